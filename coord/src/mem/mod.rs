//! [`MemBackend`]: an in-process store with etcd's semantics (revisions, versions,
//! leases on tokio's clock, watches from a revision over a bounded history,
//! transactions with compares and nested transactions).
//!
//! Only for single-process runs and simulation tests: nothing is persisted and
//! nothing is shared across processes. Lease expiry runs on tokio's clock, so tests
//! on a paused runtime (`#[tokio::test(start_paused = true)]`) control it with
//! `tokio::time::advance` or by sleeping.
//!
//! Invariants:
//! - every effective write (a put, a delete that removed a key, a transaction that
//!   changed something, an expired or revoked lease with keys) is one revision, and
//!   its events enter the history together; a request that changes nothing leaves
//!   the revision as it was;
//! - history is dropped whole revisions at a time, and the compact revision only
//!   grows: a watch sees all of a revision's events or is told it was compacted;
//! - a lease's `keys` are exactly the keys attached to it, so ending a lease deletes
//!   them all in one revision;
//! - a transaction's branches are decided against the state before it (as etcd does),
//!   and a request etcd would refuse (size, duplicate keys, missing lease) changes
//!   nothing.
//!
//! Layout (each part adds its methods to [`MemBackend`] or to the shared state):
//! - this file: [`MemBackend`], its shared state and its constructors.
//! - `store`: the key space and its revisions: one revision's writes (`Writer`), the
//!   commit that appends them to the history and compacts it.
//! - `lease`: leases on tokio's clock: expiry (on every request and by a background
//!   task), ending a lease with its keys, TTLs in whole seconds.
//! - `txn`: transactions: compares, etcd's size and duplicate-key rules, branches
//!   decided up front, then applied.
//! - `watches`: watch streams read from the shared history.
//! - `space`: the space quota and its alarm.
//! - `requests`: the [`Backend`](crate::Backend) implementation over those parts.
//! - `tests`: unit tests and the property test of the history.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::types::{KeyValue, LeaseId, Revision, WatchEvent};

use lease::MAX_LEASE_TTL_SECS;

mod lease;
mod requests;
mod space;
mod store;
mod txn;
mod watches;

#[cfg(test)]
mod tests;

/// Default number of events kept for watches that start in the past.
pub const DEFAULT_HISTORY_LIMIT: usize = 10_000;

/// An in-memory [`Backend`](crate::Backend). Cheap to clone (clones share the store).
#[derive(Clone)]
pub struct MemBackend {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
    /// The latest committed revision; watch streams wait on it.
    revision_tx: watch::Sender<Revision>,
    /// Woken when a lease is granted, so the expiry task re-computes its deadline.
    lease_granted: Arc<Notify>,
    expiry_task_started: AtomicBool,
    /// Stops the expiry task when the store is dropped.
    shutdown: CancellationToken,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

struct MemLease {
    ttl: Duration,
    deadline: Instant,
    keys: BTreeSet<String>,
}

struct State {
    revision: Revision,
    kvs: BTreeMap<String, KeyValue>,
    leases: HashMap<LeaseId, MemLease>,
    next_lease_id: i64,
    history: VecDeque<WatchEvent>,
    history_limit: usize,
    /// Watches must start at this revision or later.
    compact_revision: Revision,
    /// Granted TTLs are raised to this many seconds (etcd's minimum TTL).
    min_ttl_secs: u64,
    /// The space quota in bytes (etcd's `--quota-backend-bytes`), if any.
    quota: Option<u64>,
    /// The space alarm: raised by a write that does not fit the quota, ended only by
    /// [`Backend::free_space`](crate::Backend::free_space) (as etcd's `NOSPACE`).
    no_space: bool,
}

impl fmt::Debug for MemBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.inner.lock();
        f.debug_struct("MemBackend")
            .field("revision", &st.revision)
            .field("keys", &st.kvs.len())
            .field("leases", &st.leases.len())
            .finish_non_exhaustive()
    }
}

impl Default for MemBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl MemBackend {
    /// An empty store at revision 1 keeping [`DEFAULT_HISTORY_LIMIT`] events.
    pub fn new() -> Self {
        Self::with_history_limit(DEFAULT_HISTORY_LIMIT)
    }

    /// An empty store keeping at most `limit` events of history (at least 1). Older
    /// events are dropped whole revisions at a time, which compacts the history.
    pub fn with_history_limit(limit: usize) -> Self {
        let (revision_tx, _) = watch::channel(1);
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    revision: 1,
                    kvs: BTreeMap::new(),
                    leases: HashMap::new(),
                    next_lease_id: 0x6564_6c00_0000_0000,
                    history: VecDeque::new(),
                    history_limit: limit.max(1),
                    compact_revision: 0,
                    min_ttl_secs: 1,
                    quota: None,
                    no_space: false,
                }),
                revision_tx,
                lease_granted: Arc::new(Notify::new()),
                expiry_task_started: AtomicBool::new(false),
                shutdown: CancellationToken::new(),
            }),
        }
    }

    /// Raises every granted TTL to at least `min` (rounded up to whole seconds), as
    /// etcd does: its minimum is 1.5 election timeouts, 2 s with the default
    /// settings. Without it, a store grants any TTL of one second or more as asked.
    /// Applies to leases granted from now on.
    pub fn with_min_ttl(self, min: Duration) -> Self {
        let secs = min.as_secs() + u64::from(min.subsec_nanos() > 0);
        self.inner.lock().min_ttl_secs = secs.clamp(1, MAX_LEASE_TTL_SECS);
        self
    }

    /// Gives the store a space quota of `bytes`, as etcd's `--quota-backend-bytes`:
    /// the store's size is the bytes of the keys and values of every version it keeps,
    /// live or in the history (compaction frees the older ones). A write that would pass the quota raises the
    /// space alarm; see [`Error::NoSpace`](crate::Error::NoSpace).
    pub fn with_quota(self, bytes: u64) -> Self {
        self.inner.lock().quota = Some(bytes);
        self
    }

    /// The current store revision.
    pub fn revision(&self) -> Revision {
        self.inner.locked_now().revision
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
