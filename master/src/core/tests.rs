//! The actor on the in-memory backend (and on a real etcd where the issue is what etcd
//! returns), driven through its handle (no gRPC, no followers: the test delivers what
//! the followers would, when it chooses).

use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, Fence, MemBackend};
use edl_job::{JobKeys, JobName, RECORD_VERSION, Record, RestoreRecord};
use edl_master_client::Answer;
use tokio_util::sync::CancellationToken;

use super::Core;
use crate::dataset::DatasetSpec;
use crate::queue::QueueConfig;
use crate::store::Store;
use crate::testing::dataset;

/// A leading master's actor for job `job` on `backend` with `cfg`, running until the
/// guard drops, and its handle.
pub(crate) async fn started(
    backend: &Arc<dyn Backend>,
    job: &str,
    cfg: QueueConfig,
) -> (super::CoreHandle, tokio_util::sync::DropGuard) {
    let keys = JobKeys::new(&JobName::new(job).unwrap());
    let key = format!("{}master/election/x", keys.root());
    let revision = backend.put(&key, b"x".to_vec(), None).await.unwrap();
    let store = Store::new(backend.clone(), keys.clone(), Fence { key, revision });
    let (core, handle) = Core::start(store, cfg, 10).await.unwrap();
    let cancel = CancellationToken::new();
    tokio::spawn(core.run(cancel.clone()));
    (handle, cancel.drop_guard())
}

/// Defines a dataset of `glob` (a task a chunk) for `passes` passes through `handle`.
pub(crate) async fn define(handle: &super::CoreHandle, glob: String, passes: u32) {
    handle
        .set_dataset(DatasetSpec {
            globs: vec![glob],
            chunks_per_task: 1,
            records_per_task: 0,
            min_records_per_task: 0,
            passes,
        })
        .await
        .unwrap();
}

/// A restore of shard `shard` at `incarnation` holding nothing: a shard's first start.
fn first_start(shard: u32, incarnation: u64) -> RestoreRecord {
    RestoreRecord {
        version: RECORD_VERSION,
        shard,
        incarnation,
        step: 0,
        contains: Default::default(),
        at_ms: 0,
    }
}

/// A pserver publishes its restore before it serves, so the record is in etcd before any
/// acknowledgement through its incarnation; the follower may deliver it much later
/// (here: after two passes trained on it, as when it came before the dataset existed and
/// was dropped, then was sent again with another shard's restore). It is applied before
/// the first such acknowledgement, so its late delivery changes nothing (before, it took
/// the queue back to pass 0: the whole job trained again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_is_applied_before_any_acknowledgement_through_its_incarnation() {
    restore_before_its_acknowledgements(Arc::new(MemBackend::new())).await;
}

/// The same on a real etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_is_applied_before_any_acknowledgement_on_real_etcd() {
    let etcd = edl_testkit::EtcdCluster::start(1)
        .await
        .expect("start etcd");
    restore_before_its_acknowledgements(etcd.connect().await.expect("connect to etcd")).await;
}

