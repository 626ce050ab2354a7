//! The parameters of one shard and the update logic, on the shard's own types: no
//! protobuf, sockets or etcd (the server converts requests and replies at its edge).
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
//!
//! Layout (each part adds its methods to [`ShardCore`]):
//! - `storage`: blocks and rows in lock stripes, building a shard, reading its values.
//! - `push`: a push as received ([`RawPush`]) and validated ([`Push`]).
//! - `ledger`: which task batches the parameters contain: each applied at most once,
//!   across retries, stale steps, trainers and restores; what a restore tells the master.
//! - `dedup`: the window of steps applied per push session (async retries of pushes
//!   without an origin).
//! - `async_apply`: async mode: each push applied as it comes, at most once.
//! - `sync_apply`: sync mode: pushes summed into steps, the mean applied when a step
//!   closes.
//! - `tasks`: `TaskDone` (a task recorded as contained) and the ledger's summary.
//! - `ops`: the shard's changes as ops in the order its primary decided them, what
//!   a backup applies, and their bytes on the replication stream.
//! - `pull`: the dense blocks that changed, and sparse rows.
//! - `snapshot`: copies for checkpoints, restore from one, and where sync-mode
//!   snapshots go.
//! - `lifecycle`: a shard before and after initialisation ([`Shard`]: `Init`,
//!   `FinishInit`).
//! - `testutil` (tests only): a small model, a shard of it, pushes.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};

use tokio::sync::watch;

use crate::layout::Layout;
use crate::optim::Optimizer;
use crate::sync::SyncState;

mod async_apply;
mod dedup;
mod ledger;
mod lifecycle;
mod ops;
mod pull;
mod push;
mod snapshot;
mod storage;
mod sync_apply;
mod tasks;
#[cfg(test)]
pub(crate) mod testutil;

pub use dedup::DEDUP_WINDOW;
pub use ledger::{Ledger, LedgerError, LedgerMark, Origin};
pub use lifecycle::{InitBlocks, Shard};
pub use ops::{OpStream, ShardOp};
pub use pull::{PullReply, VersionedBlock};
pub use push::{BlockValues, Push, PushReply, RawPush, SparseUpdate, TableRows};
pub use snapshot::{CheckpointHooks, SnapshotSlot};
pub(crate) use sync_apply::out_of_range;

use dedup::Dedup;
use storage::{Block, Table};

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Counters of one shard (reported by `Status`).
#[derive(Debug, Default)]
pub struct ShardCounters {
    /// Pushes applied (async) or accumulated (sync).
    pub pushes_applied: AtomicU64,
    /// Retried pushes recognised and not applied again.
    pub duplicate_pushes: AtomicU64,
    /// Pushes refused because another attempt at their task applied part of their
    /// batches (`Overlap`).
    pub overlap_refused: AtomicU64,
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
    /// Tasks recorded as complete (`TaskDone`).
    pub tasks_done: AtomicU64,
    /// `TaskDone`s refused because the task's pushes went to an earlier incarnation.
    pub tasks_rewound: AtomicU64,
    /// Checkpoint files written.
    pub checkpoints_written: AtomicU64,
    /// Checkpoint writes that failed.
    pub checkpoints_failed: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// An initialised shard. Each part of this module adds the methods of one concern; the
/// state is laid out in `storage`.
#[derive(Debug)]
pub struct ShardCore {
    /// The model's layout over the shards.
    layout: Arc<Layout>,
    /// This shard's index.
    index: u32,
    /// The claim revision this copy of the shard lives under.
    incarnation: u64,
    optimizer: Optimizer,
    /// Dense blocks in the shard's order, each under its own lock.
    blocks: Vec<Mutex<Block>>,
    /// Sparse tables, their rows in lock stripes.
    tables: Vec<Table>,
    /// Updates applied (drives the learning-rate schedule).
    updates: AtomicU64,
    /// Held while a change is decided and given its place in the replication stream
    /// (`ops`): the marks of the ledger and the deduplication table, the update
    /// number, the op.
    order: Mutex<()>,
    /// Where a primary's ops go (the replication stream); unset: not replicated.
    stream: std::sync::OnceLock<OpStream>,
    /// Async mode: the steps applied per push session (pushes without an origin).
    dedup: Mutex<Dedup>,
    /// The task batches the parameters contain. Async: marked under `step_lock` held for
    /// reading while the push is applied (a snapshot holds it for writing); sync: marked
    /// when their step is applied.
    ledger: Mutex<Ledger>,
    /// Sync mode: the origins of the pushes that joined a step not yet applied, with
    /// their step.
    open_origins: Mutex<Vec<(u64, Origin)>>,
    /// Sync mode: the step state machine; `None` in async mode.
    sync: Option<Mutex<SyncState>>,
    /// Sync mode: held for writing while a step is applied, for reading by pulls and
    /// snapshots. Async mode: held for reading while a push is applied, for writing by a
    /// snapshot (so that a snapshot holds every push whole or not at all, as its ledger
    /// says).
    step_lock: RwLock<()>,
    /// Sync mode: whether the registry members were given at least once.
    members_seeded: AtomicBool,
    /// Sync mode: the last step applied, for the pushes waiting on it.
    closed_tx: watch::Sender<u64>,
    /// When sync-mode snapshots are taken, and where they go.
    checkpoints: Arc<CheckpointHooks>,
    /// The step of the checkpoint this shard was restored from (0: none).
    restored_from: u64,
    /// The incarnation whose final checkpoint this shard was restored from (every push
    /// it answered is here); 0: none.
    holds_all_of: u64,
    /// Counters.
    pub counters: ShardCounters,
}
