//! The elastic loop end to end in one process: the in-memory coordination backend, a real
//! master over loopback gRPC, trainers sharing a [`LocalStore`], real data in RecordIO.

use std::sync::Arc;
use std::time::Duration;

use crate::tasks::{CloudReader, ReaderConfig};
use edl_coord::{Backend, Lease, MemBackend};
use edl_job::{JobKeys, JobName};
use edl_master::{MasterConfig, run as run_master};
use edl_master_client::{MasterClient, MasterClientConfig};
use edl_recordio::{FileWriter, WriterOptions};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::model::MetricKind;
use crate::progress::Progress;
use crate::runtime::{PerPush, RuntimeConfig, run};
use crate::store::LocalStore;
use crate::testdata::{boston, split_every};
use crate::{ModelSpec, OptimizerKind, build};

mod resume;
mod sole;
mod taken_away;

fn write_shards(
    dir: &std::path::Path,
    samples: &[edl_proto::sample::Sample],
    shards: usize,
) -> String {
    let mut writers: Vec<FileWriter> = (0..shards)
        .map(|i| {
            FileWriter::create(
                dir.join(format!("train-{i:05}.recordio")),
                WriterOptions {
                    max_chunk_bytes: 2048,
                    ..WriterOptions::default()
                },
            )
            .unwrap()
        })
        .collect();
    for (i, s) in samples.iter().enumerate() {
        writers[i % shards]
            .write(&edl_proto::sample::encode(s))
            .unwrap();
    }
    for w in writers {
        w.finish().unwrap();
    }
    format!("{}/train-*.recordio", dir.display())
}

/// Registers a trainer as the runtime's caller does: the master revokes the tasks of
/// holders that are not registered.
async fn register(
    backend: &Arc<dyn Backend>,
    job: &str,
    id: &str,
    stop: &CancellationToken,
) -> Lease {
    edl_testkit::register_trainer(
        backend,
        JobKeys::new(&JobName::new(job).unwrap()).trainers(),
        id,
        Duration::from_secs(5),
        stop.child_token(),
    )
    .await
}

