//! The master's errors and their one mapping to gRPC status codes.

use crate::dataset::DatasetError;
use crate::queue::Reject;

/// Why a master call failed.
#[derive(Debug, thiserror::Error)]
pub enum MasterError {
    /// This master is a standby (or lost its leadership); `leader` is where to go.
    #[error("not the leading master{}", .leader.as_deref().map(|l| format!(" (leader: {l})")).unwrap_or_default())]
    NotLeader {
        /// The leader's address, when known.
        leader: Option<String>,
    },
    /// The master cannot serve right now (etcd unreachable, state being rebuilt). Retry.
    #[error("master unavailable: {0}")]
    Unavailable(String),
    /// etcd's database is full: the job is paused until it has space (the text says
    /// what to do). Retry.
    #[error("the job is paused: {0}")]
    EtcdFull(String),
    /// This master leads and is loading the queue from etcd (the text says for how
    /// long so far). Retry: clients wait for as long as it lasts.
    #[error("the leading master is loading the queue: {0}")]
    Loading(String),
    /// The request is malformed.
    #[error("invalid request: {0}")]
    InvalidArgument(String),
    /// The dataset could not be defined.
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    /// A task report was rejected (stale generation, unknown task, not pending).
    #[error(transparent)]
    Rejected(#[from] Reject),
    /// The request names another job, or carries a wrong token.
    #[error("{0}")]
    Unauthenticated(String),
    /// A record is too large for one etcd transaction (records are bounded by
    /// construction: this is a bug, not a condition to retry).
    #[error("record too large: {0}")]
    TooLarge(String),
}

impl MasterError {
    /// Whether the same call may succeed later (possibly at another master).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            MasterError::NotLeader { .. }
                | MasterError::Unavailable(_)
                | MasterError::EtcdFull(_)
                | MasterError::Loading(_)
        )
    }
}

impl From<edl_coord::Error> for MasterError {
    fn from(e: edl_coord::Error) -> Self {
        match e {
            edl_coord::Error::NotLeader => MasterError::NotLeader { leader: None },
            e @ edl_coord::Error::NoSpace { .. } => MasterError::EtcdFull(e.to_string()),
            other => MasterError::Unavailable(other.to_string()),
        }
    }
}

impl From<MasterError> for tonic::Status {
    fn from(e: MasterError) -> Self {
        use tonic::Code;
        let msg = e.to_string();
        match e {
            MasterError::NotLeader { leader } => {
                let mut s = tonic::Status::new(Code::Unavailable, msg);
                if let Some(addr) = leader {
                    edl_proto::headers::set_detail(&mut s, edl_proto::headers::LEADER, &addr);
                }
                s
            }
            MasterError::Unavailable(_) => tonic::Status::new(Code::Unavailable, msg),
            MasterError::EtcdFull(_) => {
                let mut s = tonic::Status::new(Code::Unavailable, msg);
                edl_proto::headers::set_detail(
                    &mut s,
                    edl_proto::headers::ERROR_KIND,
                    edl_proto::headers::KIND_PAUSED,
                );
                s
            }
            MasterError::Loading(_) => {
                let mut s = tonic::Status::new(Code::Unavailable, msg);
                edl_proto::headers::set_detail(
                    &mut s,
                    edl_proto::headers::ERROR_KIND,
                    edl_proto::headers::KIND_LOADING,
                );
                s
            }
            MasterError::InvalidArgument(_) => tonic::Status::new(Code::InvalidArgument, msg),
            MasterError::Dataset(DatasetError::Conflict { .. }) => {
                tonic::Status::new(Code::AlreadyExists, msg)
            }
            MasterError::Dataset(DatasetError::Invalid(_)) => {
                tonic::Status::new(Code::InvalidArgument, msg)
            }
            MasterError::Dataset(DatasetError::Index(_)) => {
                tonic::Status::new(Code::FailedPrecondition, msg)
            }
            MasterError::Dataset(DatasetError::Storage(e)) if e.is_transient() => {
                tonic::Status::new(Code::Unavailable, msg)
            }
            MasterError::Dataset(DatasetError::Storage(_)) => {
                tonic::Status::new(Code::FailedPrecondition, msg)
            }
            MasterError::Rejected(Reject::Stale { .. }) => tonic::Status::new(Code::Aborted, msg),
            MasterError::Rejected(Reject::UnknownTask(_)) => {
                tonic::Status::new(Code::NotFound, msg)
            }
            MasterError::Rejected(Reject::NotPending { .. }) => {
                tonic::Status::new(Code::FailedPrecondition, msg)
            }
            MasterError::Unauthenticated(_) => tonic::Status::new(Code::Unauthenticated, msg),
            MasterError::TooLarge(_) => tonic::Status::new(Code::Internal, msg),
        }
    }
}
