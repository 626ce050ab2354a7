//! [`Lease`]: a granted lease kept alive by a background task, with a `lost` token
//! that fires as soon as the lease can no longer be relied on.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::retry::{Backoff, RetryPolicy};
use crate::types::LeaseId;

/// Longest TTL the keeper takes a server's word for: a larger one (a corrupt or
/// hostile answer) is treated as this, which only makes the keeper more cautious.
pub const MAX_TRACKED_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// Shortest renewal period and attempt bound, whatever the TTL.
const MIN_PERIOD: Duration = Duration::from_millis(100);

/// A server-provided TTL, bounded to [`MAX_TRACKED_TTL`].
fn clamp_ttl(ttl: Duration) -> Duration {
    ttl.min(MAX_TRACKED_TTL)
}

/// `at + d`, saturating instead of panicking on overflow.
fn add(at: Instant, d: Duration) -> Instant {
    at.checked_add(d)
        .or_else(|| at.checked_add(MAX_TRACKED_TTL))
        .unwrap_or(at)
}

/// A lease with its keep-alive task.
///
/// The task renews the lease every `ttl / 3`, and never later than `ttl / 3`
/// before the lease's deadline by our clock (from the moment the last successful
/// renewal was *sent*, plus the TTL it returned). Each renewal attempt is bounded by
/// `ttl / 3`: an attempt that gets no answer (a hung etcd member) is abandoned and
/// retried (on etcd, through the next endpoint) while the lease may still be alive
/// by our clock, so neither a blip of etcd nor one hung member loses the lease.
/// The [`lost`](Lease::lost) token fires
///
/// - when the server says the lease is gone (expired or revoked by someone else),
/// - when no renewal succeeded before the lease's deadline by our clock (etcd
///   unreachable, paused or partitioned), which is never later than the server's
///   own expiry,
/// - when the `cancel` token given to [`grant`](Lease::grant) fires (the lease is
///   then revoked, best effort, *after* `lost` fired), on [`revoke`](Lease::revoke)
///   (likewise first), on drop,
/// - and whenever the keep-alive task ends for any other reason (even a panic).
///
/// Whoever acts under the lease (a leader, an index owner) must stop at once when
/// `lost` fires.
#[derive(Debug)]
pub struct Lease {
    id: LeaseId,
    ttl: Duration,
    backend: Arc<dyn Backend>,
    lost: CancellationToken,
    stop: CancellationToken,
    deadline: Arc<Mutex<Instant>>,
    keeper: Option<JoinHandle<()>>,
}

impl Lease {
    /// Grants a lease of `ttl` (whole seconds, rounded up; etcd may raise it to its
    /// minimum) and starts keeping it alive. When `cancel` fires, `lost` fires and
    /// the lease is revoked.
    pub async fn grant(
        backend: Arc<dyn Backend>,
        ttl: Duration,
        cancel: CancellationToken,
    ) -> Result<Lease> {
        let sent = Instant::now();
        let grant = backend.lease_grant(ttl).await?;
        let ttl = clamp_ttl(grant.ttl);
        let lost = CancellationToken::new();
        let stop = CancellationToken::new();
        let deadline = Arc::new(Mutex::new(add(sent, ttl)));
        tracing::debug!(lease = %grant.id, ?ttl, "lease granted");
        let keeper = tokio::spawn(
            Keeper {
                backend: backend.clone(),
                id: grant.id,
                ttl,
                lost: lost.clone(),
                stop: stop.clone(),
                cancel,
                deadline: deadline.clone(),
            }
            .run()
            .in_current_span(),
        );
        Ok(Lease {
            id: grant.id,
            ttl,
            backend,
            lost,
            stop,
            deadline,
            keeper: Some(keeper),
        })
    }

    /// The lease id.
    pub fn id(&self) -> LeaseId {
        self.id
    }

    /// The granted TTL (at most [`MAX_TRACKED_TTL`]).
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The backend the lease lives in.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// A token that fires when the lease is lost (see the type's docs).
    pub fn lost(&self) -> CancellationToken {
        self.lost.clone()
    }

    /// Whether `lost` fired.
    pub fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
    }

    /// Until when the lease is alive at least, by our clock. A synchronous check for
    /// hot paths: `Instant::now() < lease.valid_until()` and `!lease.is_lost()`.
    pub fn valid_until(&self) -> Instant {
        *self.deadline.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the lease is still alive, by `lost` and by our clock.
    pub fn is_valid(&self) -> bool {
        !self.is_lost() && Instant::now() < self.valid_until()
    }

    /// Fires `lost` first (so whatever acts under the lease stops before anyone
    /// else can take over), then stops the keep-alive task and revokes the lease
    /// (deleting its keys). If the revocation fails, the lease still ends within its
    /// TTL.
    pub async fn revoke(mut self) -> Result<()> {
        self.lost.cancel();
        self.stop.cancel();
        if let Some(keeper) = self.keeper.take() {
            let _ = keeper.await;
        }
        let result = self.backend.lease_revoke(self.id).await;
        match &result {
            Ok(()) => tracing::debug!(lease = %self.id, "lease revoked"),
            Err(e) => {
                tracing::warn!(lease = %self.id, error = %e, "lease revoke failed; it ends within its ttl")
            }
        }
        result
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.lost.cancel();
        self.stop.cancel();
    }
}

