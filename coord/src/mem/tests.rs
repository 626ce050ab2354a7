//! Unit tests of the in-memory store (history compaction, lease expiry, etcd's
//! transaction rules, TTLs) and the property test that replaying the watch history
//! rebuilds the store.

use super::lease::lease_ttl_secs;
use super::txn::{check_request_size, txn_size, validate_txn};
use super::*;
use crate::backend::Backend;
use crate::error::Error;
use crate::types::{Compare, CompareOp, EventKind, MAX_REQUEST_BYTES, MAX_TXN_OPS, Op, Txn};
use futures::{FutureExt, StreamExt};

#[tokio::test(start_paused = true)]
async fn history_limit_compacts_whole_revisions() {
    let b = MemBackend::with_history_limit(3);
    b.put("a", b"1".to_vec(), None).await.unwrap(); // rev 2
    let t = Txn::new().and_then([Op::put("b", "1"), Op::put("c", "1")]);
    b.txn(t).await.unwrap(); // rev 3 (two events)
    b.put("d", b"1".to_vec(), None).await.unwrap(); // rev 4 -> evicts rev 2
    let mut w = b.watch_prefix("", Some(2)).await.unwrap();
    match w.next().await {
        Some(Err(Error::Compacted { compact_revision })) => assert_eq!(compact_revision, 3),
        other => panic!("unexpected {other:?}"),
    }
    let w = b.watch_prefix("", Some(3)).await.unwrap();
    let evs: Vec<_> = w.take(3).map(|e| e.unwrap().kv.key).collect().await;
    assert_eq!(evs, vec!["b", "c", "d"]);
}

#[tokio::test(start_paused = true)]
async fn expiry_task_deletes_without_other_requests() {
    let b = MemBackend::new();
    let g = b.lease_grant(Duration::from_secs(2)).await.unwrap();
    b.put("k", b"v".to_vec(), Some(g.id)).await.unwrap();
    let mut w = b.watch_prefix("k", None).await.unwrap();
    let ev = tokio::time::timeout(Duration::from_secs(3), w.next())
        .await
        .expect("expiry within ttl")
        .unwrap()
        .unwrap();
    assert_eq!(ev.kind, EventKind::Delete);
    assert_eq!(ev.kv.key, "k");
}

#[test]
fn duplicate_key_rules() {
    let ok = Txn::new().and_then([Op::put("a", "1"), Op::put("b", "1")]);
    assert!(validate_txn(&ok).is_ok());
    let dup = Txn::new().and_then([Op::put("a", "1"), Op::put("a", "2")]);
    assert!(validate_txn(&dup).is_err());
    let put_del = Txn::new().and_then([Op::delete_prefix("a"), Op::put("ab", "1")]);
    assert!(validate_txn(&put_del).is_err());
    let nested_both_branches = Txn::new().and_then([Op::txn(
        Txn::new()
            .and_then([Op::put("a", "1")])
            .or_else([Op::put("a", "2")]),
    )]);
    assert!(validate_txn(&nested_both_branches).is_ok());
    let nested_dup = Txn::new().and_then([
        Op::put("a", "0"),
        Op::txn(Txn::new().and_then([Op::put("a", "1")])),
    ]);
    assert!(validate_txn(&nested_dup).is_err());
    let too_many = Txn::new().and_then((0..=MAX_TXN_OPS).map(|i| Op::put(format!("k{i}"), "")));
    assert!(validate_txn(&too_many).is_err());
}

#[derive(Clone, Debug)]
enum Step {
    Put(u8, u8),
    Delete(u8),
    DeletePrefix,
    Txn(u8, u8, u8),
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        (0u8..4, any::<u8>()).prop_map(|(k, v)| Step::Put(k, v)),
        (0u8..4).prop_map(Step::Delete),
        Just(Step::DeletePrefix),
        (0u8..4, 0u8..4, any::<u8>()).prop_map(|(c, k, v)| Step::Txn(c, k, v)),
    ]
}

