//! Fault tests against real etcd processes: SIGKILLed and SIGSTOPped lease holders
//! and leaders (child processes re-executing this test binary), etcd paused or
//! restarted, and a three-member cluster losing a member or its quorum.
//!
//! Every wait is a condition with a deadline; ports come from port 0. Also here (one test
//! binary): TLS to a real etcd that requires client certificates ([`tls`]); a snapshot
//! restored by etcd's own tool ([`snapshot`]).

#[path = "etcd/snapshot.rs"]
mod snapshot;
#[path = "etcd/tls.rs"]
mod tls;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use edl_coord::{
    Backend, Election, Error, EtcdBackend, EtcdConfig, EventKind, Lease, LeaseState, MemberEvent,
    Op, Registry, claim_index,
};
use edl_testkit::{ChildProcess, EtcdCluster, child_role, wait_until};
use futures::StreamExt;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const TTL: Duration = Duration::from_secs(2);
/// Slack allowed on top of a TTL for etcd's expiry check (every 500 ms) and
/// scheduling on a loaded machine.
const SLACK: Duration = Duration::from_secs(1);
/// Upper bound on how long a child process lives.
const CHILD_MAX_LIFE: Duration = Duration::from_secs(120);

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("child needs {name}"))
}

async fn connect(endpoints: &[String]) -> Arc<dyn Backend> {
    let cfg = EtcdConfig::new(endpoints.iter().cloned())
        .with_dial_timeout(Duration::from_secs(2))
        .with_request_timeout(Duration::from_secs(1));
    Arc::new(EtcdBackend::connect(cfg).await.expect("connect to etcd"))
}

