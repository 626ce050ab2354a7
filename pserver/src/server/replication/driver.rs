//! A process's replica of one shard, driven (docs/replication.md): the state machine
//! ([`crate::replica`]) fed by etcd (the group record and the live members, through
//! [`GroupStore`]), by the other replicas' connections (`super::stream`), by time, and
//! by the ops the shard hands its stream; its effects carried out on the shard, on the
//! connections and in etcd.
//!
//! - A primary's shard has an [`OpStream`] that gives each op its
//!   place (`Replication::order`) and logs its bytes; the service answers a client once
//!   [`Replication::wait_acked`] says every in-sync replica holds the op.
//! - A backup or joiner keeps one connection to its primary (it opens it, the primary
//!   serves it: [`Replication::serve_peer`]): the primary's ops and snapshots come down,
//!   its confirmations and requests go up. Ops are replayed on the connection's reader,
//!   in order, before they are confirmed.
//! - Compare-and-swaps of the group record, and snapshots for joiners (a copy of the
//!   whole shard), run on the driver task, off the machine's lock.
//!
//! Invariant: the machine's effects are carried out in the order it returned them, while
//! its lock is held, except compare-and-swaps and snapshots, which it allows to come
//! later (it waits for their outcome).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use edl_coord::Lease;
use edl_job::{GroupRecord, MemberRecord};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use jobs::Job;

use super::record::GroupStore;
use crate::error::PsError;
use crate::replica::{Effect, Millis, Msg, NotPrimary, Replica, ReplicaConfig, Role, Seq};
use crate::shard::{OpStream, Shard, ShardCore, ShardOp, lock};

/// Most bytes of ops kept for backups that fall behind (older ones go by snapshot). Ops
/// every peer confirmed are dropped sooner ([`Replica::log_needed_from`]): in steady state
/// the log holds only the ops in flight.
const LOG_BYTES: usize = 256 << 20;
/// How often the machine's timers run.
const TICK: Duration = Duration::from_millis(100);

/// What the service waits on: the primary's acknowledgements.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Acked {
    /// The epoch this replica was primary of when these were said.
    epoch: Option<u64>,
    /// Every op up to this one is held by every in-sync replica.
    upto: Seq,
    /// The ops from this one on will not be acknowledged here (stepped down).
    failed_from: Option<Seq>,
}

/// The ops' bytes kept for backups, by seq.
#[derive(Debug, Default)]
struct OpLog {
    ops: BTreeMap<Seq, Bytes>,
    bytes: usize,
}

/// The primary's ops applied here, for the contiguous watermark the machine needs.
#[derive(Debug, Default)]
struct Applied {
    /// The epoch these ops belong to.
    epoch: Option<u64>,
    upto: Seq,
    done: BTreeSet<Seq>,
}

/// One shard's replica in this process.
#[derive(Debug)]
pub struct Replication {
    /// This replica itself, for the op stream its shard holds (which must not keep it
    /// alive).
    this: Weak<Replication>,
    me: String,
    index: u32,
    shard: Arc<Shard>,
    store: Arc<GroupStore>,
    lease: Arc<Lease>,
    machine: Mutex<Replica>,
    log: Mutex<OpLog>,
    applied: Mutex<Applied>,
    /// Connections to the other replicas, by member: what to send them.
    outbox: Mutex<HashMap<String, mpsc::UnboundedSender<(Msg, Bytes)>>>,
    jobs: mpsc::UnboundedSender<Job>,
    acked: watch::Sender<Acked>,
    /// The epoch whose primary's shard has this replica's stream: set in the same step
    /// (`run`) that makes this replica primary, before its role is published, so that
    /// no op of a primary's shard is applied without its place in the stream.
    streamed: Mutex<Option<u64>>,
    /// The seq of each recent sync step's op (the pushes of a step wait for it).
    step_seqs: Mutex<BTreeMap<u64, Seq>>,
    /// The members and their records, as last seen.
    members: Mutex<BTreeMap<String, MemberRecord>>,
    start: Instant,
    stall: Duration,
    max_frame: usize,
    /// Replicas wanted, the primary included: with one, nobody is ever streamed to and
    /// no op's bytes are kept.
    replicas: usize,
    /// The epoch as primary whose duties (the claim held, the checkpointer and the
    /// failed tasks' follower running) the process started: the shard serves only then.
    duties: Mutex<Option<u64>>,
    /// This replica's role, as the machine last said it.
    roles: watch::Sender<Role>,
    upstream: Upstream,
    stop: CancellationToken,
    /// Fires when this replica's copy broke.
    failed: CancellationToken,
}

