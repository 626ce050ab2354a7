//! The trainer registry as the pserver follows it: the registered trainers (a sync push
//! must come from one), and the trainers a sync step expects (one whose lease ends is
//! dropped from the open step at once), with the step timeout enforced every tick.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, MemberEvent, Membership, Registry, follow_members};
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

/// Follows the trainer registry: registered ids for the sync check and the sync steps'
/// expected trainers (a trainer whose lease ends is dropped from the open step at once),
/// and the step timeout every tick.
///
/// Through [`edl_coord::follow_members`]: if the registry watch ends (a permission taken
/// away, ...), the ticks go on (steps still time out) and the watch is opened again with
/// a bounded backoff until `stop` fires; the listing that follows each new watch
/// replaces the members known, so that trainers that left while no watch ran are
/// forgotten.
pub(super) async fn follow_trainers(
    backend: Arc<dyn Backend>,
    keys: JobKeys,
    shard: Arc<Shard>,
    members: Arc<Members>,
    stop: CancellationToken,
) {
    let registry = Registry::new(backend, keys.trainers());
    let mut follow = follow_members(registry, None, stop.child_token());
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let sync_core = || shard.core().ok().filter(|c| c.is_sync());
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            m = follow.next() => match m {
                Some(Membership::Event(MemberEvent::Joined(m) | MemberEvent::Updated(m))) => {
                    if let Some(core) = sync_core() {
                        core.sync_member_joined(&m.id);
                    }
                    members.set.write().await.insert(m.id);
                }
                Some(Membership::Event(MemberEvent::Left(m))) => {
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
                Some(Membership::Listing(listed, _)) => {
                    *members.set.write().await = listed.into_iter().map(|m| m.id).collect();
                }
                None => break,
            },
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
