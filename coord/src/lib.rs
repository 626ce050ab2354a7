//! Coordination for edl on etcd: leases with keep-alive, leader election with
//! fencing, a member registry whose watch never misses a join or a leave, and
//! index claims; plus an in-memory backend with the same semantics for
//! single-process runs and simulation tests.
//!
//! Everything is built on the [`Backend`] trait (etcd's KV, lease, transaction and
//! watch primitives). The recipes take an `Arc<dyn Backend>`, so they behave the
//! same on [`EtcdBackend`] and [`MemBackend`]; one conformance suite
//! (`tests/conformance.rs`) checks both. Tests inject faults with the `edl-testkit`
//! crate (a dev-dependency).
//!
//! # Layout
//!
//! - [`error`]: the [`Error`] enum, with [`Error::is_retryable`].
//! - [`types`]: keys and values, leases, compares, ops, transactions, watch events,
//!   the [`Fence`] token.
//! - [`backend`]: the [`Backend`] trait.
//! - [`etcd`]: [`EtcdBackend`] and its [`EtcdConfig`], by concern: configuration,
//!   connection (auth, TLS), failures, message codec, operations, watches.
//! - [`mem`]: [`MemBackend`], on tokio's clock, by concern: the store (revisions,
//!   history and compaction), leases, transactions, watches, the requests.
//! - [`retry`](mod@retry): [`retry()`] with exponential backoff and jitter,
//!   [`retry_startup`] for a starting process's etcd steps, [`call_until`].
//! - [`lease`]: [`Lease`], kept alive in the background; its [`LeaseState`] (held,
//!   uncertain while etcd does not answer, lost) and a `lost` token.
//! - [`election`]: [`Election`], [`Leadership`] and [`fenced_txn`].
//! - [`registry`]: [`Registry`] and its [`MemberWatch`].
//! - [`membership`]: [`follow_members`], a registry followed until cancelled: events,
//!   periodic listings, re-watched after the watch ends (master and pservers use it).
//! - [`follow`]: [`follow_prefix`], a live view of every key under a prefix, on the same
//!   machinery.
//! - [`index`]: [`claim_index`] and [`claim_index_wait`].
//! - [`local_etcd`]: [`LocalEtcd`], real etcd processes on loopback ports (the
//!   private etcd of `edl run`; the test kit builds on it), and
//!   [`spawn_tied_to_process`](local_etcd::spawn_tied_to_process).
//!
//! # Example
//!
//! ```no_run
//! # async fn demo() -> edl_coord::Result<()> {
//! use std::{sync::Arc, time::Duration};
//! use edl_coord::{Backend, Election, EtcdBackend, EtcdConfig, Lease, Op};
//! use tokio_util::sync::CancellationToken;
//!
//! let shutdown = CancellationToken::new();
//! let backend: Arc<dyn Backend> =
//!     Arc::new(EtcdBackend::connect(EtcdConfig::new(["http://127.0.0.1:2379"])).await?);
//! let lease = Lease::grant(backend.clone(), Duration::from_secs(5), shutdown.clone()).await?;
//! let election = Election::new(backend.clone(), "/edl/job1/master/election");
//! let leadership = election.campaign(&lease, b"10.0.0.1:7000".to_vec(), &shutdown).await?;
//! // Every write as leader is fenced: it fails with `Error::NotLeader` once deposed.
//! leadership.fenced_txn(vec![Op::put("/edl/job1/job/state", "running")]).await?;
//! # Ok(()) }
//! ```

pub mod backend;
pub mod election;
pub mod error;
pub mod etcd;
pub mod follow;
pub mod index;
pub mod lease;
pub mod local_etcd;
pub mod mem;
pub mod membership;
pub mod registry;
pub mod retry;
pub mod types;

pub use backend::{Backend, WatchStream};
pub use election::{Election, LeaderInfo, Leadership, fenced_txn};
pub use error::{Error, Result};
pub use etcd::{
    EtcdAuth, EtcdBackend, EtcdConfig, EtcdMember, EtcdSnapshot, EtcdTls, SNAPSHOT_HASH_LEN,
    SnapshotCheck, random_secret,
};
pub use follow::{PrefixView, follow_prefix};
pub use index::{IndexClaim, claim_index, claim_index_wait};
pub use lease::{Lease, LeaseState};
pub use local_etcd::LocalEtcd;
pub use mem::MemBackend;
pub use membership::{MemberFollow, Membership, follow_members};
pub use registry::{Member, MemberEvent, MemberWatch, Registry};
pub use retry::{
    Attempt, Backoff, CallError, DEFAULT_STARTUP_WAIT, RetryPolicy, call_until, retry,
    retry_cancellable, retry_startup,
};
pub use types::{
    Compare, CompareOp, CompareTarget, EventKind, Fence, FreedSpace, KeyValue, LeaseGrant, LeaseId,
    MAX_REQUEST_BYTES, MAX_TXN_OPS, Op, OpResponse, Revision, Txn, TxnResponse, WatchEvent,
};
