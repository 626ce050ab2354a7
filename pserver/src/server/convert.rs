//! Protobuf and the shard's own types meet here, once, for both transports (gRPC and
//! the bulk path): requests become the shard's types, its replies and counters become
//! protobuf. Floats stay little-endian bytes throughout (no copy of the values).

use std::sync::atomic::{AtomicU64, Ordering};

use edl_proto::pserver as pb;

use crate::error::PsError;
use crate::layout::ParamSpec;
use crate::shard::{BlockValues, InitBlocks, Origin, PullReply, RawPush, ShardCounters, TableRows};

/// The shard's view of a push (the target shard and the sync wait stay with the service).
pub(super) fn raw_push(r: pb::PushRequest) -> RawPush {
    RawPush {
        trainer: r.trainer,
        session: r.session,
        step: r.step,
        dense: r.dense.into_iter().map(block_values).collect(),
        sparse: r
            .sparse
            .into_iter()
            .map(|s| TableRows {
                table: s.table,
                rows: s.rows,
                values: s.values,
            })
            .collect(),
        origin: r.origin.map(|o| Origin {
            pass: o.pass,
            task: o.task,
            seq: o.seq,
            count: o.count.max(1),
        }),
    }
}

fn block_values(b: pb::DenseBlock) -> BlockValues {
    BlockValues {
        id: b.id,
        values: b.values,
    }
}

/// The shard's view of an `Init` request: the spec parsed from its JSON.
pub(super) fn init_blocks(r: pb::InitRequest) -> Result<InitBlocks, PsError> {
    Ok(InitBlocks {
        shard: r.shard,
        shards: r.shards,
        spec: ParamSpec::from_json(&r.spec_json)?,
        trainer: r.trainer,
        blocks: r.blocks.into_iter().map(block_values).collect(),
    })
}

pub(super) fn pull_response(r: PullReply) -> pb::PullResponse {
    pb::PullResponse {
        blocks: r
            .blocks
            .into_iter()
            .map(|b| pb::DenseBlock {
                id: b.id,
                version: b.version,
                values: b.values,
            })
            .collect(),
        next_step: r.next_step,
        updates: r.updates,
        incarnation: r.incarnation,
    }
}

/// The protobuf form of a shard's counters.
pub(super) fn counters(c: &ShardCounters) -> pb::Counters {
    let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
    pb::Counters {
        pushes_applied: g(&c.pushes_applied),
        duplicate_pushes: g(&c.duplicate_pushes),
        stale_pushes: g(&c.stale_pushes),
        nonfinite_rejected: g(&c.nonfinite_rejected),
        invalid_rejected: g(&c.invalid_rejected),
        steps_closed: g(&c.steps_closed),
        trainers_dropped: g(&c.trainers_dropped),
        step_timeouts: g(&c.step_timeouts),
        pulls: g(&c.pulls),
        sparse_rows_pulled: g(&c.sparse_rows_pulled),
        checkpoints_written: g(&c.checkpoints_written),
        checkpoints_failed: g(&c.checkpoints_failed),
        tasks_done: g(&c.tasks_done),
        tasks_rewound: g(&c.tasks_rewound),
        overlap_refused: g(&c.overlap_refused),
    }
}
