//! The checkpoint protocol through etcd: when checkpoints are taken, the per-shard parts,
//! the [`Manifest`] once every shard of a step is written, retention, and restore. The
//! files themselves are [`super::dir`]'s.
//!
//! Protocol (keys under `/edl/<job>/checkpoints/`):
//!
//! 1. **When.** In sync mode with a step period, every shard snapshots right after
//!    applying each step that is a multiple of it: all shards pick the same steps without
//!    talking. Otherwise the holder of shard 0 is the coordinator: when its trigger fires
//!    (N updates or T elapsed) it writes `request` = a step label (fenced by its claim).
//!    Async shards snapshot as soon as they see it (each block copied under its lock,
//!    training goes on); sync shards snapshot right after applying that step (the label is
//!    two steps ahead of the coordinator, so no shard has applied it yet).
//! 2. **Write.** The snapshot is written in the background (temporary file, fsync,
//!    rename, directory fsync, crc32c); then `parts/<step>/<shard>` names it (fenced).
//! 3. **Commit.** Whoever writes the last part of a step commits, in one transaction
//!    guarded on every part and on `latest`: the manifest `<step>`, `latest` (if newer),
//!    and the removal of the parts. A writer whose part or commit fails on a transient
//!    etcd error tries again a few times; and the coordinator commits any step newer than
//!    the newest manifest whose parts have all stayed registered for a while without one
//!    (a commit lost all the same).
//! 4. **Retention.** After a commit, manifests beyond the newest `keep` are deleted; each
//!    shard then deletes its files older than the oldest manifest kept. A file is deleted
//!    only after a newer manifest is committed. While the leading master snapshots the
//!    job's etcd (`checkpoints/hold`) nothing is deleted, and no file a snapshot's pin
//!    names (`checkpoints/pins/`) is deleted while the pin lasts ([`retention`]).
//! 5. **Restore.** A pserver that claims index `i` reads the manifests newest first and
//!    restores the first whose file for `i` reads back intact (size, crc32c, uuid); a bad
//!    file is logged with the reason and the previous manifest is tried. It then writes
//!    `restores/<i>` ([`publish_restore`]): the tasks its state contains (the file's
//!    ledger), from which the master trains again what the state lacks.
//! 6. **Final checkpoint.** A pserver asked to stop writes its shard once more after it
//!    stopped serving and commits it alone ([`commit_solo`]): the newest manifest with
//!    its entry replaced, as the next step.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use edl_coord::{Backend, Compare, CompareOp, Fence, KeyValue, Op, Txn, fenced_txn};
use serde::{Deserialize, Serialize};

use super::dir::{CheckpointDir, ShardEntry};
use super::format::Snapshot;
use crate::error::PsError;
use edl_job::{JobKeys, Record, RestoreRecord};

pub use edl_job::launch::CheckpointEvery;

/// Checkpoint settings of a pserver.
#[derive(Debug, Clone)]
pub struct CheckpointConfig {
    /// Where files go: a local directory or an object URL (`s3://bucket/prefix`); a
    /// shard's files are under `<location>/<job>/ps-<index>/`.
    pub location: String,
    /// When.
    pub every: CheckpointEvery,
    /// Complete checkpoints kept.
    pub keep: usize,
    /// Write the shard once more when the pserver is asked to stop (default: yes).
    pub final_on_stop: bool,
}

impl CheckpointConfig {
    /// Checkpoints under `location` (a path or an object URL) every `every`, keeping 3.
    pub fn new(location: impl Into<String>, every: CheckpointEvery) -> Self {
        CheckpointConfig {
            location: location.into(),
            every,
            keep: 3,
            final_on_stop: true,
        }
    }
}

/// The coordinator's request (`checkpoints/request`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointRequest {
    /// The step label to checkpoint.
    pub step: u64,
    /// When it was requested (ms since the Unix epoch).
    pub at_ms: u64,
}

