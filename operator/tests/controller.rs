//! The controller (`edl_operator::controller`) against the fake API server and a real
//! etcd. The test plays a minimal kubelet: it marks created pods Running and removes
//! pods being deleted; the pods run no process here (the end-to-end test with real
//! `edl` processes is a separate one). What it shows: a TrainingJob gets its finalizer,
//! its spec in etcd, its service and pods, a status; the scale subresource resizes it
//! (2 -> 4 -> 1, surplus trainers deleted with their drain grace period), with Events
//! and `scale/trainers` in etcd; a deleted pserver pod is recreated; deleting the job
//! removes its etcd keys and then the resource. The controller runs under leader
//! election, as `edl operator run` runs it, and every request it made is one the
//! operator's RBAC rules in `deploy/rbac.yaml` allow, each rule used. The autoscaler's
//! test is in `controller/autoscale.rs`, the per-job etcd credentials' in
//! `controller/credentials.rs`.

use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, EtcdBackend, EtcdConfig};
use edl_job::{JobKeys, JobName, Record, ScaleRecord};
use edl_operator::TrainingJob;
use edl_operator::controller::{self, ControllerConfig};
use edl_operator::crd::{EtcdSpec, Phase, VolumeSource};
use edl_operator::leader::{self, LeaseElection};
use edl_operator::metrics::Metrics;
use edl_testkit::etcd::EtcdCluster;
use edl_testkit::kube_api::{Access, FakeApi, ResourceType};
use edl_testkit::wait_until;
use futures::StreamExt;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, Config};
use serde_json::json;
use tokio_util::sync::CancellationToken;

#[path = "controller/autoscale.rs"]
mod autoscale;
#[path = "controller/certificates.rs"]
mod certificates;
#[path = "controller/credentials.rs"]
mod credentials;
#[path = "controller/disruption.rs"]
mod disruption;
#[path = "controller/nodes.rs"]
mod nodes;
#[path = "controller/pod_security.rs"]
mod pod_security;
#[path = "controller/queues.rs"]
mod queues;

const NS: &str = "ml";
/// The operator's own namespace, where its Lease is (as in deploy/).
const LEASE_NS: &str = "edl-system";
const JOB: &str = "mnist";

/// Marks new pods Running and removes terminating ones (as a kubelet whose containers
/// stop at once), until `stop`.
fn kubelet(api: Arc<FakeApi>, stop: CancellationToken) -> tokio::task::JoinHandle<()> {
    on_pod_changes(api, stop, |api| {
        for pod in api.list("pods", NS) {
            let name = pod["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            if !pod["metadata"]["deletionTimestamp"].is_null() {
                let _ = api.delete("pods", NS, &name, Some(0));
            } else if pod["status"]["phase"].is_null() {
                let _ = api.patch_status(
                    "pods",
                    NS,
                    &name,
                    &json!({"phase": "Running", "podIP": "127.0.0.1"}),
                );
            }
        }
    })
}

/// Runs `settle` at once and after every change to a pod, until `stop`: a test's
/// kubelet.
fn on_pod_changes(
    api: Arc<FakeApi>,
    stop: CancellationToken,
    settle: impl Fn(&FakeApi) + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut changes = api.subscribe("pods").boxed();
        settle(&api);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                change = changes.next() => {
                    if change.is_none() {
                        return;
                    }
                    settle(&api);
                }
            }
        }
    })
}

/// The controller as these tests run it: `NS` only, resynced every 300 ms.
fn test_config() -> ControllerConfig {
    ControllerConfig {
        namespace: Some(NS.to_owned()),
        resync: Duration::from_millis(300),
        ..ControllerConfig::default()
    }
}

/// TrainingJob `JOB` in `NS` (MNIST's MLP) with `cluster` (TOML lines of `[cluster]`), on
/// the etcd at `endpoints`.
fn mnist_on(endpoints: Vec<String>, cluster: &str) -> TrainingJob {
    let spec = edl_job::JobSpec::parse_toml(&format!(
        "name = \"{JOB}\"\n[data]\ntrain = [\"/d/a-*.recordio\"]\n[model]\nkind = \"mnist_mlp\"\n\
         [cluster]\n{cluster}"
    ))
    .expect("spec");
    let mut tj = TrainingJob::from_job_spec(&spec, "edl:test", Some(NS));
    tj.spec.etcd = EtcdSpec {
        endpoints,
        ..EtcdSpec::default()
    };
    tj
}