proptest::proptest! {
    /// Every effective write bumps the revision by one; replaying the watch
    /// history from revision 1 rebuilds exactly the final store.
    #[test]
    fn history_replays_to_the_store(steps in proptest::collection::vec(step(), 1..40)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let b = MemBackend::new();
            let key = |k: u8| format!("p/{k}");
            for s in &steps {
                let before = b.revision();
                let changed = match s {
                    Step::Put(k, v) => {
                        b.put(&key(*k), vec![*v], None).await.unwrap();
                        true
                    }
                    Step::Delete(k) => b.delete(&key(*k)).await.unwrap(),
                    Step::DeletePrefix => b.delete_prefix("p/").await.unwrap() > 0,
                    Step::Txn(c, k, v) => {
                        let t = Txn::new()
                            .when([Compare::exists(key(*c))])
                            .and_then([Op::put(key(*k), vec![*v])])
                            .or_else([Op::delete(key(*k))]);
                        let existed = b.get(&key(*k)).await.unwrap().is_some();
                        let r = b.txn(t).await.unwrap();
                        r.succeeded || existed
                    }
                };
                assert_eq!(b.revision(), before + i64::from(changed), "{s:?}");
            }
            let mut w = b.watch_prefix("p/", Some(1)).await.unwrap();
            let mut replay: BTreeMap<String, KeyValue> = BTreeMap::new();
            let mut last = 0;
            // Every event is already in the history: drain without waiting.
            while let Some(Some(ev)) = w.next().now_or_never() {
                let ev = ev.unwrap();
                assert!(ev.revision() >= last);
                last = ev.revision();
                match ev.kind {
                    EventKind::Put => {
                        replay.insert(ev.kv.key.clone(), ev.kv);
                    }
                    EventKind::Delete => {
                        replay.remove(&ev.kv.key);
                    }
                }
            }
            assert_eq!(last.max(1), b.revision());
            let (kvs, _) = b.range("p/").await.unwrap();
            let replayed: Vec<KeyValue> = replay.into_values().collect();
            assert_eq!(kvs, replayed);
        });
    }
}

#[tokio::test(start_paused = true)]
async fn min_ttl_raises_granted_ttls() {
    let b = MemBackend::new().with_min_ttl(Duration::from_millis(1500));
    let g = b.lease_grant(Duration::from_secs(1)).await.unwrap();
    assert_eq!(g.ttl, Duration::from_secs(2));
    assert_eq!(b.lease_keep_alive_once(g.id).await.unwrap(), Some(g.ttl));
    let g = b.lease_grant(Duration::from_secs(5)).await.unwrap();
    assert_eq!(g.ttl, Duration::from_secs(5));
    // Without it, a TTL is granted as asked.
    let g = MemBackend::new()
        .lease_grant(Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(g.ttl, Duration::from_secs(1));
}

#[test]
fn request_size_counts_keys_values_and_compares() {
    let big = Txn::new()
        .when([Compare::value(
            "k",
            CompareOp::Equal,
            vec![0; MAX_REQUEST_BYTES],
        )])
        .and_then([Op::put("k", "v")]);
    assert!(check_request_size(txn_size(&big)).is_err());
    let nested = Txn::new().and_then([Op::txn(
        Txn::new().and_then([Op::put("k", vec![0; MAX_REQUEST_BYTES])]),
    )]);
    assert!(check_request_size(txn_size(&nested)).is_err());
    let small = Txn::new().and_then([Op::put("k", vec![0; MAX_REQUEST_BYTES / 2])]);
    assert!(check_request_size(txn_size(&small)).is_ok());
}

#[test]
fn ttl_rounds_up_to_seconds() {
    assert_eq!(lease_ttl_secs(Duration::from_millis(1500)).unwrap(), 2);
    assert_eq!(lease_ttl_secs(Duration::from_secs(2)).unwrap(), 2);
    assert!(lease_ttl_secs(Duration::ZERO).is_err());
}
