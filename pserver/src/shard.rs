//! The parameters of one shard and the update logic, without sockets or etcd.
//!
//! Concurrency: every dense block has its own lock, and every sparse table is split into
//! lock stripes; there is no shard-wide lock on the data path. Pushes of different
//! trainers update different blocks in parallel; a pull copies each block under its own
//! lock (in async mode a pull may see some blocks before and others after a concurrent
//! push, as in any asynchronous parameter server). The only shard-wide locks are small:
//! the async deduplication table and the sync step state, held for a few map operations,
//! and, in sync mode, the step lock: applying a step holds it for writing and a pull for
//! reading, so that a pull never returns some blocks of step `S` and others of `S - 1`.
//!
//! The functions here are synchronous and CPU-bound; the server calls them from
//! blocking threads.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Duration;

use bytes::Bytes;
use edl_proto::pserver as pb;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::checkpoint::{BlockSnap, RowSnap, Snapshot};
use crate::error::PsError;
use crate::layout::{Layout, Mode, ModelSpec, RowInit, mix64};
use crate::optim::{Optimizer, SlotState};
use crate::sync::{Admit, CloseJob, SyncState};
use crate::wire;

/// Lock stripes per sparse table.
const STRIPES: usize = 64;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with a thread-local scratch buffer of `n` floats (contents unspecified: the
/// caller overwrites them).
fn with_scratch<R>(n: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < n {
            s.resize(n, 0.0);
        }
        f(&mut s[..n])
    })
}

/// Counters of one shard (reported by `Status`).
#[derive(Debug, Default)]
pub struct Counters {
    /// Pushes applied (async) or accumulated (sync).
    pub pushes_applied: AtomicU64,
    /// Retried pushes recognised and not applied again.
    pub duplicate_pushes: AtomicU64,
    /// Sync pushes of a closed step.
    pub stale_pushes: AtomicU64,
    /// Pushes refused for NaN or infinite values.
    pub nonfinite_rejected: AtomicU64,
    /// Pushes refused as malformed.
    pub invalid_rejected: AtomicU64,
    /// Sync steps applied.
    pub steps_closed: AtomicU64,
    /// Sync participants dropped (left, timed out).
    pub trainers_dropped: AtomicU64,
    /// Sync steps closed by the timeout.
    pub step_timeouts: AtomicU64,
    /// Pulls served.
    pub pulls: AtomicU64,
    /// Sparse rows served.
    pub sparse_rows_pulled: AtomicU64,
    /// Checkpoint files written.
    pub checkpoints_written: AtomicU64,
    /// Checkpoint writes that failed.
    pub checkpoints_failed: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Counters {
    /// The protobuf form.
    pub fn to_pb(&self) -> pb::Counters {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        pb::Counters {
            pushes_applied: g(&self.pushes_applied),
            duplicate_pushes: g(&self.duplicate_pushes),
            stale_pushes: g(&self.stale_pushes),
            nonfinite_rejected: g(&self.nonfinite_rejected),
            invalid_rejected: g(&self.invalid_rejected),
            steps_closed: g(&self.steps_closed),
            trainers_dropped: g(&self.trainers_dropped),
            step_timeouts: g(&self.step_timeouts),
            pulls: g(&self.pulls),
            sparse_rows_pulled: g(&self.sparse_rows_pulled),
            checkpoints_written: g(&self.checkpoints_written),
            checkpoints_failed: g(&self.checkpoints_failed),
        }
    }
}

/// Where sync-mode step snapshots go: the latest one waits for the checkpoint writer
/// (an older one not yet taken is replaced).
#[derive(Debug, Default)]
pub struct SnapshotSlot {
    slot: Mutex<Option<Snapshot>>,
    notify: Notify,
}

impl SnapshotSlot {
    /// Offers a snapshot to the writer.
    pub fn put(&self, snap: Snapshot) {
        if let Some(old) = lock(&self.slot).replace(snap) {
            tracing::warn!(
                step = old.step,
                "checkpoint writer busy; a step snapshot was superseded"
            );
        }
        self.notify.notify_one();
    }

    /// Takes the pending snapshot, if any.
    pub fn take(&self) -> Option<Snapshot> {
        lock(&self.slot).take()
    }

    /// Waits until a snapshot is offered.
    pub async fn wait(&self) {
        self.notify.notified().await
    }
}

/// When sync-mode snapshots are taken (after applying a step), where they go, and the
/// last checkpoint written.
#[derive(Debug, Default)]
pub struct CheckpointHooks {
    /// The step of the last checkpoint file written (or restored from).
    pub last_written: AtomicU64,
    /// Every this many steps (all shards agree on these steps without talking).
    pub every_steps: Option<u64>,
    /// A step requested through etcd (time-based checkpoints); 0 when none.
    pub target: AtomicU64,
    /// Where snapshots go.
    pub slot: Arc<SnapshotSlot>,
}

#[derive(Debug)]
struct Block {
    values: Vec<f32>,
    state: SlotState,
    version: u64,
    acc: Vec<f32>,
    has_acc: bool,
}

#[derive(Debug)]
struct Row {
    values: Vec<f32>,
    state: SlotState,
}

#[derive(Debug, Default)]
struct Stripe {
    rows: HashMap<u64, Row>,
    acc: HashMap<u64, Vec<f32>>,
}

#[derive(Debug)]
struct Table {
    dim: usize,
    init: RowInit,
    stripes: Vec<Mutex<Stripe>>,
}

fn stripe_of(row: u64) -> usize {
    ((mix64(row) >> 32) % STRIPES as u64) as usize
}

impl Table {
    fn new(dim: usize, init: RowInit) -> Self {
        Table {
            dim,
            init,
            stripes: (0..STRIPES)
                .map(|_| Mutex::new(Stripe::default()))
                .collect(),
        }
    }

    fn rows(&self) -> usize {
        self.stripes.iter().map(|s| lock(s).rows.len()).sum()
    }
}

/// Push sessions remembered for deduplication; the least recently used are forgotten
/// beyond this (a session's retries come within seconds).
const MAX_SESSIONS: usize = 4096;

/// Steps remembered per push session: a push this far behind its session's newest is
/// refused, since whether it was applied can no longer be told.
pub const DEDUP_WINDOW: u64 = 64;

/// What the deduplication table says of a push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mark {
    /// Not seen before: apply it.
    Fresh,
    /// Applied before (a retry).
    Repeat,
    /// Older than the window behind the session's newest step.
    TooOld {
        /// The session's newest step.
        newest: u64,
    },
}

/// Sliding window of the last [`DEDUP_WINDOW`] steps of one push session, with those
/// applied marked.
#[derive(Debug, Clone, Copy, Default)]
struct Window {
    max: u64,
    seen: u64,
    used: u64,
}

impl Window {
    /// Marks `step`.
    fn mark(&mut self, step: u64) -> Mark {
        if step > self.max {
            let shift = step - self.max;
            self.seen = if shift >= DEDUP_WINDOW {
                0
            } else {
                self.seen << shift
            };
            self.seen |= 1;
            self.max = step;
            return Mark::Fresh;
        }
        let d = self.max - step;
        if d >= DEDUP_WINDOW {
            return Mark::TooOld { newest: self.max };
        }
        let bit = 1u64 << d;
        let new = self.seen & bit == 0;
        self.seen |= bit;
        if new { Mark::Fresh } else { Mark::Repeat }
    }
}

/// The steps applied per (trainer, session).
#[derive(Debug, Default)]
struct Dedup {
    sessions: HashMap<(String, u64), Window>,
    clock: u64,
}

