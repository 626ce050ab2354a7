//! The edl parameter server: holds a shard of the model's parameters and their optimizer
//! state, applies trainers' gradients (asynchronously, or in synchronous steps over the
//! trainers alive), and checkpoints itself through etcd so that a restarted pserver
//! continues where the last complete checkpoint left off.
//!
//! Dense parameters are cut into blocks spread round-robin over the `ps/desired` shards;
//! sparse tables are spread by row. Each block has its own lock (sparse tables lock
//! stripes of rows); nothing locks a whole shard on the data path. Pushes are tagged
//! (trainer, session, step) so that a retried push is never applied twice.
//!
//! Layout:
//! - [`optim`]: the update rules (SGD with momentum/Nesterov/weight decay, Adagrad, Adam,
//!   AdamW) on plain slices, `update.rs`; reused by the trainer's single-process baseline.
//!   Their description (kinds, schedules, clipping, the serde form and its validation) is
//!   `edl_job::optim`, re-exported here.
//! - [`layout`]: the parameter spec ([`ParamSpec`], [`ParamConfig`], [`Mode`] from
//!   `edl_job`) and its deterministic layout over the shards.
//! - [`sync`]: the sync-mode step protocol as a pure state machine.
//! - [`shard`]: a shard's parameters and update logic on its own types (no protobuf, no
//!   I/O), one concern per file: `storage`, `push` (validation), `dedup` (the async
//!   window), `async_apply`, `sync_apply`, `pull`, `snapshot`, `lifecycle` (`Init`).
//! - [`checkpoint`]: [`checkpoint::format`] (a checkpoint file's bytes),
//!   [`checkpoint::dir`] (a shard's files: durable writes, verified reads) and
//!   [`checkpoint::protocol`] (triggers, parts, manifests, retention and restore through
//!   etcd).
//! - [`server`]: the pserver process: `config`, `claim` (the shard count and the index),
//!   `service` (the operations behind the lease gate), `convert` (protobuf to the shard's
//!   types and back, for both transports), `grpc`, `membership` (the trainer registry),
//!   `checkpointer`, `run`.
//! - `bulk`: the same pushes and pulls over plain TCP on the same port, floats outside
//!   protobuf (the fast path for large dense models): the shared framing, `serve` (the
//!   pserver's side) and `pool` (the client's).
//! - [`client`]: the trainer's client ([`PsClient`]): `error`, `connection` (shards found
//!   through etcd), `retry`, `init` (once per job, through etcd), `cache` (the trainer's
//!   dense copy), `pull`, `push`, `status` (and probes).
//! - [`wire`]: floats on the wire. (Prefix views are `edl_coord::follow_prefix`; the
//!   job's etcd keys are `edl_job::JobKeys`.)
//! - [`error`]: errors and their mapping to gRPC status codes.

mod bulk;
pub mod checkpoint;
pub mod client;
pub mod error;
pub mod layout;
pub mod optim;
pub mod server;
pub mod shard;
pub mod sync;
pub mod wire;

#[cfg(test)]
mod tests;

pub use checkpoint::{CheckpointConfig, CheckpointEvery};
pub use client::{
    DenseCache, DenseInit, InitOutcome, PsClient, PsClientConfig, PsClientError, PullStats,
    PushOutcome, SparseGrad,
};
pub use error::PsError;
pub use layout::{DenseSpec, Mode, ParamConfig, ParamSpec, RowInit, SparseSpec};
pub use optim::{Clip, LrSchedule, Optimizer, OptimizerConfig, OptimizerKind, SlotState};
pub use server::{IndexChoice, PsConfig, run};
pub use shard::Origin;
