//! The task queue as a pure state machine.
//!
//! The queue owns every task of a dataset and moves each through
//! `todo -> pending -> done | failed` once per pass. It does no I/O and reads no clock:
//! callers pass the time (milliseconds of any monotonic-enough clock) and, after each
//! batch of events, collect the changed state with [`Queue::take_changes`] and make it
//! durable (one etcd transaction for the whole batch: group commit) before replying.
//!
//! Invariants (checked by the property tests below):
//! - every task is in exactly one state, and the internal indexes (todo order, pending
//!   set, tasks per trainer) agree with the tasks;
//! - a task's generation only grows: it is bumped on every dispatch and every revocation
//!   (requeue, hand-back), so a completion from an earlier holder is stale;
//! - a stale completion is rejected, counted and changes nothing else;
//! - a pass ends exactly when no task is todo or pending, including when its last task
//!   failed for good; failed tasks are reported and never block the pass;
//! - the state rebuilt from what was made durable ([`Queue::restore`]) equals the live
//!   state, except that pending leases are re-armed with a fresh deadline.
//!
//! Passes do not rewrite every task: when a pass ends only the [`Meta`] record changes
//! (its `pass` grows); a task whose stored `pass` is older than `Meta::pass` is todo in
//! the current pass.

use std::collections::{BTreeSet, HashMap, VecDeque};

use serde::{Deserialize, Serialize};

/// Milliseconds on the caller's clock.
pub type Millis = u64;

/// At most this many permanently failed tasks are kept for reports (the counters keep
/// counting past it).
pub const MAX_FAILED_REPORTED: usize = 1000;

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
    /// The id of the task over chunks `begin..end` of file `file`: sorts in dataset order.
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
    /// The reason of the last failure in this pass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
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
    /// Tasks failed for good, oldest first, at most [`MAX_FAILED_REPORTED`].
    pub failed: Vec<FailedTask>,
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
    /// A task whose holder is lost (or times out) more than this many times in a pass
    /// fails for good.
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

/// What changed since the last [`Queue::take_changes`]: to be made durable together.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Changes {
    /// Tasks whose record changed.
    pub tasks: Vec<Task>,
    /// The queue record, when it changed.
    pub meta: Option<Meta>,
}

impl Changes {
    /// Nothing to persist.
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty() && self.meta.is_none()
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

/// The task queue.
#[derive(Debug, Clone)]
pub struct Queue {
    cfg: QueueConfig,
    meta: Meta,
    tasks: Vec<Task>,
    index: HashMap<String, usize>,
    todo: VecDeque<usize>,
    pending: BTreeSet<usize>,
    by_trainer: HashMap<String, BTreeSet<usize>>,
    durations: VecDeque<Millis>,
    dirty: BTreeSet<usize>,
    meta_dirty: bool,
}

impl Queue {
    /// A fresh queue over `specs` (pass 0, every task todo, in the given order). Ids must
    /// be unique; duplicates are dropped (the first wins).
    pub fn new(cfg: QueueConfig, specs: Vec<TaskSpec>) -> Queue {
        let mut q = Queue::empty(cfg, Meta::default());
        for spec in specs {
            if q.index.contains_key(&spec.id) {
                continue;
            }
            let i = q.tasks.len();
            q.index.insert(spec.id.clone(), i);
            q.tasks.push(Task {
                spec,
                pass: 0,
                state: TaskState::Todo,
                generation: 0,
                failures: 0,
                losses: 0,
                last_error: None,
            });
            q.todo.push_back(i);
            q.dirty.insert(i);
        }
        q.meta_dirty = true;
        q.check_pass_end();
        q
    }

