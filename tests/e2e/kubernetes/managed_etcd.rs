//! A job on the etcd the operator runs for it (`etcd.managed`, three members, each on a
//! claim of its own), run by the test kubelet as real etcd processes that find one
//! another by their pods' DNS names: losing one member's pod changes nothing for the job.
//! The managed etcd speaks mutual TLS with the job's certificate and has authentication
//! on: the job's pods use the job's own etcd user and token (the operator reads its
//! progress from the master with the token); the root password stays with the operator.

use std::sync::Arc;
use std::time::Duration;

use edl_coord::SNAPSHOT_HASH_LEN;
use edl_coord::{Backend, EtcdBackend, EtcdConfig};
use edl_job::JobKeys;
use edl_operator::TrainingJob;
use edl_operator::crd::EtcdSnapshots;
use edl_operator::crd::{EtcdSpec, Phase};
use edl_operator::metrics::Metrics;
use edl_testkit::kube_api::FakeApi;
use edl_testkit::s3::S3Server;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::Api;
use kube::api::{DeleteParams, PostParams};

use super::{
    NS, OnOperator, final_ledger_holds, mnist_job, pod_logs, restore, secret_value, succeeded,
    tls_of, uid,
};
use crate::support::{World, wait_until};
use crate::trainer::mnist;

/// Where the job's etcd snapshots go.
const SNAPSHOTS: &str = "s3://snaps/mnist-managed/etcd";

/// The leading master snapshots the managed etcd (as its root, with the password it
/// got by reference to `<job>-etcd-root`, over the job's mutual TLS) into the job's
/// object store: three snapshots or more over time, the older deleted (a new one is
/// whole in the folder before the oldest goes, so a third is there for a moment), each
/// whole (its hash matches its data).
async fn snapshots_are_taken_whole(s3: &S3Server, pods_dir: &std::path::Path) {
    let (store, _) = edl_storage::Location::parse(SNAPSHOTS)
        .and_then(|l| l.open_with(s3.env()))
        .expect("the store");
    let snapshots = || snapshots_in(s3, SNAPSHOTS);
    // Three: the first at once, the others every two seconds.
    let seen = std::sync::Mutex::new(std::collections::BTreeSet::new());
    let three = wait_until(Duration::from_secs(60), || async {
        let now = snapshots().await;
        let mut seen = seen.lock().expect("lock");
        seen.extend(now.into_iter().map(|o| o.key));
        seen.len() >= 3
    })
    .await;
    assert!(three, "snapshots: {seen:?}\n{}", pod_logs(pods_dir));
    // The newest two kept: at most two once the oldest is deleted.
    let kept = wait_until(Duration::from_secs(30), || async {
        let now = snapshots().await.len();
        (1..=2).contains(&now)
    })
    .await;
    let now = snapshots().await;
    assert!(kept && !now.is_empty() && now.len() <= 3, "{now:?}");
    for o in now {
        let b = store.get(&o.key).await.expect("read the snapshot");
        let (data, hash) = b.split_at(b.len() - SNAPSHOT_HASH_LEN);
        assert_eq!(
            ring::digest::digest(&ring::digest::SHA256, data).as_ref(),
            hash,
            "{} is whole",
            o.key
        );
    }
}

/// The snapshots in the folder `location` of `s3`, oldest first.
pub(super) async fn snapshots_in(s3: &S3Server, location: &str) -> Vec<edl_storage::ObjectInfo> {
    let (store, folder) = edl_storage::Location::parse(location)
        .and_then(|l| l.open_with(s3.env()))
        .expect("the store");
    let mut found: Vec<_> = store
        .list(&folder)
        .await
        .unwrap_or_default()
        .into_iter()
        .filter(|o| {
            o.key
                .rsplit('/')
                .next()
                .is_some_and(|n| n.starts_with("snapshot-"))
        })
        .collect();
    found.sort_by(|a, b| a.key.cmp(&b.key));
    found
}

/// MNIST job `name` ([`mnist_job`], a 5 s lease) on the etcd the operator runs for it.
pub(super) fn managed_mnist_job(name: &str, data: (&str, &str), passes: u32) -> TrainingJob {
    mnist_job(
        name,
        data,
        passes,
        "5s",
        EtcdSpec {
            managed: true,
            ..EtcdSpec::default()
        },
    )
}

