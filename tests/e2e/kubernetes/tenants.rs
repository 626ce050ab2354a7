//! Tenants of one shared etcd: two namespaces each run a TrainingJob named `mnist` on the
//! same etcd, created and deleted with the machine's real `kubectl` on the stand-in API
//! server, under one operator's controller (every namespace, admin credentials for that
//! etcd). Each job's name in etcd carries its namespace (`<namespace>.mnist`): its own etcd
//! user, prefix and published spec, and its pods' `EDL_JOB`. Neither job's user may read
//! or write the other's keys, and deleting one job removes its keys and its user only.
//! The operator runs under RBAC as `deploy/rbac.yaml` grants it (applied with `kubectl`,
//! enforced by the stand-in for the operator's service account): in a namespace where
//! nobody bound it the Secrets rule, a job waits with the command that grants it, and
//! once that documented command is run, the job gets its credentials and pods.

use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, Error as CoordError, EtcdAuth, EtcdBackend, EtcdConfig};
use edl_operator::controller::{self, ControllerConfig};
use edl_operator::crd::{EtcdSpec, TrainingJob};
use edl_operator::metrics::Metrics;
use edl_testkit::etcd::EtcdCluster;
use edl_testkit::kube_api::{FakeApi, ResourceType};
use kube::{Client, Config};
use tokio_util::sync::CancellationToken;

use super::write_kubeconfig;
use crate::support::wait_until;

const TENANTS: [&str; 2] = ["team-a", "team-b"];
/// The operator's user: deploy/'s service account.
const OPERATOR: &str = "system:serviceaccount:edl-system:edl-operator";
const JOB: &str = "mnist";

/// Job `mnist` of namespace `ns` on the etcd at `endpoints`, as JSON for `kubectl apply`.
fn job_json(ns: &str, endpoints: Vec<String>) -> String {
    let spec = edl_job::JobSpec::parse_toml(&format!(
        "name = \"{JOB}\"\n[data]\ntrain = [\"/d/a-*.recordio\"]\n[model]\nkind = \"mnist_mlp\"\n\
         [cluster]\ntrainers = 1\n"
    ))
    .expect("spec");
    let mut tj = TrainingJob::from_job_spec(&spec, "edl:test", Some(ns));
    tj.spec.etcd = EtcdSpec {
        endpoints,
        ..EtcdSpec::default()
    };
    serde_json::to_string(&tj).expect("json")
}

/// The value of `key` in Secret `name` of `ns`, if it is there.
fn secret(api: &FakeApi, ns: &str, name: &str, key: &str) -> Option<String> {
    let s = api.get("secrets", ns, name)?;
    let v = s["data"][key].as_str()?;
    String::from_utf8(edl_testkit::kube_api::base64_decode(v)?).ok()
}

/// `EDL_JOB` of every pod of job `mnist` in `ns`.
fn pods_job_names(api: &FakeApi, ns: &str) -> Vec<String> {
    api.list("pods", ns)
        .iter()
        .filter(|p| p["metadata"]["labels"]["edl.dev/job"] == JOB)
        .map(|p| {
            p["spec"]["containers"][0]["env"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|e| e["name"] == edl_job::env::JOB)
                .and_then(|e| e["value"].as_str())
                .unwrap_or_default()
                .to_owned()
        })
        .collect()
}

