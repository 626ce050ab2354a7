//! A shard's changes as ops, for its replicas (docs/replication.md): what the primary
//! changed, in the order it decided, so that a backup applying the same ops in the same
//! order holds the same shard.
//!
//! Invariants (checked by the property test below):
//! - an op is made only of a change: a repeated push, a refused one, or a `TaskDone`
//!   refused as rewound makes none;
//! - everything that decides a change (the ledger's and the deduplication table's marks,
//!   the update counter that sets a push's learning rate) is taken under the shard's
//!   order lock together with the op's place in the stream, and a refusal by the stream
//!   (no longer primary) leaves the shard unchanged; so a backup applying the ops in
//!   order takes the same decisions: every mark is fresh there too, and each push gets
//!   the same learning rate and update number;
//! - applied one at a time on the primary, ops leave the backup bitwise equal to it
//!   (values, optimizer slots, block versions, ledger, deduplication table, update
//!   count). Concurrent async pushes are applied to the primary's blocks in parallel: two
//!   of them may reach one block in either order there, in op order on the backup, and
//!   the values then differ by float rounding only (as between any two async runs);
//!   the rest is equal;
//! - an op decoded from bytes is validated as a push from a trainer is (layout, lengths,
//!   finite values): a damaged stream is an error, never a panic or a wrong update.

use std::sync::atomic::Ordering;

use bytes::{Buf, BufMut, Bytes};
use edl_job::FailedRecord;

use super::dedup::DedupMark;
use super::ledger::{LedgerMark, Origin};
use super::push::{Push, PushReply};
use super::{ShardCore, bump, lock};
use crate::error::PsError;
use crate::sync::CloseJob;

/// One change of a shard, as its primary made it.
#[derive(Debug, Clone)]
pub enum ShardOp {
    /// Async mode: `push` applied as update number `update` (its learning rate).
    Push {
        /// The push, validated.
        push: Push,
        /// Its update number.
        update: u64,
    },
    /// A task recorded as contained (`TaskDone`).
    TaskDone {
        /// The pass.
        pass: u32,
        /// The task.
        task: u32,
        /// The dataset's task count.
        tasks: u32,
    },
    /// Tasks failed for good, settled in the ledger.
    Settle(FailedRecord),
    /// Sync mode: a step closed: the gradients its contributors summed, applied as their
    /// mean as update number `update` (or dropped, when the sum overflowed), and the
    /// batches it contains.
    Step {
        /// The step, its contributors and the trainers it timed out.
        job: CloseJob,
        /// Its update number.
        update: u64,
        /// The sum overflowed f32's range: nothing applied.
        dropped: bool,
        /// Summed gradients of the dense blocks that have some (local index, values).
        dense: Vec<(usize, Vec<f32>)>,
        /// Summed gradients of sparse rows, per table (table, row, values).
        sparse: Vec<(usize, u64, Vec<f32>)>,
        /// The task batches the step contains.
        origins: Vec<Origin>,
    },
}

/// Where a primary's ops go: the replication stream gives each op its place (and logs
/// it), or refuses it (this replica is no longer primary).
#[derive(Clone)]
pub struct OpStream(pub std::sync::Arc<OpFn>);

/// What an [`OpStream`] calls with each op.
pub type OpFn = dyn Fn(&ShardOp) -> Result<(), PsError> + Send + Sync;

impl std::fmt::Debug for OpStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OpStream")
    }
}

const KIND_PUSH: u8 = 1;
const KIND_TASK_DONE: u8 = 2;
const KIND_SETTLE: u8 = 3;
const KIND_STEP: u8 = 4;

impl ShardCore {
    /// Makes this shard a primary whose ops go to `stream`. Set once.
    pub fn set_stream(&self, stream: OpStream) -> Result<(), PsError> {
        self.stream
            .set(stream)
            .map_err(|_| PsError::Internal("the replication stream is set already".into()))
    }

    /// Whether this shard's ops go to a replication stream.
    pub fn has_stream(&self) -> bool {
        self.stream.get().is_some()
    }

    /// Hands `op` to the replication stream, if there is one.
    pub(super) fn to_stream(&self, op: &ShardOp) -> Result<(), PsError> {
        self.stream.get().map_or(Ok(()), |s| (s.0)(op))
    }

    /// Sync mode: the op of closing `job` (the caller holds the step lock for writing).
    pub(super) fn step_op(&self, job: CloseJob, finite: bool) -> ShardOp {
        let origins = lock(&self.open_origins)
            .iter()
            .filter(|(step, _)| *step <= job.step)
            .map(|(_, o)| *o)
            .collect();
        let (mut dense, mut sparse) = (Vec::new(), Vec::new());
        if finite {
            for (local, b) in self.blocks.iter().enumerate() {
                let b = lock(b);
                if b.has_acc {
                    dense.push((local, b.acc.clone()));
                }
            }
            for (ti, t) in self.tables.iter().enumerate() {
                for stripe in &t.stripes {
                    for (r, v) in &lock(stripe).acc {
                        sparse.push((ti, *r, v.clone()));
                    }
                }
            }
            sparse.sort_by_key(|(t, r, _)| (*t, *r));
        }
        ShardOp::Step {
            job,
            update: self.updates(),
            dropped: !finite,
            dense,
            sparse,
            origins,
        }
    }