/// Two trainers fit a line through a real master, pushing every batch or the sums of
/// groups of 3 batches (`batches_per_push`): every record trained once, one trainer
/// initialises, the test cost falls near the optimum. Returns the steps pushed and the
/// tasks trained.
async fn two_elastic_trainers_fit_a_line_through_the_master(per_push: PerPush) -> (u64, u64) {
    let dir = tempfile::tempdir().unwrap();
    let (train, test) = split_every(&boston(), 5);
    let glob = write_shards(dir.path(), &train, 3);
    let backend: Arc<dyn Backend> = Arc::new(MemBackend::new());
    let stop = CancellationToken::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let master = tokio::spawn(run_master(
        backend.clone(),
        MasterConfig::new(JobName::new("line").unwrap()),
        listener,
        stop.child_token(),
    ));
    let client = MasterClient::new(
        backend.clone(),
        MasterClientConfig::new(JobName::new("line").unwrap()),
        stop.child_token(),
    );
    let passes = 30;
    let ds = client.set_dataset(vec![glob], 1, passes).await.unwrap();
    assert_eq!(ds.records, train.len() as u64);

    let mut spec = ModelSpec::FitALine {
        standardize: true,
        stats: None,
    };
    spec.fit_stats(&train).unwrap();
    let model: Arc<dyn crate::Model> = Arc::from(build(&spec).unwrap());
    let store = Arc::new(LocalStore::new(
        model.clone(),
        OptimizerKind::sgd(),
        0.01,
        7,
    ));
    let test: Arc<Vec<Vec<u8>>> = Arc::new(test.iter().map(edl_proto::sample::encode).collect());
    let mut handles = Vec::new();
    let mut leases = Vec::new();
    for t in 0..2 {
        let id = format!("trainer-{t}");
        leases.push(register(&backend, "line", &id, &stop).await);
        let reader = CloudReader::start(client.clone(), ReaderConfig::new(&id));
        let mut cfg = RuntimeConfig::new(&id);
        cfg.batch_size = 20;
        cfg.seed = 7;
        cfg.test = (t == 0).then(|| test.clone());
        cfg.batches_per_push = per_push;
        let (tx, _rx) = watch::channel(Progress::default());
        handles.push(tokio::spawn(run(
            reader,
            model.clone(),
            store.clone(),
            cfg,
            stop.child_token(),
            tx,
        )));
    }
    let mut records = 0;
    let mut initialised = 0;
    let mut evals = Vec::new();
    let (mut steps, mut tasks) = (0, 0);
    for h in handles {
        let p = tokio::time::timeout(Duration::from_secs(120), h)
            .await
            .expect("trainers finish")
            .unwrap()
            .unwrap();
        records += p.records;
        steps += p.steps;
        tasks += p.tasks;
        initialised += usize::from(p.initialised);
        assert!(!p.drained);
        if !p.evals.is_empty() {
            evals = p.evals;
        }
    }
    assert_eq!(initialised, 1, "exactly one trainer initialises");
    assert_eq!(records, train.len() as u64 * u64::from(passes));
    assert_eq!(
        evals.len(),
        passes as usize,
        "one evaluation per finished pass, the last at the end of the job"
    );
    assert_eq!(evals.last().map(|e| e.0), Some(passes - 1));
    let (first, last) = (evals[0].2, evals[evals.len() - 1].2);
    assert_eq!(evals[0].1, MetricKind::Cost);
    assert!(last < first, "test cost falls: {first} -> {last}");
    // Near the least-squares optimum on this split (about 20.2): SGD at this rate settles
    // within about 17% of it (23.6 from pass 20 on, short batches weighing their part of
    // a full one; 23.4 when they weighed as much as a full one).
    assert!(last < 24.0, "test cost {last}");
    let st = client.status().await.unwrap();
    assert!(st.finished);
    assert_eq!(st.counters.unwrap().records_trained, records);
    stop.cancel();
    master.await.unwrap().unwrap();
    (steps, tasks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_elastic_trainers_fit_a_line_through_the_master_pushing_every_batch_or_groups() {
    let (batches, tasks) =
        two_elastic_trainers_fit_a_line_through_the_master(PerPush::Fixed(1)).await;
    let (groups, tasks_again) =
        two_elastic_trainers_fit_a_line_through_the_master(PerPush::Fixed(3)).await;
    assert_eq!(tasks, tasks_again);
    // A push per group of 3 batches of a task: at least a third of the batches, and at
    // most one more per task (its last group may be short).
    assert!(
        groups * 3 >= batches && groups <= batches.div_ceil(3) + tasks,
        "{groups} pushes of groups for {batches} batches in {tasks} tasks"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_trainer_hands_its_task_back_and_another_finishes_the_pass() {
    let dir = tempfile::tempdir().unwrap();
    let all = boston();
    let glob = write_shards(dir.path(), &all, 2);
    let backend: Arc<dyn Backend> = Arc::new(MemBackend::new());
    let stop = CancellationToken::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let master = tokio::spawn(run_master(
        backend.clone(),
        MasterConfig::new(JobName::new("drain").unwrap()),
        listener,
        stop.child_token(),
    ));
    let client = MasterClient::new(
        backend.clone(),
        MasterClientConfig::new(JobName::new("drain").unwrap()),
        stop.child_token(),
    );
    client.set_dataset(vec![glob], 1, 3).await.unwrap();
    let mut spec = ModelSpec::FitALine {
        standardize: true,
        stats: None,
    };
    spec.fit_stats(&all).unwrap();
    let model: Arc<dyn crate::Model> = Arc::from(build(&spec).unwrap());
    let store = Arc::new(LocalStore::new(
        model.clone(),
        OptimizerKind::sgd(),
        0.01,
        1,
    ));

    let leaving_lease = register(&backend, "drain", "leaving", &stop).await;
    let _l2 = register(&backend, "drain", "staying", &stop).await;
    // The first trainer drains as soon as it has trained a few steps.
    let drain = CancellationToken::new();
    let (tx, mut rx) = watch::channel(Progress::default());
    let mut cfg = RuntimeConfig::new("leaving");
    cfg.batch_size = 4;
    let leaving = tokio::spawn(run(
        CloudReader::start(client.clone(), ReaderConfig::new("leaving")),
        model.clone(),
        store.clone(),
        cfg,
        drain.clone(),
        tx,
    ));
    rx.wait_for(|p| p.tasks >= 2).await.unwrap();
    drain.cancel();
    let p = tokio::time::timeout(Duration::from_secs(30), leaving)
        .await
        .expect("a draining trainer stops within its grace period")
        .unwrap()
        .unwrap();
    assert!(p.drained);
    // As `edl trainer` does after draining: deregister.
    leaving_lease.revoke().await.unwrap();
    let (tx, _rx) = watch::channel(Progress::default());
    let stayer = tokio::time::timeout(
        Duration::from_secs(120),
        run(
            CloudReader::start(client.clone(), ReaderConfig::new("staying")),
            model.clone(),
            store.clone(),
            RuntimeConfig::new("staying"),
            stop.child_token(),
            tx,
        ),
    )
    .await
    .expect("the remaining trainer finishes the job")
    .unwrap();
    assert!(!stayer.drained);
    let st = client.status().await.unwrap();
    assert!(st.finished);
    let c = st.counters.unwrap();
    assert_eq!(c.failures, 0, "a hand-back is not a failure: {c:?}");
    assert_eq!(
        c.trainer_lost, 0,
        "nothing was left leased to the drained trainer: {c:?}"
    );
    assert_eq!(c.records_trained, 3 * all.len() as u64);
    assert_eq!(p.records + stayer.records, c.records_trained);
    stop.cancel();
    master.await.unwrap().unwrap();
}

/// A fit-a-line job on a real master over the in-memory backend: the training split in
/// 3 files of small chunks, `passes` passes.
struct LineJob {
    _dir: tempfile::TempDir,
    train: Vec<edl_proto::sample::Sample>,
    backend: Arc<dyn Backend>,
    stop: CancellationToken,
    master: tokio::task::JoinHandle<Result<(), edl_master::MasterError>>,
    client: MasterClient,
}

impl LineJob {
    async fn start(name: &str, passes: u32) -> LineJob {
        Self::start_with(name, passes, 1).await
    }

    /// [`LineJob::start`] with tasks of `chunks` chunks each.
    async fn start_with(name: &str, passes: u32, chunks: u32) -> LineJob {
        let dir = tempfile::tempdir().unwrap();
        let (train, _) = split_every(&boston(), 5);
        let glob = write_shards(dir.path(), &train, 3);
        let backend: Arc<dyn Backend> = Arc::new(MemBackend::new());
        let stop = CancellationToken::new();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let master = tokio::spawn(run_master(
            backend.clone(),
            MasterConfig::new(JobName::new(name).unwrap()),
            listener,
            stop.child_token(),
        ));
        let client = MasterClient::new(
            backend.clone(),
            MasterClientConfig::new(JobName::new(name).unwrap()),
            stop.child_token(),
        );
        client
            .set_dataset(vec![glob], chunks, passes)
            .await
            .unwrap();
        LineJob {
            _dir: dir,
            train,
            backend,
            stop,
            master,
            client,
        }
    }

    /// Stops the master (it must end cleanly).
    async fn finish(self) {
        self.stop.cancel();
        self.master.await.unwrap().unwrap();
    }
}

/// A [`LocalStore`] that does not let trainers update locally: the runtime takes the
/// per-group loop. `on_push`, if any, sees each push's origin once it is applied.
struct PerGroup(LocalStore, Option<OnPush>);

/// What [`PerGroup`] calls after each push.
type OnPush = Box<dyn Fn(Option<edl_pserver_client::Origin>) + Send + Sync>;

impl std::fmt::Debug for PerGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PerGroup")
            .field(&self.0)
            .finish_non_exhaustive()
    }
}

#[async_trait::async_trait]
impl crate::store::ParamStore for PerGroup {
    async fn init(
        &self,
        trainer: &str,
        params: &crate::store::ParamInit,
    ) -> Result<crate::store::InitOutcome, crate::store::StoreError> {
        self.0.init(trainer, params).await
    }
    async fn pull_dense(
        &self,
        params: &mut crate::model::Params,
    ) -> Result<(), crate::store::StoreError> {
        self.0.pull_dense(params).await
    }
    async fn pull_sparse(
        &self,
        rows: &[(String, Vec<u64>)],
        params: &mut crate::model::Params,
    ) -> Result<(), crate::store::StoreError> {
        self.0.pull_sparse(rows, params).await
    }
    async fn push(
        &self,
        trainer: &str,
        step: u64,
        origin: Option<edl_pserver_client::Origin>,
        grads: &crate::model::StepOutput,
    ) -> Result<(), crate::store::StoreError> {
        self.0.push(trainer, step, origin, grads).await?;
        if let Some(f) = &self.1 {
            f(origin);
        }
        Ok(())
    }
}

/// One trainer fits a line through a real master, with `store` (and `batches_per_push`);
/// the final parameters.
async fn one_trainer_fits_a_line(
    store: Arc<dyn crate::store::ParamStore>,
    local: &LocalStore,
    per_push: PerPush,
) -> Vec<Vec<f32>> {
    alone_on_a_line(store, local, per_push, 1).await.0
}

/// [`one_trainer_fits_a_line`] with tasks of `chunks` chunks: the final parameters and
/// the trainer's progress.
async fn alone_on_a_line(
    store: Arc<dyn crate::store::ParamStore>,
    local: &LocalStore,
    per_push: PerPush,
    chunks: u32,
) -> (Vec<Vec<f32>>, Progress) {
    let job = LineJob::start_with("one", 5, chunks).await;
    let (train, backend, stop, client) = (
        job.train.clone(),
        job.backend.clone(),
        job.stop.clone(),
        job.client.clone(),
    );
    let model = line_model(&train);
    let _lease = register(&backend, "one", "only", &stop).await;
    let mut cfg = RuntimeConfig::new("only");
    cfg.batch_size = 8;
    cfg.seed = 3;
    cfg.batches_per_push = per_push;
    let (tx, _rx) = watch::channel(Progress::default());
    let reader = CloudReader::start(client.clone(), ReaderConfig::new("only"));
    let p = tokio::time::timeout(
        Duration::from_secs(120),
        run(reader, model, store, cfg, stop.child_token(), tx),
    )
    .await
    .expect("the trainer finishes")
    .unwrap();
    assert_eq!(p.records, 5 * train.len() as u64);
    job.finish().await;
    (local.snapshot().await.expect("initialised").dense, p)
}

fn line_model(train: &[edl_proto::sample::Sample]) -> Arc<dyn crate::Model> {
    let mut spec = ModelSpec::FitALine {
        standardize: true,
        stats: None,
    };
    spec.fit_stats(train).unwrap();
    Arc::from(build(&spec).unwrap())
}

/// With plain SGD the pipeline's local updates are exact: one trainer through it, with a
/// push per batch, per group of 3 or adaptive, ends where the per-group loop with a push per
/// batch ends (every batch computed on parameters holding every earlier one: plain
/// SGD), up to rounding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trainer_through_the_pipeline_ends_where_the_per_group_loop_ends() {
    let (train, _) = split_every(&boston(), 5);
    for per_push in [PerPush::Fixed(1), PerPush::Fixed(3), PerPush::Adaptive] {
        let store = |seed| LocalStore::new(line_model(&train), OptimizerKind::sgd(), 0.01, seed);
        let piped = store(3);
        assert!(
            crate::runtime::local_updates(&piped, line_model(&train).as_ref())
                .unwrap()
                .is_some(),
            "witness: this store and model take the pipeline"
        );
        let inner = store(3);
        let per_group = PerGroup(inner.clone(), None);
        assert!(
            crate::runtime::local_updates(&per_group, line_model(&train).as_ref())
                .unwrap()
                .is_none()
        );
        let a = one_trainer_fits_a_line(Arc::new(piped.clone()), &piped, per_push).await;
        // Per batch (the pipeline sums a group's batches after applying each locally).
        let b = one_trainer_fits_a_line(Arc::new(per_group), &inner, PerPush::Fixed(1)).await;
        assert_eq!(a.len(), b.len());
        let mut moved = 0.0f32;
        for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
            assert!(
                (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                "{per_push} per push: pipeline {x} against per-group {y}"
            );
            moved = moved.max(y.abs());
        }
        // Witness: training moved the parameters (fit_a_line starts from zeros).
        assert!(moved > 0.1, "{b:?}");
    }
}

/// A [`LocalStore`] whose pushes fail from the `fail_from`th on, or whose pulls fail
/// once `fail_pulls` is set (what a store that broke for good does).
#[derive(Debug)]
struct Breaking {
    inner: LocalStore,
    pushes: std::sync::atomic::AtomicU64,
    fail_from: u64,
    fail_pulls: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl crate::store::ParamStore for Breaking {
    async fn init(
        &self,
        trainer: &str,
        params: &crate::store::ParamInit,
    ) -> Result<crate::store::InitOutcome, crate::store::StoreError> {
        self.inner.init(trainer, params).await
    }
    async fn pull_dense(
        &self,
        params: &mut crate::model::Params,
    ) -> Result<(), crate::store::StoreError> {
        if self.fail_pulls.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(crate::store::StoreError::Unavailable(
                "injected pull failure".into(),
            ));
        }
        self.inner.pull_dense(params).await
    }
    async fn pull_sparse(
        &self,
        rows: &[(String, Vec<u64>)],
        params: &mut crate::model::Params,
    ) -> Result<(), crate::store::StoreError> {
        self.inner.pull_sparse(rows, params).await
    }
    async fn push(
        &self,
        trainer: &str,
        step: u64,
        origin: Option<edl_pserver_client::Origin>,
        grads: &crate::model::StepOutput,
    ) -> Result<(), crate::store::StoreError> {
        let n = self
            .pushes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            + 1;
        if n >= self.fail_from {
            // From here on the pulls fail too (a store that is gone).
            self.fail_pulls
                .store(true, std::sync::atomic::Ordering::SeqCst);
            return Err(crate::store::StoreError::Unavailable(
                "injected push failure".into(),
            ));
        }
        self.inner.push(trainer, step, origin, grads).await
    }
    fn local_updates(&self) -> Option<edl_pserver_client::OptimizerConfig> {
        self.inner.local_updates()
    }
}

/// A store that breaks mid-job stops a trainer in the pipeline with the store's error
/// instead of hanging on a push slot, a landing or an acknowledgement (30 s is the
/// test's deadline for a hang), after the pushes before the failure were applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_breaks_stops_the_pipeline_with_its_error() {
    let job = LineJob::start("breaks", 50).await;
    let (train, backend, stop, client) = (
        job.train.clone(),
        job.backend.clone(),
        job.stop.clone(),
        job.client.clone(),
    );
    let model = line_model(&train);
    let store = Arc::new(Breaking {
        inner: LocalStore::new(model.clone(), OptimizerKind::sgd(), 0.01, 1),
        pushes: Default::default(),
        fail_from: 40,
        fail_pulls: Default::default(),
    });
    assert!(
        crate::runtime::local_updates(store.as_ref(), model.as_ref())
            .unwrap()
            .is_some(),
        "witness: the trainer takes the pipeline"
    );
    let _lease = register(&backend, "breaks", "only", &stop).await;
    let mut cfg = RuntimeConfig::new("only");
    cfg.batch_size = 8;
    let (tx, rx) = watch::channel(Progress::default());
    let reader = CloudReader::start(client.clone(), ReaderConfig::new("only"));
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        run(reader, model, store.clone(), cfg, stop.child_token(), tx),
    )
    .await
    .expect("the trainer stops instead of hanging");
    match out {
        Err(crate::RuntimeError::Store(e)) => {
            assert!(e.to_string().contains("injected push failure"), "{e}")
        }
        other => panic!("expected the store's error, got {other:?}"),
    }
    // Witness: it trained (and had tasks acknowledged) before the store broke.
    assert!(store.pushes.load(std::sync::atomic::Ordering::SeqCst) >= 40);
    assert!(rx.borrow().tasks > 0, "{:?}", rx.borrow());
    job.finish().await;
}

