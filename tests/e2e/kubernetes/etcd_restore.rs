//! A managed etcd lost whole, restored from the snapshot its job's master took, by the
//! procedure of docs/kubernetes.md ("Restoring the managed etcd"), with the real
//! `kubectl` and `edl` against the stand-in: the operator stopped, the job's pods
//! deleted, the pods of `edl operator restore-etcd` applied (each runs etcd's own
//! restore tool on its member's claim), the operator started again.

use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, EtcdBackend, EtcdConfig};
use edl_job::JobKeys;
use edl_operator::TrainingJob;
use edl_operator::crd::Phase;
use edl_operator::metrics::Metrics;
use kube::Api;
use kube::api::PostParams;

use super::managed_etcd::{managed_mnist_job, snapshots_in, snapshots_to_s3};
use super::{
    NS, OnOperator, final_ledger_holds, kubectl, pod_logs, restore, secret_value, succeeded,
    tls_of, write_kubeconfig,
};
use crate::support::{World, edl_bin, wait_until};
use crate::trainer::mnist;

const JOB: &str = "mnist-restored";
const SNAPSHOTS: &str = "s3://snaps/mnist-restored/etcd";

/// The job trains on its managed etcd (three members, snapshots every 2 s into the S3
/// server); in its third pass or later the operator is stopped and every pod of the job
/// is deleted with no grace period, the members' data deleted from their claims (the
/// etcd is lost whole). Restored from the newest snapshot by the documented pods (each
/// Succeeded, its member's data made by etcd's tool), the operator started again makes
/// the members on the restored data and the job's pods: the job's own etcd user still
/// reads its keys, the pserver restores a checkpoint the snapshot pinned (not step 0:
/// the job did not start over), and the job succeeds with every pass in its final
/// checkpoint's ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_managed_etcd_lost_whole_is_restored_from_its_snapshot_by_the_documented_pods() {
    const PASSES: u32 = 10;
    let w = World::new("unused").await;
    let (train, test) = mnist(w.dir.path());
    let mut on = OnOperator::start(&w, None, Arc::new(Metrics::default())).await;
    let mut tj = managed_mnist_job(JOB, (&train, &test), PASSES);
    let s3 = snapshots_to_s3(&w, &on.client, &mut tj, SNAPSHOTS).await;
    let jobs: Api<TrainingJob> = Api::namespaced(on.client.clone(), NS);
    jobs.create(&PostParams::default(), &tj)
        .await
        .expect("create the job");
    let pods_dir = on.pods_dir.clone();
    let status = || {
        let jobs = jobs.clone();
        async move { jobs.get(JOB).await.ok().and_then(|j| j.status) }
    };
    let training = wait_until(Duration::from_secs(180), || async {
        status()
            .await
            .is_some_and(|s| s.pass >= Some(2) && s.phase == Phase::Running)
            && !snapshots_in(&s3, SNAPSHOTS).await.is_empty()
    })
    .await;
    assert!(training, "{:?}\n{}", status().await, pod_logs(&pods_dir));

    let kubeconfig = w.dir.path().join("kubeconfig");
    write_kubeconfig(&kubeconfig, &on.api);
    let cache = w.dir.path().join("kube-cache");
    let api = on.api.clone();
    let claims_dir = pods_dir.join("claims");
    let claim_dir = |i: u32| {
        let claim = api
            .get(
                "persistentvolumeclaims",
                NS,
                &edl_operator::objects::etcd_claim_name(JOB, i),
            )
            .unwrap_or_else(|| panic!("member {i}'s claim"));
        claims_dir.join(claim["metadata"]["uid"].as_str().expect("uid"))
    };
    let mut snapshot = String::new();
    on.restart_around(async {
        // The loss: every pod of the job gone, the members' data with them.
        let selector = format!("{}={JOB}", edl_operator::objects::JOB_LABEL);
        let (ok, out) = kubectl(
            &kubeconfig,
            &cache,
            &[
                "-n",
                NS,
                "delete",
                "pods",
                "-l",
                &selector,
                "--grace-period=0",
                "--force",
            ],
        );
        assert!(ok, "kubectl delete pods: {out}");
        let gone = wait_until(Duration::from_secs(60), || async {
            api.list("pods", NS)
                .iter()
                .all(|p| p["metadata"]["labels"][edl_operator::objects::JOB_LABEL] != JOB)
        })
        .await;
        assert!(gone, "the job's pods are not gone");
        for i in 0..3 {
            let data = claim_dir(i).join("data");
            assert!(data.join("member").is_dir(), "member {i} had no data");
            std::fs::remove_dir_all(&data).expect("lose the member's data");
        }
        // The newest snapshot, and the restore pods of the TrainingJob as kubectl has it.
        let newest = snapshots_in(&s3, SNAPSHOTS)
            .await
            .pop()
            .expect("a snapshot");
        snapshot = format!("s3://snaps/{}", newest.key);
        let tj_file = w.dir.path().join("restored-job.yaml");
        let got = std::process::Command::new("kubectl")
            .args([
                "-n",
                NS,
                "get",
                "trainingjob",
                JOB,
                "-o",
                "yaml",
                "--cache-dir",
            ])
            .arg(&cache)
            .env("KUBECONFIG", &kubeconfig)
            .output()
            .expect("kubectl get");
        assert!(
            got.status.success(),
            "{}",
            String::from_utf8_lossy(&got.stderr)
        );
        std::fs::write(&tj_file, &got.stdout).expect("write the TrainingJob");
        let pods = std::process::Command::new(edl_bin())
            .args(["operator", "restore-etcd", "-n", NS, "--from", &snapshot])
            .arg(&tj_file)
            .output()
            .expect("edl operator restore-etcd");
        assert!(
            pods.status.success(),
            "{}",
            String::from_utf8_lossy(&pods.stderr)
        );
        let pods_file = w.dir.path().join("restore-pods.yaml");
        std::fs::write(&pods_file, &pods.stdout).expect("write the pods");
        let (ok, out) = kubectl(
            &kubeconfig,
            &cache,
            // The stand-in serves no OpenAPI documents for kubectl's own validation.
            &[
                "-n",
                NS,
                "apply",
                "--validate=false",
                "-f",
                pods_file.to_str().expect("utf-8"),
            ],
        );
        assert!(ok, "kubectl apply: {out}");
        let phase = |i: u32| {
            api.get("pods", NS, &format!("{JOB}-etcd-{i}-restore"))
                .and_then(|p| p["status"]["phase"].as_str().map(str::to_owned))
        };
        let selector = format!("{}={JOB}", edl_operator::objects::ETCD_RESTORE_LABEL);
        let (ok, out) = kubectl(
            &kubeconfig,
            &cache,
            &[
                "-n",
                NS,
                "wait",
                "--for=jsonpath={.status.phase}=Succeeded",
                "pod",
                "-l",
                &selector,
                "--timeout=60s",
            ],
        );
        assert!(ok, "kubectl wait: {out}\n{}", pod_logs(&pods_dir));
        for i in 0..3 {
            let log = std::fs::read_to_string(pods_dir.join(format!("{JOB}-etcd-{i}-restore.log")))
                .unwrap_or_default();
            assert_eq!(phase(i).as_deref(), Some("Succeeded"), "member {i}: {log}");
            assert!(log.contains("restored etcd member"), "{log}");
            assert!(
                claim_dir(i).join("data").join("member").is_dir(),
                "member {i}"
            );
        }
        let (ok, out) = kubectl(
            &kubeconfig,
            &cache,
            &["-n", NS, "delete", "pods", "-l", &selector],
        );
        assert!(ok, "kubectl delete the restore pods: {out}");
    })
    .await;

    // The restored etcd, as the job's own user over the job's TLS.
    let resolve = on._kubelet.resolver();
    let endpoints: Vec<String> = edl_operator::objects::etcd_endpoints(&tj)
        .iter()
        .map(|e| resolve(e))
        .collect();
    let tls = tls_of(&api, &format!("{JOB}-edl-tls-trainer"), JOB);
    let credentials = format!("{JOB}-edl-credentials");
    let text = |k: &str| String::from_utf8(secret_value(&api, &credentials, k)).expect("UTF-8");
    let keys = JobKeys::new(&super::etcd_job(JOB));
    let connected = wait_until(Duration::from_secs(120), || async {
        let cfg = EtcdConfig::new(endpoints.clone())
            .with_dial_timeout(Duration::from_secs(2))
            .with_auth(text("EDL_ETCD_USER"), text("EDL_ETCD_PASSWORD"));
        match EtcdBackend::connect_with_tls(cfg, tls.clone()).await {
            Ok(b) => b.get(&keys.spec()).await.is_ok_and(|s| s.is_some()),
            Err(_) => false,
        }
    })
    .await;
    assert!(
        connected,
        "the restored etcd does not serve the job's keys to its user ({snapshot})\n{}",
        pod_logs(&pods_dir)
    );
    let etcd: Arc<dyn Backend> = Arc::new(
        EtcdBackend::connect_with_tls(
            EtcdConfig::new(endpoints.clone())
                .with_dial_timeout(Duration::from_secs(2))
                .with_auth(text("EDL_ETCD_USER"), text("EDL_ETCD_PASSWORD")),
            tls.clone(),
        )
        .await
        .expect("connect as the job's user"),
    );
    succeeded(&jobs, JOB, &pods_dir).await;
    let restored = restore(&etcd, &keys).await.expect("the restore record");
    assert!(
        restored.step > 0,
        "the pserver started over instead of restoring a pinned checkpoint: {restored:?}"
    );
    final_ledger_holds(&api, &pods_dir, &etcd, JOB, PASSES).await;
    on.stop.cancel();
}

