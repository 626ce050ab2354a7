//! [`PsStore`] against in-process pservers on loopback (the in-memory coordination
//! backend): exactly-once pushes in sync mode behind a delayed shard, and batches whose
//! gradients are not finite, through the whole trainer loop.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::tasks::{CloudReader, ReaderConfig};
use candle_core::{Device, Tensor};
use edl_coord::{Backend, Lease, MemBackend};
use edl_job::{JobKeys, JobName};
use edl_master::{MasterConfig, run as run_master};
use edl_master_client::{MasterClient, MasterClientConfig};
use edl_proto::pserver::StatusResponse;
use edl_proto::sample::Sample;
use edl_pserver::{IndexChoice, PsConfig, PsError};
use edl_pserver_client::{
    DenseCache, Mode, OptimizerConfig, ParamConfig, PsClient, PsClientConfig, probe,
};
use edl_recordio::{FileWriter, WriterOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;

use super::PsStore;
use crate::model::{
    Batch, BatchData, DenseParam, EvalOutput, MetricKind, Model, Params, SparseTable, StepOutput,
    Target,
};
use crate::progress::Progress;
use crate::runtime::{RuntimeConfig, run};
use crate::store::{ParamInit, ParamStore, StoreError, TaskRef};

mod takeover;

/// Values of the one dense parameter: two blocks of 128, block 0 on shard 0, block 1 on
/// shard 1.
const N: usize = 256;
/// The value of a poisoned batch's gradient that is not finite: in shard 1's block, so
/// that shard 0's part of the push is finite.
const POISON_AT: usize = 200;

/// A test model with known gradients: one dense parameter `w` of [`N`] values, starting
/// at 0. A sample is `[value, poison]`; a batch's gradient is the sum of its samples'
/// values in every coordinate, except that a batch with a poisoned sample has a NaN
/// (poison 1) or an infinity (poison 2) at [`POISON_AT`]. The loss is always finite.
#[derive(Debug)]
struct KnownGrad;

impl Model for KnownGrad {
    fn name(&self) -> &str {
        "known_grad"
    }

    fn dense_params(&self) -> Vec<DenseParam> {
        vec![DenseParam {
            name: "w".into(),
            shape: vec![N],
        }]
    }

    fn sparse_tables(&self) -> Vec<SparseTable> {
        Vec::new()
    }

    fn init_dense(&self, _seed: u64) -> Vec<Vec<f32>> {
        vec![vec![0.0; N]]
    }

    fn init_sparse_row(&self, _table: &str, _row: u64, _seed: u64) -> Vec<f32> {
        Vec::new()
    }

    fn prepare(&self, samples: &[Sample]) -> crate::Result<Batch> {
        let mut x = Vec::with_capacity(samples.len() * 2);
        for (index, s) in samples.iter().enumerate() {
            if s.dense.len() != 2 {
                return Err(crate::Error::FeatureCount {
                    model: "known_grad",
                    index,
                    found: s.dense.len(),
                    expected: 2,
                });
            }
            x.extend_from_slice(&s.dense);
        }
        let n = samples.len();
        Ok(Batch {
            model: "known_grad",
            samples: n,
            data: BatchData::Dense {
                x: Tensor::from_vec(x, (n, 2), &Device::Cpu)?,
                target: Target::Values(Tensor::zeros(n, candle_core::DType::F32, &Device::Cpu)?),
            },
        })
    }

    fn sparse_rows(&self, _batch: &Batch) -> Vec<(String, Vec<u64>)> {
        Vec::new()
    }

    fn forward_backward(&self, _params: &Params, batch: &Batch) -> crate::Result<StepOutput> {
        let BatchData::Dense { x, .. } = &batch.data else {
            unreachable!("known_grad prepares dense batches")
        };
        let rows = x.to_vec2::<f32>()?;
        let mut g = vec![rows.iter().map(|r| r[0]).sum::<f32>(); N];
        for r in &rows {
            match r[1] as u32 {
                1 => g[POISON_AT] = f32::NAN,
                2 => g[POISON_AT] = f32::INFINITY,
                _ => {}
            }
        }
        Ok(StepOutput {
            loss: 0.5,
            examples: rows.len(),
            dense: vec![g],
            sparse: Vec::new(),
        })
    }

    fn evaluate(&self, _params: &Params, batch: &Batch) -> crate::Result<EvalOutput> {
        Ok(EvalOutput {
            loss_sum: 0.5 * batch.len() as f64,
            count: batch.len() as u64,
            correct: 0,
        })
    }

    fn metric(&self) -> MetricKind {
        MetricKind::Loss
    }
}

/// A gradient of `v` in every coordinate (one batch of [`KnownGrad`]).
fn grad(v: f32) -> StepOutput {
    StepOutput {
        loss: 0.5,
        examples: 1,
        dense: vec![vec![v; N]],
        sparse: Vec::new(),
    }
}

/// A TCP proxy on loopback in front of one pserver. It forwards both ways; while it
/// holds, what clients send waits in the proxy (the pserver's answers still flow back)
/// until it releases.
struct Proxy {
    addr: SocketAddr,
    hold: watch::Sender<bool>,
    /// Reads from clients that had to wait for a release.
    held: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (hold, gate) = watch::channel(false);
        let held = Arc::new(AtomicU64::new(0));
        let counter = held.clone();
        let accept = tokio::spawn(async move {
            // Dropped with the accept loop: every connection's pumps end with it.
            let mut pumps = JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                pumps.spawn(pump(cr, sw, Some((gate.clone(), counter.clone()))));
                pumps.spawn(pump(sr, cw, None));
            }
        });
        Proxy {
            addr,
            hold,
            held,
            accept,
        }
    }

    fn hold(&self) {
        self.hold.send_replace(true);
    }

    fn release(&self) {
        self.hold.send_replace(false);
    }

    fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Copies `from` to `to` until either side closes; with a gate, each read waits while
