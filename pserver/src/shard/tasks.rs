//! Tasks on the shard's side: a trainer's `TaskDone` records a task as contained once
//! every push of it was applied by this very incarnation, a task the master failed for
//! good is settled, and the ledger's summary is what a restored shard tells the master.

use std::sync::atomic::Ordering;

use edl_job::FailedRecord;
use edl_job::ledger::LedgerSummary;

use super::{ShardCore, bump, lock};
use crate::error::PsError;

impl ShardCore {
    /// Task `task` of pass `pass` (of `tasks`) is done: every push of it was answered by
    /// incarnation `pushed_to` of this shard (0: it had no push). Recorded as contained
    /// when that is this incarnation, or the one whose final checkpoint this shard was
    /// restored from (a graceful restart: every push it answered is here); otherwise
    /// [`PsError::Rewound`] (the shard was restored since, from a checkpoint that may
    /// lack some of those pushes: the task is trained again, and its batches already
    /// contained count nothing).
    pub fn task_done(
        &self,
        pass: u32,
        task: u32,
        tasks: u32,
        pushed_to: u64,
    ) -> Result<(), PsError> {
        self.task_done_ordered(pass, task, tasks, pushed_to, |op| self.to_stream(op))
    }

    /// Whether a `TaskDone` whose pushes went to incarnation `pushed_to` may be recorded
    /// here.
    pub(super) fn check_task_done(
        &self,
        pass: u32,
        task: u32,
        pushed_to: u64,
    ) -> Result<(), PsError> {
        // 0: no push of the task reached this shard (every batch skipped): nothing to
        // hold, so nothing was lost either.
        if pushed_to != 0 && pushed_to != self.incarnation && pushed_to != self.holds_all_of {
            bump(&self.counters.tasks_rewound);
            return Err(PsError::Rewound {
                shard: self.index,
                pass,
                task,
                pushed_to,
                now: self.incarnation,
            });
        }
        Ok(())
    }

    /// Records task `task` of pass `pass` as contained.
    pub(super) fn complete_task(&self, pass: u32, task: u32, tasks: u32) -> Result<(), PsError> {
        lock(&self.ledger)
            .complete(pass, task, tasks)
            .map_err(|e| self.invalid(e.to_string()))?;
        self.counters.tasks_done.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Settles the tasks the master failed for good (`job/failed/<pass>`): complete in
    /// the ledger, as no more of their pushes will come (those applied count), so that
    /// their pass seals and no restore from this ledger asks for them again.
    pub fn settle(&self, r: &FailedRecord) -> Result<(), PsError> {
        self.settle_ordered(r, |op| self.to_stream(op))
    }

    /// [`ShardCore::settle`]'s change of the ledger.
    pub(super) fn settle_ledger(&self, r: &FailedRecord) -> Result<(), PsError> {
        let mut ledger = lock(&self.ledger);
        for &task in &r.failed {
            ledger
                .complete(r.pass, task, r.tasks)
                .map_err(|e| self.invalid(e.to_string()))?;
        }
        Ok(())
    }

    /// The tasks whose updates the shard contains.
    pub fn contains(&self) -> LedgerSummary {
        lock(&self.ledger).summary()
    }

    /// The shard's index.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The incarnation (claim revision) of this copy of the shard.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }
}

#[cfg(test)]
mod tests {
    use crate::error::PsError;
    use crate::layout::Mode;
    use crate::shard::testutil::{all, core, push};
    use crate::shard::{Origin, ShardCore};

    #[test]
    fn async_batches_apply_once_and_a_restore_keeps_the_ledger() {
        let c = core(Mode::Async, 0, 1);
        let o = |seq| {
            Some(Origin {
                pass: 0,
                task: 3,
                seq,
                count: 1,
            })
        };
        let mut p = push(&c, "a", 1, 1, 1.0, &[]);
        p.origin = o(0);
        let p = c.validate_push(p).unwrap();
        assert!(c.apply_async(&p).unwrap().applied);
        // The same batch from another trainer (the task was taken over), another session,
        // another step: not applied again.
        let mut q = push(&c, "b", 9, 7, 1.0, &[]);
        q.origin = o(0);
        let q = c.validate_push(q).unwrap();
        assert!(!c.apply_async(&q).unwrap().applied);
        assert!(all(&c).iter().all(|&v| v == -1.0));
        let snap = c.snapshot(1);
        let r = ShardCore::restore(snap, 99, Default::default()).unwrap();
        assert!(!r.apply_async(&q).unwrap().applied, "the ledger came back");
        assert!(matches!(
            r.task_done(0, 3, 10, c.incarnation()),
            Err(PsError::Rewound { now: 99, .. })
        ));
        r.task_done(0, 3, 10, 99).unwrap();
        assert!(r.contains().contains(0, 3));
        assert!(!r.contains().contains(0, 2));
    }

