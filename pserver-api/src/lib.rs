//! What the edl parameter servers (`edl_pserver`) and their client
//! (`edl_pserver_client`) share: the contract below both, as neon's `pageserver_api` sits
//! under its client. The pserver never depends on its client; both depend on this.
//!
//! Layout:
//! - [`layout`]: the parameter spec ([`ParamSpec`](layout::ParamSpec),
//!   [`ParamConfig`](layout::ParamConfig), [`Mode`](layout::Mode) from `edl_job`) and its
//!   deterministic layout over the shards: the client routes blocks and rows to shards
//!   with it, the pserver checks and holds them by it.
//! - [`optim`]: the update rules (SGD with momentum/Nesterov/weight decay, Adagrad, Adam,
//!   AdamW) on plain slices; the pserver applies them, the trainer's single-process
//!   baseline reuses them. Their description is `edl_job::optim`, re-exported there.
//! - [`wire`]: floats on the wire.
//! - [`bulk`]: the bulk path's framing and the opening of a connection (its hello).
//! - [`error`]: the [`ErrorKind`](error::ErrorKind)s a pserver's refusal carries.
//! - this file: a push's [`Origin`], and the transport's limits
//!   ([`DEFAULT_MAX_MESSAGE_BYTES`], [`STREAM_WINDOW`], [`CONNECTION_WINDOW`],
//!   [`MAX_FRAME`]).

use serde::{Deserialize, Serialize};

pub mod bulk;
pub mod error;
pub mod layout;
pub mod optim;
pub mod wire;

/// Default largest message: a push or pull of a whole shard of a large model fits.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 1 << 30;
/// HTTP/2 flow-control windows: large, so that one stream moves tens of MB at full speed.
pub const STREAM_WINDOW: u32 = 16 << 20;
/// HTTP/2 connection window.
pub const CONNECTION_WINDOW: u32 = 64 << 20;
/// Largest HTTP/2 frame we accept: large frames mean few, large socket reads.
pub const MAX_FRAME: u32 = 4 << 20;

/// Where a push's gradients come from: the `count` batches from batch `seq` on (their
/// sum) of task `task` (its index in the dataset) in pass `pass`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Origin {
    /// The pass.
    pub pass: u32,
    /// The task's index in the dataset.
    pub task: u32,
    /// The number of its first batch within the task (0, 1, ...).
    pub seq: u32,
    /// Its batches: `seq..seq + count` (at least 1).
    pub count: u32,
}

impl Origin {
    /// Batch `seq` of task `task` of pass `pass`, alone.
    pub fn batch(pass: u32, task: u32, seq: u32) -> Self {
        Origin {
            pass,
            task,
            seq,
            count: 1,
        }
    }
}
