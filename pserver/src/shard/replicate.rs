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

use super::dedup::Mark as DedupMark;
use super::ledger::{Mark as LedgerMark, Origin};
use super::push::{BlockValues, Push, PushReply, RawPush, TableRows};
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
                if lock(&self.ledger).applied(o) {
                    DedupMark::Repeat
                } else {
                    DedupMark::Fresh
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
            if let Some(o) = origins.iter().find(|o| ledger.applied(**o)) {
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

    /// The bytes of `op` on the replication stream.
    pub fn encode_op(&self, op: &ShardOp) -> Bytes {
        let mut b = Vec::new();
        match op {
            ShardOp::Push { push, update } => {
                b.put_u8(KIND_PUSH);
                b.put_u64_le(*update);
                put_str(&mut b, &push.trainer);
                b.put_u64_le(push.session);
                b.put_u64_le(push.step);
                match push.origin {
                    Some(o) => {
                        b.put_u8(1);
                        b.put_u32_le(o.pass);
                        b.put_u32_le(o.task);
                        b.put_u32_le(o.seq);
                    }
                    None => b.put_u8(0),
                }
                let ids = self.layout.shard_blocks(self.index);
                b.put_u32_le(push.dense.len() as u32);
                for (local, values) in &push.dense {
                    b.put_u32_le(ids[*local]);
                    put_bytes(&mut b, values);
                }
                b.put_u32_le(push.sparse.len() as u32);
                for s in &push.sparse {
                    b.put_u32_le(s.table as u32);
                    b.put_u32_le(s.rows.len() as u32);
                    for r in &s.rows {
                        b.put_u64_le(*r);
                    }
                    put_bytes(&mut b, &s.values);
                }
            }
            ShardOp::TaskDone { pass, task, tasks } => {
                b.put_u8(KIND_TASK_DONE);
                b.put_u32_le(*pass);
                b.put_u32_le(*task);
                b.put_u32_le(*tasks);
            }
            ShardOp::Step {
                job,
                update,
                dropped,
                dense,
                sparse,
                origins,
            } => {
                b.put_u8(KIND_STEP);
                b.put_u64_le(job.step);
                b.put_u32_le(job.contributors);
                b.put_u32_le(job.timed_out);
                b.put_u64_le(*update);
                b.put_u8(u8::from(*dropped));
                b.put_u32_le(origins.len() as u32);
                for o in origins {
                    b.put_u32_le(o.pass);
                    b.put_u32_le(o.task);
                    b.put_u32_le(o.seq);
                }
                b.put_u32_le(dense.len() as u32);
                for (local, values) in dense {
                    b.put_u32_le(*local as u32);
                    put_bytes(&mut b, &crate::wire::encode(values));
                }
                b.put_u32_le(sparse.len() as u32);
                for (table, row, values) in sparse {
                    b.put_u32_le(*table as u32);
                    b.put_u64_le(*row);
                    put_bytes(&mut b, &crate::wire::encode(values));
                }
            }
            ShardOp::Settle(r) => {
                b.put_u8(KIND_SETTLE);
                b.put_u32_le(r.pass);
                b.put_u32_le(r.tasks);
                b.put_u32_le(r.failed.len() as u32);
                for t in &r.failed {
                    b.put_u32_le(*t);
                }
            }
        }
        Bytes::from(b)
    }

    /// An op read from the replication stream, validated against this shard.
    pub fn decode_op(&self, bytes: Bytes) -> Result<ShardOp, PsError> {
        let bad = |what: &str| PsError::InvalidArgument(format!("replicated op: {what}"));
        let mut c = OpReader { buf: bytes };
        let op = match c.u8()? {
            KIND_PUSH => {
                let update = c.u64()?;
                let trainer = c.string()?;
                let session = c.u64()?;
                let step = c.u64()?;
                let origin = match c.u8()? {
                    0 => None,
                    1 => Some(Origin {
                        pass: c.u32()?,
                        task: c.u32()?,
                        seq: c.u32()?,
                    }),
                    _ => return Err(bad("bad origin flag")),
                };
                let n = c.count(8)?;
                let mut dense = Vec::with_capacity(n);
                for _ in 0..n {
                    let id = c.u32()?;
                    dense.push(BlockValues {
                        id,
                        values: c.bytes()?,
                    });
                }
                let n = c.count(12)?;
                let mut sparse = Vec::with_capacity(n);
                for _ in 0..n {
                    let table = c.u32()?;
                    let rows = (0..c.count(8)?)
                        .map(|_| c.u64())
                        .collect::<Result<_, _>>()?;
                    sparse.push(TableRows {
                        table,
                        rows,
                        values: c.bytes()?,
                    });
                }
                let push = self.validate_push(RawPush {
                    trainer,
                    session,
                    step,
                    dense,
                    sparse,
                    origin,
                })?;
                ShardOp::Push { push, update }
            }
            KIND_TASK_DONE => ShardOp::TaskDone {
                pass: c.u32()?,
                task: c.u32()?,
                tasks: c.u32()?,
            },
            KIND_SETTLE => {
                let pass = c.u32()?;
                let tasks = c.u32()?;
                let failed = (0..c.count(4)?)
                    .map(|_| c.u32())
                    .collect::<Result<_, _>>()?;
                ShardOp::Settle(FailedRecord {
                    version: edl_job::RECORD_VERSION,
                    pass,
                    tasks,
                    failed,
                })
            }
            KIND_STEP => self.decode_step(&mut c)?,
            k => return Err(bad(&format!("unknown kind {k}"))),
        };
        if c.buf.has_remaining() {
            return Err(bad("trailing bytes"));
        }
        Ok(op)
    }
}

impl ShardCore {
    /// A step's op, its values checked against this shard's layout.
    fn decode_step(&self, c: &mut OpReader) -> Result<ShardOp, PsError> {
        let bad = |what: String| PsError::InvalidArgument(format!("replicated step: {what}"));
        let job = CloseJob {
            step: c.u64()?,
            contributors: c.u32()?,
            timed_out: c.u32()?,
        };
        let update = c.u64()?;
        let dropped = match c.u8()? {
            0 => false,
            1 => true,
            f => return Err(bad(format!("bad flag {f}"))),
        };
        let origins = (0..c.count(12)?)
            .map(|_| {
                let o = Origin {
                    pass: c.u32()?,
                    task: c.u32()?,
                    seq: c.u32()?,
                };
                super::ledger::Ledger::check(o).map_err(|e| bad(e.to_string()))?;
                Ok(o)
            })
            .collect::<Result<Vec<_>, PsError>>()?;
        let floats = |c: &mut OpReader, len: usize| -> Result<Vec<f32>, PsError> {
            let bytes = c.bytes()?;
            if bytes.len() != len * 4 {
                return Err(bad(format!(
                    "{} bytes where {len} floats belong",
                    bytes.len()
                )));
            }
            let v = crate::wire::decode(&bytes);
            if v.iter().any(|x| !x.is_finite()) {
                return Err(bad("a summed gradient is not finite".into()));
            }
            Ok(v)
        };
        let mut dense = Vec::new();
        for _ in 0..c.count(8)? {
            let local = c.u32()? as usize;
            let b = self
                .blocks
                .get(local)
                .ok_or_else(|| bad(format!("block {local} is not in this shard")))?;
            let len = lock(b).values.len();
            dense.push((local, floats(c, len)?));
        }
        let mut sparse = Vec::new();
        for _ in 0..c.count(16)? {
            let table = c.u32()? as usize;
            let row = c.u64()?;
            let dim = self
                .tables
                .get(table)
                .ok_or_else(|| bad(format!("no table {table}")))?
                .dim;
            sparse.push((table, row, floats(c, dim)?));
        }
        Ok(ShardOp::Step {
            job,
            update,
            dropped,
            dense,
            sparse,
            origins,
        })
    }

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

fn put_str(b: &mut Vec<u8>, s: &str) {
    put_bytes(b, s.as_bytes());
}

fn put_bytes(b: &mut Vec<u8>, v: &[u8]) {
    b.put_u32_le(v.len() as u32);
    b.put_slice(v);
}

/// A bounds-checked reader of an op's bytes.
struct OpReader {
    buf: Bytes,
}

impl OpReader {
    fn need(&self, n: usize) -> Result<(), PsError> {
        if self.buf.remaining() < n {
            return Err(PsError::InvalidArgument(format!(
                "replicated op: truncated ({} bytes left, {n} needed)",
                self.buf.remaining()
            )));
        }
        Ok(())
    }

    fn u8(&mut self) -> Result<u8, PsError> {
        self.need(1)?;
        Ok(self.buf.get_u8())
    }

    fn u32(&mut self) -> Result<u32, PsError> {
        self.need(4)?;
        Ok(self.buf.get_u32_le())
    }

    fn u64(&mut self) -> Result<u64, PsError> {
        self.need(8)?;
        Ok(self.buf.get_u64_le())
    }

    /// A count of items of at least `min_bytes` each: bounded by the bytes left, so that
    /// a damaged count allocates nothing.
    fn count(&mut self, min_bytes: usize) -> Result<usize, PsError> {
        let n = self.u32()? as usize;
        self.need(n.saturating_mul(min_bytes))?;
        Ok(n)
    }

    fn bytes(&mut self) -> Result<Bytes, PsError> {
        let n = self.u32()? as usize;
        self.need(n)?;
        Ok(self.buf.split_to(n))
    }

    fn string(&mut self) -> Result<String, PsError> {
        String::from_utf8(self.bytes()?.to_vec())
            .map_err(|_| PsError::InvalidArgument("replicated op: trainer id not UTF-8".into()))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use proptest::prelude::*;

    use super::*;
    use crate::layout::Mode;
    use crate::shard::testutil::{core, push};

    /// What a replica holds, for comparison: the snapshot (values, slots, versions,
    /// ledger, update count) and the deduplication table.
    fn state(c: &ShardCore) -> (crate::checkpoint::Snapshot, Vec<(String, u64, u64, u64)>) {
        (c.snapshot(0), lock(&c.dedup).entries())
    }

    /// A change a trainer or the master asks of a primary.
    #[derive(Debug, Clone)]
    enum Ask {
        /// (trainer, session, step, gradient, rows, origin (pass, task, seq))
        Push(u8, u8, u8, i8, Vec<u8>, Option<(u8, u8, u8)>),
        TaskDone(u8, u8),
        Settle(u8, u8),
    }

    fn ask() -> impl Strategy<Value = Ask> {
        prop_oneof![
            8 => (0u8..3, 0u8..2, 0u8..80, -3i8..4, prop::collection::vec(0u8..6, 0..4),
                  prop::option::of((0u8..2, 0u8..4, 0u8..3)))
                .prop_map(|(t, s, st, g, r, o)| Ask::Push(t, s, st, g, r, o)),
            1 => (0u8..2, 0u8..4).prop_map(|(p, t)| Ask::TaskDone(p, t)),
            1 => (0u8..2, 0u8..4).prop_map(|(p, t)| Ask::Settle(p, t)),
        ]
    }

    /// Applies `a` on the primary; the ops it makes go to `log`, as bytes.
    fn run(c: &ShardCore, a: &Ask, log: &Mutex<Vec<Bytes>>) {
        let order = |op: &ShardOp| {
            log.lock().unwrap().push(c.encode_op(op));
            Ok(())
        };
        match a {
            Ask::Push(t, s, st, g, rows, origin) => {
                let rows: Vec<u64> = rows.iter().map(|&r| u64::from(r)).collect();
                let mut raw = push(
                    c,
                    &format!("t{t}"),
                    u64::from(*s),
                    u64::from(*st),
                    f32::from(*g),
                    &rows,
                );
                raw.origin = origin.map(|(pass, task, seq)| Origin {
                    pass: u32::from(pass),
                    task: u32::from(task),
                    seq: u32::from(seq),
                });
                let p = c.validate_push(raw).unwrap();
                let _ = c.apply_async_ordered(&p, order);
            }
            Ask::TaskDone(pass, task) => {
                let _ = c.task_done_ordered(u32::from(*pass), u32::from(*task), 4, 0, order);
            }
            Ask::Settle(pass, task) => {
                let r = FailedRecord {
                    version: edl_job::RECORD_VERSION,
                    pass: u32::from(*pass),
                    tasks: 4,
                    failed: [u32::from(*task)].into(),
                };
                let _ = c.settle_ordered(&r, order);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// A backup replaying the primary's ops, through their bytes, holds the
        /// primary's state bitwise, after every op.
        #[test]
        fn a_backup_replaying_the_ops_holds_the_primarys_state(
            asks in prop::collection::vec(ask(), 0..120),
        ) {
            let primary = core(Mode::Async, 0, 1);
            let backup = core(Mode::Async, 0, 1);
            let log = Mutex::new(Vec::new());
            let mut replayed = 0;
            for a in &asks {
                let before = state(&primary);
                let made = log.lock().unwrap().len();
                run(&primary, a, &log);
                let ops: Vec<Bytes> = log.lock().unwrap()[replayed..].to_vec();
                prop_assert!(ops.len() <= 1);
                if ops.is_empty() {
                    // No op, no change (a repeat, or refused).
                    prop_assert_eq!(&state(&primary), &before);
                    prop_assert_eq!(log.lock().unwrap().len(), made);
                }
                for bytes in ops {
                    let op = backup.decode_op(bytes).unwrap();
                    backup.replay(&op).unwrap();
                    replayed += 1;
                }
                prop_assert_eq!(state(&backup), state(&primary));
            }
        }
    }

    /// A joiner built from a snapshot, then following the ops since, holds the
    /// primary's state; a damaged snapshot is refused.
    #[test]
    fn a_joiner_from_a_snapshot_and_the_ops_since_holds_the_primarys_state() {
        let primary = core(Mode::Async, 0, 1);
        let log = Mutex::new(Vec::new());
        let asks: Vec<Ask> = (0..40u8)
            .map(|i| {
                let origin = (i % 3 == 0).then_some((0, i % 4, i / 4));
                Ask::Push(i % 3, 0, i, (i % 5) as i8 - 2, vec![i % 6], origin)
            })
            .collect();
        for a in &asks[..20] {
            run(&primary, a, &log);
        }
        let (bytes, ops_held) = primary
            .replica_snapshot(|| log.lock().unwrap().len())
            .unwrap();
        for a in &asks[20..] {
            run(&primary, a, &log);
        }
        let joiner = ShardCore::from_replica_snapshot(bytes.clone(), 9, Arc::default()).unwrap();
        for op in log.lock().unwrap()[ops_held..].iter().cloned() {
            joiner.replay(&joiner.decode_op(op).unwrap()).unwrap();
        }
        assert_eq!(state(&joiner), state(&primary));
        // Witness: the deduplication table travelled (sessions without an origin).
        assert!(!lock(&joiner.dedup).entries().is_empty());
        for cut in [0, 3, 10, bytes.len() / 2, bytes.len() - 1] {
            assert!(
                ShardCore::from_replica_snapshot(bytes.slice(..cut), 9, Arc::default()).is_err(),
                "cut at {cut}"
            );
        }
    }

    /// Sync mode: a backup replaying the primary's steps (and tasks) holds its state
    /// bitwise after every step, through overflowing steps, repeats and trainers that
    /// leave; a stream that refuses leaves the step unapplied.
    #[test]
    fn a_backup_replaying_sync_steps_holds_the_primarys_state() {
        let primary = core(Mode::sync(), 0, 1);
        let backup = core(Mode::sync(), 0, 1);
        let log: Arc<Mutex<Vec<Bytes>>> = Arc::default();
        let (l, p) = (log.clone(), Arc::new(core(Mode::sync(), 0, 1)));
        // The stream encodes with a shard of the same layout (encoding reads only it).
        primary
            .set_stream(OpStream(Arc::new(move |op| {
                l.lock().unwrap().push(p.encode_op(op));
                Ok(())
            })))
            .unwrap();
        let now = tokio::time::Instant::now();
        primary.sync_set_members(["a".to_string(), "b".to_string()].into());
        let mut replayed = 0;
        let mut steps_seen = 0;
        for step in 1..=30u64 {
            for (t, g) in [("a", 1.0), ("b", (step % 7) as f32 - 3.0)] {
                let mut raw = push(&primary, t, 1, step, g, &[step % 4, 5]);
                raw.origin = (step % 3 != 0).then_some(Origin {
                    pass: 0,
                    task: u32::from(t == "b"),
                    seq: step as u32,
                });
                if step == 10 {
                    // A sum that overflows: the step is dropped, on both.
                    raw.dense[0].values = crate::wire::encode(&[f32::MAX; 4]);
                }
                let p = primary.validate_push(raw).unwrap();
                primary.sync_push(&p, now).unwrap();
            }
            if step == 20 {
                primary.task_done(0, 0, 4, 0).unwrap();
            }
            let ops: Vec<Bytes> = log.lock().unwrap()[replayed..].to_vec();
            for bytes in ops {
                let op = backup.decode_op(bytes).unwrap();
                steps_seen += usize::from(matches!(op, ShardOp::Step { .. }));
                backup.replay(&op).unwrap();
                replayed += 1;
            }
            assert_eq!(backup.last_closed(), primary.last_closed());
            assert_eq!(state(&backup), state(&primary), "after step {step}");
        }
        assert_eq!(steps_seen, 30);
        // Witness: step 10 was dropped (counted as refused), the others applied.
        assert_eq!(
            primary.counters.nonfinite_rejected.load(Ordering::Relaxed),
            1
        );
        assert_eq!(backup.updates(), primary.updates());
        assert_eq!(primary.last_closed(), 30);
        // A step applied again on the backup is a divergence (its batches are in).
        let ops = log.lock().unwrap().clone();
        let first_step = ops
            .iter()
            .map(|b| backup.decode_op(b.clone()).unwrap())
            .find(|op| matches!(op, ShardOp::Step { origins, .. } if !origins.is_empty()))
            .unwrap();
        assert!(backup.replay(&first_step).is_err());
    }

    #[test]
    fn a_sync_step_refused_by_the_stream_is_not_applied() {
        let c = core(Mode::sync(), 0, 1);
        c.set_stream(OpStream(Arc::new(|_| {
            Err(PsError::NotServing("not primary".into()))
        })))
        .unwrap();
        c.sync_set_members(["a".to_string()].into());
        let before = state(&c);
        let p = c.validate_push(push(&c, "a", 1, 1, 2.0, &[3])).unwrap();
        assert_eq!(
            c.sync_push(&p, tokio::time::Instant::now()).unwrap(),
            crate::sync::Admit::Join { step: 1 }
        );
        assert_eq!(c.last_closed(), 0, "closed without the stream");
        assert_eq!(state(&c).0.blocks, before.0.blocks);
    }

    #[test]
    fn an_op_refused_by_the_stream_changes_nothing() {
        let c = core(Mode::Async, 0, 1);
        let mut raw = push(&c, "t", 1, 1, 1.0, &[3]);
        raw.origin = Some(Origin {
            pass: 0,
            task: 1,
            seq: 0,
        });
        let p = c.validate_push(raw).unwrap();
        let before = state(&c);
        let refused = c.apply_async_ordered(&p, |_| Err(PsError::NotServing("not primary".into())));
        assert!(matches!(refused, Err(PsError::NotServing(_))));
        assert_eq!(state(&c), before);
        // Witness: the same push is applied once the stream takes it.
        assert!(c.apply_async_ordered(&p, |_| Ok(())).unwrap().applied);
        assert_ne!(state(&c), before);
        let refused = c.task_done_ordered(0, 1, 4, 0, |_| Err(PsError::NotServing("no".into())));
        assert!(refused.is_err());
        assert!(!c.contains().contains(0, 1));
    }

    /// Two trainers push at once: the ops are in the order the primary decided, and a
    /// backup replaying them holds the same ledger, table and update count, and (the
    /// gradients being small integers, exact in any order) the same values.
    #[test]
    fn concurrent_pushes_replay_to_the_same_shard() {
        let primary = Arc::new(core(Mode::Async, 0, 1));
        let log = Arc::new(Mutex::new(Vec::new()));
        let threads: Vec<_> = (0..2)
            .map(|t| {
                let (c, log) = (primary.clone(), log.clone());
                std::thread::spawn(move || {
                    for step in 1..=200u64 {
                        let mut raw =
                            push(&c, &format!("t{t}"), 1, step, (t + 1) as f32, &[step % 5]);
                        raw.origin = (step % 2 == 0).then_some(Origin {
                            pass: 0,
                            task: t,
                            seq: step as u32,
                        });
                        let p = c.validate_push(raw).unwrap();
                        c.apply_async_ordered(&p, |op| {
                            log.lock().unwrap().push(c.encode_op(op));
                            Ok(())
                        })
                        .unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let backup = core(Mode::Async, 0, 1);
        let ops = log.lock().unwrap().clone();
        assert_eq!(ops.len(), 400);
        for bytes in ops {
            backup.replay(&backup.decode_op(bytes).unwrap()).unwrap();
        }
        assert_eq!(state(&backup), state(&primary));
        // A replayed op applied again is a divergence, said as such.
        let again = push(&backup, "t0", 1, 199, 1.0, &[]);
        let p = backup.validate_push(again).unwrap();
        let err = backup
            .replay(&ShardOp::Push {
                push: p,
                update: 400,
            })
            .unwrap_err();
        assert!(err.to_string().contains("diverged"), "{err}");
    }

    #[test]
    fn a_damaged_op_is_an_error_not_a_panic() {
        let c = core(Mode::Async, 0, 1);
        let mut raw = push(&c, "t", 1, 1, 1.0, &[3, 4]);
        raw.origin = Some(Origin {
            pass: 0,
            task: 1,
            seq: 0,
        });
        let p = c.validate_push(raw).unwrap();
        let ops = [
            ShardOp::Push { push: p, update: 7 },
            ShardOp::TaskDone {
                pass: 1,
                task: 2,
                tasks: 4,
            },
            ShardOp::Settle(FailedRecord {
                version: edl_job::RECORD_VERSION,
                pass: 0,
                tasks: 4,
                failed: [1, 3].into(),
            }),
            ShardOp::Step {
                job: CloseJob {
                    step: 3,
                    contributors: 2,
                    timed_out: 0,
                },
                update: 2,
                dropped: false,
                dense: vec![(0, vec![1.0; 4])],
                sparse: vec![(0, 7, vec![2.0, 3.0])],
                origins: vec![Origin {
                    pass: 0,
                    task: 2,
                    seq: 1,
                }],
            },
        ];
        for op in &ops {
            let bytes = c.encode_op(op);
            // Witness: the whole op decodes.
            assert!(c.decode_op(bytes.clone()).is_ok());
            for cut in 0..bytes.len() {
                assert!(c.decode_op(bytes.slice(..cut)).is_err(), "cut at {cut}");
            }
            let mut longer = bytes.to_vec();
            longer.push(0);
            assert!(c.decode_op(Bytes::from(longer)).is_err());
            let mut kind = bytes.to_vec();
            kind[0] = 99;
            assert!(c.decode_op(Bytes::from(kind)).is_err());
        }
        // A gradient made infinite in transit is refused as from a trainer.
        let bytes = c.encode_op(&ops[0]).to_vec();
        let at = bytes.len() - 4;
        let mut bad = bytes.clone();
        bad[at..].copy_from_slice(&f32::INFINITY.to_le_bytes());
        assert!(c.decode_op(Bytes::from(bad)).is_err());
    }
}