/// A checkpoint (`checkpoints/<step>` in etcd): one file per shard, all of the same step
/// when the shards took it together, or the previous manifest with one shard's newer
/// file (a pserver's final checkpoint). Which tasks' updates each file holds is in the
/// file itself (its ledger), so each shard restores from its own entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// The step.
    pub step: u64,
    /// The shard count.
    pub shards: u32,
    /// `sync` or `async`.
    pub mode: String,
    /// When the manifest was committed (ms since the Unix epoch).
    pub created_ms: u64,
    /// One entry per shard, by index (a shard that never wrote a file has none).
    pub entries: Vec<ShardEntry>,
}

impl Manifest {
    /// The entry of `shard`.
    pub fn entry(&self, shard: u32) -> Option<&ShardEntry> {
        self.entries.iter().find(|e| e.shard == shard)
    }
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The steps whose parts are registered for every shard of `shards`, oldest first, from a
/// listing of `checkpoints/`.
pub(crate) fn complete_parts<'a>(
    keys: &JobKeys,
    kvs: impl Iterator<Item = &'a KeyValue>,
    shards: u32,
) -> Vec<u64> {
    let prefix = keys.all_parts();
    let mut by_step: BTreeMap<u64, BTreeSet<u32>> = BTreeMap::new();
    for kv in kvs {
        let Some(rest) = kv.key.strip_prefix(&prefix) else {
            continue;
        };
        let mut it = rest.split('/');
        let (Some(step), Some(shard), None) = (
            it.next().and_then(|s| s.parse::<u64>().ok()),
            it.next().and_then(|s| s.parse::<u32>().ok()),
            it.next(),
        ) else {
            continue;
        };
        if shard < shards {
            by_step.entry(step).or_default().insert(shard);
        }
    }
    by_step
        .into_iter()
        .filter(|(_, got)| got.len() == shards as usize)
        .map(|(step, _)| step)
        .collect()
}

/// Every committed manifest, newest first (unparseable ones are skipped with a warning).
pub async fn manifests(backend: &dyn Backend, keys: &JobKeys) -> Result<Vec<Manifest>, PsError> {
    let (kvs, _) = backend.range(&keys.checkpoints()).await?;
    Ok(parse_manifests(keys, kvs.iter()))
}

pub(crate) fn parse_manifests<'a>(
    keys: &JobKeys,
    kvs: impl Iterator<Item = &'a KeyValue>,
) -> Vec<Manifest> {
    let mut out: Vec<Manifest> = kvs
        .filter(|kv| keys.manifest_step(&kv.key).is_some())
        .filter_map(|kv| match serde_json::from_slice::<Manifest>(&kv.value) {
            Ok(m) => Some(m),
            Err(e) => {
                tracing::warn!(key = %kv.key, error = %e, "unreadable checkpoint manifest ignored");
                None
            }
        })
        .collect();
    out.sort_by_key(|m| std::cmp::Reverse(m.step));
    out
}

/// Tells the master what the shard serves from now on (`restores/<shard>`, fenced by
/// the claim): the tasks its restored state contains (none when it starts over from
/// its initial values). Written before the shard serves, so that the master trains
/// again every acknowledged task the state lacks.
pub async fn publish_restore(
    backend: &dyn Backend,
    keys: &JobKeys,
    fence: &Fence,
    record: &RestoreRecord,
) -> Result<(), PsError> {
    fenced_txn(
        backend,
        fence,
        Txn::new().and_then([Op::put(keys.restore(record.shard), record.encode())]),
    )
    .await?;
    Ok(())
}

