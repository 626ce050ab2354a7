//! Per-job etcd credentials (`edl operator run --etcd-user/--etcd-password` with a
//! shared etcd; `edl_operator::controller`) against the fake API server and a real etcd
//! with authentication on. What it shows:
//! - a TrainingJob on the shared etcd gets the Secret `<job>-edl-credentials`, owned by
//!   it, before its pods; a Secret of that name left by an earlier job (another owner
//!   uid) is replaced;
//! - the Secret's user (`edl-job-<namespace>.<job>`) may write `/edl/<namespace>.<job>/`
//!   and etcd refuses it another job's keys;
//! - every job pod takes the Secret (`envFrom`, required);
//! - the job's TLS Secret (its CA and the pods' certificate) is made before its pods,
//!   each of which mounts it (not the CA's key) with mutual TLS on, and goes with it;
//! - later rounds reuse the Secret: same object, same password, which still works;
//! - deleting the job takes the Secret with it (owner reference), and its etcd user and
//!   role (the finalizer);
//! - an operator whose etcd user may not manage users says so in a condition and an
//!   Event, and starts no job process;
//! - the operator sends its credentials only to the etcd its configuration names: a job
//!   naming another endpoint (a listener of its own) is refused in a condition and an
//!   Event, and that endpoint is never dialled;
//! - every request is one `deploy/rbac.yaml` allows in the namespace where it binds
//!   edl-operator-credentials, each of that rule's verbs used.

use edl_coord::{Error as CoordError, EtcdAuth};
use k8s_openapi::api::core::v1::{EnvFromSource, Pod, SecretEnvSource};

use super::*;

/// Where `deploy/rbac.yaml` binds the edl-operator-credentials ClusterRole.
const CRED_NS: &str = "default";
const ROOT_PASSWORD: &str = "pw";
const SECRET: &str = "mnist-edl-credentials";
/// The job's CA Secret (its CA and the operator's certificate): no pod mounts it.
const CA_SECRET: &str = "mnist-edl-ca";
/// The one TLS Secret an earlier operator made for every role, CA key and all.
const LEGACY_TLS_SECRET: &str = "mnist-edl-tls";
/// Each role's TLS Secret (its certificate and the CA's); no managed etcd here.
const ROLE_SECRETS: [(&str, &str); 3] = [
    ("master", "mnist-edl-tls-master"),
    ("pserver", "mnist-edl-tls-pserver"),
    ("trainer", "mnist-edl-tls-trainer"),
];

/// An etcd with authentication on (user root, [`ROOT_PASSWORD`]), and a client as root.
async fn etcd_with_auth() -> (EtcdCluster, Arc<EtcdBackend>) {
    EtcdCluster::start_with_auth(ROOT_PASSWORD)
        .await
        .expect("etcd with authentication on")
}

/// The controller for [`CRED_NS`] with `admin` as its credentials for the etcd at
/// `endpoints`.
fn start_operator(
    client: Client,
    (admin, endpoints): (EtcdAuth, Vec<String>),
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(controller::run(
        client,
        ControllerConfig {
            namespace: Some(CRED_NS.to_owned()),
            resync: Duration::from_millis(300),
            etcd_auth: Some(admin),
            etcd_endpoints: endpoints,
            ..ControllerConfig::default()
        },
        metrics,
        stop,
    ))
}

fn training_job(endpoints: Vec<String>) -> TrainingJob {
    let spec = edl_job::JobSpec::parse_toml(&format!(
        "name = \"{JOB}\"\n[data]\ntrain = [\"/d/a-*.recordio\"]\n[model]\nkind = \"mnist_mlp\"\n\
         [cluster]\ntrainers = 2\nmin_trainers = 1\nmax_trainers = 4\n"
    ))
    .expect("spec");
    let mut tj = TrainingJob::from_job_spec(&spec, "edl:test", Some(CRED_NS));
    tj.spec.etcd = EtcdSpec {
        endpoints,
        ..EtcdSpec::default()
    };
    tj
}

