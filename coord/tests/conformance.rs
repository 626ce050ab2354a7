//! The conformance suite: one set of cases run against [`MemBackend`] (each case on
//! a paused tokio clock) and against a real single-member etcd (all cases in one
//! test, sharing the cluster, each under its own key prefix).
//!
//! Cases only assert revisions relative to ones they observed, so they can share a
//! store. Time passes through tokio's clock: on the paused runtime, sleeps and
//! deadlines advance virtual time; against etcd they are real.

// The cases are plain functions called by the tests, where clippy's
// `allow-unwrap-in-tests` does not reach.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use edl_coord::*;
use edl_testkit::{EtcdCluster, FaultyBackend, wait_until};

const TTL: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(50);

#[derive(Clone)]
struct Env {
    backend: Arc<dyn Backend>,
    prefix: String,
}

impl Env {
    fn key(&self, k: &str) -> String {
        format!("{}{}", self.prefix, k)
    }

    async fn lease(&self) -> Lease {
        Lease::grant(self.backend.clone(), TTL, CancellationToken::new())
            .await
            .expect("grant lease")
    }

    async fn revision(&self) -> Revision {
        self.backend.range(&self.prefix).await.expect("range").1
    }
}

type Case = fn(Env) -> BoxFuture<'static, ()>;

macro_rules! cases {
    ($($name:ident),* $(,)?) => {
        const CASES: &[(&str, Case)] = &[$((stringify!($name), |env| Box::pin($name(env)))),*];

        mod mem_backend {
            $(
                #[tokio::test(start_paused = true)]
                async fn $name() {
                    let env = super::Env {
                        backend: std::sync::Arc::new(edl_coord::MemBackend::new()),
                        prefix: format!("/conformance/{}/", stringify!($name)),
                    };
                    super::$name(env).await;
                }
            )*
        }
    };
}

