//! Restores of a parameter-server shard: the training its restored state lacks is done
//! again. A restored pserver publishes which tasks of which passes its state contains
//! (`restores/<shard>`); [`Queue::rewind`] applies it once per incarnation, and
//! [`Queue::lacks`] checks each later acknowledgement against it.
//!
//! Invariants (with the pservers' ledgers, which apply every batch at most once):
//! - after a restore of shard `k` is applied, every task that is done in the current
//!   pass is contained in `k`'s restored state, or trained again: back to todo in the
//!   current pass, or, when an earlier pass lacks a task, the queue goes back to the
//!   earliest such pass (tasks the state contains are done in it, the others todo);
//! - an acknowledgement whose task's pushes were answered by an incarnation of `k` older
//!   than the restore applied, of a task the restored state lacks, is not done: the task
//!   is trained again;
//! - a restore is applied once (its incarnation is kept in [`Meta`](super::Meta)); a
//!   task trained again is counted in `recomputed`, never as lost. Training a task
//!   again is always safe: batches a shard already holds count nothing there.

use edl_job::RestoreRecord;

use super::{Queue, TaskState};

/// What applying a restore changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rewind {
    /// Tasks to be trained again.
    pub tasks: u64,
    /// Their records.
    pub records: u64,
    /// The pass the queue went back to, when it did.
    pub back_to_pass: Option<u32>,
}

/// Whether every push of a task to shard `r.shard` was answered by `r`'s incarnation
/// or a later one: the restored state then lacks nothing of it (the restore record can
/// reach the master after such a task's acknowledgement).
fn answered_since(answered: &[u64], r: &RestoreRecord) -> bool {
    answered
        .get(r.shard as usize)
        .is_some_and(|&inc| inc != 0 && inc >= r.incarnation)
}

impl Queue {
    /// Applies shard `r.shard`'s restore, once per incarnation (a restore already
    /// applied is only remembered, to check later acknowledgements against).
    pub fn rewind(&mut self, r: &RestoreRecord) -> Rewind {
        let newer = self
            .restores
            .get(&r.shard)
            .is_none_or(|old| old.incarnation < r.incarnation);
        if newer {
            self.restores.insert(r.shard, r.clone());
        }
        let applied = self.meta.restores.get(&r.shard).copied().unwrap_or(0);
        if r.incarnation <= applied {
            return Rewind::default();
        }
        self.meta.restores.insert(r.shard, r.incarnation);
        self.meta_dirty = true;
        let current = self.meta.pass;
        let n = self.tasks.len() as u32;
        // Passes whose every task was done: those before the current one, and the
        // current one too when the job finished.
        let done_passes = if self.meta.finished {
            current.saturating_add(1)
        } else {
            current
        };
        let lacking =
            (r.contains.sealed..done_passes).find(|&p| (0..n).any(|i| !r.contains.contains(p, i)));
        let mut out = Rewind::default();
        match lacking {
            Some(pass) => {
                // Back to `pass`: what the state holds of it is done, the rest todo; the
                // later passes follow as usual. Trained again: what `pass` lacks, every
                // task of the passes between, and what the current pass had done.
                let records = |i: usize| self.tasks[i].spec.records;
                let all: u64 = (0..self.tasks.len()).map(records).sum();
                let between = u64::from(current.saturating_sub(pass).saturating_sub(1));
                out.tasks += between * u64::from(n);
                out.records += between * all;
                if current > pass {
                    for i in 0..self.tasks.len() {
                        let t = &self.tasks[i];
                        if t.pass == current && matches!(t.state, TaskState::Done) {
                            out.tasks += 1;
                            out.records += records(i);
                        }
                    }
                }
                self.todo.clear();
                for i in 0..self.tasks.len() {
                    if matches!(self.tasks[i].state, TaskState::Pending { .. }) {
                        self.unlease(i);
                    }
                    let holds = r.contains.contains(pass, i as u32);
                    let t = &mut self.tasks[i];
                    t.generation += 1;
                    t.pass = pass;
                    t.failures = 0;
                    t.losses = 0;
                    t.last_error = None;
                    t.answered.clear();
                    t.state = if holds {
                        TaskState::Done
                    } else {
                        self.todo.push_back(i);
                        TaskState::Todo
                    };
                    if !holds {
                        out.tasks += 1;
                        out.records += t.spec.records;
                    }
                    self.dirty.insert(i);
                }
                self.meta.pass = pass;
                self.meta.finished = false;
                // The passes after it are undone: they will complete again.
                self.meta.counters.passes_completed = u64::from(pass);
                out.back_to_pass = Some(pass);
            }
            None => {
                let mut again: Vec<usize> = (0..self.tasks.len())
                    .filter(|&i| {
                        let t = &self.tasks[i];
                        t.pass == current
                            && matches!(t.state, TaskState::Done)
                            && !r.contains.contains(current, i as u32)
                            && !answered_since(&t.answered, r)
                    })
                    .collect();
                again.reverse();
                for i in again {
                    out.tasks += 1;
                    out.records += self.again(i);
                }
            }
        }
        if out.tasks > 0 {
            self.bump(|c| {
                c.recomputed += out.tasks;
                c.recomputed_records += out.records;
            });
            tracing::warn!(
                shard = r.shard,
                checkpoint = r.step,
                tasks = out.tasks,
                records = out.records,
                back_to_pass = ?out.back_to_pass,
                "a parameter server was restored without some acknowledged training; \
                 training it again"
            );
        }
        out
    }

