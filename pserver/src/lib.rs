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
//! The client is the crate `edl_pserver_client`, which this crate never depends on. What
//! both sides of the wire share is the contract crate `edl_pserver_api`, below both: the
//! parameter layout, the optimizers' update rules, the floats' encoding, the bulk path's
//! framing, the error kinds and the transport's limits (imported below as `layout`,
//! `optim` and `wire`, so `crate::layout` names the contract's module).
//!
//! Layout:
//! - [`sync`]: the sync-mode step protocol as a pure state machine.
//! - [`shard`]: a shard's parameters and update logic on its own types (no protobuf, no
//!   I/O), one concern per file: `storage`, `push` (validation), `dedup` (the async
//!   window), `async_apply`, `sync_apply`, `pull`, `snapshot`, `lifecycle` (`Init`), `ledger` and `tasks` (the exactly-once
//!   ledger of acknowledged tasks).
//! - [`replica`]: a shard's replica group (primary, in-sync backups, joiners, the
//!   epoch that fences them) as a pure state machine (docs/replication.md).
//! - [`checkpoint`]: [`checkpoint::format`] (a checkpoint file's bytes),
//!   [`checkpoint::dir`] (a shard's files: durable writes, verified reads) and
//!   [`checkpoint::protocol`] (triggers, parts, manifests, retention and restore through
//!   etcd).
//! - [`server`]: the pserver process: `config`, `claim` (the shard count and the index),
//!   `service` (the operations behind the lease gate), `convert` (protobuf to the shard's
//!   types and back, for both transports), `grpc`, `membership` (the trainer registry),
//!   `checkpointer`, `run`.
//! - `bulk`: the pserver's side of the bulk path (the same pushes and pulls over plain
//!   TCP on the same port, floats outside protobuf: the fast path for large dense
//!   models); its framing is `edl_pserver_api::bulk`. (Prefix views are
//!   `edl_coord::follow_prefix`; the job's etcd keys are `edl_job::JobKeys`.)
//! - [`error`]: errors and their mapping to gRPC status codes (the kinds a refusal
//!   carries are the client's [`ErrorKind`](error::ErrorKind)).

mod bulk;
pub mod checkpoint;
pub mod error;
pub mod replica;
pub mod server;
pub mod shard;
pub mod sync;

#[cfg(test)]
mod tests;

use edl_pserver_api::{layout, optim, wire};

pub use checkpoint::{CheckpointConfig, CheckpointEvery};
pub use error::PsError;
pub use server::{IndexChoice, PsConfig, run};
