//! A drained trainer hands its task back with the batches it applied, and the next
//! attempt resumes after them: every batch is trained once, in the order of a fault-free
//! run, which the final parameters match bit for bit.

use std::sync::Mutex;

use edl_pserver_client::Origin;

use super::*;

/// The per-group loop's store (every group is pulled, computed and pushed in turn) over
/// `inner`, and the origins it pushed; with `drain_at`, `drain` fires at the push of
/// that batch of the second task pushed.
fn drain_at(
    inner: LocalStore,
    drain_at: Option<u32>,
    drain: CancellationToken,
) -> (Arc<PerGroup>, Arc<Mutex<Vec<Origin>>>) {
    let origins = Arc::new(Mutex::new(Vec::<Origin>::new()));
    let seen = origins.clone();
    let on_push = move |origin: Option<Origin>| {
        let o = origin.expect("a task's push names its origin");
        let mut origins = seen.lock().expect("origins");
        origins.push(o);
        let second = origins.iter().find(|x| x.task != origins[0].task);
        if second.is_some_and(|s| s.task == o.task && Some(o.seq) == drain_at) {
            drain.cancel();
        }
    };
    (Arc::new(PerGroup(inner, Some(Box::new(on_push)))), origins)
}

/// Trains `job` with `store` as trainer `id` (batches of 8, seed 3) until the job ends
/// or `drain` fires; its progress.
async fn fit(job: &LineJob, store: Arc<PerGroup>, id: &str, drain: CancellationToken) -> Progress {
    let mut cfg = RuntimeConfig::new(id);
    cfg.batch_size = 8;
    cfg.seed = 3;
    let (tx, _rx) = watch::channel(Progress::default());
    let reader = CloudReader::start(job.client.clone(), ReaderConfig::new(id));
    let model = line_model(&job.train);
    tokio::time::timeout(
        Duration::from_secs(120),
        run(reader, model, store, cfg, drain, tx),
    )
    .await
    .expect("the trainer ends")
    .expect("the trainer trains")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_task_resumes_after_its_applied_batches_as_a_fault_free_run_would() {
    const PASSES: u32 = 2;
    // Fault-free: one trainer, tasks of two chunks (several batches of 8 each).
    let free = LineJob::start_with("free", PASSES, 2).await;
    let store = LocalStore::new(line_model(&free.train), OptimizerKind::sgd(), 0.01, 3);
    let _only = register(&free.backend, "free", "only", &free.stop).await;
    let (only, _) = drain_at(store.clone(), None, CancellationToken::new());
    fit(&free, only, "only", CancellationToken::new()).await;
    let want = store.snapshot().await.expect("initialised").dense;
    free.finish().await;

    // The same job: the first trainer drains at the push of batch 2 of its second task,
    // then a second trainer trains the rest.
    let job = LineJob::start_with("resumed", PASSES, 2).await;
    let store = LocalStore::new(line_model(&job.train), OptimizerKind::sgd(), 0.01, 3);
    let lease = register(&job.backend, "resumed", "first", &job.stop).await;
    let drain = CancellationToken::new();
    let (first, first_pushed) = drain_at(store.clone(), Some(2), drain.clone());
    let p1 = fit(&job, first, "first", drain.clone()).await;
    assert!(p1.drained && drain.is_cancelled(), "{p1:?}");
    // Batches 0, 1 and 2 of the task: pushed, then the drain before batch 3.
    assert_eq!(p1.handed_back_trained, 3 * 8, "{p1:?}");
    let drained = *first_pushed
        .lock()
        .expect("origins")
        .last()
        .expect("pushes");
    assert_eq!(drained.seq, 2);
    lease
        .revoke()
        .await
        .expect("deregister, as a drained trainer does");
    let _second = register(&job.backend, "resumed", "second", &job.stop).await;
    let (second, second_pushed) = drain_at(store.clone(), None, CancellationToken::new());
    let p2 = fit(&job, second, "second", CancellationToken::new()).await;
    assert!(!p2.drained);

    // The second trainer's first push: the handed-back task, from batch 3 on.
    let resumed = second_pushed.lock().expect("origins")[0];
    assert_eq!((resumed.task, resumed.seq), (drained.task, 3));
    let c = job
        .client
        .status()
        .await
        .expect("status")
        .counters
        .expect("counters");
    assert_eq!((c.resumed, c.resumed_records), (1, 3 * 8), "{c:?}");
    assert_eq!((c.duplicate_records, c.failures), (0, 0), "{c:?}");
    assert_eq!(
        c.records_trained,
        u64::from(PASSES) * job.train.len() as u64
    );
    assert_eq!(
        p1.records + p1.handed_back_trained + p2.records,
        c.records_trained
    );
    // No batch trained twice, none skipped, in the fault-free order: the same values.
    let got = store.snapshot().await.expect("initialised").dense;
    assert_eq!(got, want, "the final parameters of a fault-free run");
    job.finish().await;
}