struct Keeper {
    backend: Arc<dyn Backend>,
    id: LeaseId,
    ttl: Duration,
    lost: CancellationToken,
    stop: CancellationToken,
    cancel: CancellationToken,
    deadline: Arc<Mutex<Instant>>,
}

enum Renewal {
    Renewed,
    Gone,
    Expired,
    Stopped,
}

impl Keeper {
    fn deadline(&self) -> Instant {
        *self.deadline.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn set_deadline(&self, at: Instant) {
        *self.deadline.lock().unwrap_or_else(PoisonError::into_inner) = at;
    }

    /// The renewal period, and the bound on one renewal attempt.
    fn period(&self) -> Duration {
        (self.ttl / 3).max(MIN_PERIOD)
    }

    /// When to renew next: a period from now, but at least a period before the
    /// deadline (a late answer must not push the next try past the deadline).
    fn next_renewal(&self) -> Instant {
        let now = Instant::now();
        let period = self.period();
        let before_deadline = self.deadline().checked_sub(period).unwrap_or(now);
        add(now, period).min(before_deadline)
    }

    async fn run(self) {
        // Every way out of this task fires `lost`, a panic included: whoever acts
        // under the lease must not go on without its keeper.
        let _fire_lost = self.lost.clone().drop_guard();
        let mut next = self.next_renewal();
        loop {
            tokio::select! {
                biased;
                _ = self.stop.cancelled() => return,
                _ = self.cancel.cancelled() => {
                    self.revoke_on_cancel().await;
                    return;
                }
                _ = tokio::time::sleep_until(next.min(self.deadline())) => {}
            }
            match self.renew().await {
                Renewal::Renewed => next = self.next_renewal(),
                Renewal::Stopped => return,
                Renewal::Gone => {
                    tracing::warn!(lease = %self.id, "lease lost: expired or revoked on the server");
                    return;
                }
                Renewal::Expired => {
                    tracing::warn!(lease = %self.id, ttl = ?self.ttl, "lease lost: no renewal succeeded within its ttl");
                    return;
                }
            }
        }
    }

    /// Renews once, retrying failures until the lease's deadline by our clock. Each
    /// attempt is bounded by the renewal period.
    async fn renew(&self) -> Renewal {
        let period = self.period();
        let retry_max = (self.ttl / 6).max(Duration::from_millis(50));
        let mut backoff =
            Backoff::new(RetryPolicy::forever().with_delays(Duration::from_millis(25), retry_max));
        loop {
            let deadline = self.deadline();
            let sent = Instant::now();
            if sent >= deadline {
                return Renewal::Expired;
            }
            let bound = period.min(deadline - sent);
            let attempt = tokio::time::timeout(bound, self.backend.lease_keep_alive_once(self.id));
            let result = tokio::select! {
                biased;
                _ = self.stop.cancelled() => return Renewal::Stopped,
                _ = self.cancel.cancelled() => {
                    self.revoke_on_cancel().await;
                    return Renewal::Stopped;
                }
                r = attempt => r,
            };
            match result {
                Ok(Ok(Some(ttl))) => {
                    self.set_deadline(add(sent, clamp_ttl(ttl)));
                    return Renewal::Renewed;
                }
                Ok(Ok(None)) | Ok(Err(Error::LeaseLost)) => return Renewal::Gone,
                Ok(Err(e)) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    tracing::warn!(lease = %self.id, error = %e, ?left, "lease renewal failed; retrying");
                }
                Err(_) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    tracing::warn!(lease = %self.id, ?bound, ?left, "lease renewal got no answer; retrying");
                    // The attempt already waited: try again at once.
                    continue;
                }
            }
            let delay = backoff.next_delay().unwrap_or(retry_max);
            let wake = add(Instant::now(), delay).min(self.deadline());
            tokio::select! {
                biased;
                _ = self.stop.cancelled() => return Renewal::Stopped,
                _ = self.cancel.cancelled() => {
                    self.revoke_on_cancel().await;
                    return Renewal::Stopped;
                }
                _ = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    /// Fires `lost`, then revokes the lease (best effort, bounded by its deadline).
    async fn revoke_on_cancel(&self) {
        self.lost.cancel();
        let bound = self
            .deadline()
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(100));
        match tokio::time::timeout(bound, self.backend.lease_revoke(self.id)).await {
            Ok(Ok(())) => tracing::debug!(lease = %self.id, "lease revoked on shutdown"),
            Ok(Err(e)) => {
                tracing::warn!(lease = %self.id, error = %e, "lease revoke on shutdown failed")
            }
            Err(_) => tracing::warn!(lease = %self.id, "lease revoke on shutdown timed out"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    use async_trait::async_trait;

    use super::*;
    use crate::backend::WatchStream;
    use crate::mem::MemBackend;
    use crate::types::{KeyValue, LeaseGrant, Revision, Txn, TxnResponse};

    /// What the scripted backend does to lease requests.
    #[derive(Debug, Default)]
    struct Script {
        /// Every other keep-alive never answers (a hung etcd member the client does
        /// not fail over from by itself).
        hang_every_other: AtomicBool,
        /// Grants report this many seconds (0: the real TTL).
        grant_ttl_secs: std::sync::atomic::AtomicU64,
        /// Keep-alives report `Duration::MAX`.
        huge_keep_alive_ttl: AtomicBool,
        /// Keep-alives panic.
        panic_keep_alive: AtomicBool,
        keep_alives: AtomicU32,
        /// The lease's `lost` token, and whether it had fired when the revoke came.
        lost: OnceLock<CancellationToken>,
        lost_at_revoke: Mutex<Option<bool>>,
    }

    #[derive(Debug)]
    struct Scripted {
        inner: MemBackend,
        script: Arc<Script>,
    }

    fn scripted() -> (Arc<Scripted>, Arc<Script>, MemBackend) {
        let inner = MemBackend::new();
        let script = Arc::new(Script::default());
        let b = Arc::new(Scripted {
            inner: inner.clone(),
            script: script.clone(),
        });
        (b, script, inner)
    }

    #[async_trait]
    impl Backend for Scripted {
        async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
            self.inner.get(key).await
        }
        async fn range(&self, prefix: &str) -> Result<(Vec<KeyValue>, Revision)> {
            self.inner.range(prefix).await
        }
        async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision> {
            self.inner.put(key, value, lease).await
        }
        async fn delete(&self, key: &str) -> Result<bool> {
            self.inner.delete(key).await
        }
        async fn delete_prefix(&self, prefix: &str) -> Result<u64> {
            self.inner.delete_prefix(prefix).await
        }
        async fn txn(&self, txn: Txn) -> Result<TxnResponse> {
            self.inner.txn(txn).await
        }
        async fn compact(&self, revision: Revision) -> Result<()> {
            self.inner.compact(revision).await
        }
        async fn lease_grant(&self, ttl: Duration) -> Result<LeaseGrant> {
            let mut g = self.inner.lease_grant(ttl).await?;
            let secs = self.script.grant_ttl_secs.load(Ordering::SeqCst);
            if secs > 0 {
                g.ttl = Duration::from_secs(secs);
            }
            Ok(g)
        }
        async fn lease_keep_alive_once(&self, id: LeaseId) -> Result<Option<Duration>> {
            let n = self.script.keep_alives.fetch_add(1, Ordering::SeqCst);
            if self.script.panic_keep_alive.load(Ordering::SeqCst) {
                panic!("scripted keep-alive panic");
            }
            if self.script.hang_every_other.load(Ordering::SeqCst) && n.is_multiple_of(2) {
                std::future::pending::<()>().await;
            }
            let ttl = self.inner.lease_keep_alive_once(id).await?;
            if self.script.huge_keep_alive_ttl.load(Ordering::SeqCst) {
                return Ok(ttl.map(|_| Duration::MAX));
            }
            Ok(ttl)
        }
        async fn lease_revoke(&self, id: LeaseId) -> Result<()> {
            if let Some(lost) = self.script.lost.get() {
                *self
                    .script
                    .lost_at_revoke
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = Some(lost.is_cancelled());
            }
            self.inner.lease_revoke(id).await
        }
        async fn lease_ttl(&self, id: LeaseId) -> Result<Option<Duration>> {
            self.inner.lease_ttl(id).await
        }
        async fn watch_prefix(
            &self,
            prefix: &str,
            start_revision: Option<Revision>,
        ) -> Result<WatchStream> {
            self.inner.watch_prefix(prefix, start_revision).await
        }
    }

    const TTL: Duration = Duration::from_secs(3);

    /// A renewal that never answers is abandoned after a third of the TTL and tried
    /// again, instead of waiting until the deadline and losing the lease.
    #[tokio::test(start_paused = true)]
    async fn unanswered_renewals_are_retried_within_the_ttl() {
        let (b, script, inner) = scripted();
        script.hang_every_other.store(true, Ordering::SeqCst);
        let lease = Lease::grant(b.clone(), TTL, CancellationToken::new())
            .await
            .unwrap();
        inner
            .put("k", b"v".to_vec(), Some(lease.id()))
            .await
            .unwrap();
        for _ in 0..20 {
            tokio::time::sleep(TTL / 2).await;
            assert!(!lease.is_lost(), "lease lost to unanswered renewals");
            assert!(inner.get("k").await.unwrap().is_some());
        }
        assert!(script.keep_alives.load(Ordering::SeqCst) >= 20);
    }

    /// A renewal is scheduled a third of the TTL from now, and at least a third
    /// before the deadline.
    #[tokio::test(start_paused = true)]
    async fn next_renewal_leaves_a_period_before_the_deadline() {
        let (b, _script, _inner) = scripted();
        let lease = Lease::grant(b.clone(), TTL, CancellationToken::new())
            .await
            .unwrap();
        let keeper = Keeper {
            backend: b,
            id: lease.id(),
            ttl: TTL,
            lost: CancellationToken::new(),
            stop: CancellationToken::new(),
            cancel: CancellationToken::new(),
            deadline: Arc::new(Mutex::new(Instant::now() + TTL)),
        };
        let now = Instant::now();
        assert_eq!(keeper.next_renewal(), now + TTL / 3);
        // A late answer: the deadline is only 1.2 periods away.
        keeper.set_deadline(now + TTL / 3 + TTL / 15);
        assert_eq!(keeper.next_renewal(), now + TTL / 15);
        // Deadline already behind: renew at once.
        keeper.set_deadline(now);
        assert!(keeper.next_renewal() <= now);
    }

    /// A server TTL too large for the clock does not panic the keeper (or the
    /// grant).
    #[tokio::test(start_paused = true)]
    async fn huge_server_ttls_are_clamped() {
        let (b, script, _inner) = scripted();
        script.huge_keep_alive_ttl.store(true, Ordering::SeqCst);
        let lease = Lease::grant(b.clone(), TTL, CancellationToken::new())
            .await
            .unwrap();
        tokio::time::sleep(TTL * 2).await;
        assert!(script.keep_alives.load(Ordering::SeqCst) >= 2);
        assert!(!lease.is_lost(), "the keeper died");
        assert!(lease.is_valid());

        let (b, script, _inner) = scripted();
        script.grant_ttl_secs.store(u64::MAX / 4, Ordering::SeqCst);
        let lease = Lease::grant(b, TTL, CancellationToken::new())
            .await
            .unwrap();
        assert_eq!(lease.ttl(), MAX_TRACKED_TTL);
        assert!(lease.is_valid());
    }

    /// Whatever ends the keeper, a panic included, fires `lost`.
    #[tokio::test(start_paused = true)]
    async fn keeper_panic_fires_lost() {
        let (b, script, _inner) = scripted();
        script.panic_keep_alive.store(true, Ordering::SeqCst);
        let lease = Lease::grant(b, TTL, CancellationToken::new())
            .await
            .unwrap();
        // Well before the deadline: the keeper panics at its first renewal.
        tokio::time::timeout(TTL / 2, lease.lost().cancelled())
            .await
            .expect("lost fires when the keeper panics");
        assert!(!lease.is_valid());
    }

    /// `lost` fires before the revoke is sent, on `revoke` and on the cancel token.
    #[tokio::test(start_paused = true)]
    async fn revoke_fires_lost_before_revoking() {
        let (b, script, inner) = scripted();
        let lease = Lease::grant(b.clone(), TTL, CancellationToken::new())
            .await
            .unwrap();
        script.lost.set(lease.lost()).unwrap();
        inner
            .put("k", b"v".to_vec(), Some(lease.id()))
            .await
            .unwrap();
        lease.revoke().await.unwrap();
        assert_eq!(*script.lost_at_revoke.lock().unwrap(), Some(true));
        assert!(inner.get("k").await.unwrap().is_none());

        let (b, script, inner) = scripted();
        let cancel = CancellationToken::new();
        let lease = Lease::grant(b.clone(), TTL, cancel.clone()).await.unwrap();
        script.lost.set(lease.lost()).unwrap();
        inner
            .put("k", b"v".to_vec(), Some(lease.id()))
            .await
            .unwrap();
        cancel.cancel();
        assert!(wait_revoked(&inner, "k").await, "cancel revoked the lease");
        assert_eq!(*script.lost_at_revoke.lock().unwrap(), Some(true));
        assert!(lease.is_lost());
    }

    async fn wait_revoked(b: &MemBackend, key: &str) -> bool {
        edl_testkit::wait_until(TTL / 2, Duration::from_millis(10), || async {
            b.get(key).await.unwrap().is_none()
        })
        .await
    }
}