cases!(
    kv_put_get_range_delete,
    txn_compares_and_branches,
    lease_expiry_deletes_keys,
    lease_keep_alive_extends,
    lease_revoke_deletes_keys_at_one_revision,
    watch_from_revision_sees_every_event_in_order,
    watch_from_compacted_revision_fails,
    lease_recipe_keeps_alive_and_reports_loss,
    election_order_fencing_and_observe,
    registry_register_list_and_watch,
    registry_watch_misses_nothing_across_reconnects,
    claim_index_concurrent_and_reclaim,
    request_limits_rejected_alike,
    large_ranges_are_complete,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_backend_conformance() {
    let cluster = EtcdCluster::start(1).await.expect("start etcd");
    let backend = cluster.connect().await.expect("connect to etcd");
    for (name, case) in CASES {
        eprintln!("conformance case on etcd: {name}");
        let env = Env {
            backend: backend.clone(),
            prefix: format!("/conformance/{name}/"),
        };
        let run = tokio::time::timeout(Duration::from_secs(120), case(env));
        run.await
            .unwrap_or_else(|_| panic!("case {name} timed out"));
    }
}

async fn kv_put_get_range_delete(env: Env) {
    let b = &env.backend;
    let (k1, k2) = (env.key("k1"), env.key("k2"));
    assert_eq!(b.get(&k1).await.unwrap(), None);

    let r1 = b.put(&k1, b"a".to_vec(), None).await.unwrap();
    let kv = b.get(&k1).await.unwrap().unwrap();
    assert_eq!(
        (kv.create_revision, kv.mod_revision, kv.version),
        (r1, r1, 1)
    );
    assert_eq!((kv.value.as_slice(), kv.lease), (&b"a"[..], None));

    let r2 = b.put(&k1, b"b".to_vec(), None).await.unwrap();
    assert_eq!(r2, r1 + 1);
    let kv = b.get(&k1).await.unwrap().unwrap();
    assert_eq!(
        (kv.create_revision, kv.mod_revision, kv.version),
        (r1, r2, 2)
    );

    let r3 = b.put(&k2, b"c".to_vec(), None).await.unwrap();
    let (kvs, rev) = b.range(&env.prefix).await.unwrap();
    assert_eq!(rev, r3);
    let keys: Vec<_> = kvs.iter().map(|kv| kv.key.as_str()).collect();
    assert_eq!(keys, vec![k1.as_str(), k2.as_str()]);

    // Deleting bumps the revision; deleting nothing does not.
    assert!(b.delete(&k1).await.unwrap());
    assert_eq!(env.revision().await, r3 + 1);
    assert!(!b.delete(&k1).await.unwrap());
    assert_eq!(env.revision().await, r3 + 1);

    // A re-created key starts over.
    let r5 = b.put(&k1, b"d".to_vec(), None).await.unwrap();
    let kv = b.get(&k1).await.unwrap().unwrap();
    assert_eq!((kv.create_revision, kv.version), (r5, 1));

    // Prefixes are prefixes of the key bytes.
    b.put(&env.key("dir/x"), b"1".to_vec(), None).await.unwrap();
    b.put(&env.key("dirx"), b"1".to_vec(), None).await.unwrap();
    let (kvs, _) = b.range(&env.key("dir/")).await.unwrap();
    assert_eq!(kvs.len(), 1);
    assert_eq!(kvs[0].key, env.key("dir/x"));

    assert_eq!(b.delete_prefix(&env.prefix).await.unwrap(), 4);
    assert!(b.range(&env.prefix).await.unwrap().0.is_empty());

    assert!(matches!(
        b.put("", b"x".to_vec(), None).await,
        Err(Error::InvalidArgument(_))
    ));
}

async fn txn_compares_and_branches(env: Env) {
    let b = &env.backend;
    let (a, x, y, missing) = (env.key("a"), env.key("x"), env.key("y"), env.key("missing"));
    let ra = b.put(&a, b"1".to_vec(), None).await.unwrap();

    let holds = |c: Compare| {
        let b = b.clone();
        async move {
            let resp = b.txn(Txn::new().when([c.clone()])).await.unwrap();
            resp.succeeded
        }
    };
    assert!(holds(Compare::value(&a, CompareOp::Equal, "1")).await);
    assert!(!holds(Compare::value(&a, CompareOp::Equal, "2")).await);
    assert!(holds(Compare::value(&a, CompareOp::Less, "2")).await);
    assert!(holds(Compare::value(&a, CompareOp::NotEqual, "2")).await);
    assert!(holds(Compare::create_revision(&a, CompareOp::Equal, ra)).await);
    assert!(holds(Compare::mod_revision(&a, CompareOp::Equal, ra)).await);
    assert!(holds(Compare::mod_revision(&a, CompareOp::Less, ra + 1)).await);
    assert!(!holds(Compare::mod_revision(&a, CompareOp::Greater, ra)).await);
    assert!(holds(Compare::version(&a, CompareOp::Equal, 1)).await);
    assert!(holds(Compare::exists(&a)).await);
    assert!(!holds(Compare::absent(&a)).await);
    assert!(holds(Compare::absent(&missing)).await);
    assert!(holds(Compare::version(&missing, CompareOp::Equal, 0)).await);
    assert!(holds(Compare::lease(&a, CompareOp::Equal, None)).await);
    // etcd: a value compare on a missing key is false whatever the operator.
    assert!(!holds(Compare::value(&missing, CompareOp::NotEqual, "z")).await);
    // A transaction without writes does not bump the revision.
    assert_eq!(env.revision().await, ra);

    // Success branch.
    let resp = b
        .txn(
            Txn::new()
                .when([Compare::value(&a, CompareOp::Equal, "1")])
                .and_then([Op::put(&x, "1"), Op::get(&a), Op::get_prefix(&env.prefix)])
                .or_else([Op::put(&y, "1")]),
        )
        .await
        .unwrap();
    assert!(resp.succeeded);
    assert_eq!(resp.revision, ra + 1);
    assert_eq!(resp.responses[0], OpResponse::Put);
    assert_eq!(resp.get(1).unwrap()[0].value, b"1");
    // A read after a write in the same transaction sees the write.
    assert_eq!(resp.get(2).unwrap().len(), 2);
    assert!(b.get(&y).await.unwrap().is_none());
    let kx = b.get(&x).await.unwrap().unwrap();
    assert_eq!(kx.create_revision, ra + 1);

    // Failure branch; several writes share one revision.
    let resp = b
        .txn(
            Txn::new()
                .when([Compare::value(&a, CompareOp::Equal, "2")])
                .and_then([Op::put(&x, "2")])
                .or_else([Op::put(&y, "1"), Op::delete(&x), Op::delete(&missing)]),
        )
        .await
        .unwrap();
    assert!(!resp.succeeded);
    assert_eq!(resp.revision, ra + 2);
    assert_eq!(resp.responses[1], OpResponse::Delete { deleted: 1 });
    assert_eq!(resp.responses[2], OpResponse::Delete { deleted: 0 });
    assert_eq!(b.get(&y).await.unwrap().unwrap().mod_revision, ra + 2);
    assert!(b.get(&x).await.unwrap().is_none());

    // Nested transactions.
    let resp = b
        .txn(
            Txn::new().when([Compare::exists(&a)]).and_then([Op::txn(
                Txn::new()
                    .when([Compare::exists(&missing)])
                    .and_then([Op::put(&x, "then")])
                    .or_else([Op::put(&x, "else")]),
            )]),
        )
        .await
        .unwrap();
    assert!(resp.succeeded);
    match &resp.responses[0] {
        OpResponse::Txn(inner) => {
            assert!(!inner.succeeded);
            assert_eq!(inner.revision, resp.revision);
        }
        other => panic!("expected a nested response, got {other:?}"),
    }
    assert_eq!(b.get(&x).await.unwrap().unwrap().value, b"else");

    // Rejected transactions change nothing.
    let before = env.revision().await;
    let dup = Txn::new().and_then([Op::put(&x, "1"), Op::put(&x, "2")]);
    assert!(matches!(b.txn(dup).await, Err(Error::InvalidArgument(_))));
    let unknown_lease = Txn::new().and_then([
        Op::put(&y, "2"),
        Op::put_with_lease(&x, "1", LeaseId(0x7fff_0000_dead)),
    ]);
    assert!(matches!(b.txn(unknown_lease).await, Err(Error::LeaseLost)));
    assert!(matches!(
        b.put(&x, b"1".to_vec(), Some(LeaseId(0x7fff_0000_dead)))
            .await,
        Err(Error::LeaseLost)
    ));
    assert_eq!(env.revision().await, before);
    assert_eq!(b.get(&y).await.unwrap().unwrap().value, b"1");

    // Lease compares and detaching a key from its lease.
    let g = b.lease_grant(TTL).await.unwrap();
    b.put(&x, b"l".to_vec(), Some(g.id)).await.unwrap();
    assert!(holds(Compare::lease(&x, CompareOp::Equal, Some(g.id))).await);
    b.put(&x, b"m".to_vec(), None).await.unwrap();
    assert!(holds(Compare::lease(&x, CompareOp::Equal, None)).await);
    b.lease_revoke(g.id).await.unwrap();
    assert!(
        b.get(&x).await.unwrap().is_some(),
        "a detached key outlives the lease"
    );
}

async fn lease_expiry_deletes_keys(env: Env) {
    let b = &env.backend;
    let k = env.key("k");
    let g = b.lease_grant(TTL).await.unwrap();
    assert_eq!(g.ttl, TTL);
    b.put(&k, b"v".to_vec(), Some(g.id)).await.unwrap();
    assert_eq!(b.get(&k).await.unwrap().unwrap().lease, Some(g.id));
    let left = b.lease_ttl(g.id).await.unwrap().expect("lease alive");
    assert!(left <= TTL);

    let gone = wait_until(TTL + Duration::from_secs(2), POLL, || async {
        b.get(&k).await.unwrap().is_none()
    })
    .await;
    assert!(gone, "key outlived its lease");
    assert_eq!(b.lease_ttl(g.id).await.unwrap(), None);
    assert_eq!(b.lease_keep_alive_once(g.id).await.unwrap(), None);
    assert!(matches!(
        b.put(&k, b"v".to_vec(), Some(g.id)).await,
        Err(Error::LeaseLost)
    ));
}

async fn lease_keep_alive_extends(env: Env) {
    let b = &env.backend;
    let k = env.key("k");
    let g = b.lease_grant(TTL).await.unwrap();
    b.put(&k, b"v".to_vec(), Some(g.id)).await.unwrap();
    // Renew every half TTL for three TTLs: the key stays.
    for _ in 0..6 {
        tokio::time::sleep(TTL / 2).await;
        assert_eq!(b.lease_keep_alive_once(g.id).await.unwrap(), Some(TTL));
        assert!(b.get(&k).await.unwrap().is_some());
    }
    let gone = wait_until(TTL + Duration::from_secs(2), POLL, || async {
        b.get(&k).await.unwrap().is_none()
    })
    .await;
    assert!(gone, "key outlived its lease once renewals stopped");
}

async fn lease_revoke_deletes_keys_at_one_revision(env: Env) {
    let b = &env.backend;
    let (k1, k2) = (env.key("k1"), env.key("k2"));
    let g = b.lease_grant(TTL).await.unwrap();
    b.put(&k1, b"v".to_vec(), Some(g.id)).await.unwrap();
    let r = b.put(&k2, b"v".to_vec(), Some(g.id)).await.unwrap();
    let mut w = b.watch_prefix(&env.prefix, Some(r + 1)).await.unwrap();
    b.lease_revoke(g.id).await.unwrap();
    assert!(b.get(&k1).await.unwrap().is_none());
    assert!(b.get(&k2).await.unwrap().is_none());
    assert_eq!(env.revision().await, r + 1);
    for key in [&k1, &k2] {
        let ev = next(&mut w).await;
        assert_eq!(
            (ev.kind, &ev.kv.key, ev.revision()),
            (EventKind::Delete, key, r + 1)
        );
    }
    // Revoking again, renewing or asking the TTL of a revoked lease: it is gone.
    b.lease_revoke(g.id).await.unwrap();
    assert_eq!(b.lease_keep_alive_once(g.id).await.unwrap(), None);
    assert_eq!(b.lease_ttl(g.id).await.unwrap(), None);
}

async fn next(w: &mut WatchStream) -> WatchEvent {
    tokio::time::timeout(Duration::from_secs(10), w.next())
        .await
        .expect("watch event within 10 s")
        .expect("watch stream open")
        .expect("watch event")
}

async fn watch_from_revision_sees_every_event_in_order(env: Env) {
    let b = &env.backend;
    let (a, c, d) = (env.key("a"), env.key("c"), env.key("d"));
    let start = env.revision().await + 1;
    b.put(&a, b"1".to_vec(), None).await.unwrap();
    b.put(&a, b"2".to_vec(), None).await.unwrap();
    b.put("/conformance-outside/x", b"1".to_vec(), None)
        .await
        .unwrap();
    b.delete(&a).await.unwrap();
    b.txn(Txn::new().and_then([Op::put(&c, "1"), Op::put(&d, "1")]))
        .await
        .unwrap();

    let mut w = b.watch_prefix(&env.prefix, Some(start)).await.unwrap();
    let mut evs = Vec::new();
    for _ in 0..5 {
        evs.push(next(&mut w).await);
    }
    let summary: Vec<_> = evs
        .iter()
        .map(|e| (e.kind, e.kv.key.clone(), e.kv.version))
        .collect();
    assert_eq!(
        summary,
        vec![
            (EventKind::Put, a.clone(), 1),
            (EventKind::Put, a.clone(), 2),
            (EventKind::Delete, a.clone(), 0),
            (EventKind::Put, c.clone(), 1),
            (EventKind::Put, d.clone(), 1),
        ]
    );
    assert_eq!(evs[0].revision(), start);
    assert_eq!(evs[1].revision(), start + 1);
    assert_eq!(
        evs[2].revision(),
        start + 3,
        "the outside put took a revision"
    );
    assert_eq!(
        evs[3].revision(),
        evs[4].revision(),
        "one txn, one revision"
    );
    assert_eq!(evs[2].kv.create_revision, 0);
    assert_eq!(evs[1].kv.value, b"2");

    // A live watch (no start revision) sees writes made after it returned.
    let mut live = b.watch_prefix(&env.prefix, None).await.unwrap();
    let r = b.put(&a, b"3".to_vec(), None).await.unwrap();
    let ev = next(&mut live).await;
    assert_eq!(
        (ev.kind, ev.kv.key.as_str(), ev.revision()),
        (EventKind::Put, a.as_str(), r)
    );
    // The first watch keeps going too.
    assert_eq!(next(&mut w).await.revision(), r);
}

async fn watch_from_compacted_revision_fails(env: Env) {
    let b = &env.backend;
    let k = env.key("k");
    let r1 = b.put(&k, b"1".to_vec(), None).await.unwrap();
    let r2 = b.put(&k, b"2".to_vec(), None).await.unwrap();
    b.compact(r2).await.unwrap();
    let mut w = b.watch_prefix(&env.prefix, Some(r1)).await.unwrap();
    match tokio::time::timeout(Duration::from_secs(10), w.next()).await {
        Ok(Some(Err(Error::Compacted { compact_revision }))) => assert_eq!(compact_revision, r2),
        other => panic!("expected Compacted, got {other:?}"),
    }
    assert!(w.next().await.is_none(), "the stream ends after its error");
    // From the compaction revision on, history is there.
    let mut w = b.watch_prefix(&env.prefix, Some(r2)).await.unwrap();
    let ev = next(&mut w).await;
    assert_eq!((ev.revision(), ev.kv.value.as_slice()), (r2, &b"2"[..]));
    assert!(matches!(
        b.compact(r2).await,
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        b.compact(r2 + 1000).await,
        Err(Error::InvalidArgument(_))
    ));
}

async fn lease_recipe_keeps_alive_and_reports_loss(env: Env) {
    let b = &env.backend;
    let k = env.key("k");

    // Kept alive well past its TTL.
    let lease = env.lease().await;
    b.put(&k, b"v".to_vec(), Some(lease.id())).await.unwrap();
    tokio::time::sleep(TTL * 3).await;
    assert!(!lease.is_lost());
    assert_eq!(lease.state(), LeaseState::Held);
    assert!(
        b.get(&k).await.unwrap().is_some(),
        "keep-alive kept the key"
    );
    let lost = lease.lost();
    lease.revoke().await.unwrap();
    assert!(lost.is_cancelled());
    assert!(b.get(&k).await.unwrap().is_none());

    // Revoked while others hold it (a server's lease, shared with its services): its
    // keys go at once, and every holder sees it lost.
    let lease = std::sync::Arc::new(env.lease().await);
    let holder = lease.clone();
    b.put(&k, b"v".to_vec(), Some(lease.id())).await.unwrap();
    lease.revoke_shared().await.unwrap();
    assert!(holder.is_lost());
    assert!(
        b.get(&k).await.unwrap().is_none(),
        "the key went with the lease"
    );

    // Revoked from under its holder: `lost` fires within a renewal period.
    let lease = env.lease().await;
    b.lease_revoke(lease.id()).await.unwrap();
    let fired = tokio::time::timeout(TTL, lease.lost().cancelled()).await;
    assert!(fired.is_ok(), "lost did not fire after an external revoke");

    // The owner's cancel token revokes the lease.
    let cancel = CancellationToken::new();
    let lease = Lease::grant(b.clone(), TTL, cancel.clone()).await.unwrap();
    b.put(&k, b"v".to_vec(), Some(lease.id())).await.unwrap();
    cancel.cancel();
    let fired = tokio::time::timeout(TTL, lease.lost().cancelled()).await;
    assert!(fired.is_ok(), "lost did not fire on cancel");
    // `lost` fires first, then the revoke is sent.
    assert!(
        wait_until(TTL / 2, POLL, || async {
            b.get(&k).await.unwrap().is_none()
        })
        .await,
        "cancel revoked the lease"
    );

    // Backend unreachable for several TTLs while the server keeps the lease (as etcd
    // does through a quorum loss: its new leader extends every lease; here a direct
    // keep-alive stands in for it): uncertain by our clock, never lost, and held again
    // once the backend answers.
    let faulty = FaultyBackend::new(b.clone());
    let lease = Lease::grant(faulty.clone(), TTL, CancellationToken::new())
        .await
        .unwrap();
    b.put(&k, b"v".to_vec(), Some(lease.id())).await.unwrap();
    let mut state = lease.watch_state();
    faulty.set_down(true);
    let deadline = lease.valid_until();
    let server = {
        let (b, id) = (b.clone(), lease.id());
        tokio::spawn(async move {
            loop {
                assert!(b.lease_keep_alive_once(id).await.unwrap().is_some());
                tokio::time::sleep(TTL / 4).await;
            }
        })
    };
    // (`is_ok` at once: a held `Ref` of the watch would block its sender.)
    let became = tokio::time::timeout(
        TTL + Duration::from_secs(1),
        state.wait_for(|s| *s == LeaseState::Uncertain),
    )
    .await
    .is_ok_and(|r| r.is_ok());
    assert!(became, "the lease did not turn uncertain");
    assert!(
        tokio::time::Instant::now() <= deadline + Duration::from_millis(500),
        "uncertain late: {:?} past the deadline",
        tokio::time::Instant::now() - deadline
    );
    assert_eq!(lease.state(), LeaseState::Uncertain);
    for _ in 0..6 {
        tokio::time::sleep(TTL / 2).await;
        assert!(!lease.is_lost(), "lost while the backend was down");
    }
    assert_eq!(lease.state(), LeaseState::Uncertain);
    faulty.set_down(false);
    server.abort();
    let held = tokio::time::timeout(TTL, state.wait_for(|s| *s == LeaseState::Held))
        .await
        .is_ok_and(|r| r.is_ok());
    assert!(held, "not held again once the backend answered");
    assert_eq!(
        b.get(&k).await.unwrap().and_then(|kv| kv.lease),
        Some(lease.id()),
        "the key outlived the outage"
    );
    lease.revoke().await.unwrap();

    // Unreachable while the server lets the lease expire (this holder alone was cut
    // off): uncertain, not lost, until the backend answers that the lease is gone.
    let lease = Lease::grant(faulty.clone(), TTL, CancellationToken::new())
        .await
        .unwrap();
    b.put(&k, b"v".to_vec(), Some(lease.id())).await.unwrap();
    faulty.set_down(true);
    assert!(
        wait_until(TTL + Duration::from_secs(2), POLL, || async {
            b.get(&k).await.unwrap().is_none()
        })
        .await,
        "the lease did not expire on the server"
    );
    assert_eq!(lease.state(), LeaseState::Uncertain);
    assert!(!lease.is_lost());
    faulty.set_down(false);
    let fired = tokio::time::timeout(TTL, lease.lost().cancelled()).await;
    assert!(fired.is_ok(), "lost did not fire once the backend answered");
    assert_eq!(lease.state(), LeaseState::Lost);
    // A new lease works once the backend is back.
    let again = Lease::grant(faulty.clone(), TTL, CancellationToken::new())
        .await
        .unwrap();
    faulty
        .put(&k, b"back".to_vec(), Some(again.id()))
        .await
        .unwrap();
    again.revoke().await.unwrap();

    // Dropping the lease fires lost.
    let lease = env.lease().await;
    let lost = lease.lost();
    drop(lease);
    assert!(lost.is_cancelled());
}

async fn election_order_fencing_and_observe(env: Env) {
    let b = &env.backend;
    let state = env.key("state");
    let election = Election::new(b.clone(), env.key("election"));
    let never = CancellationToken::new();
    let (l1, l2, l3) = (env.lease().await, env.lease().await, env.lease().await);
    let l2_id = l2.id();
    let l3_id = l3.id();

    let observer_stop = CancellationToken::new();
    let mut observed = election.observe(observer_stop.clone());

    let first = election.campaign(&l1, b"a".to_vec(), &never).await.unwrap();
    let leader = election.leader().await.unwrap().unwrap();
    assert_eq!(
        (leader.value.as_slice(), leader.revision),
        (&b"a"[..], first.revision())
    );
    assert!(first.is_leader().await.unwrap());
    first.fenced_txn(vec![Op::put(&state, "1")]).await.unwrap();

    let (e2, e3) = (election.clone(), election.clone());
    let second = tokio::spawn(async move {
        let r = e2
            .campaign(&l2, b"b".to_vec(), &CancellationToken::new())
            .await;
        (r, l2)
    });
    let key2 = format!("{}{}", election.prefix(), l2_id);
    assert!(
        wait_until(Duration::from_secs(5), POLL, || async {
            b.get(&key2).await.unwrap().is_some()
        })
        .await
    );
    let mut third = tokio::spawn(async move {
        let r = e3
            .campaign(&l3, b"c".to_vec(), &CancellationToken::new())
            .await;
        (r, l3)
    });
    let key3 = format!("{}{}", election.prefix(), l3_id);
    assert!(
        wait_until(Duration::from_secs(5), POLL, || async {
            b.get(&key3).await.unwrap().is_some()
        })
        .await
    );
    assert!(
        !second.is_finished() && !third.is_finished(),
        "only one leader at a time"
    );

    // Resigning hands over to the next in line, not to the last.
    first.resign().await.unwrap();
    let (second, l2) = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .unwrap()
        .unwrap();
    let second = second.unwrap();
    assert!(second.revision() > 0);
    let seen = wait_until(Duration::from_secs(10), POLL, || {
        let v = observed
            .borrow_and_update()
            .as_ref()
            .map(|l| l.value.clone());
        async move { v.as_deref() == Some(&b"b"[..]) }
    })
    .await;
    assert!(seen, "observe did not report the new leader");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut third)
            .await
            .is_err()
    );
    second.fenced_txn(vec![Op::put(&state, "2")]).await.unwrap();

    // Deposed by losing its lease: the fenced write fails, `lost` fires, the next leads.
    b.lease_revoke(l2.id()).await.unwrap();
    assert!(matches!(
        second.fenced_txn(vec![Op::put(&state, "stale")]).await,
        Err(Error::NotLeader)
    ));
    assert!(
        tokio::time::timeout(TTL * 2, second.lost().cancelled())
            .await
            .is_ok()
    );
    let (third, _l3) = tokio::time::timeout(Duration::from_secs(10), third)
        .await
        .unwrap()
        .unwrap();
    let third = third.unwrap();
    assert_eq!(b.get(&state).await.unwrap().unwrap().value, b"2");

    // A fenced transaction with its own compares: the caller's failure is not NotLeader.
    let resp = third
        .fenced(
            Txn::new()
                .when([Compare::value(&state, CompareOp::Equal, "9")])
                .and_then([Op::put(&state, "x")])
                .or_else([Op::get(&state)]),
        )
        .await
        .unwrap();
    assert!(!resp.succeeded);
    assert_eq!(resp.get(0).unwrap()[0].value, b"2");
    // A deposed leader's failure branch does not run either.
    let guard_only = Fence {
        key: third.key().to_owned(),
        revision: third.revision() + 1_000_000,
    };
    let stale = fenced_txn(
        b.as_ref(),
        &guard_only,
        Txn::new()
            .when([Compare::value(&state, CompareOp::Equal, "9")])
            .or_else([Op::put(&state, "stale")]),
    )
    .await;
    assert!(matches!(stale, Err(Error::NotLeader)));
    assert_eq!(b.get(&state).await.unwrap().unwrap().value, b"2");

    // A waiting candidate that is cancelled leaves the line.
    let l4 = env.lease().await;
    let cancel = CancellationToken::new();
    let e4 = election.clone();
    let c4 = cancel.clone();
    let fourth =
        tokio::spawn(async move { e4.campaign(&l4, b"d".to_vec(), &c4).await.map(|_| ()) });
    assert!(
        wait_until(Duration::from_secs(5), POLL, || async {
            b.range(election.prefix()).await.unwrap().0.len() == 2
        })
        .await
    );
    cancel.cancel();
    let r = tokio::time::timeout(Duration::from_secs(5), fourth)
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(r, Err(Error::Cancelled)));
    assert_eq!(b.range(election.prefix()).await.unwrap().0.len(), 1);
    observer_stop.cancel();
    drop(third);
}

