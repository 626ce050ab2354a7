//! A pserver process holding a replica of a shard (`PsConfig::replicas` > 1;
//! docs/replication.md).
//!
//! The process registers itself (`ps-member/<id>`, under its lease) and starts its
//! replica. While no replica that may hold an acknowledged op is alive (no group yet, or
//! its primary and in-sync backups all gone), it claims `ps/<index>`, restores the
//! shard's checkpoint as today and proposes itself as the restorer. Otherwise it waits
//! to be recruited: the primary sends it a snapshot and the ops since. Whichever way it
//! becomes primary, it then holds `ps/<index>` (where clients find the primary), runs
//! the checkpointer and settles the tasks the master failed for good; a backup does
//! neither (the primary's ops bring it everything).

use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, Fence, IndexClaim, Lease, Op, Registry, Txn, fenced_txn, retry_startup};
use edl_job::{JobKeys, MemberRecord, PserverRecord, Record};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use super::checkpointer::Checkpointer;
use super::claim::claim_fixed;
use super::config::PsConfig;
use super::failed::follow_failed;
use super::group::GroupStore;
use super::membership::{Members, follow_trainers};
use super::replication::{Links, Replication, Upstream};
use super::run::{Restore, Serving, Started, restore_into, start_serving};
use crate::checkpoint::protocol;
use crate::checkpoint::{CheckpointDir, CheckpointEvery};
use crate::error::PsError;
use crate::replica::{ReplicaConfig, Role};
use crate::shard::{CheckpointHooks, Shard};

/// How often the primary's duties look at the replica's role.
const DUTY_TICK: Duration = Duration::from_millis(100);

/// What a replicated process shares between its tasks.
struct Ctx {
    backend: Arc<dyn Backend>,
    cfg: PsConfig,
    keys: JobKeys,
    index: u32,
    shards: u32,
    lease: Arc<Lease>,
    shard: Arc<Shard>,
    checkpoints: Arc<CheckpointHooks>,
    dir: Option<CheckpointDir>,
    rep: Arc<Replication>,
    store: Arc<GroupStore>,
    advertise: String,
}

