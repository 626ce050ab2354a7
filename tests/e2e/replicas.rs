//! Replicated shards (docs/replication.md) across real `edl pserver --replicas 2`
//! processes and a real etcd: a SIGKILLed primary, a SIGSTOPped one, and one cut off
//! from etcd by a partition (a loopback proxy) while a client still reaches it.

use std::time::Duration;

use edl_job::{JobKeys, JobName};
use edl_pserver_client::{Mode, OptimizerConfig, PsClient};
use tokio::time::Instant;

use crate::pserver::{N, config, init, pull};
use crate::support::{Proc, World, wait_until};

/// The group record of shard 0 of `w`'s job, if written.
async fn group(w: &World) -> Option<edl_job::GroupRecord> {
    use edl_job::Record;
    let keys = JobKeys::new(&JobName::new(w.job.as_str()).expect("a valid job name"));
    let kv = w
        .backend
        .get(&keys.ps_group(0))
        .await
        .expect("read the group")?;
    edl_job::GroupRecord::decode(&kv.value).ok()
}

/// The pserver arguments of a replica of shard 0 of 1, with two replicas.
const REPLICA: [&str; 6] = ["--shards", "1", "--index", "0", "--replicas", "2"];

/// Starts shard 0's primary (`psa`, reaching etcd at `etcd`), connects a client with
/// `connect` and initialises the shard through it (async SGD, learning rate 1), starts
/// the backup (`psb`) and waits until it is in sync; the two processes, the primary's
/// address and the client.
async fn pair(
    w: &World,
    etcd: &str,
    connect: impl AsyncFnOnce() -> PsClient,
) -> (Proc, Proc, String, PsClient) {
    let (a, a_addr) = w.pserver_via("psa", etcd, &REPLICA).await;
    let ps = connect().await;
    init(
        &ps,
        &vec![0.0; N],
        config(Mode::Async, OptimizerConfig::sgd(1.0)),
    )
    .await;
    let (b, _) = w.pserver("psb", &REPLICA).await;
    let synced = wait_until(Duration::from_secs(30), || async {
        group(w).await.is_some_and(|g| g.backups.len() == 1)
    })
    .await;
    assert!(
        synced,
        "the second replica never got in sync: {:?}\nprimary:\n{}\nbackup:\n{}",
        group(w).await,
        a.log(),
        b.log()
    );
    (a, b, a_addr, ps)
}

/// Waits until `backup` is promoted over the group `before`: the epoch raised by one and
/// `backup` primary; the new record.
async fn promoted(w: &World, before: &edl_job::GroupRecord, backup: &Proc) -> edl_job::GroupRecord {
    let promoted = wait_until(Duration::from_secs(20), || async {
        group(w).await.is_some_and(|r| r.epoch == before.epoch + 1)
    })
    .await;
    assert!(
        promoted,
        "the backup was never promoted: {:?}",
        group(w).await
    );
    let after = group(w).await.expect("the group after the promotion");
    assert!(
        after.primary.starts_with(&format!("0-{}-", backup.pid())),
        "{after:?}"
    );
    after
}

