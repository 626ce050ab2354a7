//! What a pserver process does for its shard, as its replica's role in the group gives
//! it (docs/replication.md); one replica or many, the same duties.
//!
//! While no replica that may hold an acknowledged op is alive (no group yet, or its
//! primary and in-sync backups all gone), the process claims `ps/<index>`, restores the
//! shard's checkpoint and proposes itself as the restorer. Otherwise it waits to be
//! recruited: the primary sends it a snapshot and the ops since (never with one replica
//! wanted). Whichever way it becomes primary, it then holds `ps/<index>` (where clients
//! find the primary), runs the checkpointer and settles the tasks the master failed for
//! good; a backup does neither (the primary's ops bring it everything).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use edl_coord::{Backend, Fence, IndexClaim, Lease, Op, Txn, fenced_txn};
use edl_job::{JobKeys, PserverRecord, Record};
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use super::driver::Replication;
use super::record::GroupStore;
use crate::checkpoint::CheckpointDir;
use crate::replica::Role;
use crate::server::checkpointer::Checkpointer;
use crate::server::claim::claim_fixed;
use crate::server::config::PsConfig;
use crate::server::failed::follow_failed;
use crate::server::restore::{Restore, restore_into};
use crate::shard::{CheckpointHooks, Shard};

/// How often the primary's duties look at the replica's role.
const DUTY_TICK: Duration = Duration::from_millis(100);

/// What a pserver process shares between its tasks.
pub(crate) struct Ctx {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) cfg: PsConfig,
    pub(crate) keys: JobKeys,
    pub(crate) index: u32,
    pub(crate) shards: u32,
    pub(crate) lease: Arc<Lease>,
    pub(crate) shard: Arc<Shard>,
    pub(crate) checkpoints: Arc<CheckpointHooks>,
    pub(crate) dir: Option<CheckpointDir>,
    pub(crate) rep: Arc<Replication>,
    pub(crate) store: Arc<GroupStore>,
    pub(crate) advertise: String,
    /// The claim `--index auto` took to choose the index: the first restore's, never
    /// given up before (another process would take the index).
    pub(crate) first_claim: Mutex<Option<IndexClaim>>,
}

/// The duties that follow the replica's role: restoring the shard when no replica that
/// may hold an acknowledged op lives; and while primary, holding `ps/<index>`,
/// checkpointing and settling failed tasks.
pub(crate) async fn duties(
    ctx: Arc<Ctx>,
    claim: Arc<Mutex<Option<IndexClaim>>>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(DUTY_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut roles = ctx.rep.roles();
    // The primary's background work, while it is primary.
    let mut primary_work: Option<CancellationToken> = None;
    loop {
        // A role's change is acted on at once (a new primary serves only once its duties
        // started); the tick retries what could not be done (a claim, a restore).
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tick.tick() => {}
            r = roles.changed() => if r.is_err() { break },
        }
        let role = ctx.rep.role();
        let held = crate::shard::lock(&claim).is_some();
        if role == Role::Primary && primary_work.is_none() {
            let fence = if held {
                crate::shard::lock(&claim).as_ref().map(|c| c.fence.clone())
            } else {
                take_claim(&ctx, &claim, &stop).await
            };
            if let Some(fence) = fence {
                primary_work = Some(start_primary_work(&ctx, fence, &stop));
                ctx.rep.duties_started();
            }
        } else if role != Role::Primary {
            if let Some(work) = primary_work.take() {
                work.cancel();
            }
            if held {
                release_claim(&ctx, &claim).await;
            }
            if role == Role::Outside && group_gone(&ctx).await {
                restore(&ctx, &claim, &stop).await;
            }
        }
    }
    if let Some(work) = primary_work {
        work.cancel();
    }
}

/// Whether no replica that may hold an acknowledged op lives (or no group exists).
async fn group_gone(ctx: &Ctx) -> bool {
    let Ok(record) = ctx.store.read().await else {
        return false;
    };
    let Some(r) = record else {
        return true;
    };
    // Until the members are listed, nobody is known to be gone. (This process's own key
    // is among them: a listing is never empty.)
    let Some(live) = ctx.rep.live_members() else {
        return false;
    };
    !live.contains(&r.primary) && r.backups.iter().all(|b| !live.contains(b))
}

/// Claims `ps/<index>` and publishes this process's address there; `None` when stopped
/// or when the replica stops being primary first.
async fn take_claim(
    ctx: &Ctx,
    claim: &Mutex<Option<IndexClaim>>,
    stop: &CancellationToken,
) -> Option<Fence> {
    let mut record = PserverRecord::of_this_process(ctx.advertise.clone(), crate::bulk::VERSION);
    let c = claim_fixed(
        &*ctx.backend,
        &ctx.keys,
        ctx.index,
        &record.encode(),
        &ctx.lease,
        stop,
    )
    .await
    .ok()?;
    record.claim_revision = c.fence.revision;
    let value = record.encode();
    let published = fenced_txn(
        &*ctx.backend,
        &c.fence,
        Txn::new().and_then([Op::put_with_lease(c.key(), value, ctx.lease.id())]),
    )
    .await;
    if let Err(e) = published {
        tracing::warn!(shard = ctx.index, error = %e, "claim not published; trying again");
    }
    tracing::info!(shard = ctx.index, claim_revision = c.fence.revision, addr = %ctx.advertise, "primary: shard claimed");
    let fence = c.fence.clone();
    *crate::shard::lock(claim) = Some(c);
    Some(fence)
}

