//! [`follow_members`]: a registry followed for as long as its owner wants, whatever
//! happens to the watch — the one membership follower of edl (the master follows its
//! trainers with it to requeue their tasks, each pserver to run its sync steps).
//!
//! It yields [`Membership::Event`]s from [`Registry::watch_members`] (which itself
//! absorbs disconnects and compactions) and [`Membership::Listing`]s: a consistent
//! listing of every member when it starts, every `reconcile_every` (when set) and after
//! every re-watch.
//!
//! Invariants:
//! - The stream ends only when `cancel` fires or it is dropped; never on its own.
//! - If the member watch ends (an error retrying cannot cure, such as a permission taken
//!   away), it is opened again after a backoff (100 ms doubling to 5 s; reset once a
//!   watch has lived 30 s), and a fresh listing follows each new watch, so a member that
//!   left while no watch ran is not missed: a consumer that replaces its set with each
//!   listing converges to the registry.
//! - Reconcile ticks go on while the watch is down.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::registry::{Member, MemberEvent, MemberWatch, Registry};
use crate::retry::{Backoff, RetryPolicy};
use crate::types::Revision;

/// First delay before the member watch is opened again after it ended.
pub const REWATCH_MIN: Duration = Duration::from_millis(100);
/// Longest delay between attempts to open the member watch again.
pub const REWATCH_MAX: Duration = Duration::from_secs(5);
/// A member watch that lived this long resets the re-watch backoff.
pub const REWATCH_HEALTHY: Duration = Duration::from_secs(30);

/// What [`follow_members`] reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Membership {
    /// A member joined, changed or left.
    Event(MemberEvent),
    /// Every member, as of one consistent listing at the revision given.
    Listing(Vec<Member>, Revision),
}

/// Stream of [`Membership`] from [`follow_members`].
#[derive(Debug)]
pub struct MemberFollow {
    rx: mpsc::Receiver<Membership>,
    _stop: tokio_util::sync::DropGuard,
}

impl Stream for MemberFollow {
    type Item = Membership;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}

/// Follows `registry` until `cancel` fires (see the module's invariants): a listing
/// first, events, a listing every `reconcile_every` (none when `None`) and after every
/// re-watch.
///
/// Runs a task on the current tokio runtime. Items are buffered (256); a consumer that
/// stops reading holds the task back, it does not lose items.
pub fn follow_members(
    registry: Registry,
    reconcile_every: Option<Duration>,
    cancel: CancellationToken,
) -> MemberFollow {
    let (tx, rx) = mpsc::channel(256);
    let stop = cancel.child_token();
    let task_stop = stop.clone();
    tokio::spawn(
        async move {
            tokio::select! {
                _ = task_stop.cancelled() => {}
                _ = run(registry, reconcile_every, tx, task_stop.clone()) => {}
            }
        }
        .in_current_span(),
    );
    MemberFollow {
        rx,
        _stop: stop.drop_guard(),
    }
}

fn rewatch_backoff() -> Backoff {
    Backoff::new(RetryPolicy::forever().with_delays(REWATCH_MIN, REWATCH_MAX))
}

async fn next_event(events: &mut Option<MemberWatch>) -> Option<MemberEvent> {
    match events {
        Some(w) => w.next().await,
        None => std::future::pending().await,
    }
}

