//! An op's bytes on the replication stream: written by the primary, read back and
//! validated by a backup (as a trainer's push is: a damaged op is an error, never a
//! panic or a wrong update).

use bytes::{Buf, BufMut, Bytes};
use edl_job::FailedRecord;

use super::super::ShardCore;
use super::super::ledger::Origin;
use super::super::lock;
use super::super::push::{BlockValues, RawPush, TableRows};
use super::{KIND_PUSH, KIND_SETTLE, KIND_STEP, KIND_TASK_DONE, ShardOp};
use crate::error::PsError;
use crate::sync::CloseJob;

impl ShardCore {
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
                        b.put_u32_le(o.count);
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
                    b.put_u32_le(o.count);
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
                        count: c.u32()?,
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
        let origins = (0..c.count(16)?)
            .map(|_| {
                let o = Origin {
                    pass: c.u32()?,
                    task: c.u32()?,
                    seq: c.u32()?,
                    count: c.u32()?,
                };
                super::super::ledger::Ledger::check(o).map_err(|e| bad(e.to_string()))?;
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
