//! The etcd side of a shard's replica group (docs/replication.md), for one pserver
//! process: its member key `ps-member/<id>` under its lease, the group record
//! `ps-group/<shard>` followed and written by guarded compare-and-swaps, and the live
//! members followed. The replica state machine ([`crate::replica`]) decides; this reads
//! and writes.
//!
//! A compare-and-swap compares the record's mod revision as last read with the `change`
//! the machine expects (absent when it expects none), that the proposer's own member key
//! is present, and that the members the guard names are absent (their leases ended). Its
//! outcome is one of three: written, refused (with the record as it is), or not known
//! (etcd unreachable: the caller sends the same proposal again).

use std::sync::{Arc, Mutex};

use edl_coord::{Backend, Compare, CompareOp, Lease, Op, Registry, Revision, Txn, follow_prefix};
use edl_job::{GroupRecord, JobKeys, MemberRecord, Record};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::replica::Guard;
use crate::shard::lock;

/// A proposal's outcome.
#[derive(Debug)]
pub enum Proposed {
    /// Written: the record is the group's now.
    Written(GroupRecord),
    /// Refused: the record moved on, or the guard failed; the record as it is.
    Refused(Option<GroupRecord>),
    /// Not known (etcd did not answer): send the same proposal again.
    Unknown(edl_coord::Error),
}

/// A shard's group record and this process's member key in etcd.
#[derive(Debug)]
pub struct GroupStore {
    backend: Arc<dyn Backend>,
    keys: JobKeys,
    shard: u32,
    /// The newest record read, with its mod revision (the compare-and-swap's guard).
    last: Mutex<Option<(u64, Revision)>>,
}

impl GroupStore {
    /// The store of shard `shard`'s group.
    pub fn new(backend: Arc<dyn Backend>, keys: JobKeys, shard: u32) -> GroupStore {
        GroupStore {
            backend,
            keys,
            shard,
            last: Mutex::new(None),
        }
    }

    /// Registers this process as member `me` under `lease`.
    pub async fn register(
        &self,
        me: &str,
        rec: &MemberRecord,
        lease: &Lease,
    ) -> Result<(), edl_coord::Error> {
        Registry::new(self.backend.clone(), self.keys.ps_members())
            .register(me, rec.encode(), lease)
            .await
            .map(|_| ())
    }

    /// Remembers the mod revision of the record of `change`.
    fn seen(&self, change: u64, revision: Revision) {
        let mut last = lock(&self.last);
        if last.is_none_or(|(c, _)| c <= change) {
            *last = Some((change, revision));
        }
    }

    fn decode(&self, value: &[u8], revision: Revision) -> Option<GroupRecord> {
        match GroupRecord::decode(value) {
            Ok(r) => {
                self.seen(r.change, revision);
                Some(r)
            }
            Err(e) => {
                tracing::error!(shard = self.shard, error = %e, "unreadable group record; ignored");
                None
            }
        }
    }

    /// The group record as it is in etcd.
    pub async fn read(&self) -> Result<Option<GroupRecord>, edl_coord::Error> {
        let kv = self.backend.get(&self.keys.ps_group(self.shard)).await?;
        Ok(kv.and_then(|kv| self.decode(&kv.value, kv.mod_revision)))
    }

    /// Writes `record` if the group record is still the one of `expect_change` (absent
    /// for 0) and `guard` holds.
    pub async fn propose(
        &self,
        expect_change: u64,
        record: &GroupRecord,
        guard: &Guard,
    ) -> Proposed {
        let key = self.keys.ps_group(self.shard);
        let current = if expect_change == 0 {
            Compare::absent(key.clone())
        } else {
            let known = *lock(&self.last);
            match known {
                Some((c, rev)) if c == expect_change => {
                    Compare::mod_revision(key.clone(), CompareOp::Equal, rev)
                }
                // The machine expects a record this store has not read: it cannot be
                // the current one, or it was read here first.
                _ => {
                    return match self.read().await {
                        Ok(r) => Proposed::Refused(r),
                        Err(e) => Proposed::Unknown(e),
                    };
                }
            }
        };
        let mut when = vec![current, Compare::exists(self.keys.ps_member(&guard.alive))];
        when.extend(
            guard
                .absent
                .iter()
                .map(|m| Compare::absent(self.keys.ps_member(m))),
        );
        let txn = Txn::new()
            .when(when)
            .and_then([Op::put(key.clone(), record.encode())])
            .or_else([Op::get(key)]);
        match self.backend.txn(txn).await {
            Ok(resp) if resp.succeeded => {
                self.seen(record.change, resp.revision);
                tracing::info!(shard = self.shard, change = record.change, epoch = record.epoch, primary = %record.primary, backups = ?record.backups, joining = ?record.joining, "group record written");
                Proposed::Written(record.clone())
            }
            Ok(resp) => {
                let now = resp
                    .get(0)
                    .and_then(|kvs| kvs.first())
                    .and_then(|kv| self.decode(&kv.value, kv.mod_revision));
                Proposed::Refused(now)
            }
            Err(e) => Proposed::Unknown(e),
        }
    }

