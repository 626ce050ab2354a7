//! Why a client call failed ([`PsClientError`]), and the kinds of error a pserver's
//! refusal carries ([`ErrorKind`], [`next_step_of`]): the pserver sets them, the client
//! reads them, so they live here, below both.

use std::time::Duration;

use tonic::Code;

use crate::layout::LayoutError;
use edl_proto::headers;

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

/// Machine-readable kinds of pserver errors, carried in the status detail
/// [`headers::ERROR_KIND`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The pserver does not serve (lease lost, shutting down, wrong shard): look the
    /// shard up again in etcd and retry.
    NotServing,
    /// The shard has no parameters (a pserver restarted without a checkpoint): a trainer
    /// sends them again with `Init` + `FinishInit`.
    Uninitialised,
    /// Sync: the step is closed; pull and push the next one.
    StaleStep,
    /// Sync: the trainer is not registered under `trainers/`.
    NotRegistered,
    /// The shard was initialised with another spec.
    SpecMismatch,
    /// NaN or infinite gradients.
    NonFinite,
    /// Async: the push is older than its session's deduplication window.
    TooOld,
    /// A task's pushes were applied by an earlier incarnation of the shard, restored
    /// since from a checkpoint: train the task again.
    Rewound,
    /// The push's run of batches was partly applied by another attempt at its task (the
    /// task was taken away from this trainer): nothing of it applied.
    Overlap,
    /// Any other malformed request.
    Invalid,
}

impl ErrorKind {
    /// The header value.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::NotServing => "not-serving",
            ErrorKind::Uninitialised => "uninitialised",
            ErrorKind::StaleStep => "stale-step",
            ErrorKind::NotRegistered => "not-registered",
            ErrorKind::SpecMismatch => "spec-mismatch",
            ErrorKind::NonFinite => "non-finite",
            ErrorKind::TooOld => "too-old",
            ErrorKind::Rewound => "rewound",
            ErrorKind::Overlap => "overlap",
            ErrorKind::Invalid => "invalid",
        }
    }

    /// Parses a header value.
    pub fn parse(s: &str) -> Option<ErrorKind> {
        Some(match s {
            "not-serving" => ErrorKind::NotServing,
            "uninitialised" => ErrorKind::Uninitialised,
            "stale-step" => ErrorKind::StaleStep,
            "rewound" => ErrorKind::Rewound,
            "not-registered" => ErrorKind::NotRegistered,
            "spec-mismatch" => ErrorKind::SpecMismatch,
            "non-finite" => ErrorKind::NonFinite,
            "too-old" => ErrorKind::TooOld,
            "overlap" => ErrorKind::Overlap,
            "invalid" => ErrorKind::Invalid,
            _ => return None,
        })
    }

    /// The kind carried by a status, if any.
    pub fn of(status: &tonic::Status) -> Option<ErrorKind> {
        headers::detail(status, headers::ERROR_KIND).and_then(ErrorKind::parse)
    }
}

/// The next step carried by a stale-step status.
pub fn next_step_of(status: &tonic::Status) -> Option<u64> {
    headers::detail(status, headers::NEXT_STEP).and_then(|s| s.parse().ok())
}
