//! Periodic snapshots of the job's own etcd (the operator's managed etcd), taken by the
//! leading master into a folder of the job's storage (its object store), so that an
//! etcd that lost its quorum with its data can be restored (docs/kubernetes.md, "Restoring
//! the managed etcd").
//!
//! A snapshot is a member's whole database as `etcdctl snapshot save` writes it
//! ([`edl_coord::EtcdSnapshot`]: the data, then its SHA-256), named
//! `snapshot-<unix ms, 13 digits>-r<revision>.db`, so names sort by time. It is written
//! in parts and appears only once every byte arrived and the hash matched: a snapshot
//! cut short (a member lost, the leader deposed, a store that fails) leaves nothing.
//! After each snapshot the oldest are deleted until `keep` are left; files of other names
//! in the folder are never touched.
//!
//! The schedule ([`due`], pure: time is an argument): one snapshot every `every`, counted
//! from the newest in the folder, so a new leader does not take one at once when its
//! predecessor just did; after a failure, again in [`RETRY`] (or `every`, if shorter).
//! Taking one needs an etcd user with the `root` role; only the leader takes them.
//!
//! Each snapshot pins the checkpoints it names ([`edl_job::CheckpointPin`]): a job
//! restored from it restores its shards from those checkpoints, which the pservers'
//! retention would otherwise delete within seconds (the restored job would then start
//! over). The leader holds the manifests (`checkpoints/hold`, on its lease: the pservers
//! delete no manifest and no file a manifest names meanwhile), takes the snapshot, and
//! in one fenced transaction writes the pin (every manifest stored now: those the
//! snapshot holds and any committed since) and releases the hold. A snapshot whose pin
//! cannot be written is deleted; a pin goes with its snapshot.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use edl_coord::{Backend, Compare, EtcdBackend, Fence, LeaseId, Op, Txn, fenced_txn};
use edl_job::{CheckpointPin, JobKeys, RECORD_VERSION, Record};
use edl_storage::Store;
use tokio_util::sync::CancellationToken;

/// Wait after a failed snapshot before the next try (or `every`, if shorter).
pub const RETRY: Duration = Duration::from_secs(30);

/// Where and how often a leading master snapshots the job's etcd.
#[derive(Clone, Debug)]
pub struct SnapshotConfig {
    /// The job's etcd, connected as a user with the `root` role.
    pub etcd: EtcdBackend,
    /// The store the snapshots go to ...
    pub store: Store,
    /// ... and their folder in it (a key prefix, without a trailing `/`).
    pub folder: String,
    /// One snapshot every this long.
    pub every: Duration,
    /// Snapshots kept (at least 1).
    pub keep: usize,
}

/// How one leader term writes the job's records about its snapshots (the hold and the
/// pins): through the master's own connection, fenced by its election key, the hold on
/// its lease.
#[derive(Clone)]
pub struct Term {
    /// The master's connection to the job's etcd.
    pub backend: Arc<dyn Backend>,
    /// The job's keys.
    pub keys: JobKeys,
    /// The leader's election key.
    pub fence: Fence,
    /// The leader's lease.
    pub lease: LeaseId,
}

impl std::fmt::Debug for Term {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Term")
            .field("keys", &self.keys)
            .field("fence", &self.fence)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

/// What the snapshots did, for `/metrics`.
#[derive(Debug, Default)]
pub struct SnapshotStats {
    /// Snapshots written whole.
    pub taken: AtomicU64,
    /// Attempts that failed (nothing written).
    pub failed: AtomicU64,
    /// When the newest snapshot this master wrote was taken (unix seconds; 0: none).
    pub last_unix_seconds: AtomicU64,
    /// Its size in bytes.
    pub last_bytes: AtomicU64,
}

/// The name of a snapshot taken at `at` of an etcd at `revision`.
pub fn name_of(at: SystemTime, revision: i64) -> String {
    let ms = at
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    format!("snapshot-{ms:013}-r{revision}.db")
}

/// When the snapshot named `name` was taken, if it is a snapshot's name.
pub fn taken_at(name: &str) -> Option<SystemTime> {
    let rest = name.strip_prefix("snapshot-")?.strip_suffix(".db")?;
    let (ms, revision) = rest.split_once("-r")?;
    if ms.len() != 13 || revision.parse::<i64>().is_err() {
        return None;
    }
    let ms: u64 = ms.parse().ok()?;
    Some(UNIX_EPOCH + Duration::from_millis(ms))
}

/// Of the files `names` in the folder, the snapshots to delete so that the newest `keep`
/// are left; other files are never among them.
pub fn to_delete<'a>(names: &[&'a str], keep: usize) -> Vec<&'a str> {
    let mut snapshots: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| taken_at(n).is_some())
        .collect();
    snapshots.sort_unstable();
    let excess = snapshots.len().saturating_sub(keep.max(1));
    snapshots.truncate(excess);
    snapshots
}