impl Dedup {
    /// Marks `step` of `trainer`'s `session`.
    fn mark(&mut self, trainer: &str, session: u64, step: u64) -> Mark {
        self.clock += 1;
        let w = self
            .sessions
            .entry((trainer.to_owned(), session))
            .or_default();
        w.used = self.clock;
        let mark = w.mark(step);
        if self.sessions.len() > MAX_SESSIONS {
            let mut used: Vec<u64> = self.sessions.values().map(|w| w.used).collect();
            used.sort_unstable();
            let cut = used[used.len() / 4];
            self.sessions.retain(|_, w| w.used > cut);
        }
        mark
    }
}

/// Why a sync push's step is refused.
pub(crate) fn out_of_range(step: u64, next: u64) -> String {
    format!(
        "step {step} is out of range: this shard's next step is {next}, and a push may be \
         at most {} steps past it (and at most step {})",
        crate::sync::MAX_STEP_AHEAD,
        crate::sync::MAX_STEP
    )
}

/// Sparse gradients of one table, validated.
#[derive(Debug, Clone)]
pub struct SparseGrad {
    table: usize,
    rows: Vec<u64>,
    values: Bytes,
}

/// A validated push: every block and row belongs to this shard, lengths match, values
/// are finite.
#[derive(Debug, Clone)]
pub struct Push {
    /// The trainer.
    pub trainer: String,
    /// Its session.
    pub session: u64,
    /// The step.
    pub step: u64,
    dense: Vec<(usize, Bytes)>,
    sparse: Vec<SparseGrad>,
}

/// Result of a push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushReply {
    /// False for a duplicate.
    pub applied: bool,
    /// Async: the shard's update count after it; sync: the step.
    pub step: u64,
}

/// The state a shard is built from (fresh or restored).
struct ShardData {
    blocks: Vec<Block>,
    tables: Vec<Table>,
    updates: u64,
    last_closed: u64,
    restored_from: u64,
}

/// An initialised shard.
#[derive(Debug)]
pub struct ShardCore {
    layout: Arc<Layout>,
    index: u32,
    incarnation: u64,
    optimizer: Optimizer,
    blocks: Vec<Mutex<Block>>,
    tables: Vec<Table>,
    updates: AtomicU64,
    dedup: Mutex<Dedup>,
    sync: Option<Mutex<SyncState>>,
    /// Sync mode: held for writing while a step is applied, for reading by pulls.
    step_lock: RwLock<()>,
    members_seeded: std::sync::atomic::AtomicBool,
    closed_tx: watch::Sender<u64>,
    checkpoints: Arc<CheckpointHooks>,
    restored_from: u64,
    /// Counters.
    pub counters: Counters,
}

impl ShardCore {
    fn build(
        layout: Arc<Layout>,
        index: u32,
        incarnation: u64,
        data: ShardData,
        checkpoints: Arc<CheckpointHooks>,
    ) -> Result<ShardCore, PsError> {
        let ShardData {
            blocks,
            tables,
            updates,
            last_closed,
            restored_from,
        } = data;
        let optimizer = Optimizer::new(layout.spec().config.optimizer.clone())
            .map_err(|e| PsError::Spec(e.into()))?;
        let sync = match layout.spec().config.mode {
            Mode::Async => None,
            Mode::Sync { step_timeout_ms } => Some(Mutex::new(SyncState::new(
                last_closed,
                Duration::from_millis(step_timeout_ms),
            ))),
        };
        Ok(ShardCore {
            layout,
            index,
            incarnation,
            optimizer,
            blocks: blocks.into_iter().map(Mutex::new).collect(),
            tables,
            updates: AtomicU64::new(updates),
            dedup: Mutex::new(Dedup::default()),
            sync,
            step_lock: RwLock::new(()),
            members_seeded: std::sync::atomic::AtomicBool::new(false),
            closed_tx: watch::channel(last_closed).0,
            checkpoints,
            restored_from,
            counters: Counters::default(),
        })
    }

    /// A shard with initial `values` for each of its blocks (in the shard's order).
    pub fn new(
        layout: Arc<Layout>,
        index: u32,
        incarnation: u64,
        values: Vec<Vec<f32>>,
        checkpoints: Arc<CheckpointHooks>,
    ) -> Result<ShardCore, PsError> {
        let optimizer = Optimizer::new(layout.spec().config.optimizer.clone())
            .map_err(|e| PsError::Spec(e.into()))?;
        let ids = layout.shard_blocks(index);
        if ids.len() != values.len() {
            return Err(PsError::InvalidArgument(format!(
                "{} blocks of values for {} blocks",
                values.len(),
                ids.len()
            )));
        }
        let mut blocks = Vec::with_capacity(ids.len());
        for (&id, values) in ids.iter().zip(values) {
            let len = layout.block(id).map_or(0, |b| b.len);
            if values.len() != len {
                return Err(PsError::InvalidArgument(format!(
                    "block {id} has {} values, expected {len}",
                    values.len()
                )));
            }
            blocks.push(Block {
                state: optimizer.state(len),
                values,
                version: 1,
                acc: Vec::new(),
                has_acc: false,
            });
        }
        let tables = layout
            .spec()
            .sparse
            .iter()
            .map(|s| Table::new(s.dim, s.init.clone()))
            .collect();
        let data = ShardData {
            blocks,
            tables,
            updates: 0,
            last_closed: 0,
            restored_from: 0,
        };
        Self::build(layout, index, incarnation, data, checkpoints)
    }

    /// A shard restored from a checkpoint snapshot.
    pub fn restore(
        snap: Snapshot,
        incarnation: u64,
        checkpoints: Arc<CheckpointHooks>,
    ) -> Result<ShardCore, PsError> {
        let layout = Arc::new(Layout::new(snap.spec.clone(), snap.shards)?);
        let optimizer = Optimizer::new(layout.spec().config.optimizer.clone())
            .map_err(|e| PsError::Spec(e.into()))?;
        let slots = optimizer.slots();
        let ids = layout.shard_blocks(snap.shard);
        if ids.len() != snap.blocks.len() {
            return Err(PsError::InvalidArgument(format!(
                "checkpoint has {} blocks, the layout gives shard {} {} blocks",
                snap.blocks.len(),
                snap.shard,
                ids.len()
            )));
        }
        let mut blocks = Vec::with_capacity(ids.len());
        for (&id, b) in ids.iter().zip(snap.blocks) {
            let len = layout.block(id).map_or(0, |b| b.len);
            if b.id != id || b.values.len() != len || b.state.slots.len() != slots * len {
                return Err(PsError::InvalidArgument(format!(
                    "checkpoint block {} ({} values) does not fit block {id} ({len} values)",
                    b.id,
                    b.values.len()
                )));
            }
            blocks.push(Block {
                values: b.values,
                state: b.state,
                version: b.version,
                acc: Vec::new(),
                has_acc: false,
            });
        }
        let mut tables = Vec::new();
        for (spec, rows) in layout.spec().sparse.iter().zip(snap.tables) {
            let t = Table::new(spec.dim, spec.init.clone());
            for r in rows {
                if r.values.len() != spec.dim || r.state.slots.len() != slots * spec.dim {
                    return Err(PsError::InvalidArgument(format!(
                        "checkpoint row {} of table {:?} has the wrong width",
                        r.row, spec.name
                    )));
                }
                lock(&t.stripes[stripe_of(r.row)]).rows.insert(
                    r.row,
                    Row {
                        values: r.values,
                        state: r.state,
                    },
                );
            }
            tables.push(t);
        }
        let data = ShardData {
            blocks,
            tables,
            updates: snap.updates,
            last_closed: snap.last_closed,
            restored_from: snap.step,
        };
        Self::build(layout, snap.shard, incarnation, data, checkpoints)
    }

