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
//! - a task that failed for good in a pass is settled in it: it is never a reason to go
//!   back to that pass, and a pass gone back to leaves it failed (it is not retried);
//! - a restore is applied before any acknowledgement through its incarnation (a
//!   pserver publishes it before it serves; the caller reads the records when an
//!   acknowledgement names an incarnation not checked yet: [`Queue::unchecked`]), so the
//!   passes it finds lacking were completed on older incarnations;
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
        let checked = self.restores_checked.entry(r.shard).or_default();
        *checked = (*checked).max(r.incarnation);
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
        // A task failed for good in a pass is settled there: never a reason to go back.
        let lacking = (r.contains.sealed..done_passes).find(|&p| {
            (0..n).any(|i| !r.contains.contains(p, i) && !self.failed_in(p, i as usize))
        });
        let mut out = Rewind::default();
        match lacking {
            Some(pass) => {
                // Back to `pass`: what the state holds of it is done, the rest todo; the
                // later passes follow as usual. Trained again: what `pass` lacks, every
                // task of the passes between, and what the current pass had done.
                let records = |i: usize| self.tasks[i].spec.records;
                let all: u64 = (0..self.tasks.len()).map(records).sum();
                for p in pass.saturating_add(1)..current {
                    let failed = self.failed.get(&p).map(|f| &f.failed);
                    let (ft, fr) = failed.map_or((0, 0), |f| {
                        (f.len() as u64, f.iter().map(|&i| records(i as usize)).sum())
                    });
                    out.tasks += u64::from(n) - ft;
                    out.records += all - fr;
                }
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
                    let failed = !holds && self.failed_in(pass, i);
                    let t = &mut self.tasks[i];
                    t.generation += 1;
                    t.pass = pass;
                    t.failures = 0;
                    t.losses = 0;
                    // The shards may hold part of an attempt at this pass from before:
                    // no dispatch after a rewind is a first one.
                    t.dispatches = 1;
                    t.last_error = None;
                    t.answered.clear();
                    t.state = if holds {
                        TaskState::Done
                    } else if failed {
                        TaskState::Failed
                    } else {
                        self.todo.push_back(i);
                        TaskState::Todo
                    };
                    if !holds && !failed {
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

    /// Whether an acknowledgement answered by `incarnations` (per shard; 0: none) names
    /// an incarnation whose restore record the queue may not have seen: the caller reads
    /// the records ([`Queue::restores_read`]) before it applies the acknowledgement.
    pub fn unchecked(&self, incarnations: &[u64]) -> bool {
        incarnations
            .iter()
            .enumerate()
            .any(|(s, &inc)| inc > self.restores_checked.get(&(s as u32)).copied().unwrap_or(0))
    }

    /// The restore records as etcd holds them, read before an acknowledgement answered
    /// by `incarnations`: each applied (once per incarnation, as always); every record of
    /// those incarnations is known from now on.
    pub fn restores_read(&mut self, records: &[RestoreRecord], incarnations: &[u64]) {
        for r in records {
            self.rewind(r);
        }
        for (s, &inc) in incarnations.iter().enumerate() {
            let checked = self.restores_checked.entry(s as u32).or_default();
            *checked = (*checked).max(inc);
        }
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
    /// again whole in the current pass. Returns its records.
    pub(super) fn again(&mut self, i: usize) -> u64 {
        if matches!(self.tasks[i].state, TaskState::Pending { .. }) {
            self.unlease(i);
        }
        let t = &mut self.tasks[i];
        t.generation += 1;
        t.state = TaskState::Todo;
        // Trained again whole: a restored shard may lack any batch of it.
        t.resume = None;
        self.todo.push_front(i);
        self.dirty.insert(i);
        self.tasks[i].spec.records
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use edl_job::ledger::{Bits, LedgerSummary};
    use edl_job::{RECORD_VERSION, RestoreRecord};
    use edl_master_api::Release;

    use super::super::tests::{cfg, specs, take};
    use super::super::{GetTask, Meta, Queue, TaskState};

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
        // Its pushes before may be partly in a shard: not a first dispatch.
        assert_eq!(t.dispatches, 2);
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
        // Pass 0 again: no dispatch of it is a first one (the shards may hold part of
        // an attempt from before), until the next pass starts afresh.
        let again = take(&mut q, "a", 8);
        assert_eq!((again.pass, again.dispatches), (0, 2));
        q.finished(&again.spec.id, again.generation, 1, &[9], 8)
            .unwrap();
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
        let mut q2 = Queue::restore(cfg(1, 3), meta, tasks, Vec::new(), 10);
        assert_eq!(q2.rewind(&r).tasks, 0, "applied before the failover");
        // Still checked for acknowledgements.
        let t = take(&mut q2, "a", 11);
        q2.finished(&t.spec.id, t.generation, 1, &[5], 12).unwrap();
        assert_eq!(q2.meta().counters.recomputed, 2);
    }

    /// Fails the next task of the current pass for good (`max_failures` 0); returns its
    /// index.
    fn fail_for_good(q: &mut Queue, now: u64) -> usize {
        let t = take(q, "a", now);
        let i = q.position(&t.spec.id).unwrap();
        q.failed(&t.spec.id, t.generation, "damaged chunk", 0)
            .unwrap();
        assert!(matches!(q.tasks()[i].state, TaskState::Failed));
        i
    }

    #[test]
    fn a_task_failed_for_good_is_settled_and_never_takes_the_queue_back() {
        // Three passes of three tasks; task 0 fails for good in pass 0.
        let mut q = Queue::new(cfg(3, 0), specs(3));
        let failed = fail_for_good(&mut q, 0);
        assert_eq!(failed, 0);
        let changes = q.take_changes();
        assert_eq!(
            changes.failed.len(),
            1,
            "the failure is durable with the batch"
        );
        assert!(changes.failed[0].failed.contains(&0) && changes.failed[0].tasks == 3);
        finish(&mut q, "a", &[5], 1);
        finish(&mut q, "a", &[5], 2);
        assert_eq!(q.pass(), 1);
        finish(&mut q, "a", &[5], 3);
        // Shard 0 restored (gracefully: it holds everything trained) from a ledger without
        // the failed task: pass 0 stays done, nothing is trained again.
        let r = q.rewind(&restore(0, 9, 0, &[(0, &[1, 2]), (1, &[0])]));
        assert_eq!(r, Default::default(), "nothing lacking but the failed task");
        assert_eq!(q.meta().counters.recomputed, 0);
        assert_eq!(q.pass(), 1);
    }

    #[test]
    fn a_pass_gone_back_to_leaves_its_failed_tasks_failed_and_lists_them_once() {
        let mut q = Queue::new(cfg(3, 0), specs(3));
        fail_for_good(&mut q, 0);
        finish(&mut q, "a", &[5], 1);
        finish(&mut q, "a", &[5], 2);
        // Pass 1: task 1 fails for good too, the others are done.
        finish(&mut q, "a", &[5], 3);
        assert_eq!(fail_for_good(&mut q, 4), 1);
        finish(&mut q, "a", &[5], 5);
        assert_eq!(q.pass(), 2);
        assert_eq!(q.meta().failed.len(), 2);
        // Shard 0 restarted from nothing (a SIGKILL before its first checkpoint): back to
        // pass 0, where the failed task stays failed; pass 1 then skips its failed task.
        let r = q.rewind(&restore(0, 9, 0, &[]));
        assert_eq!(r.back_to_pass, Some(0));
        assert_eq!(
            r.tasks,
            2 + 2,
            "two of pass 0 and two of pass 1, not the failed ones"
        );
        assert!(matches!(q.tasks()[0].state, TaskState::Failed));
        let mut now = 10;
        while q.pass() < 1 {
            finish(&mut q, "a", &[9], now);
            now += 1;
        }
        assert!(
            matches!(q.tasks()[1].state, TaskState::Failed),
            "failed in pass 1 before: not retried"
        );
        assert_eq!(q.counts().todo, 2);
        while !q.meta().finished {
            finish(&mut q, "a", &[9], now);
            now += 1;
        }
        assert_eq!(
            q.meta().failed.len(),
            2,
            "each failure listed once per pass"
        );
        assert_eq!(q.meta().counters.failed_tasks, 2);
    }

    #[test]
    fn a_reload_keeps_a_task_failed_in_a_pass_gone_back_to_failed() {
        let mut q = Queue::new(cfg(2, 0), specs(2));
        let (mut tasks, mut meta, mut failed) = (BTreeMap::new(), Meta::default(), Vec::new());
        let mut persist = |q: &mut Queue| {
            let c = q.take_changes();
            for t in c.tasks {
                tasks.insert(t.spec.id.clone(), t);
            }
            if let Some(m) = c.meta {
                meta = m;
            }
            failed.extend(c.failed);
            (
                tasks.values().cloned().collect::<Vec<_>>(),
                meta.clone(),
                failed.clone(),
            )
        };
        // Pass 0 done; in pass 1 task 1 fails for good, and the job finishes.
        finish(&mut q, "a", &[5], 0);
        finish(&mut q, "a", &[5], 1);
        finish(&mut q, "a", &[5], 2);
        assert_eq!(fail_for_good(&mut q, 3), 1);
        assert!(q.meta().finished);
        persist(&mut q);
        // Shard 0 restarted from nothing: back to pass 0, trained whole again; pass 1
        // then starts with task 1 failed (only the task record of pass 0 is stored).
        assert_eq!(q.rewind(&restore(0, 9, 0, &[])).back_to_pass, Some(0));
        finish(&mut q, "a", &[9], 4);
        finish(&mut q, "a", &[9], 5);
        assert_eq!(q.pass(), 1);
        assert!(matches!(q.tasks()[1].state, TaskState::Failed));
        let (tasks, meta, failed) = persist(&mut q);
        let r = Queue::restore(cfg(2, 0), meta, tasks, failed, 10);
        assert!(matches!(r.tasks()[1].state, TaskState::Failed), "as live");
        assert_eq!(r.counts().todo, 1);
    }

    #[test]
    fn a_task_rewound_past_max_losses_fails_for_good_with_the_reason() {
        // max_losses 2: two rewinds are trained again, the third fails the task.
        let mut q = Queue::new(cfg(1, 2), specs(2));
        for n in 0..3u64 {
            let t = take(&mut q, "a", n);
            assert_eq!(q.position(&t.spec.id), Some(0), "a rewound task goes first");
            if n < 2 {
                q.released(
                    &t.spec.id,
                    t.generation,
                    &Release::Recompute {
                        trained: t.spec.records,
                    },
                )
                .unwrap();
            } else {
                // The last one through an acknowledgement lacking in a restored shard.
                q.rewind(&restore(0, 9, 0, &[]));
                q.finished(&t.spec.id, t.generation, t.spec.records, &[5], n)
                    .unwrap();
            }
        }
        assert!(matches!(q.tasks()[0].state, TaskState::Failed));
        let c = &q.meta().counters;
        assert_eq!((c.recomputed, c.failed_tasks), (2, 1), "{c:?}");
        let f = &q.meta().failed[0];
        assert!(f.reason.contains("pserver shard's restore"), "{}", f.reason);
        // The other task still finishes the pass.
        finish(&mut q, "a", &[9], 10);
        assert!(q.meta().finished);
    }
}