async fn tick(interval: &mut Option<tokio::time::Interval>) {
    match interval {
        Some(i) => {
            i.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// Runs until the consumer goes away (or the caller's select sees `stop`).
async fn run(
    registry: Registry,
    reconcile_every: Option<Duration>,
    tx: mpsc::Sender<Membership>,
    stop: CancellationToken,
) {
    let prefix = registry.prefix().to_owned();
    let mut events = None;
    let mut watched = false;
    let mut opened = Instant::now();
    let mut backoff = rewatch_backoff();
    // The first watch is opened (and listed) like every later one, at once.
    let mut rewatch_at: Option<Instant> = Some(Instant::now());
    let mut interval = reconcile_every.map(|every| {
        let mut i = tokio::time::interval(every.max(Duration::from_millis(100)));
        i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        i
    });
    let rewatch = |at: Option<Instant>| async move {
        match at {
            Some(at) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    };
    loop {
        let sent = tokio::select! {
            ev = next_event(&mut events) => match ev {
                Some(ev) => tx.send(Membership::Event(ev)).await,
                None => {
                    if stop.is_cancelled() {
                        return; // the watch ended because the caller stopped
                    }
                    let error = events.take().and_then(|w| w.take_error());
                    if opened.elapsed() >= REWATCH_HEALTHY {
                        backoff = rewatch_backoff();
                    }
                    let delay = backoff.next_delay().unwrap_or(REWATCH_MAX);
                    tracing::error!(prefix = %prefix, error = ?error, retry_in = ?delay, "member watch ended; watching again");
                    rewatch_at = Some(Instant::now() + delay);
                    Ok(())
                }
            },
            _ = rewatch(rewatch_at) => {
                // The new watch reports every change after its own listing; the listing
                // sent here replaces what the ended watch left behind.
                let watch = registry.watch_members(stop.child_token());
                match registry.list().await {
                    Ok((members, revision)) => {
                        if watched {
                            tracing::info!(prefix = %prefix, "member registry watched again");
                        }
                        watched = true;
                        events = Some(watch);
                        opened = Instant::now();
                        rewatch_at = None;
                        tx.send(Membership::Listing(members, revision)).await
                    }
                    Err(e) => {
                        let delay = backoff.next_delay().unwrap_or(REWATCH_MAX);
                        tracing::warn!(prefix = %prefix, error = %e, retry_in = ?delay, "member listing failed; retrying");
                        rewatch_at = Some(Instant::now() + delay);
                        Ok(())
                    }
                }
            }
            _ = tick(&mut interval) => match registry.list().await {
                Ok((members, revision)) => tx.send(Membership::Listing(members, revision)).await,
                Err(e) => {
                    tracing::debug!(prefix = %prefix, error = %e, "member listing failed; next tick");
                    Ok(())
                }
            },
        };
        if sent.is_err() {
            return; // the consumer is gone
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{Backend, Lease, MemBackend};

    async fn next(f: &mut MemberFollow) -> Membership {
        tokio::time::timeout(Duration::from_secs(5), f.next())
            .await
            .expect("an item within 5 s")
            .expect("the stream does not end")
    }

    #[tokio::test]
    async fn events_then_listings_every_tick() {
        let b: Arc<dyn Backend> = Arc::new(MemBackend::new());
        let stop = CancellationToken::new();
        let reg = Registry::new(b.clone(), "/r/");
        let lease = Lease::grant(b.clone(), Duration::from_secs(5), stop.child_token())
            .await
            .unwrap();
        reg.register("a", b"1".to_vec(), &lease).await.unwrap();
        let mut f = follow_members(reg.clone(), Some(Duration::from_millis(100)), stop.clone());
        let mut joined = false;
        let mut listed = false;
        while !(joined && listed) {
            match next(&mut f).await {
                Membership::Event(MemberEvent::Joined(m)) => {
                    assert_eq!(m.id, "a");
                    joined = true;
                }
                Membership::Listing(ms, _) => {
                    assert_eq!(ms.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(), ["a"]);
                    listed = true;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        reg.deregister("a", &lease).await.unwrap();
        loop {
            match next(&mut f).await {
                Membership::Event(MemberEvent::Left(m)) => {
                    assert_eq!(m.id, "a");
                    break;
                }
                Membership::Listing(..) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        stop.cancel();
        assert!(
            tokio::time::timeout(Duration::from_secs(5), f.next())
                .await
                .expect("ends when cancelled")
                .is_none()
        );
    }
}
