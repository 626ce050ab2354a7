//! The primary's side: ops assigned and streamed to the peers (in-sync backups and
//! joiners), their confirmations, acknowledgements (every in-sync replica holds the op,
//! and the lease is held), and the record the primary wants: dead or lagging backups
//! out, caught-up joiners in, live members recruited up to the replica count.

use std::collections::{BTreeMap, BTreeSet};

use super::{Effect, Guard, Millis, Msg, NotPrimary, Replica, Seq};

/// A joiner counts as caught up within this many ops of the primary's applied op (it
/// must also hold every op acknowledged).
const CATCH_UP_SLACK: Seq = 8;

/// What a primary keeps.
#[derive(Debug, Clone)]
pub(super) struct PrimaryState {
    /// The epoch this replica is primary of.
    pub(super) epoch: u64,
    /// The last op assigned.
    next: Seq,
    /// The last op acknowledged.
    pub(super) acked: Seq,
    /// The op this epoch began with.
    base: Seq,
    /// The in-sync backups and joiners streamed to.
    peers: BTreeMap<String, Peer>,
    /// When each op not yet confirmed by every peer was assigned.
    assigned_at: BTreeMap<Seq, Millis>,
}

/// A backup or joiner, as its primary sees it.
#[derive(Debug, Clone)]
struct Peer {
    /// The last op sent (or the op a snapshot sent holds).
    sent: Seq,
    /// The last op confirmed.
    confirmed: Seq,
    /// Whether ops are streamed to it (its position is known: after it asked, or after
    /// a snapshot).
    streaming: bool,
    /// When it became a peer of this primary.
    added: Millis,
    /// The change of the record that gave it its place: its requests of older changes
    /// are stale.
    since: u64,
    /// When it was last heard from.
    heard: Millis,
    /// When a snapshot was last sent to it, until it confirms one: one at a time, timed
    /// out by the join timeout rather than the replication timeout.
    snapshot_at: Option<Millis>,
}

impl Peer {
    fn new(now: Millis, since: u64) -> Peer {
        Peer {
            sent: 0,
            confirmed: 0,
            streaming: false,
            added: now,
            since,
            heard: now,
            snapshot_at: None,
        }
    }
}

impl PrimaryState {
    /// The last op assigned.
    pub(super) fn next(&self) -> Seq {
        self.next
    }
}

impl Replica {
    /// Orders a new op. On success the shell logs the op's payload under the returned
    /// seq, applies it, calls [`Replica::local_applied`], and answers the client once an
    /// [`Effect::Ack`] covers it. An op is ordered while the lease is uncertain too (one
    /// already taken in, such as a sync step closing on its last push, must not be lost
    /// to an etcd outage): only its acknowledgement waits for the lease, so nothing is
    /// acknowledged after a takeover.
    pub fn submit(&mut self, now: Millis) -> Result<(Seq, Vec<Effect>), NotPrimary> {
        let Some(p) = self.primary.as_mut() else {
            return Err(NotPrimary(self.record.as_ref().map(|r| r.primary.clone())));
        };
        p.next += 1;
        let seq = p.next;
        p.assigned_at.insert(seq, now);
        let mut out = Vec::new();
        for (m, peer) in p.peers.iter_mut().filter(|(_, peer)| peer.streaming) {
            peer.sent = seq;
            out.push(Effect::Send {
                to: m.clone(),
                msg: Msg::Op {
                    epoch: p.epoch,
                    seq,
                },
            });
        }
        Ok((seq, out))
    }

    /// The shell applied every op up to `seq` here (the primary's own copy).
    pub fn local_applied(&mut self, now: Millis, seq: Seq) -> Vec<Effect> {
        let mut out = Vec::new();
        self.applied = self.applied.max(seq);
        self.maybe_ack(now, &mut out);
        out
    }

    /// The shell sent `to` the snapshot an [`Effect::SendSnapshot`] asked for, holding
    /// every op up to `seq`: the ops after it follow.
    pub fn snapshot_sent(&mut self, _now: Millis, to: &str, seq: Seq) -> Vec<Effect> {
        let mut out = Vec::new();
        if let Some(p) = self.primary.as_mut()
            && let Some(peer) = p.peers.get_mut(to)
        {
            peer.streaming = true;
            peer.sent = seq;
            Self::stream_from(p.epoch, p.next, to, peer, &mut out);
        }
        out
    }

    /// The first op a peer may still be sent from the shell's log: the oldest op a
    /// streaming peer (or one a snapshot is on its way to) has not confirmed. The shell
    /// may drop the ops before it; a peer that asks for a dropped op later is sent a
    /// snapshot (as after any trim), so this bounds memory, never correctness. Not
    /// primary: nothing is needed (`Seq::MAX`).
    pub fn log_needed_from(&self) -> Seq {
        let Some(p) = &self.primary else {
            return Seq::MAX;
        };
        p.peers
            .values()
            .filter(|q| q.streaming || q.snapshot_at.is_some())
            .map(|q| q.confirmed + 1)
            .min()
            .unwrap_or(p.next + 1)
    }

