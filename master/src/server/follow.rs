//! What a leader term follows in etcd: the trainer registry (a trainer that leaves loses
//! its tasks) and the pserver shards' restore records (the queue rewinds to them).

use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, MemberEvent, Membership, Registry};
use edl_job::JobKeys;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::core::CoreHandle;

/// Hands the pserver shards' restore records to the queue whenever they change (the
/// queue applies each incarnation's once), for the whole term.
pub(super) async fn follow_restores(
    backend: Arc<dyn Backend>,
    keys: JobKeys,
    handle: CoreHandle,
    term: CancellationToken,
) {
    let mut view = edl_coord::follow_prefix(backend, keys.restores(), term.child_token());
    loop {
        tokio::select! {
            _ = term.cancelled() => return,
            r = view.changed() => if r.is_err() { return },
        }
        let v = view.borrow_and_update().clone();
        if v.revision == 0 {
            continue;
        }
        let records = edl_job::records::decode_readable(v.kvs.values());
        handle.restored(records).await;
    }
}

/// Reports trainers that leave, and reconciles lease holders with a consistent listing
/// every `every`, for the whole term (through [`edl_coord::follow_members`], which
/// re-watches after a watch ends and lists after each re-watch).
pub(super) async fn follow_trainers(
    registry: Registry,
    handle: CoreHandle,
    every: Duration,
    term: CancellationToken,
) {
    let mut follow = edl_coord::follow_members(registry, Some(every), term.child_token());
    while let Some(m) = follow.next().await {
        match m {
            Membership::Event(MemberEvent::Left(m)) => {
                tracing::info!(trainer = %m.id, "trainer left");
                handle.trainers_lost(vec![m.id]).await;
            }
            Membership::Event(MemberEvent::Joined(m)) => {
                tracing::info!(trainer = %m.id, "trainer joined");
            }
            Membership::Event(MemberEvent::Updated(_)) => {}
            Membership::Listing(members, _) => {
                handle
                    .reconcile(members.into_iter().map(|m| m.id).collect())
                    .await;
            }
        }
    }
}
