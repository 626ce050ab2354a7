//! The task queue as a pure state machine.
//!
//! The queue owns every task of a dataset and moves each through
//! `todo -> pending -> done | failed` once per pass. It does no I/O and reads no clock:
//! callers pass the time (milliseconds of any monotonic-enough clock) and, after each
//! batch of events, collect the changed state with [`Queue::take_changes`] and make it
//! durable (one etcd transaction for the whole batch: group commit) before replying.
//!
//! Invariants (checked by the property tests in `tests.rs`):
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
//!
//! Layout (each part adds its methods to [`Queue`]; the types are re-exported here):
//! - `types`: tasks and their states, the [`Meta`] record and its counters, the
//!   configuration, and the answers to trainers (dispatches, acks, rejects, changes).
//! - this file: the [`Queue`], built fresh or restored, its read-only view, and the
//!   changes collected for the durable store.
//! - `dispatch`: [`Queue::get_task`] and the lease indexes a task enters and leaves.
//! - `acks`: a holder's reports: finished, failed, released (generation-checked).
//! - `failure`: trainers lost and leases timed out, and the one path every failure
//!   event takes (back to todo, or failed for good past the bounds).
//! - `passes`: the end of a pass (and of the job).
//! - `rewind`: a parameter-server shard restored without some acknowledged training:
//!   that training is done again.
//! - `tests`: unit tests and the property test of the invariants above.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use edl_job::{FailedRecord, RECORD_VERSION, RestoreRecord};

mod acks;
mod dispatch;
mod failure;
mod passes;
mod rewind;
mod types;

#[cfg(test)]
pub(crate) mod tests;

pub use rewind::Rewind;
pub use types::{
    Ack, Changes, Expired, FailedTask, GetTask, MAX_FAILED_REPORTED, MAX_REASON_BYTES, Meta,
    Millis, QueueConfig, QueueCounters, Reject, Resume, StateCounts, Task, TaskSpec, TaskState,
    TimeoutPolicy, bounded_reason,
};

/// The task queue.
#[derive(Debug, Clone)]
pub struct Queue {
    cfg: QueueConfig,
    meta: Meta,
    tasks: Vec<Task>,
    /// Task ids to positions (foldhash: a million ids hash in a fraction of SipHash's
    /// time, which a new leader's rebuild waits on).
    index: foldhash::HashMap<String, usize>,
    todo: VecDeque<usize>,
    pending: BTreeSet<usize>,
    by_trainer: HashMap<String, BTreeSet<usize>>,
    durations: VecDeque<Millis>,
    dirty: BTreeSet<usize>,
    meta_dirty: bool,
    /// The list of tasks failed for good (`Meta::failed`) changed.
    failures_dirty: bool,
    /// The newest restore of each pserver shard (for acknowledgements; see `rewind`).
    restores: BTreeMap<u32, RestoreRecord>,
    /// Per pserver shard, the newest incarnation whose restore record, if it has one, the
    /// queue has seen (in memory: a rebuilt queue reads every record).
    restores_checked: BTreeMap<u32, u64>,
    /// Per pass, the tasks failed for good in it (durable as `job/failed/<pass>`).
    failed: BTreeMap<u32, FailedRecord>,
    /// The passes whose failed-task record changed.
    failed_dirty: BTreeSet<u32>,
}