fn job_pods(api: &FakeApi) -> Vec<serde_json::Value> {
    api.list("pods", CRED_NS)
        .into_iter()
        .filter(|p| p["metadata"]["labels"]["edl.dev/job"] == JOB)
        .collect()
}

/// The Secret's value of `key`, as text.
fn value(secret: &k8s_openapi::api::core::v1::Secret, key: &str) -> String {
    let bytes = secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .unwrap_or_else(|| panic!("no {key} in the Secret"));
    String::from_utf8(bytes.0.clone()).expect("UTF-8")
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.chars().all(|c| c.is_ascii_hexdigit())
}

fn denied<T: std::fmt::Debug>(r: Result<T, CoordError>, what: &str) {
    match r {
        Err(CoordError::PermissionDenied(_)) => {}
        other => panic!("{what}: expected PermissionDenied, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_on_a_shared_etcd_gets_its_own_etcd_user_in_a_secret_it_owns() {
    let (etcd, root) = etcd_with_auth().await;
    let (api, client, operator_client) = fake_api().await;
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), CRED_NS);
    // Left by an earlier job of the same name: its owner had another uid.
    let stale: k8s_openapi::api::core::v1::Secret = serde_json::from_value(json!({
        "metadata": {"name": SECRET, "ownerReferences": [{
            "apiVersion": "edl.dev/v1alpha1", "kind": "TrainingJob", "name": JOB,
            "uid": "00000000-0000-4000-8000-0000000000ff", "controller": true}]},
        "stringData": {"EDL_ETCD_USER": "edl-job-default.mnist", "EDL_ETCD_PASSWORD": "stale",
            "EDL_JOB_TOKEN": "stale"},
    }))
    .expect("a Secret");
    let stale = secrets
        .create(&PostParams::default(), &stale)
        .await
        .expect("create the stale Secret");

    // An earlier operator's one TLS Secret for every role of the job, with the CA's key:
    // its CA carries on, so pods that mount it talk with the new ones.
    let legacy = edl_proto::tls::LocalCa::generate("mnist").expect("a CA");
    let legacy_secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(json!({
        "metadata": {"name": LEGACY_TLS_SECRET, "labels": {"edl.dev/job": JOB}},
        "stringData": {"ca.crt": legacy.ca_pem, "ca.key": legacy.ca_key_pem,
            "tls.crt": legacy.cert_pem, "tls.key": legacy.key_pem},
    }))
    .expect("a Secret");
    secrets
        .create(&PostParams::default(), &legacy_secret)
        .await
        .expect("create the earlier operator's TLS Secret");

    let stop = CancellationToken::new();
    let metrics = Arc::new(Metrics::default());
    let admin = EtcdAuth {
        user: "root".into(),
        password: ROOT_PASSWORD.into(),
    };
    let operator = start_operator(
        operator_client,
        (admin, etcd.endpoints()),
        metrics.clone(),
        stop.clone(),
    );
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), CRED_NS);
    jobs.create(&PostParams::default(), &training_job(etcd.endpoints()))
        .await
        .expect("create the job");

    let within = Duration::from_secs(20);
    let every = Duration::from_millis(50);
    let ok = wait_until(within, every, || async { job_pods(&api).len() == 4 }).await;
    assert!(ok, "pods: {:?}", api.list("pods", CRED_NS));
    let tj = jobs.get(JOB).await.expect("the job");

    // The Secret: a new one, owned by this job, with the job's user and a token.
    let secret = secrets.get(SECRET).await.expect("the job's Secret");
    assert_ne!(
        secret.metadata.uid, stale.metadata.uid,
        "the stale one was replaced"
    );
    let owners = secret.metadata.owner_references.clone().unwrap_or_default();
    assert_eq!(owners.len(), 1, "{owners:?}");
    assert_eq!(
        (owners[0].kind.as_str(), owners[0].name.as_str()),
        ("TrainingJob", JOB)
    );
    assert_eq!(Some(&owners[0].uid), tj.metadata.uid.as_ref());
    assert_eq!(owners[0].controller, Some(true));
    assert_eq!(value(&secret, "EDL_ETCD_USER"), "edl-job-default.mnist");
    let password = value(&secret, "EDL_ETCD_PASSWORD");
    let token = value(&secret, "EDL_JOB_TOKEN");
    assert!(is_hex(&password, 64), "a random password: {password:?}");
    assert!(is_hex(&token, 64), "32 random bytes, hex: {token:?}");
    // Made before the pods: the fake's resourceVersions are one counter, and neither the
    // Secret nor the pods (no kubelet here) were written after their creation.
    let rv = |v: &serde_json::Value| {
        v["metadata"]["resourceVersion"]
            .as_str()
            .and_then(|r| r.parse::<u64>().ok())
            .expect("a resourceVersion")
    };
    let secret_rv = rv(&api.get("secrets", CRED_NS, SECRET).expect("the Secret"));
    // The job's TLS Secrets, owned by the job and made before the pods: its CA (the
    // earlier operator's, carried on) with the operator's certificate, which no pod
    // mounts; and one per role, which only that role's pods mount, without the CA's key.
    let keys_of = |v: &serde_json::Value| -> Vec<String> {
        v["data"]
            .as_object()
            .map(|d| d.keys().cloned().collect())
            .unwrap_or_default()
    };
    let text = |v: &serde_json::Value, k: &str| -> String {
        let typed: k8s_openapi::api::core::v1::Secret =
            serde_json::from_value(v.clone()).expect("a Secret");
        value(&typed, k)
    };
    let ca = api
        .get("secrets", CRED_NS, CA_SECRET)
        .expect("the CA Secret");
    assert_eq!(
        keys_of(&ca),
        ["ca.crt", "ca.key", "operator.crt", "operator.key"]
    );
    assert_eq!(
        text(&ca, "ca.crt"),
        legacy.ca_pem,
        "the earlier CA carries on"
    );
    let mut tls_rvs = vec![rv(&ca)];
    for (role, name) in ROLE_SECRETS {
        let s = api
            .get("secrets", CRED_NS, name)
            .expect("a role's TLS Secret");
        assert_eq!(keys_of(&s), ["ca.crt", "tls.crt", "tls.key"], "{name}");
        assert_eq!(text(&s, "ca.crt"), legacy.ca_pem, "{name}");
        assert_eq!(s["metadata"]["ownerReferences"][0]["kind"], "TrainingJob");
        tls_rvs.push(rv(&s));
        // The role's own certificate, which its peers take from this CA (a trainer's
        // for clients only: `a_client_only_certificate_cannot_serve` in edl-proto).
        let tls = pem_tls(
            &text(&s, "ca.crt"),
            &text(&s, "tls.crt"),
            &text(&s, "tls.key"),
            "mnist.default.edl.internal".to_owned(),
        );
        assert!(tls.is_ok(), "{role}: {:?}", tls.err());
    }
    for p in job_pods(&api) {
        let name = p["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            secret_rv < rv(&p) && tls_rvs.iter().all(|r| *r < rv(&p)),
            "a Secret after pod {name}"
        );
        let role = p["metadata"]["labels"]["edl.dev/role"]
            .as_str()
            .unwrap_or_default();
        let own = format!("mnist-edl-tls-{role}");
        let mounted: Vec<&str> = p["spec"]["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v["secret"]["secretName"].as_str())
            .collect();
        assert_eq!(mounted, [own.as_str()], "pod {name} mounts its role's only");
        let volume = p["spec"]["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| v["secret"]["secretName"] == own.as_str())
            .expect("its TLS volume");
        let items: Vec<&str> = volume["secret"]["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|i| i["key"].as_str())
            .collect();
        assert_eq!(items, ["ca.crt", "tls.crt", "tls.key"]);
        let env = p["spec"]["containers"][0]["env"].to_string();
        assert!(
            env.contains("EDL_TLS_CLIENT_AUTH") && env.contains("mnist.default.edl.internal"),
            "{env}"
        );
    }

    // Its user may touch the job's keys, and only those.
    let as_job = EtcdBackend::connect(
        EtcdConfig::new(etcd.endpoints()).with_auth("edl-job-default.mnist", password.clone()),
    )
    .await
    .expect("connect as the job's user");
    as_job
        .put("/edl/default.mnist/x", b"1".to_vec(), None)
        .await
        .expect("the job's user writes /edl/default.mnist/x");
    denied(
        as_job.put("/edl/other-job/x", b"1".to_vec(), None).await,
        "write /edl/other-job/x",
    );
    denied(
        as_job.get("/edl/other-job/x").await,
        "read /edl/other-job/x",
    );
    assert!(
        root.get("/edl/other-job/x").await.expect("get").is_none(),
        "the refused write left nothing"
    );

    // Its scrape-only token, in a Secret of its own (what a Prometheus is given, so
    // it never holds the job token): owned by the job, another random value.
    let scrape = secrets
        .get("mnist-edl-metrics")
        .await
        .expect("the job's metrics Secret");
    let metrics_token = value(&scrape, "EDL_METRICS_TOKEN");
    assert!(is_hex(&metrics_token, 64), "{metrics_token:?}");
    assert_ne!(metrics_token, token);
    assert_eq!(
        scrape.data.as_ref().map(|d| d.len()),
        Some(1),
        "the metrics token alone"
    );
    let owner = scrape.metadata.owner_references.clone().unwrap_or_default();
    assert_eq!(
        owner.iter().map(|o| Some(&o.uid)).collect::<Vec<_>>(),
        [tj.metadata.uid.as_ref()]
    );

    // Every job pod takes both, and must.
    let take = |name: &str| EnvFromSource {
        secret_ref: Some(SecretEnvSource {
            name: name.to_owned(),
            optional: None,
        }),
        ..EnvFromSource::default()
    };
    let want = vec![take(SECRET), take("mnist-edl-metrics")];
    for p in job_pods(&api) {
        let pod: Pod = serde_json::from_value(p).expect("a pod");
        let c = &pod.spec.as_ref().expect("spec").containers[0];
        assert_eq!(
            c.env_from.as_ref(),
            Some(&want),
            "pod {:?}",
            pod.metadata.name
        );
    }

    // Later rounds reuse it: the same object and password, which still works.
    let rounds = metrics.reconciles.get();
    let more = wait_until(within, every, || async {
        metrics.reconciles.get() >= rounds + 3
    })
    .await;
    assert!(more, "the operator stopped deciding");
    let again = secrets.get(SECRET).await.expect("the Secret");
    assert_eq!(again.metadata.uid, secret.metadata.uid);
    assert_eq!(
        again.metadata.resource_version,
        secret.metadata.resource_version
    );
    assert_eq!(value(&again, "EDL_ETCD_PASSWORD"), password);
    let reconnected = EtcdBackend::connect(
        EtcdConfig::new(etcd.endpoints()).with_auth("edl-job-default.mnist", password.clone()),
    )
    .await
    .expect("connect as the job's user again");
    let x = reconnected.get("/edl/default.mnist/x").await.expect("get");
    assert_eq!(x.map(|kv| kv.value), Some(b"1".to_vec()));
    assert_eq!(
        condition(&api, CRED_NS, JOB, "CredentialsReady").map(|(s, r, _)| (s, r)),
        Some(("True".to_owned(), "Issued".to_owned()))
    );

    // The job goes, and its Secret with it.
    jobs.delete(JOB, &DeleteParams::default())
        .await
        .expect("delete the job");
    let gone = wait_until(within, every, || async {
        api.get("trainingjobs", CRED_NS, JOB).is_none()
            && api.get("secrets", CRED_NS, SECRET).is_none()
    })
    .await;
    assert!(gone, "secret {:?}", api.get("secrets", CRED_NS, SECRET));
    let tls_gone = wait_until(within, every, || async {
        std::iter::once(CA_SECRET)
            .chain(ROLE_SECRETS.map(|(_, n)| n))
            .all(|n| api.get("secrets", CRED_NS, n).is_none())
    })
    .await;
    assert!(tls_gone, "a TLS Secret outlived its job");
    // And its etcd user: the password that worked is refused (the finalizer deleted the
    // user and its role before the job went).
    let revoked = match EtcdBackend::connect(
        EtcdConfig::new(etcd.endpoints()).with_auth("edl-job-default.mnist", password.clone()),
    )
    .await
    {
        Err(_) => true,
        Ok(b) => b.get("/edl/default.mnist/x").await.is_err(),
    };
    assert!(revoked, "the deleted job's etcd user still works");

    stop.cancel();
    operator.await.expect("operator");
    let accesses = operator_accesses(&api);
    let secret_requests: Vec<&Access> = accesses
        .iter()
        .filter(|a| a.resource == "secrets")
        .collect();
    assert!(
        secret_requests.iter().all(|a| a.namespace == CRED_NS
            && a.name.as_deref().is_none_or(|n| n == SECRET
                || n == "mnist-edl-metrics"
                || n == CA_SECRET
                || ROLE_SECRETS.iter().any(|(_, r)| *r == n))),
        "{secret_requests:?}"
    );
    // Renewing a certificate (an update) is checked by the managed etcd's end-to-end
    // test, which renews one.
    check_rbac(&accesses, &|r, verb| {
        !credentials_rule(r) || verb == "update"
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_the_operator_cannot_make_are_a_condition_and_no_job_process_starts() {
    let (etcd, root) = etcd_with_auth().await;
    // The operator's user may read and write every job's keys, but not manage users.
    let ops = root.grant_prefix("ops", "/edl/").await.expect("user ops");
    let (api, client, operator_client) = fake_api().await;
    let stop = CancellationToken::new();
    let metrics = Arc::new(Metrics::default());
    let operator = start_operator(
        operator_client,
        (ops, etcd.endpoints()),
        metrics,
        stop.clone(),
    );
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), CRED_NS);
    jobs.create(&PostParams::default(), &training_job(etcd.endpoints()))
        .await
        .expect("create the job");

    let within = Duration::from_secs(20);
    let every = Duration::from_millis(50);
    let said = wait_until(within, every, || async {
        condition(&api, CRED_NS, JOB, "CredentialsReady").is_some_and(|(s, r, m)| {
            s == "False" && r == "CredentialsFailed" && m.contains("may manage users")
        }) && api.list("events", CRED_NS).iter().any(|e| {
            e["regarding"]["name"] == JOB
                && e["reason"] == "CredentialsFailed"
                && e["type"] == "Warning"
        })
    })
    .await;
    assert!(
        said,
        "{:?}, events {:?}",
        api.get("trainingjobs", CRED_NS, JOB)
            .map(|j| j["status"].clone()),
        api.list("events", CRED_NS)
    );
    let running = condition(&api, CRED_NS, JOB, "Running").expect("a Running condition");
    assert_eq!(
        (running.0.as_str(), running.1.as_str()),
        ("False", "CredentialsFailed")
    );
    assert!(job_pods(&api).is_empty(), "{:?}", job_pods(&api));
    assert!(api.get("secrets", CRED_NS, SECRET).is_none());
    stop.cancel();
    operator.await.expect("operator");
}

/// A TrainingJob names its etcd endpoints, so an operator with admin credentials that
/// dialled whatever a job names would hand them to anyone allowed to create a job. Here a
/// job names a listener of its own: the operator refuses the job (its `EtcdReachable`
/// condition and an Event name the endpoint and the fix), starts nothing, makes no
/// Secret, and never connects to the listener; the refusal is the witness that the
/// operator reconciled the job as far as its etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operators_credentials_go_only_to_the_etcd_it_was_given() {
    use std::sync::atomic::{AtomicUsize, Ordering};

    let (etcd, _root) = etcd_with_auth().await;
    let thief = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a listener");
    let thief_url = format!("http://{}", thief.local_addr().expect("its address"));
    let dialled = Arc::new(AtomicUsize::new(0));
    let count = dialled.clone();
    let listening = tokio::spawn(async move {
        while thief.accept().await.is_ok() {
            count.fetch_add(1, Ordering::SeqCst);
        }
    });
    let (api, client, operator_client) = fake_api().await;
    let stop = CancellationToken::new();
    let admin = EtcdAuth {
        user: "root".into(),
        password: ROOT_PASSWORD.into(),
    };
    let operator = start_operator(
        operator_client,
        (admin, etcd.endpoints()),
        Arc::new(Metrics::default()),
        stop.clone(),
    );
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), CRED_NS);
    jobs.create(
        &PostParams::default(),
        &training_job(vec![thief_url.clone()]),
    )
    .await
    .expect("create the job");

    let refused = wait_until(
        Duration::from_secs(20),
        Duration::from_millis(50),
        || async {
            condition(&api, CRED_NS, JOB, "EtcdReachable").is_some_and(|(s, _, m)| {
                s == "False"
                    && m.contains(&format!("names {thief_url}"))
                    && m.contains("--etcd-endpoints")
            }) && api.list("events", CRED_NS).iter().any(|e| {
                e["regarding"]["name"] == JOB
                    && e["type"] == "Warning"
                    && e["reason"] == "EtcdUnreachable"
                    && e["note"].as_str().is_some_and(|n| n.contains(&thief_url))
            })
        },
    )
    .await;
    assert!(
        refused,
        "{:?}, events {:?}",
        api.get("trainingjobs", CRED_NS, JOB)
            .map(|j| j["status"].clone()),
        api.list("events", CRED_NS)
    );
    // Every path to the job's etcd (reading its progress, writing its keys) checks the
    // endpoints before connecting; the refusal above is that check's.
    assert_eq!(
        dialled.load(Ordering::SeqCst),
        0,
        "the operator connected to an endpoint its configuration does not name"
    );
    assert!(job_pods(&api).is_empty(), "{:?}", job_pods(&api));
    assert!(api.get("secrets", CRED_NS, SECRET).is_none());
    // The refused job can still be deleted: the operator wrote nothing on that etcd, so
    // its finalizer goes without a visit there.
    let tj = api.get("trainingjobs", CRED_NS, JOB).expect("the job");
    assert!(
        tj["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty()),
        "the job on a shared etcd holds the operator's finalizer: {tj}"
    );
    jobs.delete(JOB, &Default::default())
        .await
        .expect("delete the job");
    let gone = wait_until(
        Duration::from_secs(20),
        Duration::from_millis(50),
        || async { api.get("trainingjobs", CRED_NS, JOB).is_none() },
    )
    .await;
    assert!(gone, "{:?}", api.get("trainingjobs", CRED_NS, JOB));
    assert_eq!(dialled.load(Ordering::SeqCst), 0, "nor while deleting it");
    stop.cancel();
    operator.await.expect("operator");
    listening.abort();
}

/// A shared etcd that speaks only mutual TLS: the operator reaches it with the TLS its
/// configuration gives (`etcd_tls`: without it, the job's `EtcdReachable` says what is
/// missing, and nothing is made), makes the job's etcd user over it, and the job's pods
/// mount the etcd's CA and their client certificate from the Secret `etcd.tls` names,
/// with the variables that point edl's etcd client at them; with those files and the
/// job's password, the job's user writes its keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_etcd_over_mutual_tls_is_reached_by_the_operator_and_the_jobs_pods() {
    use edl_operator::crd::SharedEtcdTls;
    use edl_operator::objects::ETCD_TLS_MOUNT;
    use edl_testkit::etcd::TlsEtcd;

    let etcd = TlsEtcd::start().await;
    EtcdBackend::connect_as_root(etcd.config(etcd.mutual()), None, ROOT_PASSWORD)
        .await
        .expect("turn authentication on over TLS");
    let (api, client, operator_client) = fake_api().await;
    let admin = EtcdAuth {
        user: "root".into(),
        password: ROOT_PASSWORD.into(),
    };
    let operator = |tls: Option<edl_coord::EtcdTls>, stop: CancellationToken| {
        tokio::spawn(controller::run(
            operator_client.clone(),
            ControllerConfig {
                namespace: Some(CRED_NS.to_owned()),
                resync: Duration::from_millis(300),
                etcd_auth: Some(admin.clone()),
                etcd_endpoints: vec![etcd.endpoint.clone()],
                etcd_tls: tls,
                ..ControllerConfig::default()
            },
            Arc::new(Metrics::default()),
            stop,
        ))
    };
    let mut tj = training_job(vec![etcd.endpoint.clone()]);
    tj.spec.etcd.tls = Some(SharedEtcdTls {
        secret_name: "shared-etcd-tls".into(),
        client_certificate: true,
        domain: None,
    });
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), CRED_NS);
    jobs.create(&PostParams::default(), &tj)
        .await
        .expect("create the job");

    // An operator without TLS settings for it: said, nothing made.
    let stop = CancellationToken::new();
    let without = operator(None, stop.clone());
    let said = wait_until(
        Duration::from_secs(20),
        Duration::from_millis(50),
        || async {
            condition(&api, CRED_NS, JOB, "EtcdReachable")
                .is_some_and(|(s, _, m)| s == "False" && m.contains("--etcd-ca"))
        },
    )
    .await;
    assert!(
        said,
        "{:?}",
        api.get("trainingjobs", CRED_NS, JOB)
            .map(|j| j["status"].clone())
    );
    assert!(api.get("secrets", CRED_NS, SECRET).is_none());
    assert!(job_pods(&api).is_empty());
    stop.cancel();
    without.await.expect("operator");

    // With them: the job's user is made over TLS, and its pods get the etcd's TLS.
    let stop = CancellationToken::new();
    let with = operator(Some(etcd.mutual()), stop.clone());
    let ready = wait_until(
        Duration::from_secs(20),
        Duration::from_millis(50),
        || async { api.get("secrets", CRED_NS, SECRET).is_some() && !job_pods(&api).is_empty() },
    )
    .await;
    assert!(
        ready,
        "{:?}",
        api.get("trainingjobs", CRED_NS, JOB)
            .map(|j| j["status"].clone())
    );
    for p in job_pods(&api) {
        let volume = p["spec"]["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| v["secret"]["secretName"] == "shared-etcd-tls")
            .unwrap_or_else(|| panic!("no etcd TLS volume: {p}"));
        let keys: Vec<&str> = volume["secret"]["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|i| i["key"].as_str())
            .collect();
        assert_eq!(keys, ["ca.crt", "tls.crt", "tls.key"]);
        let mounted = p["spec"]["containers"][0]["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|m| m["name"] == volume["name"] && m["mountPath"] == ETCD_TLS_MOUNT);
        assert!(mounted, "{p}");
        let env = |name: &str| {
            p["spec"]["containers"][0]["env"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|e| e["name"] == name)
                .and_then(|e| e["value"].as_str())
                .map(str::to_owned)
        };
        assert_eq!(env("EDL_ETCD_CA"), Some(format!("{ETCD_TLS_MOUNT}/ca.crt")));
        assert_eq!(
            env("EDL_ETCD_CERT"),
            Some(format!("{ETCD_TLS_MOUNT}/tls.crt"))
        );
        assert_eq!(
            env("EDL_ETCD_KEY"),
            Some(format!("{ETCD_TLS_MOUNT}/tls.key"))
        );
    }
    let secret = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), CRED_NS)
        .get(SECRET)
        .await
        .expect("the credentials");
    let as_job = EtcdBackend::connect(etcd.config(etcd.mutual()).with_auth(
        value(&secret, "EDL_ETCD_USER"),
        value(&secret, "EDL_ETCD_PASSWORD"),
    ))
    .await
    .expect("the job's user over TLS");
    as_job
        .put("/edl/default.mnist/over-tls", b"1".to_vec(), None)
        .await
        .expect("the job's user writes its keys over TLS");
    stop.cancel();
    with.await.expect("operator");
}
