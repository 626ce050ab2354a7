//! The queue's types: tasks and their states, the queue-wide [`Meta`] record and its
//! [`QueueCounters`], the configuration (with the adaptive [`TimeoutPolicy`]), and what
//! the queue answers: [`GetTask`], [`Ack`], [`Reject`], [`Changes`], [`StateCounts`].
//!
//! [`Task`] and [`Meta`] are the durable records (serialized into etcd as they are).

use serde::{Deserialize, Serialize};

/// Milliseconds on the caller's clock.
pub type Millis = u64;

/// At most this many permanently failed tasks are kept for reports (the counters keep
/// counting past it).
pub const MAX_FAILED_REPORTED: usize = 1000;

/// Longest failure reason kept in a record, in bytes (a longer one is cut at a character
/// boundary and marked with `...`; control characters become spaces, so JSON escapes
/// at most double it). With [`MAX_FAILED_REPORTED`] it bounds the [`Meta`] record to
/// well under one etcd transaction (`store::MAX_BYTES_PER_TXN`).
pub const MAX_REASON_BYTES: usize = 256;

/// `reason` as a record keeps it: at most [`MAX_REASON_BYTES`], no control characters.
pub fn bounded_reason(reason: &str) -> String {
    let (kept, cut) = if reason.len() <= MAX_REASON_BYTES {
        (reason, false)
    } else {
        let mut end = MAX_REASON_BYTES - 3;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        (&reason[..end], true)
    };
    let mut out: String = kept
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if cut {
        out.push_str("...");
    }
    out
}

/// What a task reads: a run of consecutive chunks of one RecordIO file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskSpec {
    /// Deterministic id from the file and chunk range (see [`TaskSpec::make_id`]).
    pub id: String,
    /// Index of the file in the dataset's sorted file list.
    pub file: u32,
    /// First chunk (inclusive).
    pub chunk_begin: u32,
    /// Last chunk (exclusive).
    pub chunk_end: u32,
    /// Records in those chunks.
    pub records: u64,
    /// Byte offset of the first chunk in the file.
    #[serde(default)]
    pub offset_begin: u64,
    /// Byte offset just past the last chunk.
    #[serde(default)]
    pub offset_end: u64,
}

impl TaskSpec {
    /// The id of the task over chunks `begin..end` of file `file`: unique, and sorts in
    /// dataset order up to 100,000 files (past that, files from 100,000 on sort among the
    /// others; a task's index is its position in id order, the same for every master).
    pub fn make_id(file: u32, begin: u32, end: u32) -> String {
        format!("{file:05}-{begin:07}-{end:07}")
    }
}

/// Where a task is in the current pass.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum TaskState {
    /// Waiting to be dispatched.
    Todo,
    /// Leased to a trainer until `deadline`.
    Pending {
        /// The trainer holding the lease.
        trainer: String,
        /// When it was dispatched.
        since: Millis,
        /// When the lease times out unless finished, failed or released.
        deadline: Millis,
        /// The trainer's request number that leased it: a retry of that request gets
        /// this task again instead of a second one.
        #[serde(default)]
        request: u64,
    },
    /// Its records were trained in this pass.
    Done,
    /// Failed more than `max_failures` times in this pass; `Task::last_error` says why.
    Failed,
}

/// A task with its state: the value stored under `tasks/<id>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Task {
    /// What it reads.
    pub spec: TaskSpec,
    /// The pass its state belongs to.
    pub pass: u32,
    /// Its state in that pass.
    #[serde(flatten)]
    pub state: TaskState,
    /// Bumped on every dispatch and revocation.
    pub generation: u64,
    /// Failures in this pass reported by trainers (bad data, ...).
    pub failures: u32,
    /// Times in this pass its holder was lost or timed out with it: counted apart from
    /// failures, so that chaos among trainers does not fail healthy tasks (the bound
    /// still stops a task that kills every trainer that takes it).
    #[serde(default)]
    pub losses: u32,
    /// Dispatches in this pass (a rewind counts as one: the shards may hold part of an
    /// attempt from before it). Only a first dispatch may group its batches into pushes
    /// freely (`LeasedTask::first_attempt`).
    #[serde(default)]
    pub dispatches: u32,
    /// The reason of the last failure in this pass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// When done by a trainer in this pass: per pserver shard, the oldest incarnation
    /// that answered one of its pushes (0: none), as the acknowledgement said. A restore
    /// of a shard's incarnation `n` lacks nothing of a task whose pushes to it were all
    /// answered by `n` or later (empty: unknown).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub answered: Vec<u64>,
    /// Where its next attempt starts: a draining holder handed it back after its first
    /// batches were applied on every shard. Kept until the task is done, trained again
    /// whole (a rewind), or its pass ends. Boxed: most tasks have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume: Option<Box<Resume>>,
}