/// The newest checkpoint of `shard` that reads back intact and that `build` accepts,
/// with its manifest. A bad file (or one `build` refuses) is logged with the reason and
/// the previous checkpoint is tried.
pub async fn restore_latest<T>(
    backend: &dyn Backend,
    keys: &JobKeys,
    dir: &CheckpointDir,
    shard: u32,
    shards: u32,
    build: impl Fn(Snapshot) -> Result<T, PsError>,
) -> Result<Option<(Manifest, T)>, PsError> {
    let all = manifests(backend, keys).await?;
    let total = all.len();
    for (i, m) in all.into_iter().enumerate() {
        if m.shards != shards {
            tracing::warn!(
                step = m.step,
                manifest_shards = m.shards,
                shards,
                "checkpoint has another shard count; skipped"
            );
            continue;
        }
        let Some(entry) = m.entry(shard).cloned() else {
            tracing::warn!(
                step = m.step,
                shard,
                "checkpoint has no file for this shard; skipped"
            );
            continue;
        };
        let d = dir.clone();
        let read = tokio::task::spawn_blocking(move || d.read(&entry, shard, shards))
            .await
            .map_err(|e| PsError::Internal(format!("checkpoint reader failed: {e}")))?;
        match read.map_err(PsError::from).and_then(&build) {
            Ok(built) => {
                if i > 0 {
                    tracing::warn!(
                        step = m.step,
                        shard,
                        skipped = i,
                        "restored an older checkpoint after skipping unusable newer ones"
                    );
                }
                return Ok(Some((m, built)));
            }
            Err(e) => {
                let fallback = if i + 1 < total {
                    "falling back to the previous checkpoint"
                } else {
                    "no older checkpoint to fall back to"
                };
                tracing::error!(step = m.step, shard, error = %e, "checkpoint unusable; {fallback}");
            }
        }
    }
    Ok(None)
}

/// Names a written file as this shard's part of `step` (fenced by the shard's claim).
pub async fn register_part(
    backend: &dyn Backend,
    keys: &JobKeys,
    fence: &Fence,
    step: u64,
    entry: &ShardEntry,
) -> Result<(), PsError> {
    let value = serde_json::to_vec(entry)
        .map_err(|e| PsError::Config(format!("encode checkpoint part: {e}")))?;
    fenced_txn(
        backend,
        fence,
        Txn::new().and_then([Op::put(keys.part(step, entry.shard), value)]),
    )
    .await?;
    Ok(())
}

