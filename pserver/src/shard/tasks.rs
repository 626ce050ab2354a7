//! Tasks on the shard's side: a trainer's `TaskDone` records a task as contained once
//! every push of it was applied by this very incarnation, and the ledger's summary is
//! what a restored shard tells the master.

use std::sync::atomic::Ordering;

use edl_job::ledger::LedgerSummary;

use super::{ShardCore, bump, lock};
use crate::error::PsError;

impl ShardCore {
    /// Task `task` of pass `pass` (of `tasks`) is done: every push of it was answered by
    /// incarnation `pushed_to` of this shard (0: it had no push). Recorded as contained when that is this
    /// incarnation; otherwise [`PsError::Rewound`] (the shard was restored since, from a
    /// checkpoint that may lack some of those pushes: the task is trained again, and its
    /// batches already contained count nothing).
    pub fn task_done(
        &self,
        pass: u32,
        task: u32,
        tasks: u32,
        pushed_to: u64,
    ) -> Result<(), PsError> {
        // 0: no push of the task reached this shard (every batch skipped): nothing to
        // hold, so nothing was lost either.
        if pushed_to != 0 && pushed_to != self.incarnation {
            bump(&self.counters.tasks_rewound);
            return Err(PsError::Rewound {
                shard: self.index,
                pass,
                task,
                pushed_to,
                now: self.incarnation,
            });
        }
        lock(&self.ledger)
            .complete(pass, task, tasks)
            .map_err(|e| self.invalid(e.to_string()))?;
        self.counters.tasks_done.fetch_add(1, Ordering::Relaxed);
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
}
