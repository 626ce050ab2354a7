//! [`Lease`]: a granted etcd lease kept alive by a background task, and what its holder
//! can know about it, [`LeaseState`].
//!
//! # What the states promise
//!
//! - [`Held`](LeaseState::Held): the last renewal was confirmed, and the TTL it returned,
//!   counted from when that renewal was *sent*, has not run out by our clock. The
//!   server counts from when it received the renewal, so its expiry is never earlier
//!   (clock rates being equal): while the lease is held, nobody else holds what it
//!   holds. [`Lease::state`] tells it synchronously, by the clock, for a check right
//!   before an action.
//! - [`Uncertain`](LeaseState::Uncertain): no renewal was confirmed before that deadline
//!   (etcd unreachable, electing a leader, without quorum or stalled; or this process
//!   was paused). This is not loss: etcd ends leases only on its leader, and a new
//!   leader extends every lease by its TTL when it takes over, so a leader change or a
//!   quorum loss of any length leaves the lease alive while its holder keeps renewing.
//!   But the lease may also have expired (this holder was cut off from a working etcd,
//!   or paused), and what it held may be someone else's by now: writes fenced by etcd
//!   transactions stay safe, actions etcd does not fence must pause (a pserver refuses
//!   requests). The keeper keeps renewing; the first confirmed renewal makes the lease
//!   held again.
//! - [`Lost`](LeaseState::Lost), for good, and [`Lease::lost`] fires: when the server
//!   says the lease is gone (a renewal answered TTL 0 or "not found": it expired or was
//!   revoked), when it refuses the renewal for good (permission denied), when the
//!   `cancel` token given to [`Lease::grant`] fires or on [`Lease::revoke`] (both fire
//!   `lost` *before* revoking), on drop, and whenever the keeper task ends (a panic
//!   included). Never on our clock alone: a holder paused past its TTL learns that the
//!   lease ended from its first renewal after it resumes, and is uncertain until then.
//!
//! Whoever acts under a lease stops when `lost` fires, and pauses what etcd does not
//! fence while the lease is not held ([`Lease::state`], [`Lease::watch_state`]).
//!
//! # Renewals
//!
//! The keeper renews every `ttl / 3` (at least 100 ms), and at least `ttl / 3` before
//! the deadline. Each attempt is bounded by `ttl / 3`: one that gets no answer (a hung
//! etcd member) is abandoned and tried again at once (on etcd, through the next
//! endpoint); one that fails is tried again after a backoff of 25 ms doubling to
//! `ttl / 6` (at most 1 s), for as long as it takes. A blip or one hung member costs
//! nothing; an outage costs the uncertain state for as long as it lasts.
//!
//! A caveat of etcd itself: an etcd leader *process* that is paused past the TTL (a
//! SIGSTOP, a frozen VM; a single-member etcd that is paused) still leads when it
//! resumes, and ends the leases that expired by its clock meanwhile. Their holders are
//! then told so and see `Lost`.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::retry::{Backoff, RetryPolicy};
use crate::types::LeaseId;

/// The default TTL of edl's leases (masters, pservers, trainers). The TTL is how long a
/// dead process goes unnoticed: its registration or claim stays, its tasks wait, its
/// shard is not taken over, its leadership not handed on. It is also how long a working
/// etcd leader may go without hearing a renewal (a slow fsync, a long GC pause, a
/// congested network) before it ends the lease; an etcd *without* a leader (an
/// election, a quorum loss) ends no lease, whatever the TTL. 10 s notices failures
/// within seconds and rides out the stalls of an etcd on a shared disk; a shorter TTL
/// suits a dedicated, fast etcd (or tests), a longer one a slow or distant etcd.
pub const DEFAULT_TTL: Duration = Duration::from_secs(10);

/// Longest TTL the keeper takes a server's word for: a larger one (a corrupt or
/// hostile answer) is treated as this, which only makes the keeper more cautious.
pub const MAX_TRACKED_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// Shortest renewal period and attempt bound, whatever the TTL.
const MIN_PERIOD: Duration = Duration::from_millis(100);