/// Commits the manifest of `step` if every shard's part is there. Returns whether this
/// call committed it.
pub async fn try_commit(
    backend: &dyn Backend,
    keys: &JobKeys,
    fence: &Fence,
    step: u64,
    shards: u32,
    mode: &str,
) -> Result<bool, PsError> {
    for _ in 0..5 {
        let (parts, _) = backend.range(&keys.parts(step)).await?;
        let mut entries: Vec<ShardEntry> = Vec::new();
        let mut compares = Vec::new();
        for kv in &parts {
            match serde_json::from_slice::<ShardEntry>(&kv.value) {
                Ok(e) if e.shard < shards && kv.key == keys.part(step, e.shard) => {
                    compares.push(Compare::mod_revision(
                        kv.key.clone(),
                        CompareOp::Equal,
                        kv.mod_revision,
                    ));
                    entries.push(e);
                }
                _ => tracing::warn!(key = %kv.key, "malformed checkpoint part ignored"),
            }
        }
        entries.sort_by_key(|e| e.shard);
        entries.dedup_by_key(|e| e.shard);
        if entries.len() < shards as usize {
            return Ok(false);
        }
        let latest = backend.get(&keys.latest()).await?;
        let latest_step = latest
            .as_ref()
            .and_then(|kv| {
                std::str::from_utf8(&kv.value)
                    .ok()?
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .unwrap_or(0);
        let manifest = Manifest {
            step,
            shards,
            mode: mode.to_owned(),
            created_ms: now_ms(),
            entries,
        };
        let value = serde_json::to_vec(&manifest)
            .map_err(|e| PsError::Config(format!("encode manifest: {e}")))?;
        compares.push(Compare::absent(keys.manifest(step)));
        compares.push(Compare::mod_revision(
            keys.latest(),
            CompareOp::Equal,
            latest.as_ref().map_or(0, |kv| kv.mod_revision),
        ));
        let mut ops = vec![
            Op::put(keys.manifest(step), value),
            Op::delete_prefix(keys.parts(step)),
        ];
        if step > latest_step {
            ops.push(Op::put(keys.latest(), step.to_string()));
        }
        let resp = fenced_txn(backend, fence, Txn::new().when(compares).and_then(ops)).await?;
        if resp.succeeded {
            tracing::info!(step, shards, "checkpoint manifest committed");
            return Ok(true);
        }
        if backend.get(&keys.manifest(step)).await?.is_some() {
            return Ok(false);
        }
        // A part or `latest` changed meanwhile: look again.
    }
    Ok(false)
}

/// The step label a shard's final checkpoint takes: one past the newest manifest.
pub async fn next_label(backend: &dyn Backend, keys: &JobKeys) -> Result<u64, PsError> {
    let newest = manifests(backend, keys)
        .await?
        .first()
        .map_or(0, |m| m.step);
    Ok(newest.max(requested_step(backend, keys).await?) + 1)
}

/// The step of the checkpoint round requested last (`checkpoints/request`), 0 when none.
async fn requested_step(backend: &dyn Backend, keys: &JobKeys) -> Result<u64, PsError> {
    Ok(backend
        .get(&keys.request())
        .await?
        .and_then(|kv| serde_json::from_slice::<CheckpointRequest>(&kv.value).ok())
        .map_or(0, |r| r.step))
}

/// Commits a checkpoint of one shard alone (a pserver's final checkpoint when it is
/// asked to stop): the newest manifest with this shard's file replaced by `entry`, as the
/// manifest of a step after it and after the round requested last, made `latest`. Shards
/// restore each from their own file (their ledgers say what each holds), so files of
/// different moments mix safely in one manifest. Its step is past the round in flight:
/// that round's part of this shard is older than this file, and a manifest of it
/// committed later must not be the newest (a restore would take the older part and
/// train again what this file holds). Returns the step committed, or `None` when
/// `latest` kept moving.
pub async fn commit_solo(
    backend: &dyn Backend,
    keys: &JobKeys,
    fence: &Fence,
    entry: &ShardEntry,
    shards: u32,
    mode: &str,
) -> Result<Option<u64>, PsError> {
    for _ in 0..5 {
        let latest = backend.get(&keys.latest()).await?;
        let newest = manifests(backend, keys).await?.into_iter().next();
        let requested = requested_step(backend, keys).await?;
        let step = newest.as_ref().map_or(0, |m| m.step).max(requested) + 1;
        let mut entries: Vec<ShardEntry> = newest
            .map(|m| m.entries)
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e.shard != entry.shard && e.shard < shards)
            .collect();
        entries.push(entry.clone());
        entries.sort_by_key(|e| e.shard);
        let manifest = Manifest {
            step,
            shards,
            mode: mode.to_owned(),
            created_ms: now_ms(),
            entries,
        };
        let value = serde_json::to_vec(&manifest)
            .map_err(|e| PsError::Config(format!("encode manifest: {e}")))?;
        let compares = vec![
            Compare::absent(keys.manifest(step)),
            Compare::mod_revision(
                keys.latest(),
                CompareOp::Equal,
                latest.as_ref().map_or(0, |kv| kv.mod_revision),
            ),
        ];
        let ops = vec![
            Op::put(keys.manifest(step), value),
            Op::put(keys.latest(), step.to_string()),
        ];
        let resp = fenced_txn(backend, fence, Txn::new().when(compares).and_then(ops)).await?;
        if resp.succeeded {
            tracing::info!(
                step,
                shard = entry.shard,
                "final checkpoint of the shard committed"
            );
            return Ok(Some(step));
        }
    }
    Ok(None)
}

/// Deletes manifests beyond the newest `keep`, and parts of steps older than the newest
/// manifest (abandoned rounds). Fenced by the caller's claim; nothing is deleted while
/// the master holds the manifests for an etcd snapshot (`checkpoints/hold`, checked in
/// the same transaction): the next commit prunes.
pub async fn prune(
    backend: &dyn Backend,
    keys: &JobKeys,
    fence: &Fence,
    keep: usize,
) -> Result<(), PsError> {
    let (kvs, _) = backend.range(&keys.checkpoints()).await?;
    let mut steps: Vec<u64> = kvs
        .iter()
        .filter_map(|kv| keys.manifest_step(&kv.key))
        .collect();
    steps.sort_unstable_by(|a, b| b.cmp(a));
    let newest = steps.first().copied().unwrap_or(0);
    let mut ops: Vec<Op> = steps
        .iter()
        .skip(keep.max(1))
        .map(|s| Op::delete(keys.manifest(*s)))
        .collect();
    let parts_prefix = keys.all_parts();
    let mut stale_parts: Vec<u64> = kvs
        .iter()
        .filter_map(|kv| {
            let rest = kv.key.strip_prefix(&parts_prefix)?;
            rest.split('/').next()?.parse::<u64>().ok()
        })
        .filter(|s| *s < newest)
        .collect();
    stale_parts.sort_unstable();
    stale_parts.dedup();
    ops.extend(
        stale_parts
            .iter()
            .map(|s| Op::delete_prefix(keys.parts(*s))),
    );
    for chunk in ops.chunks(100) {
        let txn = Txn::new()
            .when([Compare::absent(keys.checkpoint_hold())])
            .and_then(chunk.to_vec());
        if !fenced_txn(backend, fence, txn).await?.succeeded {
            tracing::debug!("checkpoint records held for an etcd snapshot; pruned later");
            return Ok(());
        }
    }
    if !ops.is_empty() {
        tracing::debug!(deleted = ops.len(), keep, "old checkpoint records pruned");
    }
    Ok(())
}

/// What a shard's files are kept for: the manifests its retention keeps, and those
/// pinned by etcd snapshots.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Retention {
    /// The newest `keep` manifests (every manifest while they are held for an etcd
    /// snapshot): files of their steps or newer are kept (newer ones may be parts of a
    /// round not committed yet), and every file they name.
    pub kept: Vec<Manifest>,
    /// The manifests etcd snapshots hold (`checkpoints/pins/`): every file they name
    /// is kept, so a job restored from one of those snapshots restores its shards.
    pub pinned: Vec<Manifest>,
}