async fn restore_before_its_acknowledgements(backend: Arc<dyn Backend>) {
    let keys = JobKeys::new(&JobName::new("core").unwrap());
    let key = format!("{}master/election/x", keys.root());
    let revision = backend.put(&key, b"x".to_vec(), None).await.unwrap();
    let store = Store::new(backend.clone(), keys.clone(), Fence { key, revision });
    // Shard 0 started (incarnation 9, nothing held) before the master had a dataset.
    let record = first_start(0, 9);
    backend
        .put(&keys.restore(0), record.encode(), None)
        .await
        .unwrap();
    let (core, handle) = Core::start(store, QueueConfig::default(), 10)
        .await
        .unwrap();
    let cancel = CancellationToken::new();
    let _stop = cancel.clone().drop_guard();
    tokio::spawn(core.run(cancel));
    let dir = tempfile::tempdir().unwrap();
    let glob = dataset(dir.path(), 1, 20);
    define(&handle, glob, 3).await;
    // Passes 0 and 1 trained through incarnation 9 of shard 0.
    let mut request = 0;
    loop {
        let pass = handle.status().await.unwrap().pass;
        if pass == 2 {
            break;
        }
        request += 1;
        match handle
            .get_task("t".into(), pass, request, Duration::ZERO)
            .await
            .unwrap()
        {
            Answer::Task(t) => {
                let applied = handle
                    .finished(t.id, t.generation, t.records, vec![9])
                    .await
                    .unwrap();
                assert!(applied);
            }
            Answer::PassFinished(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    // The follower delivers the record only now.
    handle.restored(vec![record]).await;
    let st = handle.status().await.unwrap();
    assert_eq!(st.pass, 2, "not taken back: {st:?}");
    assert_eq!(st.counters.recomputed, 0, "{st:?}");
}

/// Fills `backend` with live data to the last few bytes: values of 64 KiB, then 1 KiB,
/// then 8 bytes, the space freed before each (so no older version is left to free).
async fn fill_live(backend: &Arc<dyn Backend>, prefix: &str) {
    for (stage, size) in [64 << 10, 1 << 10, 8].into_iter().enumerate() {
        backend.free_space().await.unwrap();
        let n =
            edl_testkit::fill_until_full(backend, &format!("{prefix}{stage}/"), size, true).await;
        assert!(size < 64 << 10 || n >= 4, "only {n} values fit");
    }
}

/// Takes one task of the current pass (the pass advances as needed).
async fn lease_one(handle: &super::CoreHandle, request: &mut u64) -> edl_master_client::LeasedTask {
    loop {
        let pass = handle.status().await.unwrap().pass;
        *request += 1;
        match handle
            .get_task("t".into(), pass, *request, Duration::ZERO)
            .await
            .unwrap()
        {
            Answer::Task(t) => return t,
            Answer::PassFinished(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// A full etcd pauses the queue, and training goes on once it has space, losing
/// nothing. When the store is full of history, the master frees it itself (compaction)
/// and goes on at once; when it is full of live data, every call but `Status` is refused
/// with `EtcdFull`, the status says the job is paused and what to do, and the queue is
/// served again once the data is deleted and the space freed (as an operator would).
/// Every record is trained exactly once per pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_etcd_pauses_the_queue_and_training_goes_on_once_it_has_space() {
    use crate::error::MasterError;
    const PASSES: u32 = 2;
    let backend: Arc<dyn Backend> = Arc::new(MemBackend::new().with_quota(2_000_000));
    let (handle, _stop) = started(&backend, "full", QueueConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    define(&handle, dataset(dir.path(), 2, 20), PASSES).await;
    let mut request = 0;

    // Full of history: the acknowledgement is refused once, then the master has freed
    // the space itself.
    let t = lease_one(&handle, &mut request).await;
    assert!(edl_testkit::fill_until_full(&backend, "/other/history", 64 << 10, false).await >= 4);
    let ack = || handle.finished(t.id.clone(), t.generation, t.records, vec![]);
    assert!(matches!(ack().await, Err(MasterError::EtcdFull(_))));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let applied = loop {
        match ack().await {
            Ok(applied) => break applied,
            Err(MasterError::EtcdFull(_)) => {}
            Err(e) => panic!("{e}"),
        }
        assert!(tokio::time::Instant::now() < deadline, "still paused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(applied);

    // Full of live data: paused until it is deleted and the space freed.
    let t = lease_one(&handle, &mut request).await;
    let before = handle.status().await.unwrap();
    fill_live(&backend, "/other/data/").await;
    let ack = || handle.finished(t.id.clone(), t.generation, t.records, vec![]);
    match ack().await {
        Err(MasterError::EtcdFull(why)) => assert!(why.contains("--quota-backend-bytes"), "{why}"),
        other => panic!("{other:?}"),
    }
    let st = handle.status().await.unwrap();
    let why = st
        .paused
        .clone()
        .expect("the status says the job is paused");
    assert!(why.contains("alarm disarm"), "{why}");
    assert_eq!(
        st.counts.done, before.counts.done,
        "the refused ack is not applied"
    );
    assert!(matches!(
        handle
            .get_task("u".into(), st.pass, 1, Duration::ZERO)
            .await,
        Err(MasterError::EtcdFull(_))
    ));
    // Still paused after the master's own attempts (it frees etcd's space at once, and
    // writes its probe every second): compaction cannot free live data.
    let since = tokio::time::Instant::now();
    while since.elapsed() < 3 * super::space::PROBE_EVERY {
        assert!(handle.status().await.unwrap().paused.is_some());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    backend.delete_prefix("/other/").await.unwrap();
    backend.free_space().await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while handle.status().await.unwrap().paused.is_some() {
        assert!(tokio::time::Instant::now() < deadline, "still paused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ack().await.unwrap());

    // The rest of the job: every record once per pass.
    loop {
        let st = handle.status().await.unwrap();
        if st.finished {
            assert_eq!(
                st.counters.records_trained,
                u64::from(PASSES) * 40,
                "{st:?}"
            );
            assert_eq!(st.counters.duplicate_records, 0, "{st:?}");
            assert_eq!(st.counters.lost_records, 0, "{st:?}");
            assert_eq!(st.counters.passes_completed, u64::from(PASSES), "{st:?}");
            break;
        }
        request += 1;
        match handle
            .get_task("t".into(), st.pass, request, Duration::ZERO)
            .await
            .unwrap()
        {
            Answer::Task(t) => {
                assert!(
                    handle
                        .finished(t.id, t.generation, t.records, vec![])
                        .await
                        .unwrap()
                );
            }
            Answer::PassFinished(_) | Answer::JobFinished => {}
            Answer::Wait => panic!("a task is held: {st:?}"),
        }
    }
}

/// A trainer that holds a task past its lease's timeout while staying registered is
/// named stuck in the status, with its task, which is handed out again; the name goes
/// when its registration does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_silent_past_the_task_timeout_is_named_stuck_until_it_is_lost() {
    let backend: Arc<dyn Backend> = Arc::new(MemBackend::new());
    let mut cfg = QueueConfig::default();
    cfg.timeout.initial = 300;
    cfg.timeout.floor = 300;
    let (handle, _stop) = started(&backend, "stuck", cfg).await;
    let dir = tempfile::tempdir().unwrap();
    define(&handle, dataset(dir.path(), 1, 2), 1).await;
    let Answer::Task(held) = handle
        .get_task("hung".into(), 0, 1, Duration::ZERO)
        .await
        .unwrap()
    else {
        panic!("no task")
    };
    assert!(handle.status().await.unwrap().stuck.is_empty());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let stuck = loop {
        let st = handle.status().await.unwrap();
        if !st.stuck.is_empty() {
            break st.stuck;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never named stuck: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(stuck.len(), 1, "{stuck:?}");
    assert_eq!(
        (stuck[0].trainer.as_str(), &stuck[0].task),
        ("hung", &held.id)
    );
    assert!(stuck[0].held_ms >= 300, "{stuck:?}");
    // Its task is handed out again, to another trainer.
    let Answer::Task(again) = handle
        .get_task("t2".into(), 0, 1, Duration::ZERO)
        .await
        .unwrap()
    else {
        panic!("the task was not handed out again")
    };
    assert_eq!(again.id, held.id);
    handle.trainers_lost(vec!["hung".into()]).await;
    let st = handle.status().await.unwrap();
    assert!(st.stuck.is_empty(), "{st:?}");
}
