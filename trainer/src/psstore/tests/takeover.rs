//! An adaptive trainer stopped mid-task and lost: the task's next attempt, on another
//! trainer, pushes batch by batch, and every batch counts once on every shard.

use std::sync::Mutex;

use edl_pserver_client::Origin;

use super::*;
use crate::store::{InitOutcome, Position, StoreError};

/// A trainer's store over [`PsStore`] that records every origin pushed. Trainer a's
/// (`stalls`) also makes pushes take a while (a network: the adaptive pipeline sums the
/// batches computed meanwhile) and, once a push of several batches is applied, makes
/// every later push wait forever (the trainer is stopped, as by SIGSTOP, before it is
/// lost).
#[derive(Debug)]
struct Watched {
    inner: Arc<PsStore>,
    stalls: bool,
    origins: Mutex<Vec<Origin>>,
    /// The first run of several batches applied (trainer a).
    run: Mutex<Option<Origin>>,
    applied: watch::Sender<bool>,
}

impl Watched {
    fn new(inner: Arc<PsStore>, stalls: bool) -> Self {
        Watched {
            inner,
            stalls,
            origins: Mutex::new(Vec::new()),
            run: Mutex::new(None),
            applied: watch::Sender::new(false),
        }
    }
}

#[async_trait::async_trait]
impl ParamStore for Watched {
    async fn init(&self, trainer: &str, init: &ParamInit) -> Result<InitOutcome, StoreError> {
        self.inner.init(trainer, init).await
    }
    async fn pull_dense(&self, params: &mut Params) -> Result<(), StoreError> {
        self.inner.pull_dense(params).await
    }
    async fn pull_sparse(
        &self,
        rows: &[(String, Vec<u64>)],
        params: &mut Params,
    ) -> Result<(), StoreError> {
        self.inner.pull_sparse(rows, params).await
    }
    async fn push(
        &self,
        trainer: &str,
        step: u64,
        origin: Option<Origin>,
        grads: &StepOutput,
    ) -> Result<(), StoreError> {
        self.origins.lock().unwrap().extend(origin);
        self.inner.push(trainer, step, origin, grads).await
    }
    async fn push_applied(
        &self,
        trainer: &str,
        step: u64,
        origin: Option<Origin>,
        grads: StepOutput,
    ) -> Result<Position, StoreError> {
        if self.stalls {
            if *self.applied.borrow() {
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.origins.lock().unwrap().extend(origin);
        let at = self
            .inner
            .push_applied(trainer, step, origin, grads)
            .await?;
        if let Some(o) = origin.filter(|o| self.stalls && o.count > 1) {
            self.run.lock().unwrap().get_or_insert(o);
            self.applied.send_replace(true);
        }
        Ok(at)
    }
    async fn pull_current(&self, params: &mut Params) -> Result<Position, StoreError> {
        self.inner.pull_current(params).await
    }
    async fn task_done(&self, trainer: &str, task: TaskRef) -> Result<Vec<u64>, StoreError> {
        self.inner.task_done(trainer, task).await
    }
    async fn flush(&self) -> Result<(), StoreError> {
        self.inner.flush().await
    }
    fn local_updates(&self) -> Option<OptimizerConfig> {
        self.inner.local_updates()
    }
    async fn idle(&self, trainer: &str) -> Result<(), StoreError> {
        self.inner.idle(trainer).await
    }
}

/// Trainer a pushes adaptive runs of batches; once one run of several is applied, it is
/// stopped mid-task (its later pushes never arrive) and lost (its registration ends).
/// Trainer b takes the job over: the task a held comes to it as a second dispatch, which
/// it pushes batch by batch, the batches of a's applied run among them (repeats on
/// every shard). Both shards end exactly at the sum of every sample's gradient, each
/// counted once: a's run was neither lost nor counted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adaptive_trainer_lost_mid_task_leaves_every_batch_counted_once() {
    const RECORDS: u32 = 120;
    const PASSES: u32 = 2;
    let samples: Vec<Sample> = (0..RECORDS)
        .map(|k| Sample {
            version: 1,
            dense: vec![(k + 1) as f32, 0.0],
            ..Sample::default()
        })
        .collect();
    let want = -(f64::from(PASSES) * f64::from(RECORDS * (RECORDS + 1) / 2)) as f32;
    let dir = tempfile::tempdir().unwrap();
    let glob = write_dataset(dir.path(), &samples);
    let mut job = Job::new("taken-over");
    for i in 0..2 {
        job.pserver(i, TcpListener::bind("127.0.0.1:0").await.unwrap(), None);
    }
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let master = tokio::spawn(run_master(
        job.backend.clone(),
        MasterConfig::new(job.name.clone()),
        listener,
        job.stop.child_token(),
    ));
    let master_client = MasterClient::new(
        job.backend.clone(),
        MasterClientConfig::new(job.name.clone()),
        job.stop.child_token(),
    );
    // Tasks of 20 chunks (of a few samples each): dozens of batches of one sample.
    let ds = master_client
        .set_dataset(vec![glob], 20, PASSES)
        .await
        .unwrap();
    assert!(ds.tasks > 1, "several tasks: {ds:?}");
    let config = ParamConfig {
        block_size: 128,
        ..ParamConfig::new(Mode::Async, OptimizerConfig::sgd(1.0))
    };
    let start = |id: &'static str, store: Arc<dyn ParamStore>| {
        let mut cfg = RuntimeConfig::new(id);
        cfg.batch_size = 1;
        let (tx, _rx) = watch::channel(Progress::default());
        tokio::spawn(run(
            CloudReader::start(master_client.clone(), ReaderConfig::new(id)),
            Arc::new(KnownGrad),
            store,
            cfg,
            job.stop.child_token(),
            tx,
        ))
    };
    let a_store = Arc::new(Watched::new(job.store(&config).await, true));
    let mut applied_rx = a_store.applied.subscribe();
    let a_lease = job.register("a").await;
    let a = start("a", a_store.clone());
    tokio::time::timeout(Duration::from_secs(30), applied_rx.wait_for(|&x| x))
        .await
        .expect("a pushes a run of several batches within 30 s")
        .unwrap();
    // a is stopped (its later pushes hang) and then lost.
    a.abort();
    a_lease.revoke().await.unwrap();
    let run_of_a = a_store.run.lock().unwrap().expect("set with the flag");

