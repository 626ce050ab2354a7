//! A process's replica of its shard, the shell around the group's state machine
//! ([`crate::replica`]); docs/replication.md. One path for one replica and many: a
//! shard of one replica is a group of one.
//!
//! Layout, by role:
//! - [`driver`]: the replica driven ([`Replication`]): the machine fed by etcd, the
//!   peers' connections and time, its effects carried out; the peers' connections.
//! - [`record`]: the etcd side: the member key, the group record, guarded
//!   compare-and-swaps ([`GroupStore`]).
//! - [`stream`]: the replication stream's framing.
//! - `duties`: what the process does as its replica's role gives it (restore the shard
//!   when no replica may hold an acknowledged op; as primary, hold `ps/<index>`,
//!   checkpoint, settle failed tasks).
//!
//! The ops the stream carries are the shard's (`crate::shard::ops`).

pub mod driver;
pub(crate) mod duties;
pub mod record;
pub mod stream;

pub use driver::{Links, Replication, Upstream, member_id, replicate_frame, replicate_header};
pub use record::GroupStore;
