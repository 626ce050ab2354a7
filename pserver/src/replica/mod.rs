//! A shard's replica group as a pure state machine: one [`Replica`] per pserver process
//! and shard. It does no I/O and reads no clock: its shell passes the time, the group
//! record read from etcd, the live members, the lease's deadline and the messages of the
//! other replicas, and carries out the [`Effect`]s it returns, in order (send, apply,
//! snapshot, a compare-and-swap of the record, acknowledge). The protocol is
//! primary-backup with the in-sync set kept in etcd (docs/replication.md).
//!
//! Invariants (checked by the property tests in `tests.rs`, over random interleavings of
//! pushes, kills, stops, partitions, lease ends, joins and restores):
//! - **one primary per epoch**: a replica acts as primary (assigns or acknowledges ops)
//!   only in the epoch of a record naming it, and a record's epoch changes only through
//!   a compare-and-swap that raises it; a replica applies and answers nothing of an
//!   older epoch than the newest it has seen;
//! - **acknowledged means held by every in-sync replica**: the primary acknowledges op
//!   `s` only once it applied `s` and every in-sync backup of its record, and of the
//!   record it proposed if one is unsettled, confirmed `s`; so every acknowledged op is
//!   in every later primary of the same incarnation;
//! - **the in-sync set shrinks only through etcd**: a backup that confirms nothing for
//!   `timeout`, or whose lease ended, stays waited for until the primary's record
//!   without it is written;
//! - **only an in-sync backup is promoted, and only once the primary's lease is gone**
//!   (the compare-and-swap's guard), from exactly the state it has when it proposes (it
//!   applies nothing more of the old epoch). Every in-sync backup holds every op
//!   acknowledged, even one not yet following the current epoch: the ops of that epoch
//!   were acknowledged only with its confirmation. A backup whose state is not a prefix
//!   of the new primary's (a different stream, or longer than `seq_base`) is sent a
//!   snapshot;
//! - **a joiner counts only once caught up**: it is moved into the in-sync set only when
//!   it confirmed every op acknowledged (and the snapshot it was sent, if one), and from
//!   the proposal on it is waited for;
//! - **no acknowledgement after a takeover**: a primary acknowledges only while its own
//!   lease deadline is ahead (a successor needs the lease gone);
//! - a restore from a checkpoint (a new incarnation) is written only when no replica
//!   that may hold an acknowledged op is alive.
//!
//! Layout:
//! - `types`: the group record, messages, effects, configuration and roles.
//! - this file: the [`Replica`], the records it observes and the roles they give it.
//! - `primary`: assigning ops, confirmations, acknowledgements, and the record a primary
//!   wants (laggards and dead members out, joiners in, new members recruited).
//! - `backup`: applying the stream, snapshots, asking for what is missing, promotion.
//! - `tests`: unit tests and the property test of the invariants above.

use std::collections::BTreeSet;

mod backup;
mod primary;
mod types;

#[cfg(test)]
mod tests;

pub use types::{
    Effect, GroupRecord, Guard, MemberId, Millis, Msg, ReplicaConfig, Role, Seq, restore_guard,
};

use primary::PrimaryState;

/// A submitted op refused: this replica is not the primary; the primary it knows of, if
/// any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotPrimary(pub Option<MemberId>);

/// One replica of one shard, in one pserver process.
#[derive(Debug, Clone)]
pub struct Replica {
    me: MemberId,
    cfg: ReplicaConfig,
    /// The newest group record seen.
    record: Option<GroupRecord>,
    /// The last op applied here (the ops up to it, in order, are the shard's state).
    applied: Seq,
    /// The newest epoch whose primary's stream this replica's state is a prefix of
    /// (`None`: none; only a snapshot makes it one again). It applies ops only while
    /// this is the record's epoch.
    synced: Option<u64>,
    /// The incarnation of the state held here.
    incarnation: u64,
    /// The newest epoch seen, in a record or in a message (ops of older epochs are
    /// refused).
    fence: u64,
    /// The first op still in the shell's log; older ones are sent only within a
    /// snapshot.
    log_start: Seq,
    /// The live members (their keys present in etcd), in the order the shell prefers
    /// them as new backups.
    live: Vec<MemberId>,
    /// This process's lease is held until then by its own clock.
    lease_deadline: Millis,
    /// A record this replica wrote (or tried to) and has not yet seen settled: until a
    /// record of its change or later is observed it may have landed.
    proposal: Option<GroupRecord>,
    /// Set while this replica is primary.
    primary: Option<PrimaryState>,
    /// Backup or joiner: when it last asked its primary for what it lacks, while it has
    /// received nothing since.
    asked: Option<Millis>,
}