    /// The shell could not send `to` the snapshot asked for (the shard is not
    /// initialised yet): it may ask again.
    pub fn snapshot_failed(&mut self, to: &str) {
        if let Some(peer) = self.primary.as_mut().and_then(|p| p.peers.get_mut(to)) {
            peer.snapshot_at = None;
        }
    }

    /// Sends `peer` every op after its `sent` one.
    fn stream_from(epoch: u64, next: Seq, to: &str, peer: &mut Peer, out: &mut Vec<Effect>) {
        for seq in peer.sent + 1..=next {
            out.push(Effect::Send {
                to: to.to_string(),
                msg: Msg::Op { epoch, seq },
            });
        }
        peer.sent = peer.sent.max(next);
    }

    /// This replica's promotion or restore landed: it is primary from its state, which
    /// is the record's `seq_base`.
    pub(super) fn become_primary(&mut self, now: Millis, out: &mut Vec<Effect>) {
        let Some(r) = self.record.clone() else {
            return;
        };
        debug_assert_eq!(self.applied, r.seq_base, "a primary starts from seq_base");
        self.applied = r.seq_base;
        // Its log holds none of the ops up to its base (a backup replays, it does not
        // log): those go by snapshot.
        self.log_start = r.seq_base + 1;
        self.synced = Some(r.epoch);
        self.incarnation = r.incarnation;
        self.asked = None;
        let peers = r
            .backups
            .iter()
            .chain(&r.joining)
            .map(|m| (m.clone(), Peer::new(now, r.change)))
            .collect();
        self.primary = Some(PrimaryState {
            epoch: r.epoch,
            next: r.seq_base,
            acked: 0,
            base: r.seq_base,
            peers,
            assigned_at: BTreeMap::new(),
        });
        tracing::debug!(member = %self.me, epoch = r.epoch, seq_base = r.seq_base, "primary");
        self.primary_tick(now, out);
    }

    /// This primary's own record changed (a proposal of its landed): the peers follow it.
    pub(super) fn primary_membership(&mut self, now: Millis, out: &mut Vec<Effect>) {
        let (Some(r), Some(p)) = (self.record.as_ref(), self.primary.as_mut()) else {
            return;
        };
        p.peers
            .retain(|m, _| r.backups.contains(m) || r.joining.contains(m));
        for m in r.backups.iter().chain(&r.joining) {
            p.peers
                .entry(m.clone())
                .or_insert_with(|| Peer::new(now, r.change));
        }
        self.primary_tick(now, out);
    }

    /// Steps down: the ops not acknowledged are answered "not primary", and the state
    /// here is no longer known to be a prefix of the new primary's.
    pub(super) fn step_down(&mut self, out: &mut Vec<Effect>) {
        if let Some(p) = self.primary.take() {
            tracing::debug!(member = %self.me, epoch = p.epoch, "no longer primary");
            out.push(Effect::Fail { from: p.acked + 1 });
            self.forget();
            out.push(Effect::Discard);
        }
    }

    pub(super) fn on_confirm(
        &mut self,
        now: Millis,
        from: &str,
        epoch: u64,
        seq: Seq,
        out: &mut Vec<Effect>,
    ) {
        self.learn_epoch(epoch, out);
        let Some(p) = self.primary.as_mut() else {
            return;
        };
        if epoch != p.epoch {
            return;
        }
        // Confirmations count only after the peer said where it stands under its current
        // place (a confirmation from before it was removed and added again is stale).
        let Some(peer) = p.peers.get_mut(from).filter(|q| q.streaming) else {
            return;
        };
        peer.confirmed = peer.confirmed.max(seq);
        peer.heard = now;
        peer.snapshot_at = None;
        let floor = p
            .peers
            .values()
            .map(|q| q.confirmed)
            .min()
            .unwrap_or(p.next);
        p.assigned_at = p.assigned_at.split_off(&(floor + 1));
        self.maybe_ack(now, out);
        let joiner = self
            .record
            .as_ref()
            .is_some_and(|r| r.joining.contains(from));
        if joiner {
            self.reconsider(now, out);
        }
    }