async fn next_member(w: &mut MemberWatch) -> MemberEvent {
    tokio::time::timeout(Duration::from_secs(15), w.next())
        .await
        .expect("member event within 15 s")
        .expect("member watch open")
}

fn summary(ev: &MemberEvent) -> (&'static str, String) {
    match ev {
        MemberEvent::Joined(m) => ("joined", m.id.clone()),
        MemberEvent::Updated(m) => ("updated", m.id.clone()),
        MemberEvent::Left(m) => ("left", m.id.clone()),
    }
}

async fn registry_register_list_and_watch(env: Env) {
    let b = &env.backend;
    let reg = Registry::new(b.clone(), env.key("trainers"));
    let stop = CancellationToken::new();
    let (l1, l2) = (env.lease().await, env.lease().await);
    reg.register("t0", b"early".to_vec(), &l1).await.unwrap();
    let mut w = reg.watch_members(stop.clone());
    assert_eq!(summary(&next_member(&mut w).await), ("joined", "t0".into()));

    reg.register("t1", b"addr1".to_vec(), &l1).await.unwrap();
    reg.register("t2", b"addr2".to_vec(), &l2).await.unwrap();
    assert_eq!(summary(&next_member(&mut w).await), ("joined", "t1".into()));
    assert_eq!(summary(&next_member(&mut w).await), ("joined", "t2".into()));
    reg.register("t1", b"addr1b".to_vec(), &l1).await.unwrap();
    match next_member(&mut w).await {
        MemberEvent::Updated(m) => {
            assert_eq!((m.id.as_str(), m.value.as_slice()), ("t1", &b"addr1b"[..]))
        }
        other => panic!("expected an update, got {other:?}"),
    }
    assert!(matches!(
        reg.register("t1", b"x".to_vec(), &l2).await,
        Err(Error::AlreadyRegistered { .. })
    ));
    assert!(matches!(
        reg.register("a/b", b"x".to_vec(), &l2).await,
        Err(Error::InvalidArgument(_))
    ));

    let (members, _) = reg.list().await.unwrap();
    let ids: Vec<_> = members.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, vec!["t0", "t1", "t2"]);
    assert_eq!(members[1].lease, Some(l1.id()));

    l2.revoke().await.unwrap();
    assert_eq!(summary(&next_member(&mut w).await), ("left", "t2".into()));
    assert!(reg.deregister("t1", &l1).await.unwrap());
    assert_eq!(summary(&next_member(&mut w).await), ("left", "t1".into()));
    stop.cancel();
    assert!(
        tokio::time::timeout(Duration::from_secs(5), w.next())
            .await
            .unwrap()
            .is_none()
    );
}

