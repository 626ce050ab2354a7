//! The trainer's copy of the dense parameters, with the version of each block and the
//! incarnation of each shard it came from, so that a pull moves only the blocks that
//! changed (versions compare only within one incarnation of a shard).

use std::collections::HashMap;
use std::sync::Arc;

use crate::layout::{Layout, ParamSpec};
use crate::{PsClient, PsClientError, Result};

/// A dense parameter in the cache.
#[derive(Debug, Clone)]
pub struct CachedParam {
    /// Name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Values.
    pub values: Vec<f32>,
}

/// The trainer's copy of the dense parameters, with the version of each block so that a
/// pull only moves blocks that changed.
#[derive(Debug, Clone, Default)]
pub struct DenseCache {
    pub(super) spec: Option<Arc<ParamSpec>>,
    pub(super) params: Vec<CachedParam>,
    pub(super) by_name: HashMap<String, usize>,
    pub(super) versions: Vec<Vec<u64>>,
    pub(super) incarnations: Vec<u64>,
    /// Per shard, its update count when it answered the last pull.
    pub(super) updates: Vec<u64>,
    /// The parameters' initial values (from [`PsClient::seed_cache`]): a shard found
    /// without parameters (restarted without a checkpoint) starts over from them, with an
    /// empty ledger, and the master trains every task again for it.
    pub(super) initial: Option<Arc<Vec<Vec<f32>>>>,
    pub(super) next_step: u64,
}

impl DenseCache {
    /// An empty cache (filled by the first pull).
    pub fn new() -> Self {
        Self::default()
    }

    /// The values of parameter `name`.
    pub fn get(&self, name: &str) -> Option<&[f32]> {
        self.by_name
            .get(name)
            .map(|&i| self.params[i].values.as_slice())
    }

    /// Per shard, the incarnation and the update count (async: pushes applied; sync:
    /// steps) of its answer to the last pull: where the cached values stand.
    pub fn positions(&self) -> Vec<(u64, u64)> {
        self.incarnations
            .iter()
            .copied()
            .zip(self.updates.iter().copied())
            .collect()
    }

    /// Every parameter, in spec order.
    pub fn params(&self) -> &[CachedParam] {
        &self.params
    }

    /// The step to push next, as of the last pull (sync mode).
    pub fn next_step(&self) -> u64 {
        self.next_step
    }

    /// Forgets the block versions (keeping the values and their buffers): the next pull
    /// moves every block again.
    pub fn invalidate(&mut self) {
        for v in self.versions.iter_mut().flatten() {
            *v = 0;
        }
    }

    pub(super) fn reset(&mut self, layout: &Layout) {
        let spec = layout.spec();
        self.params = spec
            .dense
            .iter()
            .map(|d| CachedParam {
                name: d.name.clone(),
                shape: d.shape.clone(),
                values: vec![0.0; d.numel().unwrap_or(0)],
            })
            .collect();
        self.by_name = spec
            .dense
            .iter()
            .enumerate()
            .map(|(i, d)| (d.name.clone(), i))
            .collect();
        let n = layout.shards() as usize;
        self.versions = (0..n)
            .map(|s| vec![0; layout.shard_blocks(s as u32).len()])
            .collect();
        self.incarnations = vec![0; n];
        self.updates = vec![0; n];
        self.initial = None;
        self.spec = Some(spec.clone());
    }
}

impl PsClient {
    /// Fills `cache` with the initial `values` (one vector per dense parameter, in spec
    /// order) as this trainer's copy, and keeps them: a shard found without parameters
    /// (restarted before its first checkpoint) is initialised again from them (never from
    /// trained values: its ledger starts empty, and the master trains every task again
    /// for it). The next pull moves every block.
    pub async fn seed_cache(&self, cache: &mut DenseCache, values: &[Vec<f32>]) -> Result<()> {
        let layout = self.layout().await?;
        cache.reset(&layout);
        for (p, v) in cache.params.iter_mut().zip(values) {
            if p.values.len() != v.len() {
                return Err(PsClientError::InvalidArgument(format!(
                    "{} values for parameter {} of {} values",
                    v.len(),
                    p.name,
                    p.values.len()
                )));
            }
            p.values.copy_from_slice(v);
        }
        cache.initial = Some(Arc::new(values.to_vec()));
        Ok(())
    }
}