    /// Follows the group record until `cancel` fires: the receiver holds the newest
    /// record (`None` until one exists or is listed).
    pub fn follow(
        self: &Arc<Self>,
        cancel: CancellationToken,
    ) -> watch::Receiver<Option<GroupRecord>> {
        let key = self.keys.ps_group(self.shard);
        // The groups' prefix (the shard's own key is no prefix of its own: `ps-group/1`
        // would match `ps-group/10`), the shard's key picked out.
        let mut view = follow_prefix(self.backend.clone(), self.keys.ps_groups(), cancel.clone());
        let (tx, rx) = watch::channel(None);
        let store = self.clone();
        tokio::spawn(async move {
            loop {
                let kv = view.borrow_and_update().kvs.get(&key).cloned();
                if let Some(kv) = kv
                    && let Some(r) = store.decode(&kv.value, kv.mod_revision)
                {
                    tx.send_if_modified(|cur: &mut Option<GroupRecord>| {
                        let newer = cur.as_ref().is_none_or(|c| c.change < r.change);
                        if newer {
                            *cur = Some(r);
                        }
                        newer
                    });
                }
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    changed = view.changed() => if changed.is_err() { break },
                }
            }
        });
        rx
    }

    /// Follows the live members (their keys present) until `cancel` fires: each id
    /// with its record.
    pub fn members(
        &self,
        cancel: CancellationToken,
    ) -> watch::Receiver<std::collections::BTreeMap<String, MemberRecord>> {
        let prefix = self.keys.ps_members();
        let mut view = follow_prefix(self.backend.clone(), prefix.clone(), cancel.clone());
        let (tx, rx) = watch::channel(Default::default());
        tokio::spawn(async move {
            loop {
                let v = view.borrow_and_update().clone();
                if v.revision == 0 {
                    // Not listed yet: no member is known to be gone.
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        changed = view.changed() => if changed.is_err() { break },
                    }
                    continue;
                }
                let ids: std::collections::BTreeMap<String, MemberRecord> = v
                    .kvs
                    .iter()
                    .filter_map(|(k, kv)| {
                        let id = k.strip_prefix(&prefix)?;
                        Some((id.to_string(), MemberRecord::decode(&kv.value).ok()?))
                    })
                    .collect();
                tx.send_if_modified(
                    |cur: &mut std::collections::BTreeMap<String, MemberRecord>| {
                        let changed = *cur != ids;
                        if changed {
                            cur.clone_from(&ids);
                        }
                        changed
                    },
                );
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    changed = view.changed() => if changed.is_err() { break },
                }
            }
        });
        rx
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::time::Duration;

    use edl_testkit::etcd::EtcdCluster;

    use super::*;

    fn member(addr: &str) -> MemberRecord {
        MemberRecord {
            version: edl_job::RECORD_VERSION,
            addr: addr.into(),
            pid: 1,
            started_ms: 0,
            instance: String::new(),
        }
    }

    async fn until<T>(rx: &mut watch::Receiver<T>, mut f: impl FnMut(&T) -> bool) {
        tokio::time::timeout(Duration::from_secs(10), async {
            while !f(&rx.borrow_and_update()) {
                rx.changed().await.unwrap();
            }
        })
        .await
        .expect("the watched value never came");
    }

    /// A promotion is written only once the primary's key is gone; the old primary's
    /// own proposal then loses; a restore is refused while an in-sync backup lives; an
    /// unreachable etcd is an unknown outcome, not a refusal.
    #[tokio::test]
    async fn proposals_are_fenced_by_the_record_and_the_members_keys() {
        let etcd = EtcdCluster::start(1).await.unwrap();
        let backend = etcd.connect().await.unwrap();
        let keys = JobKeys::new(&edl_job::JobName::new("g").unwrap());
        let store = Arc::new(GroupStore::new(backend.clone(), keys.clone(), 0));
        let cancel = CancellationToken::new();
        let _stop = cancel.clone().drop_guard();
        let ttl = Duration::from_secs(5);
        let la = Lease::grant(backend.clone(), ttl, cancel.clone())
            .await
            .unwrap();
        let lb = Lease::grant(backend.clone(), ttl, cancel.clone())
            .await
            .unwrap();
        let lc = Lease::grant(backend.clone(), ttl, cancel.clone())
            .await
            .unwrap();
        store.register("a", &member("a:1"), &la).await.unwrap();
        store.register("b", &member("b:1"), &lb).await.unwrap();
        store.register("c", &member("c:1"), &lc).await.unwrap();
        let mut followed = store.follow(cancel.clone());
        let mut live = store.members(cancel.clone());
        until(&mut live, |m| m.len() == 3).await;
        assert_eq!(live.borrow()["b"].addr, "b:1");

        // a creates the group, then adds b.
        let first = GroupRecord::restored(None, "a".into(), 1, 2);
        let alive = |m: &str| Guard {
            alive: m.into(),
            absent: BTreeSet::new(),
        };
        assert!(matches!(
            store.propose(0, &first, &alive("a")).await,
            Proposed::Written(_)
        ));
        let mut with_b = first.clone();
        with_b.change += 1;
        with_b.backups.insert("b".into());
        assert!(matches!(
            store.propose(1, &with_b, &alive("a")).await,
            Proposed::Written(_)
        ));
        until(&mut followed, |r| r.as_ref().is_some_and(|r| r.change == 2)).await;

        // b's promotion: refused while a's key is there.
        let mut promoted = with_b.clone();
        promoted.change += 1;
        promoted.epoch += 1;
        promoted.primary = "b".into();
        promoted.backups.clear();
        promoted.seq_base = 7;
        promoted.base_epoch = with_b.epoch;
        let guard = Guard {
            alive: "b".into(),
            absent: ["a".to_string()].into(),
        };
        match store.propose(2, &promoted, &guard).await {
            Proposed::Refused(Some(r)) => assert_eq!(r, with_b),
            other => panic!("promotion with the primary alive: {other:?}"),
        }
        // A restore by c is refused while b (in sync) lives.
        let restore = GroupRecord::restored(Some(&with_b), "c".into(), 2, 2);
        let rguard = crate::replica::restore_guard(&with_b, &"c".to_string());
        assert!(matches!(
            store.propose(2, &restore, &rguard).await,
            Proposed::Refused(_)
        ));
        // a's lease ends: the promotion is written.
        la.revoke_shared().await.unwrap();
        until(&mut live, |m| !m.contains_key("a")).await;
        assert!(matches!(
            store.propose(2, &promoted, &guard).await,
            Proposed::Written(_)
        ));
        until(&mut followed, |r| r.as_ref().is_some_and(|r| r.epoch == 2)).await;
        // The old primary's proposal on the record it knew loses.
        let mut stale = with_b.clone();
        stale.change += 1;
        stale.backups.clear();
        match store.propose(2, &stale, &alive("a")).await {
            Proposed::Refused(Some(r)) => assert_eq!(r, promoted),
            other => panic!("a stale proposal: {other:?}"),
        }
        assert_eq!(store.read().await.unwrap(), Some(promoted.clone()));

        // etcd down: the outcome is not known.
        etcd.kill(0).unwrap();
        let mut next = promoted.clone();
        next.change += 1;
        next.joining.insert("c".into());
        let outcome = tokio::time::timeout(
            Duration::from_secs(30),
            store.propose(3, &next, &alive("b")),
        )
        .await
        .expect("a proposal to a dead etcd did not return");
        assert!(matches!(outcome, Proposed::Unknown(_)), "{outcome:?}");
    }
}