fn pod_names(api: &FakeApi, role: &str) -> Vec<String> {
    let mut names: Vec<String> = api
        .list("pods", NS)
        .into_iter()
        .filter(|p| p["metadata"]["labels"]["edl.dev/role"] == role)
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_owned))
        .collect();
    names.sort();
    names
}

fn events(api: &FakeApi) -> Vec<String> {
    api.list("events", NS)
        .into_iter()
        .filter_map(|e| e["reason"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_runs_scales_recovers_and_cleans_up_a_job() {
    let etcd = EtcdCluster::start(1).await.expect("etcd");
    // The operator's own client: its requests are the ones RBAC must allow.
    let (api, client, operator_client) = fake_api().await;
    let stop = CancellationToken::new();
    let kubelet = kubelet(api.clone(), stop.clone());
    let metrics = Arc::new(Metrics::default());
    let config = test_config();
    let election = LeaseElection {
        namespace: LEASE_NS.to_owned(),
        name: "edl-operator".to_owned(),
        identity: "test-operator".to_owned(),
        lease: Duration::from_secs(3),
        renew: Duration::from_millis(200),
    };
    let operator = {
        let (c, m) = (operator_client.clone(), metrics.clone());
        tokio::spawn(leader::run(
            operator_client,
            election,
            stop.clone(),
            move |term| controller::run(c.clone(), config.clone(), m.clone(), term),
        ))
    };

    let mut tj = mnist_on(
        etcd.endpoints(),
        "trainers = 2\nmin_trainers = 1\nmax_trainers = 4\n",
    );
    // deploy/rbac.yaml lets the operator at Secrets only in namespaces that bind
    // edl-operator-credentials (default): a job here runs without TLS between its pods.
    // The credentials test (namespace default) covers the job's TLS Secret.
    tj.spec.plaintext = true;
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);
    jobs.create(&PostParams::default(), &tj)
        .await
        .expect("create the job");

    let within = Duration::from_secs(20);
    let every = Duration::from_millis(50);
    let ok = wait_until(within, every, || async {
        pod_names(&api, "trainer").len() == 2
            && pod_names(&api, "master").len() == 1
            && pod_names(&api, "pserver").len() == 1
    })
    .await;
    assert!(ok, "pods: {:?}", api.list("pods", NS));
    let stored = api.get("trainingjobs", NS, JOB).expect("job");
    assert_eq!(stored["metadata"]["finalizers"][0], "edl.dev/etcd-cleanup");
    assert!(
        api.get("services", NS, JOB).is_some(),
        "the headless service"
    );
    let backend: Arc<dyn Backend> = Arc::new(
        EtcdBackend::connect(EtcdConfig::new(etcd.endpoints()))
            .await
            .expect("etcd client"),
    );
    // The job's name in etcd carries its namespace.
    let keys = JobKeys::new(&JobName::new(format!("{NS}.{JOB}")).expect("name"));
    assert!(
        backend.get(&keys.spec()).await.expect("get").is_some(),
        "the spec is published before the processes start"
    );
    let running = |n: u32| {
        let jobs = jobs.clone();
        async move {
            jobs.get(JOB)
                .await
                .ok()
                .and_then(|j| j.status)
                .is_some_and(|s| {
                    s.trainers.running == n && s.trainers.desired == n && s.phase == Phase::Running
                })
        }
    };
    assert!(
        wait_until(within, every, || running(2)).await,
        "{:?}",
        jobs.get(JOB).await
    );

    // A NetworkPolicy not the operator's (edited by hand: everything let out) is
    // written back at the next round.
    let policies: Api<k8s_openapi::api::networking::v1::NetworkPolicy> =
        Api::namespaced(client.clone(), NS);
    let policy_name = format!("{JOB}-edl");
    let own = policies
        .get(&policy_name)
        .await
        .expect("the job's NetworkPolicy");
    policies
        .patch(
            &policy_name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"egress": [{}]}})),
        )
        .await
        .expect("edit the NetworkPolicy");
    let edited = |p: &serde_json::Value| p["spec"]["egress"] == json!([{}]);
    assert!(edited(
        &api.get("networkpolicies", NS, &policy_name).expect("it")
    ));
    let restored = wait_until(within, every, || async {
        api.get("networkpolicies", NS, &policy_name)
            .is_some_and(|p| serde_json::to_value(&own.spec).ok() == Some(p["spec"].clone()))
    })
    .await;
    assert!(
        restored,
        "{:?}",
        api.get("networkpolicies", NS, &policy_name)
    );

    // 2 -> 4 through the scale subresource.
    jobs.patch_scale(
        JOB,
        &PatchParams::default(),
        &Patch::Merge(&json!({"spec": {"replicas": 4}})),
    )
    .await
    .expect("scale to 4");
    assert!(
        wait_until(within, every, || running(4)).await,
        "{:?}",
        jobs.get(JOB).await
    );
    assert_eq!(
        pod_names(&api, "trainer"),
        (0..4)
            .map(|i| format!("{JOB}-trainer-{i}"))
            .collect::<Vec<_>>()
    );
    let scale = backend
        .get(&keys.scale_trainers())
        .await
        .expect("get")
        .map(|kv| ScaleRecord::decode(&kv.value).expect("record").trainers);
    assert_eq!(scale, Some(4));

    // 4 -> 1: the surplus trainers are deleted with their drain grace period.
    let mut deletions = api.subscribe("pods").boxed();
    jobs.patch_scale(
        JOB,
        &PatchParams::default(),
        &Patch::Merge(&json!({"spec": {"replicas": 1}})),
    )
    .await
    .expect("scale to 1");
    let mut drained = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    while drained.len() < 3 && tokio::time::Instant::now() < deadline {
        let Ok(Some((kind, pod))) = tokio::time::timeout_at(deadline, deletions.next()).await
        else {
            break;
        };
        if kind == "MODIFIED" && !pod["metadata"]["deletionTimestamp"].is_null() {
            assert_eq!(
                pod["metadata"]["deletionGracePeriodSeconds"], 30,
                "the drain grace"
            );
            drained.push(
                pod["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            );
        }
    }
    drained.sort();
    assert_eq!(
        drained,
        ["mnist-trainer-1", "mnist-trainer-2", "mnist-trainer-3"]
    );
    assert!(
        wait_until(within, every, || running(1)).await,
        "{:?}",
        jobs.get(JOB).await
    );

    // A deleted pserver pod comes back.
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), NS);
    let old_uid =
        api.get("pods", NS, "mnist-pserver-0").expect("pserver")["metadata"]["uid"].clone();
    pods.delete("mnist-pserver-0", &DeleteParams::default())
        .await
        .expect("delete the pserver pod");
    let ok = wait_until(within, every, || async {
        api.get("pods", NS, "mnist-pserver-0")
            .is_some_and(|p| p["metadata"]["uid"] != old_uid && p["status"]["phase"] == "Running")
    })
    .await;
    assert!(ok, "the pserver pod was not recreated");
    let ok = wait_until(within, every, || async {
        let e = events(&api);
        ["ScaledUp", "ScaledDown", "PodReplaced"]
            .iter()
            .all(|r| e.iter().any(|x| x == r))
    })
    .await;
    assert!(ok, "events: {:?}", events(&api));
    assert!(metrics.reconciles.get() > 0 && metrics.recoveries.get() >= 1);

    // Deleting the job removes its keys, then the resource; its pods go with it.
    jobs.delete(JOB, &DeleteParams::default())
        .await
        .expect("delete the job");
    let ok = wait_until(within, every, || async {
        api.get("trainingjobs", NS, JOB).is_none() && api.list("pods", NS).is_empty()
    })
    .await;
    assert!(
        ok,
        "job {:?}, pods {:?}",
        api.get("trainingjobs", NS, JOB),
        api.list("pods", NS)
    );
    let (left, _) = backend.range(keys.root()).await.expect("range");
    assert!(left.is_empty(), "etcd keys left: {left:?}");

    // The lease was renewed (an update) while it led.
    let renewed = wait_until(within, every, || async {
        api.accesses()
            .iter()
            .any(|a| a.resource == "leases" && a.verb == "update")
    })
    .await;
    assert!(renewed, "the lease was never renewed");
    stop.cancel();
    operator.await.expect("operator");
    check_rbac(&operator_accesses(&api), &|r, verb| {
        // kube's event Recorder patches an Event that repeats (a series) instead of
        // creating another; no event here repeats. The autoscaler's rules are checked by
        // its own test, the credentials' rule by the credentials test.
        (strings(&r["resources"]) == ["events"] && verb == "patch")
            || autoscaler_rule(r)
            || credentials_rule(r)
            // Only jobs with replicated pservers or a managed etcd make budgets.
            || (strings(&r["resources"]) == ["poddisruptionbudgets"] && verb == "create")
            || kueue_rule(r)
            || volcano_rule(r)
    });
    kubelet.await.expect("kubelet");
}