thread_local! {
    /// The seq the stream gave the last op this thread handed it.
    static LAST_SEQ: std::cell::Cell<Option<Seq>> = const { std::cell::Cell::new(None) };
}

impl Replication {
    /// Starts the replica of member `me` for shard `shard` and its driver task, until
    /// `stop` fires.
    pub fn start(
        me: String,
        shard: Arc<Shard>,
        store: Arc<GroupStore>,
        lease: Arc<Lease>,
        links: Links,
        stop: CancellationToken,
    ) -> Arc<Replication> {
        let Links {
            replica: cfg,
            upstream,
            stall,
        } = links;
        let (jobs, jobs_rx) = mpsc::unbounded_channel();
        let r = Arc::new_cyclic(|this| Replication {
            this: this.clone(),
            index: shard.index(),
            replicas: cfg.replicas,
            duties: Mutex::default(),
            roles: watch::channel(Role::Outside).0,
            machine: Mutex::new(Replica::new(me.clone(), cfg)),
            me,
            shard,
            store,
            lease,
            log: Mutex::default(),
            applied: Mutex::default(),
            outbox: Mutex::default(),
            jobs,
            acked: watch::channel(Acked::default()).0,
            members: Mutex::default(),
            step_seqs: Mutex::default(),
            streamed: Mutex::default(),
            start: Instant::now(),
            stall,
            max_frame: usize::MAX >> 1,
            upstream,
            stop,
            failed: CancellationToken::new(),
        });
        tokio::spawn(r.clone().drive(jobs_rx).in_current_span());
        r
    }

    fn now(&self) -> Millis {
        self.start.elapsed().as_millis() as Millis
    }

    /// This replica's member id.
    pub fn me(&self) -> &str {
        &self.me
    }

    /// Replicas wanted for the shard, the primary included.
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// The live members (their keys present in etcd), as last seen; `None` until they
    /// were listed once.
    pub fn live_members(&self) -> Option<BTreeSet<String>> {
        let known = lock(&self.members);
        (!known.is_empty()).then(|| known.keys().cloned().collect())
    }

    /// This replica's role.
    pub fn role(&self) -> Role {
        lock(&self.machine).role()
    }

    /// Follows this replica's role (the process's duties wake on each change).
    pub fn roles(&self) -> watch::Receiver<Role> {
        self.roles.subscribe()
    }

    /// The process started its duties as primary of the epoch this replica is primary
    /// of now (it holds the claim; its checkpointer runs).
    pub fn duties_started(&self) {
        *lock(&self.duties) = lock(&self.machine).primary_epoch();
    }

    /// Whether this replica serves the shard: primary, with its duties started for its
    /// epoch (no change is taken before the checkpointer runs: a step's snapshot taken
    /// before it would be superseded unwritten).
    pub fn serving(&self) -> bool {
        let epoch = lock(&self.machine).primary_epoch();
        epoch.is_some() && *lock(&self.duties) == epoch
    }

    /// Whether a record this replica proposed is not settled yet.
    pub fn proposing(&self) -> bool {
        lock(&self.machine).proposal().is_some()
    }

    /// The group record as this replica last saw it.
    pub fn record(&self) -> Option<GroupRecord> {
        lock(&self.machine).record().cloned()
    }

    /// Proposes this replica as the restorer of the shard as `incarnation` (its claim's
    /// revision; its state is a checkpoint's or the initial values).
    pub fn restore(&self, incarnation: u64) {
        let mut m = lock(&self.machine);
        let fx = m.restore(self.now(), incarnation);
        self.run(&mut m, fx, None);
    }

    /// The op stream of this replica's shard when it is primary: each op gets its place
    /// and its bytes are logged.
    fn op_stream(&self) -> OpStream {
        let me = self.this.clone();
        OpStream(Arc::new(move |op| match me.upgrade() {
            Some(me) => me.order(op),
            None => Err(PsError::NotServing(
                "the shard's replication stopped".into(),
            )),
        }))
    }