    /// Whether task `i`, whose pushes were answered by `incarnations` (per shard; 0:
    /// none), is lacking from a shard restored since from a state without it.
    pub(super) fn lacks(&self, i: usize, incarnations: &[u64]) -> bool {
        let pass = self.tasks[i].pass;
        incarnations.iter().enumerate().any(|(shard, &inc)| {
            inc != 0
                && self
                    .restores
                    .get(&(shard as u32))
                    .is_some_and(|r| inc < r.incarnation && !r.contains.contains(pass, i as u32))
        })
    }

    /// Puts done or pending task `i` back at the front of the queue, to be trained
    /// again in the current pass. Returns its records.
    pub(super) fn again(&mut self, i: usize) -> u64 {
        if matches!(self.tasks[i].state, TaskState::Pending { .. }) {
            self.unlease(i);
        }
        let t = &mut self.tasks[i];
        t.generation += 1;
        t.state = TaskState::Todo;
        self.todo.push_front(i);
        self.dirty.insert(i);
        self.tasks[i].spec.records
    }
}

#[cfg(test)]
mod tests {
    use edl_job::ledger::{Bits, LedgerSummary};
    use edl_job::{RECORD_VERSION, RestoreRecord};

    use super::super::tests::{cfg, specs, take};
    use super::super::{GetTask, Queue, TaskState};

    fn restore(
        shard: u32,
        incarnation: u64,
        sealed: u32,
        complete: &[(u32, &[u32])],
    ) -> RestoreRecord {
        RestoreRecord {
            version: RECORD_VERSION,
            shard,
            incarnation,
            step: 7,
            contains: LedgerSummary {
                sealed,
                complete: complete
                    .iter()
                    .map(|(p, ts)| {
                        let mut b = Bits::default();
                        for &t in *ts {
                            b.insert(t);
                        }
                        (*p, b)
                    })
                    .collect(),
            },
            at_ms: 0,
        }
    }

    fn finish(q: &mut Queue, trainer: &str, incarnations: &[u64], now: u64) -> usize {
        let t = take(q, trainer, now);
        let i = q.position(&t.spec.id).unwrap();
        q.finished(&t.spec.id, t.generation, t.spec.records, incarnations, now)
            .unwrap();
        i
    }

    #[test]
    fn done_tasks_a_restored_shard_lacks_are_trained_again() {
        let mut q = Queue::new(cfg(2, 3), specs(4));
        for n in 0..3 {
            finish(&mut q, "a", &[5], n);
        }
        // Shard 0 restored (incarnation 9) from a state holding tasks 0 and 2 of pass 0.
        let r = q.rewind(&restore(0, 9, 0, &[(0, &[0, 2])]));
        assert_eq!(r.tasks, 1, "task 1 was done and is lacking");
        assert_eq!(r.back_to_pass, None);
        assert!(matches!(q.tasks()[1].state, TaskState::Todo));
        assert_eq!(q.meta().counters.recomputed, 1);
        assert_eq!(q.meta().counters.recomputed_records, 11);
        assert_eq!(
            q.rewind(&restore(0, 9, 0, &[])),
            Default::default(),
            "applied once"
        );
        // Task 1 is dispatched next; an acknowledgement through the old incarnation of
        // a task the restored state lacks (task 3) is not done either.
        let t = take(&mut q, "a", 10);
        assert_eq!(q.position(&t.spec.id), Some(1));
        let t3 = take(&mut q, "b", 11);
        q.finished(&t3.spec.id, t3.generation, 1, &[5], 12).unwrap();
        assert!(
            matches!(q.tasks()[3].state, TaskState::Todo),
            "lacking: again"
        );
        assert_eq!(q.meta().counters.recomputed, 2);
        // Through the new incarnation it is done.
        let t3 = take(&mut q, "b", 13);
        q.finished(&t3.spec.id, t3.generation, 1, &[9], 14).unwrap();
        q.finished(&t.spec.id, t.generation, 1, &[9], 15).unwrap();
        assert_eq!(q.pass(), 1, "pass 0 complete");
    }

