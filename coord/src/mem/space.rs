//! The space quota (etcd's `--quota-backend-bytes`) and its alarm: the store's size
//! counts every version it keeps, the live ones and those in the history, as etcd's
//! database does (until compaction, an overwritten or deleted value still takes space); a write that would
//! take the store past its quota raises the alarm and is refused; while it is raised,
//! every write that adds data (a put, a transaction with a put in either branch, a lease
//! grant) is refused with [`Error::NoSpace`], and reads, deletes and lease renewals are
//! served. [`Backend::free_space`](crate::Backend::free_space) drops the whole history
//! (the store's compaction and defragmentation at once) and ends the alarm.

use super::State;
use crate::error::{Error, Result};
use crate::types::{FreedSpace, Op, Txn};

/// What etcd adds to its database for a lease (its `leaseOverhead`).
pub(super) const LEASE_COST: u64 = 64;

impl State {
    /// The bytes the store holds, as etcd's database holds every revision it keeps:
    /// the live keys and values, and the history's older versions and deletions (an
    /// event of a live key's current version is that key, counted once).
    fn size(&self) -> u64 {
        let live: usize = self
            .kvs
            .values()
            .map(|kv| kv.key.len() + kv.value.len())
            .sum();
        let history: usize = self
            .history
            .iter()
            .filter(|e| {
                self.kvs
                    .get(&e.kv.key)
                    .is_none_or(|kv| kv.mod_revision != e.kv.mod_revision)
            })
            .map(|e| e.kv.key.len() + e.kv.value.len())
            .sum();
        (live + history) as u64
    }

    /// Refuses a write adding `cost` bytes when the alarm is raised, or raises it when
    /// the write does not fit. Writes of no cost (deletes) always pass.
    pub(super) fn check_space(&mut self, cost: u64) -> Result<()> {
        if cost == 0 {
            return Ok(());
        }
        if !self.no_space
            && let Some(quota) = self.quota
            && self.size() + cost > quota
        {
            self.no_space = true;
        }
        if self.no_space {
            return Err(Error::NoSpace {
                msg: "etcdserver: mvcc: database space exceeded".into(),
            });
        }
        Ok(())
    }

    pub(super) fn free_space(&mut self) -> FreedSpace {
        let size_before = self.size();
        self.history.clear();
        self.compact_revision = self.compact_revision.max(self.revision);
        let disarmed = std::mem::take(&mut self.no_space);
        FreedSpace {
            size_before,
            size_after: self.size(),
            disarmed,
        }
    }
}

/// The bytes a transaction's puts add, in both branches (etcd counts the larger).
pub(super) fn txn_cost(txn: &Txn) -> u64 {
    fn branch(ops: &[Op]) -> u64 {
        ops.iter()
            .map(|op| match op {
                Op::Put { key, value, .. } => (key.len() + value.len()) as u64,
                Op::Txn(inner) => txn_cost(inner),
                _ => 0,
            })
            .sum()
    }
    branch(&txn.success).max(branch(&txn.failure))
}
