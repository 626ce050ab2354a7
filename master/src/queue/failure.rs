//! Failure events: a trainer lost (its registration vanished), leases timed out, and
//! the one path every failure event takes, `fail`: the generation is bumped (so the
//! old holder's reports are stale), then the task goes back to todo, or fails for good
//! past `max_failures` reported failures or `max_losses` losses in the pass (holders
//! lost, leases timed out, training taken away by pserver restores). Losses are counted
//! apart from failures, so that chaos among trainers does not fail healthy tasks.

use super::{Expired, FailedTask, MAX_FAILED_REPORTED, Millis, Queue, TaskState};

impl Queue {
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

    /// Expires the leases whose deadline is at or before `now`: each task goes back to
    /// todo (or fails for good), and its holder, still registered but silent past the
    /// timeout, is named with it.
    pub fn tick(&mut self, now: Millis) -> Vec<Expired> {
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
            .into_iter()
            .map(|(i, held_ms, trainer)| Expired {
                task: self.tasks[i].spec.id.clone(),
                trainer,
                held_ms,
            })
            .collect()
    }

    /// A failure event on a pending task: back to todo, or failed for good past
    /// `max_failures` failures or `max_losses` losses in the pass.
    pub(super) fn fail(&mut self, i: usize, reason: &str, redo: Redo) {
        let reason = &super::bounded_reason(reason);
        self.unlease(i);
        let (max_failures, max_losses) = (self.cfg.max_failures, self.cfg.max_losses);
        let pass = self.meta.pass;
        let t = &mut self.tasks[i];
        t.generation += 1;
        match redo {
            Redo::CutOff | Redo::Rewound => t.losses += 1,
            Redo::Reported(_) => t.failures += 1,
        }
        t.last_error = Some(reason.to_owned());
        self.dirty.insert(i);
        let records = t.spec.records;
        if t.failures > max_failures || t.losses > max_losses {
            t.state = TaskState::Failed;
            tracing::warn!(task = %t.spec.id, pass, reason, "task failed for good");
            let id = t.spec.id.clone();
            // Listed and counted once per pass (a rewound pass does not train it again).
            if self.settle_failed(pass, i) {
                self.meta.failed.push(FailedTask {
                    pass,
                    id,
                    records,
                    reason: reason.to_owned(),
                });
                if self.meta.failed.len() > MAX_FAILED_REPORTED {
                    self.meta.failed.remove(0);
                }
                self.failures_dirty = true;
                self.bump(|c| {
                    c.failed_tasks += 1;
                    c.lost_records += records;
                });
            }
            self.bump(|c| c.failures += 1);
        } else if let Redo::Rewound = redo {
            // Not a failure: trained whole, and trained again first, whole.
            t.state = TaskState::Todo;
            t.resume = None;
            self.todo.push_front(i);
            self.bump(|c| {
                c.recomputed += 1;
                c.recomputed_records += records;
            });
        } else {
            t.state = TaskState::Todo;
            self.todo.push_back(i);
            self.bump(|c| {
                c.failures += 1;
                c.requeued += 1;
                match redo {
                    Redo::Reported(n) => c.duplicate_records += n,
                    _ => c.cutoff_records += records,
                }
            });
        }
    }
}

/// How a requeued task's already-trained records are counted.
#[derive(Clone, Copy, Debug)]
pub(super) enum Redo {
    /// The trainer said how many it trained.
    Reported(u64),
    /// The trainer was cut off; all of the task's records are an upper bound.
    CutOff,
    /// The task was trained whole, but a pserver shard restored since lacks it: trained
    /// again (counted in `recomputed`), a loss towards `max_losses`.
    Rewound,
}
