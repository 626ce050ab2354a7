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
mod tests {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

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
        /// Keep-alives fail as if etcd were unreachable (the lease itself is left to
        /// the inner backend).
        down: AtomicBool,
        /// Keep-alives are refused for good.
        denied: AtomicBool,
        /// Grants report this many seconds (0: the real TTL).
        grant_ttl_secs: AtomicU64,
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
            if self.script.down.load(Ordering::SeqCst) {
                return Err(Error::unavailable("scripted", "down"));
            }
            if self.script.denied.load(Ordering::SeqCst) {
                return Err(Error::PermissionDenied("scripted".into()));
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

    #[test]
    fn the_state_follows_lost_and_the_deadline() {
        let t0 = Instant::now();
        let deadline = t0 + TTL;
        assert_eq!(state_at(false, deadline, t0), LeaseState::Held);
        assert_eq!(
            state_at(false, deadline, deadline - Duration::from_nanos(1)),
            LeaseState::Held
        );
        assert_eq!(state_at(false, deadline, deadline), LeaseState::Uncertain);
        assert_eq!(
            state_at(false, deadline, t0 + 100 * TTL),
            LeaseState::Uncertain
        );
        assert_eq!(state_at(true, deadline, t0), LeaseState::Lost);
        assert_eq!(state_at(true, deadline, deadline), LeaseState::Lost);
    }

    /// A renewal is scheduled a third of the TTL from now, and at least a third
    /// before the deadline.
    #[test]
    fn next_renewal_leaves_a_period_before_the_deadline() {
        let c = Cadence { ttl: TTL };
        let now = Instant::now();
        assert_eq!(c.next_renewal(now, now + TTL), now + TTL / 3);
        // A late answer: the deadline is only 1.2 periods away.
        assert_eq!(
            c.next_renewal(now, now + TTL / 3 + TTL / 15),
            now + TTL / 15
        );
        // Deadline already behind: renew at once.
        assert!(c.next_renewal(now, now) <= now);
        // Tiny TTLs still wait the shortest period.
        let tiny = Cadence {
            ttl: Duration::from_millis(30),
        };
        assert_eq!(tiny.period(), MIN_PERIOD);
    }

    proptest::proptest! {
        /// Whatever the TTL and deadline: the next renewal is at most a period away,
        /// and a period before the deadline whenever that is still ahead; retries
        /// pause between 50 ms and 1 s, and never longer than half a period.
        #[test]
        fn cadence_bounds(ttl_ms in 0u64..10_000_000, deadline_ms in 0u64..20_000_000) {
            let c = Cadence { ttl: Duration::from_millis(ttl_ms) };
            let now = Instant::now();
            let deadline = now + Duration::from_millis(deadline_ms);
            let next = c.next_renewal(now, deadline);
            proptest::prop_assert!(next <= now + c.period());
            if deadline >= now + c.period() {
                proptest::prop_assert!(next + c.period() <= deadline);
                proptest::prop_assert!(next >= now);
            }
            let d = c.max_retry_delay();
            proptest::prop_assert!(d >= 2 * MIN_RETRY_DELAY && d <= MAX_RETRY_DELAY);
            proptest::prop_assert!(d <= c.period() / 2);
        }
    }

    /// A renewal that never answers is abandoned after a third of the TTL and tried
    /// again, instead of waiting until the deadline: the lease stays held.
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
        let state = lease.watch_state();
        for _ in 0..20 {
            tokio::time::sleep(TTL / 2).await;
            assert_eq!(
                lease.state(),
                LeaseState::Held,
                "lease unconfirmed by hung renewals"
            );
            assert!(inner.get("k").await.unwrap().is_some());
        }
        assert!(!state.has_changed().unwrap(), "the state never changed");
        assert!(script.keep_alives.load(Ordering::SeqCst) >= 20);
    }

    /// etcd unreachable for ten TTLs while the server keeps the lease (as etcd does
    /// through a quorum loss: its new leader extends every lease): the lease turns
    /// uncertain at its deadline by our clock, is never lost, and is held again at the
    /// first renewal after etcd answers.
    #[tokio::test(start_paused = true)]
    async fn an_outage_makes_the_lease_uncertain_not_lost_and_held_again_after() {
        let (b, script, inner) = scripted();
        let lease = Lease::grant(b.clone(), TTL, CancellationToken::new())
            .await
            .unwrap();
        inner
            .put("k", b"v".to_vec(), Some(lease.id()))
            .await
            .unwrap();
        tokio::time::sleep(TTL).await;
        let mut state = lease.watch_state();
        script.down.store(true, Ordering::SeqCst);
        // The server side stands in for etcd extending the lease meanwhile.
        let server = {
            let (inner, id) = (inner.clone(), lease.id());
            tokio::spawn(async move {
                loop {
                    let _ = inner.lease_keep_alive_once(id).await;
                    tokio::time::sleep(TTL / 3).await;
                }
            })
        };
        let deadline = lease.valid_until();
        state
            .wait_for(|s| *s == LeaseState::Uncertain)
            .await
            .unwrap();
        let noticed = Instant::now();
        assert!(
            noticed >= deadline && noticed <= deadline + Duration::from_millis(10),
            "uncertain at {:?} past the deadline",
            noticed.saturating_duration_since(deadline)
        );
        assert_eq!(lease.state(), LeaseState::Uncertain);
        assert!(!lease.is_held());
        tokio::time::sleep(10 * TTL).await;
        assert_eq!(lease.state(), LeaseState::Uncertain);
        assert!(!lease.is_lost(), "an outage alone never loses the lease");
        assert!(inner.get("k").await.unwrap().is_some());

        script.down.store(false, Ordering::SeqCst);
        let back = Instant::now();
        state.wait_for(|s| *s == LeaseState::Held).await.unwrap();
        assert!(
            back.elapsed() <= Cadence { ttl: TTL }.max_retry_delay(),
            "held again {:?} after etcd answered",
            back.elapsed()
        );
        assert_eq!(lease.state(), LeaseState::Held);
        assert!(lease.valid_until() > Instant::now() + TTL / 2);
        server.abort();
        // Renewed on its own from now on.
        tokio::time::sleep(5 * TTL).await;
        assert_eq!(lease.state(), LeaseState::Held);
        assert!(inner.get("k").await.unwrap().is_some());
    }