    /// Rebuilds a queue from its durable records (after a failover or restart). Tasks
    /// stored with an older pass are todo in the current one; pending leases keep their
    /// holder and get a fresh deadline from `now` (the old leader's clock is not ours).
    pub fn restore(cfg: QueueConfig, meta: Meta, mut tasks: Vec<Task>, now: Millis) -> Queue {
        tasks.sort_by(|a, b| a.spec.id.cmp(&b.spec.id));
        tasks.dedup_by(|a, b| a.spec.id == b.spec.id);
        let mut q = Queue::empty(cfg, meta);
        q.meta.counters.restores += 1;
        q.meta_dirty = true;
        let timeout = q.timeout();
        for mut t in tasks {
            let i = q.tasks.len();
            if q.meta.finished {
                // Nothing is dispatched any more; keep the records as they are.
                q.index.insert(t.spec.id.clone(), i);
                q.tasks.push(t);
                continue;
            }
            if t.pass < q.meta.pass {
                t.pass = q.meta.pass;
                t.state = TaskState::Todo;
                t.failures = 0;
                t.losses = 0;
                t.losses = 0;
                t.last_error = None;
                q.dirty.insert(i);
            }
            match &mut t.state {
                TaskState::Todo => q.todo.push_back(i),
                TaskState::Pending {
                    trainer,
                    since,
                    deadline,
                    ..
                } => {
                    *since = now;
                    *deadline = now.saturating_add(timeout);
                    q.pending.insert(i);
                    q.by_trainer.entry(trainer.clone()).or_default().insert(i);
                }
                TaskState::Done | TaskState::Failed => {}
            }
            q.index.insert(t.spec.id.clone(), i);
            q.tasks.push(t);
        }
        q.check_pass_end();
        q
    }