impl Replica {
    /// A replica of member `me` with no state and no record seen.
    pub fn new(me: MemberId, cfg: ReplicaConfig) -> Replica {
        Replica {
            me,
            cfg,
            record: None,
            applied: 0,
            synced: None,
            incarnation: 0,
            fence: 0,
            log_start: 1,
            live: Vec::new(),
            lease_deadline: 0,
            proposal: None,
            primary: None,
            asked: None,
        }
    }

    /// This replica's member id.
    pub fn me(&self) -> &MemberId {
        &self.me
    }

    /// The newest group record seen.
    pub fn record(&self) -> Option<&GroupRecord> {
        self.record.as_ref()
    }

    /// The last op applied here.
    pub fn applied(&self) -> Seq {
        self.applied
    }

    /// This replica's role, as the newest record it saw gives it.
    pub fn role(&self) -> Role {
        match &self.record {
            _ if self.primary.is_some() => Role::Primary,
            Some(r) if r.backups.contains(&self.me) => Role::Backup,
            Some(r) if r.joining.contains(&self.me) => Role::Joining,
            _ => Role::Outside,
        }
    }

    /// The epoch this replica is primary of.
    pub fn primary_epoch(&self) -> Option<u64> {
        self.primary.as_ref().map(|p| p.epoch)
    }

    /// The last op this primary acknowledged.
    pub fn acked(&self) -> Option<Seq> {
        self.primary.as_ref().map(|p| p.acked)
    }

    /// Whether this replica's state is a prefix of the current primary's stream.
    pub fn synced(&self) -> bool {
        matches!((&self.record, self.synced), (Some(r), Some(e))
            if r.epoch == e && r.incarnation == self.incarnation)
    }

    /// The lease is held until `deadline` by this process's clock.
    pub fn set_lease(&mut self, deadline: Millis) {
        self.lease_deadline = deadline;
    }

    /// The shell dropped the ops before `first_kept` from its log.
    pub fn trimmed(&mut self, first_kept: Seq) {
        self.log_start = self.log_start.max(first_kept);
    }

    /// The live members changed (the shell's view of `ps-member/`), listed in the
    /// order the shell prefers new backups.
    pub fn members(&mut self, now: Millis, live: Vec<MemberId>) -> Vec<Effect> {
        self.live = live;
        self.tick(now)
    }

    /// Time passed: timeouts, promotion, recruiting, acknowledgements held by the lease.
    pub fn tick(&mut self, now: Millis) -> Vec<Effect> {
        let mut out = Vec::new();
        if self.primary.is_some() {
            self.primary_tick(now, &mut out);
        } else {
            self.backup_tick(now, &mut out);
        }
        out
    }

    /// A group record read from etcd (the watch, or the read after a proposal). Older
    /// changes than the newest seen are ignored.
    pub fn observe(&mut self, now: Millis, record: GroupRecord) -> Vec<Effect> {
        let mut out = Vec::new();
        if self
            .record
            .as_ref()
            .is_some_and(|r| r.change >= record.change)
        {
            return out;
        }
        let was_promoting = self.promoting();
        if self
            .proposal
            .as_ref()
            .is_some_and(|p| p.change <= record.change)
        {
            self.proposal = None;
        }
        let role_before = self.role();
        let had_place = role_before != Role::Outside;
        self.fence = self.fence.max(record.epoch);
        self.record = Some(record.clone());
        if record.primary == self.me {
            match &self.primary {
                Some(p) if p.epoch == record.epoch => self.primary_membership(now, &mut out),
                _ => self.become_primary(now, &mut out),
            }
            return out;
        }
        if self.primary.is_some() {
            self.step_down(&mut out);
        } else if had_place && !record.has(&self.me) {
            self.forget();
            out.push(Effect::Discard);
        }
        if !record.has(&self.me) {
            return out;
        }
        // A new place (the watch may have skipped the record that removed it), or its own
        // promotion lost: it says where it stands.
        let resume = was_promoting || self.role() != role_before;
        self.follow(now, resume, &mut out);
        out
    }

    /// This replica's state no longer belongs to the group.
    fn forget(&mut self) {
        self.log_start = 1;
        self.applied = 0;
        self.synced = None;
        self.asked = None;
    }

