//! Checkpoints of the shards: the file format, the files of one shard on disk, and the
//! protocol through etcd that decides when to take them, commits complete sets, prunes
//! old ones and restores the newest usable one.
//!
//! Layout:
//! - [`format`](mod@format): the bytes of one checkpoint file (a [`Snapshot`] encoded,
//!   checksummed, and parsed back with bounds checks).
//! - [`dir`]: a shard's checkpoint directory: durable writes, reads verified against the
//!   [`ShardEntry`] a manifest names, listing, cleanup.
//! - [`protocol`]: triggers, per-shard parts, [`Manifest`] commits, retention and restore
//!   through etcd.

pub mod dir;
pub mod format;
pub mod protocol;

pub use dir::{CheckpointDir, CheckpointError, ShardEntry};
pub use format::{BlockSnap, RowSnap, Snapshot};
pub use protocol::{CheckpointConfig, CheckpointEvery, Manifest};
