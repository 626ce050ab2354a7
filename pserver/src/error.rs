//! The pserver's errors and their one mapping to gRPC status codes.

use edl_proto::headers;

use crate::checkpoint::CheckpointError;
use crate::layout::LayoutError;

pub use edl_pserver_api::error::{ErrorKind, next_step_of};

/// Why a pserver operation failed.
#[derive(Debug, thiserror::Error)]
pub enum PsError {
    /// This pserver does not serve: lease lost, shutting down, not yet started.
    #[error("pserver not serving: {0}")]
    NotServing(String),
    /// The request is for another shard (the caller's view of `ps/` is stale).
    #[error(
        "this pserver holds shard {have} of {shards}; the request is for shard {want} of {want_shards}"
    )]
    WrongShard {
        /// Our index.
        have: u32,
        /// Our shard count.
        shards: u32,
        /// The requested index.
        want: u32,
        /// The requested shard count.
        want_shards: u32,
    },
    /// The shard holds no parameters yet.
    #[error("shard {0} is not initialised")]
    Uninitialised(u32),
    /// The shard was initialised with another spec.
    #[error("shard already initialised with another model spec: {0}")]
    SpecMismatch(String),
    /// The request is malformed (unknown block or table, wrong length, row of another
    /// shard, ...).
    #[error("invalid request: {0}")]
    InvalidArgument(String),
    /// The spec is invalid.
    #[error(transparent)]
    Spec(#[from] LayoutError),
    /// NaN or infinite values in a gradient (rejected whole, counted, never applied).
    #[error("non-finite gradient values in {0}")]
    NonFinite(String),
    /// Sync mode: the step was closed without this trainer.
    #[error("step {step} is closed; the next step is {next}")]
    StaleStep {
        /// The step pushed.
        step: u64,
        /// The step to push next.
        next: u64,
    },
    /// Async mode: a push more than `window` steps behind its session's newest step;
    /// whether it was applied can no longer be told, so it is not applied now.
    #[error(
        "step {step} is more than {window} steps behind this push session's newest ({newest}); \
         too old to tell whether it was applied, so it is not applied now"
    )]
    StepTooOld {
        /// The step pushed.
        step: u64,
        /// The session's newest step.
        newest: u64,
        /// Steps remembered per session.
        window: u64,
    },
    /// A task's pushes were applied by an earlier incarnation of the shard (it was
    /// restored since from a checkpoint, which may lack them): the task is trained again.
    #[error(
        "task {task} of pass {pass} was pushed to incarnation {pushed_to} of shard {shard}, \
         which was restored since (incarnation {now}); the task is trained again"
    )]
    Rewound {
        /// The shard.
        shard: u32,
        /// The pass.
        pass: u32,
        /// The task's index.
        task: u32,
        /// The incarnation the pushes went to.
        pushed_to: u64,
        /// This incarnation.
        now: u64,
    },
    /// A push's run of batches was partly applied by another attempt at its task.
    #[error(
        "batches {first}..{end} of task {task} of pass {pass} were partly applied by another \
         attempt at the task (it was taken away from this trainer); nothing of this push was \
         applied",
        end = u64::from(*first) + u64::from(*count)
    )]
    Overlap {
        /// The pass.
        pass: u32,
        /// The task's index.
        task: u32,
        /// The run's first batch.
        first: u32,
        /// Its batches.
        count: u32,
    },
    /// Sync mode: pushes must come from registered trainers.
    #[error(
        "trainer {0:?} is not registered under trainers/ (sync mode counts registered trainers)"
    )]
    NotRegistered(String),
    /// The request names another job or carries a wrong token.
    #[error("{0}")]
    Unauthenticated(String),
    /// The caller's certificate names a role that may not make this request.
    #[error("{0}")]
    PermissionDenied(String),
    /// The pserver's etcd lease was lost: it stopped serving (a replacement may hold its
    /// index now).
    #[error("lost the etcd lease of shard {0}; stopped serving")]
    LeaseLost(u32),
    /// An etcd operation failed.
    #[error("etcd: {0}")]
    Coord(edl_coord::Error),
    /// A checkpoint could not be written or read.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// Startup configuration problem (shard count mismatch, bad listener, ...).
    #[error("{0}")]
    Config(String),
    /// Cancelled by shutdown.
    #[error("cancelled")]
    Cancelled,
    /// A bug or a crashed worker thread.
    #[error("internal error: {0}")]
    Internal(String),
}