    /// Gives `op` its place in the stream (refused unless primary with its lease held).
    fn order(&self, op: &ShardOp) -> Result<(), PsError> {
        // A group of one never streams: its ops need no copy.
        let bytes = if self.replicas > 1 {
            self.shard.core()?.encode_op(op)
        } else {
            Bytes::new()
        };
        let mut m = lock(&self.machine);
        let (seq, fx) = m.submit(self.now()).map_err(|NotPrimary(p)| {
            PsError::NotServing(format!(
                "shard {} is not primary here (primary: {})",
                self.index,
                p.as_deref().unwrap_or("none yet")
            ))
        })?;
        if self.replicas > 1 {
            let mut log = lock(&self.log);
            log.bytes += bytes.len();
            log.ops.insert(seq, bytes);
            let needed = m.log_needed_from().min(seq);
            while log.ops.len() > 1
                && (log.bytes > LOG_BYTES
                    || log.ops.first_key_value().is_some_and(|(&s, _)| s < needed))
            {
                if let Some((_, b)) = log.ops.pop_first() {
                    log.bytes -= b.len();
                }
            }
            if let Some((&first, _)) = log.ops.first_key_value() {
                m.trimmed(first);
            }
        }
        LAST_SEQ.with(|s| s.set(Some(seq)));
        self.run(&mut m, fx, None);
        drop(m);
        // An op other than an async push is applied by the caller right after this, with
        // the locks that order it still held (nothing reads the shard in between): it
        // counts as applied here now. A push is applied after the order lock is released,
        // and its caller says when (`local_applied`).
        if !matches!(op, ShardOp::Push { .. }) {
            self.local_applied(seq);
        }
        if let ShardOp::Step { job, .. } = op {
            let mut steps = lock(&self.step_seqs);
            steps.insert(job.step, seq);
            while steps.len() > 64 {
                steps.pop_first();
            }
        }
        Ok(())
    }

    /// The seq of sync step `step`'s op, if this primary made it.
    pub fn step_seq(&self, step: u64) -> Option<Seq> {
        lock(&self.step_seqs).get(&step).copied()
    }

    /// The seq the stream gave the last op this thread handed it (taken).
    pub fn take_last_seq() -> Option<Seq> {
        LAST_SEQ.with(|s| s.take())
    }

    /// The op `seq` is applied to this (primary's) shard.
    pub fn local_applied(&self, seq: Seq) {
        let mut m = lock(&self.machine);
        let upto = {
            let mut a = lock(&self.applied);
            let epoch = m.primary_epoch();
            if a.epoch != epoch {
                // A new epoch as primary: its ops follow the state it started from.
                *a = Applied {
                    epoch,
                    upto: m.applied(),
                    done: BTreeSet::new(),
                };
            }
            a.done.insert(seq);
            loop {
                let next = a.upto + 1;
                if !a.done.remove(&next) {
                    break;
                }
                a.upto = next;
            }
            a.upto
        };
        let fx = m.local_applied(self.now(), upto);
        self.run(&mut m, fx, None);
    }

    /// The last op given a place by this primary (what a retry found already applied
    /// waits for: the op that applied it may not be confirmed yet).
    pub fn last_assigned(&self) -> Seq {
        let m = lock(&self.machine);
        m.last_assigned().unwrap_or(m.applied())
    }

    /// Waits until every in-sync replica holds op `seq`; an error when this replica
    /// stepped down first, or after `timeout`.
    pub async fn wait_acked(&self, seq: Seq, timeout: Duration) -> Result<(), PsError> {
        let mut rx = self.acked.subscribe();
        let Some(epoch) = lock(&self.machine).primary_epoch() else {
            return Err(PsError::NotServing(format!(
                "shard {} is not primary here",
                self.index
            )));
        };
        if seq == 0 {
            // Op 0 is the restored state itself (a retry found applied before any op of
            // a restored primary): no op, nothing to wait for.
            return Ok(());
        }
        let wait = async {
            loop {
                let a = *rx.borrow_and_update();
                let said_here = a.epoch.is_none_or(|e| e == epoch);
                if a.epoch.is_some_and(|e| e > epoch)
                    || (said_here && a.failed_from.is_some_and(|f| f <= seq))
                {
                    return Err(PsError::NotServing(format!(
                        "shard {} is no longer primary here",
                        self.index
                    )));
                }
                if a.epoch == Some(epoch) && a.upto >= seq {
                    return Ok(());
                }
                if rx.changed().await.is_err() {
                    return Err(PsError::NotServing("shutting down".into()));
                }
            }
        };
        tokio::time::timeout(timeout, wait).await.map_err(|_| {
            PsError::NotServing(format!(
                "shard {}'s backups did not confirm within {timeout:?}",
                self.index
            ))
        })?
    }

