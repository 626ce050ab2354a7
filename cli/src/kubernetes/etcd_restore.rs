//! `edl operator restore-etcd` (the pods that restore a TrainingJob's managed etcd from a
//! snapshot, `edl_operator::objects::etcd_restore_pods`) and `restore-etcd-member` (what
//! each of them runs: the snapshot fetched, the member's old data moved aside, etcd's
//! own tool run). docs/kubernetes.md, "Restoring the managed etcd".

use std::path::{Path, PathBuf};

use anyhow::Context;
use edl_coord::local_etcd::{RestoredMember, restore_snapshot};

use super::{RestoreEtcdArgs, RestoreEtcdMemberArgs};

/// The YAML of the restore pods of the TrainingJob `args` names.
pub fn restore_pods(args: &RestoreEtcdArgs) -> anyhow::Result<String> {
    let tj = args.job.load(&args.namespace)?;
    anyhow::ensure!(
        tj.spec.etcd.managed,
        "{}: the job's etcd is not managed by the operator (etcd.managed); restore a shared \
         etcd with its own tools",
        args.job.file.display()
    );
    anyhow::ensure!(
        args.from.contains("://") || Path::new(&args.from).is_absolute(),
        "--from {}: an object URL (s3://, gs://, az://) or an absolute path on the members' claims",
        args.from
    );
    let mut out = String::new();
    for pod in edl_operator::objects::etcd_restore_pods(&tj, &args.from) {
        out.push_str("---\n");
        out.push_str(&serde_norway::to_string(&pod)?);
    }
    Ok(out)
}

/// Makes one member's data directory from the snapshot `args` names.
pub fn restore_member(args: &RestoreEtcdMemberArgs) -> anyhow::Result<()> {
    let dir = &args.data_dir;
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .with_context(|| format!("--data-dir {}: no parent directory", dir.display()))?;
    let snapshot = parent.join("restore-snapshot.db");
    let bytes = fetch(&args.from, &snapshot)?;
    let replaced = PathBuf::from(format!("{}.replaced", dir.display()));
    let exists = |p: &Path| {
        p.try_exists()
            .with_context(|| format!("stat {}", p.display()))
    };
    let moved = exists(dir)?;
    if moved {
        if exists(&replaced)? {
            std::fs::remove_dir_all(&replaced)
                .with_context(|| format!("remove {}", replaced.display()))?;
        }
        std::fs::rename(dir, &replaced)
            .with_context(|| format!("move {} to {}", dir.display(), replaced.display()))?;
    }
    let member = RestoredMember {
        name: args.name.clone(),
        data_dir: dir.clone(),
        initial_cluster: args.initial_cluster.clone(),
        peer_url: args.initial_advertise_peer_urls.clone(),
        token: args.initial_cluster_token.clone(),
    };
    let restored = restore_snapshot(&snapshot, &member);
    let _ = std::fs::remove_file(&snapshot);
    if let Err(e) = restored {
        // What the tool made of a snapshot it refused is no member's data: the member
        // keeps the data it had.
        if exists(dir)? {
            std::fs::remove_dir_all(dir)
                .with_context(|| format!("remove the failed restore's {}", dir.display()))?;
        }
        if moved {
            std::fs::rename(&replaced, dir).with_context(|| {
                format!("move {} back to {}", replaced.display(), dir.display())
            })?;
        }
        return Err(anyhow::Error::new(e).context(format!(
            "restore etcd member {} from {}",
            args.name, args.from
        )));
    }
    println!(
        "restored etcd member {} into {} from {} ({bytes} bytes){}",
        args.name,
        dir.display(),
        args.from,
        if moved {
            format!("; the data it had is in {}", replaced.display())
        } else {
            String::new()
        }
    );
    Ok(())
}

/// Copies the snapshot at `from` (an object URL or a file) to `to`; its size. Nothing is
/// left at `to` when it fails.
fn fetch(from: &str, to: &Path) -> anyhow::Result<u64> {
    let copied = copy_snapshot(from, to);
    if copied.is_err() {
        let _ = std::fs::remove_file(to);
    }
    copied
}

fn copy_snapshot(from: &str, to: &Path) -> anyhow::Result<u64> {
    let mut out = std::fs::File::create(to).with_context(|| format!("create {}", to.display()))?;
    let copied = if from.contains("://") {
        let mut reader = edl_storage::blocking::ObjectReader::open(from)
            .with_context(|| format!("read the snapshot {from}"))?;
        std::io::copy(&mut reader, &mut out)
    } else {
        let mut file =
            std::fs::File::open(from).with_context(|| format!("read the snapshot {from}"))?;
        std::io::copy(&mut file, &mut out)
    };
    let n = copied.with_context(|| format!("copy the snapshot {from} to {}", to.display()))?;
    out.sync_all()
        .with_context(|| format!("write {}", to.display()))?;
    Ok(n)
}