/// Gives `ps/<index>` up (this replica is no longer primary).
async fn release_claim(ctx: &Ctx, claim: &Mutex<Option<IndexClaim>>) {
    let Some(c) = crate::shard::lock(claim).take() else {
        return;
    };
    let _ = fenced_txn(
        &*ctx.backend,
        &c.fence,
        Txn::new().and_then([Op::delete(c.key())]),
    )
    .await;
    tracing::info!(shard = ctx.index, "no longer primary: claim given up");
}

/// The primary's background work under its claim: checkpoints and failed tasks.
fn start_primary_work(ctx: &Arc<Ctx>, fence: Fence, stop: &CancellationToken) -> CancellationToken {
    let work = stop.child_token();
    tokio::spawn(
        follow_failed(
            ctx.backend.clone(),
            ctx.keys.clone(),
            ctx.shard.clone(),
            work.clone(),
        )
        .in_current_span(),
    );
    if let (Some(c), Some(dir)) = (ctx.cfg.checkpoint.clone(), ctx.dir.clone()) {
        tokio::spawn(
            Checkpointer {
                backend: ctx.backend.clone(),
                keys: ctx.keys.clone(),
                fence,
                shard: ctx.shard.clone(),
                dir,
                cfg: c,
                said_full: Default::default(),
            }
            .run(work.clone())
            .in_current_span(),
        );
    }
    work
}

/// Restores the shard (claim, checkpoint, restore record) and proposes this replica as
/// its restorer. A proposal that loses (another replica restored first) gives the claim
/// back: this process then joins as a backup.
async fn restore(ctx: &Arc<Ctx>, claim: &Mutex<Option<IndexClaim>>, stop: &CancellationToken) {
    // The claim `--index auto` took, if not used yet: it is this restore's.
    let first = crate::shard::lock(&ctx.first_claim).take();
    if let Some(c) = first {
        let fence = c.fence.clone();
        *crate::shard::lock(claim) = Some(c);
        return restore_under(ctx, claim, fence, stop).await;
    }
    // The claim waits while another process holds the index; a group that comes alive
    // meanwhile (a restore by another process) ends the wait.
    let alive = stop.child_token();
    let watcher = {
        let (ctx, alive) = (ctx.clone(), alive.clone());
        tokio::spawn(async move {
            while !alive.is_cancelled() {
                tokio::time::sleep(DUTY_TICK).await;
                if ctx.rep.role() != Role::Outside || !group_gone(&ctx).await {
                    alive.cancel();
                }
            }
        })
    };
    let fence = take_claim(ctx, claim, &alive).await;
    alive.cancel();
    let _ = watcher.await;
    let Some(fence) = fence else {
        return;
    };
    restore_under(ctx, claim, fence, stop).await;
}

/// Restores the shard under the claim `fence` (held in `claim`) and proposes this
/// replica as its restorer.
async fn restore_under(
    ctx: &Arc<Ctx>,
    claim: &Mutex<Option<IndexClaim>>,
    fence: Fence,
    stop: &CancellationToken,
) {
    ctx.shard.set_incarnation(fence.revision as u64);
    let restored = restore_into(Restore {
        backend: &ctx.backend,
        keys: &ctx.keys,
        dir: ctx.dir.as_ref(),
        shard: &ctx.shard,
        checkpoints: &ctx.checkpoints,
        fence: &fence,
        shards: ctx.shards,
        wait: ctx.cfg.etcd_wait,
        shutdown: stop,
    })
    .await;
    if let Err(e) = restored {
        tracing::error!(shard = ctx.index, error = %e, "restore failed; trying again");
        release_claim(ctx, claim).await;
        return;
    }
    ctx.rep.restore(fence.revision as u64);
    // The proposal settles within a few ticks: primary, or another restorer won.
    let mut roles = ctx.rep.roles();
    for _ in 0..100 {
        if ctx.rep.role() == Role::Primary || stop.is_cancelled() {
            return;
        }
        // Settled, and another replica's: it restored first.
        if !ctx.rep.proposing() && ctx.rep.record().is_some_and(|r| r.primary != ctx.rep.me()) {
            break;
        }
        let _ = tokio::time::timeout(DUTY_TICK, roles.changed()).await;
    }
    if ctx.rep.role() != Role::Primary {
        tracing::info!(
            shard = ctx.index,
            "another replica restored the shard; joining it"
        );
        ctx.shard.uninstall();
        release_claim(ctx, claim).await;
    }
}
