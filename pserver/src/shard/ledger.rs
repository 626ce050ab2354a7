//! The ledger of one shard: which tasks' updates its parameters contain. It makes every
//! batch's gradients count exactly once, across retries, stale sync steps, trainers lost
//! mid-task, and restores from a checkpoint; and it tells the master, after a restore,
//! which acknowledged tasks must be trained again.
//!
//! A push of a trainer's task carries its [`Origin`]: the pass, the task's index in the
//! dataset, and the run of batches it sums, `[seq, seq + count)` by their sequence
//! numbers within the task (the same batches in every attempt at the task: batching is
//! deterministic; how they are grouped into pushes need not be). Once the trainer's last
//! push of a task is applied it tells every shard the task is *complete*
//! ([`Ledger::complete`]), then acknowledges it to the master.
//!
//! Invariants (checked by the property test below):
//! - a batch is applied at most once: a run is [`LedgerMark::Fresh`] (and marked) only when
//!   none of its batches was, [`LedgerMark::Repeat`] when all were or its task is complete, and
//!   [`LedgerMark::Overlap`] (nothing marked, the push refused) when some were: another
//!   attempt at the task grouped the same batches otherwise (only a task's first
//!   attempt in a pass groups freely, later ones push batch by batch, so the attempt
//!   refused is one whose task was taken away from it);
//! - [`Ledger::contains`] of a task is true exactly when it was completed here (or its
//!   pass was sealed), and stays true;
//! - a pass is *sealed* (its per-task set dropped) only when every task of it is
//!   complete and every earlier pass is sealed;
//! - the ledger is a value: a snapshot taken with the parameters (under the same lock
//!   that orders pushes, see `async_apply` and `sync_apply`) says exactly which updates
//!   the snapshot holds.
//!
//! Memory: a bitset of tasks per unsealed pass, and a bitset of sequence numbers per
//! task started and not complete (bounded by the tasks in flight, plus those abandoned
//! by lost trainers until they are trained again).

use std::collections::BTreeMap;

use edl_job::ledger::{Bits, LedgerSummary};
use serde::{Deserialize, Serialize};

/// Largest batch sequence number in a task (a task of more batches is refused).
pub const MAX_SEQ: u32 = 1 << 24;
/// Largest task count of a dataset the ledger tracks.
pub const MAX_TASKS: u32 = 1 << 26;

/// Where a push's gradients come from (the client names it with each push).
pub use edl_pserver_api::Origin;

/// What the ledger says of a push's origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LedgerMark {
    /// None of its batches applied before: apply it.
    Fresh,
    /// Already applied (a retry, a stale step resent, or a task trained again).
    Repeat,
    /// Some of its batches applied before, not all (by another attempt at the task):
    /// refused, nothing marked.
    Overlap,
}

/// Largest run of batches one push may sum.
pub const MAX_COUNT: u32 = 1 << 16;

/// The key of task `task` of pass `pass` in the partial map (a number, so that the
/// ledger serialises as JSON).
fn key(pass: u32, task: u32) -> u64 {
    (u64::from(pass) << 32) | u64::from(task)
}

/// Why a completion or a push is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    /// An origin or task count out of range.
    #[error("{0}")]
    OutOfRange(String),
}

/// The ledger of one shard.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ledger {
    /// Every task of every pass below this one is contained.
    sealed: u32,
    /// Tasks per pass (learnt from completions; 0 until the first).
    tasks: u32,
    /// Per unsealed pass: the tasks completed here.
    complete: BTreeMap<u32, Bits>,
    /// Per task started and not complete (keyed by [`key`]): the batches applied.
    partial: BTreeMap<u64, Bits>,
}

impl Ledger {
    /// Whether `origin` may be marked: in range.
    pub fn check(origin: Origin) -> Result<(), LedgerError> {
        let end = u64::from(origin.seq) + u64::from(origin.count);
        if end > u64::from(MAX_SEQ)
            || origin.task >= MAX_TASKS
            || origin.count == 0
            || origin.count > MAX_COUNT
        {
            return Err(LedgerError::OutOfRange(format!(
                "push origin {origin:?} out of range (at most {MAX_TASKS} tasks, {MAX_SEQ} \
                 batches per task and 1 to {MAX_COUNT} batches per push)"
            )));
        }
        Ok(())
    }

    /// Whether every update of task `task` of pass `pass` is contained.
    pub fn contains(&self, pass: u32, task: u32) -> bool {
        pass < self.sealed || self.complete.get(&pass).is_some_and(|b| b.has(task))
    }

    /// What marking `origin` would say, changing nothing.
    pub fn peek(&self, origin: Origin) -> LedgerMark {
        if self.contains(origin.pass, origin.task) {
            return LedgerMark::Repeat;
        }
        let Some(bits) = self.partial.get(&key(origin.pass, origin.task)) else {
            return LedgerMark::Fresh;
        };
        let batches = origin.seq..origin.seq.saturating_add(origin.count);
        let applied = batches.clone().filter(|&b| bits.has(b)).count();
        match applied {
            0 => LedgerMark::Fresh,
            n if n == batches.len() => LedgerMark::Repeat,
            _ => LedgerMark::Overlap,
        }
    }