/// An S3 server (under `w`'s directory) with the bucket `snaps`, the job's storage
/// Secret `storage` holding its credentials, and `tj`'s etcd snapshots taken into
/// `location` every two seconds, the newest two kept.
pub(super) async fn snapshots_to_s3(
    w: &World,
    client: &kube::Client,
    tj: &mut TrainingJob,
    location: &str,
) -> S3Server {
    let s3 = S3Server::start(&w.dir.path().join("s3")).expect("the S3 server");
    s3.create_bucket("snaps").expect("a bucket");
    let storage = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some("storage".into()),
            ..Default::default()
        },
        data: Some(
            s3.env()
                .into_iter()
                .map(|(k, v)| (k, k8s_openapi::ByteString(v.into_bytes())))
                .collect(),
        ),
        ..Default::default()
    };
    Api::<Secret>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &storage)
        .await
        .expect("the storage Secret");
    tj.spec.storage_secret = Some("storage".into());
    tj.spec.etcd.snapshots = EtcdSnapshots {
        location: Some(location.into()),
        every: Some("2s".into()),
        keep: Some(2),
        disabled: false,
    };
    s3
}

/// The job trains with its managed etcd's three members; member 0's pod is deleted with
/// no grace period (SIGKILL, as when its node is lost) after its data is on its claim;
/// the pod comes back on the same claim and rejoins, the job goes on (a later pass),
/// its pserver keeps its shard (no restore: the same incarnation), and it succeeds with
/// every pass in its final checkpoint's ledger, read from the managed etcd, which stays
/// up after the job ended (it holds the job's final state) until the job is deleted.
/// Then member 1 hangs (SIGSTOP): its liveness probe has the kubelet kill it, and its
/// pod is replaced and Ready again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_managed_etcd_loses_a_member_pod_and_the_job_loses_nothing() {
    const MANAGED_JOB: &str = "mnist-managed";
    const PASSES: u32 = 8;
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
    let mut tj = managed_mnist_job(MANAGED_JOB, (&train, &test), PASSES);
    assert_eq!(tj.spec.etcd.members, 3, "the default");
    let s3 = snapshots_to_s3(&w, &client, &mut tj, SNAPSHOTS).await;
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);
    jobs.create(&PostParams::default(), &tj)
        .await
        .expect("create the job");
    let status = || {
        let jobs = jobs.clone();
        async move { jobs.get(MANAGED_JOB).await.ok().and_then(|j| j.status) }
    };
    let within = Duration::from_secs(120);
    let training = wait_until(within, || async {
        status()
            .await
            .is_some_and(|s| s.pass >= Some(1) && s.phase == Phase::Running)
    })
    .await;
    assert!(training, "{:?}\n{}", status().await, pod_logs(&pods_dir));
    // The managed etcd, as the operator reaches it: only over mutual TLS with the job's
    // certificate, and then only as a user; the job's user (from the Secret every job
    // pod requires) keeps to the job's keys.
    let resolve = _kubelet.resolver();
    let endpoints: Vec<String> = edl_operator::objects::etcd_endpoints(&tj)
        .iter()
        .map(|e| resolve(e))
        .collect();
    assert!(
        endpoints.iter().all(|e| e.starts_with("https://")),
        "{endpoints:?}"
    );
    // A trainer's certificate (a job pod's: every role's is of the job's CA).
    let tls = tls_of(&api, &format!("{MANAGED_JOB}-edl-tls-trainer"), MANAGED_JOB);
    // Only a member's certificate makes a peer: at a member's peer port, a trainer's is
    // refused and a member's (the witness that the port answers) is not.
    let member_tls = tls_of(&api, &format!("{MANAGED_JOB}-edl-tls-etcd"), MANAGED_JOB);
    let peer = resolve(&format!(
        "https://{MANAGED_JOB}-etcd-0.{MANAGED_JOB}.{NS}.svc:{}",
        edl_operator::objects::ETCD_PEER_PORT
    ));
    let peer = peer.trim_start_matches("https://");
    assert!(
        peer_answers(peer, &member_tls).await,
        "a member's certificate must reach the peer port at {peer}"
    );
    assert!(
        !peer_answers(peer, &tls).await,
        "a trainer's certificate must not be taken as an etcd peer"
    );
    let cfg = EtcdConfig::new(endpoints.clone()).with_dial_timeout(Duration::from_secs(2));
    let plain = EtcdBackend::connect(EtcdConfig {
        endpoints: endpoints
            .iter()
            .map(|e| e.replace("https://", "http://"))
            .collect(),
        ..cfg.clone()
    })
    .await;
    assert!(plain.is_err(), "plain TCP must be refused");
    let r = EtcdBackend::connect_with_tls(cfg.clone(), tls.clone()).await;
    assert!(
        matches!(r, Err(edl_coord::Error::PermissionDenied(_))),
        "the job's certificate without a user must be refused: {:?}",
        r.err()
    );
    let credentials = format!("{MANAGED_JOB}-edl-credentials");
    let text = |k: &str| String::from_utf8(secret_value(&api, &credentials, k)).expect("UTF-8");
    let as_job = EtcdBackend::connect_with_tls(
        cfg.clone()
            .with_auth(text("EDL_ETCD_USER"), text("EDL_ETCD_PASSWORD")),
        tls.clone(),
    )
    .await
    .expect("connect as the job's etcd user");
    assert_eq!(text("EDL_ETCD_USER"), format!("edl-job-{NS}.{MANAGED_JOB}"));
    let keys = JobKeys::new(&super::etcd_job(MANAGED_JOB));
    assert!(
        as_job
            .get(&keys.spec())
            .await
            .expect("the job's spec")
            .is_some(),
        "the job's user reads the job's keys"
    );
    let r = as_job
        .put("/edl/another-job/job/spec", b"x".to_vec(), None)
        .await;
    assert!(
        matches!(r, Err(edl_coord::Error::PermissionDenied(_))),
        "the job's user must keep to its keys: {r:?}"
    );
    let etcd: Arc<dyn Backend> = Arc::new(as_job);
    let before = restore(&etcd, &keys)
        .await
        .expect("the pserver's restore record");
    let trainer = api
        .get("pods", NS, &format!("{MANAGED_JOB}-trainer-0"))
        .expect("a trainer");
    let from = trainer["spec"]["containers"][0]["envFrom"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|f| &f["secretRef"])
        .find(|r| r["name"] == credentials.as_str())
        .unwrap_or_else(|| panic!("the trainer takes {credentials}: {trainer}"));
    assert!(from["optional"].is_null(), "required: {from}");

    network_policy_keeps_the_job_to_itself(&client, &api, MANAGED_JOB).await;

    // `/metrics` of the master and a trainer, each on its pod's metrics port: with the
    // job's scrape-only token (what a Prometheus is given), not with the job token.
    let metrics_token = String::from_utf8(secret_value(
        &api,
        &format!("{MANAGED_JOB}-edl-metrics"),
        "EDL_METRICS_TOKEN",
    ))
    .expect("UTF-8");
    for pod in ["master-0", "trainer-0"] {
        let addr = resolve(&format!(
            "{MANAGED_JOB}-{pod}.{MANAGED_JOB}.{NS}.svc:{}",
            edl_operator::objects::METRICS_PORT
        ));
        let scraped = crate::monitoring::scrape(&addr, Some(&metrics_token)).await;
        assert!(
            scraped.starts_with("HTTP/1.1 200") && scraped.contains("edl_"),
            "{pod} at {addr}: {scraped}"
        );
        let with_job_token = crate::monitoring::scrape(&addr, Some(&text("EDL_JOB_TOKEN"))).await;
        assert!(
            with_job_token.starts_with("HTTP/1.1 401"),
            "{pod}: the job token must not open /metrics: {with_job_token}"
        );
    }

    snapshots_are_taken_whole(&s3, &pods_dir).await;

    certificates_rotate_without_a_restart(&api, &client, &_kubelet, &etcd, &keys).await;

    // Member 0 on its claim, then its pod lost.
    let member = format!("{MANAGED_JOB}-etcd-0");
    let claim = api
        .get(
            "persistentvolumeclaims",
            NS,
            &format!("{MANAGED_JOB}-etcd-data-0"),
        )
        .expect("member 0's claim");
    let claim_dir = pods_dir
        .join("claims")
        .join(claim["metadata"]["uid"].as_str().expect("uid"));
    assert!(
        claim_dir
            .join("data")
            .join("member")
            .try_exists()
            .expect("stat"),
        "member 0's data is not on its claim: {}",
        claim_dir.display()
    );
    let pass_at_loss = status().await.and_then(|s| s.pass).expect("a pass");
    let old = uid(&api, &member);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.delete(&member, &DeleteParams::default().grace_period(0))
        .await
        .expect("delete member 0's pod");
    let back = wait_until(within, || async {
        api.get("pods", NS, &member).is_some_and(|p| {
            p["metadata"]["uid"].as_str() != old.as_deref() && p["status"]["phase"] == "Running"
        })
    })
    .await;
    assert!(back, "member 0 was not recreated:\n{}", pod_logs(&pods_dir));
    let went_on = wait_until(Duration::from_secs(300), || async {
        status()
            .await
            .is_some_and(|s| s.pass > Some(pass_at_loss) || s.phase.is_finished())
    })
    .await;
    assert!(
        went_on,
        "the job stalled after the loss: {:?}\n{}",
        status().await,
        pod_logs(&pods_dir)
    );

    // Member 1 hangs (its process stopped, as a deadlock or a stuck disk would leave
    // it): alive to the kernel, its liveness probe fails, the kubelet kills it, and its
    // pod, ended, is replaced on its claim. First the witness that its probes pass
    // while it is well: its pod is Ready.
    let hung = format!("{MANAGED_JOB}-etcd-1");
    let ready = |name: String| {
        let api = api.clone();
        move || {
            let api = api.clone();
            let name = name.clone();
            async move {
                api.get("pods", NS, &name).is_some_and(|p| {
                    p["status"]["conditions"].as_array().is_some_and(|cs| {
                        cs.iter()
                            .any(|c| c["type"] == "Ready" && c["status"] == "True")
                    })
                })
            }
        }
    };
    assert!(
        wait_until(within, ready(hung.clone())).await,
        "member 1 never Ready: {:?}",
        api.get("pods", NS, &hung)
    );
    let old = uid(&api, &hung);
    let pid = _kubelet.pid(&hung).expect("member 1's process");
    edl_testkit::child::signal(pid, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
    let replaced = wait_until(within, || async {
        api.get("pods", NS, &hung).is_some_and(|p| {
            p["metadata"]["uid"].as_str() != old.as_deref() && p["status"]["phase"] == "Running"
        })
    })
    .await;
    assert!(
        replaced,
        "the hung member was not replaced:\n{}",
        pod_logs(&pods_dir)
    );
    let killed = status().await.is_some_and(|s| {
        s.recoveries
            .iter()
            .any(|r| r.pod == hung && r.reason.contains("137"))
    });
    assert!(
        killed,
        "no recovery of {hung} killed (137): {:?}",
        status().await
    );
    assert!(
        wait_until(within, ready(hung.clone())).await,
        "the new member 1 never Ready: {:?}",
        api.get("pods", NS, &hung)
    );

    // Member 2's claim lost with its pod (its node gone with a local volume): the
    // operator takes the member out of the etcd's membership and adds a new one at its
    // URL; the member's new pod, on a new and empty claim, joins the others and gets
    // their data.
    let root_password = String::from_utf8(secret_value(
        &api,
        &edl_operator::objects::etcd_root_secret_name(MANAGED_JOB),
        edl_operator::objects::ETCD_ROOT_KEY,
    ))
    .expect("UTF-8");
    let root =
        EtcdBackend::connect_with_tls(cfg.clone().with_auth("root", root_password), tls.clone())
            .await
            .expect("connect as root");
    let lost = format!("{MANAGED_JOB}-etcd-2");
    let lost_claim = format!("{MANAGED_JOB}-etcd-data-2");
    let members = root.members().await.expect("the members");
    let old_id = members
        .iter()
        .find(|m| m.name == "etcd-2")
        .map(|m| m.id)
        .expect("member 2 in the membership");
    let old_claim = api
        .get("persistentvolumeclaims", NS, &lost_claim)
        .and_then(|c| c["metadata"]["uid"].as_str().map(str::to_owned))
        .expect("member 2's claim");
    let old = uid(&api, &lost);
    let claims: Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
        Api::namespaced(client.clone(), NS);
    claims
        .delete(&lost_claim, &DeleteParams::default())
        .await
        .expect("delete member 2's claim");
    pods.delete(&lost, &DeleteParams::default().grace_period(0))
        .await
        .expect("delete member 2's pod");
    let rejoined = wait_until(Duration::from_secs(180), || async {
        let claim = api
            .get("persistentvolumeclaims", NS, &lost_claim)
            .and_then(|c| c["metadata"]["uid"].as_str().map(str::to_owned));
        let pod_new = api.get("pods", NS, &lost).is_some_and(|p| {
            p["metadata"]["uid"].as_str() != old.as_deref() && p["status"]["phase"] == "Running"
        });
        let member_new = root.members().await.is_ok_and(|ms| {
            ms.len() == 3
                && ms.iter().all(|m| m.started())
                && ms.iter().any(|m| m.name == "etcd-2" && m.id != old_id)
        });
        claim.is_some_and(|c| c != old_claim) && pod_new && member_new
    })
    .await;
    assert!(
        rejoined,
        "member 2 did not rejoin on a new claim: {:?}\n{}",
        root.members().await,
        pod_logs(&pods_dir)
    );
    // Its data came from the others: the job's spec, read through member 2 alone.
    let member_2 = resolve(&format!(
        "https://{MANAGED_JOB}-etcd-2.{MANAGED_JOB}.{NS}.svc:{}",
        edl_operator::objects::ETCD_PORT
    ));
    // A member started is not yet one that answers at once on a loaded machine: asked
    // until it does (the dial timeout alone once failed the first ask).
    let last = std::sync::Mutex::new(String::new());
    let through_2 = wait_until(Duration::from_secs(30), || async {
        let cfg = EtcdConfig::new([member_2.clone()])
            .with_dial_timeout(Duration::from_secs(2))
            .with_auth(text("EDL_ETCD_USER"), text("EDL_ETCD_PASSWORD"));
        let read = match EtcdBackend::connect_with_tls(cfg, tls.clone()).await {
            Ok(b) => b.get(&keys.spec()).await.map(|v| v.is_some()),
            Err(e) => Err(e),
        };
        *last.lock().expect("lock") = format!("{read:?}");
        read.is_ok_and(|found| found)
    })
    .await;
    assert!(
        through_2,
        "member 2 does not serve the job's keys: {}",
        last.lock().expect("lock")
    );
    let replaced_events: Vec<_> = api
        .list("events", NS)
        .into_iter()
        .filter(|e| e["reason"] == "EtcdMemberReplaced")
        .collect();
    assert!(!replaced_events.is_empty(), "no EtcdMemberReplaced event");

    succeeded(&jobs, MANAGED_JOB, &pods_dir).await;
    let after = restore(&etcd, &keys).await.expect("the restore record");
    assert_eq!(
        after.incarnation, before.incarnation,
        "the pserver restored its shard: the loss of an etcd member cost a restore"
    );
    final_ledger_holds(&api, &pods_dir, &etcd, MANAGED_JOB, PASSES).await;
    for i in 0..3 {
        let p = api
            .get("pods", NS, &format!("{MANAGED_JOB}-etcd-{i}"))
            .expect("the member stays after the job ended");
        assert_eq!(p["status"]["phase"], "Running", "member {i}");
    }
    stop.cancel();
    operator.await.expect("operator");
}