impl Task {
    /// The task in a new pass `pass`: todo (or failed for good in it, `failed`), with
    /// nothing of the pass before (failures, losses, dispatches, the last error, a
    /// resume point).
    pub(super) fn enter_pass(&mut self, pass: u32, failed: bool) {
        self.pass = pass;
        self.state = if failed {
            TaskState::Failed
        } else {
            TaskState::Todo
        };
        self.failures = 0;
        self.losses = 0;
        self.dispatches = 0;
        self.last_error = None;
        self.resume = None;
    }
}

/// The batches of a task applied before its holder handed it back (see
/// `edl_master_api::Resume`): its next attempt trains from batch `batch` on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resume {
    /// Batches applied, from the task's first.
    pub batch: u32,
    /// Their records.
    pub records: u64,
    /// Per shard, the oldest incarnation that answered their pushes (0: none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub answered: Vec<u64>,
}

/// Counters of the queue's life, kept across failovers (they are part of [`Meta`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct QueueCounters {
    /// Tasks handed to trainers.
    pub dispatched: u64,
    /// Tasks finished (a record set trained).
    pub finished: u64,
    /// Failure events: explicit failures, lost trainers, timeouts.
    pub failures: u64,
    /// Tasks put back to todo after a failure event.
    pub requeued: u64,
    /// Leases that timed out.
    pub timeouts: u64,
    /// Pending tasks revoked because their trainer's registration vanished.
    pub trainer_lost: u64,
    /// Tasks handed back by draining trainers (not failures).
    pub released: u64,
    /// Completions or failures naming an old generation, rejected.
    pub stale_rejected: u64,
    /// Records trained by finished tasks.
    pub records_trained: u64,
    /// Records a trainer reported it had trained before handing back or failing a task
    /// that was then dispatched again: trained twice.
    pub duplicate_records: u64,
    /// Tasks handed back by draining trainers with the batches they applied: the next
    /// attempt resumed after them (part of `released`).
    pub resumed: u64,
    /// Records of those batches: trained once, not again (in `records_trained`).
    pub resumed_records: u64,
    /// Tasks trained again because a restored pserver shard lacked their updates (or a
    /// trainer found its pushes answered by a shard restored since). Their first
    /// training is in `records_trained` too: without failed tasks, `records_trained`
    /// is every pass's records plus `recomputed_records`.
    pub recomputed: u64,
    /// Their records.
    pub recomputed_records: u64,
    /// Records of tasks cut off mid-way by a lost or hung trainer and dispatched again:
    /// an upper bound of what may have been trained twice (the holder cannot say).
    pub cutoff_records: u64,
    /// Tasks failed for good.
    pub failed_tasks: u64,
    /// Records of tasks failed for good: not trained in their pass.
    pub lost_records: u64,
    /// Passes completed.
    pub passes_completed: u64,
    /// Times a master rebuilt this queue from durable state (failovers and restarts).
    pub restores: u64,
}

/// A task that failed for good, for reports.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedTask {
    /// The pass it failed in.
    pub pass: u32,
    /// The task id.
    pub id: String,
    /// Its records (not trained in that pass).
    pub records: u64,
    /// The last failure's reason.
    pub reason: String,
}

/// The queue-wide durable record: current pass, whether the job is finished, counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Meta {
    /// The current pass (0-based).
    pub pass: u32,
    /// Every pass is complete.
    pub finished: bool,
    /// Life counters.
    pub counters: QueueCounters,
    /// Tasks failed for good, oldest first, at most [`MAX_FAILED_REPORTED`]. Stored
    /// apart (`job/failures`, written only when it changes), not in the queue record,
    /// which every batch rewrites; a queue record written before that holds it inline.
    #[serde(default, skip_serializing)]
    pub failed: Vec<FailedTask>,
    /// Per pserver shard, the incarnation whose restore was applied (see
    /// [`Queue::rewind`](super::Queue::rewind)).
    #[serde(default)]
    pub restores: std::collections::BTreeMap<u32, u64>,
}