    pub(super) fn on_need(
        &mut self,
        now: Millis,
        from: &str,
        epoch: u64,
        have: Option<Seq>,
        change: u64,
        out: &mut Vec<Effect>,
    ) {
        self.learn_epoch(epoch, out);
        let log_start = self.log_start;
        let Some(p) = self.primary.as_mut() else {
            return;
        };
        if epoch != p.epoch {
            return;
        }
        let Some(peer) = p.peers.get_mut(from).filter(|q| change >= q.since) else {
            return;
        };
        peer.heard = now;
        match have {
            Some(h) if h <= p.next && h + 1 >= log_start => {
                peer.confirmed = peer.confirmed.max(h);
                peer.sent = h;
                peer.streaming = true;
                Self::stream_from(p.epoch, p.next, from, peer, out);
                self.maybe_ack(now, out);
            }
            _ => {
                // One snapshot at a time: a request while one is on its way is the
                // joiner asking again.
                if peer
                    .snapshot_at
                    .is_some_and(|t| now < t + self.cfg.join_timeout)
                {
                    return;
                }
                peer.streaming = false;
                peer.snapshot_at = Some(now);
                out.push(Effect::SendSnapshot {
                    to: from.to_string(),
                    epoch: p.epoch,
                });
            }
        }
    }

    /// The last op every in-sync replica holds: applied here and confirmed by every
    /// backup of the record and of the proposal not yet settled.
    fn committed(&self) -> Seq {
        let Some(p) = &self.primary else {
            return 0;
        };
        let mut required: BTreeSet<&String> = BTreeSet::new();
        if let Some(r) = &self.record {
            required.extend(&r.backups);
        }
        if let Some(q) = &self.proposal {
            required.extend(&q.backups);
        }
        required
            .into_iter()
            .map(|m| p.peers.get(m).map_or(0, |peer| peer.confirmed))
            .fold(self.applied, Seq::min)
    }

    /// Acknowledges what every in-sync replica holds, while the lease is held.
    fn maybe_ack(&mut self, now: Millis, out: &mut Vec<Effect>) {
        if now >= self.lease_deadline {
            return;
        }
        let committed = self.committed();
        if let Some(p) = self.primary.as_mut()
            && committed > p.acked
        {
            p.acked = committed;
            out.push(Effect::Ack { upto: committed });
        }
    }

    /// Timeouts, the record wanted, and acknowledgements the lease held back.
    pub(super) fn primary_tick(&mut self, now: Millis, out: &mut Vec<Effect>) {
        self.maybe_ack(now, out);
        self.reconsider(now, out);
    }

    /// Whether `m`'s oldest unconfirmed op is older than the timeout.
    fn lagging(&self, p: &PrimaryState, m: &str, now: Millis) -> bool {
        let Some(peer) = p.peers.get(m) else {
            return true;
        };
        if peer.confirmed >= p.next {
            return false;
        }
        if let Some(t) = peer.snapshot_at {
            // A snapshot on its way: the join timeout.
            return now >= t + self.cfg.join_timeout;
        }
        let since = p
            .assigned_at
            .get(&(peer.confirmed + 1))
            .copied()
            .unwrap_or(peer.added)
            .max(peer.added);
        now >= since + self.cfg.timeout
    }

    /// Proposes the record this primary wants, when it differs from the current one and
    /// no proposal is unsettled.
    fn reconsider(&mut self, now: Millis, out: &mut Vec<Effect>) {
        if self.proposal.is_some() || now >= self.lease_deadline {
            return;
        }
        let (Some(r), Some(p)) = (&self.record, &self.primary) else {
            return;
        };
        let committed = self.committed();
        let mut want = r.clone();
        let mut dropped = BTreeSet::new();
        for b in &r.backups {
            if !self.is_live(b) || self.lagging(p, b, now) {
                want.backups.remove(b);
                dropped.insert(b.clone());
            }
        }
        for j in &r.joining {
            let peer = p.peers.get(j);
            let stalled = peer.is_none_or(|q| now >= q.heard + self.cfg.join_timeout);
            if !self.is_live(j) || stalled {
                want.joining.remove(j);
                dropped.insert(j.clone());
            } else if let Some(q) = peer
                && q.streaming
                // A snapshot sent and not confirmed: its `confirmed` predates the state
                // the joiner is being given (with nothing acknowledged yet it would look
                // caught up while holding nothing).
                && q.snapshot_at.is_none()
                && q.confirmed >= p.acked.max(committed).max(p.base)
                && q.confirmed + CATCH_UP_SLACK >= self.applied
            {
                want.joining.remove(j);
                want.backups.insert(j.clone());
            }
        }
        for m in &self.live {
            if 1 + want.backups.len() + want.joining.len() >= self.cfg.replicas {
                break;
            }
            if *m != self.me && !want.has(m) && !dropped.contains(m) {
                want.joining.insert(m.clone());
            }
        }
        if want == *r {
            return;
        }
        want.change = r.change + 1;
        tracing::debug!(member = %self.me, epoch = want.epoch, backups = ?want.backups, joining = ?want.joining, "group change proposed");
        let guard = Guard {
            alive: self.me.clone(),
            absent: BTreeSet::new(),
        };
        self.propose(want, guard, out);
    }
}