/// Whether etcd's peer port at `addr` answers `GET /members` (what a member asks its
/// peers) over TLS with `tls`'s certificate.
async fn peer_answers(addr: &str, tls: &edl_proto::tls::Tls) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(tcp) = tokio::net::TcpStream::connect(addr).await else {
        return false;
    };
    let Ok(mut s) = tls
        .connect_alpn(addr, tcp, edl_proto::tls::ALPN_HTTP1)
        .await
    else {
        return false;
    };
    let request = format!("GET /members HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if s.write_all(request.as_bytes()).await.is_err() || s.flush().await.is_err() {
        return false;
    }
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut answer)).await;
    answer.starts_with(b"HTTP/1.1 200")
}

/// The job's NetworkPolicy, as a cluster enforcing it decides: the job's pods reach one
/// another (trainer to master, trainer to etcd, etcd member to member), the cluster DNS
/// and the namespace the operator names for egress (`storage`), and nothing else; the
/// operator's pods reach the master and the etcd; Prometheus's namespace (`monitoring`)
/// reaches the metrics port only; a pod of another job in the same namespace, and a pod
/// labelled as the job's in another namespace, reach nothing.
async fn network_policy_keeps_the_job_to_itself(client: &kube::Client, api: &FakeApi, job: &str) {
    use edl_operator::objects::{DNS, ETCD_PEER_PORT, ETCD_PORT, MASTER_PORT, METRICS_PORT};
    // Pod objects only (each runs `true` and ends).
    let stranger = |name: &str, labels: serde_json::Value| -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": labels},
            "spec": {"restartPolicy": "Never",
                     "containers": [{"name": "c", "image": "x", "command": ["true"]}]},
        }))
        .expect("a pod")
    };
    let make = |ns: &str, pod: Pod| {
        let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
        async move {
            pods.create(&PostParams::default(), &pod)
                .await
                .expect("create a pod")
        }
    };
    let strangers = [
        (
            NS,
            "other-job-trainer",
            serde_json::json!({"edl.dev/job": "other-job"}),
        ),
        (
            "elsewhere",
            "lookalike",
            serde_json::json!({"edl.dev/job": job}),
        ),
        (
            "edl-system",
            "edl-operator-0",
            serde_json::json!({"app.kubernetes.io/name": "edl-operator"}),
        ),
        (
            "monitoring",
            "prometheus-0",
            serde_json::json!({"app": "prometheus"}),
        ),
        ("storage", "minio-0", serde_json::json!({"app": "minio"})),
        (DNS.0, "coredns-0", serde_json::json!({DNS.1.0: DNS.1.1})),
    ];
    for (ns, name, labels) in strangers {
        make(ns, stranger(name, labels)).await;
    }
    let allows = |from: (&str, &str), to: (&str, &str), port: i32| {
        api.network_allows(from, to, u16::try_from(port).expect("a port"))
            .expect("both pods exist")
    };
    let (trainer, master) = (format!("{job}-trainer-0"), format!("{job}-master-0"));
    let (etcd0, etcd1) = (format!("{job}-etcd-0"), format!("{job}-etcd-1"));
    let (trainer, master) = ((NS, trainer.as_str()), (NS, master.as_str()));
    let (etcd0, etcd1) = ((NS, etcd0.as_str()), (NS, etcd1.as_str()));
    assert!(
        api.get("networkpolicies", NS, &format!("{job}-edl"))
            .is_some()
    );
    let (operator, prometheus) = (
        ("edl-system", "edl-operator-0"),
        ("monitoring", "prometheus-0"),
    );
    let (other_job, lookalike) = ((NS, "other-job-trainer"), ("elsewhere", "lookalike"));
    for (from, to, port) in [
        (trainer, master, MASTER_PORT),
        (trainer, etcd0, ETCD_PORT),
        (etcd1, etcd0, ETCD_PEER_PORT),
        (operator, master, MASTER_PORT),
        (operator, etcd0, ETCD_PORT),
        (prometheus, trainer, METRICS_PORT),
        (trainer, (DNS.0, "coredns-0"), 53),
        (trainer, ("storage", "minio-0"), 9000),
        // The witness for the refusals below: neither has a policy of its own, so it
        // takes anything a pod may send.
        (prometheus, lookalike, MASTER_PORT),
        (prometheus, other_job, METRICS_PORT),
    ] {
        assert!(
            allows(from, to, port),
            "{from:?} -> {to:?}:{port} must be allowed"
        );
    }
    for from in [other_job, lookalike] {
        for (to, port) in [
            (master, MASTER_PORT),
            (etcd0, ETCD_PORT),
            (etcd0, ETCD_PEER_PORT),
            (trainer, METRICS_PORT),
        ] {
            assert!(
                !allows(from, to, port),
                "{from:?} -> {to:?}:{port} must be refused"
            );
        }
    }
    for (from, to, port) in [
        (prometheus, master, MASTER_PORT),
        (trainer, lookalike, MASTER_PORT),
        (trainer, other_job, METRICS_PORT),
        (trainer, prometheus, METRICS_PORT),
        (trainer, (DNS.0, "coredns-0"), 80),
    ] {
        assert!(
            !allows(from, to, port),
            "{from:?} -> {to:?}:{port} must be refused"
        );
    }
}