/// Entry point of the child processes: a no-op unless started by `ChildProcess`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_entry() {
    let Some(role) = child_role() else { return };
    if role == "etcd-owner" {
        // Starts etcd and waits to be killed.
        let cluster = EtcdCluster::start(1).await.unwrap();
        println!("ETCD_DIR {}", cluster.dir().display());
        println!("ETCD_PID {}", cluster.pid(0).unwrap());
        tokio::time::sleep(CHILD_MAX_LIFE).await;
        return;
    }
    let endpoints: Vec<String> = env("EDL_TEST_ENDPOINTS")
        .split(',')
        .map(str::to_owned)
        .collect();
    let backend = connect(&endpoints).await;
    let deadline = tokio::time::sleep(CHILD_MAX_LIFE);
    match role.as_str() {
        // Holds a lease with a key on it until killed.
        "lease-holder" => {
            let lease = Lease::grant(backend.clone(), TTL, CancellationToken::new())
                .await
                .unwrap();
            backend
                .put(&env("EDL_TEST_KEY"), b"held".to_vec(), Some(lease.id()))
                .await
                .unwrap();
            println!("READY {}", lease.id());
            deadline.await;
        }
        // Campaigns, then writes fenced every 100 ms, reporting each change of outcome
        // and the loss of its lease. Keeps writing after `lost` on purpose: it plays a
        // leader that has not noticed it was deposed.
        "candidate" => {
            let lease = Lease::grant(backend.clone(), TTL, CancellationToken::new())
                .await
                .unwrap();
            let election = Election::new(backend.clone(), env("EDL_TEST_ELECTION"));
            let leadership = election
                .campaign(
                    &lease,
                    env("EDL_TEST_VALUE").into_bytes(),
                    &CancellationToken::new(),
                )
                .await
                .unwrap();
            println!("LEADER {}", leadership.revision());
            let state = env("EDL_TEST_STATE");
            let mut last = String::new();
            let mut lost_reported = false;
            tokio::pin!(deadline);
            loop {
                let outcome = match leadership
                    .fenced_txn(vec![Op::put(&state, env("EDL_TEST_VALUE"))])
                    .await
                {
                    Ok(_) => "ok".to_owned(),
                    Err(Error::NotLeader) => "not-leader".to_owned(),
                    Err(e) => format!("error {e}"),
                };
                if outcome != last {
                    println!("WRITE {outcome}");
                    last = outcome;
                }
                if lease.is_lost() && !lost_reported {
                    println!("LOST");
                    lost_reported = true;
                }
                tokio::select! {
                    _ = &mut deadline => return,
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
        }
        other => panic!("unknown child role {other}"),
    }
}

fn spawn_child(role: &str, endpoints: &[String], envs: &[(&str, &str)]) -> ChildProcess {
    let joined = endpoints.join(",");
    let mut all = vec![("EDL_TEST_ENDPOINTS", joined.as_str())];
    all.extend_from_slice(envs);
    ChildProcess::spawn_test("child_entry", role, &all).expect("spawn child")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_to_unreachable_endpoints_names_them() {
    let ports: Vec<u16> = (0..2)
        .map(|_| {
            std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .unwrap()
        })
        .collect();
    let endpoints: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let cfg = EtcdConfig::new(endpoints.clone()).with_dial_timeout(Duration::from_millis(500));
    let err = EtcdBackend::connect(cfg)
        .await
        .expect_err("nothing listens there");
    assert!(err.is_retryable());
    let msg = err.to_string();
    eprintln!("{msg}");
    for e in &endpoints {
        assert!(msg.contains(e.as_str()), "{msg}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_holder_sigkill_key_disappears_within_ttl() {
    let cluster = EtcdCluster::start(1).await.unwrap();
    let backend = cluster.connect().await.unwrap();
    let key = "/faults/sigkill/holder";
    let mut child = spawn_child(
        "lease-holder",
        &cluster.endpoints(),
        &[("EDL_TEST_KEY", key)],
    );
    child
        .expect_line("READY", Duration::from_secs(20))
        .await
        .unwrap();
    let kv = backend.get(key).await.unwrap().expect("child registered");
    let mut watch = backend
        .watch_prefix(key, Some(kv.mod_revision + 1))
        .await
        .unwrap();

    child.kill().await.unwrap();
    let killed = Instant::now();
    let ev = tokio::time::timeout(TTL + SLACK, watch.next())
        .await
        .expect("key deleted within ttl + 1 s")
        .unwrap()
        .unwrap();
    assert_eq!((ev.kind, ev.kv.key.as_str()), (EventKind::Delete, key));
    eprintln!(
        "key deleted {:?} after SIGKILL (ttl {TTL:?})",
        killed.elapsed()
    );
}

/// A single-member etcd paused past the TTL: its holders' leases are uncertain while it
/// is stopped (nothing told them they ended), and lost once it resumes: the paused
/// member still leads and ends the leases that expired by its own clock meanwhile
/// (etcd's behaviour; a cluster that loses its quorum does not do this, see
/// `quorum_loss_longer_than_the_ttl_leaves_leases_uncertain_then_held`). Registering
/// the same id under a new lease then works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_etcd_paused_past_the_ttl_leaves_leases_uncertain_then_ends_them() {
    let cluster = EtcdCluster::start(1).await.unwrap();
    let backend = connect(&cluster.endpoints()).await;
    let registry = Registry::new(backend.clone(), "/faults/paused/trainers");
    let lease = Lease::grant(backend.clone(), TTL, CancellationToken::new())
        .await
        .unwrap();
    registry
        .register("t0", b"a".to_vec(), &lease)
        .await
        .unwrap();
    let mut state = lease.watch_state();

    cluster.pause(0).unwrap();
    let paused = Instant::now();
    tokio::time::timeout(TTL + SLACK, state.wait_for(|s| *s == LeaseState::Uncertain))
        .await
        .expect("uncertain within the ttl while etcd is stopped")
        .unwrap();
    assert!(!lease.is_held());
    // Keep etcd stopped for twice the TTL: still uncertain, never lost meanwhile.
    while paused.elapsed() < 2 * TTL {
        assert!(!lease.is_lost(), "lost while etcd was stopped");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(lease.state(), LeaseState::Uncertain);
    cluster.resume(0).unwrap();
    tokio::time::timeout(TTL + SLACK, lease.lost().cancelled())
        .await
        .expect("etcd, resumed, ends the lease and the holder is told");
    assert_eq!(lease.state(), LeaseState::Lost);

    // Once etcd is back: a new lease, and registering the same id works (after the
    // server ended the old lease, which it does on its own within a second).
    let fresh = edl_coord::retry(&edl_coord::RetryPolicy::default(), || {
        Lease::grant(backend.clone(), TTL, CancellationToken::new())
    })
    .await
    .unwrap();
    let give_up = Instant::now() + TTL + 2 * SLACK;
    loop {
        match registry.register("t0", b"b".to_vec(), &fresh).await {
            Ok(_) => break,
            Err(e) if Instant::now() < give_up => {
                eprintln!("re-register not yet possible: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("re-registering failed: {e}"),
        }
    }
    let (members, _) = registry.list().await.unwrap();
    assert_eq!(members.len(), 1);
    assert_eq!(members[0].lease, Some(fresh.id()));
}

/// A three-member cluster without quorum for longer than the TTL (both followers
/// SIGSTOPped; the leader steps down) leaves leases uncertain, never lost. When the followers
/// resume, the new raft leader extends every lease and the holders are confirmed
/// again: the keys under the lease and the leadership it carries survive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_loss_longer_than_the_ttl_leaves_leases_uncertain_then_held() {
    let cluster = EtcdCluster::start(3).await.unwrap();
    let leader = cluster.leader().await.expect("a raft leader");
    let backend = connect(&cluster.endpoints()).await;
    let key = "/faults/quorum/held";
    let lease = Lease::grant(backend.clone(), TTL, CancellationToken::new())
        .await
        .unwrap();
    backend
        .put(key, b"held".to_vec(), Some(lease.id()))
        .await
        .unwrap();
    let leadership = Election::new(backend.clone(), "/faults/quorum/election")
        .campaign(&lease, b"l".to_vec(), &CancellationToken::new())
        .await
        .unwrap();
    let mut state = lease.watch_state();

    let followers: Vec<usize> = (0..cluster.len()).filter(|i| *i != leader).collect();
    for &f in &followers {
        cluster.pause(f).unwrap();
    }
    // The leader renews leases on its own until it steps down for want of a quorum
    // (within two election timeouts, 2 s here); the lease is uncertain a TTL after the
    // last renewal it confirmed.
    tokio::time::timeout(
        Duration::from_secs(2) + TTL + SLACK,
        state.wait_for(|s| *s == LeaseState::Uncertain),
    )
    .await
    .expect("uncertain without a quorum")
    .unwrap();
    // Without a quorum for two more TTLs: a lease etcd ended would have ended by now.
    let uncertain = Instant::now();
    while uncertain.elapsed() < 2 * TTL {
        assert!(!lease.is_lost(), "lease lost to a quorum loss");
        assert!(!leadership.is_lost(), "leadership lost to a quorum loss");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(lease.state(), LeaseState::Uncertain);
    for &f in &followers {
        cluster.resume(f).unwrap();
    }
    let resumed = Instant::now();
    tokio::time::timeout(
        Duration::from_secs(15),
        state.wait_for(|s| *s == LeaseState::Held),
    )
    .await
    .expect("held again once the quorum is back")
    .unwrap();
    eprintln!(
        "lease held again {:?} after the followers resumed",
        resumed.elapsed()
    );
    let retry = edl_coord::RetryPolicy::default();
    let kv = edl_coord::retry(&retry, || backend.get(key))
        .await
        .unwrap()
        .expect("the key outlived the quorum loss");
    assert_eq!(kv.lease, Some(lease.id()));
    edl_coord::retry(&retry, || {
        leadership.fenced_txn(vec![Op::put("/faults/quorum/state", "after")])
    })
    .await
    .expect("the leader still leads");
    assert!(!lease.is_lost() && !leadership.is_lost());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_sigkill_follower_takes_over_within_ttl() {
    let cluster = EtcdCluster::start(1).await.unwrap();
    let backend = cluster.connect().await.unwrap();
    let prefix = "/faults/failover/election";
    let mut child = spawn_child(
        "candidate",
        &cluster.endpoints(),
        &[
            ("EDL_TEST_ELECTION", prefix),
            ("EDL_TEST_VALUE", "child"),
            ("EDL_TEST_STATE", "/faults/failover/state"),
        ],
    );
    child
        .expect_line("LEADER", Duration::from_secs(20))
        .await
        .unwrap();

    let lease = Lease::grant(backend.clone(), TTL, CancellationToken::new())
        .await
        .unwrap();
    let election = Election::new(backend.clone(), prefix);
    let follower = {
        let election = election.clone();
        tokio::spawn(async move {
            let l = election
                .campaign(&lease, b"follower".to_vec(), &CancellationToken::new())
                .await;
            (l, Instant::now(), lease)
        })
    };
    // The follower is in line behind the child.
    assert!(
        wait_until(
            Duration::from_secs(5),
            Duration::from_millis(20),
            || async { backend.range(election.prefix()).await.unwrap().0.len() == 2 }
        )
        .await
    );
    assert!(!follower.is_finished());

    child.kill().await.unwrap();
    let killed = Instant::now();
    let (leadership, elected_at, _lease) = tokio::time::timeout(TTL + SLACK, follower)
        .await
        .expect("follower leads within ttl + 1 s")
        .unwrap();
    let leadership = leadership.unwrap();
    eprintln!("failover took {:?} (ttl {TTL:?})", elected_at - killed);
    assert_eq!(election.leader().await.unwrap().unwrap().value, b"follower");
    leadership
        .fenced_txn(vec![Op::put("/faults/failover/state", "follower")])
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deposed_leader_fenced_write_fails_after_sigstop() {
    let cluster = EtcdCluster::start(1).await.unwrap();
    let backend = cluster.connect().await.unwrap();
    let prefix = "/faults/deposed/election";
    let state = "/faults/deposed/state";
    let mut child = spawn_child(
        "candidate",
        &cluster.endpoints(),
        &[
            ("EDL_TEST_ELECTION", prefix),
            ("EDL_TEST_VALUE", "old"),
            ("EDL_TEST_STATE", state),
        ],
    );
    child
        .expect_line("LEADER", Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(
        child
            .expect_line("WRITE", Duration::from_secs(5))
            .await
            .unwrap(),
        "ok"
    );

    let lease = Lease::grant(backend.clone(), TTL, CancellationToken::new())
        .await
        .unwrap();
    let election = Election::new(backend.clone(), prefix);
    let follower = {
        let election = election.clone();
        tokio::spawn(async move {
            let l = election
                .campaign(&lease, b"new".to_vec(), &CancellationToken::new())
                .await;
            (l, lease)
        })
    };
    assert!(
        wait_until(
            Duration::from_secs(5),
            Duration::from_millis(20),
            || async { backend.range(election.prefix()).await.unwrap().0.len() == 2 }
        )
        .await
    );

    // The old leader freezes past its TTL; the follower takes over meanwhile.
    child.pause().unwrap();
    let (leadership, _lease) = tokio::time::timeout(TTL + SLACK, follower)
        .await
        .expect("follower leads while the old leader is frozen")
        .unwrap();
    let leadership = leadership.unwrap();
    leadership
        .fenced_txn(vec![Op::put(state, "new")])
        .await
        .unwrap();

    // The old leader wakes up believing it leads: its fenced writes are refused, and
    // its lease reports the loss.
    child.resume().unwrap();
    assert_eq!(
        child
            .expect_line("WRITE", Duration::from_secs(10))
            .await
            .unwrap(),
        "not-leader"
    );
    child
        .expect_line("LOST", Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(backend.get(state).await.unwrap().unwrap().value, b"new");
    assert!(leadership.is_leader().await.unwrap());
}

fn summary(ev: &MemberEvent) -> (&'static str, String) {
    match ev {
        MemberEvent::Joined(m) => ("joined", m.id.clone()),
        MemberEvent::Updated(m) => ("updated", m.id.clone()),
        MemberEvent::Left(m) => ("left", m.id.clone()),
    }
}

async fn next_member(w: &mut edl_coord::MemberWatch, within: Duration) -> (&'static str, String) {
    let ev = tokio::time::timeout(within, w.next())
        .await
        .expect("member event in time")
        .expect("member watch open");
    summary(&ev)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_watch_sees_every_join_and_leave_across_etcd_restart() {
    let cluster = EtcdCluster::start(1).await.unwrap();
    let backend = connect(&cluster.endpoints()).await;
    // Leases long enough to outlive the restart.
    let ttl = Duration::from_secs(10);
    let registry = Registry::new(backend.clone(), "/faults/restart/members");
    let stop = CancellationToken::new();
    let mut watch = registry.watch_members(stop.clone());
    let la = Lease::grant(backend.clone(), ttl, CancellationToken::new())
        .await
        .unwrap();
    let lb = Lease::grant(backend.clone(), ttl, CancellationToken::new())
        .await
        .unwrap();
    registry.register("a", b"a".to_vec(), &la).await.unwrap();
    registry.register("b", b"b".to_vec(), &lb).await.unwrap();
    let mut got = vec![
        next_member(&mut watch, Duration::from_secs(10)).await,
        next_member(&mut watch, Duration::from_secs(10)).await,
    ];

    cluster.kill(0).unwrap();
    cluster.restart(0).await.unwrap();

    edl_coord::retry(&edl_coord::RetryPolicy::default(), || async {
        registry.register("c", b"c".to_vec(), &la).await.map(|_| ())
    })
    .await
    .unwrap();
    edl_coord::retry(&edl_coord::RetryPolicy::default(), || async {
        registry.deregister("a", &la).await.map(|_| ())
    })
    .await
    .unwrap();
    lb.revoke().await.unwrap();
    for _ in 0..3 {
        got.push(next_member(&mut watch, Duration::from_secs(20)).await);
    }
    let want: Vec<(&str, String)> = vec![
        ("joined", "a".into()),
        ("joined", "b".into()),
        ("joined", "c".into()),
        ("left", "a".into()),
        ("left", "b".into()),
    ];
    assert_eq!(got, want);
    assert!(!la.is_lost(), "the lease survived the restart");
    let (members, _) = registry.list().await.unwrap();
    assert_eq!(
        members.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(),
        vec!["c"]
    );
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_member_cluster_keeps_working_when_one_member_dies() {
    let cluster = EtcdCluster::start(3).await.unwrap();
    // Pin our clients to the raft leader, so killing it tests both a raft election
    // and the client's fail-over.
    let leader = cluster.leader().await.unwrap_or(0);
    let mut endpoints = cluster.endpoints();
    endpoints.rotate_left(leader);
    let backend = connect(&endpoints).await;
    let mut others = endpoints.clone();
    others.rotate_left(1);
    let writer = connect(&others[..2]).await;

    // Killing the raft leader leaves the cluster without one for an election
    // (etcd randomises its election timeout between 1 and 2 s here): no request
    // succeeds meanwhile, so a lease may turn uncertain by our clock, but it is not
    // lost: the new leader extends every lease. (A follower hanging costs nothing at
    // all: see `hung_member_does_not_cost_a_lease`.)
    let lease = Lease::grant(backend.clone(), TTL, CancellationToken::new())
        .await
        .unwrap();
    let follower_lease = Lease::grant(backend.clone(), TTL, CancellationToken::new())
        .await
        .unwrap();
    let election = Election::new(backend.clone(), "/faults/three/election");
    let leadership = election
        .campaign(&lease, b"l".to_vec(), &CancellationToken::new())
        .await
        .unwrap();
    let follower = {
        let election = election.clone();
        tokio::spawn(async move {
            let l = election
                .campaign(&follower_lease, b"f".to_vec(), &CancellationToken::new())
                .await;
            (l, follower_lease)
        })
    };
    let registry = Registry::new(backend.clone(), "/faults/three/members");
    let writer_registry = Registry::new(writer.clone(), "/faults/three/members");
    let writer_lease = Lease::grant(
        writer.clone(),
        Duration::from_secs(10),
        CancellationToken::new(),
    )
    .await
    .unwrap();
    let stop = CancellationToken::new();
    let mut watch = registry.watch_members(stop.clone());
    writer_registry
        .register("m0", b"0".to_vec(), &writer_lease)
        .await
        .unwrap();
    assert_eq!(
        next_member(&mut watch, Duration::from_secs(10)).await,
        ("joined", "m0".into())
    );

    cluster.kill(leader).unwrap();
    // Reads fail over to another member once the survivors elected a raft leader
    // (about one election timeout); until then requests time out, retryably.
    let retry = edl_coord::RetryPolicy::default();
    let started = Instant::now();
    edl_coord::retry(&retry, || backend.get("/faults/three/any"))
        .await
        .expect("read fails over");
    eprintln!(
        "reads served again {:?} after the raft leader died",
        started.elapsed()
    );
    // Changes made through the other members while our watch fails over.
    edl_coord::retry(&retry, || {
        writer_registry.register("m1", b"1".to_vec(), &writer_lease)
    })
    .await
    .unwrap();
    edl_coord::retry(&retry, || async {
        writer_registry
            .deregister("m0", &writer_lease)
            .await
            .map(|_| ())
    })
    .await
    .unwrap();
    let got = vec![
        next_member(&mut watch, Duration::from_secs(20)).await,
        next_member(&mut watch, Duration::from_secs(20)).await,
    ];
    assert_eq!(
        got,
        vec![("joined", "m1".to_owned()), ("left", "m0".to_owned())]
    );

    // Leases keep being renewed through the surviving members for several TTLs.
    let until = Instant::now() + 3 * TTL;
    while Instant::now() < until {
        assert!(!lease.is_lost(), "lease lost after one member died");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The leader still leads and writes; when it resigns the follower takes over.
    edl_coord::retry(&retry, || {
        leadership.fenced_txn(vec![Op::put("/faults/three/state", "l")])
    })
    .await
    .unwrap();
    assert!(!leadership.is_lost());
    edl_coord::retry(&retry, || async { leadership.is_leader().await })
        .await
        .unwrap();
    leadership.resign().await.unwrap();
    let (next, _l) = tokio::time::timeout(Duration::from_secs(10), follower)
        .await
        .unwrap()
        .unwrap();
    let next = next.unwrap();
    next.fenced_txn(vec![Op::put("/faults/three/state", "f")])
        .await
        .unwrap();
    let ids: BTreeSet<String> = registry
        .list()
        .await
        .unwrap()
        .0
        .into_iter()
        .map(|m| m.id)
        .collect();
    assert_eq!(ids, BTreeSet::from(["m1".to_owned()]));
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_index_five_clients_three_slots() {
    let cluster = EtcdCluster::start(1).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..5 {
        let endpoints = cluster.endpoints();
        tasks.push(tokio::spawn(async move {
            let backend = connect(&endpoints).await;
            let lease = Lease::grant(backend.clone(), TTL, CancellationToken::new())
                .await
                .unwrap();
            let r = claim_index(
                backend.as_ref(),
                "/faults/claim/ps",
                3,
                format!("c{i}"),
                &lease,
            )
            .await;
            (r, lease)
        }));
    }
    let mut indices = Vec::new();
    let mut full = 0;
    let mut holders = Vec::new();
    for t in tasks {
        let (r, lease) = t.await.unwrap();
        match r {
            Ok(claim) => {
                indices.push(claim.index);
                holders.push((claim.index, lease));
            }
            Err(Error::NoFreeIndex { n: 3 }) => full += 1,
            Err(e) => panic!("unexpected {e}"),
        }
    }
    indices.sort_unstable();
    assert_eq!(indices, vec![0, 1, 2]);
    assert_eq!(full, 2);

    // Free slot 1; a new claimer gets exactly that one.
    let backend = cluster.connect().await.unwrap();
    let pos = holders.iter().position(|(i, _)| *i == 1).unwrap();
    let (_, lease1) = holders.remove(pos);
    lease1.revoke().await.unwrap();
    let lease = Lease::grant(backend.clone(), TTL, CancellationToken::new())
        .await
        .unwrap();
    let claim = claim_index(backend.as_ref(), "/faults/claim/ps", 3, "late", &lease)
        .await
        .unwrap();
    assert_eq!(claim.index, 1);
}

/// One member of three hangs (SIGSTOP: its sockets stay open, it answers
/// nothing) for longer than the TTL, while lease holders are pinned to it: their
/// leases survive and the keys under them stay (DESIGN: losing one member of three
/// causes no interruption). Two holders: one whose request timeout gives each
/// endpoint 500 ms (the client moves on by itself), one with the default 5 s (the
/// keeper abandons the renewal after ttl/3 and the client moves on then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_member_does_not_cost_a_lease() {
    let cluster = EtcdCluster::start(3).await.unwrap();
    // Hang a follower: hanging the raft leader would also stall the cluster for
    // an election, which is a different test.
    let leader = cluster.leader().await.unwrap_or(0);
    let x = (leader + 1) % cluster.len();
    let mut pinned = cluster.endpoints();
    pinned.rotate_left(x);
    let others: Vec<String> = pinned[1..].to_vec();

    let fast = connect(&pinned).await; // request timeout 1 s: 500 ms per endpoint
    let slow: Arc<dyn Backend> = Arc::new(
        EtcdBackend::connect(
            EtcdConfig::new(pinned.clone()).with_dial_timeout(Duration::from_secs(2)),
        )
        .await
        .unwrap(),
    );
    let observer = connect(&others).await;
    let mut holders = Vec::new();
    for (name, backend) in [("fast", fast), ("slow", slow)] {
        let lease = Lease::grant(backend.clone(), TTL, CancellationToken::new())
            .await
            .unwrap();
        let key = format!("/faults/hung/{name}");
        backend
            .put(&key, b"held".to_vec(), Some(lease.id()))
            .await
            .unwrap();
        holders.push((name, key, lease, backend));
    }

    cluster.pause(x).unwrap();
    let paused = Instant::now();
    let hang_for = 2 * TTL + SLACK;
    while paused.elapsed() < hang_for {
        for (name, _, lease, _) in &holders {
            assert!(
                !lease.is_lost(),
                "{name} lease lost {:?} after member {x} hung",
                paused.elapsed()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for (name, key, lease, backend) in &holders {
        let kv = observer.get(key).await.unwrap();
        assert_eq!(
            kv.and_then(|kv| kv.lease),
            Some(lease.id()),
            "{name}: key gone while a member hung"
        );
        // The holder's own client works too (it moved off the hung member).
        assert!(backend.get(key).await.unwrap().is_some(), "{name}");
    }
    cluster.resume(x).unwrap();

    // After the member is back, everything still holds.
    tokio::time::sleep(TTL).await;
    for (name, key, lease, _) in &holders {
        assert!(!lease.is_lost(), "{name}");
        assert!(observer.get(key).await.unwrap().is_some(), "{name}");
    }
    for (_, key, lease, _) in holders {
        lease.revoke().await.unwrap();
        assert!(observer.get(&key).await.unwrap().is_none());
    }
}

/// Whether a process exists and is not a zombie.
fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // "pid (comm) S ...": the state follows the last ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| state != 'Z' && state != 'X'),
        Err(_) => false,
    }
}

/// etcd started by a test process that is SIGKILLed does not outlive it (the
/// local etcd sets a parent-death signal, `local_etcd::spawn_tied_to_process`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_dies_with_its_sigkilled_test_process() {
    let mut child = ChildProcess::spawn_test("child_entry", "etcd-owner", &[]).unwrap();
    let dir = child
        .expect_line("ETCD_DIR", Duration::from_secs(40))
        .await
        .unwrap();
    let pid: u32 = child
        .expect_line("ETCD_PID", Duration::from_secs(5))
        .await
        .unwrap()
        .parse()
        .unwrap();
    assert!(process_alive(pid));
    child.kill().await.unwrap();
    let gone = wait_until(
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async { !process_alive(pid) },
    )
    .await;
    // The killed child could not remove its directory.
    let _ = std::fs::remove_dir_all(&dir);
    assert!(gone, "etcd {pid} outlived its SIGKILLed parent");
}

/// With authentication on, a backend with the right credentials reads and writes (its
/// watch too); a wrong password is a clear, final error; no credentials are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authentication_on_credentials_work_and_bad_ones_are_refused() {
    use edl_proto::etcd::etcdserverpb::{self as pb, auth_client::AuthClient};
    let cluster = EtcdCluster::start(1).await.expect("start etcd");
    let endpoint = cluster.endpoint(0);
    // Turn auth on through the Auth API, as `etcdctl user add root && etcdctl auth
    // enable` would: root needs the root role.
    let channel = tonic::transport::Endpoint::from_shared(endpoint.clone())
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut auth = AuthClient::new(channel);
    auth.user_add(pb::AuthUserAddRequest {
        name: "root".into(),
        password: "s3cret".into(),
        ..Default::default()
    })
    .await
    .expect("add root");
    auth.role_add(pb::AuthRoleAddRequest {
        name: "root".into(),
    })
    .await
    .expect("add role root");
    auth.user_grant_role(pb::AuthUserGrantRoleRequest {
        user: "root".into(),
        role: "root".into(),
    })
    .await
    .expect("grant root");
    auth.auth_enable(pb::AuthEnableRequest {})
        .await
        .expect("enable auth");

    let cfg = |user: Option<(&str, &str)>| {
        let mut cfg = EtcdConfig::new([endpoint.clone()])
            .with_dial_timeout(Duration::from_secs(2))
            .with_request_timeout(Duration::from_secs(2));
        if let Some((u, p)) = user {
            cfg = cfg.with_auth(u, p);
        }
        cfg
    };
    let backend: Arc<dyn Backend> = Arc::new(
        EtcdBackend::connect(cfg(Some(("root", "s3cret"))))
            .await
            .expect("connect with credentials"),
    );
    let mut watch = backend.watch_prefix("/auth/", None).await.expect("watch");
    backend
        .put("/auth/k", b"v".to_vec(), None)
        .await
        .expect("put with credentials");
    let got = backend.get("/auth/k").await.expect("get").expect("key");
    assert_eq!(got.value, b"v");
    let ev = tokio::time::timeout(Duration::from_secs(5), watch.next())
        .await
        .expect("watch event in time")
        .expect("watch open")
        .expect("watch event");
    assert_eq!((ev.kind, ev.kv.key.as_str()), (EventKind::Put, "/auth/k"));

    let wrong = EtcdBackend::connect(cfg(Some(("root", "wrong"))))
        .await
        .expect_err("a wrong password is refused");
    assert!(!wrong.is_retryable(), "{wrong}");
    assert!(
        wrong.to_string().contains("authentication failed"),
        "{wrong}"
    );

    // Without credentials the connection probe itself is refused: a final error too.
    let anonymous = EtcdBackend::connect(cfg(None))
        .await
        .expect_err("no credentials are refused");
    assert!(!anonymous.is_retryable(), "{anonymous}");
}

/// A member that lost its data is replaced in the membership: with member 2 SIGKILLed
/// (as when its node and volume are gone), `replace_member` at its peer URL removes it
/// and adds a new, not yet started member there; repeated (an operator's next round, or
/// a retry after a lost answer), it changes nothing; the other two keep a quorum and
/// take writes throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_lost_its_data_is_replaced_in_the_membership() {
    let cluster = EtcdCluster::start(3).await.unwrap();
    let backend = EtcdBackend::connect(
        EtcdConfig::new(cluster.endpoints()).with_dial_timeout(Duration::from_secs(2)),
    )
    .await
    .expect("connect");
    let before = backend.members().await.expect("the members");
    assert_eq!(before.len(), 3);
    assert!(before.iter().all(|m| m.started()), "{before:?}");
    let lost = before
        .iter()
        .find(|m| m.name.ends_with("-m2"))
        .expect("member 2")
        .clone();
    cluster.kill(2).expect("SIGKILL member 2");
    let url = lost.peer_urls[0].clone();
    // etcd takes a change of membership only once the members that stay have been
    // connected for its health interval (5 s; `--strict-reconfig-check`): tried
    // again, as the operator's rounds do.
    let replaced = wait_until(
        Duration::from_secs(30),
        Duration::from_millis(500),
        || async { backend.replace_member(&url).await.is_ok() },
    )
    .await;
    assert!(replaced, "{:?}", backend.replace_member(&url).await);
    let after = backend.members().await.expect("the members");
    assert_eq!(after.len(), 3, "{after:?}");
    assert!(
        !after.iter().any(|m| m.id == lost.id),
        "the old member went"
    );
    let new = after
        .iter()
        .find(|m| m.peer_urls.contains(&url))
        .expect("a member at its URL")
        .clone();
    assert!(!new.started(), "added, not started: {new:?}");
    backend.replace_member(&url).await.expect("again");
    assert_eq!(
        backend.members().await.expect("the members"),
        after,
        "unchanged"
    );
    backend
        .put("/faults/replaced", b"x".to_vec(), None)
        .await
        .expect("the other two take writes");
}

/// A write in flight on a follower when the raft leader hangs (SIGSTOP: the follower
/// forwards the proposal to it, and it never answers) ends once the follower has elected
/// another leader, about an election timeout later, not after the client's request
/// timeout (30 s here): as a timeout (the write may have been applied), or applied.
/// Before, it waited out the whole request timeout (an etcd leader's SIGKILL cost a
/// job 5 s of training with the default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_in_flight_when_the_leader_hangs_ends_with_the_election() {
    let cluster = EtcdCluster::start(3).await.unwrap();
    let leader = cluster.leader().await.expect("a leader");
    let follower = (leader + 1) % cluster.len();
    let backend = EtcdBackend::connect(
        EtcdConfig::new([cluster.endpoints()[follower].clone()])
            .with_dial_timeout(Duration::from_secs(2))
            .with_request_timeout(Duration::from_secs(30)),
    )
    .await
    .unwrap();
    backend
        .put("/faults/in-flight/warm", b"1".to_vec(), None)
        .await
        .unwrap();

    cluster.pause(leader).unwrap();
    let paused = Instant::now();
    let written = backend
        .put("/faults/in-flight/key", b"2".to_vec(), None)
        .await;
    let took = paused.elapsed();
    // The witness that the leader changed meanwhile: another member leads.
    let new_leader = wait_until(
        Duration::from_secs(20),
        Duration::from_millis(100),
        || async { cluster.leader().await.is_some_and(|l| l != leader) },
    )
    .await;
    cluster.resume(leader).unwrap();
    assert!(new_leader, "no other member led");
    assert!(
        matches!(written, Ok(_) | Err(Error::Timeout(_))),
        "{written:?}"
    );
    assert!(
        took < Duration::from_secs(10),
        "the write waited {took:?} (the request timeout is 30 s)"
    );
    eprintln!("write in flight when the leader hung: ended after {took:?} with {written:?}");
}
