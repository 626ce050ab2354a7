//! The trainer registry as the pserver follows it: the registered trainers (a sync push
//! must come from one), and the trainers a sync step expects (one whose lease ends is
//! dropped from the open step at once), with the step timeout enforced every tick.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, MemberEvent, MemberWatch, Registry};
use futures::StreamExt;
use tokio::sync::RwLock;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::shard::Shard;
use edl_job::JobKeys;

/// Registered trainers, as seen through the registry watch.
#[derive(Debug, Default)]
pub(super) struct Members {
    pub(super) set: RwLock<HashSet<String>>,
}

/// First delay before the trainer watch is opened again after it ended.
const REWATCH_MIN: Duration = Duration::from_millis(100);
/// Longest delay between attempts to open the trainer watch again.
const REWATCH_MAX: Duration = Duration::from_secs(5);
/// A trainer watch that lived this long resets the re-watch backoff.
const REWATCH_HEALTHY: Duration = Duration::from_secs(30);

/// Follows the trainer registry: registered ids for the sync check and the sync steps'
/// expected trainers (a trainer whose lease ends is dropped from the open step at once),
/// a reconciliation and the step timeout every tick.
///
/// The registry watch ends only on an error that retrying cannot cure (a permission
/// taken away, ...); then the ticks go on (steps still time out) and the watch is
/// opened again with a bounded backoff until `stop` fires. Each new watch starts with a
/// fresh listing of the registry that replaces the members known, so that trainers that
/// left while no watch ran are forgotten.
pub(super) async fn follow_trainers(
    backend: Arc<dyn Backend>,
    keys: JobKeys,
    shard: Arc<Shard>,
    members: Arc<Members>,
    stop: CancellationToken,
) {
    let registry = Registry::new(backend, keys.trainers());
    let mut events = Some(registry.watch_members(stop.child_token()));
    let mut opened = Instant::now();
    let mut delay = REWATCH_MIN;
    let mut rewatch_at = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let sync_core = || shard.core().ok().filter(|c| c.is_sync());
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            ev = next_member_event(&mut events) => match ev {
                Some(MemberEvent::Joined(m) | MemberEvent::Updated(m)) => {
                    if let Some(core) = sync_core() {
                        core.sync_member_joined(&m.id);
                    }
                    members.set.write().await.insert(m.id);
                }
                Some(MemberEvent::Left(m)) => {
                    members.set.write().await.remove(&m.id);
                    if let Some(core) = sync_core() {
                        let id = m.id.clone();
                        let was = tokio::task::spawn_blocking(move || core.sync_member_left(&id))
                            .await
                            .unwrap_or(false);
                        if was {
                            tracing::info!(shard = shard.index(), trainer = %m.id, "trainer left; its step no longer waits for it");
                        }
                    }
                }
                None => {
                    let error = events.take().and_then(|w| w.take_error());
                    if opened.elapsed() >= REWATCH_HEALTHY {
                        delay = REWATCH_MIN;
                    }
                    tracing::error!(shard = shard.index(), error = ?error, retry_in = ?delay, "trainer registry watch ended; watching again");
                    rewatch_at = Instant::now() + delay;
                    delay = (delay * 2).min(REWATCH_MAX);
                }
            },
            _ = tokio::time::sleep_until(rewatch_at), if events.is_none() => {
                // The new watch reports every change after its own listing; ours
                // replaces what the ended watch left behind. (A trainer leaving in the
                // moment between the two listings stays known until the next re-watch:
                // at worst a step waits for it until the step timeout.)
                let watch = registry.watch_members(stop.child_token());
                match registry.list().await {
                    Ok((listed, _)) => {
                        *members.set.write().await = listed.into_iter().map(|m| m.id).collect();
                        events = Some(watch);
                        opened = Instant::now();
                        tracing::info!(shard = shard.index(), "trainer registry watched again");
                    }
                    Err(e) => {
                        tracing::warn!(shard = shard.index(), error = %e, retry_in = ?delay, "trainer registry listing failed; retrying");
                        rewatch_at = Instant::now() + delay;
                        delay = (delay * 2).min(REWATCH_MAX);
                    }
                }
            }
            _ = tick.tick() => {
                if let Some(core) = sync_core() {
                    let set: BTreeSet<String> = members.set.read().await.iter().cloned().collect();
                    let _ = tokio::task::spawn_blocking(move || {
                        core.sync_set_members(set);
                        core.sync_tick(Instant::now());
                    })
                    .await;
                }
            }
        }
    }
}

/// The next event of the trainer watch; pending while there is none.
async fn next_member_event(events: &mut Option<MemberWatch>) -> Option<MemberEvent> {
    match events {
        Some(w) => w.next().await,
        None => std::future::pending().await,
    }
}
