//! How a shard holds its values, and how a shard is built from initial values.
//!
//! Dense blocks each sit under their own lock; the rows of a sparse table are spread
//! over [`STRIPES`] locks by a hash of the row id, and come into being on their first
//! update, from the table's initialiser (rows never trained are not stored).
//!
//! Invariants: a block's `version` grows by one with every update applied to it (the
//! blocks of a fresh shard start at 1), so that a pull can skip the blocks a trainer
//! already holds; a block's and a stripe's `acc` hold sync-mode gradients of the open
//! step only, and `has_acc` says whether a block's `acc` holds any.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::watch;

use super::dedup::Dedup;
use super::ledger::Ledger;
use super::push::SparseUpdate;
use super::snapshot::CheckpointHooks;
use super::{ShardCore, ShardCounters, lock};
use crate::error::PsError;
use crate::layout::{Layout, Mode, ParamSpec, RowInit, mix64};
use crate::optim::{Optimizer, SlotState};
use crate::sync::SyncState;
use crate::wire;

/// Lock stripes per sparse table.
const STRIPES: usize = 64;

/// One dense block: values, optimizer state, version, and the open step's gradients.
#[derive(Debug)]
pub(super) struct Block {
    pub(super) values: Vec<f32>,
    pub(super) state: SlotState,
    pub(super) version: u64,
    /// `values` encoded at the version it names, shared by every pull of that version
    /// (stale once `version` moves on: every change of `values` moves it).
    pub(super) encoded: Option<(u64, Bytes)>,
    pub(super) acc: Vec<f32>,
    pub(super) has_acc: bool,
}

/// One trained row of a sparse table.
#[derive(Debug)]
pub(super) struct Row {
    pub(super) values: Vec<f32>,
    pub(super) state: SlotState,
}

/// The rows of a table that hash to one lock, and their gradients of the open step.
#[derive(Debug, Default)]
pub(super) struct Stripe {
    pub(super) rows: HashMap<u64, Row>,
    pub(super) acc: HashMap<u64, Vec<f32>>,
}

/// A sparse table: its width, how its rows start, and its stripes.
#[derive(Debug)]
pub(super) struct Table {
    pub(super) dim: usize,
    pub(super) init: RowInit,
    pub(super) stripes: Vec<Mutex<Stripe>>,
}

/// The stripe of `row`.
pub(super) fn stripe_of(row: u64) -> usize {
    ((mix64(row) >> 32) % STRIPES as u64) as usize
}

impl Table {
    pub(super) fn new(dim: usize, init: RowInit) -> Self {
        Table {
            dim,
            init,
            stripes: (0..STRIPES)
                .map(|_| Mutex::new(Stripe::default()))
                .collect(),
        }
    }

    fn rows(&self) -> usize {
        self.stripes.iter().map(|s| lock(s).rows.len()).sum()
    }
}

/// The state a shard is built from (fresh or restored).
pub(super) struct ShardData {
    pub(super) blocks: Vec<Block>,
    pub(super) tables: Vec<Table>,
    pub(super) updates: u64,
    pub(super) last_closed: u64,
    pub(super) restored_from: u64,
    pub(super) holds_all_of: u64,
    pub(super) ledger: Ledger,
}

impl ShardCore {
    pub(super) fn build(
        layout: Arc<Layout>,
        index: u32,
        incarnation: u64,
        data: ShardData,
        checkpoints: Arc<CheckpointHooks>,
    ) -> Result<ShardCore, PsError> {
        let ShardData {
            blocks,
            tables,
            updates,
            last_closed,
            restored_from,
            holds_all_of,
            ledger,
        } = data;
        let optimizer = Optimizer::new(layout.spec().config.optimizer.clone())
            .map_err(|e| PsError::Spec(e.into()))?;
        let sync = match layout.spec().config.mode {
            Mode::Async => None,
            Mode::Sync { step_timeout_ms } => Some(Mutex::new(SyncState::new(
                last_closed,
                Duration::from_millis(step_timeout_ms),
            ))),
        };
        Ok(ShardCore {
            layout,
            index,
            incarnation,
            optimizer,
            blocks: blocks.into_iter().map(Mutex::new).collect(),
            tables,
            updates: AtomicU64::new(updates),
            order: Mutex::new(()),
            stream: std::sync::OnceLock::new(),
            dedup: Mutex::new(Dedup::default()),
            ledger: Mutex::new(ledger),
            open_origins: Mutex::new(Vec::new()),
            sync,
            step_lock: RwLock::new(()),
            members_seeded: std::sync::atomic::AtomicBool::new(false),
            closed_tx: watch::channel(last_closed).0,
            checkpoints,
            restored_from,
            holds_all_of,
            counters: ShardCounters::default(),
        })
    }