impl Queue {
    /// A fresh queue over `specs` (pass 0, every task todo, in id order). Ids must
    /// be unique; duplicates are dropped (the first wins).
    pub fn new(cfg: QueueConfig, mut specs: Vec<TaskSpec>) -> Queue {
        let mut q = Queue::empty(cfg, Meta::default());
        // Dataset order (ids sort so): a task's index is its position, the same for
        // every master (`restore` sorts too), as pushes' origins name tasks by index.
        specs.sort_by(|a, b| a.id.cmp(&b.id));
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
                dispatches: 0,
                last_error: None,
                answered: Vec::new(),
                resume: None,
            });
            q.todo.push_back(i);
            q.dirty.insert(i);
        }
        q.meta_dirty = true;
        q.check_pass_end();
        q
    }

    /// Rebuilds a queue from its durable records (after a failover or restart). Tasks
    /// stored with an older pass are todo in the current one (failed, when they failed
    /// for good in it before a rewind); pending leases keep their holder and get a fresh
    /// deadline from `now` (the old leader's clock is not ours).
    pub fn restore(
        cfg: QueueConfig,
        meta: Meta,
        mut tasks: Vec<Task>,
        failed: Vec<FailedRecord>,
        now: Millis,
    ) -> Queue {
        tasks.sort_by(|a, b| a.spec.id.cmp(&b.spec.id));
        tasks.dedup_by(|a, b| a.spec.id == b.spec.id);
        let mut q = Queue::empty(cfg, meta);
        q.index.reserve(tasks.len());
        q.failed = failed.into_iter().map(|r| (r.pass, r)).collect();
        q.meta.counters.restores += 1;
        q.meta_dirty = true;
        let timeout = q.timeout();
        // In place: a million task records are not moved again.
        q.tasks = tasks;
        let pass = q.meta.pass;
        for i in 0..q.tasks.len() {
            q.index.insert(q.tasks[i].spec.id.clone(), i);
            if q.meta.finished {
                // Nothing is dispatched any more; keep the records as they are.
                continue;
            }
            if q.tasks[i].pass < pass {
                let failed = q.failed_in(pass, i);
                q.tasks[i].enter_pass(pass, failed);
                q.dirty.insert(i);
            }
            match &mut q.tasks[i].state {
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
        }
        q.check_pass_end();
        q
    }

    fn empty(cfg: QueueConfig, meta: Meta) -> Queue {
        Queue {
            cfg,
            meta,
            tasks: Vec::new(),
            index: foldhash::HashMap::default(),
            todo: VecDeque::new(),
            pending: BTreeSet::new(),
            by_trainer: HashMap::new(),
            durations: VecDeque::new(),
            dirty: BTreeSet::new(),
            meta_dirty: false,
            failures_dirty: false,
            restores: BTreeMap::new(),
            restores_checked: BTreeMap::new(),
            failed: BTreeMap::new(),
            failed_dirty: BTreeSet::new(),
        }
    }

    /// Whether task `i` failed for good in pass `pass`.
    pub fn failed_in(&self, pass: u32, i: usize) -> bool {
        self.failed
            .get(&pass)
            .is_some_and(|r| r.failed.contains(&(i as u32)))
    }

    /// Records task `i` as failed for good in pass `pass`; false when it was.
    fn settle_failed(&mut self, pass: u32, i: usize) -> bool {
        let tasks = self.tasks.len() as u32;
        let r = self.failed.entry(pass).or_insert_with(|| FailedRecord {
            version: RECORD_VERSION,
            pass,
            tasks,
            failed: Default::default(),
        });
        let new = r.failed.insert(i as u32);
        if new {
            self.failed_dirty.insert(pass);
        }
        new
    }

    /// The position of task `id` (its index in the dataset).
    pub fn position(&self, id: &str) -> Option<usize> {
        self.index.get(id).copied()
    }

    /// Tasks in the dataset.
    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    /// Whether the dataset has no task.
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
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

    /// What changed since the last call, to persist in one transaction.
    pub fn take_changes(&mut self) -> Changes {
        let tasks = std::mem::take(&mut self.dirty)
            .into_iter()
            .map(|i| self.tasks[i].clone())
            .collect();
        let meta = std::mem::take(&mut self.meta_dirty).then(|| self.meta.clone());
        let failures = std::mem::take(&mut self.failures_dirty).then(|| self.meta.failed.clone());
        let failed = std::mem::take(&mut self.failed_dirty)
            .into_iter()
            .filter_map(|p| self.failed.get(&p).cloned())
            .collect();
        Changes {
            tasks,
            meta,
            failures,
            failed,
        }
    }

    fn bump(&mut self, f: impl FnOnce(&mut QueueCounters)) {
        f(&mut self.meta.counters);
        self.meta_dirty = true;
    }
}