/// the gate holds.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut gate: Option<(watch::Receiver<bool>, Arc<AtomicU64>)>,
) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some((gate, held)) = &mut gate
            && *gate.borrow_and_update()
        {
            held.fetch_add(1, Ordering::Relaxed);
            if gate.wait_for(|h| !*h).await.is_err() {
                break;
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// A job's in-process pservers and what the trainers of a test share.
struct Job {
    name: JobName,
    backend: Arc<dyn Backend>,
    stop: CancellationToken,
    pservers: Vec<JoinHandle<Result<(), PsError>>>,
}

impl Job {
    fn new(name: &str) -> Job {
        Job {
            name: JobName::new(name).unwrap(),
            backend: Arc::new(MemBackend::new()),
            stop: CancellationToken::new(),
            pservers: Vec::new(),
        }
    }

    /// Starts the pserver of shard `index` (of 2) on `listener`, advertising `advertise`
    /// (the address clients dial) instead of the listener's when given.
    fn pserver(&mut self, index: u32, listener: TcpListener, advertise: Option<String>) {
        let mut cfg = PsConfig::new(self.name.clone());
        cfg.lease_ttl = Duration::from_secs(2);
        cfg.index = IndexChoice::Fixed(index);
        cfg.shards = Some(2);
        cfg.advertise = advertise;
        self.pservers.push(tokio::spawn(edl_pserver::run(
            self.backend.clone(),
            cfg,
            listener,
            self.stop.child_token(),
        )));
    }

    async fn client(&self) -> PsClient {
        let mut cfg = PsClientConfig::new(self.name.clone());
        cfg.retry_for = Duration::from_secs(20);
        cfg.sync_wait = Duration::from_secs(5);
        PsClient::connect(self.backend.clone(), cfg, self.stop.child_token())
            .await
            .unwrap()
    }

    async fn store(&self, config: &ParamConfig) -> Arc<PsStore> {
        Arc::new(PsStore::new(self.client().await, config.clone(), 0))
    }

    async fn register(&self, trainer: &str) -> Lease {
        edl_testkit::register_trainer(
            &self.backend,
            JobKeys::new(&self.name).trainers(),
            trainer,
            Duration::from_secs(5),
            self.stop.child_token(),
        )
        .await
    }

    /// Shard 1's pserver (the second started) loses its claim and stops; another takes
    /// the shard, with no parameters (no checkpoint), which the returned client sees.
    async fn replace_shard_1_empty(&mut self) -> PsClient {
        let keys = JobKeys::new(&self.name);
        let claim = self.backend.get(&keys.ps(1)).await.unwrap().unwrap();
        self.backend
            .lease_revoke(claim.lease.unwrap())
            .await
            .unwrap();
        let old = self.pservers.remove(1);
        let ended = tokio::time::timeout(Duration::from_secs(5), old).await;
        assert!(
            matches!(ended, Ok(Ok(Err(PsError::LeaseLost(1))))),
            "{ended:?}"
        );
        self.pserver(1, TcpListener::bind("127.0.0.1:0").await.unwrap(), None);
        let ps = self.client().await;
        // The witness: shard 1 serves again, with no parameters.
        wait_for("shard 1 served again, empty", || async {
            ps.shard_status(1).await.is_ok_and(|s| !s.initialised)
        })
        .await;
        ps
    }

    /// The status of every shard (through etcd and the proxies, if any).
    async fn status(&self, ps: &PsClient) -> Vec<StatusResponse> {
        ps.status().await.into_iter().map(|s| s.unwrap()).collect()
    }

    /// Stops the pservers and checks that they ended cleanly.
    async fn shut_down(mut self) {
        self.stop.cancel();
        for p in std::mem::take(&mut self.pservers) {
            p.await.unwrap().unwrap();
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Sync mode: a shard restored with nothing (its pserver replaced, no checkpoint) is
/// initialised again by a trainer's push: the push finds it empty, pulls (which
/// initialises it from the initial values) and pushes again. Before, the push waited
/// for another call's pull, which in a sync job no trainer makes before its push
/// returns: the job stalled until the client gave up (60 s), which the stuck trainers'
/// restarts used to hide. The task pushed before the loss is to be trained again
/// (its acknowledgement says `Rewound`), and leaving the empty shard's steps is no
/// error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_push_to_a_shard_that_lost_its_parameters_initialises_it_again() {
    let bind = || async { TcpListener::bind("127.0.0.1:0").await.unwrap() };
    let mut job = Job::new("reinit");
    job.pserver(0, bind().await, None);
    job.pserver(1, bind().await, None);
    let config = ParamConfig {
        block_size: 128,
        ..ParamConfig::new(
            Mode::Sync {
                step_timeout_ms: 5000,
            },
            OptimizerConfig::sgd(1.0),
        )
    };
    let a = job.store(&config).await;
    let _la = job.register("a").await;
    a.init("a", &ParamInit::of(&KnownGrad, 0)).await.unwrap();
    let mut pa = Params::default();
    a.pull_dense(&mut pa).await.unwrap();
    let task = |index| TaskRef {
        pass: 0,
        index,
        tasks: 2,
    };
    a.push("a", 0, Some(task(0).batch(0)), &grad(1.0))
        .await
        .unwrap();
    job.replace_shard_1_empty().await;
    let done = a.task_done("a", task(0)).await;
    assert!(matches!(done, Err(StoreError::Rewound(_))), "{done:?}");
    a.idle("a").await.unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        a.push("a", 0, Some(task(1).batch(0)), &grad(1.0)),
    )
    .await
    .expect("the push returns")
    .unwrap();
    // Shard 0 applied both steps (block 0: -2); shard 1 started again from the initial
    // values and applied the second (block 1: -1).
    a.pull_dense(&mut pa).await.unwrap();
    let w = &pa.dense[0];
    assert!(
        w[..128].iter().all(|v| *v == -2.0) && w[128..].iter().all(|v| *v == -1.0),
        "{w:?}"
    );
}

/// A sparse pull from a shard restored with nothing initialises it first (a dense pull
/// from the initial values) instead of failing the trainer, which then had to restart to
/// initialise it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sparse_pull_from_a_shard_that_lost_its_parameters_initialises_it_again() {
    let bind = || async { TcpListener::bind("127.0.0.1:0").await.unwrap() };
    let mut job = Job::new("reinit-rows");
    job.pserver(0, bind().await, None);
    job.pserver(1, bind().await, None);
    let config = ParamConfig {
        block_size: 128,
        ..ParamConfig::new(Mode::Async, OptimizerConfig::sgd(1.0))
    };
    let a = job.store(&config).await;
    let init = ParamInit {
        sparse: vec![crate::model::SparseTable {
            name: "emb".into(),
            rows: 100,
            dim: 4,
            init: crate::model::SparseInit::Zeros,
        }],
        ..ParamInit::of(&KnownGrad, 0)
    };
    a.init("a", &init).await.unwrap();
    let mut pa = Params::default();
    a.pull_dense(&mut pa).await.unwrap();
    // Rows of both shards (row ids are spread over the shards).
    let ids: Vec<u64> = (0..8).collect();
    assert_eq!(a.pull_rows("emb", &ids).await.unwrap(), vec![0.0; 32]);
    let ps = job.replace_shard_1_empty().await;
    let rows = tokio::time::timeout(Duration::from_secs(10), a.pull_rows("emb", &ids))
        .await
        .expect("the pull returns");
    assert_eq!(rows.unwrap(), vec![0.0; 32]);
    assert!(
        ps.shard_status(1).await.unwrap().initialised,
        "shard 1 initialised again"
    );
}

/// Waits (10 s at most) until `cond` holds; fails the test with `what` otherwise.
async fn wait_for<F, Fut>(what: &str, cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let ok =
        edl_testkit::wait_until(Duration::from_secs(10), Duration::from_millis(10), cond).await;
    assert!(ok, "timed out waiting until {what}");
}

/// Sync mode, two trainers, two shards, shard 1 behind a proxy that delays trainer a's
/// push of step 1 past the step timeout. Shard 0 applies step 1 with a's and b's
/// gradients; shard 1 closes it with b's alone, then answers a's late push `StaleStep`.
/// a's store sends the same batch to step 2: shard 1 adds it there, and shard 0, which
/// has it already, lets a sit step 2 out. Every shard ends with each gradient exactly
/// once (each step's sum divided by its contributors).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_shard_never_counts_a_trainers_gradient_twice() {
    let mut job = Job::new("delayed-shard");
    let l1 = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let direct = l1.local_addr().unwrap().to_string();
    let proxy = Proxy::start(l1.local_addr().unwrap()).await;
    job.pserver(0, TcpListener::bind("127.0.0.1:0").await.unwrap(), None);
    job.pserver(1, l1, Some(proxy.addr.to_string()));
    let config = ParamConfig {
        block_size: 128,
        ..ParamConfig::new(
            Mode::Sync {
                step_timeout_ms: 1500,
            },
            OptimizerConfig::sgd(1.0),
        )
    };
    let (a, b) = (job.store(&config).await, job.store(&config).await);
    let (_la, _lb) = (job.register("a").await, job.register("b").await);
    a.init("a", &ParamInit::of(&KnownGrad, 0)).await.unwrap();
    b.init("b", &ParamInit::of(&KnownGrad, 0)).await.unwrap();
    let ps = job.client().await;
    wait_for("both shards expect a and b", || async {
        job.status(&ps)
            .await
            .iter()
            .all(|s| s.participants == ["a", "b"])
    })
    .await;
    // Both trainers pull (step 1 is next); the connections through the proxy are open.
    let (mut pa, mut pb) = (Params::default(), Params::default());
    a.pull_dense(&mut pa).await.unwrap();
    b.pull_dense(&mut pb).await.unwrap();
    let task_a = TaskRef {
        pass: 0,
        index: 0,
        tasks: 2,
    };
    let task_b = TaskRef {
        pass: 0,
        index: 1,
        tasks: 2,
    };

    // Step 1: b's batch (gradient 2) reaches both shards.
    let b1 = {
        let b = b.clone();
        tokio::spawn(async move { b.push("b", 0, Some(task_b.batch(0)), &grad(2.0)).await })
    };
    wait_for("b's push of step 1 is on both shards", || async {
        job.status(&ps)
            .await
            .iter()
            .all(|s| s.next_step == 1 && s.contributed == ["b"])
    })
    .await;
    // a's batch (gradient 1): shard 0 gets it, shard 1's part waits in the proxy.
    proxy.hold();
    let a1 = {
        let a = a.clone();
        tokio::spawn(async move { a.push("a", 0, Some(task_a.batch(0)), &grad(1.0)).await })
    };
    let shard1 = || async {
        probe(
            &direct,
            job.name.as_str(),
            None,
            None,
            Duration::from_secs(5),
        )
        .await
        .unwrap()
    };
    wait_for("shard 0 applies step 1 with a and b", || async {
        ps.shard_status(0).await.unwrap().updates == 1
    })
    .await;
    wait_for("shard 1 times a out and applies step 1 with b", || async {
        shard1().await.updates == 1
    })
    .await;
    tokio::time::timeout(Duration::from_secs(10), b1)
        .await
        .expect("b's push of step 1 returns")
        .unwrap()
        .unwrap();
    let st1 = shard1().await;
    assert_eq!(st1.counters.unwrap().step_timeouts, 1, "{st1:?}");
    assert!(proxy.held() > 0, "a's push to shard 1 waited in the proxy");
    assert!(!a1.is_finished(), "a's push is not applied on shard 1");

    // Released: shard 1 answers a's push of step 1 `StaleStep`; a sends the batch to
    // step 2, which shard 1 opens with it (shard 0 has it and lets a sit out).
    proxy.release();
    wait_for("a's batch is in shard 1's step 2", || async {
        let st = shard1().await;
        st.next_step == 2 && st.contributed == ["a"]
    })
    .await;
    // Step 2: b's next batch (gradient 4); b pulls first, as the runtime does.
    b.pull_dense(&mut pb).await.unwrap();
    b.push("b", 0, Some(task_b.batch(1)), &grad(4.0))
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), a1)
        .await
        .expect("a's push returns once step 2 is applied")
        .unwrap()
        .unwrap();
    // Both tasks are complete on both shards (every push answered by these incarnations).
    b.task_done("b", task_b).await.unwrap();
    a.task_done("a", task_a).await.unwrap();

    // Shard 0: step 1 = (1 + 2) / 2, step 2 = 4 (b alone). Shard 1: step 1 = 2 (b
    // alone), step 2 = (1 + 4) / 2. a's gradient counted twice on shard 0 would make it
    // -1.5 - 2.5 = -4.
    let mut cache = DenseCache::new();
    ps.pull_dense(&mut cache).await.unwrap();
    let w = cache.get("w").unwrap();
    assert!(
        w[..128].iter().all(|&v| v == -5.5),
        "shard 0: {:?}",
        &w[..4]
    );
    assert!(
        w[128..].iter().all(|&v| v == -4.5),
        "shard 1: {:?}",
        &w[128..132]
    );
    // The path taken: a's store moved the push once; shard 1 refused it as stale;
    // shard 0 recognised the batch it had.
    assert_eq!(a.stats().stale_pushes.load(Ordering::Relaxed), 1);
    assert_eq!(b.stats().stale_pushes.load(Ordering::Relaxed), 0);
    let st = job.status(&ps).await;
    let (c0, c1) = (st[0].counters.unwrap(), st[1].counters.unwrap());
    assert_eq!((st[0].updates, st[1].updates), (2, 2));
    assert_eq!((c0.stale_pushes, c1.stale_pushes), (0, 1));
    assert_eq!(c0.duplicate_pushes, 1, "a's batch resent to shard 0");
    assert_eq!((c0.pushes_applied, c1.pushes_applied), (3, 3));
    assert_eq!((c0.tasks_done, c1.tasks_done), (2, 2));
    job.shut_down().await;
}