async fn registry_watch_misses_nothing_across_reconnects(env: Env) {
    let b = &env.backend;
    let faulty = FaultyBackend::new(b.clone());
    let writer = Registry::new(b.clone(), env.key("members"));
    let reader = Registry::new(faulty.clone(), env.key("members"));
    let stop = CancellationToken::new();
    let (l1, l2) = (env.lease().await, env.lease().await);

    writer.register("m0", b"0".to_vec(), &l1).await.unwrap();
    let mut w = reader.watch_members(stop.clone());
    assert_eq!(summary(&next_member(&mut w).await), ("joined", "m0".into()));

    // Changes while the watcher is cut off are replayed from its last revision.
    faulty.set_down(true);
    writer.register("m1", b"1".to_vec(), &l1).await.unwrap();
    writer.register("m2", b"2".to_vec(), &l2).await.unwrap();
    writer.deregister("m0", &l1).await.unwrap();
    writer.register("m3", b"3".to_vec(), &l2).await.unwrap();
    writer.deregister("m3", &l2).await.unwrap();
    writer.register("m1", b"1b".to_vec(), &l1).await.unwrap();
    faulty.set_down(false);
    let mut got = Vec::new();
    for _ in 0..6 {
        got.push(summary(&next_member(&mut w).await));
    }
    let want: Vec<(&str, String)> = vec![
        ("joined", "m1".into()),
        ("joined", "m2".into()),
        ("left", "m0".into()),
        ("joined", "m3".into()),
        ("left", "m3".into()),
        ("updated", "m1".into()),
    ];
    assert_eq!(got, want);

    // A bare disconnect (no outage) loses nothing and repeats nothing.
    faulty.break_watches();
    writer.register("m5", b"5".to_vec(), &l1).await.unwrap();
    assert_eq!(summary(&next_member(&mut w).await), ("joined", "m5".into()));

    // History compacted while cut off: re-list and report the difference.
    faulty.set_down(true);
    writer.register("m4", b"4".to_vec(), &l1).await.unwrap();
    l2.revoke().await.unwrap(); // m2 leaves
    let rev = env.revision().await;
    b.compact(rev).await.unwrap();
    faulty.set_down(false);
    let mut got = BTreeSet::new();
    for _ in 0..2 {
        got.insert(summary(&next_member(&mut w).await));
    }
    let want: BTreeSet<(&str, String)> = [("joined", "m4".into()), ("left", "m2".into())].into();
    assert_eq!(got, want);

    // The watcher's view equals the truth.
    let (members, _) = writer.list().await.unwrap();
    let ids: BTreeSet<_> = members.into_iter().map(|m| m.id).collect();
    assert_eq!(
        ids,
        BTreeSet::from(["m1".to_owned(), "m4".to_owned(), "m5".to_owned()])
    );
    stop.cancel();
}

