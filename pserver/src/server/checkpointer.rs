//! The background checkpoint writer of one shard, and on shard 0 the coordinator (see
//! [`crate::checkpoint::protocol`] for the protocol): it writes the snapshots the shard
//! offers (sync mode) or takes when a checkpoint is requested (async mode), records each
//! file as the shard's part of its step and commits the step once every part is there,
//! prunes old files, and on shard 0 requests checkpoints and commits steps whose last
//! writer's commit was lost.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use edl_coord::{Backend, Backoff, Fence, RetryPolicy, follow_prefix};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::checkpoint::protocol::{self, CheckpointConfig, CheckpointEvery, CheckpointRequest};
use crate::checkpoint::{CheckpointDir, ShardEntry, Snapshot};
use crate::error::PsError;
use crate::shard::Shard;
use edl_job::JobKeys;

/// Attempts to record a checkpoint part and commit its step, on transient etcd errors.
const COMMIT_ATTEMPTS: u32 = 8;
/// How long the coordinator leaves a complete set of parts to its last writer before
/// committing it itself (that writer's commit was lost).
const COMMIT_GRACE: Duration = Duration::from_secs(2);

/// The background checkpoint writer of one shard (and the coordinator on shard 0).
pub(super) struct Checkpointer {
    pub(super) backend: Arc<dyn Backend>,
    pub(super) keys: JobKeys,
    pub(super) fence: Fence,
    pub(super) shard: Arc<Shard>,
    pub(super) dir: CheckpointDir,
    pub(super) cfg: CheckpointConfig,
    /// etcd refused a record for lack of space, and the log said so (once until a
    /// record fits again).
    pub(super) said_full: std::sync::atomic::AtomicBool,
}