/// The retention the records under `checkpoints/` ask for (the pserver follows them).
pub fn retention<'a>(
    keys: &JobKeys,
    kvs: impl Iterator<Item = &'a KeyValue> + Clone,
    keep: usize,
) -> Retention {
    let held = kvs.clone().any(|kv| kv.key == keys.checkpoint_hold());
    let manifests = parse_manifests(keys, kvs.clone());
    let kept = if held {
        manifests
    } else {
        manifests.into_iter().take(keep.max(1)).collect()
    };
    let pins = keys.checkpoint_pins();
    let mut pinned = Vec::new();
    for kv in kvs.filter(|kv| kv.key.starts_with(&pins)) {
        match edl_job::CheckpointPin::decode(&kv.value) {
            Ok(pin) => {
                for m in pin.manifests {
                    match serde_json::from_value::<Manifest>(m) {
                        Ok(m) => pinned.push(m),
                        Err(e) => {
                            tracing::warn!(key = %kv.key, error = %e, "unreadable manifest in a checkpoint pin ignored")
                        }
                    }
                }
            }
            Err(e) => {
                tracing::warn!(key = %kv.key, error = %e, "unreadable checkpoint pin ignored")
            }
        }
    }
    Retention { kept, pinned }
}

/// Deletes this shard's files of steps older than the oldest manifest kept (called
/// after the retention changes). Never deletes a file a kept or pinned manifest names.
pub fn prune_files(dir: &CheckpointDir, retention: &Retention, shard: u32) {
    let Some(oldest) = retention.kept.iter().map(|m| m.step).min() else {
        return;
    };
    let named: Vec<&str> = retention
        .kept
        .iter()
        .chain(&retention.pinned)
        .filter_map(|m| m.entry(shard))
        .map(|e| e.path.as_str())
        .collect();
    let files = match dir.files() {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(dir = %dir.location(), error = %e, "cannot list checkpoint files");
            return;
        }
    };
    for (step, name, path) in files {
        if step >= oldest
            || named
                .iter()
                .any(|n| Path::new(n).file_name() == Some(name.as_ref()))
        {
            continue;
        }
        match dir.remove(&name) {
            Ok(()) => tracing::debug!(shard, step, %path, "old checkpoint file deleted"),
            Err(e) => {
                tracing::warn!(shard, step, %path, error = %e, "cannot delete old checkpoint file")
            }
        }
    }
}

