//! The election loop and one leader term: campaign, rebuild the queue, serve it while
//! the lease holds, hand over at once when the term ends.

use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, Backoff, Election, Lease, Registry, RetryPolicy};
use edl_job::JobKeys;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use super::follow::{follow_restores, follow_trainers};
use super::standby::Standby;
use super::{MasterConfig, Shared};
use crate::core::{Core, CoreHandle};
use crate::error::MasterError;
use crate::mirror::Mirrored;
use crate::store::{Loaded, Store};

/// Writes this process's [instance](edl_job::env::INSTANCE), when it has one, under the
/// lease it campaigns with, so that whoever sees the process end (the Kubernetes operator,
/// from its pod's status) can revoke that lease and let a standby lead at once
/// ([`edl_job::holders`]). Best effort: without it, the lease ends with its TTL.
async fn mark_instance(backend: &Arc<dyn Backend>, keys: &JobKeys, advertise: &str, lease: &Lease) {
    let instance = edl_job::env::instance();
    if instance.is_empty() {
        return;
    }
    let key = keys.master_instance(instance);
    if let Err(e) = backend
        .put(&key, advertise.as_bytes().to_vec(), Some(lease.id()))
        .await
    {
        tracing::debug!(error = %e, "could not write this master's instance; its lease will expire instead");
    }
}

/// Campaigns, leads until the lease is lost, and campaigns again, until shutdown.
pub(super) async fn lead_loop(
    backend: &Arc<dyn Backend>,
    cfg: &MasterConfig,
    keys: &JobKeys,
    election: &Election,
    advertise: &str,
    shared: &Arc<Shared>,
    shutdown: &CancellationToken,
) -> Result<(), MasterError> {
    let mut backoff = Backoff::new(retry_forever(Duration::from_millis(100)));
    let mut said_full = false;
    while !shutdown.is_cancelled() {
        let lease = match Lease::grant(backend.clone(), cfg.lease_ttl, shutdown.child_token()).await
        {
            Ok(l) => l,
            Err(e) => {
                // A full etcd refuses lease grants until space is freed: said once.
                if !e.is_no_space() || !std::mem::replace(&mut said_full, true) {
                    tracing::warn!(error = %e, "cannot get an etcd lease; retrying");
                }
                backoff.wait(shutdown).await;
                continue;
            }
        };
        mark_instance(backend, keys, advertise, &lease).await;
        // Meanwhile, follow the queue and watch the leader (server::standby).
        let standby = Standby::start(
            backend.clone(),
            keys.clone(),
            election.clone(),
            advertise.to_owned(),
            cfg.standby_copy,
            shutdown,
        );
        let leadership = match election.campaign(&lease, advertise, shutdown).await {
            Ok(l) => l,
            Err(edl_coord::Error::Cancelled) => break,
            Err(e) => {
                tracing::warn!(error = %e, "campaign ended; retrying");
                backoff.wait(shutdown).await;
                continue;
            }
        };
        backoff = Backoff::new(retry_forever(Duration::from_millis(100)));
        tracing::info!(addr = %advertise, revision = leadership.revision(), "leading");
        // Loading from now on: clients wait (as for a pause) instead of taking this
        // master for a standby while it takes its copy over.
        *shared.loading.write().await = Some(std::time::Instant::now());
        let mirrored = standby
            .take(backend, keys, advertise, TAKEOVER_CATCH_UP)
            .await;
        let term = CancellationToken::new();
        let lost = leadership.lost();
        let stop =
            {
                let term = term.clone();
                let shutdown = shutdown.clone();
                tokio::spawn(async move {
                tokio::select! {
                    _ = lost.cancelled() => tracing::warn!("leadership lost; stepping down"),
                    _ = shutdown.cancelled() => {}
                    _ = term.cancelled() => {}
                }
                term.cancel();
            }
.in_current_span())
            };
        let store = Store::new(backend.clone(), keys.clone(), leadership.fence().clone());
        let leader = crate::snapshots::Term {
            backend: backend.clone(),
            keys: keys.clone(),
            fence: leadership.fence().clone(),
            lease: lease.id(),
        };
        match lead(backend, cfg, keys, store, mirrored, leader, shared, &term).await {
            Ok(()) => {}
            Err(e) => tracing::warn!(error = %e, "leader term ended"),
        }
        *shared.core.write().await = None;
        term.cancel();
        let _ = stop.await;
        // Hand over at once: a term can end with the lease still valid (a failed commit
        // that is not a fencing error, a store that could not be loaded), and a stale
        // election key would block every candidate, us included, until its TTL ran out.
        if let Err(e) = leadership.resign().await {
            tracing::debug!(error = %e, "resign failed; the lease will expire");
        }
        if let Err(e) = lease.revoke().await {
            tracing::debug!(error = %e, "lease revoke failed; it will expire");
        }
        if shutdown.is_cancelled() {
            break;
        }
    }
    Ok(())
}

