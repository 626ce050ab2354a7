//! The parameter server against real etcd: `edl pserver` processes, trainers in this
//! process and as child processes, SIGKILL, SIGSTOP, corrupt checkpoints.

use std::collections::BTreeMap;
use std::time::Duration;

use edl_job::{JobKeys, JobName};
use edl_pserver::checkpoint;
use edl_pserver::checkpoint::protocol as ckpt;
use edl_pserver_client::error::ErrorKind;
use edl_pserver_client::{
    DenseCache, DenseInit, Mode, OptimizerConfig, ParamConfig, PsClient, PsClientError, probe,
};
use edl_testkit::{ChildProcess, child_role};
use tokio::time::Instant;

use crate::support::{World, wait_until};

pub(crate) const N: usize = 10_000;

pub(crate) fn config(mode: Mode, opt: OptimizerConfig) -> ParamConfig {
    ParamConfig {
        block_size: 256,
        ..ParamConfig::new(mode, opt)
    }
}

pub(crate) async fn init(ps: &PsClient, w: &[f32], cfg: ParamConfig) {
    ps.init(
        "init",
        &[DenseInit {
            name: "w",
            shape: &[N],
            values: w,
        }],
        &[],
        cfg,
    )
    .await
    .expect("init");
}

pub(crate) async fn pull(ps: &PsClient) -> Vec<f32> {
    let mut cache = DenseCache::new();
    ps.pull_dense(&mut cache).await.expect("pull");
    cache.get("w").expect("w").to_vec()
}

/// Waits until every shard's next sync step expects exactly `who`.
async fn wait_participants(ps: &PsClient, who: &[&str]) {
    let ok = wait_until(Duration::from_secs(20), || async {
        ps.status()
            .await
            .iter()
            .all(|s| s.as_ref().is_ok_and(|s| s.participants == who))
    })
    .await;
    assert!(ok, "participants never became {who:?}");
}

