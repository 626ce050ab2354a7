//! The backup's and joiner's side: applying the primary's stream in order, snapshots,
//! asking for what is missing (after a gap, a new epoch or a silence), and promotion
//! once the primary's lease is gone.

use std::collections::BTreeSet;

use super::{Effect, GroupRecord, Guard, Millis, Msg, Replica, Role, Seq};

impl Replica {
    /// The record gives this replica a place as a backup or joiner of another primary:
    /// it keeps following the stream, or learns whether its state is still a prefix of
    /// the new primary's and asks for what it lacks.
    ///
    /// `resume`: this replica just got its place, or its own promotion lost (it dropped
    /// the ops that came meanwhile): it tells the primary where it stands.
    pub(super) fn follow(&mut self, now: Millis, resume: bool, out: &mut Vec<Effect>) {
        let Some(r) = self.record.clone() else {
            return;
        };
        if self.synced() {
            // Same epoch: a change of membership.
            if resume {
                self.ask(now, out);
            }
            return;
        }
        // A new epoch: this state is a prefix of the new primary's when both are
        // prefixes of the same stream and it holds no op past the new primary's base.
        if r.incarnation == self.incarnation
            && self.synced.is_some_and(|e| e == r.base_epoch)
            && self.applied <= r.seq_base
        {
            self.synced = Some(r.epoch);
        }
        self.ask(now, out);
    }

    /// Asks the primary for the ops after this state, or for a snapshot.
    pub(super) fn ask(&mut self, now: Millis, out: &mut Vec<Effect>) {
        let Some(r) = &self.record else {
            return;
        };
        let have = self.synced().then_some(self.applied);
        self.asked = Some(now);
        out.push(Effect::Send {
            to: r.primary.clone(),
            msg: Msg::Need {
                epoch: r.epoch,
                have,
                change: r.change,
            },
        });
    }

    /// Whether this replica proposed itself as primary and the outcome is not known:
    /// it applies nothing meanwhile (its state is the new epoch's base).
    pub(super) fn promoting(&self) -> bool {
        self.proposal.as_ref().is_some_and(|p| p.primary == self.me)
    }

    /// Whether a message of `epoch` from `from` is the current primary's stream to a
    /// replica following it.
    fn is_primary_stream(&self, from: &str, epoch: u64) -> bool {
        matches!(self.role(), Role::Backup | Role::Joining)
            && !self.promoting()
            && self
                .record
                .as_ref()
                .is_some_and(|r| r.epoch == epoch && r.primary == from)
    }

    pub(super) fn on_op(
        &mut self,
        now: Millis,
        from: &str,
        epoch: u64,
        seq: Seq,
        out: &mut Vec<Effect>,
    ) {
        if self.primary.is_some() {
            // Another primary's stream: a newer epoch exists.
            self.learn_epoch(epoch, out);
            return;
        }
        // An epoch not yet seen in a record waits for the record (then this replica asks).
        if !self.is_primary_stream(from, epoch) || !self.synced() || seq <= self.applied {
            return;
        }
        if seq > self.applied + 1 {
            // A gap (messages lost with a broken connection): ask once per timeout.
            if self.asked.is_none_or(|t| now >= t + self.cfg.timeout) {
                self.ask(now, out);
            }
            return;
        }
        self.applied = seq;
        self.asked = None;
        out.push(Effect::Apply { seq });
        out.push(Effect::Send {
            to: from.to_string(),
            msg: Msg::Confirm { epoch, seq },
        });
    }

    pub(super) fn on_snapshot(
        &mut self,
        _now: Millis,
        from: &str,
        epoch: u64,
        seq: Seq,
        out: &mut Vec<Effect>,
    ) {
        if self.primary.is_some() {
            self.learn_epoch(epoch, out);
            return;
        }
        if !self.is_primary_stream(from, epoch) {
            return;
        }
        // A synced state longer than the snapshot is a longer prefix of the same stream:
        // keep it (what it confirmed stays confirmed).
        if !(self.synced() && self.applied >= seq) {
            self.applied = seq;
            self.synced = Some(epoch);
            if let Some(r) = &self.record {
                self.incarnation = r.incarnation;
            }
            out.push(Effect::Install { seq });
        }
        self.asked = None;
        out.push(Effect::Send {
            to: from.to_string(),
            msg: Msg::Confirm {
                epoch,
                seq: self.applied,
            },
        });
    }

    /// A backup's or joiner's timers: asking again after a silence, and promotion.
    pub(super) fn backup_tick(&mut self, now: Millis, out: &mut Vec<Effect>) {
        if matches!(self.role(), Role::Backup | Role::Joining)
            && !self.promoting()
            && self.asked.is_some_and(|t| now >= t + self.cfg.timeout)
        {
            self.ask(now, out);
        }
        self.maybe_promote(out);
    }

    /// An in-sync, synced backup proposes itself as primary once the primary's lease is
    /// gone, from exactly its state (`seq_base`), guarded in etcd by the old primary's
    /// key being absent and its own present.
    fn maybe_promote(&mut self, out: &mut Vec<Effect>) {
        let Some(r) = &self.record else {
            return;
        };
        let Some(base_epoch) = self.synced.filter(|_| self.incarnation == r.incarnation) else {
            return;
        };
        if self.role() != Role::Backup
            || self.proposal.is_some()
            || self.is_live(&r.primary)
            || !self.is_live(&self.me)
        {
            return;
        }
        let backups = r
            .backups
            .iter()
            .filter(|b| **b != self.me && self.is_live(b))
            .cloned()
            .collect();
        let record = GroupRecord {
            version: edl_job::RECORD_VERSION,
            change: r.change + 1,
            epoch: r.epoch + 1,
            incarnation: r.incarnation,
            primary: self.me.clone(),
            backups,
            joining: BTreeSet::new(),
            seq_base: self.applied,
            base_epoch,
            replicas: self.cfg.replicas as u32,
        };
        let guard = Guard {
            alive: self.me.clone(),
            absent: [r.primary.clone()].into(),
        };
        tracing::debug!(member = %self.me, epoch = record.epoch, seq_base = record.seq_base, "promotion proposed");
        self.propose(record, guard, out);
    }
}