/// When the next snapshot is due, given the newest one (`None`: none yet, due at
/// once) and whether the last attempt failed at `failed_at`.
pub fn due(
    newest: Option<SystemTime>,
    failed_at: Option<SystemTime>,
    every: Duration,
) -> Option<SystemTime> {
    let after_newest = newest.map(|t| t + every);
    let after_failure = failed_at.map(|t| t + RETRY.min(every));
    match (after_newest, after_failure) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// Takes snapshots while `term` lasts (one leader term).
pub async fn run(
    cfg: SnapshotConfig,
    leader: Term,
    stats: &SnapshotStats,
    term: CancellationToken,
) {
    let (store, folder) = (&cfg.store, cfg.folder.trim_end_matches('/'));
    let mut newest = match newest_in(store, folder).await {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!(error = %e, "etcd snapshots: cannot list their folder; taking one now");
            None
        }
    };
    let mut failed_at = None;
    let mut last_failure: Option<String> = None;
    loop {
        let wait = due(newest, failed_at, cfg.every)
            .and_then(|t| t.duration_since(SystemTime::now()).ok())
            .unwrap_or_default();
        tokio::select! {
            _ = term.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        let at = SystemTime::now();
        match take_pinned(&cfg.etcd, &leader, store, folder, at, &term).await {
            Err(SnapshotError::Cancelled) => return,
            Ok((name, bytes)) => {
                tracing::info!(snapshot = %store.url(&key(folder, &name)), bytes, "etcd snapshot taken");
                stats.taken.fetch_add(1, Ordering::Relaxed);
                stats.last_bytes.store(bytes, Ordering::Relaxed);
                stats.last_unix_seconds.store(
                    at.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs(),
                    Ordering::Relaxed,
                );
                newest = Some(at);
                failed_at = None;
                last_failure = None;
                if let Err(e) = prune(&leader, store, folder, cfg.keep).await {
                    tracing::warn!(error = %e, "etcd snapshots: cannot delete the oldest");
                }
            }
            Err(e) => {
                // Said once while it fails the same way.
                let said = e.to_string();
                if last_failure.as_deref() != Some(said.as_str()) {
                    tracing::warn!(error = %said, "etcd snapshot failed; trying again every {:?} while it fails", RETRY.min(cfg.every));
                    last_failure = Some(said);
                } else {
                    tracing::debug!(error = %said, "etcd snapshot failed again");
                }
                stats.failed.fetch_add(1, Ordering::Relaxed);
                failed_at = Some(at);
            }
        }
    }
}

fn key(folder: &str, name: &str) -> String {
    if folder.is_empty() {
        name.to_owned()
    } else {
        format!("{folder}/{name}")
    }
}

/// The snapshot names in the folder.
async fn names_in(store: &Store, folder: &str) -> edl_storage::Result<Vec<String>> {
    Ok(store
        .list(folder)
        .await?
        .into_iter()
        .filter_map(|o| o.key.rsplit('/').next().map(str::to_owned))
        .collect())
}

async fn newest_in(store: &Store, folder: &str) -> edl_storage::Result<Option<SystemTime>> {
    Ok(names_in(store, folder)
        .await?
        .iter()
        .filter_map(|n| taken_at(n))
        .max())
}

/// Deletes the oldest snapshots until `keep` are left, then every pin whose snapshot
/// is not in the folder (theirs, and any left by a deletion cut short).
async fn prune(
    leader: &Term,
    store: &Store,
    folder: &str,
    keep: usize,
) -> Result<(), SnapshotError> {
    let names = names_in(store, folder).await?;
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let gone = to_delete(&names, keep);
    for n in &gone {
        store.delete(&key(folder, n)).await?;
    }
    let pins = leader.keys.checkpoint_pins();
    let (kvs, _) = leader.backend.range(&pins).await?;
    let orphans: Vec<Op> = kvs
        .iter()
        .filter(|kv| {
            kv.key
                .strip_prefix(&pins)
                .is_none_or(|n| gone.contains(&n) || !names.contains(&n))
        })
        .map(|kv| Op::delete(kv.key.clone()))
        .collect();
    for chunk in orphans.chunks(100) {
        fenced_txn(
            &*leader.backend,
            &leader.fence,
            Txn::new().and_then(chunk.to_vec()),
        )
        .await?;
    }
    Ok(())
}

/// Takes one snapshot with the manifests held, then pins them ([`Term`]): its name and
/// size. On any failure the hold is released and nothing is left in the folder.
async fn take_pinned(
    etcd: &EtcdBackend,
    leader: &Term,
    store: &Store,
    folder: &str,
    at: SystemTime,
    term: &CancellationToken,
) -> Result<(String, u64), SnapshotError> {
    let (backend, keys, fence) = (&*leader.backend, &leader.keys, &leader.fence);
    let hold = keys.checkpoint_hold();
    fenced_txn(
        backend,
        fence,
        Txn::new().and_then([Op::put_with_lease(hold.clone(), Vec::new(), leader.lease)]),
    )
    .await?;
    let taken = match take(etcd, store, folder, at, term).await {
        // A snapshot whose checkpoints may be gone is not kept.
        Ok((name, bytes)) => match pin(leader, &name).await {
            Ok(()) => Ok((name, bytes)),
            Err(e) => Err((e, Some(name))),
        },
        Err(e) => Err((e, None)),
    };
    match taken {
        Ok(taken) => Ok(taken),
        Err((e, stored)) => {
            if let Some(name) = stored
                && let Err(d) = store.delete(&key(folder, &name)).await
            {
                tracing::warn!(snapshot = %name, error = %d, "etcd snapshots: cannot delete a snapshot left without its pin");
            }
            if let Err(r) =
                fenced_txn(backend, fence, Txn::new().and_then([Op::delete(hold)])).await
            {
                tracing::debug!(error = %r, "etcd snapshots: releasing the hold failed; it ends with the lease");
            }
            Err(e)
        }
    }
}

/// Pins every manifest stored now (the hold kept the snapshot's) for snapshot `name`,
/// and releases the hold, in one fenced transaction that requires the hold.
async fn pin(leader: &Term, name: &str) -> Result<(), SnapshotError> {
    let (backend, keys) = (&*leader.backend, &leader.keys);
    let (kvs, _) = backend.range(&keys.checkpoints()).await?;
    let mut manifests: Vec<(u64, serde_json::Value)> = kvs
        .iter()
        .filter_map(|kv| {
            let step = keys.manifest_step(&kv.key)?;
            match serde_json::from_slice(&kv.value) {
                Ok(m) => Some((step, m)),
                Err(e) => {
                    tracing::warn!(key = %kv.key, error = %e, "etcd snapshots: an unreadable manifest is not pinned");
                    None
                }
            }
        })
        .collect();
    manifests.sort_by_key(|(step, _)| std::cmp::Reverse(*step));
    let record = CheckpointPin {
        version: RECORD_VERSION,
        manifests: manifests.into_iter().map(|(_, m)| m).collect(),
    };
    let hold = keys.checkpoint_hold();
    let txn = Txn::new().when([Compare::exists(hold.clone())]).and_then([
        Op::put(keys.checkpoint_pin(name), record.encode()),
        Op::delete(hold),
    ]);
    if !fenced_txn(backend, &leader.fence, txn).await?.succeeded {
        return Err(SnapshotError::HoldLost);
    }
    Ok(())
}

/// Takes one snapshot into the folder: its name and size.
async fn take(
    etcd: &EtcdBackend,
    store: &Store,
    folder: &str,
    at: SystemTime,
    term: &CancellationToken,
) -> Result<(String, u64), SnapshotError> {
    let mut snapshot = tokio::select! {
        _ = term.cancelled() => return Err(SnapshotError::Cancelled),
        s = etcd.snapshot() => s?,
    };
    let name = name_of(at, snapshot.revision());
    let mut writer = store.writer(&key(folder, &name)).await?;
    // The term's end aborts the upload too: no part of it is left in the store.
    let copied = async {
        loop {
            let next = tokio::select! {
                _ = term.cancelled() => return Err(SnapshotError::Cancelled),
                n = snapshot.next() => n?,
            };
            let Some(bytes) = next else {
                return Ok::<_, SnapshotError>(());
            };
            writer.write(bytes).await?;
        }
    }
    .await;
    match copied {
        Ok(()) => Ok((name, writer.finish().await?)),
        Err(e) => {
            if let Err(abort) = writer.abort().await {
                tracing::debug!(error = %abort, "etcd snapshots: aborting the upload failed");
            }
            Err(e)
        }
    }
}

/// Why a snapshot was not taken: etcd's part or the store's.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// etcd refused the snapshot to this user.
    #[error(
        "etcd refused the snapshot ({0}): it needs a user with the root role (EDL_ETCD_SNAPSHOT_USER, EDL_ETCD_SNAPSHOT_PASSWORD)"
    )]
    NotRoot(String),
    /// etcd failed or sent a damaged stream.
    #[error("etcd: {0}")]
    Etcd(edl_coord::Error),
    /// The store failed.
    #[error("{0}")]
    Store(#[from] edl_storage::Error),
    /// The hold on the manifests ended before their pin was written (the leader's lease
    /// ended): the snapshot was deleted.
    #[error("the hold on the checkpoint manifests ended before the snapshot's pin was written")]
    HoldLost,
    /// The leader's term ended first.
    #[error("the leader's term ended")]
    Cancelled,
}

