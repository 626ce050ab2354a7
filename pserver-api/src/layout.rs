//! The model spec (what the initialising trainer declares) and its deterministic layout
//! over the shards.
//!
//! A dense parameter is a flat `f32` vector with a shape, cut into blocks of
//! `block_size` floats (the last block of a parameter may be shorter). Blocks are
//! numbered in parameter order; block `g` lives on shard `g % shards`, at position
//! `g / shards` of that shard. A sparse table (embedding) of `dim` floats per row keeps
//! row `r` on shard `mix(r) % shards`. Every process computes the same layout from the
//! spec and the shard count.

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

pub use edl_job::optim::Mode;

use crate::optim::{ConfigError, Optimizer, OptimizerConfig};

/// Default block size: 64 Ki floats (256 KiB), large enough for streaming speed and
/// small enough to spread and lock finely.
pub const DEFAULT_BLOCK_SIZE: usize = 64 * 1024;
/// Largest block size accepted.
pub const MAX_BLOCK_SIZE: usize = 16 << 20;
/// Largest sparse row width accepted.
pub const MAX_DIM: usize = 1 << 20;
/// Longest parameter or table name accepted.
pub const MAX_NAME_LEN: usize = 256;
/// Most dense blocks accepted in all (every process holds the layout's list of blocks):
/// 2 Mi blocks, 512 GiB of parameters at the default block size.
pub const MAX_BLOCKS: u64 = 1 << 21;
/// Most sparse tables accepted (each shard keeps lock stripes for every one).
pub const MAX_TABLES: usize = 4096;

/// Why a spec or layout was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LayoutError {
    /// A structural problem (empty or duplicate name, zero size, overflow, ...).
    #[error("invalid model spec: {0}")]
    Invalid(String),
    /// The optimizer settings are invalid.
    #[error(transparent)]
    Optimizer(#[from] ConfigError),
}

/// How a sparse row never trained is initialised: a deterministic function of the
/// table's seed and the row id, so every shard, before and after a restore, gives the
/// same values.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum RowInit {
    /// All zeros.
    Zeros,
    /// Uniform in `[low, high)`.
    Uniform {
        /// Lower bound.
        low: f32,
        /// Upper bound.
        high: f32,
        /// Seed.
        seed: u64,
    },
    /// Normal with `mean` and `std`.
    Normal {
        /// Mean.
        mean: f32,
        /// Standard deviation.
        std: f32,
        /// Seed.
        seed: u64,
    },
}

/// SplitMix64: the row hash and the row initialiser's generator.
#[inline]
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl RowInit {
    fn validate(&self) -> Result<(), LayoutError> {
        let ok = match *self {
            RowInit::Zeros => true,
            RowInit::Uniform { low, high, .. } => {
                low.is_finite() && high.is_finite() && low <= high
            }
            RowInit::Normal { mean, std, .. } => mean.is_finite() && std.is_finite() && std >= 0.0,
        };
        if ok {
            Ok(())
        } else {
            Err(LayoutError::Invalid(format!(
                "bad row initialiser {self:?}"
            )))
        }
    }

    /// Fills `out` with the initial values of row `row`.
    pub fn fill(&self, row: u64, out: &mut [f32]) {
        let mut state = 0u64;
        let mut next = |seed: u64| {
            state = state.wrapping_add(1);
            // 24 random bits -> [0, 1)
            (mix64(seed ^ mix64(row) ^ state.wrapping_mul(0x2545_f491_4f6c_dd1d)) >> 40) as f32
                / (1u64 << 24) as f32
        };
        match *self {
            RowInit::Zeros => out.fill(0.0),
            RowInit::Uniform { low, high, seed } => {
                for v in out.iter_mut() {
                    *v = low + (high - low) * next(seed);
                }
            }
            RowInit::Normal { mean, std, seed } => {
                for v in out.iter_mut() {
                    // Box-Muller; u1 in (0, 1].
                    let u1 = 1.0 - next(seed);
                    let u2 = next(seed);
                    let z = (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos();
                    *v = mean + std * z;
                }
            }
        }
    }
}

/// A dense parameter.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DenseSpec {
    /// Unique name.
    pub name: String,
    /// Shape; the parameter holds the product of the dimensions.
    pub shape: Vec<usize>,
}