/// The requests the operator's own client made (its bearer token names it).
fn operator_accesses(api: &FakeApi) -> Vec<Access> {
    api.accesses()
        .into_iter()
        .filter(|a| a.user.as_deref() == Some("edl-operator"))
        .collect()
}

/// The operator's RBAC rules in deploy/rbac.yaml, from the bindings of its ServiceAccount
/// (`edl-system/edl-operator`): a ClusterRoleBinding's ClusterRole holds in every
/// namespace, a RoleBinding's Role or ClusterRole in the binding's namespace (the
/// edl-operator ClusterRole everywhere, edl-operator-election in edl-system,
/// edl-operator-credentials where it is bound). They must allow every request in
/// `accesses` and grant nothing that was not used, but the rules (and verbs)
/// `used_elsewhere` names.
fn check_rbac(accesses: &[Access], used_elsewhere: &dyn Fn(&serde_json::Value, &str) -> bool) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/rbac.yaml");
    let text = std::fs::read_to_string(path).expect("read deploy/rbac.yaml");
    let docs: Vec<serde_json::Value> = serde_norway::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).expect("a YAML document"))
        .collect();
    // (where it holds: None = every namespace, its name, its rules), namespaced first.
    let mut bound: Vec<(Option<String>, String, Vec<serde_json::Value>)> = Vec::new();
    for b in &docs {
        let cluster_wide = match b["kind"].as_str() {
            Some("ClusterRoleBinding") => true,
            Some("RoleBinding") => false,
            _ => continue,
        };
        let operator = b["subjects"].as_array().into_iter().flatten().any(|s| {
            s["kind"] == "ServiceAccount"
                && s["name"] == "edl-operator"
                && s["namespace"] == LEASE_NS
        });
        if !operator {
            continue;
        }
        let ns = (!cluster_wide).then(|| {
            b["metadata"]["namespace"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        });
        let r = &b["roleRef"];
        let role = docs
            .iter()
            .find(|d| {
                d["kind"] == r["kind"]
                    && d["metadata"]["name"] == r["name"]
                    && (r["kind"] == "ClusterRole"
                        || d["metadata"]["namespace"].as_str() == ns.as_deref())
            })
            .unwrap_or_else(|| panic!("no {} {} in deploy/rbac.yaml", r["kind"], r["name"]));
        let name = format!(
            "{} {} in {}",
            r["kind"].as_str().unwrap_or_default(),
            r["name"].as_str().unwrap_or_default(),
            ns.as_deref().unwrap_or("every namespace")
        );
        bound.push((
            ns,
            name,
            role["rules"].as_array().cloned().unwrap_or_default(),
        ));
    }
    bound.sort_by_key(|(ns, _, _)| ns.is_none());
    // (binding, rule index, verb) used.
    let mut used = std::collections::BTreeSet::new();
    assert!(!accesses.is_empty());
    for a in accesses {
        let resource = match &a.subresource {
            Some(sub) => format!("{}/{sub}", a.resource),
            None => a.resource.to_owned(),
        };
        let allowed = bound
            .iter()
            .enumerate()
            .filter(|(_, (ns, _, _))| ns.as_ref().is_none_or(|ns| *ns == a.namespace))
            .find_map(|(set, (_, _, rules))| {
                rules.iter().enumerate().find_map(|(i, r)| {
                    let names = strings(&r["resourceNames"]);
                    (strings(&r["apiGroups"]).contains(&a.group.to_owned())
                        && strings(&r["resources"]).contains(&resource)
                        && strings(&r["verbs"]).iter().any(|v| v == a.verb)
                        && (names.is_empty() || a.name.as_ref().is_some_and(|n| names.contains(n))))
                    .then_some((set, i))
                })
            });
        let (set, i) = allowed.unwrap_or_else(|| {
            panic!("deploy/rbac.yaml does not allow the operator's request {a:?}")
        });
        used.insert((set, i, a.verb));
    }
    for (set, (_, name, rules)) in bound.iter().enumerate() {
        for (i, r) in rules.iter().enumerate() {
            for verb in strings(&r["verbs"]) {
                assert!(
                    used.iter()
                        .any(|(s, j, v)| *s == set && *j == i && *v == verb)
                        || used_elsewhere(r, &verb),
                    "deploy/rbac.yaml grants {verb} on {:?} ({name}, rule {i}), which the \
                     operator did not use: least privilege",
                    r["resources"]
                );
            }
        }
    }
}

fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The rules only `--autoscale` uses (the nodes' rule every operator uses: it watches
/// them).
fn autoscaler_rule(r: &serde_json::Value) -> bool {
    let resources = strings(&r["resources"]);
    resources == ["priorityclasses"] || resources == ["trainingjobs/scale"]
}

/// The rule only jobs with `spec.volcano` use.
fn volcano_rule(r: &serde_json::Value) -> bool {
    strings(&r["apiGroups"]) == ["scheduling.volcano.sh"]
}

/// The rules only an operator that admits jobs through Kueue (`--kueue`) uses.
fn kueue_rule(r: &serde_json::Value) -> bool {
    strings(&r["apiGroups"]) == ["kueue.x-k8s.io"]
}

/// The rule only an operator with admin credentials for a shared etcd uses.
fn credentials_rule(r: &serde_json::Value) -> bool {
    strings(&r["resources"]) == ["secrets"]
}

/// The fake API server, a client for the test, and one that identifies as the operator
/// (its requests are the ones RBAC must allow).
async fn fake_api() -> (Arc<FakeApi>, Client, Client) {
    let api = Arc::new(
        FakeApi::start(ResourceType::for_operator())
            .await
            .expect("fake API server"),
    );
    let client = Client::try_from(Config::new(api.url().parse().expect("url"))).expect("client");
    let mut as_operator = Config::new(api.url().parse().expect("url"));
    as_operator.headers.push((
        http::header::AUTHORIZATION,
        http::HeaderValue::from_static("Bearer edl-operator"),
    ));
    let operator = Client::try_from(as_operator).expect("client");
    (api, client, operator)
}

/// The Running (or another) condition of a job in `ns`: (status, reason, message).
fn condition(api: &FakeApi, ns: &str, job: &str, type_: &str) -> Option<(String, String, String)> {
    let tj = api.get("trainingjobs", ns, job)?;
    let c = tj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)?
        .clone();
    let s = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
    Some((s("status"), s("reason"), s("message")))
}