    fn empty(cfg: QueueConfig, meta: Meta) -> Queue {
        Queue {
            cfg,
            meta,
            tasks: Vec::new(),
            index: HashMap::new(),
            todo: VecDeque::new(),
            pending: BTreeSet::new(),
            by_trainer: HashMap::new(),
            durations: VecDeque::new(),
            dirty: BTreeSet::new(),
            meta_dirty: false,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &QueueConfig {
        &self.cfg
    }

    /// The current pass.
    pub fn pass(&self) -> u32 {
        self.meta.pass
    }

    /// Whether every pass is complete.
    pub fn is_finished(&self) -> bool {
        self.meta.finished
    }

    /// The queue record (pass, counters, failed tasks).
    pub fn meta(&self) -> &Meta {
        &self.meta
    }

    /// Every task, in id order for a fresh queue.
    pub fn tasks(&self) -> &[Task] {
        &self.tasks
    }

    /// A task by id.
    pub fn task(&self, id: &str) -> Option<&Task> {
        self.index.get(id).map(|&i| &self.tasks[i])
    }

    /// Trainers holding at least one lease.
    pub fn holders(&self) -> impl Iterator<Item = &str> {
        self.by_trainer.keys().map(String::as_str)
    }

    /// Task counts by state in the current pass.
    pub fn counts(&self) -> StateCounts {
        let mut c = StateCounts {
            todo: self.todo.len(),
            pending: self.pending.len(),
            ..StateCounts::default()
        };
        for t in &self.tasks {
            match t.state {
                TaskState::Done => c.done += 1,
                TaskState::Failed => c.failed += 1,
                _ => {}
            }
        }
        c
    }

    /// The current lease timeout.
    pub fn timeout(&self) -> Millis {
        let p = &self.cfg.timeout;
        if self.durations.len() < p.min_samples.max(1) {
            return p.initial.clamp(p.floor, p.ceiling.max(p.floor));
        }
        let mut d: Vec<Millis> = self.durations.iter().copied().collect();
        d.sort_unstable();
        let rank = ((d.len() as f64) * p.percentile.clamp(0.0, 1.0)).ceil() as usize;
        let q = d[rank.clamp(1, d.len()) - 1];
        let t = (q as f64 * p.multiple.max(1.0)).min(u64::MAX as f64) as Millis;
        t.clamp(p.floor, p.ceiling.max(p.floor))
    }

    /// The earliest pending deadline, for the caller's timer.
    pub fn next_deadline(&self) -> Option<Millis> {
        self.pending
            .iter()
            .filter_map(|&i| match self.tasks[i].state {
                TaskState::Pending { deadline, .. } => Some(deadline),
                _ => None,
            })
            .min()
    }

    /// A trainer asks for a task of `pass`. `request` numbers the trainer's requests
    /// (0 = unnumbered): a retried request gets the task already leased for it.
    pub fn get_task(&mut self, trainer: &str, pass: u32, request: u64, now: Millis) -> GetTask {
        if request != 0
            && let Some(held) = self.by_trainer.get(trainer)
            && let Some(&i) = held.iter().find(|&&i| {
                matches!(&self.tasks[i].state, TaskState::Pending { request: r, .. } if *r == request)
            })
        {
            return GetTask::Task(self.tasks[i].clone());
        }
        if self.meta.finished {
            return GetTask::JobFinished;
        }
        if pass < self.meta.pass {
            return GetTask::PassFinished {
                next_pass: self.meta.pass,
            };
        }
        if pass > self.meta.pass {
            // A trainer cannot be ahead of the queue; it talks to a master whose view is
            // older than the one it saw. Let it wait for this one to catch up.
            return GetTask::Wait;
        }
        let Some(i) = self.todo.pop_front() else {
            return GetTask::Wait;
        };
        let deadline = now.saturating_add(self.timeout());
        let t = &mut self.tasks[i];
        t.generation += 1;
        t.state = TaskState::Pending {
            trainer: trainer.to_owned(),
            since: now,
            deadline,
            request,
        };
        self.pending.insert(i);
        self.by_trainer
            .entry(trainer.to_owned())
            .or_default()
            .insert(i);
        self.dirty.insert(i);
        self.bump(|c| c.dispatched += 1);
        GetTask::Task(self.tasks[i].clone())
    }

    /// Looks up a task for a report and checks its generation.
    fn check(&mut self, id: &str, generation: u64) -> Result<usize, Reject> {
        let Some(&i) = self.index.get(id) else {
            return Err(Reject::UnknownTask(id.to_owned()));
        };
        let current = self.tasks[i].generation;
        if generation != current {
            self.bump(|c| c.stale_rejected += 1);
            return Err(Reject::Stale {
                id: id.to_owned(),
                got: generation,
                current,
            });
        }
        Ok(i)
    }

    fn not_pending(&self, i: usize) -> Reject {
        let t = &self.tasks[i];
        Reject::NotPending {
            id: t.spec.id.clone(),
            state: match t.state {
                TaskState::Todo => "todo",
                TaskState::Pending { .. } => "pending",
                TaskState::Done => "done",
                TaskState::Failed => "failed",
            },
        }
    }

    /// A trainer trained every record of a task (`records` is what it counted).
    pub fn finished(
        &mut self,
        id: &str,
        generation: u64,
        records: u64,
        now: Millis,
    ) -> Result<Ack, Reject> {
        let i = self.check(id, generation)?;
        let since = match &self.tasks[i].state {
            TaskState::Pending { since, .. } => *since,
            // Same generation and done: a retried report whose reply was lost. After the
            // pass ended the task is todo again with the generation it finished with
            // (revocations bump it), which is the same retry.
            TaskState::Done | TaskState::Todo => return Ok(Ack::AlreadyApplied),
            TaskState::Failed => return Err(self.not_pending(i)),
        };
        self.unlease(i);
        self.tasks[i].state = TaskState::Done;
        self.dirty.insert(i);
        self.durations.push_back(now.saturating_sub(since));
        while self.durations.len() > self.cfg.timeout.window.max(1) {
            self.durations.pop_front();
        }
        self.bump(|c| {
            c.finished += 1;
            c.records_trained += records;
        });
        self.check_pass_end();
        Ok(Ack::Applied)
    }

    /// A trainer could not process a task (for example a corrupt chunk). `trained` is how
    /// many of its records it trained before giving up.
    pub fn failed(
        &mut self,
        id: &str,
        generation: u64,
        reason: &str,
        trained: u64,
    ) -> Result<Ack, Reject> {
        let i = self.check(id, generation)?;
        if !matches!(self.tasks[i].state, TaskState::Pending { .. }) {
            return Err(self.not_pending(i));
        }
        self.fail(i, reason, Redo::Reported(trained));
        self.check_pass_end();
        Ok(Ack::Applied)
    }

    /// A draining trainer hands a task back: not a failure; it is dispatched next.
    /// `trained` is how many of its records it trained.
    pub fn released(&mut self, id: &str, generation: u64, trained: u64) -> Result<Ack, Reject> {
        let i = self.check(id, generation)?;
        if !matches!(self.tasks[i].state, TaskState::Pending { .. }) {
            return Err(self.not_pending(i));
        }
        self.unlease(i);
        let t = &mut self.tasks[i];
        t.generation += 1;
        t.state = TaskState::Todo;
        self.todo.push_front(i);
        self.dirty.insert(i);
        self.bump(|c| {
            c.released += 1;
            c.duplicate_records += trained;
        });
        Ok(Ack::Applied)
    }

    /// A trainer's registration vanished (its etcd lease expired): every task it holds
    /// fails with reason "trainer lost" and goes back to todo at once. Returns their ids.
    pub fn trainer_lost(&mut self, trainer: &str) -> Vec<String> {
        let held: Vec<usize> = self
            .by_trainer
            .get(trainer)
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default();
        for &i in &held {
            self.bump(|c| c.trainer_lost += 1);
            self.fail(i, &format!("trainer lost: {trainer}"), Redo::CutOff);
        }
        self.check_pass_end();
        held.iter()
            .map(|&i| self.tasks[i].spec.id.clone())
            .collect()
    }

    /// Expires the leases whose deadline is at or before `now`. Returns their ids.
    pub fn tick(&mut self, now: Millis) -> Vec<String> {
        let expired: Vec<(usize, Millis, String)> = self
            .pending
            .iter()
            .filter_map(|&i| match &self.tasks[i].state {
                TaskState::Pending {
                    deadline,
                    since,
                    trainer,
                    ..
                } if *deadline <= now => Some((i, now.saturating_sub(*since), trainer.clone())),
                _ => None,
            })
            .collect();
        for (i, held, trainer) in &expired {
            self.bump(|c| c.timeouts += 1);
            let reason = format!(
                "timed out after {:.1}s on trainer {trainer}",
                *held as f64 / 1000.0
            );
            self.fail(*i, &reason, Redo::CutOff);
        }
        self.check_pass_end();
        expired
            .iter()
            .map(|(i, _, _)| self.tasks[*i].spec.id.clone())
            .collect()
    }

    /// What changed since the last call, to persist in one transaction.
    pub fn take_changes(&mut self) -> Changes {
        let tasks = std::mem::take(&mut self.dirty)
            .into_iter()
            .map(|i| self.tasks[i].clone())
            .collect();
        let meta = std::mem::take(&mut self.meta_dirty).then(|| self.meta.clone());
        Changes { tasks, meta }
    }

    fn bump(&mut self, f: impl FnOnce(&mut QueueCounters)) {
        f(&mut self.meta.counters);
        self.meta_dirty = true;
    }

    /// Removes a pending task from the lease indexes.
    fn unlease(&mut self, i: usize) {
        self.pending.remove(&i);
        if let TaskState::Pending { trainer, .. } = &self.tasks[i].state
            && let Some(set) = self.by_trainer.get_mut(trainer)
        {
            set.remove(&i);
            if set.is_empty() {
                self.by_trainer.remove(trainer);
            }
        }
    }

    /// A failure event on a pending task: back to todo, or failed for good past
    /// `max_failures`.
    fn fail(&mut self, i: usize, reason: &str, redo: Redo) {
        self.unlease(i);
        let (max_failures, max_losses) = (self.cfg.max_failures, self.cfg.max_losses);
        let pass = self.meta.pass;
        let t = &mut self.tasks[i];
        t.generation += 1;
        match redo {
            Redo::CutOff => t.losses += 1,
            Redo::Reported(_) => t.failures += 1,
        }
        t.last_error = Some(reason.to_owned());
        self.dirty.insert(i);
        let records = t.spec.records;
        if t.failures > max_failures || t.losses > max_losses {
            t.state = TaskState::Failed;
            let failed = FailedTask {
                pass,
                id: t.spec.id.clone(),
                records,
                reason: reason.to_owned(),
            };
            tracing::warn!(task = %failed.id, pass, reason, "task failed for good");
            self.meta.failed.push(failed);
            if self.meta.failed.len() > MAX_FAILED_REPORTED {
                self.meta.failed.remove(0);
            }
            self.bump(|c| {
                c.failures += 1;
                c.failed_tasks += 1;
                c.lost_records += records;
            });
        } else {
            t.state = TaskState::Todo;
            self.todo.push_back(i);
            self.bump(|c| {
                c.failures += 1;
                c.requeued += 1;
                match redo {
                    Redo::Reported(n) => c.duplicate_records += n,
                    Redo::CutOff => c.cutoff_records += records,
                }
            });
        }
    }

    /// Ends the pass when nothing is todo or pending.
    fn check_pass_end(&mut self) {
        if self.meta.finished || !self.todo.is_empty() || !self.pending.is_empty() {
            return;
        }
        let ended = self.meta.pass;
        self.meta.counters.passes_completed += 1;
        self.meta_dirty = true;
        if ended.saturating_add(1) >= self.cfg.passes {
            self.meta.finished = true;
            tracing::info!(pass = ended, "last pass finished");
            return;
        }
        self.meta.pass = ended + 1;
        tracing::info!(pass = ended, next = self.meta.pass, "pass finished");
        for (i, t) in self.tasks.iter_mut().enumerate() {
            t.pass = self.meta.pass;
            t.state = TaskState::Todo;
            t.failures = 0;
            t.losses = 0;
            t.last_error = None;
            self.todo.push_back(i);
        }
        if self.tasks.is_empty() {
            // An empty dataset finishes every pass at once.
            self.check_pass_end();
        }
    }
}

/// How a requeued task's already-trained records are counted.
#[derive(Clone, Copy, Debug)]
enum Redo {
    /// The trainer said how many it trained.
    Reported(u64),
    /// The trainer was cut off; all of the task's records are an upper bound.
    CutOff,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn specs(n: u32) -> Vec<TaskSpec> {
        (0..n)
            .map(|i| TaskSpec {
                id: TaskSpec::make_id(i / 4, i % 4, i % 4 + 1),
                file: i / 4,
                chunk_begin: i % 4,
                chunk_end: i % 4 + 1,
                records: 10 + u64::from(i),
                offset_begin: 0,
                offset_end: 0,
            })
            .collect()
    }

    fn cfg(passes: u32, max_failures: u32) -> QueueConfig {
        QueueConfig {
            passes,
            max_failures,
            max_losses: max_failures,
            ..QueueConfig::default()
        }
    }

    fn take(q: &mut Queue, trainer: &str, now: Millis) -> Task {
        let pass = q.pass();
        match q.get_task(trainer, pass, 0, now) {
            GetTask::Task(t) => t,
            other => panic!("expected a task, got {other:?}"),
        }
    }

    #[test]
    fn one_pass_dispatches_every_task_once_then_finishes() {
        let mut q = Queue::new(cfg(1, 3), specs(5));
        let mut seen = BTreeSet::new();
        for n in 0..5 {
            let t = take(&mut q, "a", n);
            assert_eq!(t.generation, 1);
            assert!(seen.insert(t.spec.id.clone()));
        }
        assert_eq!(q.get_task("a", 0, 0, 10), GetTask::Wait);
        for id in seen.clone() {
            assert_eq!(q.finished(&id, 1, 7, 20), Ok(Ack::Applied));
        }
        assert!(q.is_finished());
        assert_eq!(q.get_task("a", 0, 0, 30), GetTask::JobFinished);
        assert_eq!(q.meta().counters.records_trained, 35);
        assert_eq!(q.meta().counters.passes_completed, 1);
    }

    #[test]
    fn lost_trainers_do_not_use_up_a_tasks_failure_budget() {
        let mut q = Queue::new(
            QueueConfig {
                max_losses: 4,
                ..cfg(1, 1)
            },
            specs(1),
        );
        // Four holders die with it: still retried (failures stay 0).
        for n in 0..4 {
            let t = take(&mut q, &format!("t{n}"), 0);
            q.trainer_lost(&format!("t{n}"));
            assert_eq!(q.tasks[0].failures, 0);
            assert_eq!(q.tasks[0].losses, n + 1);
            assert!(matches!(q.tasks[0].state, TaskState::Todo), "{t:?}");
        }
        // The fifth loss exceeds max_losses: a task that kills every trainer is stopped.
        take(&mut q, "t4", 0);
        q.trainer_lost("t4");
        assert!(matches!(q.tasks[0].state, TaskState::Failed));
        assert!(q.is_finished());
    }

    #[test]
    fn passes_advance_and_old_pass_requests_are_told() {
        let mut q = Queue::new(cfg(2, 3), specs(2));
        let a = take(&mut q, "a", 0);
        let b = take(&mut q, "b", 0);
        q.finished(&a.spec.id, a.generation, 1, 1).unwrap();
        q.finished(&b.spec.id, b.generation, 1, 1).unwrap();
        assert_eq!(q.pass(), 1);
        assert_eq!(
            q.get_task("a", 0, 0, 2),
            GetTask::PassFinished { next_pass: 1 }
        );
        let a2 = take(&mut q, "a", 3);
        assert_eq!(a2.pass, 1);
        assert_eq!(a2.generation, 2);
        // A retried completion of pass 0 is recognised as already applied.
        assert_eq!(
            q.finished(&b.spec.id, b.generation, 1, 4),
            Ok(Ack::AlreadyApplied)
        );
    }

    #[test]
    fn stale_finish_after_redispatch_is_rejected_and_counted() {
        let mut q = Queue::new(cfg(1, 3), specs(1));
        let t = take(&mut q, "a", 0);
        assert_eq!(q.trainer_lost("a"), vec![t.spec.id.clone()]);
        let t2 = take(&mut q, "b", 1);
        assert!(t2.generation > t.generation);
        let before = q.task(&t.spec.id).cloned();
        assert!(matches!(
            q.finished(&t.spec.id, t.generation, 10, 2),
            Err(Reject::Stale { .. })
        ));
        assert_eq!(q.task(&t.spec.id).cloned(), before);
        assert_eq!(q.meta().counters.stale_rejected, 1);
        assert_eq!(
            q.finished(&t2.spec.id, t2.generation, 10, 3),
            Ok(Ack::Applied)
        );
        assert_eq!(q.meta().counters.cutoff_records, 10);
        assert!(q.is_finished());
    }

    #[test]
    fn a_task_failing_past_max_failures_fails_and_the_pass_still_ends() {
        let mut q = Queue::new(cfg(2, 2), specs(2));
        let good = take(&mut q, "a", 0);
        q.finished(&good.spec.id, good.generation, 1, 1).unwrap();
        for attempt in 0..3 {
            let t = take(&mut q, "a", 2);
            assert_eq!(t.failures, attempt);
            q.failed(&t.spec.id, t.generation, "corrupt chunk in f.recordio", 0)
                .unwrap();
        }
        // Third failure > max_failures = 2: failed for good, pass 0 over.
        assert_eq!(q.pass(), 1);
        let m = q.meta();
        assert_eq!(m.counters.failed_tasks, 1);
        assert_eq!(m.failed.len(), 1);
        assert_eq!(m.failed[0].reason, "corrupt chunk in f.recordio");
        assert_eq!(m.failed[0].pass, 0);
        assert_eq!(m.counters.lost_records, 11);
        // Next pass retries it from scratch.
        assert_eq!(q.counts().todo, 2);
    }

    #[test]
    fn release_is_not_a_failure_and_goes_first() {
        let mut q = Queue::new(cfg(1, 0), specs(3));
        let t = take(&mut q, "a", 0);
        assert_eq!(q.released(&t.spec.id, t.generation, 4), Ok(Ack::Applied));
        let again = take(&mut q, "b", 1);
        assert_eq!(again.spec.id, t.spec.id);
        assert_eq!(again.failures, 0);
        assert_eq!(q.meta().counters.released, 1);
        assert_eq!(q.meta().counters.duplicate_records, 4);
        assert_eq!(q.meta().counters.failures, 0);
    }

    #[test]
    fn timeouts_requeue_and_adapt_to_task_durations() {
        let mut policy = TimeoutPolicy {
            initial: 60_000,
            floor: 1_000,
            ..TimeoutPolicy::default()
        };
        policy.min_samples = 3;
        let mut q = Queue::new(
            QueueConfig {
                passes: 1,
                max_failures: 5,
                max_losses: 5,
                timeout: policy,
            },
            specs(8),
        );
        assert_eq!(q.timeout(), 60_000);
        for k in 0..4u64 {
            let t = take(&mut q, "a", k * 1000);
            q.finished(&t.spec.id, t.generation, 1, k * 1000 + 500)
                .unwrap();
        }
        // p95 of 500 ms durations x4 = 2 s.
        assert_eq!(q.timeout(), 2_000);
        let t = take(&mut q, "hung", 10_000);
        assert_eq!(q.next_deadline(), Some(12_000));
        assert!(q.tick(11_999).is_empty());
        assert_eq!(q.tick(12_000), vec![t.spec.id.clone()]);
        assert_eq!(q.meta().counters.timeouts, 1);
        assert!(matches!(
            q.finished(&t.spec.id, t.generation, 1, 12_001),
            Err(Reject::Stale { .. })
        ));
    }

    #[test]
    fn restore_rebuilds_the_same_queue_and_rearms_leases() {
        let mut q = Queue::new(cfg(3, 3), specs(4));
        let mut store: BTreeMap<String, Task> = BTreeMap::new();
        let mut meta = Meta::default();
        let mut persist = |q: &mut Queue| {
            let c = q.take_changes();
            for t in c.tasks {
                store.insert(t.spec.id.clone(), t);
            }
            if let Some(m) = c.meta {
                meta = m;
            }
            (store.values().cloned().collect::<Vec<_>>(), meta.clone())
        };
        for _ in 0..4 {
            let t = take(&mut q, "a", 0);
            q.finished(&t.spec.id, t.generation, 1, 5).unwrap();
        }
        let held = take(&mut q, "b", 6);
        let (tasks, m) = persist(&mut q);
        let r = Queue::restore(cfg(3, 3), m, tasks, 1_000);
        assert_eq!(r.pass(), 1);
        assert_eq!(r.counts(), q.counts());
        match &r.task(&held.spec.id).unwrap().state {
            TaskState::Pending {
                trainer, deadline, ..
            } => {
                assert_eq!(trainer, "b");
                assert_eq!(*deadline, 1_000 + r.timeout());
            }
            s => panic!("expected pending, got {s:?}"),
        }
        assert_eq!(r.meta().counters.restores, 1);
    }

    #[test]
    fn a_retried_get_task_returns_the_same_lease() {
        let mut q = Queue::new(cfg(1, 3), specs(3));
        let GetTask::Task(a) = q.get_task("a", 0, 7, 0) else {
            panic!("expected a task")
        };
        assert_eq!(q.get_task("a", 0, 7, 1), GetTask::Task(a.clone()));
        assert_eq!(q.meta().counters.dispatched, 1);
        // Another request number, or another trainer, gets another task.
        let GetTask::Task(b) = q.get_task("a", 0, 8, 2) else {
            panic!("expected a task")
        };
        assert_ne!(a.spec.id, b.spec.id);
        let GetTask::Task(c) = q.get_task("b", 0, 7, 3) else {
            panic!("expected a task")
        };
        assert_ne!(c.spec.id, a.spec.id);
    }

    #[test]
    fn empty_dataset_finishes_at_once() {
        let mut q = Queue::new(cfg(3, 3), vec![]);
        assert!(q.is_finished());
        assert_eq!(q.get_task("a", 0, 0, 0), GetTask::JobFinished);
    }

    /// Events of the property test.
    #[derive(Clone, Debug)]
    enum Ev {
        Get(u8, u64),
        Finish(u8, bool),
        Fail(u8, bool),
        Release(u8, bool),
        Lost(u8),
        Tick(u16),
        Restore,
    }

    fn ev() -> impl Strategy<Value = Ev> {
        prop_oneof![
            4 => (0u8..4, 0u64..4).prop_map(|(t, r)| Ev::Get(t, r)),
            4 => (any::<u8>(), any::<bool>()).prop_map(|(i, s)| Ev::Finish(i, s)),
            1 => (any::<u8>(), any::<bool>()).prop_map(|(i, s)| Ev::Fail(i, s)),
            1 => (any::<u8>(), any::<bool>()).prop_map(|(i, s)| Ev::Release(i, s)),
            1 => (0u8..4).prop_map(Ev::Lost),
            1 => (0u16..2000).prop_map(Ev::Tick),
            1 => Just(Ev::Restore),
        ]
    }

    /// The indexes agree with the tasks and every task is in exactly one state.
    fn check_invariants(q: &Queue) {
        let todo: BTreeSet<usize> = q.todo.iter().copied().collect();
        assert_eq!(todo.len(), q.todo.len(), "a task is twice in todo");
        for (i, t) in q.tasks.iter().enumerate() {
            let in_todo = todo.contains(&i);
            let in_pending = q.pending.contains(&i);
            match &t.state {
                TaskState::Todo => assert!(in_todo && !in_pending),
                TaskState::Pending { trainer, .. } => {
                    assert!(!in_todo && in_pending);
                    assert!(q.by_trainer[trainer].contains(&i));
                }
                TaskState::Done | TaskState::Failed => assert!(!in_todo && !in_pending),
            }
            assert_eq!(t.pass, q.meta.pass, "every task is in the current pass");
        }
        let held: usize = q.by_trainer.values().map(BTreeSet::len).sum();
        assert_eq!(held, q.pending.len());
        assert!(q.by_trainer.values().all(|s| !s.is_empty()));
        if !q.meta.finished {
            assert!(
                !q.todo.is_empty() || !q.pending.is_empty(),
                "a pass with nothing todo or pending must have ended"
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn invariants_hold_under_any_event_sequence(
            n in 0u32..12,
            passes in 1u32..4,
            max_failures in 0u32..3,
            events in prop::collection::vec(ev(), 0..300),
        ) {
            let config = cfg(passes, max_failures);
            let mut q = Queue::new(config.clone(), specs(n));
            let mut store: BTreeMap<String, Task> = BTreeMap::new();
            let mut meta = Meta::default();
            let mut now: Millis = 0;
            let mut leases: Vec<Task> = Vec::new();
            let mut generations: HashMap<String, u64> = HashMap::new();
            let mut passes_seen = 0;
            // The service makes the fresh queue durable before it serves.
            let c = q.take_changes();
            for t in c.tasks {
                store.insert(t.spec.id.clone(), t);
            }
            meta = c.meta.unwrap_or(meta);
            for e in events {
                now += 7;
                let before = q.clone();
                match e {
                    Ev::Get(tr, request) => {
                        let pass = q.pass();
                        if let GetTask::Task(t) = q.get_task(&format!("t{tr}"), pass, request, now) {
                            leases.push(t);
                        }
                    }
                    Ev::Finish(k, stale) | Ev::Fail(k, stale) | Ev::Release(k, stale)
                        if !leases.is_empty() =>
                    {
                        let t = leases[k as usize % leases.len()].clone();
                        let generation = if stale { t.generation.saturating_sub(1) } else { t.generation };
                        let r = match e {
                            Ev::Finish(..) => q.finished(&t.spec.id, generation, t.spec.records, now),
                            Ev::Fail(..) => q.failed(&t.spec.id, generation, "boom", 1),
                            _ => q.released(&t.spec.id, generation, 1),
                        };
                        if let Err(Reject::Stale { .. }) = r {
                            // A stale report changes nothing but the counter.
                            let mut expect = before.clone();
                            expect.meta.counters.stale_rejected += 1;
                            prop_assert_eq!(&q.tasks, &expect.tasks);
                            prop_assert_eq!(&q.meta, &expect.meta);
                        }
                    }
                    Ev::Finish(..) | Ev::Fail(..) | Ev::Release(..) => {}
                    Ev::Lost(tr) => {
                        q.trainer_lost(&format!("t{tr}"));
                    }
                    Ev::Tick(d) => {
                        now += u64::from(d) * 1000;
                        q.tick(now);
                    }
                    Ev::Restore => {
                        q = Queue::restore(
                            config.clone(),
                            meta.clone(),
                            store.values().cloned().collect(),
                            now,
                        );
                        // Restoring only bumps the restore counter.
                        let mut expect = before.meta.clone();
                        expect.counters.restores += 1;
                        prop_assert_eq!(&q.meta, &expect);
                        for t in &before.tasks {
                            let r = q.task(&t.spec.id).unwrap();
                            prop_assert_eq!(r.generation, t.generation);
                            prop_assert_eq!(
                                std::mem::discriminant(&r.state),
                                std::mem::discriminant(&t.state)
                            );
                        }
                    }
                }
                check_invariants(&q);
                prop_assert!(q.pass() >= before.pass());
                prop_assert!(q.pass() < passes);
                for t in &q.tasks {
                    let g = generations.entry(t.spec.id.clone()).or_default();
                    prop_assert!(t.generation >= *g, "generation went down");
                    *g = t.generation;
                }
                passes_seen = passes_seen.max(q.meta.counters.passes_completed);
                let c = q.take_changes();
                for t in c.tasks {
                    store.insert(t.spec.id.clone(), t);
                }
                if let Some(m) = c.meta {
                    meta = m;
                }
            }
            // Drive the job to the end: it always finishes.
            let mut guard = 0;
            while !q.is_finished() {
                guard += 1;
                prop_assert!(guard < 10_000, "job did not finish");
                now += 1;
                q.tick(now + 10_000_000);
                let pass = q.pass();
                if let GetTask::Task(t) = q.get_task("drain", pass, 0, now) {
                    q.finished(&t.spec.id, t.generation, t.spec.records, now).unwrap();
                }
                check_invariants(&q);
            }
            prop_assert_eq!(q.meta.counters.passes_completed, u64::from(passes));
            prop_assert!(passes_seen <= u64::from(passes));
        }
    }
}