impl Checkpointer {
    pub(super) async fn run(self, stop: CancellationToken) {
        let mut view = follow_prefix(
            self.backend.clone(),
            self.keys.checkpoints(),
            stop.child_token(),
        );
        let slot = self.shard.checkpoints().slot.clone();
        let mut handled = 0u64;
        let mut retained = protocol::Retention::default();
        let mut newest_manifest = 0u64;
        // Coordinator state (shard 0).
        let mut requested_step = 0u64;
        let mut requested_at = Instant::now();
        let mut requested_updates = 0u64;
        // Coordinator: complete sets of parts without a manifest, and since when.
        let mut uncommitted: BTreeMap<u64, Instant> = BTreeMap::new();
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = slot.wait() => {
                    if let Some(snap) = slot.take() {
                        self.write(snap, &stop).await;
                    }
                }
                r = view.changed() => {
                    if r.is_err() {
                        break;
                    }
                    let v = view.borrow_and_update().clone();
                    if v.revision == 0 {
                        continue;
                    }
                    newest_manifest = protocol::parse_manifests(&self.keys, v.kvs.values())
                        .first()
                        .map_or(0, |m| m.step);
                    if self.shard.index() == 0 {
                        let complete =
                            protocol::complete_parts(&self.keys, v.kvs.values(), self.shard.shards());
                        let now = Instant::now();
                        uncommitted.retain(|s, _| complete.contains(s));
                        for s in complete.into_iter().filter(|s| *s > newest_manifest) {
                            uncommitted.entry(s).or_insert(now);
                        }
                    }
                    let retention = protocol::retention(&self.keys, v.kvs.values(), self.cfg.keep);
                    if retention != retained {
                        retained = retention.clone();
                        let dir = self.dir.clone();
                        let index = self.shard.index();
                        let _ = tokio::task::spawn_blocking(move || protocol::prune_files(&dir, &retention, index)).await;
                    }
                    let req = v
                        .kvs
                        .get(&self.keys.request())
                        .and_then(|kv| serde_json::from_slice::<CheckpointRequest>(&kv.value).ok());
                    if let Some(req) = req {
                        requested_step = requested_step.max(req.step);
                        if req.step > handled && req.step > newest_manifest {
                            handled = req.step;
                            self.handle_request(req.step, &stop).await;
                        }
                    }
                }
                _ = tick.tick(), if self.shard.index() == 0 => {
                    let Ok(core) = self.shard.core() else { continue };
                    self.commit_lost(&mut uncommitted, newest_manifest, core.spec().config.mode.name())
                        .await;
                    let updates = core.updates();
                    let due = match self.cfg.every {
                        CheckpointEvery::Steps(_) if core.is_sync() => false,
                        CheckpointEvery::Steps(n) => updates >= requested_updates + n,
                        CheckpointEvery::Interval(t) => {
                            requested_at.elapsed() >= t && updates != requested_updates
                        }
                    };
                    if !due {
                        continue;
                    }
                    let step = if core.is_sync() {
                        core.next_step() + 2
                    } else {
                        updates
                    }
                    .max(requested_step + 1)
                    .max(newest_manifest + 1);
                    match protocol::request(&*self.backend, &self.keys, &self.fence, step).await {
                        Ok(()) => {
                            requested_step = step;
                            requested_at = Instant::now();
                            requested_updates = updates;
                        }
                        Err(e) => tracing::warn!(step, error = %e, "checkpoint request failed"),
                    }
                }
            }
        }
    }

    async fn handle_request(&self, step: u64, stop: &CancellationToken) {
        let Ok(core) = self.shard.core() else {
            tracing::debug!(step, "checkpoint requested before initialisation; skipped");
            return;
        };
        if core.is_sync() {
            if core.last_closed() >= step {
                tracing::warn!(
                    shard = self.shard.index(),
                    step,
                    last = core.last_closed(),
                    "requested checkpoint step already applied here; skipping this round"
                );
                return;
            }
            self.shard
                .checkpoints()
                .target
                .store(step, std::sync::atomic::Ordering::Release);
            return;
        }
        let snap = tokio::task::spawn_blocking(move || core.snapshot(step)).await;
        match snap {
            Ok(s) => self.write(s, stop).await,
            Err(e) => tracing::error!(step, error = %e, "snapshot failed"),
        }
    }

    /// Coordinator: commits the steps of `uncommitted` newer than the newest manifest
    /// whose parts have waited [`COMMIT_GRACE`] for their last writer's commit.
    async fn commit_lost(
        &self,
        uncommitted: &mut BTreeMap<u64, Instant>,
        newest_manifest: u64,
        mode: &str,
    ) {
        uncommitted.retain(|s, _| *s > newest_manifest);
        let due: Vec<u64> = uncommitted
            .iter()
            .filter(|(_, since)| since.elapsed() >= COMMIT_GRACE)
            .map(|(s, _)| *s)
            .collect();
        for step in due {
            let shards = self.shard.shards();
            match protocol::try_commit(&*self.backend, &self.keys, &self.fence, step, shards, mode)
                .await
            {
                Ok(committed) => {
                    uncommitted.remove(&step);
                    if committed {
                        tracing::warn!(step, "committed a checkpoint its last writer did not");
                        if let Err(e) =
                            protocol::prune(&*self.backend, &self.keys, &self.fence, self.cfg.keep)
                                .await
                        {
                            tracing::warn!(error = %e, "checkpoint pruning failed");
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(step, error = %e, "checkpoint commit failed; trying again later");
                    uncommitted.insert(step, Instant::now());
                }
            }
        }
    }

    /// Records this shard's part of `step` and commits the step if every part is there,
    /// trying again on transient etcd errors (at most [`COMMIT_ATTEMPTS`] times, until
    /// `stop`).
    async fn record(&self, step: u64, entry: &ShardEntry, mode: &str, stop: &CancellationToken) {
        let shard = self.shard.index();
        let mut backoff = Backoff::new(
            RetryPolicy::forever().with_delays(Duration::from_millis(50), Duration::from_secs(2)),
        );
        for attempt in 1..=COMMIT_ATTEMPTS {
            let commit = async {
                protocol::register_part(&*self.backend, &self.keys, &self.fence, step, entry)
                    .await?;
                let committed = protocol::try_commit(
                    &*self.backend,
                    &self.keys,
                    &self.fence,
                    step,
                    self.shard.shards(),
                    mode,
                )
                .await?;
                if committed {
                    protocol::prune(&*self.backend, &self.keys, &self.fence, self.cfg.keep).await?;
                }
                Ok::<_, PsError>(())
            };
            match commit.await {
                Ok(()) => {
                    if self.said_full.swap(false, Ordering::Relaxed) {
                        tracing::info!(
                            shard,
                            step,
                            "etcd has space again: checkpoints are recorded"
                        );
                    }
                    return;
                }
                // A full etcd: the next checkpoint tries again (the files are on disk;
                // the last recorded checkpoint stays the one to restore).
                Err(PsError::Coord(e)) if e.is_no_space() => {
                    if !self.said_full.swap(true, Ordering::Relaxed) {
                        tracing::error!(shard, step, error = %e, "checkpoints are not recorded until etcd has space");
                    }
                    return;
                }
                Err(e) if e.is_retryable() && attempt < COMMIT_ATTEMPTS => {
                    tracing::warn!(shard, step, attempt, error = %e, "checkpoint part not recorded in etcd; retrying");
                    if !backoff.wait(stop).await {
                        return;
                    }
                }
                Err(e) => {
                    tracing::error!(shard, step, error = %e, "checkpoint part not recorded in etcd");
                    return;
                }
            }
        }
    }

    async fn write(&self, snap: Snapshot, stop: &CancellationToken) {
        let step = snap.step;
        let shard = self.shard.index();
        let counters = self.shard.core().ok();
        let started = Instant::now();
        let entry = match protocol::write_snapshot(&self.dir, Arc::new(snap)).await {
            Ok(e) => e,
            Err(e) => {
                if let Some(c) = &counters {
                    c.counters
                        .checkpoints_failed
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                tracing::error!(shard, step, error = %e, "checkpoint write failed; the previous checkpoint stays valid");
                return;
            }
        };
        tracing::info!(shard, step, path = %entry.path, bytes = entry.size, took = ?started.elapsed(), "checkpoint file written");
        if let Some(c) = &counters {
            c.counters
                .checkpoints_written
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        self.shard
            .checkpoints()
            .last_written
            .fetch_max(step, std::sync::atomic::Ordering::Relaxed);
        let mode = counters
            .as_ref()
            .map_or("async", |c| c.spec().config.mode.name());
        self.record(step, &entry, mode, stop).await;
    }
}
