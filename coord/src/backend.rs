//! The [`Backend`] trait: the KV, lease and watch primitives that both backends
//! implement with etcd's semantics.

use std::fmt;
use std::pin::Pin;
use std::time::Duration;

use async_trait::async_trait;
use futures::Stream;

use crate::error::Result;
use crate::types::{
    FreedSpace, KeyValue, LeaseGrant, LeaseId, Revision, Txn, TxnResponse, WatchEvent,
};

/// A stream of watch events. An `Err` item is terminal: the stream ends after it.
/// The stream also ends (with an error) when the connection is lost; callers that
/// must see every event resume from the revision after the last one they saw.
pub type WatchStream = Pin<Box<dyn Stream<Item = Result<WatchEvent>> + Send>>;

/// Key-value store primitives with etcd v3 semantics.
///
/// Implemented by [`EtcdBackend`](crate::EtcdBackend) and
/// [`MemBackend`](crate::MemBackend); recipes take an `Arc<dyn Backend>` so they
/// behave the same on both.
///
/// Semantics shared by both implementations (checked by the conformance suite):
/// - the store revision starts at 1 and each committed write (put, delete of an
///   existing key, transaction with at least one effective write, lease end that
///   deletes keys) bumps it by exactly one;
/// - a key's `version` counts writes since creation and resets on delete;
/// - a put without lease detaches the key from its previous lease;
/// - a put attached to an unknown lease fails with [`Error::LeaseLost`](crate::Error::LeaseLost);
/// - lease TTLs are whole seconds (rounded up);
/// - watches deliver every event from their start revision, in revision order.
#[async_trait]
pub trait Backend: Send + Sync + fmt::Debug + 'static {
    /// Reads one key.
    async fn get(&self, key: &str) -> Result<Option<KeyValue>>;

    /// Reads every key that starts with `prefix`, sorted by key, from one consistent
    /// snapshot; returns them with the store revision of that snapshot. (etcd reads
    /// it in pages, all at the revision of the first page.)
    async fn range(&self, prefix: &str) -> Result<(Vec<KeyValue>, Revision)>;

    /// Writes `value` at `key`, attached to `lease` if given; returns the revision of
    /// the write. A request over [`MAX_REQUEST_BYTES`](crate::types::MAX_REQUEST_BYTES)
    /// fails with [`Error::InvalidArgument`](crate::Error::InvalidArgument).
    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision>;

    /// Deletes one key; returns whether it existed.
    async fn delete(&self, key: &str) -> Result<bool>;

    /// Deletes every key that starts with `prefix`; returns how many were deleted.
    async fn delete_prefix(&self, prefix: &str) -> Result<u64>;

    /// Runs a transaction.
    ///
    /// etcd bounds a transaction: at most [`MAX_TXN_OPS`](crate::types::MAX_TXN_OPS)
    /// (128) operations per branch and compares, nested transactions included, and
    /// at most [`MAX_REQUEST_BYTES`](crate::types::MAX_REQUEST_BYTES) (1.5 MiB, etcd's
    /// default `--max-request-bytes`) for the whole request. A larger one fails with
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) and changes nothing
    /// (both backends); batch writers must split their batches.
    async fn txn(&self, txn: Txn) -> Result<TxnResponse>;

    /// Discards the history before `revision`: watches starting earlier then fail
    /// with [`Error::Compacted`](crate::Error::Compacted). Returns once the old
    /// versions are gone from the database itself (etcd: a physical compaction), so a
    /// defragmentation after it frees their space.
    async fn compact(&self, revision: Revision) -> Result<()>;

    /// Frees the space of a full store, as an operator would after
    /// [`Error::NoSpace`](crate::Error::NoSpace): compacts the history to the current
    /// revision (watches that start earlier then re-list), defragments (etcd: every
    /// member, one at a time; each blocks while it runs) and ends the space alarm. A
    /// write that still does not fit raises the alarm again. On etcd with
    /// authentication it needs a user that may manage the cluster (`root`); a job's
    /// user gets [`Error::PermissionDenied`](crate::Error::PermissionDenied).
    async fn free_space(&self) -> Result<FreedSpace>;

    /// Grants a lease with the given TTL (rounded up to whole seconds).
    async fn lease_grant(&self, ttl: Duration) -> Result<LeaseGrant>;

    /// Renews a lease once. Returns the TTL it now has, or `None` when the lease is
    /// gone (expired or revoked).
    async fn lease_keep_alive_once(&self, id: LeaseId) -> Result<Option<Duration>>;

    /// Revokes a lease, deleting its keys. Revoking an unknown lease is not an error.
    async fn lease_revoke(&self, id: LeaseId) -> Result<()>;

    /// The remaining TTL of a lease, or `None` when it is gone.
    async fn lease_ttl(&self, id: LeaseId) -> Result<Option<Duration>>;

    /// Watches every key starting with `prefix`, from `start_revision` (inclusive)
    /// or, when `None`, from the next write. When this returns, the watch is
    /// established: no later write is missed.
    async fn watch_prefix(
        &self,
        prefix: &str,
        start_revision: Option<Revision>,
    ) -> Result<WatchStream>;
}