/// A snapshot that etcd's tool refuses (damaged), or one that cannot be read, fails the
/// restore pod with the cause, and the member keeps the data it had: nothing is moved
/// aside or left behind.
#[test]
fn a_damaged_snapshot_fails_the_member_restore_and_keeps_its_data() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    std::fs::create_dir_all(data.join("member")).expect("mkdir");
    std::fs::write(data.join("member").join("kept"), b"the member's data").expect("write");
    let snapshot = dir.path().join("snapshot.db");
    std::fs::write(&snapshot, vec![7u8; 4096]).expect("write a damaged snapshot");
    let missing = dir.path().join("no-such-snapshot.db");
    for (from, says) in [
        (&snapshot, "snapshot restore"),
        (&missing, "read the snapshot"),
    ] {
        let out = std::process::Command::new(edl_bin())
            .args(["operator", "restore-etcd-member", "--from"])
            .arg(from)
            .args(["--name", "etcd-0", "--data-dir"])
            .arg(&data)
            .args([
                "--initial-cluster",
                "etcd-0=http://127.0.0.1:1",
                "--initial-advertise-peer-urls",
                "http://127.0.0.1:1",
                "--initial-cluster-token",
                "t",
            ])
            .output()
            .expect("run edl");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        assert!(stderr.contains(says), "{says}: {stderr}");
        assert_eq!(
            std::fs::read(data.join("member").join("kept")).expect("the data is kept"),
            b"the member's data"
        );
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .expect("ls")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(left.len(), 2, "only the data and the snapshot: {left:?}");
    }
}