/// Waits until every shard's next step is `step`, holding exactly `who`'s pushes.
async fn wait_contributed(ps: &PsClient, step: u64, who: &[&str]) {
    let ok = wait_until(Duration::from_secs(10), || async {
        ps.status().await.iter().all(|s| {
            s.as_ref()
                .is_ok_and(|s| s.next_step == step && s.contributed == who)
        })
    })
    .await;
    assert!(
        ok,
        "step {step} never held the pushes of {who:?}: {:?}",
        ps.status().await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_async_pushes_to_two_pserver_processes_apply_the_exact_sum() {
    let w = World::new("ps-async").await;
    let (_p0, _) = w.pserver("ps0", &["--shards", "2"]).await;
    let (_p1, _) = w.pserver("ps1", &["--shards", "2"]).await;
    let ps = w.ps_client().await;
    let start: Vec<f32> = (0..N).map(|i| i as f32).collect();
    init(&ps, &start, config(Mode::Async, OptimizerConfig::sgd(1.0))).await;
    // 8 trainers, 40 pushes each, trainer t's k-th push is (t + 1) everywhere.
    let mut tasks = Vec::new();
    for t in 0..8u64 {
        let ps = w.ps_client().await;
        tasks.push(tokio::spawn(async move {
            let g = vec![(t + 1) as f32; N];
            for k in 1..=40u64 {
                let out = ps
                    .push(&format!("t{t}"), k, &[("w", &g)], &[])
                    .await
                    .unwrap();
                assert!(out.applied);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    // sum over t of 40 * (t + 1) = 40 * 36
    let got = pull(&ps).await;
    for (i, v) in got.iter().enumerate() {
        assert_eq!(*v, i as f32 - 1440.0, "w[{i}]");
    }
    let applied: u64 = ps
        .status()
        .await
        .into_iter()
        .map(|s| s.unwrap().counters.unwrap().pushes_applied)
        .sum();
    assert_eq!(applied, 2 * 8 * 40, "every push applied once on each shard");
}

/// A trainer child process: registers, pushes `EDL_TEST_STEPS` sync steps of gradient
/// `EDL_TEST_GRAD` from the current step on, then stays registered and silent.
async fn trainer_child() {
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} not set"));
    let endpoints: Vec<String> = env("EDL_TEST_ETCD").split(',').map(str::to_owned).collect();
    let job = JobName::new(env("EDL_TEST_JOB")).expect("a valid job name");
    let id = env("EDL_TEST_ID");
    let grad: f32 = env("EDL_TEST_GRAD").parse().expect("EDL_TEST_GRAD");
    let steps: u64 = env("EDL_TEST_STEPS").parse().expect("EDL_TEST_STEPS");
    let backend: std::sync::Arc<dyn edl_coord::Backend> = std::sync::Arc::new(
        edl_coord::EtcdBackend::connect(edl_coord::EtcdConfig::new(endpoints))
            .await
            .expect("trainer child"),
    );
    let cancel = tokio_util::sync::CancellationToken::new();
    let _lease = edl_testkit::register_trainer(
        &backend,
        JobKeys::new(&job).trainers(),
        &id,
        Duration::from_secs(2),
        cancel.clone(),
    )
    .await;
    let mut cfg = edl_pserver_client::PsClientConfig::new(job.clone());
    cfg.sync_wait = Duration::from_millis(500);
    let ps = PsClient::connect(backend, cfg, cancel.clone())
        .await
        .expect("trainer child");
    ps.wait_initialised(Duration::from_secs(30))
        .await
        .expect("trainer child");
    println!("registered");
    let start: u64 = env("EDL_TEST_FROM").parse().expect("EDL_TEST_FROM");
    let g = vec![grad; N];
    for step in start..start + steps {
        let out = ps
            .push(&id, step, &[("w", &g)], &[])
            .await
            .expect("trainer child");
        println!("applied {}", out.step);
    }
    println!("idle");
    tokio::time::sleep(Duration::from_secs(600)).await;
}

fn spawn_trainer(w: &World, id: &str, grad: f32, from: u64, steps: u64) -> ChildProcess {
    ChildProcess::spawn_test(
        "pserver::sync_steps_average_live_trainer_processes_through_a_kill_and_a_join",
        "trainer",
        &[
            ("EDL_TEST_ETCD", &w.etcd_arg()),
            ("EDL_TEST_JOB", &w.job),
            ("EDL_TEST_ID", id),
            ("EDL_TEST_GRAD", &grad.to_string()),
            ("EDL_TEST_FROM", &from.to_string()),
            ("EDL_TEST_STEPS", &steps.to_string()),
        ],
    )
    .expect("spawn trainer child")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_steps_average_live_trainer_processes_through_a_kill_and_a_join() {
    if child_role().is_some() {
        trainer_child().await;
        return;
    }
    let w = World::new("ps-sync").await;
    let (_p0, _) = w.pserver("ps0", &["--shards", "2", "--index", "0"]).await;
    let (_p1, _) = w.pserver("ps1", &["--shards", "2", "--index", "1"]).await;
    let ps = w.ps_client().await;
    init(
        &ps,
        &vec![0.0; N],
        config(Mode::sync(), OptimizerConfig::sgd(1.0)),
    )
    .await;
    let _la = w.register_trainer("a").await;
    let _lb = w.register_trainer("b").await;
    // The shards know a and b before c can push: otherwise c's first push, made as soon
    // as it registered, could open and close step 1 on a shard that has not yet seen a
    // and b (it learns the trainers from an etcd watch), and their pushes would be stale.
    wait_participants(&ps, &["a", "b"]).await;
    // Child trainer c pushes 5.0 at steps 1 and 2, then hangs (alive, silent).
    let mut c = spawn_trainer(&w, "c", 5.0, 1, 2);
    c.expect_line("registered", Duration::from_secs(60))
        .await
        .unwrap();
    wait_participants(&ps, &["a", "b", "c"]).await;
    let (a, b) = (w.ps_client().await, w.ps_client().await);
    let (ga, gb) = (vec![1.0f32; N], vec![3.0f32; N]);
    let mut expect = 0.0f32;
    for step in 1..=2u64 {
        let (da, db) = ([("w", ga.as_slice())], [("w", gb.as_slice())]);
        let (ra, rb) = tokio::join!(a.push("a", step, &da, &[]), b.push("b", step, &db, &[]));
        assert_eq!((ra.unwrap().step, rb.unwrap().step), (step, step));
        expect -= (1.0 + 3.0 + 5.0) / 3.0;
        let got = pull(&ps).await;
        assert!(
            got.iter().all(|v| (v - expect).abs() < 1e-5),
            "step {step}: {} != {expect}",
            got[0]
        );
    }
    c.expect_line("idle", Duration::from_secs(30))
        .await
        .unwrap();
    // Step 3: a and b push; c is alive but silent, so the step waits for it. SIGKILL c
    // mid-step: once its lease (2 s) expires the step closes with a and b.
    let pushes = {
        let (a, b) = (a.clone(), b.clone());
        tokio::spawn(async move {
            let (ga, gb) = (vec![1.0f32; N], vec![3.0f32; N]);
            let (da, db) = ([("w", ga.as_slice())], [("w", gb.as_slice())]);
            let (ra, rb) = tokio::join!(a.push("a", 3, &da, &[]), b.push("b", 3, &db, &[]));
            (ra.unwrap().step, rb.unwrap().step)
        })
    };
    wait_contributed(&ps, 3, &["a", "b"]).await;
    assert!(!pushes.is_finished(), "step 3 waits for the silent trainer");
    c.kill().await.unwrap();
    let killed = Instant::now();
    assert_eq!(pushes.await.unwrap(), (3, 3));
    eprintln!("step closed {:?} after the SIGKILL", killed.elapsed());
    expect -= 2.0;
    let got = pull(&ps).await;
    assert!(
        got.iter().all(|v| (v - expect).abs() < 1e-5),
        "{} != {expect}",
        got[0]
    );
    // A new trainer process joins before step 4: steps 4 and 5 average a, b and d.
    let mut d = spawn_trainer(&w, "d", 8.0, 4, 2);
    d.expect_line("registered", Duration::from_secs(60))
        .await
        .unwrap();
    wait_participants(&ps, &["a", "b", "d"]).await;
    for step in 4..=5u64 {
        let (da, db) = ([("w", ga.as_slice())], [("w", gb.as_slice())]);
        let (ra, rb) = tokio::join!(a.push("a", step, &da, &[]), b.push("b", step, &db, &[]));
        assert_eq!((ra.unwrap().step, rb.unwrap().step), (step, step));
        expect -= (1.0 + 3.0 + 8.0) / 3.0;
        let got = pull(&ps).await;
        assert!(
            got.iter().all(|v| (v - expect).abs() < 1e-4),
            "step {step}: {} != {expect}",
            got[0]
        );
    }
    d.expect_line("idle", Duration::from_secs(30))
        .await
        .unwrap();
}

/// Waits until `checkpoints/latest` is at least `step`.
async fn wait_checkpoint(w: &World, step: u64) {
    let key = JobKeys::new(&JobName::new(w.job.as_str()).expect("a valid job name")).latest();
    let ok = wait_until(Duration::from_secs(30), || async {
        w.backend.get(&key).await.ok().flatten().is_some_and(|kv| {
            std::str::from_utf8(&kv.value)
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
                .is_some_and(|s| s >= step)
        })
    })
    .await;
    assert!(ok, "no checkpoint of step {step} committed");
}

/// Runs sync steps `from..=to` by trainer "a" with a gradient depending on the step and
/// the position; returns the parameters after each step.
async fn train(ps: &PsClient, from: u64, to: u64, seen: &mut BTreeMap<u64, Vec<f32>>) {
    for step in from..=to {
        let g: Vec<f32> = (0..N)
            .map(|i| ((i as u64 * 7 + step) % 11) as f32 - 5.0)
            .collect();
        let out = ps.push("a", step, &[("w", &g)], &[]).await.expect("push");
        assert_eq!(out.step, step);
        seen.insert(step, pull(ps).await);
    }
}

/// The values of shard `shard`'s blocks of `w` in `v`, by offset.
async fn shard_part(ps: &PsClient, shard: u32, v: &[f32]) -> Vec<(usize, Vec<f32>)> {
    let layout = ps.layout().await.expect("layout");
    layout
        .param_blocks(0)
        .iter()
        .filter(|b| b.shard == shard)
        .map(|b| (b.offset, v[b.offset..b.offset + b.len].to_vec()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_pserver_restores_its_checkpoint_and_training_continues() {
    let w = World::new("ps-kill").await;
    let every = ["--checkpoint-every", "2", "--shards", "2"];
    let (_p0, _) = w
        .pserver("ps0", &[&every[..], &["--index", "0"]].concat())
        .await;
    let (mut p1, a1) = w
        .pserver("ps1", &[&every[..], &["--index", "1"]].concat())
        .await;
    let ps = w.ps_client().await;
    init(
        &ps,
        &vec![0.0; N],
        config(Mode::sync(), OptimizerConfig::adam(0.01)),
    )
    .await;
    let _la = w.register_trainer("a").await;
    wait_participants(&ps, &["a"]).await;
    let mut seen = BTreeMap::new();
    train(&ps, 1, 5, &mut seen).await;
    wait_checkpoint(&w, 4).await;
    p1.kill();
    let killed = Instant::now();
    // A fresh pserver takes index 1 once the dead one's lease ends, restores step 4.
    let (p1b, a1b) = w
        .pserver("ps1b", &[&every[..], &["--index", "1"]].concat())
        .await;
    assert_ne!(a1, a1b);
    p1b.wait_log("restored from checkpoint", Duration::from_secs(10))
        .await;
    let st = ps.shard_status(1).await.unwrap();
    assert_eq!(st.restored_from, 4);
    eprintln!(
        "shard 1 serving again {:?} after the SIGKILL",
        killed.elapsed()
    );
    // The trainer's client follows ps/1 to the new address: shard 1 holds exactly the
    // checkpointed parameters of step 4, shard 0 those of step 5.
    let now = pull(&ps).await;
    assert_eq!(
        shard_part(&ps, 1, &now).await,
        shard_part(&ps, 1, &seen[&4]).await
    );
    assert_eq!(
        shard_part(&ps, 0, &now).await,
        shard_part(&ps, 0, &seen[&5]).await
    );
    // Training continues (the restored shard's step counter catches up) and it keeps
    // checkpointing.
    train(&ps, 6, 8, &mut seen).await;
    wait_checkpoint(&w, 8).await;
    let st = ps.shard_status(1).await.unwrap();
    assert!(st.last_checkpoint >= 8, "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pserver_paused_past_its_ttl_and_replaced_never_serves_again() {
    let w = World::new("ps-stop").await;
    let (mut old, old_addr) = w.pserver("old", &["--shards", "1", "--index", "0"]).await;
    let ps = w.ps_client().await;
    init(
        &ps,
        &vec![1.0; N],
        config(Mode::Async, OptimizerConfig::sgd(1.0)),
    )
    .await;
    let mut cache = DenseCache::new();
    ps.seed_cache(&mut cache, &[vec![1.0; N], vec![0.5]])
        .await
        .unwrap();
    ps.pull_dense(&mut cache).await.unwrap();
    old.signal("STOP");
    let key = JobKeys::new(&JobName::new(w.job.as_str()).expect("a valid job name")).ps(0);
    let expired = wait_until(Duration::from_secs(10), || async {
        w.backend.get(&key).await.is_ok_and(|kv| kv.is_none())
    })
    .await;
    assert!(expired, "the stopped pserver's claim never expired");
    let (_new, new_addr) = w.pserver("new", &["--index", "0"]).await;
    // The trainer follows ps/0 to the replacement, which it initialises again from its
    // copy (no checkpoint was taken yet).
    ps.pull_dense(&mut cache).await.unwrap();
    assert!(cache.get("w").unwrap().iter().all(|v| *v == 1.0));
    // A call sent while the old pserver is still stopped waits in its socket; it is the
    // first thing the process sees when it resumes, with its lease long expired. It must
    // be refused (and so must anything later, until the process exits).
    let port: u16 = old_addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("the old pserver's port");
    let queued = edl_testkit::unread_at(port);
    let early = {
        let (addr, job) = (old_addr.clone(), w.job.clone());
        tokio::spawn(async move { probe(&addr, &job, None, None, Duration::from_secs(10)).await })
    };
    // The call is in the stopped process's socket (the kernel accepts the connection
    // and queues the request: more than 100 bytes) before it resumes.
    let sent = wait_until(Duration::from_secs(10), || async {
        edl_testkit::unread_at(port) >= queued + 100
    })
    .await;
    assert!(
        sent,
        "the early call never reached the stopped pserver's socket"
    );
    old.signal("CONT");
    for r in [
        early.await.unwrap(),
        probe(&old_addr, &w.job, None, None, Duration::from_secs(5)).await,
    ] {
        match r {
            Ok(st) => panic!("the replaced pserver served a status call: {st:?}"),
            Err(e) => {
                eprintln!("replaced pserver: {e}");
                assert!(
                    e.kind() == Some(ErrorKind::NotServing)
                        || matches!(
                            e,
                            PsClientError::Connect { .. } | PsClientError::ProbeRefused { .. }
                        ),
                    "{e}"
                );
            }
        }
    }
    let status = old.wait_exit(Duration::from_secs(10)).await;
    assert!(
        !status.success(),
        "the replaced pserver exits with an error"
    );
    old.wait_log("etcd lease lost", Duration::from_secs(1))
        .await;
    // ps/0 is still the replacement's, and it serves.
    let kv = w.backend.get(&key).await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&kv.value).contains(&new_addr));
    ps.push("t", 1, &[("w", &vec![1.0; N])], &[]).await.unwrap();
    ps.pull_dense(&mut cache).await.unwrap();
    assert!(cache.get("w").unwrap().iter().all(|v| *v == 0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_checkpoint_file_falls_back_to_the_previous_checkpoint() {
    let w = World::new("ps-corrupt").await;
    let args = ["--checkpoint-every", "2", "--shards", "1", "--index", "0"];
    let (mut p, _) = w.pserver("ps", &args).await;
    let ps = w.ps_client().await;
    init(
        &ps,
        &vec![0.0; N],
        config(Mode::sync(), OptimizerConfig::sgd(0.5)),
    )
    .await;
    let _la = w.register_trainer("a").await;
    wait_participants(&ps, &["a"]).await;
    let mut seen = BTreeMap::new();
    train(&ps, 1, 4, &mut seen).await;
    wait_checkpoint(&w, 4).await;
    // Killed: no final checkpoint.
    p.signal("KILL");
    p.wait_exit(Duration::from_secs(10)).await;
    // Flip a byte in the middle of step 4's file.
    let keys = JobKeys::new(&JobName::new(w.job.as_str()).expect("a valid job name"));
    let manifests = ckpt::manifests(&*w.backend, &keys).await.unwrap();
    assert_eq!(
        manifests.iter().map(|m| m.step).collect::<Vec<_>>(),
        vec![4, 2]
    );
    let path = manifests[0].entry(0).unwrap().path.clone();
    let mut bytes = std::fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x5a;
    std::fs::write(&path, bytes).unwrap();
    // <root>/<job>/ps-0/<file>.
    let root = std::path::Path::new(&path)
        .ancestors()
        .nth(3)
        .expect("<root>/<job>/ps-0/<file>");
    let dir = checkpoint::CheckpointDir::new(
        root,
        &JobName::new(w.job.as_str()).expect("a valid job name"),
        0,
    );
    assert!(matches!(
        dir.read(manifests[0].entry(0).unwrap(), 0, 1),
        Err(checkpoint::CheckpointError::Corrupt { .. })
    ));
    let (p2, _) = w.pserver("ps2", &args).await;
    p2.wait_log("restored from checkpoint", Duration::from_secs(10))
        .await;
    let log = p2.log();
    assert!(
        log.contains("checkpoint unusable; falling back to the previous checkpoint"),
        "{log}"
    );
    assert!(log.contains("crc32c mismatch"), "{log}");
    assert!(log.contains(&path), "the message names the file: {log}");
    assert_eq!(pull(&ps).await, seen[&2], "parameters of step 2");
    assert_eq!(ps.shard_status(0).await.unwrap().restored_from, 2);
    // The trainer is at step 5; the shard's counter jumps and training continues.
    train(&ps, 5, 6, &mut seen).await;
    let err = ps.push("a", 6, &[("w", &vec![0.0; N])], &[]).await.unwrap();
    assert!(!err.applied, "a retried step is not applied twice");
}