/// Warning events about `job` with `reason`.
fn warnings(api: &FakeApi, job: &str, reason: &str) -> Vec<String> {
    event_notes(api, NS, job, reason, Some("Warning"))
}

/// The notes of the events in `ns` about `job` with `reason` (of `type_`, if given).
fn event_notes(
    api: &FakeApi,
    ns: &str,
    job: &str,
    reason: &str,
    type_: Option<&str>,
) -> Vec<String> {
    api.list("events", ns)
        .into_iter()
        .filter(|e| {
            e["regarding"]["name"] == job
                && e["reason"] == reason
                && type_.is_none_or(|t| e["type"] == t)
        })
        .map(|e| e["note"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// The TLS setup of a job process with the CA `ca` and the certificate `cert` with its
/// `key` (PEM), checking its peers' certificates against `domain`.
fn pem_tls(
    ca: &str,
    cert: &str,
    key: &str,
    domain: String,
) -> Result<edl_proto::tls::Tls, edl_proto::tls::TlsError> {
    edl_proto::tls::Tls::from_pem(
        ca.as_bytes(),
        "ca",
        Some(edl_proto::tls::PemIdentity {
            cert: cert.as_bytes().to_vec(),
            key: key.as_bytes().to_vec(),
            cert_name: "tls.crt".into(),
            key_name: "tls.key".into(),
        }),
        Some(domain),
        true,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_becomes_conditions_and_events_never_a_silent_pending() {
    let etcd = EtcdCluster::start(1).await.expect("etcd");
    let (api, client, _) = fake_api().await;
    let stop = CancellationToken::new();
    let metrics = Arc::new(Metrics::default());
    let operator = tokio::spawn(controller::run(
        client.clone(),
        test_config(),
        metrics.clone(),
        stop.clone(),
    ));
    // A port nothing listens on: bound, then closed.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let job = |name: &str, endpoints: Vec<String>| {
        let spec = edl_job::JobSpec::parse_toml(&format!(
            "name = \"{name}\"\n[data]\ntrain = [\"mnist/*.recordio\"]\n\
             [model]\nkind = \"mnist_mlp\"\n[cluster]\ntrainers = 1\n"
        ))
        .expect("spec");
        let mut tj = TrainingJob::from_job_spec(&spec, "edl:test", Some(NS));
        tj.spec.etcd = EtcdSpec {
            endpoints,
            ..EtcdSpec::default()
        };
        tj.spec.volumes.data = Some(VolumeSource {
            claim_name: Some("mnist".into()),
            ..VolumeSource::default()
        });
        tj
    };
    let mut bad_image = job("bad-image", etcd.endpoints());
    bad_image.spec.image = "edl:no-such-tag".into();
    let mut no_data = job("no-data", etcd.endpoints());
    no_data.spec.volumes.data = Some(VolumeSource {
        claim_name: Some("missing".into()),
        ..VolumeSource::default()
    });
    let no_etcd = job("no-etcd", vec![format!("http://127.0.0.1:{closed}")]);
    let mut invalid = job("invalid", etcd.endpoints());
    invalid.spec.volumes.data = None;
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);
    for tj in [&bad_image, &no_data, &no_etcd, &invalid] {
        jobs.create(&PostParams::default(), tj)
            .await
            .expect("create a job");
    }

    // The cluster's side: bad-image's containers cannot pull their image; no-data's pods
    // cannot be scheduled (their claim does not exist).
    let within = Duration::from_secs(20);
    let every = Duration::from_millis(50);
    let pods_of = |job: &str| -> Vec<String> {
        api.list("pods", NS)
            .into_iter()
            .filter(|p| p["metadata"]["labels"]["edl.dev/job"] == job)
            .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_owned))
            .collect()
    };
    let created = wait_until(within, every, || async {
        pods_of("bad-image").len() == 3 && pods_of("no-data").len() == 3
    })
    .await;
    assert!(created, "pods: {:?}", api.list("pods", NS));
    for pod in pods_of("bad-image") {
        api.patch_status(
            "pods",
            NS,
            &pod,
            &json!({"phase": "Pending", "containerStatuses": [{
                "name": "edl", "image": "edl:no-such-tag", "imageID": "", "ready": false,
                "restartCount": 0, "state": {"waiting": {"reason": "ErrImagePull",
                "message": "pull access denied for edl, repository does not exist"}}}]}),
        )
        .expect("patch a pod");
    }
    for pod in pods_of("no-data") {
        api.patch_status(
            "pods",
            NS,
            &pod,
            &json!({"phase": "Pending", "conditions": [{"type": "PodScheduled",
                "status": "False", "reason": "Unschedulable",
                "message": "0/3 nodes are available: persistentvolumeclaim \"missing\" not found"}]}),
        )
        .expect("patch a pod");
    }

    let said = |job: &'static str,
                type_: &'static str,
                reason: &'static str,
                needle: &'static str| {
        let api = api.clone();
        async move {
            let ok = wait_until(within, every, || async {
                condition(&api, NS, job, type_)
                    .is_some_and(|(s, r, m)| s == "False" && r == reason && m.contains(needle))
                    && warnings(&api, job, reason)
                        .iter()
                        .any(|n| n.contains(needle))
            })
            .await;
            assert!(
                ok,
                "{job}: no {type_} condition and Warning event {reason} saying {needle:?}: {:?}, \
                 events {:?}",
                api.get("trainingjobs", NS, job)
                    .map(|j| j["status"].clone()),
                warnings(&api, job, reason)
            );
        }
    };
    said("bad-image", "Running", "ErrImagePull", "pull access denied").await;
    said(
        "no-data",
        "Running",
        "Unschedulable",
        "persistentvolumeclaim \"missing\"",
    )
    .await;
    said("no-etcd", "EtcdReachable", "EtcdUnreachable", "").await;
    let phase = |job: &str| {
        api.get("trainingjobs", NS, job)
            .map(|j| j["status"]["phase"].clone())
    };
    for job in ["bad-image", "no-data"] {
        assert_eq!(phase(job), Some(json!("Pending")), "{job}");
    }
    // An invalid job fails, naming the field; it gets no pods.
    let failed = wait_until(within, every, || async {
        condition(&api, NS, "invalid", "Failed").is_some_and(|(s, r, m)| {
            s == "True" && r == "InvalidSpec" && m.starts_with("spec.volumes.data")
        })
    })
    .await;
    assert!(failed, "{:?}", api.get("trainingjobs", NS, "invalid"));
    assert_eq!(phase("invalid"), Some(json!("Failed")));
    assert!(pods_of("invalid").is_empty());
    assert!(!warnings(&api, "invalid", "InvalidSpec").is_empty());
    // One event per problem, however many rounds saw it: each job decided again more
    // than twice since.
    let rounds = metrics.reconciles.get();
    let more = wait_until(within, every, || async {
        metrics.reconciles.get() >= rounds + 12
    })
    .await;
    assert!(more, "the operator stopped deciding");
    assert_eq!(warnings(&api, "bad-image", "ErrImagePull").len(), 1);
    stop.cancel();
    operator.await.expect("operator");
}

