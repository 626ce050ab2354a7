//! [`GoodputClock`]: a trainer's wall time split into [`Bucket`]s that sum to it.
//!
//! The parts of a trainer mark what they do as spans ([`GoodputClock::span`]): the loop
//! waits for a task or evaluates, a group computes, a pull or a push is waited for, a
//! pserver call is retried after a failure (the pserver client's [`RetryObserver`]).
//! Spans overlap (the pipeline's compute thread computes while the loop asks for the next
//! task and a push is retried), so each instant goes to the active bucket first in
//! [`Bucket::ALL`]'s order, and to [`Bucket::Idle`] when none is active.
//!
//! Invariants of [`Clock`] (a pure state machine, time as an argument):
//! - the buckets' totals plus the open interval are exactly the time since the clock's
//!   start (so a report's buckets sum to its wall time);
//! - an interval is charged to the bucket that was first among the active ones during
//!   it (every change of the active set settles the interval before it).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use edl_master_client::LeasedTask;
pub use edl_master_client::{Bucket, Goodput};
use edl_pserver_client::RetryObserver;

const N: usize = Bucket::ALL.len();

/// The buckets' totals and the spans active now.
#[derive(Clone, Debug)]
pub struct Clock {
    since: Instant,
    active: [u32; N],
    totals: [Duration; N],
    /// Since when the current bucket is the current one.
    current_since: Instant,
}

impl Clock {
    /// A clock starting at `now`, nothing active.
    pub fn new(now: Instant) -> Clock {
        Clock {
            since: now,
            active: [0; N],
            totals: [Duration::ZERO; N],
            current_since: now,
        }
    }

    /// The bucket the present instant goes to.
    pub fn current(&self) -> Bucket {
        Bucket::ALL
            .into_iter()
            .find(|b| self.active[b.index()] > 0)
            .unwrap_or(Bucket::Idle)
    }

    /// Charges the time up to `now` to the current bucket (a `now` before the last
    /// change counts as the last change).
    fn settle(&mut self, now: Instant) {
        if now > self.since {
            self.totals[self.current().index()] += now - self.since;
            self.since = now;
        }
    }

    /// A span of `b` begins at `now`.
    pub fn begin(&mut self, b: Bucket, now: Instant) {
        self.settle(now);
        let was = self.current();
        self.active[b.index()] += 1;
        self.changed(was, now);
    }

    /// A span of `b` ends at `now` (one that was not begun is ignored).
    pub fn end(&mut self, b: Bucket, now: Instant) {
        self.settle(now);
        let was = self.current();
        let n = &mut self.active[b.index()];
        *n = n.saturating_sub(1);
        self.changed(was, now);
    }

    fn changed(&mut self, was: Bucket, now: Instant) {
        if self.current() != was {
            self.current_since = now.max(self.current_since);
        }
    }

    /// How long, at `now`, the trainer has been waiting on another process: the current
    /// bucket is [`Bucket::Communicating`] or [`Bucket::Recovering`] (a pull, a push or
    /// a report that has not returned, nothing computing) and has been since; `None`
    /// otherwise. A trainer so waiting is not stuck: whatever it waits on is.
    pub fn waiting_for(&self, now: Instant) -> Option<Duration> {
        matches!(self.current(), Bucket::Communicating | Bucket::Recovering)
            .then(|| now.saturating_duration_since(self.current_since))
    }

    /// The totals at `now`, the open interval charged to the current bucket.
    pub fn snapshot(&self, now: Instant) -> Goodput {
        let mut totals = self.totals;
        if now > self.since {
            totals[self.current().index()] += now - self.since;
        }
        Goodput {
            seconds: totals.map(|d| d.as_secs_f64()),
        }
    }
}

/// The bucket of computing `task`: [`Bucket::Recomputing`] when an earlier attempt of
/// this pass had it and this one does not resume after that attempt's applied batches
/// (as far as the trainer can tell: a task a dead trainer had read ahead but not begun
/// counts too, as the master counts its records as cut off).
pub fn compute_bucket(task: &LeasedTask) -> Bucket {
    if task.first_attempt() || task.dispatches == 0 || task.resume.is_some() {
        Bucket::Computing
    } else {
        Bucket::Recomputing
    }
}