/// Replicated shards (docs/replication.md): two `edl pserver --replicas 2` processes hold
/// shard 0. The primary is SIGKILLed after 30 acknowledged pushes; its in-sync backup
/// takes over with every one of them (nothing read from a checkpoint, the same
/// incarnation), and the trainer's pushes go on to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_primary_is_replaced_by_its_backup_with_every_acknowledged_push() {
    let w = World::new("ps-repl").await;
    let (mut a, b, _, ps) = pair(&w, &w.etcd_arg(), async || w.ps_client().await).await;
    let before = group(&w).await.unwrap();
    assert!(
        before.primary.starts_with(&format!("0-{}-", a.pid())),
        "{before:?}"
    );
    let shown = status(&w).await;
    assert!(
        shown.contains(&format!("replicas in sync 2/2  epoch {}", before.epoch))
            && shown.contains(&format!("primary  0-{}-", a.pid()))
            && shown.contains(&format!("in sync  0-{}-", b.pid())),
        "edl status:\n{shown}"
    );
    let g = vec![1.0f32; N];
    for k in 1..=30u64 {
        let out = ps.push("t", k, &[("w", &g)], &[]).await.unwrap();
        assert!(out.applied);
    }
    a.kill();
    let killed = Instant::now();
    // The pushes wait out the failover (the client retries) and reach the new primary.
    for k in 31..=40u64 {
        let out = ps.push("t", k, &[("w", &g)], &[]).await.unwrap();
        assert!(out.applied, "push {k}");
    }
    eprintln!(
        "pushes served again {:?} after the SIGKILL",
        killed.elapsed()
    );
    let after = group(&w).await.unwrap();
    assert!(
        after.primary.starts_with(&format!("0-{}-", b.pid())),
        "{after:?}"
    );
    assert_eq!(after.epoch, before.epoch + 1);
    assert_eq!(
        after.incarnation, before.incarnation,
        "a promotion, not a restore"
    );
    // Every acknowledged push is in: 40 pushes of 1.0 at learning rate 1.
    let got = pull(&ps).await;
    assert!(got.iter().all(|v| *v == -40.0), "{:?}", &got[..4]);
    assert!(!b.log().contains("restored from checkpoint"));
    b.wait_log("primary: shard claimed", Duration::from_secs(5))
        .await;
    let st = ps.shard_status(0).await.unwrap();
    assert_eq!(st.counters.unwrap().pushes_applied, 40);
    let shown = status(&w).await;
    eprintln!("edl status after the failover:\n{shown}");
    assert!(
        shown.contains(&format!("epoch {}", after.epoch))
            && shown.contains(&format!("primary  0-{}-", b.pid())),
        "edl status:\n{shown}"
    );
}

/// What `edl status` prints for `w`'s job (a spec is written first: `edl status` shows
/// the jobs that have one).
async fn status(w: &World) -> String {
    let job = JobName::new(w.job.as_str()).expect("a valid job name");
    let spec = edl_job::JobSpec::parse_toml(&format!(
        "name = \"{job}\"\n[data]\ntrain = \"none-*.recordio\"\n[model]\nkind = \"fit_a_line\"\n"
    ))
    .expect("a minimal spec");
    w.backend
        .put(&JobKeys::new(&job).spec(), spec.to_stored(), None)
        .await
        .expect("write the spec");
    let (ok, out, err) = crate::run::edl_cmd(&["status", "--etcd", &w.etcd_arg(), &w.job]);
    assert!(ok, "edl status failed: {err}");
    out
}

/// Replicated shards: a SIGSTOPped primary is replaced once its lease ends. A push that
/// reached it while it was stopped is never acknowledged by it: when it resumes, its
/// lease is gone, it refuses and exits, and the client's retry is applied once, at the
/// new primary. The new primary holds every push, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigstopped_primary_is_replaced_and_acknowledges_nothing_after() {
    let w = World::new("ps-repl-stop").await;
    let (mut a, b, a_addr, ps) = pair(&w, &w.etcd_arg(), async || w.ps_client().await).await;
    let a_port: u16 = a_addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("the primary's port");
    let before = group(&w).await.unwrap();
    let g = vec![1.0f32; N];
    for k in 1..=20u64 {
        ps.push("t", k, &[("w", &g)], &[]).await.unwrap();
    }
    a.signal("STOP");
    // A push sent to the stopped primary: it waits in its socket, then is retried.
    let queued = edl_testkit::unread_at(a_port);
    let late = {
        let ps = ps.clone();
        let g = g.clone();
        tokio::spawn(async move { ps.push("t", 21, &[("w", &g)], &[]).await })
    };
    let reached = wait_until(Duration::from_secs(10), || async {
        edl_testkit::unread_at(a_port) >= queued + 1000
    })
    .await;
    assert!(
        reached,
        "the push never reached the stopped primary's socket"
    );
    promoted(&w, &before, &b).await;
    a.signal("CONT");
    let status = a.wait_exit(Duration::from_secs(10)).await;
    assert!(
        !status.success(),
        "the replaced primary exits with an error"
    );
    a.wait_log("etcd lease lost", Duration::from_secs(1)).await;
    late.await
        .unwrap()
        .expect("the push sent during the stop is served by the new primary");
    for k in 22..=30u64 {
        ps.push("t", k, &[("w", &g)], &[]).await.unwrap();
    }
    let got = pull(&ps).await;
    assert!(got.iter().all(|v| *v == -30.0), "{:?}", &got[..4]);
    let st = ps.shard_status(0).await.unwrap();
    assert_eq!(
        st.counters.unwrap().pushes_applied,
        30,
        "each push applied once"
    );
}