/// Shortest and longest pause between failed renewals.
const MIN_RETRY_DELAY: Duration = Duration::from_millis(25);
const MAX_RETRY_DELAY: Duration = Duration::from_secs(1);

/// What the holder of a [`Lease`] can know about it (see the [module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseState {
    /// Confirmed by etcd, and not past its TTL by our clock: nobody else holds what it
    /// holds.
    Held,
    /// Not confirmed in time (etcd unreachable or this process paused): it may live on
    /// or may have ended. Pause what etcd does not fence; the keeper keeps renewing.
    Uncertain,
    /// Gone for good (expired or revoked on the server, cancelled, dropped).
    Lost,
}

/// The state at `now` of a lease whose deadline by our clock is `deadline`.
fn state_at(lost: bool, deadline: Instant, now: Instant) -> LeaseState {
    if lost {
        LeaseState::Lost
    } else if now < deadline {
        LeaseState::Held
    } else {
        LeaseState::Uncertain
    }
}

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

/// The keeper's timing for a lease of `ttl`: plain arithmetic on instants, so that it
/// is tested without a clock.
#[derive(Clone, Copy, Debug)]
struct Cadence {
    ttl: Duration,
}

impl Cadence {
    /// The renewal period, and the bound on one renewal attempt.
    fn period(self) -> Duration {
        (self.ttl / 3).max(MIN_PERIOD)
    }

    /// The longest pause between failed renewals.
    fn max_retry_delay(self) -> Duration {
        (self.ttl / 6).clamp(2 * MIN_RETRY_DELAY, MAX_RETRY_DELAY)
    }

    /// When to renew next: a period after `now`, but at least a period before
    /// `deadline` (a late answer must not push the next try past the deadline).
    fn next_renewal(self, now: Instant, deadline: Instant) -> Instant {
        let period = self.period();
        let before_deadline = deadline.checked_sub(period).unwrap_or(now);
        add(now, period).min(before_deadline)
    }
}

/// What the lease and its keeper share.
#[derive(Debug)]
struct Shared {
    /// Until when the lease is alive at least, by our clock.
    deadline: Mutex<Instant>,
    /// The state as the keeper last published it.
    state: watch::Sender<LeaseState>,
    lost: CancellationToken,
}

impl Shared {
    fn new(deadline: Instant) -> Self {
        Shared {
            deadline: Mutex::new(deadline),
            state: watch::channel(LeaseState::Held).0,
            lost: CancellationToken::new(),
        }
    }