impl DenseSpec {
    /// Number of floats, or `None` on overflow.
    pub fn numel(&self) -> Option<usize> {
        self.shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }
}

/// A sparse table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SparseSpec {
    /// Unique name.
    pub name: String,
    /// Floats per row.
    pub dim: usize,
    /// Initial value of rows never trained.
    pub init: RowInit,
}

/// How the shards update: mode, optimizer, block size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamConfig {
    /// Sync or async.
    pub mode: Mode,
    /// The optimizer of every parameter and table.
    pub optimizer: OptimizerConfig,
    /// Floats per dense block.
    #[serde(default = "default_block_size")]
    pub block_size: usize,
}

fn default_block_size() -> usize {
    DEFAULT_BLOCK_SIZE
}

impl ParamConfig {
    /// `mode` with `optimizer` and the default block size.
    pub fn new(mode: Mode, optimizer: OptimizerConfig) -> Self {
        ParamConfig {
            mode,
            optimizer,
            block_size: DEFAULT_BLOCK_SIZE,
        }
    }
}

/// Everything the shards must agree on: parameters, tables, settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamSpec {
    /// Dense parameters, in order.
    pub dense: Vec<DenseSpec>,
    /// Sparse tables, in order.
    #[serde(default)]
    pub sparse: Vec<SparseSpec>,
    /// Mode, optimizer, block size.
    pub config: ParamConfig,
}

fn check_name(kind: &str, name: &str) -> Result<(), LayoutError> {
    let ok =
        !name.is_empty() && name.len() <= MAX_NAME_LEN && name.chars().all(|c| !c.is_control());
    if ok {
        Ok(())
    } else {
        Err(LayoutError::Invalid(format!(
            "{kind} name {name:?} must be 1..={MAX_NAME_LEN} printable characters"
        )))
    }
}

impl ParamSpec {
    /// Checks names, sizes and settings.
    pub fn validate(&self) -> Result<(), LayoutError> {
        let bs = self.config.block_size;
        if bs == 0 || bs > MAX_BLOCK_SIZE {
            return Err(LayoutError::Invalid(format!(
                "block_size must be in 1..={MAX_BLOCK_SIZE}, got {bs}"
            )));
        }
        Optimizer::new(self.config.optimizer.clone())?;
        let mut names = std::collections::HashSet::new();
        let mut blocks = 0u64;
        for d in &self.dense {
            check_name("parameter", &d.name)?;
            if !names.insert(d.name.as_str()) {
                return Err(LayoutError::Invalid(format!(
                    "duplicate parameter {:?}",
                    d.name
                )));
            }
            match d.numel() {
                Some(n) if n > 0 && n <= u32::MAX as usize => {
                    blocks = blocks.saturating_add(n.div_ceil(bs) as u64);
                }
                _ => {
                    return Err(LayoutError::Invalid(format!(
                        "parameter {:?} has shape {:?}: its size must be in 1..=2^32-1",
                        d.name, d.shape
                    )));
                }
            }
        }
        if blocks > MAX_BLOCKS {
            return Err(LayoutError::Invalid(format!(
                "the dense parameters make {blocks} blocks of {bs} floats, more than \
                 {MAX_BLOCKS}: use a larger block_size"
            )));
        }
        if self.sparse.len() > MAX_TABLES {
            return Err(LayoutError::Invalid(format!(
                "{} sparse tables, more than {MAX_TABLES}",
                self.sparse.len()
            )));
        }
        let mut tables = std::collections::HashSet::new();
        for s in &self.sparse {
            check_name("table", &s.name)?;
            if !tables.insert(s.name.as_str()) {
                return Err(LayoutError::Invalid(format!(
                    "duplicate table {:?}",
                    s.name
                )));
            }
            if s.dim == 0 || s.dim > MAX_DIM {
                return Err(LayoutError::Invalid(format!(
                    "table {:?} has dim {}: must be in 1..={MAX_DIM}",
                    s.name, s.dim
                )));
            }
            s.init.validate()?;
        }
        if self.dense.is_empty() && self.sparse.is_empty() {
            return Err(LayoutError::Invalid("the model has no parameter".into()));
        }
        Ok(())
    }