/// Replicated shards under a partition: the primary and one trainer are cut off from
/// etcd (each reaches it through a loopback proxy that stops forwarding), while the
/// trainer still reaches the primary and the backup still reaches etcd. The primary's
/// lease ends at etcd and the backup is promoted; the old primary, still running and
/// still reached by the trainer that cannot learn of the promotion, refuses its push
/// (its lease is not confirmed) instead of acknowledging it. Once healed, the old
/// primary learns its lease is gone and exits, the trainer finds the new primary, and
/// its retried push is applied there once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_partitioned_from_etcd_acknowledges_nothing_after_its_backup_took_over() {
    use edl_testkit::proxy::Proxy;
    let w = World::new("ps-repl-cut").await;
    let etcd_addr: std::net::SocketAddr = w
        .etcd
        .endpoint(0)
        .trim_start_matches("http://")
        .parse()
        .expect("etcd's address");
    let a_etcd = Proxy::start(etcd_addr)
        .await
        .expect("a proxy for the primary");
    let t_etcd = Proxy::start(etcd_addr)
        .await
        .expect("a proxy for the trainer");
    let via = format!("http://{}", a_etcd.addr());
    let cfg = edl_coord::EtcdConfig::new(vec![format!("http://{}", t_etcd.addr())])
        .with_dial_timeout(Duration::from_secs(2))
        .with_request_timeout(Duration::from_secs(2));
    let t_backend: std::sync::Arc<dyn edl_coord::Backend> = std::sync::Arc::new(
        edl_coord::EtcdBackend::connect(cfg)
            .await
            .expect("the trainer's etcd"),
    );
    let mut ps_cfg = edl_pserver_client::PsClientConfig::new(
        JobName::new(w.job.as_str()).expect("a valid job name"),
    );
    ps_cfg.retry_for = Duration::from_secs(4);
    let connect = async || {
        edl_pserver_client::PsClient::connect(t_backend, ps_cfg, w.cancel.child_token())
            .await
            .expect("the trainer's pserver client")
    };
    let (mut a, b, _, ps) = pair(&w, &via, connect).await;
    let g = vec![1.0f32; N];
    for k in 1..=20u64 {
        assert!(ps.push("t", k, &[("w", &g)], &[]).await.unwrap().applied);
    }
    let before = group(&w).await.unwrap();
    assert!(
        before.primary.starts_with(&format!("0-{}-", a.pid())),
        "{before:?}"
    );

    a_etcd.cut();
    t_etcd.cut();
    promoted(&w, &before, &b).await;
    // The old primary runs, and the trainer (cut from etcd) still sends to it.
    assert!(a.running(), "the old primary exited:\n{}", a.log());
    let refused = ps
        .push("t", 21, &[("w", &g)], &[])
        .await
        .expect_err("the old primary acknowledged a push after its backup took over");
    let said = refused.to_string();
    assert!(
        // The process's gate or the replica's own check: either refuses.
        said.contains("etcd lease of shard 0 is not confirmed")
            || said.contains("etcd lease of shard 0's primary is not confirmed"),
        "the push was not refused by the old primary: {said}"
    );

    a_etcd.heal();
    t_etcd.heal();
    let status = a.wait_exit(Duration::from_secs(20)).await;
    assert!(
        !status.success(),
        "the replaced primary exits with an error"
    );
    a.wait_log("etcd lease lost", Duration::from_secs(1)).await;
    // The trainer's retry of push 21 (the same session) reaches the new primary.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match ps.push("t", 21, &[("w", &g)], &[]).await {
            Ok(out) => {
                assert!(out.applied, "push 21 was applied before");
                break;
            }
            Err(e) => assert!(Instant::now() < deadline, "push 21 never served: {e}"),
        }
    }
    for k in 22..=30u64 {
        assert!(ps.push("t", k, &[("w", &g)], &[]).await.unwrap().applied);
    }
    let got = pull(&ps).await;
    assert!(got.iter().all(|v| *v == -30.0), "{:?}", &got[..4]);
    let st = ps.shard_status(0).await.unwrap();
    assert_eq!(
        st.counters.unwrap().pushes_applied,
        30,
        "each push applied once"
    );
    assert!(!b.log().contains("restored from checkpoint"));
}
