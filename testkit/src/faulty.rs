//! [`FaultyBackend`]: fault injection by wrapping a [`Backend`].

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use edl_coord::{
    Backend, Error, KeyValue, LeaseGrant, LeaseId, Result, Revision, Txn, TxnResponse, WatchStream,
};
use futures::StreamExt;
use tokio::sync::watch;

use crate::lock;

/// Makes an injected error (a plain `fn`, so it can be called again and again).
pub type ErrorFn = fn() -> Error;

/// A [`Backend`] wrapper that injects faults: an outage (every request fails with
/// [`Error::Unavailable`]), watch disconnects, and errors of a chosen kind for
/// chosen requests (for instance a non-retryable [`Error::PermissionDenied`]). It
/// counts the requests it sees, so a test can check that a loop backs off.
#[derive(Debug)]
pub struct FaultyBackend {
    inner: Arc<dyn Backend>,
    down: AtomicBool,
    breaks: watch::Sender<u64>,
    failures: Arc<Mutex<Vec<Failure>>>,
    requests: AtomicU64,
    injected: AtomicU64,
}

/// An injected failure: which requests, the error, and how many more times (`None`:
/// until cleared).
#[derive(Debug)]
struct Failure {
    request: String,
    error: ErrorFn,
    left: Option<u64>,
}

/// The pseudo-request name under which [`FaultyBackend::fail`] makes open and new
/// watch streams fail (their next item is the error).
pub const WATCH_STREAM: &str = "watch_stream";

impl FaultyBackend {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Backend>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            down: AtomicBool::new(false),
            breaks: watch::channel(0).0,
            failures: Arc::new(Mutex::new(Vec::new())),
            requests: AtomicU64::new(0),
            injected: AtomicU64::new(0),
        })
    }

    /// Starts or ends an outage. Starting one also breaks every open watch.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
        if down {
            self.break_watches();
        }
    }

    /// Makes the requests named in `requests` (the [`Backend`] method names, such
    /// as `"range"` or `"watch_prefix"`, and [`WATCH_STREAM`] for the items of watch
    /// streams) fail with `error()` until [`clear_failures`](Self::clear_failures).
    /// Open watch streams are broken when [`WATCH_STREAM`] is among them.
    pub fn fail(&self, requests: &[&str], error: ErrorFn) {
        lock(&self.failures).extend(requests.iter().map(|r| Failure {
            request: (*r).to_owned(),
            error,
            left: None,
        }));
        if requests.contains(&WATCH_STREAM) {
            self.break_watches();
        }
    }

    /// Makes the next request named `request` fail with `error()`, once.
    pub fn fail_once(&self, request: &str, error: ErrorFn) {
        lock(&self.failures).push(Failure {
            request: request.to_owned(),
            error,
            left: Some(1),
        });
    }

    /// How many requests failed with an injected error (not counting outages).
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::SeqCst)
    }

    /// Ends the failures injected with [`fail`](Self::fail).
    pub fn clear_failures(&self) {
        lock(&self.failures).clear();
    }

    /// How many requests reached this wrapper (failed ones included; each watch
    /// stream item counts as none).
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }

    /// Ends every open watch stream with an `Unavailable` error (or the error
    /// injected for [`WATCH_STREAM`]).
    pub fn break_watches(&self) {
        self.breaks.send_modify(|n| *n += 1);
    }

    fn take_failure(failures: &Mutex<Vec<Failure>>, request: &str) -> Option<Error> {
        let mut failures = lock(failures);
        let i = failures.iter().position(|f| f.request == request)?;
        let error = (failures[i].error)();
        if let Some(left) = &mut failures[i].left {
            *left -= 1;
            if *left == 0 {
                failures.remove(i);
            }
        }
        Some(error)
    }

    fn check(&self, request: &str) -> Result<()> {
        self.requests.fetch_add(1, Ordering::SeqCst);
        if self.down.load(Ordering::SeqCst) {
            return Err(Error::unavailable("faulty-backend", "injected outage"));
        }
        match Self::take_failure(&self.failures, request) {
            Some(e) => {
                self.injected.fetch_add(1, Ordering::SeqCst);
                Err(e)
            }
            None => Ok(()),
        }
    }
}

#[async_trait]
impl Backend for FaultyBackend {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        self.check("get")?;
        self.inner.get(key).await
    }

    async fn range(&self, prefix: &str) -> Result<(Vec<KeyValue>, Revision)> {
        self.check("range")?;
        self.inner.range(prefix).await
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision> {
        self.check("put")?;
        self.inner.put(key, value, lease).await
    }

    async fn delete(&self, key: &str) -> Result<bool> {
        self.check("delete")?;
        self.inner.delete(key).await
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<u64> {
        self.check("delete_prefix")?;
        self.inner.delete_prefix(prefix).await
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResponse> {
        self.check("txn")?;
        self.inner.txn(txn).await
    }

    async fn compact(&self, revision: Revision) -> Result<()> {
        self.check("compact")?;
        self.inner.compact(revision).await
    }

    async fn free_space(&self) -> Result<edl_coord::FreedSpace> {
        self.check("free_space")?;
        self.inner.free_space().await
    }

    async fn lease_grant(&self, ttl: Duration) -> Result<LeaseGrant> {
        self.check("lease_grant")?;
        self.inner.lease_grant(ttl).await
    }

    async fn lease_keep_alive_once(&self, id: LeaseId) -> Result<Option<Duration>> {
        self.check("lease_keep_alive_once")?;
        self.inner.lease_keep_alive_once(id).await
    }

    async fn lease_revoke(&self, id: LeaseId) -> Result<()> {
        self.check("lease_revoke")?;
        self.inner.lease_revoke(id).await
    }

    async fn lease_ttl(&self, id: LeaseId) -> Result<Option<Duration>> {
        self.check("lease_ttl")?;
        self.inner.lease_ttl(id).await
    }

    async fn watch_prefix(
        &self,
        prefix: &str,
        start_revision: Option<Revision>,
    ) -> Result<WatchStream> {
        self.check("watch_prefix")?;
        let mut breaks = self.breaks.subscribe();
        breaks.borrow_and_update();
        let inner = self.inner.watch_prefix(prefix, start_revision).await?;
        let failures = self.failures.clone();
        let stream = futures::stream::unfold(
            (inner, breaks, failures, false),
            |(mut inner, mut breaks, failures, done)| async move {
                if done {
                    return None;
                }
                if let Some(e) = Self::take_failure(&failures, WATCH_STREAM) {
                    return Some((Err(e), (inner, breaks, failures, true)));
                }
                tokio::select! {
                    biased;
                    _ = breaks.changed() => {
                        let e = Self::take_failure(&failures, WATCH_STREAM).unwrap_or_else(|| {
                            Error::unavailable("faulty-backend", "injected watch disconnect")
                        });
                        Some((Err(e), (inner, breaks, failures, true)))
                    }
                    item = inner.next() => item.map(|i| (i, (inner, breaks, failures, false))),
                }
            },
        );
        Ok(Box::pin(stream))
    }
}