    /// A push summing a run of batches is applied whole or not at all: a run that
    /// another attempt at the task partly applied is refused (nothing of it applied,
    /// counted, an `overlap` status), and the batches it held that were not applied stay
    /// open to the attempt that holds the task.
    #[test]
    fn a_run_of_batches_partly_applied_by_another_attempt_is_refused_whole() {
        use std::sync::atomic::Ordering;

        let c = core(Mode::Async, 0, 1);
        let at = |trainer: &str, step: u64, seq: u32, count: u32| {
            let mut p = push(&c, trainer, 1, step, 1.0, &[]);
            p.origin = Some(Origin {
                pass: 0,
                task: 3,
                seq,
                count,
            });
            c.validate_push(p).unwrap()
        };
        // The first attempt pushed batches 0..4 as one run; a later attempt pushes batch
        // by batch: batch 4 is new, batch 2 is not.
        assert!(c.apply_async(&at("a", 1, 0, 4)).unwrap().applied);
        assert!(c.apply_async(&at("b", 1, 4, 1)).unwrap().applied);
        assert!(!c.apply_async(&at("b", 2, 2, 1)).unwrap().applied);
        assert!(all(&c).iter().all(|&v| v == -2.0), "two pushes applied");
        // The first attempt, its task taken away, pushes batches 4..8: refused whole.
        let err = c.apply_async(&at("a", 2, 4, 4)).unwrap_err();
        assert!(
            matches!(
                err,
                PsError::Overlap {
                    task: 3,
                    first: 4,
                    count: 4,
                    ..
                }
            ),
            "{err}"
        );
        assert!(all(&c).iter().all(|&v| v == -2.0), "nothing of it applied");
        assert_eq!(c.counters.overlap_refused.load(Ordering::Relaxed), 1);
        let status: tonic::Status = err.into();
        assert_eq!(
            edl_pserver_api::error::ErrorKind::of(&status),
            Some(edl_pserver_api::error::ErrorKind::Overlap)
        );
        // Its batches 5..8 were not marked: the holder's pushes of them apply.
        for (step, seq) in [(3, 5), (4, 6), (5, 7)] {
            assert!(c.apply_async(&at("b", step, seq, 1)).unwrap().applied);
        }
        assert!(all(&c).iter().all(|&v| v == -5.0));
    }

    /// A task the master failed for good is settled: its pass seals (the ledger stays
    /// bounded) and a restore's summary holds it, on the ready core and on every core
    /// made ready later (a restore installed after the record was read).
    #[test]
    fn a_task_failed_for_good_is_settled_and_its_pass_seals() {
        use edl_job::FailedRecord;

        use crate::shard::Shard;

        let record = FailedRecord {
            version: edl_job::RECORD_VERSION,
            pass: 0,
            tasks: 3,
            failed: [2].into(),
        };
        let c = core(Mode::Async, 0, 1);
        c.task_done(0, 0, 3, 0).unwrap();
        c.task_done(0, 1, 3, 0).unwrap();
        assert_eq!(c.contains().sealed, 0, "task 2 is neither done nor settled");
        let snap = c.snapshot(1);
        c.settle(&record).unwrap();
        assert_eq!(c.contains().sealed, 1, "pass 0 sealed");
        // A shard restored from a snapshot taken before the failure was settled.
        let shard = Shard::new(0, 1, 99, Default::default());
        shard.settle(vec![record]);
        shard.install(ShardCore::restore(snap, 99, Default::default()).unwrap());
        assert_eq!(shard.core().unwrap().contains().sealed, 1);
    }

    /// A shard restored from the final checkpoint of the incarnation before it (a
    /// graceful restart) holds every push that incarnation answered: a task whose pushes
    /// it answered is done here, not trained again; one answered by an older one is not.
    #[test]
    fn a_final_checkpoint_holds_every_push_its_incarnation_answered() {
        let c = core(Mode::Async, 0, 1);
        let mut p = push(&c, "a", 1, 1, 1.0, &[]);
        p.origin = Some(Origin {
            pass: 0,
            task: 3,
            seq: 0,
            count: 1,
        });
        let p = c.validate_push(p).unwrap();
        assert!(c.apply_async(&p).unwrap().applied);
        let mut snap = c.snapshot(1);
        snap.final_of = c.incarnation();
        let r = ShardCore::restore(snap, 99, Default::default()).unwrap();
        r.task_done(0, 3, 10, c.incarnation()).unwrap();
        assert!(r.contains().contains(0, 3));
        assert!(matches!(
            r.task_done(0, 4, 10, c.incarnation() - 1),
            Err(PsError::Rewound { now: 99, .. })
        ));
    }
}