/// A task lease that ran past its deadline ([`Queue::tick`](super::Queue::tick)): the
/// task went back to todo, and its holder, still registered (a lost trainer's tasks go
/// back at once), reported nothing for the whole timeout: stuck, or far slower than the
/// job's other tasks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expired {
    /// The task.
    pub task: String,
    /// The trainer that held it.
    pub trainer: String,
    /// How long it held it.
    pub held_ms: Millis,
}

/// How long a lease lasts: a multiple of a high percentile of observed task durations,
/// within `[floor, ceiling]`, and `initial` until enough durations were observed. Trainer
/// loss is detected through etcd leases within seconds; this timeout is only the backstop
/// for a trainer that is alive but hung.
#[derive(Clone, Debug, PartialEq)]
pub struct TimeoutPolicy {
    /// Lease length before `min_samples` durations are known.
    pub initial: Millis,
    /// Shortest lease.
    pub floor: Millis,
    /// Longest lease.
    pub ceiling: Millis,
    /// Multiple of the percentile.
    pub multiple: f64,
    /// The percentile of task durations, in (0, 1].
    pub percentile: f64,
    /// Durations needed before the adaptive value is used.
    pub min_samples: usize,
    /// How many recent durations are kept.
    pub window: usize,
}

impl Default for TimeoutPolicy {
    fn default() -> Self {
        TimeoutPolicy {
            initial: 300_000,
            floor: 10_000,
            ceiling: 3_600_000,
            multiple: 4.0,
            percentile: 0.95,
            min_samples: 5,
            window: 256,
        }
    }
}

/// Queue configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct QueueConfig {
    /// A task failing more than this many times in a pass fails for good.
    pub max_failures: u32,
    /// A task lost more than this many times in a pass fails for good: its holder lost
    /// or timed out, or its training taken away by a pserver shard's restore (so that a
    /// task longer than the gap between restores is not trained again forever).
    pub max_losses: u32,
    /// Passes over the dataset; the job finishes after the last.
    pub passes: u32,
    /// Lease timeouts.
    pub timeout: TimeoutPolicy,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            max_failures: 3,
            max_losses: 10,
            passes: 1,
            timeout: TimeoutPolicy::default(),
        }
    }
}

/// The answer to a trainer asking for work.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GetTask {
    /// A task leased to the trainer.
    Task(Task),
    /// Nothing to dispatch now, but tasks of this pass are still pending elsewhere; ask
    /// again (the service long-polls).
    Wait,
    /// The pass the trainer asked for is over; the current one is `next_pass`.
    PassFinished {
        /// The current pass.
        next_pass: u32,
    },
    /// Every pass is complete.
    JobFinished,
}

/// A completion, failure or hand-back that was accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ack {
    /// It changed the task.
    Applied,
    /// The same report was already applied (a retry): nothing changed.
    AlreadyApplied,
}

/// A completion, failure or hand-back that was rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Reject {
    /// No task has this id.
    #[error("unknown task {0}")]
    UnknownTask(String),
    /// The report names another generation than the task's: the lease was revoked or
    /// re-dispatched since. Never applied; counted in `stale_rejected`.
    #[error("stale report for task {id}: generation {got}, current {current}")]
    Stale {
        /// The task id.
        id: String,
        /// The generation in the report.
        got: u64,
        /// The task's generation.
        current: u64,
    },
    /// The generation matches but the task is not leased (for example it failed for good).
    #[error("task {id} is not pending (it is {state})")]
    NotPending {
        /// The task id.
        id: String,
        /// Its state.
        state: &'static str,
    },
}

/// What changed since the last [`Queue::take_changes`](super::Queue::take_changes): to be
/// made durable together.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Changes {
    /// Tasks whose record changed.
    pub tasks: Vec<Task>,
    /// The queue record, when it changed.
    pub meta: Option<Meta>,
    /// The list of tasks failed for good (`Meta::failed`), when it changed.
    pub failures: Option<Vec<FailedTask>>,
    /// The failed-task records that changed (`job/failed/<pass>`).
    pub failed: Vec<edl_job::FailedRecord>,
}

impl Changes {
    /// Nothing to persist.
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
            && self.meta.is_none()
            && self.failures.is_none()
            && self.failed.is_empty()
    }
}

/// Task counts by state, for `Status`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateCounts {
    /// Todo tasks.
    pub todo: usize,
    /// Pending tasks.
    pub pending: usize,
    /// Done tasks.
    pub done: usize,
    /// Failed tasks.
    pub failed: usize,
}
