//! The invariants checked after every step of the simulated world, and healing it
//! until the group settles.

use super::*;

impl World {
    /// The invariants, after every step.
    pub(super) fn check(&mut self) {
        for (id, n) in &mut self.nodes {
            let Some(epoch) = n.rep.primary_epoch() else {
                continue;
            };
            // One primary per epoch.
            let who = self.acted.entry(epoch).or_insert_with(|| id.clone());
            assert_eq!(who, id, "two primaries in epoch {epoch}");
            if n.primary_of != Some(epoch) {
                n.primary_of = Some(epoch);
                // Every acknowledged op of this incarnation is in the new primary.
                let inc = n.rep.record().unwrap().incarnation;
                let held: BTreeSet<u64> = n.data.iter().copied().collect();
                for op in self.acked.get(&inc).into_iter().flatten() {
                    assert!(
                        held.contains(op),
                        "{id}, primary of epoch {epoch}, lacks acknowledged op {op}"
                    );
                }
            }
        }
        // Every in-sync replica of the record in etcd holds every op acknowledged in its
        // incarnation.
        if let Some(r) = self.history.last() {
            let acked = self.acked.get(&r.incarnation);
            for m in r.backups.iter().chain([&r.primary]) {
                let Some(n) = self.nodes.get(m) else {
                    continue;
                };
                let held: BTreeSet<u64> = n.data.iter().copied().collect();
                for op in acked.into_iter().flatten() {
                    assert!(
                        held.contains(op),
                        "{m}, in sync in change {}, lacks acknowledged op {op}",
                        r.change
                    );
                }
            }
        }
        // A synced replica's state is a prefix of its primary's.
        let primaries: BTreeMap<u64, &Node> = self
            .nodes
            .values()
            .filter_map(|n| n.rep.primary_epoch().map(|e| (e, n)))
            .collect();
        for (id, n) in &self.nodes {
            if n.rep.primary_epoch().is_some() || !n.rep.synced() {
                continue;
            }
            let epoch = n.rep.record().unwrap().epoch;
            if let Some(p) = primaries.get(&epoch) {
                let k = n.data.len().min(p.data.len());
                assert_eq!(
                    &n.data[..k],
                    &p.data[..k],
                    "{id}'s state is not a prefix of its primary's"
                );
                assert!(
                    n.data.len() <= p.data.len(),
                    "{id} holds more than its primary"
                );
            }
        }
    }

    /// Everything heals; enough processes run; the group settles and serves: a push is
    /// acknowledged and the group has its replica count.
    pub(super) fn settle(&mut self) {
        self.cut.clear();
        let ids: Vec<MemberId> = self.nodes.keys().cloned().collect();
        for id in &ids {
            let n = self.nodes.get_mut(id).unwrap();
            n.stopped = false;
            n.etcd_cut = false;
        }
        self.advance(0);
        while self.nodes.len() < self.cfg.replicas {
            self.start();
        }
        let deadline = self.now + 120_000;
        loop {
            if self.now >= deadline {
                // What each process holds, to tell why.
                for (id, n) in &self.nodes {
                    eprintln!("{id}: {:?} data {:?}", n.rep, n.data);
                }
                eprintln!("members {:?}", self.members);
            }
            assert!(
                self.now < deadline,
                "the group did not settle: {:?}",
                self.record()
            );
            self.pump();
            let gone = self.record().is_none_or(|r| {
                !self.is_live(&r.primary) && r.backups.iter().all(|b| !self.is_live(b))
            });
            if gone {
                let outside: Vec<MemberId> = self
                    .nodes
                    .iter()
                    .filter(|(_, n)| n.rep.role() == Role::Outside)
                    .map(|(id, _)| id.clone())
                    .collect();
                if let Some(id) = outside.first() {
                    self.restore(id);
                }
            }
            let r = self.record().cloned();
            if let Some(r) = r
                && r.backups.len() + 1 == self.cfg.replicas
                && r.joining.is_empty()
                && self
                    .nodes
                    .get(&r.primary)
                    .is_some_and(|n| n.rep.primary_epoch() == Some(r.epoch))
            {
                let before = self.acks;
                self.submit(&r.primary.clone());
                for _ in 0..20 {
                    self.pump();
                }
                if self.acks > before {
                    return;
                }
            }
            self.advance(200);
        }
    }

    /// Delivers every message and watch event now.
    pub(super) fn pump(&mut self) {
        for _ in 0..50 {
            let ids: Vec<MemberId> = self.nodes.keys().cloned().collect();
            for id in &ids {
                self.watch(id, true);
            }
            let keys: Vec<(MemberId, MemberId)> = self
                .net
                .iter()
                .filter(|((_, to), q)| {
                    !q.is_empty() && self.nodes.get(to).is_some_and(|n| !n.stopped)
                })
                .map(|(k, _)| k.clone())
                .collect();
            if keys.is_empty() {
                return;
            }
            for (f, t) in keys {
                drain(self, &f, &t);
            }
        }
    }
}