async fn claim_index_concurrent_and_reclaim(env: Env) {
    let b = &env.backend;
    let prefix = env.key("ps");
    b.put(&format!("{prefix}/desired"), b"3".to_vec(), None)
        .await
        .unwrap();
    let mut leases = Vec::new();
    for _ in 0..5 {
        leases.push(Some(env.lease().await));
    }
    let claims = futures::future::join_all(
        leases
            .iter()
            .flatten()
            .map(|l| claim_index(b.as_ref(), &prefix, 3, l.id().to_string(), l)),
    )
    .await;
    let mut won = Vec::new();
    let mut losers = Vec::new();
    for (i, c) in claims.into_iter().enumerate() {
        match c {
            Ok(claim) => won.push((claim.index, i, claim)),
            Err(Error::NoFreeIndex { n: 3 }) => losers.push(i),
            Err(e) => panic!("unexpected claim error: {e}"),
        }
    }
    won.sort_by_key(|w| w.0);
    assert_eq!(won.iter().map(|w| w.0).collect::<Vec<_>>(), vec![0, 1, 2]);
    assert_eq!(losers.len(), 2);

    // Claiming again with a holder's lease returns its claim.
    let (idx1, holder1, claim1) = won[1].clone();
    let holder_lease = leases[holder1].take().unwrap();
    let again = claim_index(b.as_ref(), &prefix, 3, "again", &holder_lease)
        .await
        .unwrap();
    assert_eq!(again, claim1);
    fenced_txn(
        b.as_ref(),
        &claim1.fence,
        Txn::new().and_then([Op::put(env.key("shard1"), "ok")]),
    )
    .await
    .unwrap();

    // A waiting claimer gets the slot freed by a revoked lease.
    let waiter = leases[losers[0]].take().unwrap();
    let (b2, p2, cancel) = (b.clone(), prefix.clone(), CancellationToken::new());
    let c2 = cancel.clone();
    let mut waiting = tokio::spawn(async move {
        let r = claim_index_wait(b2.as_ref(), &p2, 3, "waiter", &waiter, &c2).await;
        (r, waiter)
    });
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut waiting)
            .await
            .is_err(),
        "nothing is free yet"
    );
    holder_lease.revoke().await.unwrap();
    let (r, _waiter) = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .unwrap()
        .unwrap();
    let claim = r.unwrap();
    assert_eq!(claim.index, idx1);
    assert!(claim.fence.revision > claim1.fence.revision);
    // The old holder's fence no longer holds.
    let stale = fenced_txn(
        b.as_ref(),
        &claim1.fence,
        Txn::new().and_then([Op::put(env.key("shard1"), "stale")]),
    )
    .await;
    assert!(matches!(stale, Err(Error::NotLeader)));
    cancel.cancel();
    drop(leases);
}

