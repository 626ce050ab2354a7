//! A process's replica of one shard, driven (docs/replication.md): the state machine
//! ([`crate::replica`]) fed by etcd (the group record and the live members, through
//! [`GroupStore`]), by the other replicas' connections ([`super::stream`]), by time, and
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
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use edl_coord::Lease;
use edl_job::{GroupRecord, MemberRecord};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use super::group::{GroupStore, Proposed};
use super::stream;
use crate::error::PsError;
use crate::replica::{Effect, Guard, Millis, Msg, NotPrimary, Replica, ReplicaConfig, Role, Seq};
use crate::shard::{OpStream, Shard, ShardCore, ShardOp, lock};

/// Bytes of ops kept for backups that fall behind (older ones go by snapshot).
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

/// Work the driver task does off the machine's lock.
#[derive(Debug)]
enum Job {
    Propose {
        expect_change: u64,
        record: GroupRecord,
        guard: Guard,
    },
    Snapshot {
        to: String,
        epoch: u64,
    },
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
    /// The epoch whose primary's shard has this replica's stream.
    streamed: Mutex<Option<u64>>,
    /// The seq of each recent sync step's op (the pushes of a step wait for it).
    step_seqs: Mutex<BTreeMap<u64, Seq>>,
    /// The members and their records, as last seen.
    members: Mutex<BTreeMap<String, MemberRecord>>,
    start: Instant,
    stall: Duration,
    max_frame: usize,
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
        let r = Arc::new(Replication {
            index: shard.index(),
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
    pub fn op_stream(self: &Arc<Self>) -> OpStream {
        let me = self.clone();
        OpStream(Arc::new(move |op| me.order(op)))
    }

    /// Gives `op` its place in the stream (refused unless primary with its lease held).
    fn order(&self, op: &ShardOp) -> Result<(), PsError> {
        let core = self.shard.core()?;
        let bytes = core.encode_op(op);
        let mut m = lock(&self.machine);
        let (seq, fx) = m.submit(self.now()).map_err(|e| match e {
            NotPrimary::Elsewhere(p) => PsError::NotServing(format!(
                "shard {} is not primary here (primary: {})",
                self.index,
                p.as_deref().unwrap_or("none yet")
            )),
            NotPrimary::LeaseUncertain => PsError::NotServing(format!(
                "the etcd lease of shard {}'s primary is not confirmed",
                self.index
            )),
        })?;
        {
            let mut log = lock(&self.log);
            log.bytes += bytes.len();
            log.ops.insert(seq, bytes);
            while log.bytes > LOG_BYTES && log.ops.len() > 1 {
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
                    let live: Vec<String> = all.keys().cloned().collect();
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
            self.stream_when_primary();
        }
        if let Some((_, stop)) = upstream {
            stop.cancel();
        }
    }

    /// A primary's shard hands its ops to the stream.
    fn stream_when_primary(self: &Arc<Self>) {
        let primary = lock(&self.machine).primary_epoch();
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

    /// Keeps a connection to `primary` until `stop` fires.
    async fn upstream(self: Arc<Self>, primary: String, stop: CancellationToken) {
        let mut delay = Duration::from_millis(50);
        while !stop.is_cancelled() {
            let addr = lock(&self.members).get(&primary).map(|r| r.addr.clone());
            if let Some(addr) = addr {
                let up = &self.upstream;
                let opened = edl_pserver_client::bulk::open(
                    &addr,
                    &up.job,
                    up.token.as_deref(),
                    up.tls.as_ref(),
                )
                .await;
                match opened {
                    Ok(mut conn) => {
                        let frame = replicate_frame(self.index, &self.me);
                        if conn.write_all(&frame).await.is_ok() && conn.flush().await.is_ok() {
                            delay = Duration::from_millis(50);
                            self.clone()
                                .peer(conn, primary.clone(), stop.clone(), true)
                                .await;
                        }
                    }
                    Err(e) => {
                        tracing::debug!(shard = self.index, %primary, %addr, error = %e, "primary unreachable")
                    }
                }
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(Duration::from_secs(1));
        }
    }

    /// Serves a replication connection opened by `peer` (a backup or joiner of this
    /// primary), its hello already read, until it ends or this replica stops.
    pub async fn serve_peer<S>(self: Arc<Self>, conn: S, peer: String)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let stop = self.stop.child_token();
        self.peer(conn, peer, stop, false).await;
    }

    /// Runs one replication connection with `peer`: frames from the outbox written,
    /// frames read handed to the machine (on a blocking thread: replaying an op is CPU
    /// work), until either side ends.
    async fn peer<S>(
        self: Arc<Self>,
        conn: S,
        peer: String,
        stop: CancellationToken,
        upstream: bool,
    ) where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (mut rd, mut wr) = tokio::io::split(conn);
        let (tx, mut rx) = mpsc::unbounded_channel::<(Msg, Bytes)>();
        lock(&self.outbox).insert(peer.clone(), tx.clone());
        if upstream {
            let mut m = lock(&self.machine);
            let fx = m.reconnected(self.now());
            self.run(&mut m, fx, None);
        }
        let stall = self.stall;
        let writer = async {
            while let Some((msg, body)) = rx.recv().await {
                if stream::write(&mut wr, &msg, &body, stall).await.is_err() {
                    break;
                }
            }
        };
        let reader = async {
            loop {
                match stream::read(&mut rd, self.max_frame, stall).await {
                    Ok(Some((msg, payload))) => {
                        let me = self.clone();
                        let from = peer.clone();
                        let handled = tokio::task::spawn_blocking(move || {
                            let mut m = lock(&me.machine);
                            let fx = m.on_message(me.now(), &from, msg);
                            me.run(&mut m, fx, Some(&payload));
                        })
                        .await;
                        if handled.is_err() {
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::debug!(shard = self.index, %peer, error = %e, "replication connection ended");
                        break;
                    }
                }
            }
        };
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = writer => {}
            _ = reader => {}
        }
        let mut outbox = lock(&self.outbox);
        if outbox.get(&peer).is_some_and(|t| t.same_channel(&tx)) {
            outbox.remove(&peer);
        }
    }

    /// Carries out a job of the driver.
    async fn job(self: Arc<Self>, job: Job) {
        match job {
            Job::Propose {
                expect_change,
                record,
                guard,
            } => {
                let outcome = self.store.propose(expect_change, &record, &guard).await;
                let now = self.now();
                let mut m = lock(&self.machine);
                let fx = match outcome {
                    Proposed::Written(r) => m.observe(now, r),
                    Proposed::Refused(r) => {
                        // Refused at the change it expected: the guard failed, it did not
                        // land. Past it: the record read back settles the proposal (it
                        // may be this one, landed by an attempt whose answer was lost).
                        let moved_on = r.as_ref().is_some_and(|r| r.change > expect_change);
                        let mut fx = if moved_on {
                            Vec::new()
                        } else {
                            m.refused(now, &record)
                        };
                        if let Some(r) = r {
                            fx.extend(m.observe(now, r));
                        }
                        fx
                    }
                    Proposed::Unknown(e) => {
                        tracing::warn!(shard = self.index, error = %e, "group record write not confirmed; sending it again");
                        let me = self.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            // Only while it is still the proposal not settled.
                            if lock(&me.machine).proposal() == Some(&record) {
                                let _ = me.jobs.send(Job::Propose {
                                    expect_change,
                                    record,
                                    guard,
                                });
                            }
                        });
                        Vec::new()
                    }
                };
                self.run(&mut m, fx, None);
            }
            Job::Snapshot { to, epoch } => {
                let me = self.clone();
                let taken = tokio::task::spawn_blocking(move || {
                    let core = me.shard.core()?;
                    // Taken between two ops: every op given a place is applied.
                    core.replica_snapshot(|| lock(&me.machine).last_assigned().unwrap_or(0))
                })
                .await;
                let (bytes, seq) = match taken {
                    Ok(Ok(x)) => x,
                    Ok(Err(e)) => {
                        tracing::debug!(shard = self.index, %to, error = %e, "no snapshot for a joiner yet");
                        lock(&self.machine).snapshot_failed(&to);
                        return;
                    }
                    Err(_) => return,
                };
                let mut m = lock(&self.machine);
                if let Some(tx) = lock(&self.outbox).get(&to) {
                    let _ = tx.send((Msg::Snapshot { epoch, seq }, bytes));
                }
                let fx = m.snapshot_sent(self.now(), &to, seq);
                self.run(&mut m, fx, None);
            }
        }
    }
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

/// The header of a [`KIND_REPLICATE`](edl_pserver_client::bulk::KIND_REPLICATE) frame:
/// the shard and the opening member.
pub fn replicate_frame(shard: u32, me: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(12 + me.len());
    b.extend_from_slice(&edl_pserver_client::bulk::KIND_REPLICATE.to_le_bytes());
    b.extend_from_slice(&(4 + me.len() as u32).to_le_bytes());
    b.extend_from_slice(&shard.to_le_bytes());
    b.extend_from_slice(me.as_bytes());
    b
}

/// Reads a [`replicate_frame`]'s header: the shard and the member.
pub fn replicate_header(header: &[u8]) -> Result<(u32, String), PsError> {
    let bad = |w: &str| PsError::InvalidArgument(format!("replication header: {w}"));
    if header.len() < 4 || header.len() > 4 + 256 {
        return Err(bad("bad length"));
    }
    let shard = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    let id = std::str::from_utf8(&header[4..]).map_err(|_| bad("member id not UTF-8"))?;
    if id.is_empty() {
        return Err(bad("no member id"));
    }
    Ok((shard, id.to_string()))
}

#[cfg(test)]
mod tests {
    use edl_job::{JobKeys, JobName, RECORD_VERSION};
    use edl_testkit::etcd::EtcdCluster;
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpListener;

    use super::*;
    use crate::layout::Mode;
    use crate::shard::testutil::{core, push};

    /// One replica process in the test: its shard, replication, listener and stop.
    struct Node {
        shard: Arc<Shard>,
        rep: Arc<Replication>,
        stop: CancellationToken,
    }

    async fn node(etcd: &EtcdCluster, id: &str, with_values: bool, cfg: &ReplicaConfig) -> Node {
        let backend = etcd.connect().await.unwrap();
        let keys = JobKeys::new(&JobName::new("r").unwrap());
        let stop = CancellationToken::new();
        let lease = Arc::new(
            Lease::grant(backend.clone(), Duration::from_secs(2), stop.clone())
                .await
                .unwrap(),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let store = Arc::new(GroupStore::new(backend, keys, 0));
        let rec = MemberRecord {
            version: RECORD_VERSION,
            addr: listener.local_addr().unwrap().to_string(),
            pid: std::process::id(),
            started_ms: 0,
        };
        store.register(id, &rec, &lease).await.unwrap();
        let shard = Arc::new(Shard::new(0, 1, 9, Arc::default()));
        if with_values {
            shard.install(core(Mode::Async, 0, 1));
        }
        let rep = Replication::start(
            id.into(),
            shard.clone(),
            store,
            lease,
            Links {
                replica: cfg.clone(),
                upstream: Upstream {
                    job: "r".into(),
                    token: None,
                    tls: None,
                },
                stall: Duration::from_secs(5),
            },
            stop.clone(),
        );
        let (r, s) = (rep.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let (mut conn, _) = tokio::select! {
                    _ = s.cancelled() => break,
                    a = listener.accept() => a.unwrap(),
                };
                let r = r.clone();
                tokio::spawn(async move {
                    if let Ok((0, peer)) = accept_replica(&mut conn).await {
                        r.serve_peer(conn, peer).await;
                    }
                });
            }
        });
        Node { shard, rep, stop }
    }

    /// The pserver's side of opening a replication connection, as `bulk` does it (the
    /// hello taken as is: this test has no token).
    async fn accept_replica(conn: &mut tokio::net::TcpStream) -> std::io::Result<(u32, String)> {
        let mut head = [0u8; 12];
        conn.read_exact(&mut head).await?;
        let len = u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize;
        let mut hello = vec![0u8; len];
        conn.read_exact(&mut hello).await?;
        conn.write_all(&edl_pserver_client::bulk::STATUS_OK.to_le_bytes())
            .await?;
        let mut frame = [0u8; 8];
        conn.read_exact(&mut frame).await?;
        assert_eq!(
            frame[..4],
            edl_pserver_client::bulk::KIND_REPLICATE.to_le_bytes()
        );
        let len = u32::from_le_bytes([frame[4], frame[5], frame[6], frame[7]]) as usize;
        let mut header = vec![0u8; len];
        conn.read_exact(&mut header).await?;
        replicate_header(&header).map_err(std::io::Error::other)
    }

    async fn until(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !f() {
            assert!(Instant::now() < deadline, "{what}: not within 30 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Pushes on the primary `n`, each answered only once the backups hold it.
    async fn pushes(n: &Node, steps: std::ops::Range<u64>) {
        for step in steps {
            let core = n.shard.core().unwrap();
            let rep = n.rep.clone();
            let seq = tokio::task::spawn_blocking(move || {
                let p = core
                    .validate_push(push(&core, "t", 1, step, 1.0, &[step % 3]))
                    .unwrap();
                assert!(core.apply_async(&p).unwrap().applied);
                let seq = Replication::take_last_seq().expect("the push got no place");
                rep.local_applied(seq);
                seq
            })
            .await
            .unwrap();
            n.rep
                .wait_acked(seq, Duration::from_secs(20))
                .await
                .unwrap();
        }
    }

    fn state(
        n: &Node,
    ) -> (
        Vec<crate::checkpoint::format::BlockSnap>,
        u64,
        edl_job::ledger::LedgerSummary,
    ) {
        let c = n.shard.core().unwrap();
        let s = c.snapshot(0);
        (s.blocks, s.updates, c.contains())
    }

    /// A fresh member joins the primary's group by snapshot, follows its pushes (each
    /// answered only once it holds it), and takes over with all of them when the
    /// primary's lease ends; nothing is read from a checkpoint.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_backup_joins_follows_every_acknowledged_push_and_takes_over() {
        let etcd = EtcdCluster::start(1).await.unwrap();
        let cfg = ReplicaConfig {
            replicas: 2,
            timeout: 2_000,
            join_timeout: 20_000,
        };
        let a = node(&etcd, "a", true, &cfg).await;
        a.rep.restore(9);
        until("a primary", || a.rep.role() == Role::Primary).await;
        // Pushes before the backup exists are acknowledged by the primary alone.
        pushes(&a, 1..6).await;
        let b = node(&etcd, "b", false, &cfg).await;
        until("b in sync", || {
            a.rep.record().is_some_and(|r| r.backups.contains("b"))
        })
        .await;
        pushes(&a, 6..40).await;
        // Every acknowledged push is in the backup (it confirmed each before the answer).
        until("b caught up", || {
            b.shard.core().is_ok_and(|c| c.updates() == 39)
        })
        .await;
        assert_eq!(state(&b), state(&a));
        // The primary's process ends (its lease revoked): the backup takes over.
        a.stop.cancel();
        until("b primary", || b.rep.role() == Role::Primary).await;
        let r = b.rep.record().unwrap();
        assert_eq!(r.primary, "b");
        assert_eq!(r.epoch, 2);
        assert_eq!(r.incarnation, 9, "a promotion is not a restore");
        assert_eq!(b.shard.core().unwrap().updates(), 39);
        // It serves: a push is acknowledged (alone: no other member to recruit).
        pushes(&b, 40..45).await;
        assert_eq!(b.shard.core().unwrap().updates(), 44);
        b.stop.cancel();
    }
}
