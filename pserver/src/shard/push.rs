//! A push as it arrives ([`RawPush`]: gradients as little-endian floats, not yet
//! checked) and as the shard applies it ([`Push`]: validated against the layout).
//!
//! Invariant: a [`Push`] names only blocks and rows of this shard, each block at most
//! once, with the lengths the layout gives and finite values; a push that fails any
//! check is refused whole, and nothing of it is applied.

use bytes::Bytes;

use super::ledger::{Ledger, Origin};
use super::{ShardCore, bump};
use crate::error::PsError;
use crate::wire;

/// Values of one dense block as little-endian `f32`s: gradients in a push, initial
/// values in `Init`.
#[derive(Debug, Clone)]
pub struct BlockValues {
    /// Global block id.
    pub id: u32,
    /// Little-endian `f32` values.
    pub values: Bytes,
}

/// Gradients of rows of one sparse table: `rows.len() * dim` little-endian `f32`s, row
/// after row.
#[derive(Debug, Clone)]
pub struct TableRows {
    /// Index of the table in the model spec.
    pub table: u32,
    /// Row ids (repeats are summed).
    pub rows: Vec<u64>,
    /// Little-endian `f32` values.
    pub values: Bytes,
}

/// A push as received, not yet checked against the shard.
#[derive(Debug, Clone)]
pub struct RawPush {
    /// The trainer.
    pub trainer: String,
    /// Random per client instance: a restarted trainer with the same id starts a new
    /// sequence of steps.
    pub session: u64,
    /// Async: the trainer's own step (strictly increasing per session). Sync: the global
    /// step the gradients belong to.
    pub step: u64,
    /// Gradients of dense blocks.
    pub dense: Vec<BlockValues>,
    /// Gradients of sparse rows.
    pub sparse: Vec<TableRows>,
    /// The task batch the gradients come from (applied at most once per origin).
    pub origin: Option<Origin>,
}

/// Sparse gradients of one table, validated.
#[derive(Debug, Clone)]
pub struct SparseUpdate {
    pub(super) table: usize,
    pub(super) rows: Vec<u64>,
    pub(super) values: Bytes,
}

/// A validated push: every block and row belongs to this shard, lengths match, values
/// are finite.
#[derive(Debug, Clone)]
pub struct Push {
    /// The trainer.
    pub trainer: String,
    /// Its session.
    pub session: u64,
    /// The step.
    pub step: u64,
    /// The task batch the gradients come from.
    pub origin: Option<Origin>,
    pub(super) dense: Vec<(usize, Bytes)>,
    pub(super) sparse: Vec<SparseUpdate>,
}

/// Result of a push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushReply {
    /// False for a duplicate.
    pub applied: bool,
    /// Async: the shard's update count after it; sync: the step.
    pub step: u64,
}

impl ShardCore {
    pub(super) fn invalid(&self, msg: String) -> PsError {
        bump(&self.counters.invalid_rejected);
        PsError::InvalidArgument(msg)
    }

    /// The refusal of a push whose run of batches `o` another attempt partly applied
    /// (counted).
    pub(super) fn overlap(&self, o: super::ledger::Origin) -> PsError {
        bump(&self.counters.overlap_refused);
        PsError::Overlap {
            pass: o.pass,
            task: o.task,
            first: o.seq,
            count: o.count,
        }
    }

