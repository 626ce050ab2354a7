//! Why a client call failed ([`PsClientError`]). The kinds of error a pserver's refusal
//! carries ([`ErrorKind`], [`next_step_of`]) are the contract's, `edl_pserver_api::error`,
//! re-exported here.

use std::time::Duration;

use tonic::Code;

use crate::layout::LayoutError;

pub use edl_pserver_api::error::{ErrorKind, next_step_of};

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum PsClientError {
    /// A shard did not answer within the call's retry budget.
    #[error("shard {shard} of job {job} unreachable for {waited:?}: {last}")]
    Unavailable {
        /// The job.
        job: String,
        /// The shard.
        shard: u32,
        /// How long the call tried.
        waited: Duration,
        /// The last error seen.
        last: String,
    },
    /// A pserver refused the call (malformed request, NaN gradients, ...); retrying will
    /// not help.
    #[error("shard {shard} refused: {status}")]
    Refused {
        /// The shard.
        shard: u32,
        /// The status.
        status: tonic::Status,
    },
    /// The arguments do not fit the model (unknown parameter, wrong length, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// NaN or infinite gradient values: the push was refused whole before any shard was
    /// sent any of it (kind [`ErrorKind::NonFinite`], as a pserver's refusal).
    #[error("non-finite gradient values in {0}; nothing was pushed")]
    NonFinite(String),
    /// Sync mode: the step was applied without this push; pull and push `next`.
    #[error("step {step} was already applied without this trainer; the next step is {next}")]
    StaleStep {
        /// The step pushed.
        step: u64,
        /// The step to push next.
        next: u64,
    },
    /// Sync mode: the shard holds no parameters (restored with no checkpoint): pull,
    /// which initialises it from the initial values, and push again. (In async mode a
    /// push waits for another call's pull to do it.)
    #[error("shard {shard} has no parameters: pull to initialise it, then push again")]
    Uninitialised {
        /// The shard.
        shard: u32,
    },
    /// A shard was restored since it answered a task's pushes, from a checkpoint that may
    /// lack some of them: train the task again.
    #[error("shard {shard}: {msg}")]
    Rewound {
        /// The shard.
        shard: u32,
        /// The pserver's explanation.
        msg: String,
    },
    /// A shard refused a push whose batches another attempt at the task partly applied:
    /// the task was taken away from this trainer (the other attempt trains the rest).
    #[error("shard {shard}: {msg}")]
    Overlap {
        /// The shard.
        shard: u32,
        /// The pserver's explanation.
        msg: String,
    },
    /// A pserver probed directly refused or failed the call.
    #[error("the pserver at {addr} refused: {status}")]
    ProbeRefused {
        /// The address.
        addr: String,
        /// The status.
        status: tonic::Status,
    },
    /// A pserver could not be reached at all (direct probes).
    #[error("cannot reach the pserver at {addr}: {msg}")]
    Connect {
        /// The address.
        addr: String,
        /// What failed.
        msg: String,
    },
    /// No trainer initialised the parameters yet.
    #[error("the parameters of job {0} are not initialised yet")]
    NotInitialised(String),
    /// The job was initialised with another model spec.
    #[error("the job's parameters were initialised with another model spec: {0}")]
    SpecMismatch(String),
    /// The spec is invalid.
    #[error(transparent)]
    Spec(#[from] LayoutError),
    /// etcd failed.
    #[error("etcd: {0}")]
    Coord(edl_coord::Error),
    /// Cancelled.
    #[error("cancelled")]
    Cancelled,
}

// The message includes the cause's text, so the cause is not also its `source()`
// (a report of the chain would say it twice).
impl From<edl_coord::Error> for PsClientError {
    fn from(e: edl_coord::Error) -> Self {
        PsClientError::Coord(e)
    }
}

impl PsClientError {
    /// The gRPC code of a refusal.
    pub fn code(&self) -> Option<Code> {
        match self {
            PsClientError::Refused { status, .. } | PsClientError::ProbeRefused { status, .. } => {
                Some(status.code())
            }
            _ => None,
        }
    }

    /// The pserver's error kind of a refusal ([`ErrorKind::NonFinite`] too for
    /// gradients the client refused before sending them).
    pub fn kind(&self) -> Option<ErrorKind> {
        match self {
            PsClientError::NonFinite(_) => Some(ErrorKind::NonFinite),
            PsClientError::Refused { status, .. } | PsClientError::ProbeRefused { status, .. } => {
                ErrorKind::of(status)
            }
            _ => None,
        }
    }
}