    /// The layout.
    pub fn layout(&self) -> &Arc<Layout> {
        &self.layout
    }

    /// The spec.
    pub fn spec(&self) -> &ModelSpec {
        self.layout.spec()
    }

    /// Whether the shard runs in sync mode.
    pub fn is_sync(&self) -> bool {
        self.sync.is_some()
    }

    /// Updates applied.
    pub fn updates(&self) -> u64 {
        self.updates.load(Ordering::Acquire)
    }

    /// The step of the checkpoint this shard was restored from (0: none).
    pub fn restored_from(&self) -> u64 {
        self.restored_from
    }

    /// Sync: the step to push next; async: 0.
    pub fn next_step(&self) -> u64 {
        self.sync.as_ref().map_or(0, |s| lock(s).next_step())
    }

    /// Sync: the last step applied.
    pub fn last_closed(&self) -> u64 {
        self.sync.as_ref().map_or(0, |s| lock(s).last_closed())
    }

    /// Sync: a receiver of the last applied step.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.closed_tx.subscribe()
    }

    /// Sync: the participants and who pushed the open step.
    pub fn sync_members(&self) -> (Vec<String>, Vec<String>) {
        match &self.sync {
            Some(s) => {
                let s = lock(s);
                (
                    s.participants().map(str::to_owned).collect(),
                    s.contributed().map(str::to_owned).collect(),
                )
            }
            None => (Vec::new(), Vec::new()),
        }
    }

    /// Blocks and trained rows held.
    pub fn sizes(&self) -> (usize, u64) {
        (
            self.blocks.len(),
            self.tables.iter().map(|t| t.rows() as u64).sum(),
        )
    }

    fn invalid(&self, msg: String) -> PsError {
        bump(&self.counters.invalid_rejected);
        PsError::InvalidArgument(msg)
    }

    /// Validates a push request: blocks and rows of this shard, lengths, finiteness.
    /// Nothing is applied when this fails.
    pub fn validate_push(&self, req: pb::PushRequest) -> Result<Push, PsError> {
        if req.trainer.is_empty() || req.trainer.contains('/') {
            return Err(self.invalid(format!(
                "trainer id {:?} must be non-empty and contain no '/'",
                req.trainer
            )));
        }
        let mut dense = Vec::with_capacity(req.dense.len());
        let mut seen = vec![false; self.blocks.len()];
        for b in req.dense {
            let Some(info) = self.layout.block(b.id).filter(|i| i.shard == self.index) else {
                return Err(self.invalid(format!(
                    "block {} is not a block of shard {}",
                    b.id, self.index
                )));
            };
            if Some(b.values.len()) != wire::byte_len(info.len) {
                return Err(self.invalid(format!(
                    "block {} of parameter {:?} has {} bytes of gradient, expected {} ({} floats)",
                    b.id,
                    self.param_name(info.param),
                    b.values.len(),
                    info.len * 4,
                    info.len
                )));
            }
            let local = info.local as usize;
            if std::mem::replace(&mut seen[local], true) {
                return Err(self.invalid(format!("block {} appears twice", b.id)));
            }
            if !wire::all_finite(&b.values) {
                bump(&self.counters.nonfinite_rejected);
                return Err(PsError::NonFinite(format!(
                    "block {} of parameter {:?}",
                    b.id,
                    self.param_name(info.param)
                )));
            }
            dense.push((local, b.values));
        }
        let mut sparse = Vec::with_capacity(req.sparse.len());
        for s in req.sparse {
            let Some(t) = self.tables.get(s.table as usize) else {
                return Err(self.invalid(format!("unknown table {}", s.table)));
            };
            let name = &self.spec().sparse[s.table as usize].name;
            if Some(s.values.len()) != s.rows.len().checked_mul(t.dim * 4) {
                return Err(self.invalid(format!(
                    "table {name:?}: {} bytes of gradient for {} rows of {} floats",
                    s.values.len(),
                    s.rows.len(),
                    t.dim
                )));
            }
            if let Some(r) = s
                .rows
                .iter()
                .find(|&&r| self.layout.row_shard(r) != self.index)
            {
                return Err(self.invalid(format!(
                    "row {r} of table {name:?} belongs to shard {}, not {}",
                    self.layout.row_shard(*r),
                    self.index
                )));
            }
            if !wire::all_finite(&s.values) {
                bump(&self.counters.nonfinite_rejected);
                return Err(PsError::NonFinite(format!("rows of table {name:?}")));
            }
            sparse.push(SparseGrad {
                table: s.table as usize,
                rows: s.rows,
                values: s.values,
            });
        }
        Ok(Push {
            trainer: req.trainer,
            session: req.session,
            step: req.step,
            dense,
            sparse,
        })
    }

    fn param_name(&self, param: u32) -> &str {
        self.spec()
            .dense
            .get(param as usize)
            .map_or("?", |d| d.name.as_str())
    }

    /// Async mode: applies `push` unless it was applied before. A push more than
    /// [`DEDUP_WINDOW`] steps behind its session's newest is refused
    /// ([`PsError::StepTooOld`]): whether it was applied can no longer be told.
    pub fn apply_async(&self, push: &Push) -> Result<PushReply, PsError> {
        match lock(&self.dedup).mark(&push.trainer, push.session, push.step) {
            Mark::Fresh => {}
            Mark::Repeat => {
                bump(&self.counters.duplicate_pushes);
                return Ok(PushReply {
                    applied: false,
                    step: self.updates(),
                });
            }
            Mark::TooOld { newest } => {
                bump(&self.counters.invalid_rejected);
                return Err(PsError::StepTooOld {
                    step: push.step,
                    newest,
                    window: DEDUP_WINDOW,
                });
            }
        }
        let u = self.updates.fetch_add(1, Ordering::AcqRel);
        let lr = self.optimizer.lr(u);
        for (local, bytes) in &push.dense {
            let mut b = lock(&self.blocks[*local]);
            let b = &mut *b;
            with_scratch(b.values.len(), |g| {
                wire::decode_into(bytes, g);
                self.optimizer.step(lr, &mut b.values, g, 1.0, &mut b.state);
            });
            b.version += 1;
        }
        let overflowed: usize = push
            .sparse
            .iter()
            .map(|s| self.apply_rows(s, lr, 1.0))
            .sum();
        if overflowed > 0 {
            bump(&self.counters.nonfinite_rejected);
            tracing::warn!(
                shard = self.index,
                trainer = %push.trainer,
                rows = overflowed,
                "repeated sparse rows summed past f32's range; those rows left as they were"
            );
        }
        bump(&self.counters.pushes_applied);
        Ok(PushReply {
            applied: true,
            step: u + 1,
        })
    }

    /// Applies sparse gradients row by row, each stripe locked once; repeated rows are
    /// summed first. A row whose sum overflows to infinity is left as it is; returns how
    /// many were.
    fn apply_rows(&self, s: &SparseGrad, lr: f32, scale: f32) -> usize {
        let mut overflowed = 0;
        let t = &self.tables[s.table];
        let dim = t.dim;
        let mut by_stripe: Vec<Vec<usize>> = vec![Vec::new(); STRIPES];
        for (i, &r) in s.rows.iter().enumerate() {
            by_stripe[stripe_of(r)].push(i);
        }
        let mut grad = vec![0f32; dim];
        for (stripe, mut idx) in by_stripe.into_iter().enumerate() {
            if idx.is_empty() {
                continue;
            }
            idx.sort_by_key(|&i| s.rows[i]);
            let mut st = lock(&t.stripes[stripe]);
            let mut k = 0;
            while k < idx.len() {
                let row = s.rows[idx[k]];
                grad.fill(0.0);
                while k < idx.len() && s.rows[idx[k]] == row {
                    let at = idx[k] * dim * 4;
                    wire::add_into(&s.values[at..at + dim * 4], &mut grad);
                    k += 1;
                }
                if !grad.iter().all(|g| g.is_finite()) {
                    overflowed += 1;
                    continue;
                }
                let r = st.rows.entry(row).or_insert_with(|| {
                    let mut values = vec![0f32; dim];
                    t.init.fill(row, &mut values);
                    Row {
                        values,
                        state: self.optimizer.state(dim),
                    }
                });
                self.optimizer
                    .step(lr, &mut r.values, &grad, scale, &mut r.state);
            }
        }
        overflowed
    }

    fn sync_state(&self) -> &Mutex<SyncState> {
        // Callers check `is_sync` first; an async shard never reaches the sync path.
        self.sync
            .as_ref()
            .unwrap_or_else(|| unreachable!("sync call on an async shard"))
    }

    /// Sync mode: admits `push` into a step and, when admitted, accumulates it and
    /// applies the step if it is complete. Call from a blocking thread; runs to
    /// completion even if the caller stops waiting.
    pub fn sync_push(&self, push: &Push, now: Instant) -> Result<Admit, PsError> {
        if !self.is_sync() {
            return Err(PsError::InvalidArgument(
                "the shard is in async mode".into(),
            ));
        }
        let (admit, close) = lock(self.sync_state()).admit(&push.trainer, push.step, now);
        if let Some(job) = close {
            self.sync_close(job);
        }
        match admit {
            Admit::Join { step } => {
                self.accumulate(push);
                bump(&self.counters.pushes_applied);
                let close = lock(self.sync_state()).accumulated(&push.trainer);
                if let Some(job) = close {
                    self.sync_close(job);
                }
                Ok(Admit::Join { step })
            }
            Admit::AlreadyApplied { .. } | Admit::InProgress { .. } => {
                bump(&self.counters.duplicate_pushes);
                Ok(admit)
            }
            Admit::Stale { .. } => {
                bump(&self.counters.stale_pushes);
                Ok(admit)
            }
            Admit::Wait => Ok(admit),
            Admit::OutOfRange { next } => Err(self.invalid(out_of_range(push.step, next))),
        }
    }

    fn accumulate(&self, push: &Push) {
        for (local, bytes) in &push.dense {
            let mut b = lock(&self.blocks[*local]);
            let n = b.values.len();
            if b.acc.len() != n {
                b.acc = vec![0.0; n];
            }
            wire::add_into(bytes, &mut b.acc);
            b.has_acc = true;
        }
        for s in &push.sparse {
            let t = &self.tables[s.table];
            let dim = t.dim;
            for (i, &r) in s.rows.iter().enumerate() {
                let mut st = lock(&t.stripes[stripe_of(r)]);
                let acc = st.acc.entry(r).or_insert_with(|| vec![0.0; dim]);
                wire::add_into(&s.values[i * dim * 4..(i + 1) * dim * 4], acc);
            }
        }
    }

    /// Sync mode: a pull's view of one step (no step is applied while it is held).
    /// Async mode: nothing.
    fn step_view(&self) -> Option<std::sync::RwLockReadGuard<'_, ()>> {
        self.is_sync().then(|| {
            self.step_lock
                .read()
                .unwrap_or_else(PoisonError::into_inner)
        })
    }

    /// Sync mode: applies the mean of the accumulated gradients of `job`'s step,
    /// snapshots it when a checkpoint is due, and wakes the waiting pushes. Pulls wait
    /// while the step is applied.
    pub fn sync_close(&self, job: CloseJob) {
        let applying = self
            .step_lock
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if self.accumulated_finite() {
            self.apply_accumulated(job);
        } else {
            // Finite gradients may sum past f32's range: such a step changes nothing.
            self.clear_accumulated();
            bump(&self.counters.nonfinite_rejected);
            tracing::error!(
                shard = self.index,
                step = job.step,
                trainers = job.contributors,
                "the step's summed gradients overflow to infinity; step dropped"
            );
        }
        bump(&self.counters.steps_closed);
        if job.timed_out > 0 {
            bump(&self.counters.step_timeouts);
            self.counters
                .trainers_dropped
                .fetch_add(u64::from(job.timed_out), Ordering::Relaxed);
        }
        let cp = &self.checkpoints;
        let target = cp.target.load(Ordering::Acquire);
        let due_every = cp
            .every_steps
            .is_some_and(|n| n > 0 && job.step.is_multiple_of(n));
        let due_target = target > 0 && job.step >= target;
        if due_target {
            if job.step != target {
                tracing::warn!(
                    shard = self.index,
                    step = job.step,
                    target,
                    "requested checkpoint step skipped; checkpointing this step instead"
                );
            }
            let _ = cp
                .target
                .compare_exchange(target, 0, Ordering::AcqRel, Ordering::Acquire);
        }
        if due_every || due_target {
            let snap = self.snapshot_at(job.step, job.step);
            cp.slot.put(snap);
        }
        lock(self.sync_state()).closed(job);
        drop(applying);
        self.closed_tx.send_replace(job.step);
        tracing::debug!(
            shard = self.index,
            step = job.step,
            trainers = job.contributors,
            "step applied"
        );
    }

    /// Whether every accumulated gradient (dense and sparse) is finite.
    fn accumulated_finite(&self) -> bool {
        let finite = |v: &[f32]| v.iter().all(|x| x.is_finite());
        self.blocks.iter().all(|b| {
            let b = lock(b);
            !b.has_acc || finite(&b.acc)
        }) && self.tables.iter().all(|t| {
            t.stripes
                .iter()
                .all(|s| lock(s).acc.values().all(|a| finite(a)))
        })
    }

    /// Forgets the accumulated gradients.
    fn clear_accumulated(&self) {
        for b in &self.blocks {
            let mut b = lock(b);
            if b.has_acc {
                b.acc.fill(0.0);
                b.has_acc = false;
            }
        }
        for t in &self.tables {
            for stripe in &t.stripes {
                lock(stripe).acc.clear();
            }
        }
    }

    /// Applies the mean of the accumulated gradients of `job`'s step.
    fn apply_accumulated(&self, job: CloseJob) {
        let scale = 1.0 / job.contributors.max(1) as f32;
        let u = self.updates.fetch_add(1, Ordering::AcqRel);
        let lr = self.optimizer.lr(u);
        for b in &self.blocks {
            let mut b = lock(b);
            if !b.has_acc {
                continue;
            }
            let b = &mut *b;
            self.optimizer
                .step(lr, &mut b.values, &b.acc, scale, &mut b.state);
            b.acc.fill(0.0);
            b.has_acc = false;
            b.version += 1;
        }
        for (ti, t) in self.tables.iter().enumerate() {
            for stripe in &t.stripes {
                let acc = std::mem::take(&mut lock(stripe).acc);
                if acc.is_empty() {
                    continue;
                }
                let rows: Vec<u64> = acc.keys().copied().collect();
                let mut values = Vec::with_capacity(rows.len() * t.dim * 4);
                for r in &rows {
                    for v in &acc[r] {
                        values.extend_from_slice(&v.to_le_bytes());
                    }
                }
                self.apply_rows(
                    &SparseGrad {
                        table: ti,
                        rows,
                        values: Bytes::from(values),
                    },
                    lr,
                    scale,
                );
            }
        }
    }

    fn sync_apply(&self, f: impl FnOnce(&mut SyncState) -> Option<CloseJob>) {
        let Some(s) = &self.sync else { return };
        let close = f(&mut lock(s));
        if let Some(job) = close {
            self.sync_close(job);
        }
    }

    /// Sync mode: `trainer` stops taking part until its next push (`Leave`); returns
    /// whether it was taking part.
    pub fn sync_leave(&self, trainer: &str) -> bool {
        let mut was = false;
        self.sync_apply(|s| {
            let (w, close) = s.leave(trainer);
            was = w;
            close
        });
        if was {
            bump(&self.counters.trainers_dropped);
        }
        was
    }

    /// Sync mode: `trainer`'s registration ended; returns whether the open step was
    /// waiting for it.
    pub fn sync_member_left(&self, trainer: &str) -> bool {
        let mut was = false;
        self.sync_apply(|s| {
            let (w, close) = s.member_left(trainer);
            was = w;
            close
        });
        if was {
            bump(&self.counters.trainers_dropped);
        }
        was
    }

    /// Sync mode: `trainer` registered.
    pub fn sync_member_joined(&self, trainer: &str) {
        if let Some(s) = &self.sync {
            lock(s).member_joined(trainer);
        }
    }

    /// Sync mode: reconciles the registry members with a listing.
    pub fn sync_set_members(&self, members: std::collections::BTreeSet<String>) {
        self.sync_apply(|s| s.set_members(members));
        self.members_seeded.store(true, Ordering::Release);
    }

    /// Sync mode: whether the registry members were given at least once (a step must
    /// not open before: it would expect nobody).
    pub fn sync_members_seeded(&self) -> bool {
        self.members_seeded.load(Ordering::Acquire)
    }

    /// Sync mode: enforces the step timeout.
    pub fn sync_tick(&self, now: Instant) {
        let Some(s) = &self.sync else { return };
        let close = {
            let mut s = lock(s);
            let missing = s.missing();
            let job = s.tick(now);
            if job.is_some() {
                tracing::warn!(
                    shard = self.index,
                    ?missing,
                    "step timed out; dropping silent trainers from it"
                );
            }
            job
        };
        if let Some(job) = close {
            self.sync_close(job);
        }
    }

    /// The blocks whose version differs from `known` (all when `incarnation` is not
    /// ours or `known` is empty).
    pub fn pull(&self, known: &[u64], incarnation: u64) -> pb::PullResponse {
        let known = if incarnation == self.incarnation {
            known
        } else {
            &[]
        };
        let view = self.step_view();
        let ids = self.layout.shard_blocks(self.index);
        let mut blocks = Vec::new();
        for (i, (b, &id)) in self.blocks.iter().zip(ids).enumerate() {
            let b = lock(b);
            if known.get(i) == Some(&b.version) {
                continue;
            }
            blocks.push(pb::DenseBlock {
                id,
                version: b.version,
                values: wire::encode(&b.values),
            });
        }
        bump(&self.counters.pulls);
        let resp = pb::PullResponse {
            blocks,
            next_step: if self.is_sync() {
                self.next_step()
            } else {
                self.updates()
            },
            updates: self.updates(),
            incarnation: self.incarnation,
        };
        drop(view);
        resp
    }

    /// Values of `rows` of table `table` (rows never trained: their initial values), in
    /// at most `max_bytes`.
    pub fn pull_sparse(
        &self,
        table: u32,
        rows: &[u64],
        max_bytes: usize,
    ) -> Result<Bytes, PsError> {
        let Some(t) = self.tables.get(table as usize) else {
            return Err(PsError::InvalidArgument(format!("unknown table {table}")));
        };
        let dim = t.dim;
        let Some(size) = rows
            .len()
            .checked_mul(dim)
            .and_then(|n| n.checked_mul(4))
            .filter(|&n| n <= max_bytes)
        else {
            return Err(PsError::InvalidArgument(format!(
                "{} rows of {dim} floats exceed the {max_bytes} byte message limit; pull fewer \
                 rows at once",
                rows.len()
            )));
        };
        if let Some(r) = rows
            .iter()
            .find(|&&r| self.layout.row_shard(r) != self.index)
        {
            return Err(PsError::InvalidArgument(format!(
                "row {r} belongs to shard {}, not {}",
                self.layout.row_shard(*r),
                self.index
            )));
        }
        let mut out = vec![0u8; size];
        let mut init = vec![0f32; dim];
        let _view = self.step_view();
        for (i, &r) in rows.iter().enumerate() {
            let dst = &mut out[i * dim * 4..(i + 1) * dim * 4];
            let st = lock(&t.stripes[stripe_of(r)]);
            let values = match st.rows.get(&r) {
                Some(row) => &row.values,
                None => {
                    t.init.fill(r, &mut init);
                    &init
                }
            };
            for (c, v) in dst.chunks_exact_mut(4).zip(values) {
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        self.counters
            .sparse_rows_pulled
            .fetch_add(rows.len() as u64, Ordering::Relaxed);
        Ok(Bytes::from(out))
    }

    /// A copy of the shard labelled `step` (each block copied under its own lock).
    pub fn snapshot(&self, step: u64) -> Snapshot {
        let _view = self.step_view();
        self.snapshot_at(step, self.last_closed())
    }

    fn snapshot_at(&self, step: u64, last_closed: u64) -> Snapshot {
        let ids = self.layout.shard_blocks(self.index);
        let blocks = self
            .blocks
            .iter()
            .zip(ids)
            .map(|(b, &id)| {
                let b = lock(b);
                BlockSnap {
                    id,
                    version: b.version,
                    values: b.values.clone(),
                    state: b.state.clone(),
                }
            })
            .collect();
        let tables = self
            .tables
            .iter()
            .map(|t| {
                let mut rows: Vec<RowSnap> = t
                    .stripes
                    .iter()
                    .flat_map(|s| {
                        lock(s)
                            .rows
                            .iter()
                            .map(|(&row, r)| RowSnap {
                                row,
                                values: r.values.clone(),
                                state: r.state.clone(),
                            })
                            .collect::<Vec<_>>()
                    })
                    .collect();
                rows.sort_by_key(|r| r.row);
                rows
            })
            .collect();
        Snapshot {
            step,
            shard: self.index,
            shards: self.layout.shards(),
            spec: self.spec().clone(),
            updates: self.updates(),
            last_closed,
            blocks,
            tables,
        }
    }

    /// The values of dense parameter `name` held by this shard, as (offset, values)
    /// runs (for tests and tools).
    pub fn dense_values(&self, name: &str) -> Vec<(usize, Vec<f32>)> {
        let Some(p) = self.layout.param_index(name) else {
            return Vec::new();
        };
        self.layout
            .param_blocks(p)
            .iter()
            .filter(|b| b.shard == self.index)
            .map(|b| {
                (
                    b.offset,
                    lock(&self.blocks[b.local as usize]).values.clone(),
                )
            })
            .collect()
    }
}

/// A shard before and after initialisation.
#[derive(Debug)]
pub struct Shard {
    index: u32,
    shards: u32,
    incarnation: u64,
    state: RwLock<ShardState>,
    checkpoints: Arc<CheckpointHooks>,
}

#[derive(Debug)]
enum ShardState {
    Empty,
    Loading {
        layout: Arc<Layout>,
        blocks: Vec<Option<Vec<f32>>>,
    },
    Ready(Arc<ShardCore>),
}

impl Shard {
    /// An empty shard `index` of `shards`.
    pub fn new(
        index: u32,
        shards: u32,
        incarnation: u64,
        checkpoints: Arc<CheckpointHooks>,
    ) -> Self {
        Shard {
            index,
            shards,
            incarnation,
            state: RwLock::new(ShardState::Empty),
            checkpoints,
        }
    }

    /// The index.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The shard count.
    pub fn shards(&self) -> u32 {
        self.shards
    }

    /// The incarnation (claim revision).
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Where sync snapshots go, and when.
    pub fn checkpoints(&self) -> &Arc<CheckpointHooks> {
        &self.checkpoints
    }

    /// The initialised shard.
    pub fn core(&self) -> Result<Arc<ShardCore>, PsError> {
        match &*self.state.read().unwrap_or_else(PoisonError::into_inner) {
            ShardState::Ready(c) => Ok(c.clone()),
            _ => Err(PsError::Uninitialised(self.index)),
        }
    }

    /// Installs a restored shard.
    pub fn install(&self, core: ShardCore) {
        *self.state.write().unwrap_or_else(PoisonError::into_inner) =
            ShardState::Ready(Arc::new(core));
    }

    /// Checks that a request names this shard.
    pub fn check_target(&self, shard: u32, shards: u32) -> Result<(), PsError> {
        if shard != self.index || shards != self.shards {
            return Err(PsError::WrongShard {
                have: self.index,
                shards: self.shards,
                want: shard,
                want_shards: shards,
            });
        }
        Ok(())
    }

    /// Loads initial blocks (see the `Init` RPC). Returns (already initialised, blocks
    /// still missing).
    pub fn init(&self, req: pb::InitRequest) -> Result<(bool, u32), PsError> {
        self.check_target(req.shard, req.shards)?;
        let spec = ModelSpec::from_json(&req.spec_json)?;
        let mut state = self.state.write().unwrap_or_else(PoisonError::into_inner);
        if let ShardState::Ready(core) = &*state {
            return if *core.spec() == spec {
                Ok((true, 0))
            } else {
                Err(PsError::SpecMismatch(format!(
                    "shard {} holds another model; the request's spec differs",
                    self.index
                )))
            };
        }
        if let ShardState::Loading { layout, .. } = &*state
            && **layout.spec() != spec
        {
            // A new initialiser (the first died) with another spec: start over.
            tracing::warn!(shard = self.index, trainer = %req.trainer, "initialisation restarted with another spec");
            *state = ShardState::Empty;
        }
        if matches!(*state, ShardState::Empty) {
            let layout = Arc::new(Layout::new(spec, self.shards)?);
            let n = layout.shard_blocks(self.index).len();
            *state = ShardState::Loading {
                layout,
                blocks: vec![None; n],
            };
        }
        let ShardState::Loading { layout, blocks } = &mut *state else {
            return Err(PsError::Uninitialised(self.index));
        };
        for b in req.blocks {
            let Some(info) = layout.block(b.id).filter(|i| i.shard == self.index) else {
                return Err(PsError::InvalidArgument(format!(
                    "block {} is not a block of shard {}",
                    b.id, self.index
                )));
            };
            if Some(b.values.len()) != wire::byte_len(info.len) {
                return Err(PsError::InvalidArgument(format!(
                    "block {} has {} bytes, expected {}",
                    b.id,
                    b.values.len(),
                    info.len * 4
                )));
            }
            if !wire::all_finite(&b.values) {
                return Err(PsError::NonFinite(format!(
                    "initial values of block {}",
                    b.id
                )));
            }
            blocks[info.local as usize] = Some(wire::decode(&b.values));
        }
        let missing = blocks.iter().filter(|b| b.is_none()).count() as u32;
        Ok((false, missing))
    }

    /// Completes initialisation; returns whether it was already done.
    pub fn finish_init(&self) -> Result<bool, PsError> {
        let mut state = self.state.write().unwrap_or_else(PoisonError::into_inner);
        let (layout, blocks) = match &mut *state {
            ShardState::Ready(_) => return Ok(true),
            ShardState::Empty => {
                return Err(PsError::InvalidArgument(
                    "FinishInit before any Init".into(),
                ));
            }
            ShardState::Loading { layout, blocks } => (layout.clone(), blocks),
        };
        let missing = blocks.iter().filter(|b| b.is_none()).count();
        if missing > 0 {
            return Err(PsError::InvalidArgument(format!(
                "{missing} blocks of shard {} were never sent",
                self.index
            )));
        }
        let values = std::mem::take(blocks).into_iter().flatten().collect();
        let core = ShardCore::new(
            layout,
            self.index,
            self.incarnation,
            values,
            self.checkpoints.clone(),
        )?;
        *state = ShardState::Ready(Arc::new(core));
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{DenseSpec, ParamConfig, SparseSpec};
    use crate::optim::OptimizerConfig;

    pub(crate) fn spec(mode: Mode, opt: OptimizerConfig) -> ModelSpec {
        ModelSpec {
            dense: vec![
                DenseSpec {
                    name: "w".into(),
                    shape: vec![10],
                },
                DenseSpec {
                    name: "b".into(),
                    shape: vec![3],
                },
            ],
            sparse: vec![SparseSpec {
                name: "emb".into(),
                dim: 2,
                init: RowInit::Zeros,
            }],
            config: ParamConfig {
                block_size: 4,
                ..ParamConfig::new(mode, opt)
            },
        }
    }

    fn core(mode: Mode, index: u32, shards: u32) -> ShardCore {
        let layout = Arc::new(Layout::new(spec(mode, OptimizerConfig::sgd(1.0)), shards).unwrap());
        let values = layout
            .shard_blocks(index)
            .iter()
            .map(|&id| vec![0.0; layout.block(id).unwrap().len])
            .collect();
        ShardCore::new(layout, index, 9, values, Arc::default()).unwrap()
    }

    fn push(
        c: &ShardCore,
        trainer: &str,
        session: u64,
        step: u64,
        g: f32,
        rows: &[u64],
    ) -> pb::PushRequest {
        let l = c.layout();
        pb::PushRequest {
            shard: c.index,
            shards: l.shards(),
            trainer: trainer.into(),
            session,
            step,
            dense: l
                .shard_blocks(c.index)
                .iter()
                .map(|&id| pb::DenseBlock {
                    id,
                    version: 0,
                    values: wire::encode(&vec![g; l.block(id).unwrap().len]),
                })
                .collect(),
            sparse: vec![pb::SparseRows {
                table: 0,
                rows: rows.to_vec(),
                values: wire::encode(&vec![g; rows.len() * 2]),
            }],
            wait_ms: 0,
        }
    }

    fn all(c: &ShardCore) -> Vec<f32> {
        let mut v = c
            .dense_values("w")
            .into_iter()
            .flat_map(|(_, v)| v)
            .collect::<Vec<_>>();
        v.extend(c.dense_values("b").into_iter().flat_map(|(_, v)| v));
        v
    }

    #[test]
    fn async_pushes_apply_once_each() {
        let c = core(Mode::Async, 0, 1);
        let p = c
            .validate_push(push(&c, "t", 1, 1, 1.0, &[5, 5, 7]))
            .unwrap();
        assert!(c.apply_async(&p).unwrap().applied);
        assert!(
            !c.apply_async(&p).unwrap().applied,
            "a retry is not applied twice"
        );
        let p2 = c.validate_push(push(&c, "t", 1, 2, 2.0, &[])).unwrap();
        assert!(c.apply_async(&p2).unwrap().applied);
        assert!(all(&c).iter().all(|&v| v == -3.0), "{:?}", all(&c));
        // Row 5 appeared twice in one push: summed, applied once (-2); row 7: -1.
        let rows = wire::decode(&c.pull_sparse(0, &[5, 7, 9], 1 << 20).unwrap());
        assert_eq!(rows, vec![-2.0, -2.0, -1.0, -1.0, 0.0, 0.0]);
        // A pull larger than the message limit is refused before anything is allocated.
        assert_eq!(c.pull_sparse(0, &[5, 7], 16).unwrap().len(), 16);
        assert!(matches!(
            c.pull_sparse(0, &[5, 7, 9], 16),
            Err(PsError::InvalidArgument(_))
        ));
        // A push older than the window is refused, not silently dropped.
        let p_new = c.validate_push(push(&c, "t", 1, 200, 1.0, &[])).unwrap();
        assert!(c.apply_async(&p_new).unwrap().applied);
        let p_old = c.validate_push(push(&c, "t", 1, 3, 1.0, &[])).unwrap();
        let err = c.apply_async(&p_old).unwrap_err();
        assert!(
            matches!(
                err,
                PsError::StepTooOld {
                    step: 3,
                    newest: 200,
                    ..
                }
            ),
            "{err}"
        );
        let status: tonic::Status = err.into();
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
        // A new session of the same trainer starts over.
        let p3 = c.validate_push(push(&c, "t", 2, 1, 1.0, &[])).unwrap();
        assert!(c.apply_async(&p3).unwrap().applied);
        assert_eq!(c.counters.duplicate_pushes.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn the_dedup_window_accepts_reordering_and_rejects_repeats() {
        let mut d = Dedup::default();
        assert_eq!(d.mark("t", 1, 3), Mark::Fresh);
        assert_eq!(d.mark("t", 1, 1), Mark::Fresh);
        assert_eq!(d.mark("t", 1, 2), Mark::Fresh);
        assert_eq!(d.mark("t", 1, 2), Mark::Repeat);
        assert_eq!(
            d.mark("t", 2, 2),
            Mark::Fresh,
            "another session of the same trainer"
        );
        assert_eq!(d.mark("t", 1, 100), Mark::Fresh);
        assert_eq!(
            d.mark("t", 1, 3),
            Mark::TooOld { newest: 100 },
            "too old to tell: refused"
        );
        assert_eq!(d.mark("t", 1, 37), Mark::Fresh, "inside the window");
        assert_eq!(d.mark("t", 1, 100), Mark::Repeat);
        assert_eq!(d.mark("t", 2, 2), Mark::Repeat);
        for s in 0..(MAX_SESSIONS as u64 + 10) {
            d.mark("u", 10 + s, 1);
        }
        assert!(d.sessions.len() <= MAX_SESSIONS);
        assert_eq!(
            d.mark("u", 10 + MAX_SESSIONS as u64 + 9, 1),
            Mark::Repeat,
            "recent sessions kept"
        );
    }

    #[test]
    fn bad_pushes_are_refused_whole_and_counted() {
        let c = core(Mode::Async, 0, 2);
        let mut req = push(&c, "t", 1, 1, 1.0, &[]);
        let mut bad = wire::decode(&req.dense[0].values);
        bad[1] = f32::NAN;
        req.dense[0].values = wire::encode(&bad);
        assert!(matches!(c.validate_push(req), Err(PsError::NonFinite(_))));
        let mut req = push(&c, "t", 1, 1, 1.0, &[]);
        req.dense[0].values.truncate(4);
        assert!(matches!(
            c.validate_push(req),
            Err(PsError::InvalidArgument(_))
        ));
        let mut req = push(&c, "t", 1, 1, 1.0, &[]);
        req.dense[0].id = 1; // block 1 lives on shard 1
        assert!(matches!(
            c.validate_push(req),
            Err(PsError::InvalidArgument(_))
        ));
        let foreign = (0..100u64).find(|&r| c.layout().row_shard(r) == 1).unwrap();
        let req = push(&c, "t", 1, 1, 1.0, &[foreign]);
        assert!(matches!(
            c.validate_push(req),
            Err(PsError::InvalidArgument(_))
        ));
        let mut req = push(&c, "t", 1, 1, 1.0, &[]);
        req.sparse[0].values = wire::encode(&[f32::INFINITY, 0.0]);
        req.sparse[0].rows = vec![(0..100u64).find(|&r| c.layout().row_shard(r) == 0).unwrap()];
        assert!(matches!(c.validate_push(req), Err(PsError::NonFinite(_))));
        assert_eq!(c.counters.nonfinite_rejected.load(Ordering::Relaxed), 2);
        assert!(all(&c).iter().all(|&v| v == 0.0), "nothing applied");
    }

    #[test]
    fn sync_steps_apply_the_mean_of_the_contributors() {
        let c = core(Mode::sync(), 0, 1);
        let now = Instant::now();
        c.sync_set_members(["a".to_string()].into());
        let a = c.validate_push(push(&c, "a", 1, 1, 2.0, &[3])).unwrap();
        assert_eq!(c.sync_push(&a, now).unwrap(), Admit::Join { step: 1 });
        // a alone was registered at step 1: applied at once.
        assert_eq!(c.last_closed(), 1);
        assert!(all(&c).iter().all(|&v| v == -2.0));
        c.sync_member_joined("b");
        let a2 = c.validate_push(push(&c, "a", 1, 2, 2.0, &[3])).unwrap();
        let b2 = c.validate_push(push(&c, "b", 1, 2, 4.0, &[])).unwrap();
        assert_eq!(c.sync_push(&b2, now).unwrap(), Admit::Join { step: 2 });
        assert_eq!(c.last_closed(), 1, "waits for a");
        assert_eq!(
            c.sync_push(&b2, now).unwrap(),
            Admit::InProgress { step: 2 }
        );
        assert_eq!(c.sync_push(&a2, now).unwrap(), Admit::Join { step: 2 });
        assert_eq!(c.last_closed(), 2);
        // mean(2, 4) = 3
        assert!(all(&c).iter().all(|&v| v == -5.0), "{:?}", all(&c));
        // Row 3: step 1: -2; step 2: only a pushed it (2), divided by 2 trainers: -1.
        assert_eq!(
            wire::decode(&c.pull_sparse(0, &[3], 1 << 20).unwrap()),
            vec![-3.0, -3.0]
        );
        assert_eq!(
            c.sync_push(&a2, now).unwrap(),
            Admit::AlreadyApplied { step: 2 }
        );
        // b dies before step 3: a's push waits, b leaves, the step closes with a alone.
        let a3 = c.validate_push(push(&c, "a", 1, 3, 1.0, &[])).unwrap();
        assert_eq!(c.sync_push(&a3, now).unwrap(), Admit::Join { step: 3 });
        assert_eq!(c.last_closed(), 2);
        assert!(c.sync_member_left("b"));
        assert_eq!(c.last_closed(), 3);
        assert!(all(&c).iter().all(|&v| v == -6.0));
        // A runaway step is refused, not admitted into the step counter.
        let runaway = c
            .validate_push(push(&c, "a", 1, u64::MAX, 1.0, &[]))
            .unwrap();
        assert!(matches!(
            c.sync_push(&runaway, now),
            Err(PsError::InvalidArgument(_))
        ));
        assert_eq!(c.next_step(), 4);
    }

    struct DropFlag<'a>(&'a std::sync::atomic::AtomicBool);

    impl Drop for DropFlag<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }

    #[test]
    fn a_sync_pull_sees_one_step_whole() {
        let spec = ModelSpec {
            dense: vec![DenseSpec {
                name: "w".into(),
                shape: vec![64 * 256],
            }],
            sparse: Vec::new(),
            config: ParamConfig {
                block_size: 256,
                ..ParamConfig::new(Mode::sync(), OptimizerConfig::sgd(1.0))
            },
        };
        let layout = Arc::new(Layout::new(spec, 1).unwrap());
        let values = layout
            .shard_blocks(0)
            .iter()
            .map(|&id| vec![0.0; layout.block(id).unwrap().len])
            .collect();
        let c = ShardCore::new(layout, 0, 1, values, Arc::default()).unwrap();
        c.sync_set_members(["a".to_string()].into());
        const STEPS: u64 = 300;
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                // Set even if this thread panics, so the puller stops.
                let _done = DropFlag(&done);
                for step in 1..=STEPS {
                    let mut req = push(&c, "a", 1, step, 1.0, &[]);
                    req.sparse.clear();
                    let p = c.validate_push(req).unwrap();
                    assert_eq!(
                        c.sync_push(&p, Instant::now()).unwrap(),
                        Admit::Join { step }
                    );
                }
            });
            let mut pulls = 0;
            while !done.load(Ordering::Acquire) || pulls == 0 {
                let resp = c.pull(&[], 0);
                // Every block holds the same step: the one before the next to push, or
                // the one before that while the next is being applied.
                let first = wire::decode(&resp.blocks[0].values)[0];
                let applied = (-first) as u64;
                assert!(
                    applied + 1 == resp.next_step || applied + 2 == resp.next_step,
                    "pull {pulls}: step {applied} applied, the next step is {}",
                    resp.next_step
                );
                for b in &resp.blocks {
                    let v = wire::decode(&b.values);
                    assert!(
                        v.iter().all(|&x| x == first),
                        "pull {pulls}: block {} holds {}, block 0 holds {first}",
                        b.id,
                        v[0],
                    );
                }
                pulls += 1;
            }
        });
        assert_eq!(c.last_closed(), STEPS);
    }

    #[test]
    fn a_sync_step_whose_sum_overflows_is_dropped() {
        let c = core(Mode::sync(), 0, 1);
        let now = Instant::now();
        c.sync_set_members(["a".to_string(), "b".to_string()].into());
        // Each gradient is finite; their sum is not.
        for t in ["a", "b"] {
            let p = c.validate_push(push(&c, t, 1, 1, 3e38, &[3])).unwrap();
            assert_eq!(c.sync_push(&p, now).unwrap(), Admit::Join { step: 1 });
        }
        assert_eq!(c.last_closed(), 1, "the step is over");
        assert!(all(&c).iter().all(|&v| v == 0.0), "{:?}", all(&c));
        assert_eq!(
            wire::decode(&c.pull_sparse(0, &[3], 1 << 20).unwrap()),
            vec![0.0, 0.0]
        );
        assert_eq!(c.counters.nonfinite_rejected.load(Ordering::Relaxed), 1);
        // The next step applies as usual.
        for t in ["a", "b"] {
            let p = c.validate_push(push(&c, t, 1, 2, 1.0, &[3])).unwrap();
            c.sync_push(&p, now).unwrap();
        }
        assert_eq!(c.last_closed(), 2);
        assert!(all(&c).iter().all(|&v| v == -1.0), "{:?}", all(&c));
        // Async: a row repeated within one push may sum past the range too.
        let c = core(Mode::Async, 0, 1);
        let p = c
            .validate_push(push(&c, "t", 1, 1, 3e38, &[5, 5, 7]))
            .unwrap();
        assert!(c.apply_async(&p).unwrap().applied);
        let rows = wire::decode(&c.pull_sparse(0, &[5, 7], 1 << 20).unwrap());
        assert_eq!(&rows[..2], &[0.0, 0.0], "row 5 left as it was");
        assert_eq!(&rows[2..], &[-3e38, -3e38]);
        assert_eq!(c.counters.nonfinite_rejected.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn snapshots_restore_the_same_state() {
        let c = core(Mode::Async, 1, 2);
        let rows: Vec<u64> = (0..50u64)
            .filter(|&r| c.layout().row_shard(r) == 1)
            .collect();
        for s in 1..4 {
            let p = c
                .validate_push(push(&c, "t", 1, s, s as f32, &rows))
                .unwrap();
            c.apply_async(&p).unwrap();
        }
        let snap = c.snapshot(3);
        let r = ShardCore::restore(snap.clone(), 10, Arc::default()).unwrap();
        assert_eq!(r.snapshot(3), snap);
        assert_eq!(r.updates(), 3);
        assert_eq!(r.restored_from(), 3);
        // Versions of another incarnation are ignored by pulls.
        let known: Vec<u64> = c.pull(&[], 0).blocks.iter().map(|b| b.version).collect();
        assert!(c.pull(&known, 9).blocks.is_empty());
        assert_eq!(r.pull(&known, 9).blocks.len(), known.len());
    }

    #[test]
    fn init_is_idempotent_and_checks_the_spec() {
        let s = Shard::new(0, 2, 1, Arc::default());
        assert!(matches!(s.core(), Err(PsError::Uninitialised(0))));
        let sp = spec(Mode::Async, OptimizerConfig::sgd(0.1));
        let layout = Layout::new(sp.clone(), 2).unwrap();
        let blocks: Vec<pb::DenseBlock> = layout
            .shard_blocks(0)
            .iter()
            .map(|&id| pb::DenseBlock {
                id,
                version: 0,
                values: wire::encode(&vec![1.0; layout.block(id).unwrap().len]),
            })
            .collect();
        let req = |blocks: Vec<pb::DenseBlock>, spec: &ModelSpec| pb::InitRequest {
            shard: 0,
            shards: 2,
            trainer: "t".into(),
            spec_json: spec.to_json(),
            blocks,
        };
        assert_eq!(s.init(req(blocks[..1].to_vec(), &sp)).unwrap(), (false, 1));
        assert!(s.finish_init().is_err(), "a block is missing");
        assert_eq!(s.init(req(blocks[1..].to_vec(), &sp)).unwrap(), (false, 0));
        assert!(!s.finish_init().unwrap());
        assert!(s.finish_init().unwrap());
        assert_eq!(s.init(req(Vec::new(), &sp)).unwrap(), (true, 0));
        let other = spec(Mode::sync(), OptimizerConfig::sgd(0.1));
        assert!(matches!(
            s.init(req(Vec::new(), &other)),
            Err(PsError::SpecMismatch(_))
        ));
        let wrong = pb::InitRequest {
            shard: 1,
            ..req(Vec::new(), &sp)
        };
        assert!(matches!(s.init(wrong), Err(PsError::WrongShard { .. })));
        assert!(
            s.core()
                .unwrap()
                .dense_values("w")
                .iter()
                .all(|(_, v)| v.iter().all(|&x| x == 1.0))
        );
    }
}