    let b_store = Arc::new(Watched::new(job.store(&config).await, false));
    let _b_lease = job.register("b").await;
    let p = tokio::time::timeout(Duration::from_secs(60), start("b", b_store.clone()))
        .await
        .expect("b finishes the job")
        .unwrap()
        .expect("b does not fail");
    // Witness: b trained a's task again (a second dispatch: batch by batch), its
    // batches in a's applied run among them.
    let origins = b_store.origins.lock().unwrap().clone();
    let again: Vec<&Origin> = origins
        .iter()
        .filter(|o| (o.pass, o.task) == (run_of_a.pass, run_of_a.task))
        .collect();
    assert!(again.iter().all(|o| o.count == 1), "{again:?}");
    for b in run_of_a.seq..run_of_a.seq + run_of_a.count {
        assert!(
            again.iter().any(|o| o.seq == b),
            "batch {b} of {run_of_a:?}: {again:?}"
        );
    }
    let st = master_client.status().await.unwrap();
    assert!(st.finished);
    let c = st.counters.unwrap();
    assert!(c.trainer_lost >= 1, "{c:?}");
    assert!(p.records > 0);
    // Every sample's gradient once per pass, on both shards.
    let ps = job.client().await;
    let mut cache = DenseCache::new();
    ps.pull_dense(&mut cache).await.unwrap();
    let w = cache.get("w").unwrap();
    assert!(
        w.iter().all(|&v| v == want),
        "want {want} everywhere: shard 0 {:?}, shard 1 {:?}",
        &w[..2],
        &w[128..130]
    );
    job.stop.cancel();
    master.await.unwrap().unwrap();
    job.shut_down().await;
}