    /// Carries out `fx` in order (the machine locked), with the payload of the message
    /// that made them.
    fn run(&self, m: &mut Replica, fx: Vec<Effect>, payload: Option<&Bytes>) {
        let mut queue: std::collections::VecDeque<Effect> = fx.into();
        while let Some(e) = queue.pop_front() {
            match e {
                Effect::Send { to, msg } => {
                    let body = match msg {
                        Msg::Op { seq, .. } => match lock(&self.log).ops.get(&seq) {
                            Some(b) => b.clone(),
                            // Trimmed since: the peer asks again and gets a snapshot.
                            None => continue,
                        },
                        _ => Bytes::new(),
                    };
                    if let Some(tx) = lock(&self.outbox).get(&to) {
                        let _ = tx.send((msg, body));
                    }
                }
                Effect::SendSnapshot { to, epoch } => {
                    let _ = self.jobs.send(Job::Snapshot { to, epoch });
                }
                Effect::Apply { seq } => {
                    let applied = payload
                        .ok_or_else(|| PsError::Internal("an op without its bytes".into()))
                        .and_then(|b| {
                            let core = self.shard.core()?;
                            core.replay(&core.decode_op(b.clone())?)
                        });
                    if let Err(e) = applied {
                        self.broken(&format!("replicated op {seq} failed: {e}"));
                        return;
                    }
                }
                Effect::Install { seq } => {
                    let incarnation = m.record().map_or(0, |r| r.incarnation);
                    let built = payload
                        .ok_or_else(|| PsError::Internal("a snapshot without its bytes".into()))
                        .and_then(|b| {
                            ShardCore::from_replica_snapshot(
                                b.clone(),
                                incarnation,
                                self.shard.checkpoints().clone(),
                            )
                        });
                    match built {
                        Ok(core) => {
                            self.shard.install(core);
                            tracing::info!(shard = self.index, seq, "snapshot installed");
                        }
                        Err(e) => {
                            self.broken(&format!("a snapshot failed to install: {e}"));
                            return;
                        }
                    }
                }
                Effect::Propose {
                    expect_change,
                    record,
                    guard,
                } => {
                    let _ = self.jobs.send(Job::Propose {
                        expect_change,
                        record,
                        guard,
                    });
                }
                Effect::Ack { upto } => {
                    let epoch = m.primary_epoch();
                    self.acked.send_modify(|a| {
                        if a.epoch != epoch {
                            // A new epoch as primary: its own acknowledgements.
                            *a = Acked {
                                epoch,
                                ..Acked::default()
                            };
                        }
                        a.upto = a.upto.max(upto);
                    });
                }
                Effect::Fail { from } => {
                    self.acked.send_modify(|a| a.failed_from = Some(from));
                }
                Effect::Discard => {
                    self.shard.uninstall();
                    *lock(&self.log) = OpLog::default();
                }
            }
        }
        self.stream_when_primary(m);
        let role = m.role();
        self.roles
            .send_if_modified(|r| std::mem::replace(r, role) != role);
    }

    /// This replica's copy can no longer follow the stream: it must not confirm anything
    /// more, nor be promoted with what it holds. The process leaves (its lease ends; a
    /// supervisor starts a fresh member), which takes it out of the group.
    fn broken(&self, why: &str) {
        tracing::error!(
            shard = self.index,
            reason = why,
            "this replica's copy is broken; the process leaves its group"
        );
        self.shard.uninstall();
        self.failed.cancel();
        self.stop.cancel();
    }

    /// Fires when this replica's copy broke (the process should exit).
    pub fn failed(&self) -> &CancellationToken {
        &self.failed
    }

