//! A holder's reports on its lease: finished, failed, released (a draining trainer's
//! hand-back). Each is checked against the task's generation first: a report naming
//! another generation is stale, rejected and counted, and changes nothing else; a
//! retried report that was already applied is acknowledged again without effect.

use super::failure::Redo;
use edl_master_api::Release;

use super::{Ack, Millis, Queue, Reject, Resume, TaskState};

/// Why a task trained whole is trained again (the last reason when that fails it).
const REWOUND: &str = "its updates were lost with a pserver shard's restore";

impl Queue {
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

    /// A trainer trained every record of a task (`records` is what it counted), and
    /// `incarnations` (per pserver shard, 0 for none) recorded it as done. When one of
    /// those shards was restored since, from a state without the task, the task is
    /// trained again instead (counted in `recomputed`; a loss, so past `max_losses` in
    /// the pass it fails for good rather than be rewound forever).
    pub fn finished(
        &mut self,
        id: &str,
        generation: u64,
        records: u64,
        incarnations: &[u64],
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
        if self.lacks(i, incarnations) {
            // Trained (counted so), but lost with the shard's restore: trained again.
            tracing::warn!(task = %id, "task finished on a pserver shard restored since without it; training it again");
            self.bump(|c| c.records_trained += records);
            self.fail(i, REWOUND, Redo::Rewound);
            self.check_pass_end();
            return Ok(Ack::Applied);
        }
        self.unlease(i);
        self.tasks[i].state = TaskState::Done;
        self.tasks[i].answered = incarnations.to_vec();
        self.tasks[i].resume = None;
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

    /// Puts pending task `i`, handed back by a draining holder, back in todo ahead of
    /// every todo task later in the dataset: a drain's hand-backs (its task, then those
    /// it read ahead, in whatever order they arrive) are dispatched first, in dataset
    /// order, as a fault-free run would have trained them.
    fn handed_back(&mut self, i: usize) {
        self.unlease(i);
        let t = &mut self.tasks[i];
        t.generation += 1;
        t.state = TaskState::Todo;
        let at = self
            .todo
            .iter()
            .position(|&j| j > i)
            .unwrap_or(self.todo.len());
        self.todo.insert(at, i);
        self.dirty.insert(i);
    }

    /// A trainer hands a task back: not a failure. Draining, it is dispatched next,
    /// resuming after the batches the trainer applied (when it says so; the records it
    /// trained are otherwise trained again, counted as duplicates). `Recompute`: the
    /// trainer trained it all, but a pserver shard restored meanwhile lacks some of it
    /// (counted in `recomputed`, and a loss, as for `finished`).
    pub fn released(&mut self, id: &str, generation: u64, how: &Release) -> Result<Ack, Reject> {
        let i = self.check(id, generation)?;
        if !matches!(self.tasks[i].state, TaskState::Pending { .. }) {
            return Err(self.not_pending(i));
        }
        match how {
            Release::Recompute { trained } => {
                // Trained whole (counted so), but lost with a shard's restore.
                self.bump(|c| c.records_trained += trained);
                self.fail(i, REWOUND, Redo::Rewound);
                self.check_pass_end();
            }
            Release::Drained { trained, resume } => {
                let before = self.tasks[i].resume.take();
                self.handed_back(i);
                let t = &self.tasks[i];
                let resume = resume.as_ref().filter(|r| {
                    // Past what the attempt was given, and within the task: anything
                    // else is not a prefix this lease could have applied.
                    r.records <= t.spec.records
                        && before
                            .as_ref()
                            .is_none_or(|b| r.batch > b.batch && r.records >= b.records)
                });
                let trained = *trained;
                match resume {
                    Some(r) => {
                        self.tasks[i].resume = Some(Box::new(Resume {
                            batch: r.batch,
                            records: r.records,
                            answered: r.answered.clone(),
                        }));
                        self.bump(|c| {
                            c.released += 1;
                            c.resumed += 1;
                            c.resumed_records += trained;
                            c.records_trained += trained;
                        });
                    }
                    None => {
                        // The attempt's own records are trained again; what an
                        // earlier attempt applied still stands.
                        self.tasks[i].resume = before;
                        self.bump(|c| {
                            c.released += 1;
                            c.duplicate_records += trained;
                        });
                    }
                }
            }
        }
        Ok(Ack::Applied)
    }
}