    /// Async mode, on a primary: applies `push` unless it was applied before, as
    /// [`ShardCore::apply_async`] does, handing the op to `order` first, under the order
    /// lock: `order` gives the op its place in the stream (and logs it). If `order`
    /// refuses, nothing changed.
    pub fn apply_async_ordered(
        &self,
        push: &Push,
        order: impl FnOnce(&ShardOp) -> Result<(), PsError>,
    ) -> Result<PushReply, PsError> {
        let _gate = self
            .step_lock
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let update = {
            let _order = lock(&self.order);
            match self.peek(push)? {
                DedupMark::Fresh => {}
                DedupMark::Repeat => {
                    bump(&self.counters.duplicate_pushes);
                    return Ok(PushReply {
                        applied: false,
                        step: self.updates(),
                    });
                }
                DedupMark::TooOld { newest } => {
                    bump(&self.counters.invalid_rejected);
                    return Err(PsError::StepTooOld {
                        step: push.step,
                        newest,
                        window: super::DEDUP_WINDOW,
                    });
                }
            }
            let update = self.updates.load(Ordering::Acquire);
            order(&ShardOp::Push {
                push: push.clone(),
                update,
            })?;
            self.mark_fresh(push)?;
            self.updates.store(update + 1, Ordering::Release);
            update
        };
        self.apply_push_values(push, update);
        bump(&self.counters.pushes_applied);
        Ok(PushReply {
            applied: true,
            step: update + 1,
        })
    }

    /// What the ledger or the deduplication table says of `push`, changing nothing.
    fn peek(&self, push: &Push) -> Result<DedupMark, PsError> {
        Ok(match push.origin {
            Some(o) => {
                super::ledger::Ledger::check(o).map_err(|e| self.invalid(e.to_string()))?;
                match lock(&self.ledger).peek(o) {
                    LedgerMark::Fresh => DedupMark::Fresh,
                    LedgerMark::Repeat => DedupMark::Repeat,
                    LedgerMark::Overlap => return Err(self.overlap(o)),
                }
            }
            None => lock(&self.dedup).peek(&push.trainer, push.session, push.step),
        })
    }

    /// Marks `push` applied; an error if it was (a backup whose stream diverged).
    fn mark_fresh(&self, push: &Push) -> Result<(), PsError> {
        let fresh = match push.origin {
            Some(o) => {
                lock(&self.ledger)
                    .mark(o)
                    .map_err(|e| self.invalid(e.to_string()))?
                    == LedgerMark::Fresh
            }
            None => {
                lock(&self.dedup).mark(&push.trainer, push.session, push.step) == DedupMark::Fresh
            }
        };
        if fresh {
            Ok(())
        } else {
            Err(PsError::Internal(format!(
                "shard {}: a replicated push of trainer {} step {} was applied here before \
                 (the replica diverged)",
                self.index, push.trainer, push.step
            )))
        }
    }

    /// A `TaskDone` on a primary: [`ShardCore::task_done`], with the op handed to
    /// `order` under the order lock once the task is accepted.
    pub fn task_done_ordered(
        &self,
        pass: u32,
        task: u32,
        tasks: u32,
        pushed_to: u64,
        order: impl FnOnce(&ShardOp) -> Result<(), PsError>,
    ) -> Result<(), PsError> {
        let _order = lock(&self.order);
        self.check_task_done(pass, task, pushed_to)?;
        order(&ShardOp::TaskDone { pass, task, tasks })?;
        self.complete_task(pass, task, tasks)
    }

    /// Settles tasks failed for good on a primary, with the op handed to `order`.
    pub fn settle_ordered(
        &self,
        r: &FailedRecord,
        order: impl FnOnce(&ShardOp) -> Result<(), PsError>,
    ) -> Result<(), PsError> {
        let _order = lock(&self.order);
        order(&ShardOp::Settle(r.clone()))?;
        self.settle_ledger(r)
    }

