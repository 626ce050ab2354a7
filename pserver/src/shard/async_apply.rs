//! Async mode: each push applied as it comes, at most once: per origin (a task's batch,
//! see `ledger`) when it has one, else per (trainer, session, step) (see `dedup`);
//! block by block under each block's own lock, and the whole push under the step lock
//! held for reading, so that a snapshot (holding it for writing) has it whole or not at
//! all.

use std::cell::RefCell;

use super::push::{Push, PushReply};
use super::{ShardCore, bump, lock};
use crate::error::PsError;
use crate::wire;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl ShardCore {
    /// Async mode: applies `push` unless it was applied before (handing the op to the
    /// replication stream when there is one: [`ShardCore::apply_async_ordered`]). A push more than
    /// [`DEDUP_WINDOW`](super::DEDUP_WINDOW) steps behind its session's newest is refused
    /// ([`PsError::StepTooOld`]): whether it was applied can no longer be told.
    pub fn apply_async(&self, push: &Push) -> Result<PushReply, PsError> {
        self.apply_async_ordered(push, |op| self.to_stream(op))
    }

    /// Applies the values of `push` as update number `update` (its learning rate), block
    /// by block under each block's lock (the caller holds the step lock for reading and
    /// marked the push).
    pub(super) fn apply_push_values(&self, push: &Push, update: u64) {
        let lr = self.optimizer.lr(update);
        for (local, bytes) in &push.dense {
            let mut b = lock(&self.blocks[*local]);
            let b = &mut *b;
            // The gradient read in place where the bytes allow (one pass over them, the
            // update's), else decoded into this thread's scratch.
            SCRATCH.with_borrow_mut(|scratch| {
                let g = wire::floats(bytes, scratch);
                self.optimizer.step(lr, &mut b.values, g, 1.0, &mut b.state);
            });
            b.version += 1;
        }
        let overflowed: usize = push
            .sparse
            .iter()
            .map(|s| self.apply_rows(s, lr, 1.0))
            .sum();
        if overflowed > 0 {
            bump(&self.counters.nonfinite_rejected);
            tracing::warn!(
                shard = self.index,
                trainer = %push.trainer,
                rows = overflowed,
                "repeated sparse rows summed past f32's range; those rows left as they were"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::layout::Mode;
    use crate::shard::testutil::{all, core, push};

    #[test]
    fn async_pushes_apply_once_each() {
        let c = core(Mode::Async, 0, 1);
        let p = c
            .validate_push(push(&c, "t", 1, 1, 1.0, &[5, 5, 7]))
            .unwrap();
        assert!(c.apply_async(&p).unwrap().applied);
        assert!(
            !c.apply_async(&p).unwrap().applied,
            "a retry is not applied twice"
        );
        let p2 = c.validate_push(push(&c, "t", 1, 2, 2.0, &[])).unwrap();
        assert!(c.apply_async(&p2).unwrap().applied);
        assert!(all(&c).iter().all(|&v| v == -3.0), "{:?}", all(&c));
        // Row 5 appeared twice in one push: summed, applied once (-2); row 7: -1.
        let rows = wire::decode(&c.pull_sparse(0, &[5, 7, 9], 1 << 20).unwrap());
        assert_eq!(rows, vec![-2.0, -2.0, -1.0, -1.0, 0.0, 0.0]);
        // A pull larger than the message limit is refused before anything is allocated.
        assert_eq!(c.pull_sparse(0, &[5, 7], 16).unwrap().len(), 16);
        assert!(matches!(
            c.pull_sparse(0, &[5, 7, 9], 16),
            Err(PsError::InvalidArgument(_))
        ));
        // A push older than the window is refused, not silently dropped.
        let p_new = c.validate_push(push(&c, "t", 1, 200, 1.0, &[])).unwrap();
        assert!(c.apply_async(&p_new).unwrap().applied);
        let p_old = c.validate_push(push(&c, "t", 1, 3, 1.0, &[])).unwrap();
        let err = c.apply_async(&p_old).unwrap_err();
        assert!(
            matches!(
                err,
                PsError::StepTooOld {
                    step: 3,
                    newest: 200,
                    ..
                }
            ),
            "{err}"
        );
        let status: tonic::Status = err.into();
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
        // A new session of the same trainer starts over.
        let p3 = c.validate_push(push(&c, "t", 2, 1, 1.0, &[])).unwrap();
        assert!(c.apply_async(&p3).unwrap().applied);
        assert_eq!(c.counters.duplicate_pushes.load(Ordering::Relaxed), 1);
    }
}