    /// Marks `origin`'s batches applied when it is [`LedgerMark::Fresh`]; says what it was.
    pub fn mark(&mut self, origin: Origin) -> Result<LedgerMark, LedgerError> {
        Self::check(origin)?;
        let m = self.peek(origin);
        if m == LedgerMark::Fresh {
            let bits = self
                .partial
                .entry(key(origin.pass, origin.task))
                .or_default();
            for b in origin.seq..origin.seq + origin.count {
                bits.insert(b);
            }
        }
        Ok(m)
    }

    /// Task `task` of pass `pass` (of a dataset of `tasks` tasks) is complete: every push
    /// of it was applied. Seals the passes complete from the lowest unsealed one on.
    pub fn complete(&mut self, pass: u32, task: u32, tasks: u32) -> Result<(), LedgerError> {
        if tasks == 0 || tasks > MAX_TASKS || task >= tasks {
            return Err(LedgerError::OutOfRange(format!(
                "task {task} of a dataset of {tasks} tasks (at most {MAX_TASKS})"
            )));
        }
        if self.tasks != 0 && self.tasks != tasks {
            return Err(LedgerError::OutOfRange(format!(
                "the dataset has {} tasks, not {tasks}",
                self.tasks
            )));
        }
        self.tasks = tasks;
        self.partial.remove(&key(pass, task));
        if pass < self.sealed {
            return Ok(());
        }
        self.complete.entry(pass).or_default().insert(task);
        while self
            .complete
            .get(&self.sealed)
            .is_some_and(|b| b.count() == u64::from(self.tasks))
        {
            self.complete.remove(&self.sealed);
            let sealed = self.sealed;
            self.partial.retain(|&k, _| (k >> 32) as u32 > sealed);
            self.sealed += 1;
        }
        Ok(())
    }

    /// What the master needs after a restore from this ledger: which tasks of which
    /// passes are contained.
    pub fn summary(&self) -> LedgerSummary {
        LedgerSummary {
            sealed: self.sealed,
            complete: self.complete.clone(),
        }
    }

    /// Tasks started and not complete (for status and tests).
    pub fn partial_tasks(&self) -> usize {
        self.partial.len()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashSet};

    use proptest::prelude::*;

    use super::*;

    fn o(pass: u32, task: u32, seq: u32) -> Origin {
        Origin::batch(pass, task, seq)
    }

    fn run(pass: u32, task: u32, seq: u32, count: u32) -> Origin {
        Origin {
            pass,
            task,
            seq,
            count,
        }
    }

    #[test]
    fn runs_of_batches_apply_whole_or_not_at_all() {
        let mut l = Ledger::default();
        assert_eq!(l.mark(run(0, 1, 0, 4)).unwrap(), LedgerMark::Fresh);
        assert_eq!(
            l.mark(run(0, 1, 0, 4)).unwrap(),
            LedgerMark::Repeat,
            "a retry"
        );
        assert_eq!(
            l.mark(o(0, 1, 2)).unwrap(),
            LedgerMark::Repeat,
            "inside the run"
        );
        assert_eq!(l.mark(run(0, 1, 1, 2)).unwrap(), LedgerMark::Repeat);
        // Another attempt grouped batches 2..6 together: 2 and 3 are in, 4 and 5 not.
        assert_eq!(l.peek(run(0, 1, 2, 4)), LedgerMark::Overlap);
        assert_eq!(l.mark(run(0, 1, 2, 4)).unwrap(), LedgerMark::Overlap);
        assert_eq!(
            l.mark(o(0, 1, 4)).unwrap(),
            LedgerMark::Fresh,
            "the refused run marked nothing"
        );
        assert_eq!(l.mark(run(0, 1, 5, 3)).unwrap(), LedgerMark::Fresh);
        assert!(l.mark(run(0, 1, 9, 0)).is_err(), "an empty run");
        assert!(
            l.mark(run(0, 1, MAX_SEQ - 1, 2)).is_err(),
            "past the last batch"
        );
        assert!(l.mark(run(0, 1, 0, MAX_COUNT + 1)).is_err(), "too long");
        l.complete(0, 1, 2).unwrap();
        assert_eq!(l.peek(run(0, 1, 7, 9)), LedgerMark::Repeat, "complete");
    }

