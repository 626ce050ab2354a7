//! A job's etcd lost whole and restored from the leading master's snapshot.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use edl_coord::Backend;
use edl_job::{CheckpointPin, JobKeys, JobName, Record, RestoreRecord};
use edl_master::snapshots::taken_at;
use edl_testkit::EtcdCluster;

use crate::support::World;
use crate::trainer::{final_metric, finish, fit_a_line_spec, wait_status};

const PASSES: u64 = 60;
/// Each pserver checkpoints every 20 sync steps (a pass is 21 batches of 20) and keeps
/// the newest two: a checkpoint's files are deleted about two passes after it.
const PSERVER: [&str; 6] = [
    "--shards",
    "1",
    "--checkpoint-every",
    "20",
    "--keep-checkpoints",
    "2",
];

/// The fit_a_line job in sync mode: with one trainer, two runs of it train in the same
/// order, so their final costs compare.
fn spec(w: &World) -> PathBuf {
    fit_a_line_spec(w, "sync", PASSES)
}

/// The steps of the manifests stored in the job's etcd now.
async fn live_manifests(backend: &std::sync::Arc<dyn Backend>, keys: &JobKeys) -> Vec<u64> {
    backend
        .range(&keys.checkpoints())
        .await
        .map(|(kvs, _)| {
            kvs.iter()
                .filter_map(|kv| keys.manifest_step(&kv.key))
                .collect()
        })
        .unwrap_or_default()
}

/// The checkpoint files of shard 0 now: (step, path).
fn files(w: &World) -> Vec<(u64, String)> {
    let job = JobName::new(&w.job).expect("name");
    edl_pserver::checkpoint::CheckpointDir::new(w.checkpoint_dir(), &job, 0)
        .files()
        .map(|f| f.into_iter().map(|(step, _, path)| (step, path)).collect())
        .unwrap_or_default()
}