/// etcd's limits: 128 operations per branch, 1.5 MiB per request. Both backends
/// refuse more with `InvalidArgument`, and change nothing.
async fn request_limits_rejected_alike(env: Env) {
    let b = &env.backend;
    let before = b
        .put(&env.key("marker"), b"1".to_vec(), None)
        .await
        .unwrap();
    let invalid = |r: Result<TxnResponse>| match r {
        Err(Error::InvalidArgument(msg)) => msg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    };

    let many =
        Txn::new().and_then((0..=MAX_TXN_OPS).map(|i| Op::put(env.key(&format!("k{i}")), "")));
    let msg = invalid(b.txn(many).await);
    assert!(msg.contains("too many operations"), "{msg}");
    let nested_many = Txn::new().and_then([Op::txn(
        Txn::new().and_then((0..=MAX_TXN_OPS).map(|i| Op::put(env.key(&format!("n{i}")), ""))),
    )]);
    invalid(b.txn(nested_many).await);
    let compares = Txn::new()
        .when((0..=MAX_TXN_OPS).map(|i| Compare::absent(env.key(&format!("c{i}")))))
        .and_then([Op::put(env.key("c"), "")]);
    invalid(b.txn(compares).await);
    // Exactly the limit is fine.
    let limit =
        Txn::new().and_then((0..MAX_TXN_OPS).map(|i| Op::put(env.key(&format!("k{i}")), "")));
    let rev = b.txn(limit).await.unwrap().revision;
    assert_eq!(rev, before + 1);

    const MIB: usize = 1 << 20;
    // Over etcd's 1.5 MiB but within gRPC's limit (2 MiB): "request is too large".
    let msg = match b.put(&env.key("big"), vec![7; MIB * 7 / 4], None).await {
        Err(Error::InvalidArgument(msg)) => msg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    };
    assert!(msg.contains("request is too large"), "{msg}");
    // Over gRPC's limit too: the same answer (not a retryable error).
    let msg = match b.put(&env.key("big"), vec![7; 3 * MIB], None).await {
        Err(Error::InvalidArgument(msg)) => msg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    };
    assert!(msg.contains("request is too large"), "{msg}");
    // Many small values adding up.
    let sum =
        Txn::new().and_then((0..4).map(|i| Op::put(env.key(&format!("s{i}")), vec![1; MIB / 2])));
    invalid(b.txn(sum).await);
    assert_eq!(
        env.revision().await,
        rev,
        "rejected requests changed nothing"
    );

    // One MiB is fine, alone or in a transaction.
    b.put(&env.key("big"), vec![7; MIB], None).await.unwrap();
    let kv = b.get(&env.key("big")).await.unwrap().unwrap();
    assert_eq!(kv.value.len(), MIB);
    b.txn(Txn::new().and_then([Op::put(env.key("big2"), vec![8; MIB])]))
        .await
        .unwrap();
    assert_eq!(
        b.delete_prefix(&env.prefix).await.unwrap(),
        MAX_TXN_OPS as u64 + 3
    );
}

