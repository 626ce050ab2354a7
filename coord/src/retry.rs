//! Retrying with exponential backoff and jitter: [`retry`] for coordination calls,
//! [`retry_startup`] for the etcd steps of a starting process, [`call_until`], the one
//! retry/failover loop of the master and pserver clients.

use std::future::Future;
use std::time::Duration;

use rand::Rng;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};

/// How to retry: exponential backoff from `initial` to `max`, each delay drawn
/// uniformly from its upper half (jitter), until `max_elapsed` or `max_attempts`.
#[derive(Clone, Debug, PartialEq)]
pub struct RetryPolicy {
    /// First delay.
    pub initial: Duration,
    /// Largest delay.
    pub max: Duration,
    /// Growth factor between delays (at least 1).
    pub multiplier: f64,
    /// Give up once this much time has passed since the first attempt.
    pub max_elapsed: Option<Duration>,
    /// Give up after this many attempts (the first one included).
    pub max_attempts: Option<u32>,
}

impl Default for RetryPolicy {
    /// 50 ms doubling to 2 s, for at most 30 s.
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(50),
            max: Duration::from_secs(2),
            multiplier: 2.0,
            max_elapsed: Some(Duration::from_secs(30)),
            max_attempts: None,
        }
    }
}

impl RetryPolicy {
    /// Retries forever (until cancelled) with the default delays.
    pub fn forever() -> Self {
        Self {
            max_elapsed: None,
            max_attempts: None,
            ..Self::default()
        }
    }

    /// Sets the delays.
    pub fn with_delays(mut self, initial: Duration, max: Duration) -> Self {
        self.initial = initial;
        self.max = max;
        self
    }

    /// Sets the time limit.
    pub fn with_max_elapsed(mut self, max_elapsed: Option<Duration>) -> Self {
        self.max_elapsed = max_elapsed;
        self
    }

    /// Sets the attempt limit.
    pub fn with_max_attempts(mut self, max_attempts: Option<u32>) -> Self {
        self.max_attempts = max_attempts;
        self
    }
}

/// A sequence of backoff delays following a [`RetryPolicy`].
#[derive(Debug)]
pub struct Backoff {
    policy: RetryPolicy,
    current: Duration,
    attempts: u32,
    started: Instant,
}

impl Backoff {
    /// Starts a sequence now.
    pub fn new(policy: RetryPolicy) -> Self {
        Self {
            current: policy.initial,
            policy,
            attempts: 1,
            started: Instant::now(),
        }
    }

    /// The delay before the next attempt, or `None` when the policy's limits are
    /// reached.
    pub fn next_delay(&mut self) -> Option<Duration> {
        if self.policy.max_attempts.is_some_and(|m| self.attempts >= m) {
            return None;
        }
        let base = self.current.min(self.policy.max);
        let half = base / 2;
        let jitter = if half.is_zero() {
            Duration::ZERO
        } else {
            rand::rng().random_range(Duration::ZERO..=half)
        };
        let delay = half + jitter;
        if let Some(max_elapsed) = self.policy.max_elapsed
            && self.started.elapsed() + delay > max_elapsed
        {
            return None;
        }
        self.attempts += 1;
        self.current = base
            .mul_f64(self.policy.multiplier.max(1.0))
            .min(self.policy.max);
        Some(delay)
    }

    /// Sleeps for the next delay. Returns `false` when the limits are reached or
    /// `cancel` fires first.
    pub async fn wait(&mut self, cancel: &CancellationToken) -> bool {
        let Some(delay) = self.next_delay() else {
            return false;
        };
        tokio::select! {
            _ = cancel.cancelled() => false,
            _ = tokio::time::sleep(delay) => true,
        }
    }
}

/// Runs `op` until it succeeds, fails with an error that is not
/// [retryable](Error::is_retryable), or the policy gives up (then the last error is
/// returned).
pub async fn retry<T, F, Fut>(policy: &RetryPolicy, op: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    retry_cancellable(policy, &CancellationToken::new(), op).await
}