    #[test]
    fn batches_count_once_and_complete_tasks_seal_their_pass() {
        let mut l = Ledger::default();
        assert_eq!(l.mark(o(0, 1, 0)).unwrap(), LedgerMark::Fresh);
        assert_eq!(l.mark(o(0, 1, 1)).unwrap(), LedgerMark::Fresh);
        assert_eq!(l.mark(o(0, 1, 1)).unwrap(), LedgerMark::Repeat, "a retry");
        assert_eq!(l.peek(o(0, 1, 0)), LedgerMark::Repeat);
        assert_eq!(l.peek(o(0, 1, 2)), LedgerMark::Fresh);
        assert!(!l.contains(0, 1));
        l.complete(0, 1, 2).unwrap();
        assert!(l.contains(0, 1));
        assert_eq!(
            l.mark(o(0, 1, 5)).unwrap(),
            LedgerMark::Repeat,
            "a task trained again after it completed counts nothing"
        );
        assert_eq!(l.partial_tasks(), 0);
        assert_eq!(l.mark(o(1, 0, 0)).unwrap(), LedgerMark::Fresh, "next pass");
        l.complete(0, 0, 2).unwrap();
        let s = l.summary();
        assert_eq!(s.sealed, 1, "pass 0 complete: sealed");
        assert!(s.complete.is_empty());
        assert!(s.contains(0, 0) && s.contains(0, 1) && !s.contains(1, 0));
        assert_eq!(
            l.mark(o(0, 0, 0)).unwrap(),
            LedgerMark::Repeat,
            "sealed pass"
        );
        assert!(l.complete(0, 0, 3).is_err(), "the task count is fixed");
        assert!(l.complete(1, 2, 2).is_err(), "task out of range");
        assert!(l.mark(o(0, 0, MAX_SEQ)).is_err());
    }

    #[test]
    fn a_pass_with_a_task_left_out_stays_unsealed() {
        let mut l = Ledger::default();
        l.complete(0, 0, 2).unwrap();
        l.complete(1, 0, 2).unwrap();
        l.complete(1, 1, 2).unwrap();
        let s = l.summary();
        assert_eq!(s.sealed, 0, "task 1 of pass 0 never completed");
        assert!(s.contains(1, 1) && !s.contains(0, 1));
        l.complete(0, 1, 2).unwrap();
        assert_eq!(l.summary().sealed, 2, "both passes seal at once");
    }

    #[test]
    fn the_ledger_survives_a_snapshot_as_json() {
        let mut l = Ledger::default();
        l.mark(o(3, 100, 7)).unwrap();
        l.complete(3, 99, 200).unwrap();
        let back: Ledger = serde_json::from_str(&serde_json::to_string(&l).unwrap()).unwrap();
        assert_eq!(back, l);
        assert_eq!(back.peek(o(3, 100, 7)), LedgerMark::Repeat);
        assert!(back.contains(3, 99));
    }

    proptest! {
        /// Against a model (a set of applied batches and of complete tasks), in any
        /// order of marks of runs and completions: each batch is applied once, a run
        /// whole or not at all, containment follows completion, and sealing drops
        /// nothing still needed.
        #[test]
        fn matches_a_set_model(ops in prop::collection::vec(
            (any::<bool>(), 0u32..3, 0u32..4, 0u32..6, 1u32..4), 1..200)
        ) {
            const TASKS: u32 = 4;
            let mut l = Ledger::default();
            let mut applied: HashSet<(u32, u32, u32)> = HashSet::new();
            let mut complete: BTreeSet<(u32, u32)> = BTreeSet::new();
            for (is_mark, pass, task, seq, count) in ops {
                if is_mark {
                    let m = l.mark(run(pass, task, seq, count)).unwrap();
                    let done = (seq..seq + count)
                        .filter(|&b| applied.contains(&(pass, task, b)))
                        .count() as u32;
                    let expect = if complete.contains(&(pass, task)) || done == count {
                        LedgerMark::Repeat
                    } else if done == 0 {
                        LedgerMark::Fresh
                    } else {
                        LedgerMark::Overlap
                    };
                    prop_assert_eq!(m, expect);
                    if m == LedgerMark::Fresh {
                        applied.extend((seq..seq + count).map(|b| (pass, task, b)));
                    }
                } else {
                    l.complete(pass, task, TASKS).unwrap();
                    complete.insert((pass, task));
                }
                let s = l.summary();
                for p in 0..3 {
                    for t in 0..TASKS {
                        prop_assert_eq!(l.contains(p, t), complete.contains(&(p, t)));
                        prop_assert_eq!(s.contains(p, t), complete.contains(&(p, t)));
                        for b in 0..9 {
                            let want = complete.contains(&(p, t)) || applied.contains(&(p, t, b));
                            prop_assert_eq!(l.peek(o(p, t, b)) == LedgerMark::Repeat, want);
                        }
                    }
                    let all = (0..TASKS).all(|t| complete.contains(&(p, t)));
                    let below = (0..p).all(|q| (0..TASKS).all(|t| complete.contains(&(q, t))));
                    prop_assert_eq!(p < s.sealed, all && below);
                }
            }
        }
    }
}