/// Polls `f` every 20 ms until it gives a value or `within` passes.
async fn poll<T, F, Fut>(within: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The snapshot of the job's etcd taken after `since`, once its pin is written: its
/// path and the manifests it pins.
async fn snapshot_after(
    w: &World,
    keys: &JobKeys,
    folder: &Path,
    since: SystemTime,
) -> (PathBuf, Vec<edl_pserver::checkpoint::Manifest>) {
    let found = poll(Duration::from_secs(60), || async move {
        let names = std::fs::read_dir(folder).into_iter().flatten().flatten();
        for name in names.filter_map(|e| e.file_name().into_string().ok()) {
            if taken_at(&name).is_none_or(|t| t <= since) {
                continue;
            }
            let Ok(Some(kv)) = w.backend.get(&keys.checkpoint_pin(&name)).await else {
                continue;
            };
            let pin = CheckpointPin::decode(&kv.value).expect("a pin");
            let manifests: Vec<edl_pserver::checkpoint::Manifest> = pin
                .manifests
                .into_iter()
                .map(|m| serde_json::from_value(m).expect("a pinned manifest"))
                .collect();
            if !manifests.is_empty() {
                return Some((folder.join(name), manifests));
            }
        }
        None
    })
    .await;
    found.unwrap_or_else(|| panic!("no snapshot with pinned checkpoints after {since:?}"))
}

/// The job's etcd is lost whole (every job process SIGKILLed, the etcd's member and its
/// data gone) in pass 20 or later, and restored by etcd's own tool from a snapshot the
/// leading master took (`edl master --etcd-snapshots`). The snapshot pinned its
/// checkpoints, so the restored pserver restores the newest of them although the
/// pservers' retention deleted every other file of their time (witnessed before the
/// loss: the live etcd names none of them, and files of later checkpoints were deleted
/// while theirs stayed). The job resumes where the snapshot left it and finishes: no
/// record lost, the records trained are every pass's plus those counted as trained
/// again, far fewer than the snapshot had trained (a job whose pinned files were gone
/// would start over), every pass sealed in the ledger, and the final cost within 2% of
/// a run without the loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_restored_from_an_etcd_snapshot_resumes_from_its_pinned_checkpoints() {
    // The fault-free run.
    let base = World::new("restore-base").await;
    let base_spec = spec(&base);
    let (_m, _) = base.master("master", &[]).await;
    let (_p, _) = base.pserver("ps0", &PSERVER).await;
    let mut trainers = vec![base.trainer("t0", &base_spec)];
    let (_, base_cost) =
        final_metric(&finish(&base, &mut trainers, Duration::from_secs(300)).await);
    drop(base);

    let w = World::new("restore").await;
    let keys = JobKeys::new(&JobName::new(&w.job).expect("name"));
    let spec = spec(&w);
    let folder = w.dir.path().join("etcd-snapshots");
    let folder_arg = folder.display().to_string();
    let (mut master, _) = w
        .master(
            "master",
            &[
                "--etcd-snapshots",
                &folder_arg,
                "--etcd-snapshot-every",
                "1s",
                "--etcd-snapshot-keep",
                "1000",
            ],
        )
        .await;
    let (mut pserver, _) = w.pserver("ps0", &PSERVER).await;
    let mut trainer = w.trainer("t0", &spec);
    wait_status(&w, Duration::from_secs(120), "pass 20", |s| s.pass >= 20).await;
    let (snapshot, pinned) = snapshot_after(&w, &keys, &folder, SystemTime::now()).await;
    let pinned_steps: Vec<u64> = pinned.iter().map(|m| m.step).collect();
    let newest_pinned = pinned_steps
        .iter()
        .copied()
        .max()
        .expect("a pinned manifest");
    // Training goes on until the live etcd names none of the pinned checkpoints and
    // the retention deleted files of later ones, keeping the pinned files.
    let mut pruned_later: Vec<(u64, String)> = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let moved_on = loop {
        let live = live_manifests(&w.backend, &keys).await;
        let now = files(&w);
        if let Some(oldest_live) = live.iter().copied().min() {
            // Files of checkpoints after the pinned ones but before the live ones:
            // retention deletes them; seen once, then gone.
            pruned_later.extend(
                now.iter()
                    .filter(|(s, _)| *s > newest_pinned && *s < oldest_live)
                    .cloned(),
            );
            let gone = pruned_later.iter().any(|f| !now.contains(f));
            if gone && live.iter().all(|s| !pinned_steps.contains(s)) {
                break true;
            }
        }
        if tokio::time::Instant::now() >= deadline {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        moved_on,
        "the live etcd still names a pinned checkpoint, or no later checkpoint's file was \
         deleted: pinned {pinned_steps:?}, live {:?}, files {:?}",
        live_manifests(&w.backend, &keys).await,
        files(&w)
    );
    let kept = files(&w);
    for m in &pinned {
        let entry = m.entry(0).expect("shard 0's file");
        assert!(
            kept.iter().any(|(_, p)| p == &entry.path),
            "pinned file {} deleted; files now: {kept:?}",
            entry.path
        );
    }

    // Everything is lost: the processes, then etcd with its data.
    for p in [&mut trainer, &mut pserver, &mut master] {
        p.kill();
    }
    w.etcd.kill(0).expect("kill the etcd member");
    let etcd = EtcdCluster::start_restored(1, &snapshot)
        .await
        .expect("etcd restored from the snapshot");
    let backend = etcd.connect().await.expect("connect");
    let mut w = w;
    drop(std::mem::replace(&mut w.etcd, etcd));
    w.backend = backend;
    let (_master, _) = w.master("master-2", &[]).await;
    let client = w.client();
    let restored_status = poll(Duration::from_secs(60), || async {
        client.status().await.ok()
    })
    .await;
    let at_snapshot = restored_status.expect("the restored job's master never answered");
    let trained_at_snapshot = at_snapshot.counters.expect("counters").records_trained;
    assert!(
        at_snapshot.pass >= 20 && !at_snapshot.finished,
        "the restored queue is the snapshot's: {at_snapshot:?}"
    );
    let (_pserver, _) = w.pserver("ps0-2", &PSERVER).await;
    let mut trainers = vec![w.trainer("t1", &spec)];
    let (_, cost) = final_metric(&finish(&w, &mut trainers, Duration::from_secs(300)).await);

    // The shard restored the newest checkpoint the snapshot holds, a pinned one.
    let record = w
        .backend
        .get(&keys.restore(0))
        .await
        .expect("get")
        .expect("the restore record");
    let record = RestoreRecord::decode(&record.value).expect("a restore record");
    assert!(
        record.step > 0 && pinned_steps.contains(&record.step),
        "the shard restored step {} (0: none), not a pinned checkpoint {pinned_steps:?}",
        record.step
    );
    let s = w.client().status().await.expect("status");
    let c = s.counters.expect("counters");
    assert!(s.finished, "{s:?}");
    assert_eq!((c.lost_records, c.failed_tasks), (0, 0), "{c:?}");
    assert_eq!(
        c.records_trained,
        PASSES * s.total_records + c.recomputed_records,
        "every pass's records, and those trained again: {c:?}"
    );
    assert!(
        c.recomputed_records < trained_at_snapshot / 2,
        "{} records trained again of the {trained_at_snapshot} the snapshot had trained: \
         the job started over",
        c.recomputed_records
    );
    let ps = w.ps_client().await;
    let ledgers: Vec<u32> = ps
        .status()
        .await
        .into_iter()
        .map(|r| r.expect("shard status").passes_contained)
        .collect();
    assert_eq!(
        ledgers,
        vec![PASSES as u32],
        "every pass sealed in the ledger"
    );
    eprintln!(
        "restored from {}: {} records trained again of {trained_at_snapshot} at the snapshot; \
         cost {cost:.3}, fault-free {base_cost:.3}",
        snapshot.display(),
        c.recomputed_records
    );
    assert!(
        (cost - base_cost).abs() <= 0.02 * base_cost,
        "the final cost {cost} is not within 2% of the fault-free {base_cost}"
    );
}