/// Like [`retry`], stopping with [`Error::Cancelled`] when `cancel` fires.
pub async fn retry_cancellable<T, F, Fut>(
    policy: &RetryPolicy,
    cancel: &CancellationToken,
    mut op: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let mut backoff = Backoff::new(policy.clone());
    loop {
        let result = tokio::select! {
            _ = cancel.cancelled() => return Err(Error::Cancelled),
            r = op() => r,
        };
        match result {
            Ok(v) => return Ok(v),
            Err(e) if e.is_retryable() => {
                tracing::debug!(error = %e, "retryable error; backing off");
                match backoff.next_delay() {
                    Some(delay) => {
                        tokio::select! {
                            _ = cancel.cancelled() => return Err(Error::Cancelled),
                            _ = tokio::time::sleep(delay) => {}
                        }
                    }
                    None => return Err(e),
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// How long a starting process keeps retrying an unreachable etcd by default
/// ([`retry_startup`]: connect, lease grant, registration, spec read): long enough to
/// ride out an etcd leader election, a member restart or a quorum loss of a minute, and
/// short enough that a wrong address is reported within minutes.
pub const DEFAULT_STARTUP_WAIT: Duration = Duration::from_secs(120);

/// How often a starting process tries a write again while etcd is full.
const FULL_POLL: Duration = Duration::from_secs(2);

fn backoff_policy(wait: Duration) -> RetryPolicy {
    RetryPolicy::forever()
        .with_delays(Duration::from_millis(100), Duration::from_secs(2))
        .with_max_elapsed(Some(wait))
}

/// Runs one startup step against etcd (`what`: a verb phrase for the log, such as
/// "grant the lease"), retrying transient errors ([`Error::is_retryable`]) with backoff
/// (100 ms doubling to 2 s, jittered) for up to `wait`. The first failure is logged as
/// a warning, a success after failures as info. An error that is not transient is
/// returned at once; when `wait` runs out, the last error (it names the endpoints when
/// etcd could not be reached); when `cancel` fires, [`Error::Cancelled`]. A full etcd
/// ([`Error::NoSpace`]) is waited out without limit (logged once): etcd answers, and
/// the step succeeds once space is freed; `wait` counts again from then.
pub async fn retry_startup<T, F, Fut>(
    what: &str,
    wait: Duration,
    cancel: &CancellationToken,
    mut op: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let started = Instant::now();
    let mut backoff = Backoff::new(backoff_policy(wait));
    let mut failed = false;
    let mut full = false;
    loop {
        let result = tokio::select! {
            _ = cancel.cancelled() => return Err(Error::Cancelled),
            r = op() => r,
        };
        let e = match result {
            Ok(v) => {
                if failed {
                    tracing::info!(waited = ?started.elapsed(), "etcd answered: {what} done");
                }
                return Ok(v);
            }
            Err(e) if e.is_retryable() => e,
            Err(e) => return Err(e),
        };
        if e.is_no_space() {
            // etcd answers, and is full: wait for space however long it takes (a role
            // that gave up would only be restarted into the same wait), saying so once.
            if !full {
                tracing::warn!(error = %e, "{what}: waiting for etcd to have space");
                full = true;
            }
            failed = true;
            backoff = Backoff::new(backoff_policy(wait));
            tokio::select! {
                _ = cancel.cancelled() => return Err(Error::Cancelled),
                _ = tokio::time::sleep(FULL_POLL) => {}
            }
            continue;
        }
        if failed {
            tracing::debug!(error = %e, "{what}: etcd still unavailable; retrying");
        } else {
            tracing::warn!(error = %e, ?wait, "{what}: etcd unavailable; retrying");
            failed = true;
        }
        let Some(delay) = backoff.next_delay() else {
            return Err(e);
        };
        tokio::select! {
            _ = cancel.cancelled() => return Err(Error::Cancelled),
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// How one attempt of a client call ended (see [`call_until`]).
#[derive(Debug)]
pub enum Attempt<R, E> {
    /// It succeeded.
    Done(R),
    /// It failed for good.
    Fail(E),
    /// It failed in a way another attempt may cure (reconnect, failover); why.
    Retry(String),
    /// The service answered that it is paused (a job waiting for etcd to have space, a
    /// new leading master loading its queue): attempts go on however long that lasts,
    /// 20 ms apart at first and at most [`PAUSED_POLL`] apart (a pause of a few
    /// milliseconds costs no second; a long one costs the service one call a second),
    /// and `retry_for` counts again from the end of the pause; why.
    Paused(String),
}

/// The longest wait of [`call_until`] between attempts while the service says it is
/// paused.
pub const PAUSED_POLL: Duration = Duration::from_secs(1);

/// The backoff of [`call_until`] while paused: 20 ms doubling to [`PAUSED_POLL`].
fn paused_backoff() -> Backoff {
    Backoff::new(RetryPolicy::forever().with_delays(Duration::from_millis(20), PAUSED_POLL))
}

/// Why [`call_until`] gave up.
#[derive(Debug)]
pub enum CallError<E> {
    /// An attempt failed for good.
    Failed(E),
    /// `cancel` fired.
    Cancelled,
    /// Every attempt for `waited` asked for a retry; `last` says why the last did.
    GaveUp {
        /// How long it tried.
        waited: Duration,
        /// The last attempt's reason.
        last: String,
    },
}

/// The one retry/failover loop of edl's clients (the master's and the pservers'): runs
/// `attempt` (given the deadline, for its own connect waits) until it is done or fails
/// for good, retrying for `retry_for` with a backoff of 20 ms doubling to 500 ms
/// (jittered; never sleeping past the deadline), and stopping at once when `cancel` fires.
pub async fn call_until<R, E, F, Fut>(
    retry_for: Duration,
    cancel: &CancellationToken,
    mut attempt: F,
) -> std::result::Result<R, CallError<E>>
where
    F: FnMut(Instant) -> Fut,
    Fut: Future<Output = Attempt<R, E>>,
{
    let mut start = Instant::now();
    let mut until = start + retry_for;
    let mut backoff = Backoff::new(
        RetryPolicy::forever().with_delays(Duration::from_millis(20), Duration::from_millis(500)),
    );
    let mut paused_since = None;
    let mut paused = paused_backoff();
    loop {
        if cancel.is_cancelled() {
            return Err(CallError::Cancelled);
        }
        let last = match attempt(until).await {
            Attempt::Done(r) => {
                if let Some(since) = paused_since {
                    tracing::info!(waited = ?Instant::now() - since, "the pause is over");
                }
                return Ok(r);
            }
            Attempt::Fail(e) => return Err(CallError::Failed(e)),
            Attempt::Retry(last) => last,
            Attempt::Paused(why) => {
                if paused_since.is_none() {
                    tracing::warn!("{why}; waiting");
                    paused_since = Some(Instant::now());
                    paused = paused_backoff();
                }
                if !paused.wait(cancel).await {
                    return Err(CallError::Cancelled);
                }
                start = Instant::now();
                until = start + retry_for;
                continue;
            }
        };
        let now = Instant::now();
        if now >= until {
            return Err(CallError::GaveUp {
                waited: now - start,
                last,
            });
        }
        tracing::debug!(error = %last, "call failed; retrying");
        let delay = backoff
            .next_delay()
            .unwrap_or(Duration::from_millis(500))
            .min(until - now);
        tokio::select! {
            _ = cancel.cancelled() => return Err(CallError::Cancelled),
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test(start_paused = true)]
    async fn retries_only_retryable_errors() {
        let calls = AtomicU32::new(0);
        let r: Result<u32> = retry(&RetryPolicy::default(), || async {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            if n < 3 {
                Err(Error::unavailable("e", "down"))
            } else {
                Ok(n)
            }
        })
        .await;
        assert_eq!(r.unwrap(), 3);

        calls.store(0, Ordering::SeqCst);
        let r: Result<u32> = retry(&RetryPolicy::default(), || async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err(Error::NotLeader)
        })
        .await;
        assert!(matches!(r, Err(Error::NotLeader)));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_after_limits() {
        let calls = AtomicU32::new(0);
        let policy = RetryPolicy::default().with_max_attempts(Some(4));
        let r: Result<()> = retry(&policy, || async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err(Error::Timeout(Duration::from_secs(1)))
        })
        .await;
        assert!(matches!(r, Err(Error::Timeout(_))));
        assert_eq!(calls.load(Ordering::SeqCst), 4);

        let start = Instant::now();
        let policy = RetryPolicy::default().with_max_elapsed(Some(Duration::from_secs(5)));
        let r: Result<()> = retry(&policy, || async { Err(Error::unavailable("e", "down")) }).await;
        assert!(r.is_err());
        assert!(start.elapsed() <= Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn cancellation_stops_retrying() {
        let cancel = CancellationToken::new();
        let c2 = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            c2.cancel();
        });
        let r: Result<()> = retry_cancellable(&RetryPolicy::forever(), &cancel, || async {
            Err(Error::unavailable("e", "down"))
        })
        .await;
        assert!(matches!(r, Err(Error::Cancelled)));
    }

    /// A startup step is retried through an outage, gives up after its wait with the
    /// last error, and fails at once on an error retrying cannot cure.
    #[tokio::test(start_paused = true)]
    async fn retry_startup_waits_out_outages_for_its_wait_only() {
        let cancel = CancellationToken::new();
        let calls = AtomicU32::new(0);
        let start = Instant::now();
        let r = retry_startup("connect", Duration::from_secs(120), &cancel, || async {
            if start.elapsed() < Duration::from_secs(90) {
                calls.fetch_add(1, Ordering::SeqCst);
                Err(Error::unavailable("http://e:2379", "connection refused"))
            } else {
                Ok(7)
            }
        })
        .await;
        assert_eq!(r.unwrap(), 7);
        let n = calls.load(Ordering::SeqCst);
        assert!((40..=120).contains(&n), "{n} attempts in 90 s");

        let start = Instant::now();
        let r: Result<()> = retry_startup("connect", Duration::from_secs(120), &cancel, || async {
            Err(Error::unavailable("http://e:2379", "connection refused"))
        })
        .await;
        let waited = start.elapsed();
        assert!(
            waited <= Duration::from_secs(120) && waited >= Duration::from_secs(117),
            "{waited:?}"
        );
        assert!(r.unwrap_err().to_string().contains("http://e:2379"));

        calls.store(0, Ordering::SeqCst);
        let r: Result<()> = retry_startup("connect", Duration::from_secs(120), &cancel, || async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err(Error::PermissionDenied("bad password".into()))
        })
        .await;
        assert!(matches!(r, Err(Error::PermissionDenied(_))));
        assert_eq!(calls.load(Ordering::SeqCst), 1);

        let c2 = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            c2.cancel();
        });
        let r: Result<()> = retry_startup("connect", Duration::from_secs(120), &cancel, || async {
            Err(Error::Timeout(Duration::from_secs(5)))
        })
        .await;
        assert!(matches!(r, Err(Error::Cancelled)));
    }

    /// A full etcd is waited out past the step's wait (it answers; space may be freed
    /// at any time), and the step succeeds once it has space.
    #[tokio::test(start_paused = true)]
    async fn retry_startup_waits_for_a_full_etcd_without_limit() {
        let cancel = CancellationToken::new();
        let calls = AtomicU32::new(0);
        let start = Instant::now();
        let r = retry_startup(
            "grant the lease",
            Duration::from_secs(10),
            &cancel,
            || async {
                calls.fetch_add(1, Ordering::SeqCst);
                if start.elapsed() < Duration::from_secs(600) {
                    Err(Error::NoSpace {
                        msg: "etcdserver: mvcc: database space exceeded".into(),
                    })
                } else {
                    Ok(7)
                }
            },
        )
        .await;
        assert_eq!(r.unwrap(), 7);
        assert!(start.elapsed() >= Duration::from_secs(600));
        let n = calls.load(Ordering::SeqCst);
        assert!((200..=400).contains(&n), "{n} attempts in 600 s");
    }

    proptest::proptest! {
        #[test]
        fn delays_stay_within_bounds(initial_ms in 1u64..1000, max_ms in 1u64..5000, mult in 1.0f64..4.0) {
            let policy = RetryPolicy {
                initial: Duration::from_millis(initial_ms),
                max: Duration::from_millis(max_ms),
                multiplier: mult,
                max_elapsed: None,
                max_attempts: Some(20),
            };
            let mut b = Backoff::new(policy.clone());
            let mut n = 0;
            while let Some(d) = b.next_delay() {
                proptest::prop_assert!(d <= policy.max);
                n += 1;
            }
            proptest::prop_assert_eq!(n, 19);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn call_until_retries_until_done_or_the_deadline() {
        let cancel = CancellationToken::new();
        let mut n = 0;
        let r: std::result::Result<u32, CallError<()>> =
            call_until(Duration::from_secs(5), &cancel, |_| {
                n += 1;
                let k = n;
                async move {
                    if k < 3 {
                        Attempt::Retry(format!("try {k}"))
                    } else {
                        Attempt::Done(k)
                    }
                }
            })
            .await;
        assert_eq!(r.unwrap(), 3);

        let r: std::result::Result<(), CallError<()>> =
            call_until(Duration::from_millis(300), &cancel, |_| async {
                Attempt::Retry("down".into())
            })
            .await;
        match r {
            Err(CallError::GaveUp { waited, last }) => {
                assert!(waited >= Duration::from_millis(300), "{waited:?}");
                assert!(waited < Duration::from_millis(900), "{waited:?}");
                assert_eq!(last, "down");
            }
            other => panic!("expected GaveUp, got {other:?}"),
        }

        let r: std::result::Result<(), CallError<&str>> =
            call_until(Duration::from_secs(5), &cancel, |_| async {
                Attempt::Fail("no")
            })
            .await;
        assert!(matches!(r, Err(CallError::Failed("no"))));

        cancel.cancel();
        let r: std::result::Result<(), CallError<()>> =
            call_until(Duration::from_secs(5), &cancel, |_| async {
                Attempt::Done(())
            })
            .await;
        assert!(matches!(r, Err(CallError::Cancelled)));
    }

    /// A pause of a few milliseconds (a new leading master loading its queue) costs
    /// the caller about that, not a second; a long one is polled every half second to
    /// second once the backoff has grown (never faster, never slower), and is waited out
    /// past `retry_for`.
    #[tokio::test(start_paused = true)]
    async fn call_until_waits_out_a_pause_soon_after_it_ends() {
        let cancel = CancellationToken::new();
        for pause in [Duration::from_millis(5), Duration::from_secs(60)] {
            let start = Instant::now();
            let mut attempts = Vec::new();
            let r: std::result::Result<u32, CallError<()>> =
                call_until(Duration::from_secs(5), &cancel, |_| {
                    attempts.push(start.elapsed());
                    let paused = start.elapsed() < pause;
                    async move {
                        if paused {
                            Attempt::Paused("loading".into())
                        } else {
                            Attempt::Done(1)
                        }
                    }
                })
                .await;
            assert_eq!(r.unwrap(), 1);
            let waited = start.elapsed();
            assert!(waited >= pause, "{pause:?}: done after {waited:?}");
            // The first waits are 20 ms at most; later ones at most PAUSED_POLL.
            let slack = if pause < PAUSED_POLL {
                Duration::from_millis(20)
            } else {
                PAUSED_POLL
            };
            assert!(
                waited <= pause + slack,
                "{pause:?}: done only after {waited:?}"
            );
            let gaps: Vec<Duration> = attempts.windows(2).map(|w| w[1] - w[0]).collect();
            assert!(gaps.iter().all(|g| *g <= PAUSED_POLL), "{gaps:?}");
            if pause > PAUSED_POLL {
                // Once grown, the backoff waits at least half its bound: no faster than
                // twice a second (the last gap is cut short by the pause's end).
                let grown: Vec<&Duration> =
                    gaps.iter().skip_while(|g| **g < PAUSED_POLL / 2).collect();
                assert!(grown.len() >= 40, "the backoff never grew: {gaps:?}");
                assert!(
                    grown[..grown.len() - 1]
                        .iter()
                        .all(|g| **g >= PAUSED_POLL / 2),
                    "{gaps:?}"
                );
                // Polled every half second to second once the backoff has grown.
                assert!(
                    (55..=130).contains(&attempts.len()),
                    "{} attempts in {pause:?}",
                    attempts.len()
                );
            }
        }
    }
}