/// Rotation without a restart: the master's and the etcd members' certificates, each
/// put in its Secret two thirds through its life (one of the job's CA, for the role's
/// names, as though issued 70 days ago), are issued again by the operator in the same
/// Secrets; the kubelet swaps the new files into the running pods' volumes, and the
/// master and an etcd member present the renewed certificate from their next
/// handshake, the same processes all along (their pids).
async fn certificates_rotate_without_a_restart(
    api: &FakeApi,
    client: &kube::Client,
    kubelet: &edl_testkit::kubelet::Kubelet,
    etcd: &Arc<dyn Backend>,
    keys: &JobKeys,
) {
    use edl_operator::objects::{Role, role_certificate, tls_secret_name};
    use k8s_openapi::ByteString;
    use k8s_openapi::api::core::v1::Secret;
    use std::time::SystemTime;
    const JOB: &str = "mnist-managed";
    const DAY: Duration = Duration::from_secs(86_400);
    let text =
        |secret: &str, key: &str| String::from_utf8(secret_value(api, secret, key)).expect("UTF-8");
    let ca_secret = format!("{JOB}-edl-ca");
    let ca =
        edl_proto::tls::JobCa::from_pem(&text(&ca_secret, "ca.crt"), &text(&ca_secret, "ca.key"))
            .expect("the job's CA");
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    // Where each presents its certificate: the leading master's address, and member
    // 0's client port.
    let (masters, _) = etcd
        .range(&keys.master_election())
        .await
        .expect("the masters");
    let master_addr = masters
        .iter()
        .min_by_key(|kv| kv.create_revision)
        .map(|kv| String::from_utf8_lossy(&kv.value).into_owned())
        .expect("a master");
    let member_addr = kubelet.resolver()(&format!(
        "{JOB}-etcd-0.{JOB}.{NS}.svc:{}",
        edl_operator::objects::ETCD_PORT
    ));
    let pids =
        |pods: &[&str]| -> Vec<Option<u32>> { pods.iter().map(|p| kubelet.pid(p)).collect() };
    let pods = [format!("{JOB}-master-0"), format!("{JOB}-etcd-0")];
    let pods: Vec<&str> = pods.iter().map(String::as_str).collect();
    let before = pids(&pods);
    assert!(before.iter().all(Option::is_some), "{before:?}");
    let mut due = Vec::new();
    for (role, addr) in [(Role::Master, &master_addr), (Role::Etcd, &member_addr)] {
        let name = tls_secret_name(JOB, role);
        let (cn, names, usage) = role_certificate(JOB, NS, Some(role));
        let now = SystemTime::now();
        let old = ca
            .issue_between(&cn, names, usage, now - 70 * DAY, now + 20 * DAY)
            .expect("a certificate");
        let mut s = secrets.get(&name).await.expect("the role's Secret");
        let data = s.data.get_or_insert_with(Default::default);
        data.insert(
            "tls.crt".into(),
            ByteString(old.cert_pem.clone().into_bytes()),
        );
        data.insert("tls.key".into(), ByteString(old.key_pem.into_bytes()));
        secrets
            .replace(&name, &PostParams::default(), &s)
            .await
            .expect("put the certificate that is due");
        due.push((name, addr.clone(), old.cert_pem));
    }
    // Any of the job's own certificates verifies the servers.
    let tls = tls_of(api, &format!("{JOB}-edl-tls-trainer"), JOB);
    for (name, addr, old) in &due {
        let renewed = wait_until(Duration::from_secs(60), || async {
            let now = text(name, "tls.crt");
            now != *old && presented(addr, &tls).await == Some(der(&now))
        })
        .await;
        assert!(
            renewed,
            "{name}: at {addr}, the certificate presented is not the renewed one in the \
             Secret (the due one is {}presented)",
            if presented(addr, &tls).await == Some(der(old)) {
                ""
            } else {
                "not "
            }
        );
    }
    assert_eq!(pids(&pods), before, "the processes were not restarted");
}

/// The (first) certificate of `pem`, as DER.
fn der(pem: &str) -> Vec<u8> {
    let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
    edl_testkit::kube_api::base64_decode(&body).expect("base64")
}

/// The certificate the TLS server at `addr` presents to a new connection made with
/// `tls` (DER), if the handshake succeeds.
async fn presented(addr: &str, tls: &edl_proto::tls::Tls) -> Option<Vec<u8>> {
    let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
    let s = tls
        .connect_alpn(addr, tcp, edl_proto::tls::ALPN_H2)
        .await
        .ok()?;
    let chain = s.get_ref().1.peer_certificates()?;
    Some(chain.first()?.as_ref().to_vec())
}