/// Ranges larger than one etcd page (1000 keys) and than gRPC's default 4 MiB
/// message come back whole, sorted, at one revision.
async fn large_ranges_are_complete(env: Env) {
    let b = &env.backend;
    let keys: Vec<String> = (0..2500)
        .map(|i| env.key(&format!("many/{i:05}")))
        .collect();
    for chunk in keys.chunks(100) {
        b.txn(Txn::new().and_then(chunk.iter().map(|k| Op::put(k.clone(), "v"))))
            .await
            .unwrap();
    }
    // Keys just outside the prefix stay out.
    b.put(&env.key("many0"), b"x".to_vec(), None).await.unwrap();
    let last = b.put(&env.key("manz"), b"x".to_vec(), None).await.unwrap();
    let (kvs, rev) = b.range(&env.key("many/")).await.unwrap();
    assert!(rev >= last);
    let got: Vec<&str> = kvs.iter().map(|kv| kv.key.as_str()).collect();
    assert_eq!(got, keys.iter().map(String::as_str).collect::<Vec<_>>());

    const MIB: usize = 1 << 20;
    for i in 0..6 {
        b.put(
            &env.key(&format!("fat/{i}")),
            vec![u8::try_from(i).unwrap(); MIB],
            None,
        )
        .await
        .unwrap();
    }
    let (kvs, _) = b.range(&env.key("fat/")).await.unwrap();
    assert_eq!(kvs.len(), 6);
    assert!(
        kvs.iter()
            .enumerate()
            .all(|(i, kv)| kv.value.len() == MIB && kv.value[0] == u8::try_from(i).unwrap())
    );
    // Not paginated: one 6 MiB answer.
    let resp = b
        .txn(Txn::new().and_then([Op::get_prefix(env.key("fat/"))]))
        .await
        .unwrap();
    assert_eq!(resp.get(0).unwrap().len(), 6);
    b.delete_prefix(&env.prefix).await.unwrap();
}

