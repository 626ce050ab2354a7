//! The edl master: splits a RecordIO dataset into tasks, keeps the task queue durable in
//! etcd and leases tasks to trainers.
//!
//! Layout:
//! - [`queue`]: the task queue as a pure, deterministic state machine (events in, changed
//!   tasks out); no I/O, no clocks — time is an argument. By concern: `types`, `dispatch`,
//!   `acks`, `failure` (lost trainers, timeouts), `passes`.
//! - [`dataset`]: globs expanded and indexed into deterministic task specs.
//! - the job's etcd keys are `edl_job::JobKeys` (one builder for the whole job tree).
//! - [`store`]: the queue's records in etcd, written by fenced transactions.
//! - [`core`]: the leader's actor: batches requests, group-commits them, long-polls.
//! - [`server`]: the master process (election, gRPC adapter, trainer follower).
//! - [`task`]: [`task::LeasedTask`] and [`task::Next`], the task as it travels to a trainer
//!   and back (both sides of the wire), converted to protobuf there and only there.
//! - [`client`]: the trainer's client: leader discovery, failover, idempotent retries.
//! - [`reader`]: the `cloud_reader`: leased tasks read ahead, acknowledged after training.
//! - [`metrics`]: `/metrics` in Prometheus text format.
//! - [`error`]: errors and their mapping to gRPC status codes.

pub mod client;
pub mod core;
pub mod dataset;
pub mod error;
pub mod metrics;
pub mod overview;
pub mod queue;
pub mod reader;
pub mod server;
pub mod store;
pub mod task;

#[cfg(test)]
mod tests;

pub use error::MasterError;
pub use server::{MasterConfig, run};