    /// A shard with initial `values` for each of its blocks (in the shard's order).
    pub fn new(
        layout: Arc<Layout>,
        index: u32,
        incarnation: u64,
        values: Vec<Vec<f32>>,
        checkpoints: Arc<CheckpointHooks>,
    ) -> Result<ShardCore, PsError> {
        let optimizer = Optimizer::new(layout.spec().config.optimizer.clone())
            .map_err(|e| PsError::Spec(e.into()))?;
        let ids = layout.shard_blocks(index);
        if ids.len() != values.len() {
            return Err(PsError::InvalidArgument(format!(
                "{} blocks of values for {} blocks",
                values.len(),
                ids.len()
            )));
        }
        let mut blocks = Vec::with_capacity(ids.len());
        for (&id, values) in ids.iter().zip(values) {
            let len = layout.block(id).map_or(0, |b| b.len);
            if values.len() != len {
                return Err(PsError::InvalidArgument(format!(
                    "block {id} has {} values, expected {len}",
                    values.len()
                )));
            }
            blocks.push(Block {
                state: optimizer.state(len),
                values,
                version: 1,
                encoded: None,
                acc: Vec::new(),
                has_acc: false,
            });
        }
        let tables = layout
            .spec()
            .sparse
            .iter()
            .map(|s| Table::new(s.dim, s.init.clone()))
            .collect();
        let data = ShardData {
            blocks,
            tables,
            updates: 0,
            last_closed: 0,
            restored_from: 0,
            holds_all_of: 0,
            ledger: Ledger::default(),
        };
        Self::build(layout, index, incarnation, data, checkpoints)
    }

    /// The layout.
    pub fn layout(&self) -> &Arc<Layout> {
        &self.layout
    }

    /// The spec.
    pub fn spec(&self) -> &ParamSpec {
        self.layout.spec()
    }

    /// Whether the shard runs in sync mode.
    pub fn is_sync(&self) -> bool {
        self.sync.is_some()
    }

    /// Updates applied.
    pub fn updates(&self) -> u64 {
        self.updates.load(Ordering::Acquire)
    }

    /// The step of the checkpoint this shard was restored from (0: none).
    pub fn restored_from(&self) -> u64 {
        self.restored_from
    }

    /// Blocks and trained rows held.
    pub fn sizes(&self) -> (usize, u64) {
        (
            self.blocks.len(),
            self.tables.iter().map(|t| t.rows() as u64).sum(),
        )
    }

    /// Applies sparse gradients row by row, each stripe locked once; repeated rows are
    /// summed first. A row whose sum overflows to infinity is left as it is; returns how
    /// many were.
    pub(super) fn apply_rows(&self, s: &SparseUpdate, lr: f32, scale: f32) -> usize {
        let mut overflowed = 0;
        let t = &self.tables[s.table];
        let dim = t.dim;
        let mut by_stripe: Vec<Vec<usize>> = vec![Vec::new(); STRIPES];
        for (i, &r) in s.rows.iter().enumerate() {
            by_stripe[stripe_of(r)].push(i);
        }
        let mut grad = vec![0f32; dim];
        for (stripe, mut idx) in by_stripe.into_iter().enumerate() {
            if idx.is_empty() {
                continue;
            }
            idx.sort_by_key(|&i| s.rows[i]);
            let mut st = lock(&t.stripes[stripe]);
            let mut k = 0;
            while k < idx.len() {
                let row = s.rows[idx[k]];
                grad.fill(0.0);
                while k < idx.len() && s.rows[idx[k]] == row {
                    let at = idx[k] * dim * 4;
                    wire::add_into(&s.values[at..at + dim * 4], &mut grad);
                    k += 1;
                }
                if !grad.iter().all(|g| g.is_finite()) {
                    overflowed += 1;
                    continue;
                }
                let r = st.rows.entry(row).or_insert_with(|| {
                    let mut values = vec![0f32; dim];
                    t.init.fill(row, &mut values);
                    Row {
                        values,
                        state: self.optimizer.state(dim),
                    }
                });
                self.optimizer
                    .step(lr, &mut r.values, &grad, scale, &mut r.state);
            }
        }
        overflowed
    }

    /// The values of dense parameter `name` held by this shard, as (offset, values)
    /// runs (for tests and tools).
    pub fn dense_values(&self, name: &str) -> Vec<(usize, Vec<f32>)> {
        let Some(p) = self.layout.param_index(name) else {
            return Vec::new();
        };
        self.layout
            .param_blocks(p)
            .iter()
            .filter(|b| b.shard == self.index)
            .map(|b| {
                (
                    b.offset,
                    lock(&self.blocks[b.local as usize]).values.clone(),
                )
            })
            .collect()
    }
}