/// A trainer's [`Clock`], shared by its parts (on the wall clock).
#[derive(Clone, Debug)]
pub struct GoodputClock {
    clock: Arc<Mutex<Clock>>,
    /// Whether the [`Bucket::Starting`] span begun at the start still runs.
    starting: Arc<std::sync::atomic::AtomicBool>,
    /// Whether a loop marks its spans on this clock, so that its totals mean something
    /// ([`GoodputClock::measured`]).
    in_use: Arc<std::sync::atomic::AtomicBool>,
}

impl Default for GoodputClock {
    /// A clock of its own (a loop whose time nobody reports), starting now.
    fn default() -> Self {
        GoodputClock::starting_at(Instant::now())
    }
}

impl GoodputClock {
    /// A clock started at `start` (a process's start) in [`Bucket::Starting`], until
    /// [`GoodputClock::started`].
    pub fn starting_at(start: Instant) -> GoodputClock {
        let mut clock = Clock::new(start);
        clock.begin(Bucket::Starting, start);
        GoodputClock {
            clock: Arc::new(Mutex::new(clock)),
            starting: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            in_use: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        }
    }

    /// Says that a loop marks its spans on this clock from now on.
    pub fn use_it(&self) {
        self.in_use
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The totals now, once a loop uses the clock ([`GoodputClock::use_it`]); `None`
    /// before (a loop of the caller's own, whose time is not measured).
    pub fn measured(&self) -> Option<Goodput> {
        self.in_use
            .load(std::sync::atomic::Ordering::Relaxed)
            .then(|| self.snapshot())
    }

    /// Ends the starting span (the first task arrived); later calls do nothing.
    pub fn started(&self) {
        if self
            .starting
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            self.with(|c| c.end(Bucket::Starting, Instant::now()));
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut Clock) -> T) -> T {
        f(&mut self.clock.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Marks `b` active until the span is dropped.
    pub fn span(&self, b: Bucket) -> Span {
        self.with(|c| c.begin(b, Instant::now()));
        Span {
            clock: self.clone(),
            bucket: b,
        }
    }

    /// The totals now.
    pub fn snapshot(&self) -> Goodput {
        self.with(|c| c.snapshot(Instant::now()))
    }

    /// [`Clock::waiting_for`] now.
    pub fn waiting_for(&self) -> Option<Duration> {
        self.with(|c| c.waiting_for(Instant::now()))
    }
}

/// A bucket active while this lives ([`GoodputClock::span`]).
#[derive(Debug)]
#[must_use = "the span ends when dropped"]
pub struct Span {
    clock: GoodputClock,
    bucket: Bucket,
}

impl Drop for Span {
    fn drop(&mut self) {
        let b = self.bucket;
        self.clock.with(|c| c.end(b, Instant::now()));
    }
}

/// The pserver client's retries, as [`Bucket::Recovering`].
impl RetryObserver for GoodputClock {
    fn retrying(&self, on: bool) {
        let now = Instant::now();
        self.with(|c| {
            if on {
                c.begin(Bucket::Recovering, now)
            } else {
                c.end(Bucket::Recovering, now)
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// A span of `bucket` over `[start, start + len)` milliseconds.
    #[derive(Clone, Debug)]
    struct Spn {
        bucket: usize,
        start: u64,
        len: u64,
    }

    fn spans() -> impl Strategy<Value = Vec<Spn>> {
        prop::collection::vec(
            (0..N - 1, 0..200u64, 0..80u64).prop_map(|(bucket, start, len)| Spn {
                bucket,
                start,
                len,
            }),
            0..12,
        )
    }

    proptest! {
        /// Overlapping spans: each millisecond goes to the first active bucket (Idle
        /// when none is), the totals sum to the time since the start at every
        /// snapshot, and a snapshot taken mid-way agrees with the final totals up to it.
        #[test]
        fn each_instant_goes_to_the_first_active_bucket_and_the_totals_sum_to_the_wall(
            spans in spans(), at in 0..300u64,
        ) {
            let t0 = Instant::now();
            let ms = |m: u64| t0 + Duration::from_millis(m);
            // Events in time order; at one instant, ends before begins (either order
            // charges nothing to a zero-length interval; empty spans have no events).
            let mut events: Vec<(u64, bool, usize)> = Vec::new();
            for s in spans.iter().filter(|s| s.len > 0) {
                events.push((s.start, true, s.bucket));
                events.push((s.start + s.len, false, s.bucket));
            }
            events.sort_by_key(|&(t, begin, _)| (t, begin));
            let mut c = Clock::new(t0);
            let mut mid = None;
            for &(t, begin, b) in &events {
                if mid.is_none() && t >= at {
                    mid = Some(c.snapshot(ms(at)));
                }
                let b = Bucket::ALL[b];
                if begin { c.begin(b, ms(t)) } else { c.end(b, ms(t)) }
            }
            let end = 300u64;
            let got = c.snapshot(ms(end));
            // The reference: millisecond by millisecond.
            let mut want = [0u64; N];
            for m in 0..end {
                let first = (0..N - 1)
                    .find(|&b| spans.iter().any(|s| s.bucket == b && s.start <= m && m < s.start + s.len))
                    .unwrap_or(N - 1);
                want[first] += 1;
            }
            for b in 0..N {
                prop_assert!((got.seconds[b] - want[b] as f64 / 1e3).abs() < 1e-9, "{b}: {got:?} {want:?}");
            }
            prop_assert!((got.total() - 0.3).abs() < 1e-9);
            if let Some(mid) = mid {
                prop_assert!((mid.total() - at as f64 / 1e3).abs() < 1e-9);
                for b in 0..N {
                    prop_assert!(mid.seconds[b] <= got.seconds[b] + 1e-9);
                }
            }
        }
    }

    /// Waiting on another process: a pull, a push or a retried call is the current
    /// bucket (nothing computing, evaluating or starting), timed from when it became so.
    #[test]
    fn waiting_is_a_call_in_flight_alone_timed_from_when_it_became_so() {
        let t0 = Instant::now();
        let ms = |m: u64| t0 + Duration::from_millis(m);
        let d = Duration::from_millis;
        let mut c = Clock::new(t0);
        assert_eq!(c.waiting_for(ms(1)), None, "idle");
        c.begin(Bucket::Communicating, ms(0));
        assert_eq!(c.waiting_for(ms(5)), Some(d(5)));
        // Computing meanwhile (the pipeline's compute thread): not waiting.
        c.begin(Bucket::Computing, ms(10));
        assert_eq!(c.waiting_for(ms(12)), None);
        c.end(Bucket::Computing, ms(20));
        assert_eq!(
            c.waiting_for(ms(25)),
            Some(d(5)),
            "again from the compute's end"
        );
        // A second call in flight changes nothing; a retry is waiting too.
        c.begin(Bucket::Communicating, ms(26));
        assert_eq!(c.waiting_for(ms(30)), Some(d(10)));
        c.begin(Bucket::Recovering, ms(30));
        assert_eq!(c.waiting_for(ms(31)), Some(d(1)));
        c.end(Bucket::Recovering, ms(40));
        assert_eq!(c.waiting_for(ms(41)), Some(d(1)));
        c.end(Bucket::Communicating, ms(50));
        c.end(Bucket::Communicating, ms(50));
        // Waiting for a task is not waiting on a call (the reader asks meanwhile).
        c.begin(Bucket::WaitingForTask, ms(60));
        assert_eq!(c.waiting_for(ms(70)), None);
    }

    #[test]
    fn an_unbegun_end_and_a_time_before_the_last_change_charge_nothing() {
        let t0 = Instant::now();
        let mut c = Clock::new(t0);
        c.end(Bucket::Computing, t0 + Duration::from_millis(5));
        assert_eq!(c.current(), Bucket::Idle);
        c.begin(Bucket::Computing, t0 + Duration::from_millis(10));
        c.end(Bucket::Computing, t0 + Duration::from_millis(7));
        let g = c.snapshot(t0 + Duration::from_millis(10));
        assert!((g.get(Bucket::Idle) - 0.010).abs() < 1e-9, "{g:?}");
        assert_eq!(g.get(Bucket::Computing), 0.0);
        assert!((g.total() - 0.010).abs() < 1e-9);
    }
}