/// A model whose `at`th forward/backward panics (a bug in a user's model).
#[derive(Debug)]
struct Panicking {
    inner: Arc<dyn crate::Model>,
    calls: std::sync::atomic::AtomicU64,
    at: u64,
}

impl crate::Model for Panicking {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn dense_params(&self) -> Vec<crate::model::DenseParam> {
        self.inner.dense_params()
    }
    fn sparse_tables(&self) -> Vec<crate::model::SparseTable> {
        self.inner.sparse_tables()
    }
    fn init_dense(&self, seed: u64) -> Vec<Vec<f32>> {
        self.inner.init_dense(seed)
    }
    fn init_sparse_row(&self, table: &str, row: u64, seed: u64) -> Vec<f32> {
        self.inner.init_sparse_row(table, row, seed)
    }
    fn prepare_records(&self, records: &[Vec<u8>], seed: u64) -> crate::Result<crate::Batch> {
        self.inner.prepare_records(records, seed)
    }
    fn sparse_rows(&self, batch: &crate::Batch) -> Vec<(String, Vec<u64>)> {
        self.inner.sparse_rows(batch)
    }
    fn forward_backward(
        &self,
        params: &crate::model::Params,
        batch: &crate::Batch,
    ) -> crate::Result<crate::model::StepOutput> {
        let n = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        assert!(n < self.at, "{PANIC_MESSAGE} at call {n}");
        self.inner.forward_backward(params, batch)
    }
    fn evaluate(
        &self,
        params: &crate::model::Params,
        batch: &crate::Batch,
    ) -> crate::Result<crate::model::EvalOutput> {
        self.inner.evaluate(params, batch)
    }
    fn metric(&self) -> MetricKind {
        self.inner.metric()
    }
}