/// Writes `samples` to one RecordIO file of small chunks (several tasks); returns its
/// path.
fn write_dataset(dir: &std::path::Path, samples: &[Sample]) -> String {
    let path = dir.join("train-00000.recordio");
    let mut w = FileWriter::create(
        &path,
        WriterOptions {
            max_chunk_bytes: 64,
            ..WriterOptions::default()
        },
    )
    .unwrap();
    for s in samples {
        w.write(&edl_proto::sample::encode(s)).unwrap();
    }
    w.finish().unwrap();
    path.display().to_string()
}

/// One trainer runs the whole loop (master, tasks, [`PsStore`], two shards) on a
/// dataset where some batches have a finite loss and a NaN or infinite gradient in
/// shard 1's block only. The trainer skips those batches and finishes the job; no shard
/// applies any part of them: both shards' values are exactly the sum of the finite
/// batches' gradients, and no shard ever saw a non-finite value.
async fn non_finite_batches_are_skipped_whole(mode: Mode, name: &str) {
    let sync = mode.is_sync();
    const RECORDS: u32 = 24;
    let poison = |k: u32| match k % 5 {
        2 if k.is_multiple_of(2) => 1.0, // NaN
        2 => 2.0,                        // infinity
        _ => 0.0,
    };
    let samples: Vec<Sample> = (0..RECORDS)
        .map(|k| Sample {
            version: 1,
            dense: vec![(k + 1) as f32, poison(k)],
            ..Sample::default()
        })
        .collect();
    let skipped = (0..RECORDS).filter(|&k| poison(k) != 0.0).count() as u64;
    let want: f32 = -((0..RECORDS)
        .filter(|&k| poison(k) == 0.0)
        .map(|k| k + 1)
        .sum::<u32>() as f32);
    let dir = tempfile::tempdir().unwrap();
    let glob = write_dataset(dir.path(), &samples);
    let mut job = Job::new(name);
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
    let ds = master_client.set_dataset(vec![glob], 1, 1).await.unwrap();
    assert!(ds.tasks > 1, "several tasks: {ds:?}");
    let config = ParamConfig {
        block_size: 128,
        ..ParamConfig::new(mode, OptimizerConfig::sgd(1.0))
    };
    let store = job.store(&config).await;
    let _lease = job.register("t").await;
    let mut cfg = RuntimeConfig::new("t");
    cfg.batch_size = 1;
    let (tx, _rx) = watch::channel(Progress::default());
    let p = tokio::time::timeout(
        Duration::from_secs(60),
        run(
            CloudReader::start(master_client.clone(), ReaderConfig::new("t")),
            Arc::new(KnownGrad),
            store.clone(),
            cfg,
            job.stop.child_token(),
            tx,
        ),
    )
    .await
    .expect("the trainer finishes the job")
    .expect("the trainer does not fail");
    assert!(!p.drained);
    assert_eq!(p.skipped_batches, skipped);
    let pushed = u64::from(RECORDS) - skipped;
    if sync {
        assert_eq!(p.steps, pushed, "a push per batch pushed");
    } else {
        // Adaptive runs of batches (skipped ones inside a run count as seen), each
        // applied whole: the values below are exactly the finite batches' sum.
        assert!((1..=pushed).contains(&p.steps), "{} pushes", p.steps);
    }
    assert_eq!(
        p.records,
        u64::from(RECORDS),
        "skipped batches count as seen"
    );
    assert_eq!(p.tasks, ds.tasks);
    let st = master_client.status().await.unwrap();
    assert!(st.finished);
    assert_eq!(st.counters.unwrap().records_trained, u64::from(RECORDS));
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
    for s in job.status(&ps).await {
        let c = s.counters.unwrap();
        assert_eq!(
            c.nonfinite_rejected, 0,
            "shard {}: nothing non-finite",
            s.shard
        );
        assert_eq!(c.invalid_rejected, 0, "shard {}", s.shard);
        assert_eq!(c.pushes_applied, p.steps, "shard {}", s.shard);
    }
    job.stop.cancel();
    master.await.unwrap().unwrap();
    job.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_batches_with_non_finite_gradients_are_skipped_and_no_shard_applies_a_part() {
    non_finite_batches_are_skipped_whole(Mode::Async, "nonfinite-async").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_batches_with_non_finite_gradients_are_skipped_and_no_shard_applies_a_part() {
    non_finite_batches_are_skipped_whole(Mode::sync(), "nonfinite-sync").await;
}
