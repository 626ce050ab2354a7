//! The crate's error type, shared by both backends and every recipe.

use std::time::Duration;

use crate::types::Revision;

/// Result with [`Error`] as the default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of the coordination layer.
///
/// Callers branch on the variant: [`Error::is_retryable`] tells whether the same
/// request may succeed later (etcd unreachable, no quorum, a timeout); the others
/// are final for that request.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No endpoint could serve the request (connection refused, no leader, too
    /// many requests, connection lost). Retryable.
    #[error("cannot reach etcd at {}: {msg}", endpoints.join(", "))]
    Unavailable {
        /// The endpoints that were tried.
        endpoints: Vec<String>,
        /// What went wrong, as reported by the transport or the server.
        msg: String,
    },

    /// The request did not complete within its deadline. Retryable, but note that a
    /// mutation that timed out may or may not have been applied.
    #[error("request timed out after {0:?}")]
    Timeout(Duration),

    /// A fenced write was refused: the caller's election key (or claimed index) is
    /// gone or was re-created, so the caller is no longer the leader (owner).
    #[error("not the leader: the fencing compare failed")]
    NotLeader,

    /// The lease expired, was revoked, or is unknown to the server.
    #[error("lease lost (expired, revoked or unknown)")]
    LeaseLost,

    /// A watch asked for history that was compacted away. Re-list and watch again
    /// from the revision of the listing.
    #[error("revision compacted; the oldest revision still available is {compact_revision}")]
    Compacted {
        /// The compaction revision: watches may start at this revision or later.
        compact_revision: Revision,
    },

    /// The operation was cancelled by its caller's token.
    #[error("operation cancelled")]
    Cancelled,

    /// A request was malformed (empty key, duplicate key in a transaction, a future
    /// or compacted revision in `compact`, too many operations, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// [`claim_index`](crate::claim_index) found every index in `[0, n)` taken.
    #[error("no free index in [0, {n})")]
    NoFreeIndex {
        /// The number of indices.
        n: u32,
    },

    /// A registry member id is held by another lease (another live process).
    #[error("member {id:?} is already registered under another lease")]
    AlreadyRegistered {
        /// The member id.
        id: String,
    },

    /// Authentication failed or the user lacks a permission.
    #[error("permission denied: {0}")]
    PermissionDenied(String),

    /// The server sent something this crate cannot decode (a non-UTF-8 key, a
    /// missing field, an unknown enum value).
    #[error("malformed response from etcd: {0}")]
    Malformed(String),

    /// etcd's database is full: its size reached `--quota-backend-bytes` and etcd
    /// raised its `NOSPACE` alarm. Until the alarm ends, etcd refuses every write that
    /// adds data (puts, transactions that put, lease grants) on every member, and
    /// still serves reads, deletes and lease renewals. Retryable (the request succeeds
    /// once space is freed, see [`Backend::free_space`](crate::Backend::free_space)),
    /// but never by trying another endpoint.
    #[error(
        "etcd's database is full ({msg}): free space (delete unneeded keys, compact, \
         defragment every member, then `etcdctl alarm disarm`) or restart etcd with a \
         larger --quota-backend-bytes; see docs/design.md, \"A full etcd\""
    )]
    NoSpace {
        /// What etcd said.
        msg: String,
    },

    /// Any other error reported by etcd or the client library. Not retryable.
    #[error("etcd error: {0}")]
    Etcd(String),
}

impl Error {
    /// Whether the same request may succeed if tried again later.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::Unavailable { .. } | Error::Timeout(_) | Error::NoSpace { .. }
        )
    }

    /// Whether etcd refused because its database is full ([`Error::NoSpace`]).
    pub fn is_no_space(&self) -> bool {
        matches!(self, Error::NoSpace { .. })
    }

    /// An [`Error::Unavailable`] from one endpoint (retryable).
    pub fn unavailable(endpoint: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Unavailable {
            endpoints: vec![endpoint.into()],
            msg: msg.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryable_classification() {
        assert!(Error::unavailable("a:1", "down").is_retryable());
        assert!(Error::Timeout(Duration::from_secs(1)).is_retryable());
        let full = Error::NoSpace {
            msg: "etcdserver: mvcc: database space exceeded".into(),
        };
        assert!(full.is_retryable() && full.is_no_space());
        assert!(full.to_string().contains("alarm disarm"), "{full}");
        for e in [
            Error::NotLeader,
            Error::LeaseLost,
            Error::Cancelled,
            Error::Compacted {
                compact_revision: 3,
            },
            Error::InvalidArgument("x".into()),
            Error::NoFreeIndex { n: 3 },
        ] {
            assert!(!e.is_retryable(), "{e}");
        }
    }

    #[test]
    fn unavailable_names_endpoints() {
        let e = Error::Unavailable {
            endpoints: vec!["http://127.0.0.1:1".into(), "http://127.0.0.1:2".into()],
            msg: "connection refused".into(),
        };
        let s = e.to_string();
        assert!(s.contains("http://127.0.0.1:1, http://127.0.0.1:2"), "{s}");
        assert!(s.contains("connection refused"), "{s}");
    }
}