/// What the panicking model's panic says.
const PANIC_MESSAGE: &str = "injected model panic";

/// A model that panics on the compute thread stops the trainer with an error saying the
/// panic's message (the thread's end is noticed: nothing waits for it forever; 30 s is
/// the test's deadline for a hang).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_panics_stops_the_pipeline_with_an_error() {
    let job = LineJob::start("panics", 50).await;
    let (train, backend, stop, client) = (
        job.train.clone(),
        job.backend.clone(),
        job.stop.clone(),
        job.client.clone(),
    );
    let inner = line_model(&train);
    let store = Arc::new(LocalStore::new(
        inner.clone(),
        OptimizerKind::sgd(),
        0.01,
        1,
    ));
    let model = Arc::new(Panicking {
        inner,
        calls: Default::default(),
        at: 30,
    });
    let _lease = register(&backend, "panics", "only", &stop).await;
    let mut cfg = RuntimeConfig::new("only");
    cfg.batch_size = 8;
    let (tx, _rx) = watch::channel(Progress::default());
    let reader = CloudReader::start(client.clone(), ReaderConfig::new("only"));
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        run(reader, model.clone(), store, cfg, stop.child_token(), tx),
    )
    .await
    .expect("the trainer stops instead of hanging");
    let err = out.expect_err("a panicking model is an error");
    // The error says the compute thread panicked, and why (the panic's own message).
    assert!(err.to_string().contains("compute thread panicked"), "{err}");
    assert!(err.to_string().contains(PANIC_MESSAGE), "{err}");
    // Witness: the panic was reached.
    assert!(model.calls.load(std::sync::atomic::Ordering::SeqCst) >= 30);
    job.finish().await;
}