    /// On a backup: applies `op`, made by the primary, in stream order.
    pub fn replay(&self, op: &ShardOp) -> Result<(), PsError> {
        match op {
            ShardOp::Push { push, update } => {
                let _gate = self
                    .step_lock
                    .read()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                {
                    let _order = lock(&self.order);
                    self.mark_fresh(push)?;
                    self.updates.fetch_max(update + 1, Ordering::AcqRel);
                }
                self.apply_push_values(push, *update);
                bump(&self.counters.pushes_applied);
                Ok(())
            }
            ShardOp::TaskDone { pass, task, tasks } => {
                let _order = lock(&self.order);
                self.complete_task(*pass, *task, *tasks)
            }
            ShardOp::Settle(r) => {
                let _order = lock(&self.order);
                self.settle_ledger(r)
            }
            ShardOp::Step {
                job,
                update,
                dropped,
                dense,
                sparse,
                origins,
            } => self.replay_step(*job, *update, *dropped, dense, sparse, origins),
        }
    }

    /// On a backup: applies a step as its primary closed it.
    fn replay_step(
        &self,
        job: CloseJob,
        update: u64,
        dropped: bool,
        dense: &[(usize, Vec<f32>)],
        sparse: &[(usize, u64, Vec<f32>)],
        origins: &[Origin],
    ) -> Result<(), PsError> {
        let Some(sync) = &self.sync else {
            return Err(PsError::Internal(format!(
                "shard {}: a sync step replicated to an async shard",
                self.index
            )));
        };
        let _applying = self
            .step_lock
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        {
            let ledger = lock(&self.ledger);
            if let Some(o) = origins
                .iter()
                .find(|o| ledger.peek(**o) != LedgerMark::Fresh)
            {
                return Err(PsError::Internal(format!(
                    "shard {}: step {} holds batch {o:?}, applied here before (the replica \
                     diverged)",
                    self.index, job.step
                )));
            }
        }
        self.clear_accumulated();
        if !dropped {
            for (local, acc) in dense {
                let mut b = lock(&self.blocks[*local]);
                b.acc.clone_from(acc);
                b.has_acc = true;
            }
            for (table, row, v) in sparse {
                let t = &self.tables[*table];
                lock(&t.stripes[super::storage::stripe_of(*row)])
                    .acc
                    .insert(*row, v.clone());
            }
            self.updates.store(update, Ordering::Release);
            self.apply_accumulated(job);
        }
        {
            let mut ledger = lock(&self.ledger);
            for o in origins {
                let _ = ledger.mark(*o);
            }
        }
        lock(&self.open_origins).retain(|(step, _)| *step > job.step);
        bump(&self.counters.steps_closed);
        lock(sync).replayed(job.step);
        self.closed_tx.send_replace(job.step);
        Ok(())
    }
}

impl ShardCore {
    /// A copy of the whole shard for a joining replica, with the deduplication table
    /// (which checkpoints do not hold), taken between two ops: no op is being decided or
    /// applied meanwhile. `at` runs at that moment and tells the last op the copy holds.
    pub fn replica_snapshot<T>(&self, at: impl FnOnce() -> T) -> Result<(Bytes, T), PsError> {
        let (snap, dedup, t) = {
            let _cut = self
                .step_lock
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let _order = lock(&self.order);
            let mut dedup = Vec::new();
            lock(&self.dedup).encode(&mut dedup);
            let t = at();
            // What the shard was restored from travels too: a promoted joiner judges
            // `TaskDone`s as its primary did.
            let mut snap = self.snapshot_at(self.restored_from, self.last_closed());
            snap.final_of = self.holds_all_of;
            (snap, dedup, t)
        };
        let mut b = Vec::with_capacity(4 + dedup.len());
        b.put_u32_le(dedup.len() as u32);
        b.extend_from_slice(&dedup);
        let file = crate::checkpoint::format::encode(&snap)
            .map_err(|e| PsError::Internal(format!("replica snapshot not written: {e}")))?;
        b.extend_from_slice(&file);
        Ok((Bytes::from(b), t))
    }

    /// A shard built from a [`ShardCore::replica_snapshot`]'s bytes, verified as a
    /// checkpoint file is.
    pub fn from_replica_snapshot(
        mut bytes: Bytes,
        incarnation: u64,
        checkpoints: std::sync::Arc<super::CheckpointHooks>,
    ) -> Result<ShardCore, PsError> {
        let bad = |what: String| PsError::InvalidArgument(format!("replica snapshot: {what}"));
        let n = bytes
            .try_get_u32_le()
            .map_err(|_| bad("truncated".into()))? as usize;
        if bytes.remaining() < n {
            return Err(bad("truncated deduplication table".into()));
        }
        let mut dedup_bytes = bytes.split_to(n);
        let dedup = super::dedup::Dedup::decode(&mut dedup_bytes)
            .filter(|_| !dedup_bytes.has_remaining())
            .ok_or_else(|| bad("damaged deduplication table".into()))?;
        let (snap, _) = crate::checkpoint::format::decode(&bytes).map_err(bad)?;
        let core = ShardCore::restore(snap, incarnation, checkpoints)?;
        *lock(&core.dedup) = dedup;
        Ok(core)
    }
}

mod wire;

#[cfg(test)]
mod tests;
