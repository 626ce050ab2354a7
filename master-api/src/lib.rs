//! What the edl master (`edl_master`) and its client (`edl_master_client`) share: the
//! contract below both, so that the master never depends on its client.
//!
//! Layout:
//! - [`task`]: [`LeasedTask`], [`Answer`] and [`Release`], the task as it travels to a
//!   trainer and back, converted to protobuf there and only there.
//! - [`goodput`]: [`Goodput`], a trainer's wall time split into [`Bucket`]s, sent with
//!   `GetTask` and shown by `Status`.
//! - this file: the wire's limits ([`MAX_MESSAGE_BYTES`], [`MAX_REASON_WIRE_BYTES`]).
//!
//! Keeping them here rather than in `edl_proto` keeps protobuf out of the domain types'
//! users.

pub mod goodput;
pub mod task;

pub use goodput::{Bucket, Goodput};
pub use task::{Answer, LeasedTask, Release, Resume};

/// Largest request the master accepts (a SetDataset with many globs fits easily).
pub const MAX_MESSAGE_BYTES: usize = 4 << 20;
/// Longest failure reason a report may carry, in bytes (the master refuses a longer one;
/// the client cuts it).
pub const MAX_REASON_WIRE_BYTES: usize = 64 << 10;