    /// The driver: timers, the group record, the members, compare-and-swaps and
    /// snapshots, and this replica's connection to its primary.
    async fn drive(self: Arc<Self>, mut jobs: mpsc::UnboundedReceiver<Job>) {
        let mut records = self.store.follow(self.stop.child_token());
        let mut members = self.store.members(self.stop.child_token());
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The connection to the primary this replica follows: (primary, its stop).
        let mut upstream: Option<(String, CancellationToken)> = None;
        loop {
            tokio::select! {
                _ = self.stop.cancelled() => break,
                _ = tick.tick() => {
                    let deadline = self
                        .lease
                        .valid_until()
                        .saturating_duration_since(self.start)
                        .as_millis() as Millis;
                    let mut m = lock(&self.machine);
                    m.set_lease(if self.lease.is_held() { deadline } else { 0 });
                    let fx = m.tick(self.now());
                    self.run(&mut m, fx, None);
                }
                changed = records.changed() => {
                    if changed.is_err() { break; }
                    let r = records.borrow_and_update().clone();
                    if let Some(r) = r {
                        let mut m = lock(&self.machine);
                        let fx = m.observe(self.now(), r);
                        self.run(&mut m, fx, None);
                    }
                }
                changed = members.changed() => {
                    if changed.is_err() { break; }
                    let all = members.borrow_and_update().clone();
                    // Only this shard's members can be its replicas: a process holds one
                    // replica of one shard (its id names the shard).
                    let live: Vec<String> = all
                        .keys()
                        .filter(|id| shard_of_member(id) == Some(self.index))
                        .cloned()
                        .collect();
                    *lock(&self.members) = all;
                    let mut m = lock(&self.machine);
                    let fx = m.members(self.now(), live);
                    self.run(&mut m, fx, None);
                }
                Some(job) = jobs.recv() => {
                    // Off the loop: a slow etcd or a large snapshot must not hold the
                    // timers (and the lease deadline the machine acknowledges by).
                    tokio::spawn(self.clone().job(job).in_current_span());
                }
            }
            self.follow_primary(&mut upstream);
        }
        if let Some((_, stop)) = upstream {
            stop.cancel();
        }
    }

    /// A primary's shard hands its ops to the stream.
    fn stream_when_primary(&self, m: &Replica) {
        let primary = m.primary_epoch();
        let mut streamed = lock(&self.streamed);
        if primary.is_some() && *streamed != primary {
            self.shard.set_stream(self.op_stream());
            *streamed = primary;
        } else if primary.is_none() {
            *streamed = None;
        }
    }

    /// Opens (or closes) the connection to the primary this replica follows.
    fn follow_primary(self: &Arc<Self>, upstream: &mut Option<(String, CancellationToken)>) {
        let want = {
            let m = lock(&self.machine);
            match (m.role(), m.record()) {
                (Role::Backup | Role::Joining, Some(r)) => Some(r.primary.clone()),
                _ => None,
            }
        };
        if upstream.as_ref().map(|(p, _)| p) == want.as_ref() {
            return;
        }
        if let Some((_, stop)) = upstream.take() {
            stop.cancel();
        }
        let Some(primary) = want else {
            return;
        };
        let stop = self.stop.child_token();
        tokio::spawn(
            self.clone()
                .upstream(primary.clone(), stop.clone())
                .in_current_span(),
        );
        *upstream = Some((primary, stop));
    }
}

/// A member id for a process holding a replica of shard `index`: `<index>-<pid>-<random>`
/// (a new one at every start).
pub fn member_id(index: u32) -> String {
    format!(
        "{index}-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    )
}

/// The shard a member id names ([`member_id`]).
pub fn shard_of_member(id: &str) -> Option<u32> {
    id.split('-').next()?.parse().ok()
}

/// A replica's settings and how it reaches the other replicas.
#[derive(Debug, Clone)]
pub struct Links {
    /// The group's settings.
    pub replica: ReplicaConfig,
    /// How a backup reaches its primary.
    pub upstream: Upstream,
    /// Longest stall within a frame of the replication stream.
    pub stall: Duration,
}

/// How a backup reaches its primary: the job and token of the bulk path's hello, and TLS
/// when the job's pservers use it.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// The job.
    pub job: String,
    /// The job's token.
    pub token: Option<String>,
    /// TLS (the client side), when pservers serve TLS.
    pub tls: Option<edl_proto::tls::Tls>,
}

mod jobs;
mod peers;

pub use peers::{replicate_frame, replicate_header};

#[cfg(test)]
mod tests;