impl From<edl_coord::Error> for SnapshotError {
    fn from(e: edl_coord::Error) -> Self {
        match e {
            edl_coord::Error::PermissionDenied(m) => SnapshotError::NotRoot(m),
            e => SnapshotError::Etcd(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn names_sort_by_time_and_read_back() {
        let t = UNIX_EPOCH + Duration::from_millis(1_764_460_800_123);
        let n = name_of(t, 42);
        assert_eq!(n, "snapshot-1764460800123-r42.db");
        assert_eq!(taken_at(&n), Some(t));
        assert!(
            name_of(UNIX_EPOCH + Duration::from_secs(9), 7) < n,
            "zero-padded"
        );
        for other in [
            "snapshot-1-r2.db",
            "checkpoint-1764460800123-r42.db",
            "snapshot-1764460800123-rx.db",
            "snapshot-1764460800123-r42.db.part",
        ] {
            assert_eq!(taken_at(other), None, "{other}");
        }
    }

    #[test]
    fn the_next_is_due_every_after_the_newest_and_sooner_after_a_failure() {
        let t = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let every = Duration::from_secs(600);
        assert_eq!(due(None, None, every), None, "none yet: at once");
        assert_eq!(due(Some(t), None, every), Some(t + every));
        // A failure long after the newest: tried again after RETRY, not `every`.
        let failed = t + Duration::from_secs(900);
        assert_eq!(due(Some(t), Some(failed), every), Some(failed + RETRY));
        // A short period bounds the retry.
        let short = Duration::from_secs(5);
        assert_eq!(due(None, Some(t), short), Some(t + short));
    }

    /// Against a real etcd with authentication on and a real S3 server: the loop takes a
    /// snapshot at once and then every period, keeps the newest `keep` (each whole: its
    /// hash matches), leaves a file of another name alone, and stops with its term. As a
    /// user without the root role it writes nothing and counts the failures.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn snapshots_are_taken_every_period_and_the_oldest_deleted() {
        use edl_coord::{Backend, SNAPSHOT_HASH_LEN};
        use edl_testkit::EtcdCluster;
        use edl_testkit::s3::S3Server;
        let dir = tempfile::tempdir().expect("tempdir");
        let s3 = S3Server::start(&dir.path().join("s3")).expect("the S3 server");
        s3.create_bucket("ckpt").expect("bucket");
        let (store, folder) = edl_storage::Location::parse("s3://ckpt/job/etcd-snapshots")
            .and_then(|l| l.open_with(s3.env()))
            .expect("the store");
        store
            .put(
                &format!("{folder}/notes.txt"),
                bytes::Bytes::from_static(b"mine"),
            )
            .await
            .expect("a file of another name");
        let (etcd, root) = EtcdCluster::start_with_auth("pw").await.expect("etcd");
        root.put("/edl/j/k", vec![1; 4096], None)
            .await
            .expect("put");
        // The leader's records: a manifest to pin, and a pin of no snapshot in the folder.
        let leader = leader_of(&root, "j").await;
        let keys = leader.keys.clone();
        let manifest = br#"{"step":7,"shards":1,"mode":"sync","created_ms":1,"entries":[]}"#;
        root.put(&keys.manifest(7), manifest.to_vec(), None)
            .await
            .expect("put");
        let orphan = keys.checkpoint_pin(&name_of(UNIX_EPOCH + Duration::from_secs(9), 1));
        root.put(&orphan, b"{}".to_vec(), None).await.expect("put");
        let cfg = SnapshotConfig {
            etcd: (*root).clone(),
            store: store.clone(),
            folder: folder.clone(),
            every: Duration::from_millis(300),
            keep: 2,
        };
        let stats = std::sync::Arc::new(SnapshotStats::default());
        let term = CancellationToken::new();
        let task = {
            let (stats, term, leader) = (stats.clone(), term.clone(), leader.clone());
            tokio::spawn(async move { run(cfg, leader, &stats, term).await })
        };
        let four = edl_testkit::wait_until(
            Duration::from_secs(30),
            Duration::from_millis(50),
            || async { stats.taken.load(Ordering::Relaxed) >= 4 },
        )
        .await;
        term.cancel();
        task.await.expect("the loop stops with its term");
        assert!(four, "four snapshots: {stats:?}");
        assert_eq!(stats.failed.load(Ordering::Relaxed), 0, "{stats:?}");
        let names = names_in(&store, &folder).await.expect("list");
        let snaps: Vec<&String> = names.iter().filter(|n| taken_at(n).is_some()).collect();
        assert_eq!(snaps.len(), 2, "the newest two kept: {names:?}");
        assert!(names.iter().any(|n| n == "notes.txt"), "{names:?}");
        let last = stats.last_unix_seconds.load(Ordering::Relaxed);
        let newest = snaps.iter().filter_map(|n| taken_at(n)).max().expect("one");
        assert_eq!(
            newest.duration_since(UNIX_EPOCH).expect("time").as_secs(),
            last,
            "the newest kept is the last taken"
        );
        // Each snapshot kept has its pin, holding the manifest; the others' pins and the
        // orphan are gone, and so is the hold.
        let (pins, _) = root.range(&keys.checkpoint_pins()).await.expect("range");
        let pinned: Vec<&str> = pins
            .iter()
            .filter_map(|kv| kv.key.strip_prefix(&keys.checkpoint_pins()))
            .collect();
        let mut kept: Vec<&str> = snaps.iter().map(|n| n.as_str()).collect();
        kept.sort_unstable();
        assert_eq!(pinned, kept, "a pin per snapshot kept, no other");
        for kv in &pins {
            let pin = CheckpointPin::decode(&kv.value).expect("a pin");
            assert_eq!(
                pin.manifests,
                vec![serde_json::from_slice::<serde_json::Value>(manifest).expect("json")]
            );
        }
        assert!(
            root.get(&keys.checkpoint_hold())
                .await
                .expect("get")
                .is_none()
        );
        for n in snaps {
            let b = store.get(&key(&folder, n)).await.expect("read it");
            let (data, hash) = b.split_at(b.len() - SNAPSHOT_HASH_LEN);
            assert_eq!(
                ring::digest::digest(&ring::digest::SHA256, data).as_ref(),
                hash
            );
            if taken_at(n) == Some(newest) {
                assert_eq!(b.len() as u64, stats.last_bytes.load(Ordering::Relaxed));
            }
        }

        // The job's own user may not take one: nothing is written, failures counted.
        let auth = root
            .grant_prefix("edl-job-j", "/edl/j/")
            .await
            .expect("user");
        let job = EtcdBackend::connect(etcd.config().with_auth(&auth.user, &auth.password))
            .await
            .expect("connect as the job");
        let (store2, folder2) = edl_storage::Location::parse("s3://ckpt/job/other")
            .and_then(|l| l.open_with(s3.env()))
            .expect("the store");
        let stats = std::sync::Arc::new(SnapshotStats::default());
        let term = CancellationToken::new();
        let cfg = SnapshotConfig {
            etcd: job,
            store: store2.clone(),
            folder: folder2.clone(),
            every: Duration::from_millis(100),
            keep: 2,
        };
        let task = {
            let (stats, term) = (stats.clone(), term.clone());
            tokio::spawn(async move { run(cfg, leader, &stats, term).await })
        };
        let failed = edl_testkit::wait_until(
            Duration::from_secs(30),
            Duration::from_millis(50),
            || async { stats.failed.load(Ordering::Relaxed) >= 1 },
        )
        .await;
        term.cancel();
        task.await.expect("stops");
        assert!(failed, "{stats:?}");
        assert_eq!(stats.taken.load(Ordering::Relaxed), 0);
        assert!(names_in(&store2, &folder2).await.expect("list").is_empty());
        assert!(
            root.get(&keys.checkpoint_hold())
                .await
                .expect("get")
                .is_none(),
            "the hold is released after a failure"
        );
    }

    /// A leader of job `job` on `etcd`: an election key, fenced by its revision, and a
    /// lease.
    async fn leader_of(etcd: &std::sync::Arc<EtcdBackend>, job: &str) -> Term {
        let keys = JobKeys::new(&edl_job::JobName::new(job).expect("name"));
        let backend: Arc<dyn Backend> = etcd.clone();
        let lease = backend
            .lease_grant(Duration::from_secs(30))
            .await
            .expect("lease")
            .id;
        let key = keys.master_election() + "leader";
        let revision = backend
            .put(&key, b"me".to_vec(), Some(lease))
            .await
            .expect("put");
        Term {
            backend,
            keys,
            fence: Fence { key, revision },
            lease,
        }
    }

    proptest! {
        /// The newest `keep` snapshots stay, the rest go, and no other file is touched.
        #[test]
        fn retention_keeps_the_newest(times in proptest::collection::btree_set(0u64..10_000_000, 0..12), keep in 0usize..6, others in 0usize..3) {
            let mut names: Vec<String> = times
                .iter()
                .map(|ms| name_of(UNIX_EPOCH + Duration::from_millis(1_700_000_000_000 + ms), 1))
                .collect();
            names.extend((0..others).map(|i| format!("notes-{i}.txt")));
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            let gone = to_delete(&refs, keep);
            let kept: Vec<&str> = refs.iter().copied().filter(|n| taken_at(n).is_some() && !gone.contains(n)).collect();
            prop_assert_eq!(kept.len(), times.len().min(keep.max(1)));
            prop_assert!(gone.iter().all(|g| taken_at(g).is_some()));
            let newest_gone = gone.iter().filter_map(|g| taken_at(g)).max();
            let oldest_kept = kept.iter().filter_map(|k| taken_at(k)).min();
            if let (Some(g), Some(k)) = (newest_gone, oldest_kept) {
                prop_assert!(g < k);
            }
        }
    }
}
