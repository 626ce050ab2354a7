//! [`Lease`]: a granted lease kept alive by a background task, with a `lost` token
//! that fires as soon as the lease can no longer be relied on.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::retry::{Backoff, RetryPolicy};
use crate::types::LeaseId;

/// A lease with its keep-alive task.
///
/// The task renews the lease every `ttl / 3`. A failed renewal is retried with
/// backoff for as long as the lease may still be alive by our own clock (from the
/// moment the last successful renewal was *sent*, plus the TTL it returned), so a
/// blip of etcd does not lose the lease. The [`lost`](Lease::lost) token fires
///
/// - when the server says the lease is gone (expired or revoked by someone else),
/// - when no renewal succeeded before the lease's deadline by our clock (etcd
///   unreachable, paused or partitioned), which is never later than the server's
///   own expiry,
/// - when the `cancel` token given to [`grant`](Lease::grant) fires (the lease is
///   then revoked, best effort), on [`revoke`](Lease::revoke), and on drop.
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
    /// minimum) and starts keeping it alive. When `cancel` fires, the lease is
    /// revoked and `lost` fires.
    pub async fn grant(
        backend: Arc<dyn Backend>,
        ttl: Duration,
        cancel: CancellationToken,
    ) -> Result<Lease> {
        let sent = Instant::now();
        let grant = backend.lease_grant(ttl).await?;
        let lost = CancellationToken::new();
        let stop = CancellationToken::new();
        let deadline = Arc::new(Mutex::new(sent + grant.ttl));
        tracing::debug!(lease = %grant.id, ttl = ?grant.ttl, "lease granted");
        let keeper = tokio::spawn(
            Keeper {
                backend: backend.clone(),
                id: grant.id,
                ttl: grant.ttl,
                lost: lost.clone(),
                stop: stop.clone(),
                cancel,
                deadline: deadline.clone(),
            }
            .run(),
        );
        Ok(Lease {
            id: grant.id,
            ttl: grant.ttl,
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

    /// The granted TTL.
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

    /// Stops the keep-alive task and revokes the lease (deleting its keys), then
    /// fires `lost`. If the revocation fails, the lease still ends within its TTL.
    pub async fn revoke(mut self) -> Result<()> {
        self.stop.cancel();
        if let Some(keeper) = self.keeper.take() {
            let _ = keeper.await;
        }
        let result = self.backend.lease_revoke(self.id).await;
        self.lost.cancel();
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
        self.stop.cancel();
        self.lost.cancel();
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

    async fn run(self) {
        let interval = (self.ttl / 3).max(Duration::from_millis(100));
        let mut next = Instant::now() + interval;
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
                Renewal::Renewed => next = Instant::now() + interval,
                Renewal::Stopped => return,
                Renewal::Gone => {
                    tracing::warn!(lease = %self.id, "lease lost: expired or revoked on the server");
                    self.lost.cancel();
                    return;
                }
                Renewal::Expired => {
                    tracing::warn!(lease = %self.id, ttl = ?self.ttl, "lease lost: no renewal succeeded within its ttl");
                    self.lost.cancel();
                    return;
                }
            }
        }
    }

    /// Renews once, retrying failures until the lease's deadline by our clock.
    async fn renew(&self) -> Renewal {
        let retry_max = (self.ttl / 6).max(Duration::from_millis(50));
        let mut backoff =
            Backoff::new(RetryPolicy::forever().with_delays(Duration::from_millis(25), retry_max));
        loop {
            let deadline = self.deadline();
            let sent = Instant::now();
            if sent >= deadline {
                return Renewal::Expired;
            }
            let attempt =
                tokio::time::timeout_at(deadline, self.backend.lease_keep_alive_once(self.id));
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
                    self.set_deadline(sent + ttl);
                    return Renewal::Renewed;
                }
                Ok(Ok(None)) | Ok(Err(Error::LeaseLost)) => return Renewal::Gone,
                Ok(Err(e)) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    tracing::warn!(lease = %self.id, error = %e, ?left, "lease renewal failed; retrying");
                }
                Err(_) => return Renewal::Expired,
            }
            let delay = backoff.next_delay().unwrap_or(retry_max);
            let wake = (Instant::now() + delay).min(self.deadline());
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

    async fn revoke_on_cancel(&self) {
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
        self.lost.cancel();
    }
}