// The message includes the cause's text, so the cause is not also its `source()`
// (a report of the chain would say it twice).
impl From<edl_coord::Error> for PsError {
    fn from(e: edl_coord::Error) -> Self {
        PsError::Coord(e)
    }
}

impl PsError {
    /// Whether the same call may succeed later (possibly at another pserver).
    pub fn is_retryable(&self) -> bool {
        match self {
            PsError::NotServing(_) | PsError::WrongShard { .. } | PsError::LeaseLost(_) => true,
            PsError::Coord(e) => e.is_retryable(),
            _ => false,
        }
    }

    fn kind(&self) -> Option<ErrorKind> {
        Some(match self {
            PsError::NotServing(_) | PsError::WrongShard { .. } | PsError::LeaseLost(_) => {
                ErrorKind::NotServing
            }
            PsError::Uninitialised(_) => ErrorKind::Uninitialised,
            PsError::SpecMismatch(_) => ErrorKind::SpecMismatch,
            PsError::InvalidArgument(_) | PsError::Spec(_) => ErrorKind::Invalid,
            PsError::NonFinite(_) => ErrorKind::NonFinite,
            PsError::StaleStep { .. } => ErrorKind::StaleStep,
            PsError::StepTooOld { .. } => ErrorKind::TooOld,
            PsError::Rewound { .. } => ErrorKind::Rewound,
            PsError::Overlap { .. } => ErrorKind::Overlap,
            PsError::NotRegistered(_) => ErrorKind::NotRegistered,
            _ => return None,
        })
    }
}

impl From<PsError> for tonic::Status {
    fn from(e: PsError) -> Self {
        use tonic::Code;
        let msg = e.to_string();
        let kind = e.kind();
        let code = match &e {
            PsError::NotServing(_)
            | PsError::WrongShard { .. }
            | PsError::LeaseLost(_)
            | PsError::Cancelled => Code::Unavailable,
            PsError::Coord(c) if c.is_retryable() => Code::Unavailable,
            PsError::Coord(_) => Code::Internal,
            PsError::Uninitialised(_)
            | PsError::NotRegistered(_)
            | PsError::StepTooOld { .. }
            | PsError::Rewound { .. } => Code::FailedPrecondition,
            PsError::SpecMismatch(_) => Code::AlreadyExists,
            PsError::InvalidArgument(_) | PsError::Spec(_) | PsError::NonFinite(_) => {
                Code::InvalidArgument
            }
            PsError::StaleStep { .. } | PsError::Overlap { .. } => Code::Aborted,
            PsError::Unauthenticated(_) => Code::Unauthenticated,
            PsError::PermissionDenied(_) => Code::PermissionDenied,
            PsError::Checkpoint(_) | PsError::Config(_) | PsError::Internal(_) => Code::Internal,
        };
        let mut status = tonic::Status::new(code, msg);
        if let Some(kind) = kind {
            headers::set_detail(&mut status, headers::ERROR_KIND, kind.as_str());
        }
        if let PsError::StaleStep { next, .. } = e {
            headers::set_detail(&mut status, headers::NEXT_STEP, &next.to_string());
        }
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_and_codes() {
        let s: tonic::Status = PsError::StaleStep { step: 3, next: 5 }.into();
        assert_eq!(s.code(), tonic::Code::Aborted);
        assert_eq!(ErrorKind::of(&s), Some(ErrorKind::StaleStep));
        assert_eq!(next_step_of(&s), Some(5));
        let s: tonic::Status = PsError::NonFinite("block 3".into()).into();
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        assert_eq!(ErrorKind::of(&s), Some(ErrorKind::NonFinite));
        let s: tonic::Status = PsError::LeaseLost(1).into();
        assert_eq!(s.code(), tonic::Code::Unavailable);
        assert_eq!(ErrorKind::of(&s), Some(ErrorKind::NotServing));
        let s: tonic::Status = PsError::Uninitialised(0).into();
        assert_eq!(ErrorKind::of(&s), Some(ErrorKind::Uninitialised));
        for k in [
            ErrorKind::NotServing,
            ErrorKind::Uninitialised,
            ErrorKind::StaleStep,
            ErrorKind::NotRegistered,
            ErrorKind::SpecMismatch,
            ErrorKind::NonFinite,
            ErrorKind::TooOld,
            ErrorKind::Invalid,
        ] {
            assert_eq!(ErrorKind::parse(k.as_str()), Some(k));
        }
    }
}