/// The space quota of both backends (each on a store of its own, with a quota of
/// [`QUOTA`]): see [`full_store_refuses_writes_until_space_is_freed`].
const QUOTA: u64 = 2_000_000;

#[tokio::test(start_paused = true)]
async fn mem_full_store_refuses_writes_until_space_is_freed() {
    full_store_refuses_writes_until_space_is_freed(Arc::new(MemBackend::new().with_quota(QUOTA)))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_full_store_refuses_writes_until_space_is_freed() {
    let options = edl_coord::local_etcd::Options {
        quota_bytes: Some(QUOTA),
        ..Default::default()
    };
    let cluster = EtcdCluster::start_with(1, options)
        .await
        .expect("start etcd");
    let backend = cluster.connect().await.expect("connect to etcd");
    full_store_refuses_writes_until_space_is_freed(backend).await;
}

/// A store filled past its quota raises its space alarm: puts, transactions that put
/// and lease grants are refused with `NoSpace` (retryable, and said with the fix),
/// while reads, deletes, delete-only transactions and lease renewals are served; the
/// alarm stays after keys are deleted, until `free_space`, which shrinks the store and
/// ends the alarm; then writes succeed.
async fn full_store_refuses_writes_until_space_is_freed(backend: Arc<dyn Backend>) {
    const VALUE: usize = 64 << 10;
    let lease = backend.lease_grant(Duration::from_secs(60)).await.unwrap();
    backend
        .put("/full/leased", b"x".to_vec(), Some(lease.id))
        .await
        .unwrap();
    let mut filled = 0u64;
    let full = loop {
        // etcd measures its database file, which grows in steps and is measured at its
        // commits (every 100 ms): a burst of puts passes the quota by some way.
        assert!(
            filled * VALUE as u64 <= 10 * QUOTA,
            "{filled} values of {VALUE} bytes and the store is not full"
        );
        let value: Vec<u8> = (0..VALUE).map(|_| rand::random::<u8>()).collect();
        match backend
            .put(&format!("/full/junk/{filled}"), value, None)
            .await
        {
            Ok(_) => filled += 1,
            Err(e) => break e,
        }
    };
    // The positive witness: the store took data before it filled up.
    assert!(filled >= 4, "only {filled} values fit");
    assert!(full.is_no_space() && full.is_retryable(), "{full:?}");
    assert!(full.to_string().contains("--quota-backend-bytes"), "{full}");

    let refused = |r: Result<()>, what: &str| match r {
        Err(e) if e.is_no_space() => {}
        other => panic!("{what} while full: {other:?}"),
    };
    refused(
        backend
            .put("/full/small", b"x".to_vec(), None)
            .await
            .map(drop),
        "a put",
    );
    refused(backend.lease_grant(TTL).await.map(drop), "a lease grant");
    let put_txn = Txn {
        compares: vec![],
        success: vec![],
        failure: vec![Op::Put {
            key: "/full/txn".into(),
            value: b"x".to_vec(),
            lease: None,
        }],
    };
    refused(
        backend.txn(put_txn).await.map(drop),
        "a transaction that puts",
    );

    // Served while full. etcd checks the quota twice: before a put (refused, not
    // applied) and again as it applies one, where a put that takes the store past the
    // quota is kept and still answered `NoSpace`. So the refused put may be there.
    assert!(backend.get("/full/leased").await.unwrap().is_some());
    let held = backend.range("/full/junk/").await.unwrap().0.len() as u64;
    assert!(
        held == filled || held == filled + 1,
        "{held} values held after {filled} accepted puts"
    );
    assert!(
        backend
            .lease_keep_alive_once(lease.id)
            .await
            .unwrap()
            .is_some()
    );
    let delete_txn = Txn {
        compares: vec![],
        success: vec![Op::Delete {
            key: "/full/junk/0".into(),
        }],
        failure: vec![],
    };
    assert!(backend.txn(delete_txn).await.unwrap().succeeded);
    assert_eq!(
        backend.delete_prefix("/full/junk/").await.unwrap(),
        held - 1
    );
    // Deleting is not enough: the alarm stays until the space is freed.
    refused(
        backend
            .put("/full/small", b"x".to_vec(), None)
            .await
            .map(drop),
        "a put after deleting",
    );

    let freed = backend.free_space().await.unwrap();
    assert!(freed.disarmed, "{freed:?}");
    assert!(
        freed.size_after < freed.size_before && freed.size_after < QUOTA / 2,
        "{freed:?}"
    );
    backend
        .put("/full/small", b"x".to_vec(), None)
        .await
        .unwrap();
    backend.lease_grant(TTL).await.unwrap();
    assert!(backend.get("/full/leased").await.unwrap().is_some());
    // Nothing to free: no alarm to end.
    assert!(!backend.free_space().await.unwrap().disarmed);
}
