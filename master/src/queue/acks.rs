//! A holder's reports on its lease: finished, failed, released (a draining trainer's
//! hand-back). Each is checked against the task's generation first: a report naming
//! another generation is stale, rejected and counted, and changes nothing else; a
//! retried report that was already applied is acknowledged again without effect.

use super::failure::Redo;
use super::{Ack, Millis, Queue, Reject, TaskState};

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
}