fn denied<T: std::fmt::Debug>(r: Result<T, CoordError>, what: &str) {
    match r {
        Err(CoordError::PermissionDenied(_)) => {}
        other => panic!("{what}: expected PermissionDenied, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_namespaces_run_jobs_of_one_name_on_one_shared_etcd_without_meeting() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (etcd, root) = EtcdCluster::start_with_auth("pw")
        .await
        .expect("etcd with authentication on");
    let mut types = ResourceType::for_operator();
    types.extend(ResourceType::for_deploy());
    let api = Arc::new(FakeApi::start(types).await.expect("fake API server"));
    let kubeconfig = dir.path().join("kubeconfig");
    write_kubeconfig(&kubeconfig, &api);
    let cache = dir.path().join("kube-cache");
    let kubectl = |args: &[&str]| -> String {
        let (ok, text) = super::kubectl(&kubeconfig, &cache, args);
        assert!(ok, "kubectl {args:?}: {text}");
        text
    };
    // The operator as deploy/'s service account, under deploy/'s RBAC.
    let rbac = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/rbac.yaml");
    let out = kubectl(&["apply", "--validate=false", "-f", rbac]);
    assert!(out.contains("edl-operator-credentials"), "{out}");
    api.enforce_rbac(OPERATOR);
    let mut config = Config::new(api.url().parse().expect("url"));
    config.headers.push((
        axum::http::header::AUTHORIZATION,
        axum::http::HeaderValue::from_str(&format!("Bearer {OPERATOR}")).expect("header"),
    ));
    let client = Client::try_from(config).expect("client");
    let stop = CancellationToken::new();
    let operator = tokio::spawn(controller::run(
        client,
        ControllerConfig {
            namespace: None,
            resync: Duration::from_millis(300),
            etcd_auth: Some(EtcdAuth {
                user: "root".into(),
                password: "pw".into(),
            }),
            etcd_endpoints: etcd.endpoints(),
            ..ControllerConfig::default()
        },
        Arc::new(Metrics::default()),
        stop.clone(),
    ));
    for ns in TENANTS {
        let file = dir.path().join(format!("{ns}.json"));
        std::fs::write(&file, job_json(ns, etcd.endpoints())).expect("write the job");
        let out = kubectl(&[
            "apply",
            "--validate=false",
            "-n",
            ns,
            "-f",
            &file.display().to_string(),
        ]);
        assert!(out.contains("created"), "{out}");
    }

    // deploy/ grants the operator the Secrets of `default` only: each job waits, saying
    // how to grant it its namespace's, and makes no pod.
    let grant = |ns: &str| {
        format!(
            "kubectl -n {ns} create rolebinding edl-operator-credentials --clusterrole \
             edl-operator-credentials --serviceaccount edl-system:edl-operator \
             --dry-run=client -o yaml | kubectl apply -f -"
        )
    };
    let messages = |ns: &str| -> String {
        api.get("trainingjobs", ns, JOB)
            .map(|j| j["status"]["conditions"].to_string())
            .unwrap_or_default()
    };
    let waiting = wait_until(Duration::from_secs(30), || async {
        TENANTS.iter().all(|ns| messages(ns).contains(&grant(ns)))
    })
    .await;
    assert!(waiting, "{:?}", TENANTS.map(messages));
    for ns in TENANTS {
        assert!(messages(ns).contains("is forbidden"), "{}", messages(ns));
        assert!(
            pods_job_names(&api, ns).is_empty(),
            "{ns}: no pod without its Secrets"
        );
        // The documented command, as an administrator runs it: its two halves.
        let command = grant(ns);
        let (make, apply) = command.split_once(" | ").expect("a pipe");
        let args: Vec<&str> = make.split_whitespace().skip(1).collect();
        let binding = dir.path().join(format!("{ns}-binding.yaml"));
        std::fs::write(&binding, kubectl(&args)).expect("write the binding");
        assert_eq!(apply, "kubectl apply -f -");
        // (`--validate=false`: the stand-in serves no OpenAPI documents.)
        let out = kubectl(&[
            "apply",
            "--validate=false",
            "-f",
            &binding.display().to_string(),
        ]);
        assert!(out.contains("created"), "{out}");
    }

    // Each job gets its credentials and its pods, named in etcd by its namespace.
    let user = |ns: &str| secret(&api, ns, "mnist-edl-credentials", "EDL_ETCD_USER");
    let ready = wait_until(Duration::from_secs(30), || async {
        TENANTS
            .iter()
            .all(|ns| user(ns).is_some() && !pods_job_names(&api, ns).is_empty())
    })
    .await;
    assert!(
        ready,
        "{:?}",
        TENANTS.map(|ns| (
            user(ns),
            api.get("trainingjobs", ns, JOB)
                .map(|j| j["status"].clone())
        ))
    );
    let mut users = Vec::new();
    for ns in TENANTS {
        let name = format!("{ns}.{JOB}");
        assert_eq!(
            user(ns).as_deref(),
            Some(format!("edl-job-{name}").as_str())
        );
        let pods = pods_job_names(&api, ns);
        assert!(pods.iter().all(|n| *n == name), "{ns}: {pods:?}");
        let status = api.get("trainingjobs", ns, JOB).expect("the job");
        assert_eq!(status["status"]["etcdJob"], name.as_str(), "{status}");
        let published = root
            .get(&format!("/edl/{name}/job/spec"))
            .await
            .expect("get");
        assert!(
            published.is_some(),
            "{ns}'s spec is published under /edl/{name}/"
        );
        let password =
            secret(&api, ns, "mnist-edl-credentials", "EDL_ETCD_PASSWORD").expect("password");
        let as_job = EtcdBackend::connect(
            EtcdConfig::new(etcd.endpoints())
                .with_auth(format!("edl-job-{name}"), password.clone()),
        )
        .await
        .expect("connect as the job's user");
        users.push((ns, name, as_job, password));
    }
    assert!(
        root.get(&format!("/edl/{JOB}/job/spec"))
            .await
            .expect("get")
            .is_none(),
        "nothing under the bare name"
    );
    for (ns, name, as_job, _) in &users {
        as_job
            .put(&format!("/edl/{name}/x"), ns.as_bytes().to_vec(), None)
            .await
            .expect("a job's user writes its own keys");
        let other = &users.iter().find(|u| u.0 != *ns).expect("the other").1;
        denied(
            as_job.get(&format!("/edl/{other}/job/spec")).await,
            "read the other namespace's job",
        );
        denied(
            as_job
                .put(&format!("/edl/{other}/x"), b"taken".to_vec(), None)
                .await,
            "write the other namespace's job",
        );
    }
    for (ns, name, _, _) in &users {
        let x = root.get(&format!("/edl/{name}/x")).await.expect("get");
        assert_eq!(
            x.map(|kv| kv.value),
            Some(ns.as_bytes().to_vec()),
            "each its own"
        );
    }

    // Deleting team-a's job takes its keys and its user, and nothing of team-b's.
    let out = kubectl(&["delete", "-n", TENANTS[0], "trainingjob", JOB]);
    assert!(out.contains("deleted"), "{out}");
    let (a, b) = (&users[0].1, &users[1].1);
    let cleaned = wait_until(Duration::from_secs(30), || async {
        api.get("trainingjobs", TENANTS[0], JOB).is_none()
            && root
                .range(&format!("/edl/{a}/"))
                .await
                .is_ok_and(|(kvs, _)| kvs.is_empty())
    })
    .await;
    assert!(cleaned, "{:?}", api.get("trainingjobs", TENANTS[0], JOB));
    // The password that worked is refused (the finalizer deleted the user and its role).
    let revoked = match EtcdBackend::connect(
        EtcdConfig::new(etcd.endpoints()).with_auth(format!("edl-job-{a}"), users[0].3.clone()),
    )
    .await
    {
        Err(_) => true,
        Ok(c) => c.get(&format!("/edl/{a}/x")).await.is_err(),
    };
    assert!(revoked, "team-a's etcd user outlived its job");
    assert!(
        root.get(&format!("/edl/{b}/job/spec"))
            .await
            .expect("get")
            .is_some(),
        "team-b's job keeps its spec"
    );
    users[1]
        .2
        .put(&format!("/edl/{b}/y"), b"1".to_vec(), None)
        .await
        .expect("team-b's user still works");
    stop.cancel();
    operator.await.expect("operator");
}