/// Runs a replica of shard `index` of `shards` on `listener` until `shutdown` fires or
/// the lease is lost (see [`run`](super::run)).
pub(super) async fn run_replicated(
    backend: Arc<dyn Backend>,
    cfg: PsConfig,
    listener: TcpListener,
    shutdown: CancellationToken,
    lease: Arc<Lease>,
    (index, shards): (u32, u32),
    advertise: String,
) -> Result<(), PsError> {
    let keys = JobKeys::new(&cfg.job);
    let wait = cfg.etcd_wait;
    let me = super::replication::member_id(index);
    let store = Arc::new(GroupStore::new(backend.clone(), keys.clone(), index));
    let member = MemberRecord {
        version: edl_job::RECORD_VERSION,
        addr: advertise.clone(),
        pid: std::process::id(),
        started_ms: protocol::now_ms(),
    };
    retry_startup("register the replica", wait, &shutdown, || {
        store.register(&me, &member, &lease)
    })
    .await?;
    let sync_every = match cfg.checkpoint.as_ref().map(|c| c.every) {
        Some(CheckpointEvery::Steps(n)) => Some(n),
        _ => None,
    };
    let checkpoints = Arc::new(CheckpointHooks {
        every_steps: sync_every,
        ..Default::default()
    });
    let shard = Arc::new(Shard::new(index, shards, 0, checkpoints.clone()));
    let stop = shutdown.child_token();
    let rep = Replication::start(
        me.clone(),
        shard.clone(),
        store.clone(),
        lease.clone(),
        Links {
            replica: ReplicaConfig {
                replicas: cfg.replicas,
                ..ReplicaConfig::default()
            },
            upstream: Upstream {
                job: cfg.job.to_string(),
                token: cfg.token.clone(),
                tls: cfg.peer_tls.clone(),
            },
            stall: cfg.io_timeout,
        },
        stop.clone(),
    );
    tracing::info!(job = %cfg.job, shard = index, member = %me, replicas = cfg.replicas, "replica started");

    let members = Arc::new(Members::default());
    let registry = Registry::new(backend.clone(), keys.trainers());
    let (listed, _) =
        retry_startup("list the trainers", wait, &shutdown, || registry.list()).await?;
    members
        .set
        .write()
        .await
        .extend(listed.into_iter().map(|m| m.id));
    let Started {
        acceptor,
        mut server,
    } = start_serving(
        Serving {
            backend: backend.clone(),
            cfg: &cfg,
            keys: keys.clone(),
            lease: lease.clone(),
            shard: shard.clone(),
            members: members.clone(),
            claim_revision: 0,
            replication: Some(rep.clone()),
        },
        listener,
        stop.clone(),
    )?;
    tracing::info!(job = %cfg.job, shard = index, addr = %advertise, "pserver serving");
    let dir = cfg
        .checkpoint
        .as_ref()
        .map(|c| CheckpointDir::open(&c.location, &cfg.job, index))
        .transpose()?;
    let ctx = Arc::new(Ctx {
        backend: backend.clone(),
        cfg: cfg.clone(),
        keys: keys.clone(),
        index,
        shards,
        lease: lease.clone(),
        shard: shard.clone(),
        checkpoints,
        dir,
        rep,
        store,
        advertise,
    });
    let claim = Arc::new(std::sync::Mutex::new(None::<IndexClaim>));
    let tasks = vec![
        acceptor,
        tokio::spawn(
            follow_trainers(
                backend.clone(),
                keys.clone(),
                shard.clone(),
                members,
                stop.clone(),
            )
            .in_current_span(),
        ),
        tokio::spawn(duties(ctx.clone(), claim.clone(), stop.clone()).in_current_span()),
    ];
    let lost = lease.lost();
    let broken = ctx.rep.failed().clone();
    let result = tokio::select! {
        biased;
        _ = shutdown.cancelled() => Ok(()),
        _ = broken.cancelled() => Err(PsError::Internal(format!(
            "shard {index}: this replica's copy broke (see the log); restart the process: \
             it joins again as a new member"
        ))),
        _ = lost.cancelled() => {
            tracing::error!(job = %cfg.job, shard = index, "etcd lease lost; stopped serving (another replica may be primary now)");
            Err(PsError::LeaseLost(index))
        }
        r = &mut server => Err(PsError::Config(format!("grpc server ended: {r:?}"))),
    };
    super::run::wind_down(&stop, server, tasks).await;
    let held = crate::shard::lock(&claim).take();
    if result.is_ok()
        && let Some(held) = held
        && ctx.cfg.checkpoint.as_ref().is_some_and(|c| c.final_on_stop)
        && let Some(dir) = &ctx.dir
        && let Ok(core) = ctx.shard.core()
    {
        super::run::final_checkpoint(&*backend, &keys, &held.fence, dir, core).await;
    }
    if result.is_ok() {
        // The member key and any claim go at once: a backup is promoted without waiting
        // out the TTL.
        super::run::stopped(&lease, index).await;
    }
    result
}

/// The duties that follow the replica's role: restoring the shard when no replica that
/// may hold an acknowledged op lives; and while primary, holding `ps/<index>`,
/// checkpointing and settling failed tasks.
async fn duties(
    ctx: Arc<Ctx>,
    claim: Arc<std::sync::Mutex<Option<IndexClaim>>>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(DUTY_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The primary's background work, while it is primary.
    let mut primary_work: Option<CancellationToken> = None;
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tick.tick() => {}
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
    claim: &std::sync::Mutex<Option<IndexClaim>>,
    stop: &CancellationToken,
) -> Option<Fence> {
    let mut record = PserverRecord {
        bulk: crate::bulk::VERSION,
        pid: std::process::id(),
        started_ms: protocol::now_ms(),
        ..PserverRecord::at(ctx.advertise.clone())
    };
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
async fn release_claim(ctx: &Ctx, claim: &std::sync::Mutex<Option<IndexClaim>>) {
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
async fn restore(
    ctx: &Arc<Ctx>,
    claim: &std::sync::Mutex<Option<IndexClaim>>,
    stop: &CancellationToken,
) {
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
    for _ in 0..100 {
        tokio::time::sleep(DUTY_TICK).await;
        if ctx.rep.role() == Role::Primary || stop.is_cancelled() {
            return;
        }
        if ctx.rep.record().is_some_and(|r| r.primary != ctx.rep.me()) {
            break;
        }
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
