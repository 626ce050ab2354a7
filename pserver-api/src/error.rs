//! The kinds of error a pserver's refusal carries ([`ErrorKind`], [`next_step_of`]): the
//! pserver sets them in a status's details, the client reads them.

use edl_proto::headers;

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
