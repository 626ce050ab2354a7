//! Copies of a shard for checkpoints, and a shard restored from one. In sync mode a
//! snapshot is taken right after a step is applied, under the step lock, and offered to
//! the checkpoint writer through the [`SnapshotSlot`] (a newer one replaces one not yet
//! taken); [`CheckpointHooks`] say when.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use super::storage::{Block, Row, ShardData, Table, stripe_of};
use super::{ShardCore, lock};
use crate::checkpoint::{BlockSnap, RowSnap, Snapshot};
use crate::error::PsError;
use crate::layout::Layout;
use crate::optim::Optimizer;

/// Where sync-mode step snapshots go: the latest one waits for the checkpoint writer
/// (an older one not yet taken is replaced).
#[derive(Debug, Default)]
pub struct SnapshotSlot {
    slot: Mutex<Option<Snapshot>>,
    notify: Notify,
}

impl SnapshotSlot {
    /// Offers a snapshot to the writer.
    pub fn put(&self, snap: Snapshot) {
        if let Some(old) = lock(&self.slot).replace(snap) {
            tracing::warn!(
                step = old.step,
                "checkpoint writer busy; a step snapshot was superseded"
            );
        }
        self.notify.notify_one();
    }

    /// Takes the pending snapshot, if any.
    pub fn take(&self) -> Option<Snapshot> {
        lock(&self.slot).take()
    }

    /// Waits until a snapshot is offered.
    pub async fn wait(&self) {
        self.notify.notified().await
    }
}

/// When sync-mode snapshots are taken (after applying a step), where they go, and the
/// last checkpoint written.
#[derive(Debug, Default)]
pub struct CheckpointHooks {
    /// The step of the last checkpoint file written (or restored from).
    pub last_written: AtomicU64,
    /// Every this many steps (all shards agree on these steps without talking).
    pub every_steps: Option<u64>,
    /// A step requested through etcd (time-based checkpoints); 0 when none.
    pub target: AtomicU64,
    /// Where snapshots go.
    pub slot: Arc<SnapshotSlot>,
}

impl ShardCore {
    /// A shard restored from a checkpoint snapshot.
    pub fn restore(
        snap: Snapshot,
        incarnation: u64,
        checkpoints: Arc<CheckpointHooks>,
    ) -> Result<ShardCore, PsError> {
        let layout = Arc::new(Layout::new(snap.spec.clone(), snap.shards)?);
        let optimizer = Optimizer::new(layout.spec().config.optimizer.clone())
            .map_err(|e| PsError::Spec(e.into()))?;
        let slots = optimizer.slots();
        let ids = layout.shard_blocks(snap.shard);
        if ids.len() != snap.blocks.len() {
            return Err(PsError::InvalidArgument(format!(
                "checkpoint has {} blocks, the layout gives shard {} {} blocks",
                snap.blocks.len(),
                snap.shard,
                ids.len()
            )));
        }
        let mut blocks = Vec::with_capacity(ids.len());
        for (&id, b) in ids.iter().zip(snap.blocks) {
            let len = layout.block(id).map_or(0, |b| b.len);
            if b.id != id || b.values.len() != len || b.state.slots.len() != slots * len {
                return Err(PsError::InvalidArgument(format!(
                    "checkpoint block {} ({} values) does not fit block {id} ({len} values)",
                    b.id,
                    b.values.len()
                )));
            }
            blocks.push(Block {
                values: b.values,
                state: b.state,
                version: b.version,
                encoded: None,
                acc: Vec::new(),
                has_acc: false,
            });
        }
        let mut tables = Vec::new();
        for (spec, rows) in layout.spec().sparse.iter().zip(snap.tables) {
            let t = Table::new(spec.dim, spec.init.clone());
            for r in rows {
                if r.values.len() != spec.dim || r.state.slots.len() != slots * spec.dim {
                    return Err(PsError::InvalidArgument(format!(
                        "checkpoint row {} of table {:?} has the wrong width",
                        r.row, spec.name
                    )));
                }
                lock(&t.stripes[stripe_of(r.row)]).rows.insert(
                    r.row,
                    Row {
                        values: r.values,
                        state: r.state,
                    },
                );
            }
            tables.push(t);
        }
        let data = ShardData {
            blocks,
            tables,
            updates: snap.updates,
            last_closed: snap.last_closed,
            restored_from: snap.step,
            holds_all_of: snap.final_of,
            ledger: snap.ledger,
        };
        Self::build(layout, snap.shard, incarnation, data, checkpoints)
    }

    /// A copy of the shard labelled `step`. Sync mode: between two steps; async mode:
    /// between two pushes (pushes wait while the values are copied), so that the copy
    /// holds exactly the batches its ledger names.
    pub fn snapshot(&self, step: u64) -> Snapshot {
        if self.is_sync() {
            let _view = self.step_view();
            self.snapshot_at(step, self.last_closed())
        } else {
            let _cut = self
                .step_lock
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            self.snapshot_at(step, self.last_closed())
        }
    }

    pub(super) fn snapshot_at(&self, step: u64, last_closed: u64) -> Snapshot {
        let ids = self.layout.shard_blocks(self.index);
        let blocks = self
            .blocks
            .iter()
            .zip(ids)
            .map(|(b, &id)| {
                let b = lock(b);
                BlockSnap {
                    id,
                    version: b.version,
                    values: b.values.clone(),
                    state: b.state.clone(),
                }
            })
            .collect();
        let tables = self
            .tables
            .iter()
            .map(|t| {
                let mut rows: Vec<RowSnap> = t
                    .stripes
                    .iter()
                    .flat_map(|s| {
                        lock(s)
                            .rows
                            .iter()
                            .map(|(&row, r)| RowSnap {
                                row,
                                values: r.values.clone(),
                                state: r.state.clone(),
                            })
                            .collect::<Vec<_>>()
                    })
                    .collect();
                rows.sort_by_key(|r| r.row);
                rows
            })
            .collect();
        Snapshot {
            step,
            shard: self.index,
            shards: self.layout.shards(),
            spec: self.spec().clone(),
            updates: self.updates(),
            last_closed,
            ledger: lock(&self.ledger).clone(),
            final_of: 0,
            blocks,
            tables,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Mode;
    use crate::shard::testutil::{core, push};

    #[test]
    fn snapshots_restore_the_same_state() {
        let c = core(Mode::Async, 1, 2);
        let rows: Vec<u64> = (0..50u64)
            .filter(|&r| c.layout().row_shard(r) == 1)
            .collect();
        for s in 1..4 {
            let p = c
                .validate_push(push(&c, "t", 1, s, s as f32, &rows))
                .unwrap();
            c.apply_async(&p).unwrap();
        }
        let snap = c.snapshot(3);
        let r = ShardCore::restore(snap.clone(), 10, Arc::default()).unwrap();
        assert_eq!(r.snapshot(3), snap);
        assert_eq!(r.updates(), 3);
        assert_eq!(r.restored_from(), 3);
        // Versions of another incarnation are ignored by pulls.
        let known: Vec<u64> = c.pull(&[], 0).blocks.iter().map(|b| b.version).collect();
        assert!(c.pull(&known, 9).blocks.is_empty());
        assert_eq!(r.pull(&known, 9).blocks.len(), known.len());
    }
}
