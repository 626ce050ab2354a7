//! What a shard's parameters contain, as the master needs to know it after a restore:
//! the tasks of each pass whose updates are all applied ([`LedgerSummary`]), published
//! by a restored pserver in a [`RestoreRecord`](crate::records::RestoreRecord). The
//! ledger that keeps it is the pserver's (`edl_pserver::shard::Ledger`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A set of small integers as a bitset.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Bits(Vec<u64>);

impl Bits {
    /// Whether `i` is in the set.
    pub fn has(&self, i: u32) -> bool {
        let (w, b) = (i as usize / 64, i % 64);
        self.0.get(w).is_some_and(|x| x >> b & 1 == 1)
    }

    /// Adds `i`; false when it was there.
    pub fn insert(&mut self, i: u32) -> bool {
        let (w, b) = (i as usize / 64, i % 64);
        if self.0.len() <= w {
            self.0.resize(w + 1, 0);
        }
        let new = self.0[w] >> b & 1 == 0;
        self.0[w] |= 1 << b;
        new
    }

    /// How many are in the set.
    pub fn count(&self) -> u64 {
        self.0.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// The members, ascending.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().enumerate().flat_map(|(w, &x)| {
            (0..64u32).filter_map(move |b| (x >> b & 1 == 1).then_some(w as u32 * 64 + b))
        })
    }
}

/// The tasks a ledger contains: every task of the passes below `sealed`, and in later
/// passes those in `complete`. Published by a restored shard so that the master trains
/// the others again.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerSummary {
    /// Every task of every pass below this one is contained.
    pub sealed: u32,
    /// Per later pass: the tasks contained.
    pub complete: BTreeMap<u32, Bits>,
}

impl LedgerSummary {
    /// Whether task `task` of pass `pass` is contained.
    pub fn contains(&self, pass: u32, task: u32) -> bool {
        pass < self.sealed || self.complete.get(&pass).is_some_and(|b| b.has(task))
    }
}
