//! Fixtures of the shard's unit tests: a small model, a shard of it, pushes.

use std::sync::Arc;

use super::ShardCore;
use super::push::{BlockValues, RawPush, TableRows};
use crate::layout::{DenseSpec, Layout, Mode, ParamConfig, ParamSpec, RowInit, SparseSpec};
use crate::optim::OptimizerConfig;
use crate::wire;

pub(crate) fn spec(mode: Mode, opt: OptimizerConfig) -> ParamSpec {
    ParamSpec {
        dense: vec![
            DenseSpec {
                name: "w".into(),
                shape: vec![10],
            },
            DenseSpec {
                name: "b".into(),
                shape: vec![3],
            },
        ],
        sparse: vec![SparseSpec {
            name: "emb".into(),
            dim: 2,
            init: RowInit::Zeros,
        }],
        config: ParamConfig {
            block_size: 4,
            ..ParamConfig::new(mode, opt)
        },
    }
}

pub(crate) fn core(mode: Mode, index: u32, shards: u32) -> ShardCore {
    let layout = Arc::new(Layout::new(spec(mode, OptimizerConfig::sgd(1.0)), shards).unwrap());
    let values = layout
        .shard_blocks(index)
        .iter()
        .map(|&id| vec![0.0; layout.block(id).unwrap().len])
        .collect();
    ShardCore::new(layout, index, 9, values, Arc::default()).unwrap()
}

pub(crate) fn push(
    c: &ShardCore,
    trainer: &str,
    session: u64,
    step: u64,
    g: f32,
    rows: &[u64],
) -> RawPush {
    let l = c.layout();
    RawPush {
        trainer: trainer.into(),
        session,
        step,
        dense: l
            .shard_blocks(c.index)
            .iter()
            .map(|&id| BlockValues {
                id,
                values: wire::encode(&vec![g; l.block(id).unwrap().len]),
            })
            .collect(),
        sparse: vec![TableRows {
            table: 0,
            rows: rows.to_vec(),
            values: wire::encode(&vec![g; rows.len() * 2]),
        }],
        origin: None,
    }
}

pub(crate) fn all(c: &ShardCore) -> Vec<f32> {
    let mut v = c
        .dense_values("w")
        .into_iter()
        .flat_map(|(_, v)| v)
        .collect::<Vec<_>>();
    v.extend(c.dense_values("b").into_iter().flat_map(|(_, v)| v));
    v
}
