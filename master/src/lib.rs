//! The edl master: splits a RecordIO dataset into tasks, keeps the task queue durable in
//! etcd and leases tasks to trainers.
//!
//! Layout:
//! - [`queue`]: the task queue as a pure, deterministic state machine (events in, changed
//!   tasks out); no I/O, no clocks — time is an argument. By concern: `types`, `dispatch`,
//!   `acks`, `failure` (lost trainers, timeouts), `passes`, `rewind` (a pass rewound to
//!   what a restored pserver shard still has).
//! - [`dataset`]: globs expanded and indexed into deterministic task specs.
//! - the job's etcd keys are `edl_job::JobKeys` (one builder for the whole job tree).
//! - [`store`]: the queue's records in etcd, written by fenced transactions.
//! - `mirror`: a standby's copy of the queue's records, kept from a watch, that a
//!   standby elected leader rebuilds the queue from.
//! - [`core`]: the leader's actor: batches requests, group-commits them, long-polls.
//! - [`server`]: the master process (election, gRPC adapter, trainer follower).
//! - [`metrics`]: `/metrics` in Prometheus text format.
//! - [`snapshots`]: the leader's periodic snapshots of the job's own etcd (a managed
//!   etcd) to the job's storage.
//! - [`error`]: errors and their mapping to gRPC status codes.
//! - `testing` (this crate's tests, and the `testing` feature): an in-process master for
//!   the tests of the master and of its clients.
//!
//! The client side is the crate `edl_master_client` (leader discovery, failover,
//! idempotent retries, a job's overview for `edl status` and the operator), which this
//! crate never depends on. What both sides share, the task types that cross the wire
//! (`LeasedTask`, the answer to `GetTask`) and the wire's limits, is the contract crate
//! `edl_master_api`. The trainer's `cloud_reader` is `edl_trainer::tasks`.

pub mod core;
pub mod dataset;
pub mod error;
pub mod metrics;
mod mirror;
pub mod queue;
pub mod server;
pub mod snapshots;
pub mod store;

#[cfg(any(test, feature = "testing"))]
pub mod testing;
#[cfg(test)]
mod tests;

pub use error::MasterError;
pub use server::{MasterConfig, run};
