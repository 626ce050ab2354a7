//! A snapshot taken through etcd's Maintenance API ([`EtcdBackend::snapshot`]) is the
//! file `etcdctl snapshot save` writes: etcd's own tool restores it into a new cluster
//! with the keys at their revisions and the users and roles, and refuses it damaged.

use std::time::Duration;

use edl_coord::local_etcd::LocalEtcd;
use edl_coord::{Backend, Error, EtcdBackend, SNAPSHOT_HASH_LEN};
use edl_testkit::EtcdCluster;
use ring::digest;

/// Reads a whole snapshot.
async fn take(etcd: &EtcdBackend) -> Result<Vec<u8>, Error> {
    let mut s = etcd.snapshot().await?;
    let mut out = Vec::new();
    while let Some(b) = s.next().await? {
        out.extend_from_slice(&b);
    }
    Ok(out)
}

/// The job's keys (under its user) and its user survive a snapshot and its restore into
/// a new three-member cluster: every key with its value and mod revision, a key written
/// after the snapshot absent, authentication still on. A user without the root role
/// cannot take one; a snapshot with one byte changed is refused by etcd's tool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_restores_with_etcds_own_tool_into_a_new_cluster() {
    let (etcd, root) = EtcdCluster::start_with_auth("pw").await.expect("etcd");
    let auth = root
        .grant_prefix("edl-job-a", "/edl/a/")
        .await
        .expect("the job's user");
    let cfg = etcd.config();
    let job = EtcdBackend::connect(cfg.clone().with_auth(&auth.user, &auth.password))
        .await
        .expect("connect as the job");
    // Enough data for a stream of many messages (etcd sends 32 KiB at a time).
    for i in 0..300 {
        job.put(
            &format!("/edl/a/k{i:03}"),
            vec![b'a' + (i % 26) as u8; 1024],
            None,
        )
        .await
        .expect("put");
    }
    let (before, _) = job.range("/edl/a/").await.expect("range");
    assert_eq!(before.len(), 300);

    let refused = take(&job).await;
    assert!(
        matches!(refused, Err(Error::PermissionDenied(_))),
        "a snapshot needs the root role: {refused:?}"
    );
    let bytes = take(&root).await.expect("root takes a snapshot");
    // The file: the database, then the SHA-256 of it.
    let (data, hash) = bytes.split_at(bytes.len() - SNAPSHOT_HASH_LEN);
    assert!(data.len() > 300 * 1024, "{} bytes", data.len());
    assert_eq!(digest::digest(&digest::SHA256, data).as_ref(), hash);
    job.put("/edl/a/after", b"later".to_vec(), None)
        .await
        .expect("a key after the snapshot");

    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("snapshot.db");
    std::fs::write(&file, &bytes).expect("write the snapshot");
    let restored = LocalEtcd::start_restored(3, &file)
        .await
        .expect("etcd's tool restores it and the members start");
    let rcfg = restored
        .config()
        .with_request_timeout(Duration::from_secs(5));
    let r = match EtcdBackend::connect(rcfg.clone()).await {
        Ok(open) => open.get("/edl/a/k000").await.map(|_| ()),
        Err(e) => Err(e),
    };
    let refused = match &r {
        Err(Error::PermissionDenied(_)) => true,
        Err(Error::InvalidArgument(m)) => m.contains("user name is empty"),
        _ => false,
    };
    assert!(refused, "authentication is still on: {r:?}");
    let job = EtcdBackend::connect(rcfg.with_auth(&auth.user, &auth.password))
        .await
        .expect("the job's user and password are restored");
    let (after, _) = job.range("/edl/a/").await.expect("range the restored keys");
    assert_eq!(
        after
            .iter()
            .map(|kv| (&kv.key, &kv.value, kv.mod_revision))
            .collect::<Vec<_>>(),
        before
            .iter()
            .map(|kv| (&kv.key, &kv.value, kv.mod_revision))
            .collect::<Vec<_>>(),
        "every key, value and revision as at the snapshot, nothing written after it"
    );

    // One byte changed: etcd's tool refuses it (the hash), and nothing starts.
    let mut damaged = bytes.clone();
    damaged[4096 + 100] ^= 0xff;
    let bad = dir.path().join("damaged.db");
    std::fs::write(&bad, &damaged).expect("write");
    let refused = LocalEtcd::start_restored(1, &bad).await;
    let why = refused.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        why.contains("snapshot restore") && why.contains("sha256"),
        "a damaged snapshot is refused: {why}"
    );
}
