//! A shard restored into this process: from its newest checkpoint (or left for a trainer
//! to initialise), with the tasks the master failed for good settled in it, and what it
//! holds published (`restores/<index>`) for the master, fenced by the claim it was
//! restored under.

use std::sync::Arc;

use edl_coord::{Backend, Fence, retry_startup};
use edl_job::{JobKeys, RestoreRecord};
use tokio_util::sync::CancellationToken;

use crate::checkpoint::CheckpointDir;
use crate::checkpoint::protocol;
use crate::error::PsError;
use crate::shard::{CheckpointHooks, Shard, ShardCore};

/// What a restore needs.
pub(super) struct Restore<'a> {
    pub(super) backend: &'a Arc<dyn Backend>,
    pub(super) keys: &'a JobKeys,
    pub(super) dir: Option<&'a CheckpointDir>,
    pub(super) shard: &'a Arc<Shard>,
    pub(super) checkpoints: &'a Arc<CheckpointHooks>,
    /// The claim the shard is restored under: its revision is the new incarnation.
    pub(super) fence: &'a Fence,
    pub(super) shards: u32,
    pub(super) wait: std::time::Duration,
    pub(super) shutdown: &'a CancellationToken,
}

/// Restores the shard's latest checkpoint into `shard` (or leaves it for a trainer to
/// initialise), settles the tasks failed for good in it, and publishes what it holds
/// (`restores/<index>`) for the master, fenced by the claim.
pub(super) async fn restore_into(r: Restore<'_>) -> Result<(), PsError> {
    let Restore {
        backend,
        keys,
        dir,
        shard,
        checkpoints,
        fence,
        shards,
        wait,
        shutdown,
    } = r;
    let index = shard.index();
    if let Some(dir) = dir {
        let d = dir.clone();
        let _ = tokio::task::spawn_blocking(move || d.remove_temporaries()).await;
        let incarnation = fence.revision as u64;
        let build = |snap| ShardCore::restore(snap, incarnation, (*checkpoints).clone());
        let restored = retry_startup("restore the checkpoint", wait, shutdown, || async {
            match protocol::restore_latest(&**backend, keys, dir, index, shards, build).await {
                Ok(r) => Ok(Ok(r)),
                Err(PsError::Coord(e)) => Err(e),
                Err(e) => Ok(Err(e)),
            }
        })
        .await??;
        match restored {
            Some((manifest, core)) => {
                let step = core.restored_from();
                checkpoints
                    .last_written
                    .store(step, std::sync::atomic::Ordering::Relaxed);
                shard.install(core);
                tracing::info!(
                    shard = index,
                    step,
                    manifest_step = manifest.step,
                    "restored from checkpoint"
                );
            }
            None => tracing::info!(
                shard = index,
                "no checkpoint to restore; waiting for a trainer to initialise the parameters"
            ),
        }
    }
    // The tasks failed for good are settled in what it holds (the checkpoint may predate
    // some of their records).
    let failed_prefix = keys.failed();
    let (failed, _) = retry_startup("read the failed tasks", wait, shutdown, || {
        backend.range(&failed_prefix)
    })
    .await?;
    shard.settle(edl_job::records::decode_readable(&failed));
    // What this incarnation holds, for the master: the restored ledger, or nothing (a
    // trainer initialises the shard from the initial values). On a job's first start
    // nothing was trained, and the record changes nothing.
    let restored = shard.core().ok();
    let record = RestoreRecord {
        version: edl_job::RECORD_VERSION,
        shard: index,
        incarnation: fence.revision as u64,
        step: restored.as_ref().map_or(0, |c| c.restored_from()),
        contains: restored.map(|c| c.contains()).unwrap_or_default(),
        at_ms: protocol::now_ms(),
    };
    retry_startup("publish the restore", wait, shutdown, || async {
        match protocol::publish_restore(&**backend, keys, fence, &record).await {
            Ok(()) => Ok(Ok(())),
            Err(PsError::Coord(e)) => Err(e),
            Err(e) => Ok(Err(e)),
        }
    })
    .await??;

    Ok(())
}