    fn deadline(&self) -> Instant {
        *self.deadline.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn state_now(&self) -> LeaseState {
        state_at(self.lost.is_cancelled(), self.deadline(), Instant::now())
    }

    fn published(&self) -> LeaseState {
        *self.state.borrow()
    }

    /// A renewal sent at `sent` was confirmed with `ttl`: held until `sent + ttl`.
    /// Returns the old deadline if the lease was uncertain.
    fn confirm(&self, sent: Instant, ttl: Duration) -> Option<Instant> {
        let old = std::mem::replace(
            &mut *self.deadline.lock().unwrap_or_else(PoisonError::into_inner),
            add(sent, clamp_ttl(ttl)),
        );
        let mut was_uncertain = false;
        self.state.send_if_modified(|s| {
            was_uncertain = *s == LeaseState::Uncertain;
            if was_uncertain {
                *s = LeaseState::Held;
            }
            was_uncertain
        });
        was_uncertain.then_some(old)
    }

    /// The deadline passed unconfirmed. Returns whether the lease was held.
    fn suspect(&self) -> bool {
        self.state.send_if_modified(|s| {
            let held = *s == LeaseState::Held;
            if held {
                *s = LeaseState::Uncertain;
            }
            held
        })
    }

    /// Lost for good: fires `lost`, then publishes it.
    fn lose(&self) {
        self.lost.cancel();
        self.state.send_if_modified(|s| {
            let changed = *s != LeaseState::Lost;
            *s = LeaseState::Lost;
            changed
        });
    }
}

/// Marks the lease lost when the keeper ends, however it ends.
struct LoseOnDrop(Arc<Shared>);

impl Drop for LoseOnDrop {
    fn drop(&mut self) {
        self.0.lose();
    }
}

/// A lease with its keep-alive task (see the [module docs](self) for what its states
/// promise and how it is renewed).
#[derive(Debug)]
pub struct Lease {
    id: LeaseId,
    ttl: Duration,
    backend: Arc<dyn Backend>,
    shared: Arc<Shared>,
    stop: CancellationToken,
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
        let shared = Arc::new(Shared::new(add(sent, ttl)));
        let stop = CancellationToken::new();
        tracing::debug!(lease = %grant.id, ?ttl, "lease granted");
        let keeper = tokio::spawn(
            Keeper {
                backend: backend.clone(),
                id: grant.id,
                ttl,
                cadence: Cadence { ttl },
                shared: shared.clone(),
                stop: stop.clone(),
                cancel,
            }
            .run()
            .in_current_span(),
        );
        Ok(Lease {
            id: grant.id,
            ttl,
            backend,
            shared,
            stop,
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

    /// A token that fires when the lease is lost for good (see the [module
    /// docs](self)); never on our clock alone.
    pub fn lost(&self) -> CancellationToken {
        self.shared.lost.clone()
    }

    /// Whether `lost` fired.
    pub fn is_lost(&self) -> bool {
        self.shared.lost.is_cancelled()
    }

    /// The state right now, by `lost` and by our clock: the check to make right before
    /// an action that etcd does not fence. It turns uncertain at the deadline even
    /// before the keeper notices (a process that was paused sees it at once).
    pub fn state(&self) -> LeaseState {
        self.shared.state_now()
    }

    /// Whether the lease is held right now (`state() == Held`).
    pub fn is_held(&self) -> bool {
        self.state() == LeaseState::Held
    }

    /// Follows the state as the keeper publishes it: to wait for a change (for
    /// instance until the lease is held again). It may lag [`state`](Self::state) by
    /// a scheduling delay.
    pub fn watch_state(&self) -> watch::Receiver<LeaseState> {
        self.shared.state.subscribe()
    }

    /// Until when the lease is alive at least, by our clock (the deadline of
    /// [`LeaseState::Held`]).
    pub fn valid_until(&self) -> Instant {
        self.shared.deadline()
    }

    /// Fires `lost` first (so whatever acts under the lease stops before anyone
    /// else can take over), then stops the keep-alive task and revokes the lease
    /// (deleting its keys). If the revocation fails, the lease still ends within its
    /// TTL.
    pub async fn revoke(mut self) -> Result<()> {
        self.shared.lose();
        self.stop.cancel();
        if let Some(keeper) = self.keeper.take() {
            let _ = keeper.await;
        }
        self.revoke_request().await
    }

    /// [`Lease::revoke`] of a lease that others still hold (through an `Arc`): fires
    /// `lost` (they see it ended), stops the keep-alive and revokes the lease, without
    /// waiting for the keep-alive task to finish.
    pub async fn revoke_shared(&self) -> Result<()> {
        self.shared.lose();
        self.stop.cancel();
        self.revoke_request().await
    }

    async fn revoke_request(&self) -> Result<()> {
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
        self.shared.lose();
        self.stop.cancel();
    }
}

struct Keeper {
    backend: Arc<dyn Backend>,
    id: LeaseId,
    ttl: Duration,
    cadence: Cadence,
    shared: Arc<Shared>,
    stop: CancellationToken,
    cancel: CancellationToken,
}

enum Renewal {
    Renewed,
    /// The server says the lease is gone, or refused the renewal for good.
    Gone,
    Stopped,
}

impl Keeper {
    async fn run(self) {
        // Every way out of this task marks the lease lost, a panic included: whoever
        // acts under the lease must not go on without its keeper.
        let _lose = LoseOnDrop(self.shared.clone());
        loop {
            let next = self
                .cadence
                .next_renewal(Instant::now(), self.shared.deadline());
            if self.guarded(tokio::time::sleep_until(next)).await.is_none() {
                return;
            }
            match self.renew().await {
                Renewal::Renewed => {}
                Renewal::Gone | Renewal::Stopped => return,
            }
        }
    }

    /// Runs `fut` to completion, marking the lease uncertain if its deadline passes
    /// meanwhile. `None` when the keeper is stopped or cancelled first (on cancel the
    /// lease is revoked).
    async fn guarded<F: Future>(&self, fut: F) -> Option<F::Output> {
        tokio::pin!(fut);
        loop {
            let deadline = self.shared.deadline();
            let held = self.shared.published() == LeaseState::Held;
            tokio::select! {
                biased;
                _ = self.stop.cancelled() => return None,
                _ = self.cancel.cancelled() => {
                    self.revoke_on_cancel().await;
                    return None;
                }
                out = &mut fut => return Some(out),
                _ = tokio::time::sleep_until(deadline), if held => {
                    if self.shared.suspect() {
                        tracing::warn!(
                            lease = %self.id,
                            ttl = ?self.ttl,
                            "lease not confirmed within its ttl (etcd unreachable?); uncertain until etcd answers, still renewing"
                        );
                    }
                }
            }
        }
    }

    /// Renews once, trying again after failures for as long as it takes (each attempt
    /// bounded by the renewal period), until it is confirmed, the server says the
    /// lease is gone, or the keeper stops.
    async fn renew(&self) -> Renewal {
        let max_delay = self.cadence.max_retry_delay();
        let mut backoff =
            Backoff::new(RetryPolicy::forever().with_delays(MIN_RETRY_DELAY, max_delay));
        let mut failing = false;
        loop {
            let sent = Instant::now();
            let bound = self.cadence.period();
            let attempt = tokio::time::timeout(bound, self.backend.lease_keep_alive_once(self.id));
            let Some(result) = self.guarded(attempt).await else {
                return Renewal::Stopped;
            };
            let (why, timed_out) = match result {
                Ok(Ok(Some(ttl))) => {
                    if let Some(since) = self.shared.confirm(sent, ttl) {
                        tracing::info!(
                            lease = %self.id,
                            unconfirmed_for = ?since.elapsed(),
                            "lease confirmed again"
                        );
                    }
                    return Renewal::Renewed;
                }
                Ok(Ok(None)) | Ok(Err(Error::LeaseLost)) => {
                    tracing::warn!(lease = %self.id, "lease lost: expired or revoked on the server");
                    return Renewal::Gone;
                }
                Ok(Err(e @ Error::PermissionDenied(_))) => {
                    tracing::error!(lease = %self.id, error = %e, "lease lost: etcd refuses to renew it");
                    return Renewal::Gone;
                }
                Ok(Err(e)) => (e.to_string(), false),
                Err(_) => (format!("no answer within {bound:?}"), true),
            };
            let left = self
                .shared
                .deadline()
                .saturating_duration_since(Instant::now());
            if failing {
                tracing::debug!(lease = %self.id, error = %why, ?left, "lease renewal failed; retrying");
            } else {
                tracing::warn!(lease = %self.id, error = %why, ?left, "lease renewal failed; retrying");
                failing = true;
            }
            if timed_out {
                // The attempt already waited: try again at once.
                continue;
            }
            let delay = backoff.next_delay().unwrap_or(max_delay);
            if self.guarded(tokio::time::sleep(delay)).await.is_none() {
                return Renewal::Stopped;
            }
        }
    }

    /// Marks the lease lost, then revokes it (best effort, bounded by the time left
    /// of its TTL and at least a renewal period).
    async fn revoke_on_cancel(&self) {
        self.shared.lose();
        let bound = self
            .shared
            .deadline()
            .saturating_duration_since(Instant::now())
            .max(self.cadence.period());
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
mod tests;
