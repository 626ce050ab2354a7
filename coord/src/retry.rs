//! Retrying retryable errors with exponential backoff and jitter.

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
}