    /// Validates a push request: blocks and rows of this shard, lengths, finiteness.
    /// Nothing is applied when this fails.
    pub fn validate_push(&self, req: RawPush) -> Result<Push, PsError> {
        if req.trainer.is_empty() || req.trainer.contains('/') {
            return Err(self.invalid(format!(
                "trainer id {:?} must be non-empty and contain no '/'",
                req.trainer
            )));
        }
        if let Some(o) = req.origin {
            Ledger::check(o).map_err(|e| self.invalid(e.to_string()))?;
        }
        let mut dense = Vec::with_capacity(req.dense.len());
        let mut seen = vec![false; self.blocks.len()];
        for b in req.dense {
            let Some(info) = self.layout.block(b.id).filter(|i| i.shard == self.index) else {
                return Err(self.invalid(format!(
                    "block {} is not a block of shard {}",
                    b.id, self.index
                )));
            };
            if Some(b.values.len()) != wire::byte_len(info.len) {
                return Err(self.invalid(format!(
                    "block {} of parameter {:?} has {} bytes of gradient, expected {} ({} floats)",
                    b.id,
                    self.param_name(info.param),
                    b.values.len(),
                    info.len * 4,
                    info.len
                )));
            }
            let local = info.local as usize;
            if std::mem::replace(&mut seen[local], true) {
                return Err(self.invalid(format!("block {} appears twice", b.id)));
            }
            if !wire::all_finite(&b.values) {
                bump(&self.counters.nonfinite_rejected);
                return Err(PsError::NonFinite(format!(
                    "block {} of parameter {:?}",
                    b.id,
                    self.param_name(info.param)
                )));
            }
            dense.push((local, b.values));
        }
        let mut sparse = Vec::with_capacity(req.sparse.len());
        for s in req.sparse {
            let Some(t) = self.tables.get(s.table as usize) else {
                return Err(self.invalid(format!("unknown table {}", s.table)));
            };
            let name = &self.spec().sparse[s.table as usize].name;
            if Some(s.values.len()) != s.rows.len().checked_mul(t.dim * 4) {
                return Err(self.invalid(format!(
                    "table {name:?}: {} bytes of gradient for {} rows of {} floats",
                    s.values.len(),
                    s.rows.len(),
                    t.dim
                )));
            }
            if let Some(r) = s
                .rows
                .iter()
                .find(|&&r| self.layout.row_shard(r) != self.index)
            {
                return Err(self.invalid(format!(
                    "row {r} of table {name:?} belongs to shard {}, not {}",
                    self.layout.row_shard(*r),
                    self.index
                )));
            }
            if !wire::all_finite(&s.values) {
                bump(&self.counters.nonfinite_rejected);
                return Err(PsError::NonFinite(format!("rows of table {name:?}")));
            }
            sparse.push(SparseUpdate {
                table: s.table as usize,
                rows: s.rows,
                values: s.values,
            });
        }
        Ok(Push {
            trainer: req.trainer,
            session: req.session,
            step: req.step,
            origin: req.origin,
            dense,
            sparse,
        })
    }

    fn param_name(&self, param: u32) -> &str {
        self.spec()
            .dense
            .get(param as usize)
            .map_or("?", |d| d.name.as_str())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::layout::Mode;
    use crate::shard::testutil::{all, core, push};

    #[test]
    fn bad_pushes_are_refused_whole_and_counted() {
        let c = core(Mode::Async, 0, 2);
        let mut req = push(&c, "t", 1, 1, 1.0, &[]);
        let mut bad = wire::decode(&req.dense[0].values);
        bad[1] = f32::NAN;
        req.dense[0].values = wire::encode(&bad);
        assert!(matches!(c.validate_push(req), Err(PsError::NonFinite(_))));
        let mut req = push(&c, "t", 1, 1, 1.0, &[]);
        req.dense[0].values.truncate(4);
        assert!(matches!(
            c.validate_push(req),
            Err(PsError::InvalidArgument(_))
        ));
        let mut req = push(&c, "t", 1, 1, 1.0, &[]);
        req.dense[0].id = 1; // block 1 lives on shard 1
        assert!(matches!(
            c.validate_push(req),
            Err(PsError::InvalidArgument(_))
        ));
        let foreign = (0..100u64).find(|&r| c.layout().row_shard(r) == 1).unwrap();
        let req = push(&c, "t", 1, 1, 1.0, &[foreign]);
        assert!(matches!(
            c.validate_push(req),
            Err(PsError::InvalidArgument(_))
        ));
        let mut req = push(&c, "t", 1, 1, 1.0, &[]);
        req.sparse[0].values = wire::encode(&[f32::INFINITY, 0.0]);
        req.sparse[0].rows = vec![(0..100u64).find(|&r| c.layout().row_shard(r) == 0).unwrap()];
        assert!(matches!(c.validate_push(req), Err(PsError::NonFinite(_))));
        assert_eq!(c.counters.nonfinite_rejected.load(Ordering::Relaxed), 2);
        assert!(all(&c).iter().all(|&v| v == 0.0), "nothing applied");
    }
}