    /// The spec as JSON.
    pub fn to_json(&self) -> String {
        // Serialising plain data with string keys cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Parses and validates a JSON spec.
    pub fn from_json(json: &str) -> Result<ParamSpec, LayoutError> {
        let spec: ParamSpec = serde_json::from_str(json)
            .map_err(|e| LayoutError::Invalid(format!("spec is not valid JSON: {e}")))?;
        spec.validate()?;
        Ok(spec)
    }
}

/// One dense block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    /// Global block id.
    pub id: u32,
    /// Index of its parameter in the spec.
    pub param: u32,
    /// Offset of its first float in the parameter.
    pub offset: usize,
    /// Floats in the block.
    pub len: usize,
    /// The shard holding it.
    pub shard: u32,
    /// Its position among the shard's blocks.
    pub local: u32,
}

/// A spec laid out over `shards` shards.
#[derive(Debug, Clone)]
pub struct Layout {
    spec: Arc<ParamSpec>,
    shards: u32,
    blocks: Vec<BlockInfo>,
    /// First block id of each parameter, plus the total at the end.
    param_first: Vec<u32>,
    shard_blocks: Vec<Vec<u32>>,
    by_name: HashMap<String, usize>,
    table_by_name: HashMap<String, usize>,
}

impl Layout {
    /// Lays `spec` out over `shards` shards (validating the spec).
    pub fn new(spec: ParamSpec, shards: u32) -> Result<Layout, LayoutError> {
        spec.validate()?;
        if shards == 0 {
            return Err(LayoutError::Invalid("zero shards".into()));
        }
        let bs = spec.config.block_size;
        let mut blocks = Vec::new();
        let mut param_first = Vec::with_capacity(spec.dense.len() + 1);
        let mut shard_blocks = vec![Vec::new(); shards as usize];
        for (p, d) in spec.dense.iter().enumerate() {
            param_first.push(blocks.len() as u32);
            let n = d.numel().unwrap_or(0);
            let mut offset = 0;
            while offset < n {
                let id = u32::try_from(blocks.len())
                    .map_err(|_| LayoutError::Invalid("more than 2^32 blocks".into()))?;
                let shard = id % shards;
                let local = id / shards;
                shard_blocks[shard as usize].push(id);
                let len = bs.min(n - offset);
                blocks.push(BlockInfo {
                    id,
                    param: p as u32,
                    offset,
                    len,
                    shard,
                    local,
                });
                offset += len;
            }
        }
        param_first.push(blocks.len() as u32);
        let by_name = spec
            .dense
            .iter()
            .enumerate()
            .map(|(i, d)| (d.name.clone(), i))
            .collect();
        let table_by_name = spec
            .sparse
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.clone(), i))
            .collect();
        Ok(Layout {
            spec: Arc::new(spec),
            shards,
            blocks,
            param_first,
            shard_blocks,
            by_name,
            table_by_name,
        })
    }

    /// The spec.
    pub fn spec(&self) -> &Arc<ParamSpec> {
        &self.spec
    }

    /// The shard count.
    pub fn shards(&self) -> u32 {
        self.shards
    }

    /// Every block, by id.
    pub fn blocks(&self) -> &[BlockInfo] {
        &self.blocks
    }

    /// One block.
    pub fn block(&self, id: u32) -> Option<&BlockInfo> {
        self.blocks.get(id as usize)
    }

    /// The blocks of parameter `param`.
    pub fn param_blocks(&self, param: usize) -> &[BlockInfo] {
        match (self.param_first.get(param), self.param_first.get(param + 1)) {
            (Some(&a), Some(&b)) => &self.blocks[a as usize..b as usize],
            _ => &[],
        }
    }

    /// The block ids of `shard`, in its order.
    pub fn shard_blocks(&self, shard: u32) -> &[u32] {
        self.shard_blocks
            .get(shard as usize)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// The index of dense parameter `name`.
    pub fn param_index(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// The index of sparse table `name`.
    pub fn table_index(&self, name: &str) -> Option<usize> {
        self.table_by_name.get(name).copied()
    }

    /// The shard of row `row` (of any table).
    pub fn row_shard(&self, row: u64) -> u32 {
        (mix64(row) % u64::from(self.shards)) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(dense: &[(&str, &[usize])], block_size: usize) -> ParamSpec {
        ParamSpec {
            dense: dense
                .iter()
                .map(|(n, s)| DenseSpec {
                    name: (*n).into(),
                    shape: s.to_vec(),
                })
                .collect(),
            sparse: vec![SparseSpec {
                name: "emb".into(),
                dim: 4,
                init: RowInit::Uniform {
                    low: -0.1,
                    high: 0.1,
                    seed: 7,
                },
            }],
            config: ParamConfig {
                block_size,
                ..ParamConfig::new(Mode::Async, OptimizerConfig::sgd(0.1))
            },
        }
    }

    #[test]
    fn blocks_cover_every_parameter_round_robin() {
        let l = Layout::new(spec(&[("w", &[10, 25]), ("b", &[25])], 100), 3).unwrap();
        // w: 250 floats -> 100, 100, 50; b: 25 -> one block.
        let lens: Vec<usize> = l.blocks().iter().map(|b| b.len).collect();
        assert_eq!(lens, vec![100, 100, 50, 25]);
        assert_eq!(l.param_blocks(0).len(), 3);
        assert_eq!(l.param_blocks(1)[0].id, 3);
        assert_eq!(l.param_blocks(1)[0].offset, 0);
        assert_eq!(l.shard_blocks(0), &[0, 3]);
        assert_eq!(l.shard_blocks(1), &[1]);
        assert_eq!(l.shard_blocks(2), &[2]);
        assert_eq!(l.block(3).unwrap().local, 1);
        assert!(l.param_blocks(9).is_empty());
    }

    #[test]
    fn rows_spread_over_shards() {
        let l = Layout::new(spec(&[("w", &[4])], 100), 4).unwrap();
        let mut n = [0usize; 4];
        for r in 0..4000u64 {
            n[l.row_shard(r) as usize] += 1;
        }
        assert!(n.iter().all(|&c| c > 800), "{n:?}");
    }

    #[test]
    fn row_init_is_deterministic_and_in_range() {
        let init = RowInit::Uniform {
            low: -0.5,
            high: 0.5,
            seed: 1,
        };
        let (mut a, mut b) = ([0f32; 8], [0f32; 8]);
        init.fill(42, &mut a);
        init.fill(42, &mut b);
        assert_eq!(a, b);
        assert!(a.iter().all(|v| (-0.5..0.5).contains(v)));
        init.fill(43, &mut b);
        assert_ne!(a, b);
        let normal = RowInit::Normal {
            mean: 0.0,
            std: 1.0,
            seed: 3,
        };
        let mut v = vec![0f32; 10_000];
        normal.fill(5, &mut v);
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / v.len() as f32;
        assert!(mean.abs() < 0.05 && (var - 1.0).abs() < 0.1, "{mean} {var}");
        assert!(v.iter().all(|x| x.is_finite()));
    }

    #[test]
    fn invalid_specs_are_refused() {
        assert!(Layout::new(spec(&[("w", &[0])], 100), 2).is_err());
        assert!(Layout::new(spec(&[("w", &[2]), ("w", &[3])], 100), 2).is_err());
        assert!(Layout::new(spec(&[("", &[2])], 100), 2).is_err());
        assert!(Layout::new(spec(&[("w", &[2])], 0), 2).is_err());
        assert!(Layout::new(spec(&[("w", &[usize::MAX, 2])], 10), 2).is_err());
        assert!(Layout::new(spec(&[("w", &[2])], 10), 0).is_err());
        // Too many blocks in all (an Init could otherwise make the pserver lay out
        // billions of them).
        let err = spec(&[("w", &[u32::MAX as usize])], 1)
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("blocks"), "{err}");
        let many = MAX_BLOCKS as usize / 2;
        assert!(
            spec(&[("a", &[many]), ("b", &[many])], 1)
                .validate()
                .is_ok()
        );
        assert!(
            spec(&[("a", &[many]), ("b", &[many + 1])], 1)
                .validate()
                .is_err()
        );
        let mut s = spec(&[("w", &[2])], 10);
        s.sparse = (0..=MAX_TABLES)
            .map(|i| SparseSpec {
                name: format!("t{i}"),
                dim: 1,
                init: RowInit::Zeros,
            })
            .collect();
        assert!(s.validate().is_err());
        assert!(ParamSpec::from_json("{").is_err());
        let s = spec(&[("w", &[2])], 10);
        assert_eq!(ParamSpec::from_json(&s.to_json()).unwrap(), s);
    }
}
