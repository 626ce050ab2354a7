//! The pserver process: claims a shard index in etcd, restores its latest checkpoint,
//! serves the gRPC API, follows the trainer registry (sync mode), and checkpoints in the
//! background.
//!
//! A pserver serves only while its etcd lease is held by its own clock: every RPC checks
//! the lease before it starts and again before it answers. While the lease is uncertain
//! (etcd unreachable past the TTL) it refuses every call as retryable and goes on once
//! etcd confirms the lease; a pserver that was paused past its TTL (and replaced)
//! answers nothing once it runs again, and exits when etcd tells it the lease ended.
//!
//! Layout:
//! - `config`: [`PsConfig`], [`IndexChoice`] and the transport's limits.
//! - `claim`: the job's shard count (`ps/desired`) and the claim of `ps/<index>`
//!   ([`PserverRecord`](edl_job::PserverRecord)).
//! - `service`: the pserver's operations whatever the transport, behind the lease gate.
//! - `convert`: protobuf to the shard's types and back, once for both transports.
//! - `grpc`: the gRPC adapter ([`PsGrpc`]).
//! - `membership`: the trainer registry followed (the trainers a sync step expects).
//! - `failed`: the tasks the master failed for good, followed and settled in the shard.
//! - `restore`: a shard restored into this process (checkpoint, failed tasks settled,
//!   `restores/<index>` published).
//! - [`replication`]: the process's replica of its shard, by role: the driver (the
//!   state machine fed by etcd, the peers' connections and time), the etcd record, the
//!   stream's framing, and the duties its role gives the process.
//! - `checkpointer`: the background checkpoint writer, and the coordinator on shard 0.
//! - `run`: startup, serving and shutdown ([`run`](fn@run)): one path for one replica
//!   and many.

mod checkpointer;
mod claim;
mod config;
mod convert;
mod failed;
mod grpc;
mod membership;
mod metrics;
pub mod replication;
mod restore;
mod run;
mod service;

pub use config::{
    CONNECTION_WINDOW, DEFAULT_IO_TIMEOUT, DEFAULT_MAX_BULK_CONNECTIONS, DEFAULT_MAX_MESSAGE_BYTES,
    IndexChoice, MAX_FRAME, MAX_PUSH_WAIT, PsConfig, STREAM_WINDOW,
};
pub use grpc::PsGrpc;
pub use run::run;
pub(crate) use service::Service;