/// An operator newer than the installed CRD: the API server drops `status.etcdJob` (the
/// stand-in prunes it, as a structural schema without the field does). The operator
/// records a new job's name in etcd before its first key or pod and finds it dropped:
/// it says so in a Warning Event with the fix, and makes nothing, so that no later round
/// can take the job for one from before and give its pods another name. Once the field
/// stays (the CRD applied), the same job goes on under `<namespace>.<name>`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crd_older_than_the_operator_stops_a_new_job_before_its_first_key_or_pod() {
    let etcd = EtcdCluster::start(1).await.expect("etcd");
    let (api, client, _) = fake_api().await;
    api.prune("trainingjobs", &["status", "etcdJob"]);
    let stop = CancellationToken::new();
    let operator = tokio::spawn(controller::run(
        client.clone(),
        test_config(),
        Arc::new(Metrics::default()),
        stop.clone(),
    ));
    let tj = mnist_on(etcd.endpoints(), "trainers = 1\n");
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);
    jobs.create(&PostParams::default(), &tj)
        .await
        .expect("create the job");
    let said = wait_until(
        Duration::from_secs(20),
        Duration::from_millis(50),
        || async {
            api.list("events", NS).iter().any(|e| {
                e["regarding"]["name"] == JOB
                    && e["reason"] == "CrdOutdated"
                    && e["note"]
                        .as_str()
                        .is_some_and(|n| n.contains("deploy/crd.yaml"))
            })
        },
    )
    .await;
    assert!(said, "{:?}", api.list("events", NS));
    let pods: Vec<_> = api
        .list("pods", NS)
        .into_iter()
        .filter(|p| p["metadata"]["labels"]["edl.dev/job"] == JOB)
        .collect();
    assert!(pods.is_empty(), "{pods:?}");
    let backend = EtcdBackend::connect(EtcdConfig::new(etcd.endpoints()))
        .await
        .expect("etcd client");
    let (keys, _) = backend.range("/edl/").await.expect("range");
    assert!(keys.is_empty(), "nothing written under any name: {keys:?}");

    // The CRD applied: the field stays, and the job goes on under its qualified name.
    let qualified = JobKeys::new(&JobName::new(format!("{NS}.{JOB}")).expect("name"));
    api.unprune("trainingjobs");
    let published = wait_until(
        Duration::from_secs(20),
        Duration::from_millis(50),
        || async {
            backend
                .get(&qualified.spec())
                .await
                .is_ok_and(|v| v.is_some())
        },
    )
    .await;
    assert!(published, "the spec under /edl/{NS}.{JOB}/");
    let (keys, _) = backend.range(&format!("/edl/{JOB}/")).await.expect("range");
    assert!(keys.is_empty(), "nothing under the bare name: {keys:?}");
    stop.cancel();
    operator.await.expect("operator");
}
