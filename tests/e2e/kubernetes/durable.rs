//! A job on the operator's defaults keeps its state through the loss of a pod: its
//! pserver checkpoints to a PersistentVolumeClaim the operator made for it, which the
//! test kubelet keeps for the claim's lifetime (an `emptyDir` would go with the pod).

use std::sync::Arc;
use std::time::Duration;

use edl_coord::Backend;
use edl_job::{JobKeys, JobName};
use edl_operator::TrainingJob;
use edl_operator::crd::EtcdSpec;
use edl_operator::metrics::Metrics;
use kube::Api;
use kube::api::{DeleteParams, PostParams};

use super::{
    NS, OnOperator, final_ledger_holds, mnist_job, pod_logs, restore, succeeded, tls_from, tls_of,
    uid,
};
use crate::support::{World, wait_until};
use crate::trainer::mnist;

/// Whether the job's leading master answers a status call made over `tls` (`None`:
/// plain TCP).
async fn master_answers(
    backend: &Arc<dyn Backend>,
    job: &JobName,
    tls: Option<edl_proto::tls::Tls>,
) -> bool {
    let mut cfg = edl_master_client::MasterClientConfig::new(job.clone());
    cfg.tls = tls;
    cfg.retry_for = Duration::from_secs(2);
    cfg.call_timeout = Duration::from_secs(2);
    edl_master_client::MasterClient::new(
        backend.clone(),
        cfg,
        tokio_util::sync::CancellationToken::new(),
    )
    .status()
    .await
    .is_ok()
}

/// The newest checkpoint step committed for the job.
async fn newest_manifest(backend: &Arc<dyn Backend>, keys: &JobKeys) -> Option<u64> {
    let (kvs, _) = backend.range(&keys.checkpoints()).await.ok()?;
    kvs.iter()
        .filter_map(|kv| keys.manifest_step(&kv.key))
        .max()
}

