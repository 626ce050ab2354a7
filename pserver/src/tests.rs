//! In-process tests of the pserver service: real gRPC on loopback (port 0), the in-memory
//! coordination backend. Cross-process tests against real etcd are in `tests/e2e/`.

use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, Lease, MemBackend};
use edl_proto::pserver as pb;
use edl_testkit::{FaultyBackend, WATCH_STREAM};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::checkpoint::CheckpointDir;
use crate::checkpoint::protocol::{self, CheckpointConfig, CheckpointEvery};
use crate::error::{ErrorKind, PsError};
use crate::layout::{DenseSpec, Mode, ParamConfig, ParamSpec, RowInit, SparseSpec};
use crate::optim::{Clip, OptimizerConfig};
use crate::server::{IndexChoice, PsConfig, run};
use edl_job::{JobKeys, JobName};
use edl_job::{PserverRecord, Record};
use edl_pserver_client::{
    DenseCache, DenseInit, InitOutcome, PsClient, PsClientConfig, PsClientError, SparsePush, probe,
};

struct Harness {
    backend: Arc<dyn Backend>,
    stop: CancellationToken,
    job: JobName,
    shards: u32,
    dir: tempfile::TempDir,
    token: Option<String>,
    tls: Option<edl_proto::tls::Tls>,
}

struct Ps {
    stop: CancellationToken,
    handle: JoinHandle<Result<(), PsError>>,
}

impl Ps {
    async fn stop(self) -> Result<(), PsError> {
        self.stop.cancel();
        self.handle.await.unwrap()
    }
}

impl Harness {
    fn new(job: &str, shards: u32) -> Harness {
        Harness {
            backend: Arc::new(MemBackend::new()),
            stop: CancellationToken::new(),
            job: JobName::new(job).unwrap(),
            shards,
            dir: tempfile::tempdir().unwrap(),
            token: None,
            tls: None,
        }
    }

    async fn pserver(&self, index: u32, every: Option<CheckpointEvery>) -> Ps {
        self.pserver_with(self.backend.clone(), index, every, |_| {})
            .await
    }

    /// A pserver on `backend` (a fault-injecting wrapper, say), `f` adjusting its config.
    async fn pserver_with(
        &self,
        backend: Arc<dyn Backend>,
        index: u32,
        every: Option<CheckpointEvery>,
        f: impl FnOnce(&mut PsConfig),
    ) -> Ps {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut cfg = PsConfig::new(self.job.clone());
        cfg.lease_ttl = Duration::from_secs(1);
        cfg.index = IndexChoice::Fixed(index);
        cfg.shards = Some(self.shards);
        cfg.token = self.token.clone();
        cfg.tls = self.tls.clone();
        cfg.checkpoint = every.map(|e| CheckpointConfig {
            keep: 2,
            ..CheckpointConfig::new(self.dir.path().display().to_string(), e)
        });
        f(&mut cfg);
        let stop = self.stop.child_token();
        let handle = tokio::spawn(run(backend, cfg, listener, stop.clone()));
        Ps { stop, handle }
    }

    async fn client(&self) -> PsClient {
        self.client_with(|_| {}).await
    }

    async fn client_with(&self, f: impl FnOnce(&mut PsClientConfig)) -> PsClient {
        let mut cfg = PsClientConfig::new(self.job.clone());
        cfg.token = self.token.clone();
        cfg.tls = self.tls.clone();
        cfg.retry_for = Duration::from_secs(20);
        cfg.sync_wait = Duration::from_millis(500);
        f(&mut cfg);
        PsClient::connect(self.backend.clone(), cfg, self.stop.child_token())
            .await
            .unwrap()
    }