    /// etcd unreachable while the server lets the lease expire (this holder alone was
    /// cut off): uncertain, not lost, until etcd answers that the lease is gone.
    #[tokio::test(start_paused = true)]
    async fn a_lease_that_ended_during_an_outage_is_lost_when_etcd_answers() {
        let (b, script, inner) = scripted();
        let lease = Lease::grant(b.clone(), TTL, CancellationToken::new())
            .await
            .unwrap();
        inner
            .put("k", b"v".to_vec(), Some(lease.id()))
            .await
            .unwrap();
        let mut state = lease.watch_state();
        script.down.store(true, Ordering::SeqCst);
        tokio::time::sleep(3 * TTL).await;
        assert!(
            inner.get("k").await.unwrap().is_none(),
            "expired on the server"
        );
        assert_eq!(lease.state(), LeaseState::Uncertain);
        assert!(!lease.is_lost(), "nobody told the holder yet");
        script.down.store(false, Ordering::SeqCst);
        tokio::time::timeout(Duration::from_secs(2), lease.lost().cancelled())
            .await
            .expect("lost fires once etcd says the lease is gone");
        assert_eq!(lease.state(), LeaseState::Lost);
        state.wait_for(|s| *s == LeaseState::Lost).await.unwrap();
    }

    /// A renewal refused for good (permission denied) loses the lease at once.
    #[tokio::test(start_paused = true)]
    async fn a_refused_renewal_loses_the_lease() {
        let (b, script, _inner) = scripted();
        let lease = Lease::grant(b, TTL, CancellationToken::new())
            .await
            .unwrap();
        script.denied.store(true, Ordering::SeqCst);
        tokio::time::timeout(TTL / 2, lease.lost().cancelled())
            .await
            .expect("lost fires at the first refused renewal");
        assert_eq!(lease.state(), LeaseState::Lost);
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
        assert!(lease.is_held());

        let (b, script, _inner) = scripted();
        script.grant_ttl_secs.store(u64::MAX / 4, Ordering::SeqCst);
        let lease = Lease::grant(b, TTL, CancellationToken::new())
            .await
            .unwrap();
        assert_eq!(lease.ttl(), MAX_TRACKED_TTL);
        assert!(lease.is_held());
    }

    /// Whatever ends the keeper, a panic included, loses the lease.
    #[tokio::test(start_paused = true)]
    async fn keeper_panic_fires_lost() {
        let (b, script, _inner) = scripted();
        script.panic_keep_alive.store(true, Ordering::SeqCst);
        let lease = Lease::grant(b, TTL, CancellationToken::new())
            .await
            .unwrap();
        let mut state = lease.watch_state();
        // Well before the deadline: the keeper panics at its first renewal.
        tokio::time::timeout(TTL / 2, lease.lost().cancelled())
            .await
            .expect("lost fires when the keeper panics");
        assert_eq!(lease.state(), LeaseState::Lost);
        state.wait_for(|s| *s == LeaseState::Lost).await.unwrap();
    }

    /// `lost` fires before the revoke is sent, on `revoke` and on the cancel token;
    /// dropping the lease fires it too.
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
        let state = lease.watch_state();
        lease.revoke().await.unwrap();
        assert_eq!(*script.lost_at_revoke.lock().unwrap(), Some(true));
        assert!(inner.get("k").await.unwrap().is_none());
        assert_eq!(*state.borrow(), LeaseState::Lost);

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

        let (b, _script, _inner) = scripted();
        let lease = Lease::grant(b, TTL, CancellationToken::new())
            .await
            .unwrap();
        let (lost, state) = (lease.lost(), lease.watch_state());
        drop(lease);
        assert!(lost.is_cancelled());
        assert_eq!(*state.borrow(), LeaseState::Lost);
    }

    async fn wait_revoked(b: &MemBackend, key: &str) -> bool {
        edl_testkit::wait_until(TTL / 2, Duration::from_millis(10), || async {
            b.get(key).await.unwrap().is_none()
        })
        .await
    }
}