    /// The proposal `record` was refused by etcd with the group record still at the
    /// change it expected (its guard failed): it did not land. A refusal because the
    /// record moved on is not this: the record may be this very proposal, landed by an
    /// earlier attempt whose answer was lost; the shell observes the record read back
    /// instead, which settles the proposal. (An outcome not known, such as a timeout, is
    /// no refusal either: the shell sends the same compare-and-swap again until etcd
    /// answers it.)
    pub fn refused(&mut self, now: Millis, record: &GroupRecord) -> Vec<Effect> {
        let mut out = Vec::new();
        // Only the proposal refused is settled (a resend of an older one may be refused
        // after a newer one was made).
        if self.proposal.as_ref() != Some(record) {
            return out;
        }
        let was_promoting = self.promoting();
        self.proposal = None;
        if was_promoting && self.synced() {
            // It dropped the ops that came meanwhile.
            self.ask(now, &mut out);
        }
        out
    }

    /// The proposal not yet settled, if any (a shell sending a proposal again checks it
    /// is still the one).
    pub fn proposal(&self) -> Option<&GroupRecord> {
        self.proposal.as_ref()
    }

    /// The last op this primary gave a place (what a retry found applied waits for, and
    /// what a snapshot taken between two ops holds).
    pub fn last_assigned(&self) -> Option<Seq> {
        self.primary.as_ref().map(|p| p.next())
    }

    /// A backup's or joiner's connection to its primary was (re)opened: what was in
    /// flight may be lost, so it says where it stands.
    pub fn reconnected(&mut self, now: Millis) -> Vec<Effect> {
        let mut out = Vec::new();
        if matches!(self.role(), Role::Backup | Role::Joining) && !self.promoting() {
            self.ask(now, &mut out);
        }
        out
    }

    /// A message from another replica of the shard.
    pub fn on_message(&mut self, now: Millis, from: &str, msg: Msg) -> Vec<Effect> {
        let mut out = Vec::new();
        match msg {
            Msg::Op { epoch, .. } | Msg::Snapshot { epoch, .. } if epoch < self.fence => {
                out.push(Effect::Send {
                    to: from.to_string(),
                    msg: Msg::Fenced { epoch: self.fence },
                });
            }
            Msg::Op { epoch, seq } => self.on_op(now, from, epoch, seq, &mut out),
            Msg::Snapshot { epoch, seq } => self.on_snapshot(now, from, epoch, seq, &mut out),
            Msg::Confirm { epoch, seq } => self.on_confirm(now, from, epoch, seq, &mut out),
            Msg::Need {
                epoch,
                have,
                change,
            } => self.on_need(now, from, epoch, have, change, &mut out),
            Msg::Fenced { epoch } => self.learn_epoch(epoch, &mut out),
        }
        out
    }

    /// A newer epoch exists than this replica's record says: a primary of an older one
    /// steps down at once (its record will follow through the watch).
    fn learn_epoch(&mut self, epoch: u64, out: &mut Vec<Effect>) {
        self.fence = self.fence.max(epoch);
        if self.primary.as_ref().is_some_and(|p| p.epoch < epoch) {
            self.step_down(out);
        }
    }

    /// Proposes a restore: the shard's state in the shell is a checkpoint's (or the
    /// initial values), op 0 of a new `incarnation` (higher than any before: the
    /// restorer's claim revision). Refused (no effect) while a proposal
    /// is unsettled or when this replica has a place in the group. The compare-and-swap's
    /// guard requires every replica that may hold an acknowledged op to be gone.
    pub fn restore(&mut self, _now: Millis, incarnation: u64) -> Vec<Effect> {
        if self.proposal.is_some() || self.role() != Role::Outside {
            return Vec::new();
        }
        let record = GroupRecord::restored(
            self.record.as_ref(),
            self.me.clone(),
            incarnation,
            self.cfg.replicas as u32,
        );
        let guard = match &self.record {
            Some(r) => restore_guard(r, &self.me),
            None => Guard {
                alive: self.me.clone(),
                absent: BTreeSet::new(),
            },
        };
        self.forget();
        self.proposal = Some(record.clone());
        vec![Effect::Propose {
            expect_change: self.record.as_ref().map_or(0, |r| r.change),
            record,
            guard,
        }]
    }

    /// Records a proposal and returns its effect.
    fn propose(&mut self, record: GroupRecord, guard: Guard, out: &mut Vec<Effect>) {
        let expect_change = self.record.as_ref().map_or(0, |r| r.change);
        debug_assert_eq!(record.change, expect_change + 1);
        self.proposal = Some(record.clone());
        out.push(Effect::Propose {
            expect_change,
            record,
            guard,
        });
    }

    fn is_live(&self, m: &str) -> bool {
        self.live.iter().any(|l| l == m)
    }
}
