//! Dispatch: a trainer asks for a task and gets one leased to it (or is told to wait,
//! that its pass is over, or that the job is finished), and the lease indexes (`pending`,
//! `by_trainer`) that a task enters on dispatch and leaves through `unlease`.
//!
//! A trainer waiting on a pserver or the master keeps its leases (`keep`): it is not
//! stuck, whatever its lease's deadline says.
//!
//! A dispatch bumps the task's generation and counts the task's dispatches in its pass;
//! a retried request (same trainer, same request number) gets the task already leased
//! for it instead of a second one.

use super::{GetTask, Millis, Queue, TaskState};

impl Queue {
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
            // The queue went back to an earlier pass (a pserver shard was restored
            // without some of the training since, see `rewind`): the trainer follows.
            return GetTask::PassFinished {
                next_pass: self.meta.pass,
            };
        }
        let Some(i) = self.todo.pop_front() else {
            return GetTask::Wait;
        };
        let deadline = now.saturating_add(self.timeout());
        let t = &mut self.tasks[i];
        t.generation += 1;
        t.dispatches = t.dispatches.saturating_add(1);
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

    /// Trainer `trainer` is alive and waiting on a pserver or the master (a pull, a push
    /// or a report that has not returned), not stuck: the deadlines of the tasks it
    /// holds move to `now` plus the timeout (never earlier). Nothing else changes and
    /// nothing needs to be made durable (a restored queue re-arms every lease). Returns
    /// how many tasks it holds.
    pub fn keep(&mut self, trainer: &str, now: Millis) -> usize {
        let until = now.saturating_add(self.timeout());
        let Some(held) = self.by_trainer.get(trainer) else {
            return 0;
        };
        for &i in held {
            if let TaskState::Pending { deadline, .. } = &mut self.tasks[i].state {
                *deadline = (*deadline).max(until);
            }
        }
        held.len()
    }

    /// Removes a pending task from the lease indexes.
    pub(super) fn unlease(&mut self, i: usize) {
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
}