/// A job submitted with no checkpoint volume and no `plaintext` gets mutual TLS between
/// its pods (its master answers the job's own certificate, and refuses plain TCP and a
/// certificate of another CA) and a claim per pserver; its pserver pod,
/// deleted with no grace (SIGKILL, as when its node is lost), comes back on the same
/// claim and restores the newest checkpoint from it (`restores/0` names a step, not 0);
/// the job succeeds, its final checkpoint's ledger holds every pass, and deleting the job
/// deletes the claim and its directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_pserver_pod_restores_from_its_claim_on_the_defaults() {
    const DURABLE_JOB: &str = "mnist-durable";
    const PASSES: u32 = 6;
    let w = World::new("unused").await;
    let (train, test) = mnist(w.dir.path());
    let OnOperator {
        pods_dir,
        api,
        client,
        _kubelet,
        stop,
        operator,
        ..
    } = OnOperator::start(&w, None, Arc::new(Metrics::default())).await;
    let tj = mnist_job(
        DURABLE_JOB,
        (&train, &test),
        PASSES,
        "3s",
        EtcdSpec {
            endpoints: w.etcd.endpoints(),
            ..EtcdSpec::default()
        },
    );
    assert!(tj.spec.volumes.checkpoints.is_none(), "the defaults");
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);
    jobs.create(&PostParams::default(), &tj)
        .await
        .expect("create the job");
    let status = || {
        let jobs = jobs.clone();
        async move { jobs.get(DURABLE_JOB).await.ok().and_then(|j| j.status) }
    };
    let keys = JobKeys::new(&super::etcd_job(DURABLE_JOB));
    let within = Duration::from_secs(120);

    // Training, with a checkpoint committed, on the claim the operator made.
    let checkpointed = wait_until(within, || async {
        status().await.is_some_and(|s| s.pass >= Some(1))
            && newest_manifest(&w.backend, &keys).await.is_some()
    })
    .await;
    assert!(
        checkpointed,
        "no checkpoint: {:?}\n{}",
        status().await,
        pod_logs(&pods_dir)
    );
    let claim = format!("{DURABLE_JOB}-checkpoints-0");
    let claim_uid = api
        .get("persistentvolumeclaims", NS, &claim)
        .and_then(|c| c["metadata"]["uid"].as_str().map(str::to_owned))
        .expect("the operator made the pserver's claim");
    let claim_dir = pods_dir.join("claims").join(&claim_uid);
    let pserver = format!("{DURABLE_JOB}-pserver-0");
    let mounted = api.get("pods", NS, &pserver).is_some_and(|p| {
        p["spec"]["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|v| v["persistentVolumeClaim"]["claimName"] == claim.as_str())
    });
    assert!(mounted, "{:?}", api.get("pods", NS, &pserver));
    let s = status().await.expect("status");
    let durable = s
        .conditions
        .iter()
        .find(|c| c.type_ == "CheckpointsDurable")
        .expect("the CheckpointsDurable condition");
    assert_eq!(
        (durable.status.as_str(), durable.reason.as_str()),
        ("True", "Claims")
    );
    let policy = api
        .get("networkpolicies", NS, &format!("{DURABLE_JOB}-edl"))
        .expect("the job's NetworkPolicy");
    assert_eq!(
        policy["spec"]["podSelector"]["matchLabels"]["edl.dev/job"],
        DURABLE_JOB
    );
    let first = restore(&w.backend, &keys).await.expect("the first restore");
    assert_eq!(first.step, 0, "the first pserver started fresh: {first:?}");

    // Mutual TLS by default: the master answers the job's own certificate, and refuses
    // plain TCP and a certificate of another CA (made for the same name).
    let job = super::etcd_job(DURABLE_JOB);
    let own = tls_of(&api, &format!("{DURABLE_JOB}-edl-tls-trainer"), DURABLE_JOB);
    assert!(
        master_answers(&w.backend, &job, Some(own)).await,
        "the master refused the job's own certificate"
    );
    assert!(
        !master_answers(&w.backend, &job, None).await,
        "the master answered plain TCP"
    );
    let other = edl_proto::tls::LocalCa::generate_for(
        "another-job",
        vec![edl_operator::objects::tls_domain(DURABLE_JOB, NS)],
        1,
    )
    .expect("another CA");
    let foreign = tls_from(
        other.ca_pem.as_bytes(),
        other.cert_pem.as_bytes(),
        other.key_pem.as_bytes(),
        DURABLE_JOB,
    );
    assert!(
        !master_answers(&w.backend, &job, Some(foreign)).await,
        "the master answered another job's certificate"
    );

    // The pserver pod goes without a grace period (its node lost).
    let before = uid(&api, &pserver);
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), NS);
    pods.delete(&pserver, &DeleteParams::default().grace_period(0))
        .await
        .expect("delete the pserver pod");
    let back = wait_until(within, || async {
        api.get("pods", NS, &pserver).is_some_and(|p| {
            p["metadata"]["uid"].as_str() != before.as_deref() && p["status"]["phase"] == "Running"
        })
    })
    .await;
    assert!(
        back,
        "the pserver pod was not recreated: {:?}\n{}",
        status().await,
        pod_logs(&pods_dir)
    );
    let restored = wait_until(within, || async {
        restore(&w.backend, &keys)
            .await
            .is_some_and(|r| r.incarnation != first.incarnation)
    })
    .await;
    let again = restore(&w.backend, &keys).await.expect("a restore record");
    assert!(
        restored && again.step > 0,
        "the new pserver pod restored nothing from its claim: {again:?}\n{}",
        pod_logs(&pods_dir)
    );
    assert!(
        !status().await.expect("status").phase.is_finished(),
        "the job ended before the fault"
    );

    // To the end; the final checkpoint (written when the pserver is stopped) holds
    // every pass.
    succeeded(&jobs, DURABLE_JOB, &pods_dir).await;
    final_ledger_holds(&api, &pods_dir, &w.backend, DURABLE_JOB, PASSES).await;
    assert!(
        claim_dir.join(DURABLE_JOB).try_exists().expect("stat"),
        "the checkpoints are on the claim's volume: {}",
        claim_dir.display()
    );

    // Deleting the job deletes its claim (owned by it) and the claim's volume.
    jobs.delete(DURABLE_JOB, &DeleteParams::default())
        .await
        .expect("delete the job");
    let gone = wait_until(within, || async {
        api.get("trainingjobs", NS, DURABLE_JOB).is_none()
            && api.get("persistentvolumeclaims", NS, &claim).is_none()
            && !claim_dir.try_exists().expect("stat")
    })
    .await;
    assert!(gone, "the job's claim or its volume stayed");
    stop.cancel();
    operator.await.expect("operator");
}
