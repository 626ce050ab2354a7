//! The edl master: splits a RecordIO dataset into tasks, keeps the task queue durable in
//! etcd and leases tasks to trainers.
//!
//! Layout:
//! - [`dataset`]: globs expanded and indexed into deterministic task specs.
//! - [`queue`]: the task queue as a pure, deterministic state machine (events in, changed
//!   tasks out); no I/O, no clocks — time is an argument.

pub mod dataset;
pub mod queue;