/// Writes the coordinator's request for `step` (fenced by shard 0's claim).
pub async fn request(
    backend: &dyn Backend,
    keys: &JobKeys,
    fence: &Fence,
    step: u64,
) -> Result<(), PsError> {
    let value = serde_json::to_vec(&CheckpointRequest {
        step,
        at_ms: now_ms(),
    })
    .map_err(|e| PsError::Config(format!("encode checkpoint request: {e}")))?;
    fenced_txn(
        backend,
        fence,
        Txn::new().and_then([Op::put(keys.request(), value)]),
    )
    .await?;
    tracing::debug!(step, "checkpoint requested");
    Ok(())
}

/// Writes a snapshot to `dir` on a blocking thread.
pub async fn write_snapshot(
    dir: &CheckpointDir,
    snap: Arc<Snapshot>,
) -> Result<ShardEntry, PsError> {
    let dir = dir.clone();
    tokio::task::spawn_blocking(move || dir.write(&snap))
        .await
        .map_err(|e| PsError::Config(format!("checkpoint writer panicked: {e}")))?
        .map_err(PsError::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The files a shard keeps: those of the newest `keep` manifests and newer, those a
    /// pin names (an etcd snapshot holds their manifests), and every manifest's while
    /// the manifests are held for a snapshot.
    #[test]
    fn pinned_and_held_checkpoints_keep_their_files() {
        use crate::checkpoint::format::tests::sample;
        let keys = JobKeys::new(&edl_job::JobName::new("j").unwrap());
        let root = tempfile::tempdir().unwrap();
        // The sample snapshots are shard 1's.
        let dir = CheckpointDir::new(root.path(), &edl_job::JobName::new("j").unwrap(), 1);
        let manifest = |step: u64| Manifest {
            step,
            shards: 1,
            mode: "sync".into(),
            created_ms: step,
            entries: vec![dir.write(&sample(step, 2, 2)).unwrap()],
        };
        let ms: Vec<Manifest> = [10, 20, 30, 40].map(manifest).to_vec();
        let kv = |key: String, value: Vec<u8>| KeyValue {
            key,
            value,
            create_revision: 1,
            mod_revision: 1,
            version: 1,
            lease: None,
        };
        let mut kvs: Vec<KeyValue> = ms
            .iter()
            .map(|m| kv(keys.manifest(m.step), serde_json::to_vec(m).unwrap()))
            .collect();
        let pin = edl_job::CheckpointPin {
            version: 1,
            manifests: vec![serde_json::to_value(&ms[0]).unwrap()],
        };
        kvs.push(kv(keys.checkpoint_pin("snapshot-a"), pin.encode()));
        let steps = |ms: &[Manifest]| ms.iter().map(|m| m.step).collect::<Vec<_>>();
        let files = || {
            let mut steps: Vec<u64> = dir.files().unwrap().into_iter().map(|f| f.0).collect();
            steps.sort_unstable();
            steps
        };

        // Held: every manifest is kept, and every file.
        let mut held = kvs.clone();
        held.push(kv(keys.checkpoint_hold(), Vec::new()));
        let r = retention(&keys, held.iter(), 2);
        assert_eq!(steps(&r.kept), [40, 30, 20, 10]);
        prune_files(&dir, &r, 1);
        assert_eq!(files(), [10, 20, 30, 40]);

        // Released: the newest two and the pinned one.
        let r = retention(&keys, kvs.iter(), 2);
        assert_eq!(steps(&r.kept), [40, 30]);
        assert_eq!(steps(&r.pinned), [10]);
        prune_files(&dir, &r, 1);
        assert_eq!(files(), [10, 30, 40]);

        // The pin gone: only the newest two.
        kvs.pop();
        let r = retention(&keys, kvs.iter(), 2);
        assert!(r.pinned.is_empty());
        prune_files(&dir, &r, 1);
        assert_eq!(files(), [30, 40]);
    }

    /// The manifests' records are not pruned while held for an etcd snapshot; they are
    /// once the hold is gone.
    #[tokio::test]
    async fn held_manifests_are_not_pruned() {
        use edl_coord::MemBackend;
        let backend = MemBackend::new();
        let keys = JobKeys::new(&edl_job::JobName::new("j").unwrap());
        let claim = keys.ps(0);
        let revision = backend.put(&claim, b"x".to_vec(), None).await.unwrap();
        let fence = Fence {
            key: claim,
            revision,
        };
        for step in [1u64, 2, 3] {
            backend
                .put(&keys.manifest(step), b"{}".to_vec(), None)
                .await
                .unwrap();
        }
        backend
            .put(&keys.checkpoint_hold(), Vec::new(), None)
            .await
            .unwrap();
        prune(&backend, &keys, &fence, 1).await.unwrap();
        let count = || async {
            let (kvs, _) = backend.range(&keys.checkpoints()).await.unwrap();
            kvs.iter()
                .filter(|kv| keys.manifest_step(&kv.key).is_some())
                .count()
        };
        assert_eq!(count().await, 3, "held: nothing pruned");
        backend.delete(&keys.checkpoint_hold()).await.unwrap();
        prune(&backend, &keys, &fence, 1).await.unwrap();
        assert_eq!(count().await, 1, "released: the newest one left");
    }

    #[test]
    fn complete_part_sets_are_found() {
        let keys = JobKeys::new(&edl_job::JobName::new("j").unwrap());
        let kv = |key: String| KeyValue {
            key,
            value: b"{}".to_vec(),
            create_revision: 1,
            mod_revision: 1,
            version: 1,
            lease: None,
        };
        let kvs = [
            kv(keys.part(4, 0)),
            kv(keys.part(4, 1)),
            kv(keys.part(6, 1)),
            kv(keys.part(8, 0)),
            kv(keys.part(8, 1)),
            kv(keys.part(8, 7)),
            kv(format!("{}9/x/y", keys.all_parts())),
            kv(keys.manifest(2)),
        ];
        assert_eq!(complete_parts(&keys, kvs.iter(), 2), vec![4, 8]);
        assert!(complete_parts(&keys, kvs.iter(), 3).is_empty());
    }

    /// A pserver's final checkpoint is committed past the round requested last: that
    /// round's part of this shard was written before the final file, so a manifest of
    /// it committed later must not be the newest (the shard restarted would restore the
    /// older part and the master train again what the final file holds).
    #[tokio::test]
    async fn a_final_checkpoint_is_committed_past_the_round_in_flight() {
        use edl_coord::{Backend, MemBackend};
        let backend = MemBackend::new();
        let keys = JobKeys::new(&edl_job::JobName::new("j").unwrap());
        let claim = keys.ps(1);
        let revision = backend.put(&claim, b"x".to_vec(), None).await.unwrap();
        let fence = Fence {
            key: claim,
            revision,
        };
        let entry = |shard: u32, path: &str| ShardEntry {
            shard,
            path: path.into(),
            size: 1,
            crc32c: 0,
            uuid: path.into(),
        };
        // A manifest of step 4; shard 0 asked for a round at step 90 (async: its update
        // count), whose parts are being written.
        let four = Manifest {
            step: 4,
            shards: 2,
            mode: "async".into(),
            created_ms: 0,
            entries: vec![entry(0, "a4"), entry(1, "b4")],
        };
        backend
            .put(&keys.manifest(4), serde_json::to_vec(&four).unwrap(), None)
            .await
            .unwrap();
        request(&backend, &keys, &fence, 90).await.unwrap();
        assert_eq!(next_label(&backend, &keys).await.unwrap(), 91);
        let step = commit_solo(&backend, &keys, &fence, &entry(1, "b-final"), 2, "async")
            .await
            .unwrap();
        assert_eq!(step, Some(91), "past the round in flight, not at 5");
        let newest = manifests(&backend, &keys).await.unwrap();
        assert_eq!(newest[0].step, 91);
        assert_eq!(newest[0].entry(1).unwrap().path, "b-final");
        // Witness: the other shard's entry is the newest manifest's.
        assert_eq!(newest[0].entry(0).unwrap().path, "a4");
    }
}