/// How long a new leader waits for its standby copy of the queue to catch up before it
/// reads the queue from etcd instead.
const TAKEOVER_CATCH_UP: Duration = Duration::from_secs(5);

/// One leader term: rebuild the queue (from `mirrored`, the standby's copy, when it has
/// one), serve it, follow the trainers, snapshot the job's etcd if asked to.
#[allow(clippy::too_many_arguments)]
async fn lead(
    backend: &Arc<dyn Backend>,
    cfg: &MasterConfig,
    keys: &JobKeys,
    store: Store,
    mirrored: Option<Mirrored>,
    leader: crate::snapshots::Term,
    shared: &Arc<Shared>,
    term: &CancellationToken,
) -> Result<(), MasterError> {
    let mut backoff = Backoff::new(retry_forever(Duration::from_millis(50)));
    let started = std::time::Instant::now();
    let preloaded = match mirrored {
        Some(Mirrored::Records(r)) => match crate::store::assemble(keys, *r) {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::warn!(error = %e, "the standby's copy of the queue does not load; reading it from etcd");
                None
            }
        },
        // No dataset yet (nothing to read), or a journal to settle (the full load does).
        Some(Mirrored::NoDataset | Mirrored::Journal) | None => None,
    };
    let from = if preloaded.is_some() {
        "standby copy"
    } else {
        "etcd"
    };
    let (core, handle) = match load(store, cfg, preloaded, term, &mut backoff).await {
        Ok(Some(x)) => x,
        other => {
            *shared.loading.write().await = None;
            return other.map(|_| ());
        }
    };
    let registry = Registry::new(backend.clone(), keys.trainers());
    // Holders that are not registered right now lost their trainer during the failover.
    if let Ok((members, _)) = registry.list().await {
        handle
            .reconcile(members.into_iter().map(|m| m.id).collect())
            .await;
    }
    let follower = tokio::spawn(
        follow_trainers(registry, handle.clone(), cfg.reconcile_every, term.clone())
            .in_current_span(),
    );
    let restores = tokio::spawn(
        follow_restores(backend.clone(), keys.clone(), handle.clone(), term.clone())
            .in_current_span(),
    );
    let snapshots = cfg.snapshots.clone().map(|s| {
        let shared = shared.clone();
        let term = term.clone();
        tokio::spawn(
            async move { crate::snapshots::run(s, leader, &shared.snapshots, term).await }
                .in_current_span(),
        )
    });
    *shared.core.write().await = Some(handle);
    *shared.loading.write().await = None;
    tracing::info!(
        seconds = started.elapsed().as_secs_f64(),
        from,
        "serving the queue"
    );
    let result = core.run(term.clone()).await;
    term.cancel();
    let _ = follower.await;
    let _ = restores.await;
    if let Some(s) = snapshots {
        let _ = s.await;
    }
    result
}

/// Loads the queue, first from `preloaded` when given, then from etcd (retrying until it
/// loads or the term ends: `None`). Meanwhile calls are refused as `Loading`, and
/// clients wait.
async fn load(
    store: Store,
    cfg: &MasterConfig,
    mut preloaded: Option<Loaded>,
    term: &CancellationToken,
    backoff: &mut Backoff,
) -> Result<Option<(Core, CoreHandle)>, MasterError> {
    loop {
        let first = preloaded.take();
        match Core::start_from(store.clone(), cfg.queue.clone(), cfg.max_batch, first).await {
            Ok(x) => return Ok(Some(x)),
            Err(e @ MasterError::NotLeader { .. }) => return Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "loading the queue failed; retrying");
                backoff.wait(term).await;
                if term.is_cancelled() {
                    return Ok(None);
                }
            }
        }
    }
}

/// Retries until cancelled, from `initial` up to 2 s between attempts.
fn retry_forever(initial: Duration) -> RetryPolicy {
    RetryPolicy::forever().with_delays(initial, Duration::from_secs(2))
}