    #[test]
    fn a_restore_seen_after_tasks_trained_on_its_incarnation_redoes_only_older_ones() {
        let mut q = Queue::new(cfg(2, 3), specs(4));
        // Task 0 was trained on incarnation 5 of shard 0; tasks 1 and 2 on incarnation 9,
        // whose restore record (holding nothing: a fresh start) reaches the queue only now.
        let old = finish(&mut q, "a", &[5], 0);
        let new: Vec<usize> = (1..3).map(|n| finish(&mut q, "a", &[9], n)).collect();
        let r = q.rewind(&restore(0, 9, 0, &[]));
        assert_eq!(
            r.tasks, 1,
            "only the task answered by the older incarnation"
        );
        assert!(matches!(q.tasks()[old].state, TaskState::Todo));
        for i in new {
            assert!(matches!(q.tasks()[i].state, TaskState::Done), "task {i}");
        }
        assert_eq!(q.meta().counters.recomputed, 1);
    }

    #[test]
    fn a_restore_lacking_an_earlier_pass_takes_the_queue_back_to_it() {
        let mut q = Queue::new(cfg(3, 3), specs(3));
        for n in 0..3 {
            finish(&mut q, "a", &[5], n);
        }
        assert_eq!(q.pass(), 1);
        finish(&mut q, "a", &[5], 4);
        let held = take(&mut q, "b", 5);
        // Restored from a state holding only task 1 of pass 0.
        let r = q.rewind(&restore(0, 9, 0, &[(0, &[1])]));
        assert_eq!(r.back_to_pass, Some(0));
        assert_eq!(
            r.tasks, 3,
            "tasks 0 and 2 of pass 0, and the one done in pass 1"
        );
        assert_eq!(q.pass(), 0);
        let states: Vec<bool> = q
            .tasks()
            .iter()
            .map(|t| matches!(t.state, TaskState::Done))
            .collect();
        assert_eq!(states, vec![false, true, false]);
        // The holder of a pass-1 task is stale now, and a trainer asking for pass 1 is
        // sent back to pass 0.
        assert!(
            q.finished(&held.spec.id, held.generation, 1, &[9], 6)
                .is_err()
        );
        assert_eq!(
            q.get_task("b", 1, 0, 7),
            GetTask::PassFinished { next_pass: 0 }
        );
        // Training goes on from there to the end.
        let mut now = 8;
        while !q.meta().finished {
            finish(&mut q, "a", &[9], now);
            now += 1;
        }
        assert_eq!(
            q.meta().counters.passes_completed,
            3,
            "passes undone are not counted"
        );
    }

    #[test]
    fn a_restore_after_the_job_finished_reopens_it() {
        let mut q = Queue::new(cfg(1, 3), specs(2));
        finish(&mut q, "a", &[5], 0);
        finish(&mut q, "a", &[5], 1);
        assert!(q.meta().finished);
        let r = q.rewind(&restore(0, 9, 0, &[(0, &[0])]));
        assert_eq!((r.tasks, r.back_to_pass), (1, Some(0)));
        assert!(!q.meta().finished);
        // A restore holding everything changes nothing.
        let mut q = Queue::new(cfg(1, 3), specs(2));
        finish(&mut q, "a", &[5], 0);
        finish(&mut q, "a", &[5], 1);
        assert_eq!(q.rewind(&restore(0, 9, 1, &[])).tasks, 0);
        assert!(q.meta().finished);
    }

    #[test]
    fn a_restore_survives_a_failover_and_is_not_applied_twice() {
        let mut q = Queue::new(cfg(1, 3), specs(3));
        finish(&mut q, "a", &[5], 0);
        finish(&mut q, "a", &[5], 1);
        let r = restore(0, 9, 0, &[(0, &[0])]);
        assert_eq!(q.rewind(&r).tasks, 1);
        let changes = q.take_changes();
        let meta = changes.meta.clone().expect("meta changed");
        let tasks: Vec<_> = q.tasks().to_vec();
        let mut q2 = Queue::restore(cfg(1, 3), meta, tasks, 10);
        assert_eq!(q2.rewind(&r).tasks, 0, "applied before the failover");
        // Still checked for acknowledgements.
        let t = take(&mut q2, "a", 11);
        q2.finished(&t.spec.id, t.generation, 1, &[5], 12).unwrap();
        assert_eq!(q2.meta().counters.recomputed, 2);
    }
}