    async fn register(&self, trainer: &str) -> Lease {
        edl_testkit::register_trainer(
            &self.backend,
            JobKeys::new(&self.job).trainers(),
            trainer,
            Duration::from_secs(1),
            self.stop.child_token(),
        )
        .await
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

const N: usize = 1000;

type Grads<'a> = &'a [(&'a str, &'a [f32])];

fn cfg(mode: Mode, opt: OptimizerConfig) -> ParamConfig {
    ParamConfig {
        block_size: 128,
        ..ParamConfig::new(mode, opt)
    }
}

fn emb() -> SparseSpec {
    SparseSpec {
        name: "emb".into(),
        dim: 3,
        init: RowInit::Uniform {
            low: -1.0,
            high: 1.0,
            seed: 5,
        },
    }
}

async fn init(ps: &PsClient, trainer: &str, w: &[f32], config: ParamConfig) -> InitOutcome {
    ps.init(
        trainer,
        &[
            DenseInit {
                name: "w",
                shape: &[N],
                values: w,
            },
            DenseInit {
                name: "b",
                shape: &[1],
                values: &[0.5],
            },
        ],
        &[emb()],
        config,
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_one_trainer_initialises_and_concurrent_async_pushes_sum_exactly() {
    let h = Harness::new("async-sum", 2);
    let _p0 = h.pserver(0, None).await;
    let _p1 = h.pserver(1, None).await;
    let w: Vec<f32> = (0..N).map(|i| i as f32).collect();
    let mut inits = Vec::new();
    for t in 0..4 {
        let ps = h.client().await;
        let w = w.clone();
        inits.push(tokio::spawn(async move {
            init(
                &ps,
                &format!("t{t}"),
                &w,
                cfg(Mode::Async, OptimizerConfig::sgd(1.0)),
            )
            .await
        }));
    }
    let mut outcomes = Vec::new();
    for i in inits {
        outcomes.push(i.await.unwrap());
    }
    assert_eq!(
        outcomes
            .iter()
            .filter(|o| **o == InitOutcome::Initialised)
            .count(),
        1,
        "{outcomes:?}"
    );
    // 4 trainers x 25 pushes of gradient k (k = 1..=25) with lr 1: w -= 4 * 325.
    let mut pushers = Vec::new();
    for t in 0..4 {
        let ps = h.client().await;
        pushers.push(tokio::spawn(async move {
            for k in 1..=25u64 {
                let g = vec![k as f32; N];
                let rows = [7u64, 7, 1_000_003];
                let sg = vec![1.0f32; 9];
                let out = ps
                    .push(
                        &format!("t{t}"),
                        k,
                        &[("w", &g), ("b", &[k as f32])],
                        &[SparsePush {
                            table: "emb",
                            rows: &rows,
                            values: &sg,
                        }],
                    )
                    .await
                    .unwrap();
                assert!(out.applied);
                // A retry of the same push is recognised and not applied again.
                if k == 5 {
                    let again = ps
                        .push(&format!("t{t}"), k, &[("w", &g)], &[])
                        .await
                        .unwrap();
                    assert!(!again.applied);
                }
            }
        }));
    }
    for p in pushers {
        p.await.unwrap();
    }
    let ps = h.client().await;
    let mut cache = DenseCache::new();
    let stats = ps.pull_dense(&mut cache).await.unwrap();
    assert_eq!(stats.blocks, N.div_ceil(128) + 1);
    let got = cache.get("w").unwrap();
    for (i, v) in got.iter().enumerate() {
        assert_eq!(*v, i as f32 - 1300.0, "w[{i}]");
    }
    assert_eq!(cache.get("b").unwrap(), &[0.5 - 1300.0]);
    // Nothing changed: the next pull moves nothing.
    assert_eq!(ps.pull_dense(&mut cache).await.unwrap().blocks, 0);
    // Sparse rows: row 7 was pushed twice per step (summed), 100 steps in all.
    let mut init7 = [0f32; 3];
    emb().init.fill(7, &mut init7);
    let mut init9 = [0f32; 3];
    emb().init.fill(9, &mut init9);
    let rows = ps.pull_sparse("emb", &[7, 9, 1_000_003]).await.unwrap();
    // The bulk path (the client's default) and gRPC read the same rows.
    let grpc = h.client_with(|c| c.bulk = false).await;
    assert_eq!(
        grpc.pull_sparse("emb", &[7, 9, 1_000_003]).await.unwrap(),
        rows
    );
    for d in 0..3 {
        assert!((rows[d] - (init7[d] - 200.0)).abs() < 1e-3, "{rows:?}");
        assert_eq!(
            rows[3 + d],
            init9[d],
            "untrained row reads as its initial value"
        );
    }
    let st = ps.status().await;
    let dups: u64 = st
        .iter()
        .map(|s| s.as_ref().unwrap().counters.unwrap().duplicate_pushes)
        .sum();
    assert!(dups >= 4, "every retried push was recognised ({dups})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_gradients_are_refused_whole_and_counted() {
    let h = Harness::new("bad", 2);
    let _p0 = h.pserver(0, None).await;
    let _p1 = h.pserver(1, None).await;
    let ps = h.client().await;
    init(
        &ps,
        "t",
        &vec![0.0; N],
        cfg(Mode::Async, OptimizerConfig::sgd(1.0)),
    )
    .await;
    // Value 200 is in block 1, on shard 1; the rest of the push (shard 0's blocks, "b")
    // is finite. The client refuses it whole: shard 0 gets none of it either.
    let mut g = vec![1.0f32; N];
    g[200] = f32::NAN;
    let err = ps
        .push("t", 1, &[("w", &g), ("b", &[1.0])], &[])
        .await
        .unwrap_err();
    assert!(matches!(err, PsClientError::NonFinite(_)), "{err}");
    assert_eq!(err.kind(), Some(ErrorKind::NonFinite), "{err}");
    assert!(err.to_string().contains("\"w\" (value 200: NaN)"), "{err}");
    let rows = [1u64, 2];
    let err = ps
        .push(
            "t",
            1,
            &[],
            &[SparsePush {
                table: "emb",
                rows: &rows,
                values: &[0.0, 0.0, 0.0, 0.0, f32::INFINITY, 0.0],
            }],
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind(), Some(ErrorKind::NonFinite), "{err}");
    let err = ps.push("t", 2, &[("w", &[1.0; 3])], &[]).await.unwrap_err();
    assert!(matches!(err, PsClientError::InvalidArgument(_)), "{err}");
    let err = ps.push("t", 2, &[("nope", &[1.0])], &[]).await.unwrap_err();
    assert!(matches!(err, PsClientError::InvalidArgument(_)), "{err}");
    // A client that skips the check (here: a raw gRPC push to shard 1) is refused by the
    // shard, whole: its finite block 1 is not applied either.
    let addr = ps_addr(&h, 1).await;
    let mut raw =
        pb::parameter_server_client::ParameterServerClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
    let mut bad = vec![1.0f32; 128];
    bad[5] = f32::NEG_INFINITY;
    let mut req = tonic::Request::new(pb::PushRequest {
        shard: 1,
        shards: 2,
        trainer: "t".into(),
        session: 7,
        step: 1,
        dense: [(1, vec![1.0f32; 128]), (3, bad)]
            .into_iter()
            .map(|(id, v)| pb::DenseBlock {
                id,
                version: 0,
                values: crate::wire::encode(&v),
            })
            .collect(),
        ..Default::default()
    });
    edl_proto::headers::set_credentials(req.metadata_mut(), h.job.as_str(), None);
    let st = raw.push(req).await.unwrap_err();
    assert_eq!(st.code(), tonic::Code::InvalidArgument);
    assert_eq!(ErrorKind::of(&st), Some(ErrorKind::NonFinite), "{st:?}");
    assert!(st.message().contains("block 3"), "{st:?}");
    let counters = |s: u32| {
        let ps = ps.clone();
        async move { ps.shard_status(s).await.unwrap().counters.unwrap() }
    };
    let (c0, c1) = (counters(0).await, counters(1).await);
    assert_eq!(
        (c0.nonfinite_rejected, c1.nonfinite_rejected),
        (0, 1),
        "only the raw push reached a shard"
    );
    assert_eq!((c0.pushes_applied, c1.pushes_applied), (0, 0));
    let mut cache = DenseCache::new();
    ps.pull_dense(&mut cache).await.unwrap();
    assert!(
        cache.get("w").unwrap().iter().all(|v| *v == 0.0),
        "nothing applied"
    );
    assert_eq!(cache.get("b").unwrap(), &[0.5]);
    for st in ps.status().await {
        assert_eq!(st.unwrap().sparse_rows, 0, "no sparse row trained");
    }
    // A trainer with another spec is told so.
    let ps2 = h.client().await;
    let err = ps2
        .init(
            "u",
            &[DenseInit {
                name: "w",
                shape: &[3],
                values: &[0.0; 3],
            }],
            &[],
            cfg(Mode::Async, OptimizerConfig::sgd(1.0)),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, PsClientError::SpecMismatch(_)), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clipping_is_applied_by_the_client_before_the_push() {
    let h = Harness::new("clip", 2);
    let _p0 = h.pserver(0, None).await;
    let _p1 = h.pserver(1, None).await;
    let ps = h.client().await;
    let mut opt = OptimizerConfig::sgd(1.0);
    opt.clip = Clip {
        max_norm: Some(1.0),
        max_value: None,
    };
    init(&ps, "t", &vec![0.0; N], cfg(Mode::Async, opt)).await;
    // Every coordinate 1: norm sqrt(1001) over w and b; scaled to norm 1.
    let g = vec![1.0f32; N];
    ps.push("t", 1, &[("w", &g), ("b", &[1.0])], &[])
        .await
        .unwrap();
    let mut cache = DenseCache::new();
    ps.pull_dense(&mut cache).await.unwrap();
    let want = -1.0 / ((N + 1) as f32).sqrt();
    for v in cache.get("w").unwrap() {
        assert!((v - want).abs() < 1e-6, "{v} != {want}");
    }
}

/// Waits until every shard expects exactly `who` in its next sync step.
async fn wait_participants(ps: &PsClient, who: &[&str]) {
    let ok = edl_testkit::wait_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async {
            ps.status()
                .await
                .iter()
                .all(|s| s.as_ref().is_ok_and(|s| s.participants == who))
        },
    )
    .await;
    assert!(
        ok,
        "participants never became {who:?}: {:?}",
        ps.status().await
    );
}

/// Waits until every shard's next step is `step`, holding exactly `who`'s pushes.
async fn wait_contributed(ps: &PsClient, step: u64, who: &[&str]) {
    let ok = edl_testkit::wait_until(
        Duration::from_secs(10),
        Duration::from_millis(10),
        || async {
            ps.status().await.iter().all(|s| {
                s.as_ref()
                    .is_ok_and(|s| s.next_step == step && s.contributed == who)
            })
        },
    )
    .await;
    assert!(
        ok,
        "step {step} never held the pushes of {who:?}: {:?}",
        ps.status().await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_steps_average_the_live_trainers_through_deaths_and_joins() {
    let h = Harness::new("sync", 2);
    let _p0 = h.pserver(0, None).await;
    let _p1 = h.pserver(1, None).await;
    let ps = h.client().await;
    init(
        &ps,
        "a",
        &vec![0.0; N],
        cfg(Mode::sync(), OptimizerConfig::sgd(1.0)),
    )
    .await;
    let _la = h.register("a").await;
    let lb = h.register("b").await;
    wait_participants(&ps, &["a", "b"]).await;
    let (a, b) = (h.client().await, h.client().await);
    let (g1, g3) = (vec![1.0f32; N], vec![3.0f32; N]);
    let mut expect = 0.0f32;
    // Steps 1 and 2: a pushes 1, b pushes 3: mean 2 per step.
    for step in 1..=2u64 {
        let (da, db): (Grads<'_>, Grads<'_>) =
            (&[("w", &g1), ("b", &[1.0])], &[("w", &g3), ("b", &[3.0])]);
        let (ra, rb) = tokio::join!(a.push("a", step, da, &[]), b.push("b", step, db, &[]));
        assert_eq!(ra.unwrap().step, step);
        assert_eq!(rb.unwrap().step, step);
        expect -= 2.0;
    }
    let mut cache = DenseCache::new();
    assert_eq!(ps.pull_dense(&mut cache).await.unwrap().next_step, 3);
    assert!(cache.get("w").unwrap().iter().all(|v| *v == expect));
    assert_eq!(cache.get("b").unwrap(), &[0.5 + expect]);
    // Step 3: a pushes; b dies before pushing (its lease ends): the step closes with a.
    let pa = {
        let a = a.clone();
        tokio::spawn(async move { a.push("a", 3, &[("w", &vec![5.0; N])], &[]).await })
    };
    wait_contributed(&ps, 3, &["a"]).await;
    assert!(!pa.is_finished(), "the step waits for b");
    drop(lb); // no more keep-alives: the registration ends with the lease
    assert_eq!(pa.await.unwrap().unwrap().step, 3);
    expect -= 5.0;
    ps.pull_dense(&mut cache).await.unwrap();
    assert!(cache.get("w").unwrap().iter().all(|v| *v == expect));
    // b's zombie push is refused: it is no longer registered.
    let err = b
        .push("b", 3, &[("w", &vec![100.0; N])], &[])
        .await
        .unwrap_err();
    assert_eq!(err.kind(), Some(ErrorKind::NotRegistered), "{err}");
    // Step 4: a pushes, alone (the only participant: the step closes at once); c
    // registers after it: c enters at step 5.
    let pa = {
        let a = a.clone();
        tokio::spawn(async move { a.push("a", 4, &[("w", &vec![2.0; N])], &[]).await })
    };
    // (a is the only participant: its push closes step 4 before c registers.)
    wait_contributed(&ps, 5, &[]).await;
    let _lc = h.register("c").await;
    assert_eq!(
        pa.await.unwrap().unwrap().step,
        4,
        "step 4 does not wait for c"
    );
    expect -= 2.0;
    wait_participants(&ps, &["a", "c"]).await;
    let c = h.client().await;
    // c's push of the closed step 4 is stale.
    let err = c
        .push("c", 4, &[("w", &vec![100.0; N])], &[])
        .await
        .unwrap_err();
    assert!(
        matches!(err, PsClientError::StaleStep { step: 4, next: 5 }),
        "{err}"
    );
    let pc = {
        let c = c.clone();
        tokio::spawn(async move { c.push("c", 5, &[("w", &vec![10.0; N])], &[]).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!pc.is_finished(), "step 5 waits for a");
    a.push("a", 5, &[("w", &vec![2.0; N])], &[]).await.unwrap();
    pc.await.unwrap().unwrap();
    expect -= 6.0;
    ps.pull_dense(&mut cache).await.unwrap();
    assert!(cache.get("w").unwrap().iter().all(|v| *v == expect));
    // An unregistered trainer cannot take part.
    let err = ps
        .push("ghost", 6, &[("w", &vec![1.0; N])], &[])
        .await
        .unwrap_err();
    assert_eq!(err.kind(), Some(ErrorKind::NotRegistered), "{err}");
    // a leaves: c alone makes step 6.
    a.leave("a").await.unwrap();
    assert_eq!(
        c.push("c", 6, &[("w", &vec![1.0; N])], &[])
            .await
            .unwrap()
            .step,
        6
    );
}

/// A sync push whose step stays open longer than the client's wait on the server
/// (`sync_wait`) is asked again; the shard answers "in progress" until the step is
/// applied: the push returns only then, and the trainer stays in the steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_push_asked_again_returns_only_once_its_step_is_applied() {
    let h = Harness::new("sync-ask-again", 2);
    let _p0 = h.pserver(0, None).await;
    let _p1 = h.pserver(1, None).await;
    let ps = h.client().await;
    init(
        &ps,
        "a",
        &vec![0.0; N],
        cfg(Mode::sync(), OptimizerConfig::sgd(1.0)),
    )
    .await;
    let (_la, _lb) = (h.register("a").await, h.register("b").await);
    wait_participants(&ps, &["a", "b"]).await;
    let (a, b) = (h.client().await, h.client().await);
    let origin = |task| {
        Some(crate::shard::Origin {
            pass: 0,
            task,
            seq: 0,
            count: 1,
        })
    };
    let pa = {
        let a = a.clone();
        tokio::spawn(async move {
            a.push_from("a", 1, origin(0), &[("w", &vec![1.0; N])], &[])
                .await
        })
    };
    // a's wait on the server (500 ms) runs out and it asks again, on both shards.
    let asked_again = edl_testkit::wait_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async {
            ps.status().await.iter().all(|s| {
                s.as_ref()
                    .is_ok_and(|s| s.counters.is_some_and(|c| c.duplicate_pushes >= 1))
            })
        },
    )
    .await;
    assert!(asked_again, "{:?}", ps.status().await);
    assert!(!pa.is_finished(), "step 1 is not applied: it waits for b");
    for s in ps.status().await {
        let s = s.unwrap();
        assert_eq!((s.updates, s.next_step), (0, 1));
        assert_eq!(s.participants, ["a", "b"], "a still takes part");
        assert_eq!(s.contributed, ["a"]);
    }
    b.push_from("b", 1, origin(1), &[("w", &vec![3.0; N])], &[])
        .await
        .unwrap();
    let out = pa.await.unwrap().unwrap();
    assert_eq!(out.step, 1);
    assert!(out.applied);
    let mut cache = DenseCache::new();
    assert_eq!(ps.pull_dense(&mut cache).await.unwrap().next_step, 2);
    assert!(cache.get("w").unwrap().iter().all(|v| *v == -2.0));
}

async fn wait_manifest(backend: &Arc<dyn Backend>, keys: &JobKeys, step: u64) {
    let ok = edl_testkit::wait_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async { backend.get(&keys.manifest(step)).await.unwrap().is_some() },
    )
    .await;
    assert!(ok, "manifest of step {step} never committed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_restore_and_fall_back_past_a_corrupt_file() {
    let h = Harness::new("ckpt", 2);
    let keys = JobKeys::new(&JobName::new("ckpt").unwrap());
    let every = Some(CheckpointEvery::Steps(2));
    // The stops here stand for crashes: no final checkpoint.
    let crash = no_final_checkpoint;
    let p0 = h.pserver_with(h.backend.clone(), 0, every, crash).await;
    let p1 = h.pserver_with(h.backend.clone(), 1, every, crash).await;
    let ps = h.client().await;
    init(
        &ps,
        "a",
        &vec![0.0; N],
        cfg(Mode::sync(), OptimizerConfig::adam(0.1)),
    )
    .await;
    let _la = h.register("a").await;
    let mut cache = DenseCache::new();
    let mut at = std::collections::BTreeMap::new();
    for step in 1..=6u64 {
        let g: Vec<f32> = (0..N)
            .map(|i| ((i + step as usize) % 7) as f32 - 3.0)
            .collect();
        ps.push(
            "a",
            step,
            &[("w", &g)],
            &[SparsePush {
                table: "emb",
                rows: &[step],
                values: &[1.0, 2.0, 3.0],
            }],
        )
        .await
        .unwrap();
        ps.pull_dense(&mut cache).await.unwrap();
        at.insert(step, cache.get("w").unwrap().to_vec());
        if step % 2 == 0 {
            // A writer still busy when a newer step's snapshot arrives skips the older
            // one; wait so that every checkpoint step gets written here.
            wait_manifest(&h.backend, &keys, step).await;
        }
    }
    // keep = 2: the manifest of step 2 is pruned once 6 is committed.
    let ok = edl_testkit::wait_until(
        Duration::from_secs(5),
        Duration::from_millis(20),
        || async { h.backend.get(&keys.manifest(2)).await.unwrap().is_none() },
    )
    .await;
    assert!(ok, "old manifest not pruned");
    assert_eq!(
        h.backend.get(&keys.latest()).await.unwrap().unwrap().value,
        b"6"
    );
    let rows_before = ps.pull_sparse("emb", &[1, 5, 6]).await.unwrap();
    // Restart shard 1: it restores step 6 exactly.
    p1.stop().await.unwrap();
    let p1 = h.pserver_with(h.backend.clone(), 1, every, crash).await;
    ps.pull_dense(&mut cache).await.unwrap();
    assert_eq!(cache.get("w").unwrap(), at[&6].as_slice());
    assert_eq!(
        ps.pull_sparse("emb", &[1, 5, 6]).await.unwrap(),
        rows_before
    );
    let st = ps.shard_status(1).await.unwrap();
    assert_eq!(st.restored_from, 6);
    // Training goes on after the restore (the optimizer state came back too).
    ps.push("a", 7, &[("w", &vec![1.0; N])], &[]).await.unwrap();
    // Corrupt shard 1's file of step 6, restart: it falls back to step 4.
    let manifests = protocol::manifests(&*h.backend, &keys).await.unwrap();
    let m6 = manifests.iter().find(|m| m.step == 6).unwrap();
    let path = &m6.entry(1).unwrap().path;
    let mut bytes = std::fs::read(path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(path, bytes).unwrap();
    p1.stop().await.unwrap();
    let _p1 = h.pserver_with(h.backend.clone(), 1, every, crash).await;
    let st = ps.shard_status(1).await.unwrap();
    assert_eq!(st.restored_from, 4);
    // Shard 1's blocks are step 4's; shard 0's are past step 6.
    let layout = ps.layout().await.unwrap();
    ps.pull_dense(&mut cache).await.unwrap();
    let w = cache.get("w").unwrap();
    for b in layout.param_blocks(0).iter().filter(|b| b.shard == 1) {
        assert_eq!(
            &w[b.offset..b.offset + b.len],
            &at[&4][b.offset..b.offset + b.len]
        );
    }
    // The restored shard keeps checkpointing (its step counter jumps to the trainers').
    for step in 8..=10u64 {
        ps.push("a", step, &[("w", &vec![0.5; N])], &[])
            .await
            .unwrap();
    }
    wait_manifest(&h.backend, &keys, 10).await;
    let files = CheckpointDir::new(h.dir.path(), &JobName::new("ckpt").unwrap(), 1)
        .files()
        .unwrap();
    assert!(
        files.iter().all(|(s, _, _)| *s >= 6),
        "old files pruned: {files:?}"
    );
    p0.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_checkpoints_are_coordinated_by_shard_zero() {
    let h = Harness::new("ckpt-async", 2);
    let keys = JobKeys::new(&JobName::new("ckpt-async").unwrap());
    let every = Some(CheckpointEvery::Steps(5));
    let _p0 = h.pserver(0, every).await;
    let p1 = h.pserver(1, every).await;
    let ps = h.client().await;
    init(
        &ps,
        "a",
        &vec![0.0; N],
        cfg(Mode::Async, OptimizerConfig::sgd(1.0)),
    )
    .await;
    for step in 1..=5u64 {
        ps.push("a", step, &[("w", &vec![1.0; N])], &[])
            .await
            .unwrap();
    }
    let ok = edl_testkit::wait_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async { h.backend.get(&keys.latest()).await.unwrap().is_some() },
    )
    .await;
    assert!(ok, "no async checkpoint committed");
    let m = protocol::manifests(&*h.backend, &keys).await.unwrap();
    assert_eq!(m[0].entries.len(), 2);
    assert_eq!(m[0].mode, "async");
    p1.stop().await.unwrap();
    let _p1 = h.pserver(1, every).await;
    let mut cache = DenseCache::new();
    ps.pull_dense(&mut cache).await.unwrap();
    assert!(cache.get("w").unwrap().iter().all(|v| *v == -5.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_restarted_without_checkpoint_starts_over_from_the_initial_values() {
    let h = Harness::new("reinit", 2);
    let _p0 = h.pserver(0, None).await;
    let p1 = h.pserver(1, None).await;
    let ps = h.client().await;
    let w: Vec<f32> = (0..N).map(|i| i as f32).collect();
    init(&ps, "a", &w, cfg(Mode::Async, OptimizerConfig::sgd(1.0))).await;
    let mut cache = DenseCache::new();
    ps.seed_cache(&mut cache, &[w.clone(), vec![0.5]])
        .await
        .unwrap();
    ps.push("a", 1, &[("w", &vec![1.0; N])], &[]).await.unwrap();
    ps.pull_dense(&mut cache).await.unwrap();
    p1.stop().await.unwrap();
    let _p1 = h.pserver(1, None).await;
    // Shard 1 starts over from the initial values (never from trained ones: its ledger
    // is empty, and the master trains everything again for it); shard 0 keeps its own.
    ps.pull_dense(&mut cache).await.unwrap();
    let layout = ps.layout().await.unwrap();
    let got = cache.get("w").unwrap().to_vec();
    for b in layout.param_blocks(0) {
        let shift = if b.shard == 1 { 0.0 } else { 1.0 };
        for (i, v) in got.iter().enumerate().skip(b.offset).take(b.len) {
            assert_eq!(*v, i as f32 - shift, "value {i} of shard {}", b.shard);
        }
    }
    // A client that never saw the initial values cannot start a shard over.
    let p1 = _p1;
    p1.stop().await.unwrap();
    let _p1 = h.pserver(1, None).await;
    let other = h.client().await;
    assert!(other.pull_dense(&mut DenseCache::new()).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pserver_that_loses_its_lease_stops_serving_and_exits() {
    let h = Harness::new("lease", 1);
    let p0 = h.pserver(0, None).await;
    let ps = h.client().await;
    init(
        &ps,
        "a",
        &vec![1.0; N],
        cfg(Mode::Async, OptimizerConfig::sgd(1.0)),
    )
    .await;
    let mut cache = DenseCache::new();
    ps.seed_cache(&mut cache, &[vec![1.0; N], vec![0.5]])
        .await
        .unwrap();
    ps.pull_dense(&mut cache).await.unwrap();
    let keys = JobKeys::new(&JobName::new("lease").unwrap());
    let kv = h.backend.get(&keys.ps(0)).await.unwrap().unwrap();
    h.backend.lease_revoke(kv.lease.unwrap()).await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(5), p0.handle)
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(r, Err(PsError::LeaseLost(0))), "{r:?}");
    // A second pserver with index 0 takes over (empty: no checkpoint); the client
    // follows it and initialises it again from the initial values.
    let _p = h.pserver(0, None).await;
    ps.pull_dense(&mut cache).await.unwrap();
    assert!(cache.get("w").unwrap().iter().all(|v| *v == 1.0));
    ps.push("a", 1, &[("w", &vec![1.0; N])], &[]).await.unwrap();
    ps.pull_dense(&mut cache).await.unwrap();
    assert!(cache.get("w").unwrap().iter().all(|v| *v == 0.0));
}

/// etcd unreachable for several TTLs while the pserver's lease lives on (as etcd keeps
/// leases through a quorum loss): the pserver refuses calls as retryable `NotServing`
/// while it cannot be sure it still holds its shard, does not exit, and serves again
/// once etcd confirms the lease; a push retried meanwhile is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pserver_whose_lease_is_unconfirmed_refuses_calls_until_etcd_answers() {
    let h = Harness::new("uncertain", 1);
    let faulty = FaultyBackend::new(h.backend.clone());
    let p0 = h.pserver_with(faulty.clone(), 0, None, |_| {}).await;
    let ps = h.client().await;
    init(
        &ps,
        "a",
        &vec![1.0; N],
        cfg(Mode::Async, OptimizerConfig::sgd(1.0)),
    )
    .await;
    let addr = ps_addr(&h, 0).await;
    let keys = JobKeys::new(&h.job);
    let lease = h.backend.get(&keys.ps(0)).await.unwrap().unwrap().lease;
    let lease = lease.expect("the claim is under the pserver's lease");

    faulty.set_down(true);
    // Standing in for etcd, which ends no lease while it has no leader.
    let server = {
        let backend = h.backend.clone();
        tokio::spawn(async move {
            loop {
                let _ = backend.lease_keep_alive_once(lease).await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    // Refused once the lease is past its TTL (1 s) unconfirmed.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let refusal = loop {
        match probe(&addr, h.job.as_str(), None, None, Duration::from_secs(1)).await {
            Err(e) if e.kind() == Some(ErrorKind::NotServing) => break e,
            _ => {}
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the pserver went on serving with its lease unconfirmed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(refusal.code(), Some(tonic::Code::Unavailable));
    assert!(refusal.to_string().contains("not confirmed"), "{refusal}");
    // A push now waits (the client retries) instead of failing.
    let push = {
        let ps = ps.clone();
        tokio::spawn(async move { ps.push("a", 1, &[("w", &vec![1.0; N])], &[]).await })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !push.is_finished(),
        "a push went through with the lease unconfirmed"
    );
    assert!(!p0.handle.is_finished(), "the pserver exited");

    faulty.set_down(false);
    let pushed = tokio::time::timeout(Duration::from_secs(10), push)
        .await
        .expect("the push goes through once etcd confirms the lease")
        .unwrap()
        .unwrap();
    assert!(pushed.applied);
    server.abort();
    let mut cache = DenseCache::new();
    ps.pull_dense(&mut cache).await.unwrap();
    assert!(cache.get("w").unwrap().iter().all(|v| *v == 0.0));
    assert!(!p0.handle.is_finished(), "the pserver exited");
    p0.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_and_bulk_paths_agree_and_check_the_token() {
    let mut h = Harness::new("paths", 2);
    h.token = Some("s3cret".into());
    paths_agree_and_check_the_token(&h).await;
}

/// The same over mutual TLS; then clients without TLS, without a client certificate,
/// or with a certificate of another CA reach neither path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_and_bulk_paths_agree_over_mutual_tls() {
    use edl_proto::tls::{LocalCa, TlsFiles};
    let mut h = Harness::new("paths-tls", 2);
    h.token = Some("s3cret".into());
    let files = LocalCa::generate("paths-tls")
        .unwrap()
        .write(&h.dir.path().join("tls"))
        .unwrap();
    h.tls = Some(files.load().unwrap());
    paths_agree_and_check_the_token(&h).await;
    let intruder = {
        let mut f = LocalCa::generate("intruder")
            .unwrap()
            .write(&h.dir.path().join("intruder"))
            .unwrap();
        f.ca = files.ca.clone();
        f.load().unwrap()
    };
    let no_cert = TlsFiles {
        cert: None,
        key: None,
        client_auth: false,
        ..files.clone()
    }
    .load()
    .unwrap();
    for (what, tls) in [
        ("plain", None),
        ("no client certificate", Some(no_cert)),
        ("another CA's certificate", Some(intruder)),
    ] {
        for use_bulk in [true, false] {
            let bad = h
                .client_with(|c| {
                    c.tls = tls.clone();
                    c.bulk = use_bulk;
                    c.retry_for = Duration::from_millis(500);
                })
                .await;
            let mut cache = DenseCache::new();
            let err = bad.pull_dense(&mut cache).await.unwrap_err();
            assert_ne!(
                err.code(),
                Some(tonic::Code::Unauthenticated),
                "{what}, bulk={use_bulk}: reached the service: {err}"
            );
        }
    }
}

/// With one certificate per role (as the operator issues them), only a pserver's opens
/// a replication stream on the bulk path: a trainer's (a client of the same CA, with
/// the job's token) is refused with PermissionDenied before anything of the stream is
/// read, and a pserver's passes that check (the witness: it reaches the next one, this
/// unreplicated shard's refusal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_pservers_certificate_opens_a_replication_stream() {
    use edl_proto::tls::{CertUse, JobCa, PemIdentity, Tls};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut h = Harness::new("roles", 1);
    h.token = Some("s3cret".into());
    let ca = JobCa::generate("roles", 1).unwrap();
    let names = || vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
    let tls = |cn: &str, usage: CertUse| {
        let issued = ca.issue(cn, names(), usage, 1).unwrap();
        let id = PemIdentity {
            cert: issued.cert_pem.into_bytes(),
            key: issued.key_pem.into_bytes(),
            cert_name: cn.to_owned(),
            key_name: cn.to_owned(),
        };
        Tls::from_pem(ca.ca_pem.as_bytes(), "ca", Some(id), None, true).unwrap()
    };
    let pserver_tls = tls("edl pserver ml.roles", CertUse::ServerAndClient);
    h.tls = Some(pserver_tls.clone());
    let _p0 = h.pserver(0, None).await;
    let addr = ps_addr(&h, 0).await;
    let replicate = |t: Tls| {
        let addr = addr.clone();
        async move {
            let mut conn = edl_pserver_api::bulk::open(&addr, "roles", Some("s3cret"), Some(&t))
                .await
                .expect("the hello is accepted");
            conn.write_all(&crate::server::replication::replicate_frame(0, "intruder"))
                .await
                .unwrap();
            conn.flush().await.unwrap();
            let mut head = [0u8; 8];
            conn.read_exact(&mut head).await.unwrap();
            assert_ne!(
                edl_pserver_api::bulk::u32_at(&head[..4]),
                edl_pserver_api::bulk::STATUS_OK
            );
            let len = edl_pserver_api::bulk::u32_at(&head[4..]) as usize;
            let mut body = vec![0u8; len];
            conn.read_exact(&mut body).await.unwrap();
            edl_pserver_api::bulk::pb_to_status(
                <pb::BulkError as prost::Message>::decode(&body[..]).unwrap(),
            )
        }
    };
    let trainer = replicate(tls("edl trainer ml.roles", CertUse::Client)).await;
    assert_eq!(trainer.code(), tonic::Code::PermissionDenied, "{trainer:?}");
    assert!(trainer.message().contains("trainer"), "{trainer:?}");
    let pserver = replicate(pserver_tls).await;
    assert_eq!(pserver.code(), tonic::Code::InvalidArgument, "{pserver:?}");
    assert!(pserver.message().contains("not replicated"), "{pserver:?}");
}

async fn paths_agree_and_check_the_token(h: &Harness) {
    let _p0 = h.pserver(0, None).await;
    let _p1 = h.pserver(1, None).await;
    let bulk = h.client().await;
    let grpc = h.client_with(|c| c.bulk = false).await;
    let w: Vec<f32> = (0..N).map(|i| i as f32).collect();
    init(&grpc, "t", &w, cfg(Mode::Async, OptimizerConfig::sgd(0.5))).await;
    for k in 1..=4u64 {
        let g: Vec<f32> = (0..N).map(|i| ((i as u64 + k) % 3) as f32).collect();
        let via = if k % 2 == 0 { &bulk } else { &grpc };
        assert!(via.push("t", k, &[("w", &g)], &[]).await.unwrap().applied);
    }
    let (mut a, mut b) = (DenseCache::new(), DenseCache::new());
    bulk.pull_dense(&mut a).await.unwrap();
    grpc.pull_dense(&mut b).await.unwrap();
    assert_eq!(a.get("w"), b.get("w"));
    let want: Vec<f32> = (0..N)
        .map(|i| i as f32 - 0.5 * (1..=4u64).map(|k| ((i as u64 + k) % 3) as f32).sum::<f32>())
        .collect();
    assert_eq!(a.get("w").unwrap(), want.as_slice());
    // A retried push (same client and step) is recognised on either path.
    let g = vec![1.0f32; N];
    assert!(!grpc.push("t", 3, &[("w", &g)], &[]).await.unwrap().applied);
    assert!(!bulk.push("t", 4, &[("w", &g)], &[]).await.unwrap().applied);
    // Without the token, both paths refuse.
    for use_bulk in [true, false] {
        let bad = h
            .client_with(|c| {
                c.token = None;
                c.bulk = use_bulk;
            })
            .await;
        let mut cache = DenseCache::new();
        let err = bad.pull_dense(&mut cache).await.unwrap_err();
        assert_eq!(
            err.code(),
            Some(tonic::Code::Unauthenticated),
            "bulk={use_bulk}: {err}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_based_checkpoints_pick_one_step_for_every_shard() {
    let h = Harness::new("ckpt-interval", 2);
    let keys = JobKeys::new(&JobName::new("ckpt-interval").unwrap());
    let every = Some(CheckpointEvery::Interval(Duration::from_millis(300)));
    let _p0 = h.pserver(0, every).await;
    let _p1 = h.pserver(1, every).await;
    let ps = h.client().await;
    init(
        &ps,
        "a",
        &vec![0.0; N],
        cfg(Mode::sync(), OptimizerConfig::sgd(1.0)),
    )
    .await;
    let _la = h.register("a").await;
    wait_participants(&ps, &["a"]).await;
    // Shard 0 asks for a step two steps ahead; both shards snapshot right after it.
    let mut step = 1;
    let ok = edl_testkit::wait_until(Duration::from_secs(20), Duration::from_millis(50), || {
        let ps = ps.clone();
        let s = step;
        step += 1;
        async move {
            ps.push("a", s, &[("w", &vec![1.0; N])], &[]).await.unwrap();
            ps.status()
                .await
                .iter()
                .all(|s| s.as_ref().is_ok_and(|s| s.last_checkpoint > 0))
        }
    })
    .await;
    assert!(ok, "no time-based checkpoint");
    let latest = loop {
        if let Some(kv) = h.backend.get(&keys.latest()).await.unwrap() {
            break String::from_utf8(kv.value).unwrap().parse::<u64>().unwrap();
        }
        ps.push("a", step, &[("w", &vec![1.0; N])], &[])
            .await
            .unwrap();
        step += 1;
    };
    let m = protocol::manifests(&*h.backend, &keys).await.unwrap();
    assert_eq!(m[0].step, latest);
    assert_eq!(m[0].mode, "sync");
    assert_eq!(m[0].entries.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_membership_and_ticks_go_on_after_the_trainer_watch_ends() {
    let h = Harness::new("rewatch", 1);
    let faulty = FaultyBackend::new(h.backend.clone());
    let _p0 = h.pserver_with(faulty.clone(), 0, None, |_| {}).await;
    let ps = h.client().await;
    init(
        &ps,
        "a",
        &vec![0.0; N],
        cfg(Mode::sync(), OptimizerConfig::sgd(1.0)),
    )
    .await;
    let _la = h.register("a").await;
    wait_participants(&ps, &["a"]).await;
    // The pserver's registry watch ends on an error that retrying cannot cure; the
    // pserver keeps reconciling its members (and ticking) and watches again.
    faulty.fail(&[WATCH_STREAM], || {
        edl_coord::Error::PermissionDenied("injected".into())
    });
    let _lb = h.register("b").await;
    wait_participants(&ps, &["a", "b"]).await;
    faulty.clear_failures();
    let lc = h.register("c").await;
    wait_participants(&ps, &["a", "b", "c"]).await;
    drop(lc); // c's lease ends: the new watch sees it leave
    wait_participants(&ps, &["a", "b"]).await;
}

/// A pserver that takes every sync push and never applies its step (a bug, or a
/// pserver whose step timeout never fires).
#[derive(Debug, Clone, Copy)]
struct NeverCloses;

#[tonic::async_trait]
impl pb::parameter_server_server::ParameterServer for NeverCloses {
    async fn init(
        &self,
        _: tonic::Request<pb::InitRequest>,
    ) -> Result<tonic::Response<pb::InitResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("init"))
    }

    async fn finish_init(
        &self,
        _: tonic::Request<pb::FinishInitRequest>,
    ) -> Result<tonic::Response<pb::FinishInitResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("finish_init"))
    }

    async fn push(
        &self,
        req: tonic::Request<pb::PushRequest>,
    ) -> Result<tonic::Response<pb::PushResponse>, tonic::Status> {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let step = req.get_ref().step;
        Ok(tonic::Response::new(pb::PushResponse {
            applied: true,
            step,
            done: false,
            next_step: step,
            incarnation: 1,
        }))
    }

    async fn task_done(
        &self,
        _: tonic::Request<pb::TaskDoneRequest>,
    ) -> Result<tonic::Response<pb::TaskDoneResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("task_done"))
    }

    async fn pull(
        &self,
        _: tonic::Request<pb::PullRequest>,
    ) -> Result<tonic::Response<pb::PullResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("pull"))
    }

    async fn pull_sparse(
        &self,
        _: tonic::Request<pb::PullSparseRequest>,
    ) -> Result<tonic::Response<pb::PullSparseResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("pull_sparse"))
    }

    async fn leave(
        &self,
        _: tonic::Request<pb::LeaveRequest>,
    ) -> Result<tonic::Response<pb::LeaveResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("leave"))
    }

    async fn status(
        &self,
        _: tonic::Request<pb::StatusRequest>,
    ) -> Result<tonic::Response<pb::StatusResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("status"))
    }
}

/// Serves `svc` on a loopback port recorded as `ps/<index>` of `h`'s job (no bulk path),
/// with `spec` as the job's parameters.
async fn fake_pserver(h: &Harness, svc: NeverCloses, spec: &ParamSpec) {
    let keys = JobKeys::new(&h.job);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let record = PserverRecord::at(listener.local_addr().unwrap().to_string());
    let stop = h.stop.child_token();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::parameter_server_server::ParameterServerServer::new(svc))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                stop.cancelled_owned(),
            ),
    );
    let b = &h.backend;
    b.put(&keys.desired(), h.shards.to_string().into_bytes(), None)
        .await
        .unwrap();
    b.put(&keys.ps(0), record.encode(), None).await.unwrap();
    b.put(&keys.params_spec(), spec.to_json().into_bytes(), None)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_push_gives_up_on_a_step_that_never_closes() {
    let h = Harness::new("never-closes", 1);
    let spec = ParamSpec {
        dense: vec![DenseSpec {
            name: "w".into(),
            shape: vec![4],
        }],
        sparse: Vec::new(),
        config: ParamConfig::new(
            Mode::Sync {
                step_timeout_ms: 100,
            },
            OptimizerConfig::sgd(1.0),
        ),
    };
    fake_pserver(&h, NeverCloses, &spec).await;
    let ps = h
        .client_with(|c| {
            c.retry_for = Duration::from_millis(300);
            c.sync_wait = Duration::from_millis(100);
        })
        .await;
    let push = ps.push("a", 1, &[("w", &[1.0; 4])], &[]);
    let err = tokio::time::timeout(Duration::from_secs(10), push)
        .await
        .expect("the push gives up")
        .unwrap_err();
    assert!(
        matches!(err, PsClientError::Unavailable { shard: 0, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("sync step 1"), "{err}");
}

/// A listener whose accept queue is full (and the connections that fill it): a new
/// connection to it hangs, the kernel dropping its SYNs.
async fn full_listener() -> (TcpListener, Vec<tokio::net::TcpStream>) {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = sock.listen(1).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut held = Vec::new();
    loop {
        let connect = tokio::net::TcpStream::connect(addr);
        match tokio::time::timeout(Duration::from_millis(300), connect).await {
            Ok(Ok(s)) => held.push(s),
            Ok(Err(e)) => panic!("connect to the backlog listener: {e}"),
            Err(_) => break,
        }
        assert!(held.len() < 64, "the accept queue never filled");
    }
    (listener, held)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_that_cannot_be_reached_does_not_stall_the_others() {
    let h = Harness::new("partition", 2);
    let _p0 = h.pserver(0, None).await;
    let (stuck, _held) = full_listener().await;
    let record = PserverRecord::at(stuck.local_addr().unwrap().to_string());
    let keys = JobKeys::new(&h.job);
    h.backend
        .put(&keys.ps(1), record.encode(), None)
        .await
        .unwrap();
    let ps = h
        .client_with(|c| c.connect_timeout = Duration::from_secs(5))
        .await;
    ps.shard_status(0).await.unwrap();
    let stalled = {
        let ps = ps.clone();
        tokio::spawn(async move { ps.shard_status(1).await })
    };
    // For a second, while shard 1 is being connected to, shard 0 answers at once.
    let start = tokio::time::Instant::now();
    while start.elapsed() < Duration::from_secs(1) {
        let st = tokio::time::timeout(Duration::from_millis(500), ps.shard_status(0))
            .await
            .expect("shard 0 answers while shard 1 is being connected to");
        assert_eq!(st.unwrap().shard, 0);
    }
    assert!(!stalled.is_finished(), "shard 1 cannot be reached");
    stalled.abort();
}

/// The address of shard `index`'s pserver, once it claimed its index.
async fn ps_addr(h: &Harness, index: u32) -> String {
    let keys = JobKeys::new(&h.job);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(kv) = h.backend.get(&keys.ps(index)).await.unwrap() {
            let record = PserverRecord::decode(&kv.value).unwrap();
            return record.addr;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "shard {index} never claimed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The first bytes of a bulk connection announcing a hello of `len` bytes.
fn bulk_head(len: u32) -> Vec<u8> {
    let mut head = crate::bulk::MAGIC.to_vec();
    head.extend_from_slice(&crate::bulk::VERSION.to_le_bytes());
    head.extend_from_slice(&len.to_le_bytes());
    head
}

/// Opens a bulk connection and says hello; returns it and the status answered (`None`
/// when the pserver closed it instead).
async fn bulk_connect(addr: &str, job: &str) -> (tokio::net::TcpStream, Option<u32>) {
    use prost::Message;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let hello = pb::BulkHello {
        job: job.into(),
        token: String::new(),
    }
    .encode_to_vec();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut msg = bulk_head(hello.len() as u32);
    msg.extend_from_slice(&hello);
    let _ = s.write_all(&msg).await;
    let mut status = [0u8; 4];
    let read = tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut status))
        .await
        .expect("the pserver answers a hello at once");
    let status = read.ok().map(|_| u32::from_le_bytes(status));
    (s, status)
}

/// Whether the pserver closed `s` (EOF or an error within 5 s).
async fn closed_by_pserver(s: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::AsyncReadExt;
    let mut byte = [0u8; 1];
    matches!(
        tokio::time::timeout(Duration::from_secs(5), s.read(&mut byte)).await,
        Ok(Ok(0) | Err(_))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bulk_path_bounds_hellos_stalls_and_connections() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let h = Harness::new("bulk-limits", 1);
    let _p0 = h
        .pserver_with(h.backend.clone(), 0, None, |c| {
            c.io_timeout = Duration::from_secs(3);
            c.max_bulk_connections = 2;
        })
        .await;
    let addr = ps_addr(&h, 0).await;
    let port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
    // A hello longer than a job name and a token is refused before it is read.
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    s.write_all(&bulk_head(1 << 20)).await.unwrap();
    let mut status = [0u8; 4];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut status))
        .await
        .expect("a long hello is refused at once")
        .unwrap();
    assert_eq!(u32::from_le_bytes(status), crate::bulk::STATUS_ERR);
    drop(s);
    // Two connections are served; a third takes the slot of the one idle longest.
    let (mut a, st) = bulk_connect(&addr, h.job.as_str()).await;
    assert_eq!(st, Some(crate::bulk::STATUS_OK));
    let (mut b, st) = bulk_connect(&addr, h.job.as_str()).await;
    assert_eq!(st, Some(crate::bulk::STATUS_OK));
    let (mut c, st) = bulk_connect(&addr, h.job.as_str()).await;
    assert_eq!(
        st,
        Some(crate::bulk::STATUS_OK),
        "an idle slot is taken over"
    );
    assert!(
        closed_by_pserver(&mut a).await,
        "the longest-idle connection is closed"
    );
    // Both slots in the middle of a request (a frame started, the pserver has read its
    // bytes): a fourth connection is closed at once.
    let mut frame = crate::bulk::KIND_PULL.to_le_bytes().to_vec();
    frame.extend_from_slice(&100u32.to_le_bytes());
    b.write_all(&frame).await.unwrap();
    c.write_all(&frame).await.unwrap();
    let read =
        edl_testkit::wait_until(Duration::from_secs(5), Duration::from_millis(5), || async {
            edl_testkit::unread_at(port) == 0
        })
        .await;
    assert!(read, "the pserver never read the frames' first bytes");
    let (_d, st) = bulk_connect(&addr, h.job.as_str()).await;
    assert_eq!(
        st, None,
        "a connection beyond the bound, none idle, is closed"
    );
    // A peer that stalls in the middle of a frame loses its connection, and its slot.
    assert!(
        closed_by_pserver(&mut b).await,
        "a stalled connection is closed"
    );
    let ok = edl_testkit::wait_until(
        Duration::from_secs(5),
        Duration::from_millis(20),
        || async { bulk_connect(&addr, h.job.as_str()).await.1 == Some(crate::bulk::STATUS_OK) },
    )
    .await;
    assert!(ok, "the stalled connection's slot was never freed");
}

/// More clients than bulk slots: each request of one client finds the other's
/// connection idle in the only slot and takes it over; its pool's connection was closed
/// since its last request, and the request goes out again on a fresh one. Every push
/// and pull succeeds, and each push is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_beyond_the_bulk_bound_take_turns_on_its_slots() {
    let h = Harness::new("bulk-share", 1);
    let _p0 = h
        .pserver_with(h.backend.clone(), 0, None, |c| c.max_bulk_connections = 1)
        .await;
    // Retries for 1 s: a slot held by the other client's idle connection (for its
    // 600 s idle timeout) would fail the request.
    let one = h
        .client_with(|c| c.retry_for = Duration::from_secs(1))
        .await;
    let two = h
        .client_with(|c| c.retry_for = Duration::from_secs(1))
        .await;
    init(
        &one,
        "a",
        &vec![0.0; N],
        cfg(Mode::Async, OptimizerConfig::sgd(1.0)),
    )
    .await;
    init(
        &two,
        "b",
        &vec![0.0; N],
        cfg(Mode::Async, OptimizerConfig::sgd(1.0)),
    )
    .await;
    let g = vec![-1.0f32; N];
    for step in 1..=20u64 {
        for (ps, who) in [(&one, "a"), (&two, "b")] {
            ps.push(who, step, &[("w", &g), ("b", &[0.0])], &[])
                .await
                .unwrap_or_else(|e| panic!("push {step} of {who}: {e}"));
        }
    }
    let mut cache = DenseCache::new();
    two.pull_dense(&mut cache).await.unwrap();
    let w = cache.get("w").unwrap();
    assert!(w.iter().all(|&x| x == 40.0), "{:?}", &w[..4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_is_recorded_after_a_transient_etcd_failure() {
    let h = Harness::new("ckpt-retry", 1);
    let keys = JobKeys::new(&JobName::new("ckpt-retry").unwrap());
    let faulty = FaultyBackend::new(h.backend.clone());
    let every = Some(CheckpointEvery::Steps(2));
    let _p0 = h.pserver_with(faulty.clone(), 0, every, |_| {}).await;
    let ps = h.client().await;
    init(
        &ps,
        "a",
        &vec![0.0; N],
        cfg(Mode::sync(), OptimizerConfig::sgd(1.0)),
    )
    .await;
    let _la = h.register("a").await;
    wait_participants(&ps, &["a"]).await;
    // etcd refuses the pserver's transactions while step 2's file is written.
    faulty.fail(&["txn"], || edl_coord::Error::Unavailable {
        endpoints: vec!["faulty-backend".into()],
        msg: "injected".into(),
    });
    for step in 1..=2u64 {
        ps.push("a", step, &[("w", &vec![1.0; N])], &[])
            .await
            .unwrap();
    }
    let dir = CheckpointDir::new(h.dir.path(), &JobName::new("ckpt-retry").unwrap(), 0);
    let written = edl_testkit::wait_until(
        Duration::from_secs(10),
        Duration::from_millis(10),
        || async { dir.files().unwrap().iter().any(|(s, _, _)| *s == 2) },
    )
    .await;
    assert!(written, "the checkpoint file of step 2 was never written");
    faulty.clear_failures();
    wait_manifest(&h.backend, &keys, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_commits_a_step_whose_commit_was_lost() {
    let h = Harness::new("ckpt-lost", 2);
    let keys = JobKeys::new(&JobName::new("ckpt-lost").unwrap());
    let every = Some(CheckpointEvery::Steps(1000));
    let _p0 = h.pserver(0, every).await;
    let _p1 = h.pserver(1, every).await;
    let ps = h.client().await;
    init(
        &ps,
        "a",
        &vec![0.0; N],
        cfg(Mode::sync(), OptimizerConfig::sgd(1.0)),
    )
    .await;
    // Every shard's part of step 7 is registered, and nobody committed it (its last
    // writer died, or etcd kept failing its commit).
    for shard in 0..2u32 {
        let kv = h.backend.get(&keys.ps(shard)).await.unwrap().unwrap();
        let fence = edl_coord::Fence {
            key: keys.ps(shard),
            revision: kv.create_revision,
        };
        let entry = crate::checkpoint::ShardEntry {
            shard,
            path: format!("/nonexistent/ps-{shard}.ckpt"),
            size: 1,
            crc32c: 0,
            uuid: "u".into(),
        };
        protocol::register_part(&*h.backend, &keys, &fence, 7, &entry)
            .await
            .unwrap();
    }
    wait_manifest(&h.backend, &keys, 7).await;
    let m = protocol::manifests(&*h.backend, &keys).await.unwrap();
    assert_eq!(m[0].step, 7);
    assert_eq!(m[0].entries.len(), 2);
    assert_eq!(m[0].mode, "sync");
}

/// The gradients of batch `seq` of task `task`: known, different for every batch.
fn batch_grad(task: u32, seq: u32) -> (Vec<f32>, Vec<f32>) {
    let k = (task * 3 + seq + 1) as f32;
    let dense = (0..N).map(|i| ((i % 13) as f32 - 6.0) * 0.01 * k).collect();
    let rows = vec![0.1 * k, -0.2 * k, 0.05 * k];
    (dense, rows)
}

/// Pushes the batches `seqs` of `task` (pass 0) with their origins; returns, per shard,
/// the oldest incarnation that answered.
async fn push_task(ps: &PsClient, task: u32, seqs: std::ops::Range<u32>) -> Vec<u64> {
    let mut oldest = vec![0u64; ps.shards() as usize];
    for seq in seqs {
        let (dense, rows) = batch_grad(task, seq);
        let row = [u64::from(task % 4)];
        let out = ps
            .push_from(
                "a",
                u64::from(task * 3 + seq + 1),
                Some(crate::shard::Origin::batch(0, task, seq)),
                &[("w", &dense)],
                &[SparsePush {
                    table: "emb",
                    rows: &row,
                    values: &rows,
                }],
            )
            .await
            .unwrap();
        for (o, i) in oldest.iter_mut().zip(out.incarnations) {
            if *o == 0 || i < *o {
                *o = i;
            }
        }
    }
    oldest
}

/// Dense and sparse parameters of a job, as pulled.
async fn params_of(ps: &PsClient) -> (Vec<f32>, Vec<f32>) {
    let mut cache = DenseCache::new();
    ps.pull_dense(&mut cache).await.unwrap();
    let rows = ps.pull_sparse("emb", &[0, 1, 2, 3]).await.unwrap();
    (cache.get("w").unwrap().to_vec(), rows)
}

/// A pserver killed mid-task and restored from an older checkpoint loses nothing: the
/// tasks its restored state lacks are trained again (found from `restores/0`, as the
/// master does), the batches it holds count nothing, and the final dense and sparse
/// parameters equal a fault-free run's bit for bit (one trainer: a fixed order).
async fn restore_then_train_again_matches_a_fault_free_run(mode: Mode, name: &str) {
    const TASKS: u32 = 6;
    const BATCHES: u32 = 3;
    let w0: Vec<f32> = (0..N).map(|i| (i % 7) as f32).collect();
    let config = cfg(mode.clone(), OptimizerConfig::adam(0.05));
    // Fault-free.
    let free = Harness::new(&format!("{name}-free"), 1);
    let _f = free.pserver(0, None).await;
    let fps = free.client().await;
    init(&fps, "a", &w0, config.clone()).await;
    let _fa = free.register("a").await;
    for t in 0..TASKS {
        let incs = push_task(&fps, t, 0..BATCHES).await;
        fps.task_done("a", 0, t, TASKS, &incs).await.unwrap();
    }
    let want = params_of(&fps).await;

    // With a crash.
    let h = Harness::new(&format!("{name}-crash"), 1);
    let keys = JobKeys::new(&h.job);
    // Sync: every shard snapshots after step 9 (task 2's last batch); async: when
    // asked, below.
    let every = Some(CheckpointEvery::Steps(if mode.is_sync() {
        9
    } else {
        1_000_000
    }));
    let crash = no_final_checkpoint;
    let p = h.pserver_with(h.backend.clone(), 0, every, crash).await;
    let ps = h.client().await;
    init(&ps, "a", &w0, config.clone()).await;
    let _la = h.register("a").await;
    let mut cache = DenseCache::new();
    ps.seed_cache(&mut cache, &[w0.clone(), vec![0.5]])
        .await
        .unwrap();
    for t in 0..2 {
        let incs = push_task(&ps, t, 0..BATCHES).await;
        ps.task_done("a", 0, t, TASKS, &incs).await.unwrap();
    }
    push_task(&ps, 2, 0..2).await;
    // A checkpoint: tasks 0 and 1 complete, and two (async: now) or three (sync: after
    // step 9) batches of task 2.
    if !mode.is_sync() {
        protocol::request(&*h.backend, &keys, &claim_fence(&h, 0).await, 1)
            .await
            .unwrap();
        wait_manifest(&h.backend, &keys, 1).await;
    }
    // More training the crash will lose: the rest of task 2 (done), part of task 3.
    let incs = push_task(&ps, 2, 2..BATCHES).await;
    ps.task_done("a", 0, 2, TASKS, &incs).await.unwrap();
    let ok = edl_testkit::wait_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async { h.backend.get(&keys.latest()).await.unwrap().is_some() },
    )
    .await;
    assert!(ok, "no checkpoint committed");
    let lost_incs = push_task(&ps, 3, 0..2).await;
    p.stop().await.unwrap();
    let _p = h.pserver_with(h.backend.clone(), 0, every, crash).await;
    // The restored shard says what it holds; the "master" trains the rest again.
    let restored = || async {
        let kv = h.backend.get(&keys.restore(0)).await.unwrap()?;
        edl_job::RestoreRecord::decode(&kv.value)
            .ok()
            .filter(|r| r.step > 0)
    };
    let ok = edl_testkit::wait_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async { restored().await.is_some() },
    )
    .await;
    assert!(ok, "no restore record");
    let rec = restored().await.unwrap();
    let held: Vec<u32> = (0..TASKS)
        .filter(|&t| rec.contains.contains(0, t))
        .collect();
    assert_eq!(held, vec![0, 1], "tasks 2 and 3 are lacking");
    // Task 3's pushes went to the old incarnation: its completion is refused.
    assert!(matches!(
        ps.task_done("a", 0, 3, TASKS, &lost_incs).await,
        Err(PsClientError::Rewound { .. })
    ));
    // Trained again in order: task 2 (the batches held count nothing), then on.
    for t in 2..TASKS {
        let incs = push_task(&ps, t, 0..BATCHES).await;
        ps.task_done("a", 0, t, TASKS, &incs).await.unwrap();
    }
    let got = params_of(&ps).await;
    assert_eq!(got.0, want.0, "dense parameters equal the fault-free run's");
    assert_eq!(got.1, want.1, "sparse rows equal the fault-free run's");
    let st = ps.shard_status(0).await.unwrap();
    let c = st.counters.unwrap();
    assert!(
        (2..=3).contains(&c.duplicate_pushes),
        "the batches of task 2 held: {}",
        c.duplicate_pushes
    );
    assert_eq!(c.tasks_rewound, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_a_restored_shard_trained_again_ends_bit_for_bit_where_a_fault_free_run_does() {
    restore_then_train_again_matches_a_fault_free_run(Mode::Async, "again-async").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_a_restored_shard_trained_again_ends_bit_for_bit_where_a_fault_free_run_does() {
    restore_then_train_again_matches_a_fault_free_run(Mode::sync(), "again-sync").await;
}

/// A pserver config whose stop stands for a crash: no final checkpoint.
fn no_final_checkpoint(c: &mut PsConfig) {
    if let Some(c) = c.checkpoint.as_mut() {
        c.final_on_stop = false;
    }
}

/// The fence of the claim of shard `index` of `h`'s job (to write a checkpoint request
/// as the coordinator would).
async fn claim_fence(h: &Harness, index: u32) -> edl_coord::Fence {
    let keys = JobKeys::new(&h.job);
    let kv = h.backend.get(&keys.ps(index)).await.unwrap().unwrap();
    edl_coord::Fence {
        key: keys.ps(index),
        revision: kv.create_revision,
    }
}

/// Fuzzing the bulk path from an authenticated peer: 300 seeded connections each say a
/// valid hello, then send random frames (random kinds, lengths from 0 to absurd, random
/// headers, a few valid headers with wrong payloads), random byte runs, or stop in the
/// middle. The pserver answers or closes each connection without panicking or hanging,
/// and afterwards serves a real client with the parameters unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bulk_path_survives_random_frames_from_an_authenticated_peer() {
    use prost::Message;
    use rand::{Rng, SeedableRng};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let h = Harness::new("bulkfuzz", 1);
    let _p0 = h.pserver(0, None).await;
    let ps = h.client().await;
    let w: Vec<f32> = (0..N).map(|i| i as f32).collect();
    init(&ps, "t", &w, cfg(Mode::Async, OptimizerConfig::sgd(0.5))).await;
    let addr = ps_addr(&h, 0).await;
    let hello = pb::BulkHello {
        job: h.job.to_string(),
        token: String::new(),
    }
    .encode_to_vec();
    let mut rng = rand::rngs::StdRng::seed_from_u64(19);
    let mut answered = 0;
    for case in 0..300u32 {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let mut msg = bulk_head(hello.len() as u32);
        msg.extend_from_slice(&hello);
        s.write_all(&msg).await.unwrap();
        let mut status = [0u8; 4];
        s.read_exact(&mut status).await.unwrap();
        assert_eq!(
            u32::from_le_bytes(status),
            crate::bulk::STATUS_OK,
            "case {case}"
        );
        let mut bytes = Vec::new();
        for _ in 0..rng.random_range(1..4) {
            let kind: u32 = match rng.random_range(0..4) {
                0 => 1,
                1 => 2,
                2 => rng.random(),
                _ => 0,
            };
            let header: Vec<u8> = match rng.random_range(0..3) {
                // A push header that announces a payload the frame does not carry.
                0 => pb::BulkPush {
                    request: Some(pb::PushRequest {
                        trainer: "t".into(),
                        step: rng.random_range(0..5),
                        dense: vec![pb::DenseBlock::default()],
                        ..Default::default()
                    }),
                    dense_bytes: vec![rng.random_range(0..1 << 20)],
                    sparse_bytes: vec![],
                }
                .encode_to_vec(),
                1 => (0..rng.random_range(0..256))
                    .map(|_| rng.random())
                    .collect(),
                _ => Vec::new(),
            };
            let len: u32 = match rng.random_range(0..4) {
                0 => header.len() as u32,
                1 => rng.random(),
                2 => rng.random_range(0..64),
                _ => u32::MAX,
            };
            bytes.extend_from_slice(&kind.to_le_bytes());
            bytes.extend_from_slice(&len.to_le_bytes());
            bytes.extend_from_slice(&header);
            let junk = rng.random_range(0..512);
            bytes.extend((0..junk).map(|_| rng.random::<u8>()));
        }
        let cut = rng.random_range(0..=bytes.len());
        let _ = s.write_all(&bytes[..cut]).await;
        let _ = s.shutdown().await;
        let mut out = Vec::new();
        match tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await {
            Ok(_) => {}
            Err(_) => panic!("case {case}: the pserver neither answered nor closed"),
        }
        if !out.is_empty() {
            answered += 1;
        }
    }
    // The positive witness: frames were parsed (and refused) as well as cut off.
    assert!(
        answered > 30,
        "only {answered} of 300 connections got an answer"
    );
    assert!(!_p0.handle.is_finished(), "the pserver exited");
    let mut cache = DenseCache::new();
    ps.pull_dense(&mut cache).await.unwrap();
    assert_eq!(
        cache.get("w").unwrap(),
        w.as_slice(),
        "the parameters changed"
    );
}
