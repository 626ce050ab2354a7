//! The stand-in itself, as the operator's tests rely on it: the test kubelet's volumes
//! live as long as a real cluster keeps them (an `emptyDir` its pod's lifetime, a claim's
//! directory the claim's), and the machine's real `kubectl` drives a TrainingJob on the
//! fake API server.

use std::sync::Arc;
use std::time::Duration;

use edl_testkit::kube_api::{FakeApi, ResourceType};
use kube::api::DeleteParams;
use kube::{Api, Client, Config};
use serde_json::json;

use super::{NS, stand_in, uid, write_kubeconfig};
use crate::support::wait_until;

/// The test kubelet keeps an `emptyDir` as long as its pod, as a kubelet does: a pod
/// that writes into one, deleted and made again under the same name, finds a new empty
/// directory, and the old one is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_dir_lives_as_long_as_its_pod() {
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("words.txt");
    std::fs::write(&input, "one two\nthree\n").expect("write input");
    let pods_dir = dir.path().join("pods");
    let (api, _kubelet) = stand_in(&pods_dir).await;
    let client = Client::try_from(Config::new(api.url().parse().expect("url"))).expect("client");
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client, NS);
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "metadata": {"name": "writer"},
        "spec": {
            "restartPolicy": "Never",
            "volumes": [{"name": "scratch", "emptyDir": {}}],
            "containers": [{
                "name": "c",
                "image": "edl",
                "command": ["edl", "data", "convert", "--format", "text", "--prefix", "t",
                            "--out", "/scratch", input.to_str().expect("utf-8 path")],
                "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
            }],
        },
    }))
    .expect("pod");
    // Written into the pod's emptyDir; returns its uid and the file's path.
    let run = || async {
        pods.create(&Default::default(), &pod)
            .await
            .expect("create pod");
        let done = wait_until(Duration::from_secs(60), || async {
            api.get("pods", NS, "writer")
                .is_some_and(|p| p["status"]["phase"] == "Succeeded")
        })
        .await;
        assert!(
            done,
            "the pod never succeeded: {:?}",
            api.get("pods", NS, "writer")
        );
        let uid = uid(&api, "writer").expect("uid");
        let file = pods_dir
            .join("emptydir")
            .join(&uid)
            .join("scratch")
            .join("t-00000-of-00001.recordio");
        assert!(file.is_file(), "{} written", file.display());
        (uid, file)
    };
    let (first, first_file) = run().await;
    pods.delete("writer", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete pod");
    let gone = wait_until(Duration::from_secs(30), || async {
        api.get("pods", NS, "writer").is_none() && !first_file.try_exists().expect("stat")
    })
    .await;
    assert!(
        gone,
        "the deleted pod's emptyDir is still there: {}",
        first_file.display()
    );
    let (second, second_file) = run().await;
    assert_ne!(first, second, "a new pod");
    assert_ne!(first_file, second_file);
    assert!(
        !first_file.try_exists().expect("stat"),
        "the first pod's emptyDir stays gone"
    );
}

/// A PersistentVolumeClaim's directory outlives the pods that mount it and goes with the
/// claim, as a dynamically provisioned volume with the `Delete` policy does: what a pod
/// wrote is there for the next pod, and gone once the claim is deleted; a claim deleted
/// while a running pod mounts it waits for that pod (claim protection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_outlives_its_pods_and_goes_with_the_claim() {
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("words.txt");
    std::fs::write(&input, "one two\nthree\n").expect("write input");
    let pods_dir = dir.path().join("pods");
    let (api, _kubelet) = stand_in(&pods_dir).await;
    let client = Client::try_from(Config::new(api.url().parse().expect("url"))).expect("client");
    let claims: Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
        Api::namespaced(client.clone(), NS);
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client, NS);
    let claim = serde_json::from_value(json!({
        "metadata": {"name": "state"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }))
    .expect("claim");
    claims
        .create(&Default::default(), &claim)
        .await
        .expect("create claim");
    let claim_uid = api
        .get("persistentvolumeclaims", NS, "state")
        .and_then(|c| c["metadata"]["uid"].as_str().map(str::to_owned))
        .expect("claim uid");
    let file = pods_dir
        .join("claims")
        .join(&claim_uid)
        .join("t-00000-of-00001.recordio");
    // The first pod writes into the claim; the second only lists it (`edl data stat`
    // fails on a missing file), so it succeeds only if the first pod's file is there.
    let pod = |name: &str, command: Vec<&str>| -> k8s_openapi::api::core::v1::Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "restartPolicy": "Never",
                "volumes": [{"name": "state", "persistentVolumeClaim": {"claimName": "state"}}],
                "containers": [{
                    "name": "c", "image": "edl", "command": command,
                    "volumeMounts": [{"name": "state", "mountPath": "/state"}],
                }],
            },
        }))
        .expect("pod")
    };
    let succeeds = |name: &'static str| {
        let api = api.clone();
        async move {
            let done = wait_until(Duration::from_secs(60), || async {
                api.get("pods", NS, name)
                    .is_some_and(|p| p["status"]["phase"] == "Succeeded")
            })
            .await;
            assert!(
                done,
                "{name} never succeeded: {:?}",
                api.get("pods", NS, name)
            );
        }
    };
    let input = input.to_str().expect("utf-8 path");
    let write = pod(
        "writer",
        vec![
            "edl", "data", "convert", "--format", "text", "--prefix", "t", "--out", "/state", input,
        ],
    );
    pods.create(&Default::default(), &write)
        .await
        .expect("create writer");
    succeeds("writer").await;
    assert!(
        file.try_exists().expect("stat"),
        "{} written",
        file.display()
    );
    pods.delete("writer", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete writer");
    let gone = wait_until(Duration::from_secs(30), || async {
        api.get("pods", NS, "writer").is_none()
    })
    .await;
    assert!(gone, "the writer pod was never removed");
    assert!(
        file.try_exists().expect("stat"),
        "the claim outlives its pod"
    );
    let read = pod(
        "reader",
        vec!["edl", "data", "stat", "/state/t-00000-of-00001.recordio"],
    );
    pods.create(&Default::default(), &read)
        .await
        .expect("create reader");
    succeeds("reader").await;
    // Deleted while a running pod mounts it, the claim stays (Terminating, its
    // directory kept) until the pod is gone, as a cluster's claim protection keeps it.
    let holder = pod("holder", vec!["sleep", "120"]);
    pods.create(&Default::default(), &holder)
        .await
        .expect("create holder");
    let running = wait_until(Duration::from_secs(30), || async {
        api.get("pods", NS, "holder")
            .is_some_and(|p| p["status"]["phase"] == "Running")
    })
    .await;
    assert!(running, "{:?}", api.get("pods", NS, "holder"));
    claims
        .delete("state", &DeleteParams::default())
        .await
        .expect("delete claim");
    let terminating = api
        .get("persistentvolumeclaims", NS, "state")
        .expect("the claim stays while its pod runs");
    assert!(!terminating["metadata"]["deletionTimestamp"].is_null());
    assert_eq!(
        terminating["metadata"]["finalizers"],
        json!(["kubernetes.io/pvc-protection"])
    );
    assert!(file.try_exists().expect("stat"), "its directory is kept");
    pods.delete("holder", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete holder");
    let deleted = wait_until(Duration::from_secs(30), || async {
        !file.try_exists().expect("stat")
    })
    .await;
    assert!(
        deleted,
        "the claim's directory outlived the claim: {}",
        file.display()
    );
}

/// The real `kubectl` of this machine drives a TrainingJob on the fake API server, as a
/// user of a real cluster would: apply, get (YAML and a JSONPath), scale through the
/// scale subresource, a merge patch, delete. Each change is checked in the server's
/// store. (No OpenAPI document is served, so `apply` runs with `--validate=false`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_drives_a_trainingjob_on_the_stand_in() {
    let dir = tempfile::tempdir().expect("tempdir");
    let api = Arc::new(
        FakeApi::start(ResourceType::for_operator())
            .await
            .expect("fake API server"),
    );
    let kubeconfig = dir.path().join("kubeconfig");
    write_kubeconfig(&kubeconfig, &api);
    let cache = dir.path().join("kube-cache");
    let kubectl = |args: &[&str]| -> String {
        let (ok, text) = super::kubectl(&kubeconfig, &cache, args);
        assert!(ok, "kubectl {args:?}: {text}");
        text
    };
    let trainers = || {
        api.get("trainingjobs", NS, "mnist-mlp")
            .map(|j| j["spec"]["cluster"]["trainers"].clone())
    };
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/examples/mnist-mlp.yaml"
    );
    assert!(kubectl(&["get", "trainingjobs"]).contains("No resources found"));
    assert!(kubectl(&["apply", "--validate=false", "-f", example]).contains("created"));
    assert!(trainers().is_some(), "the job is in the server's store");
    let yaml = kubectl(&["get", "trainingjobs", "-o", "yaml"]);
    assert!(
        yaml.contains("kind: TrainingJob") && yaml.contains("name: mnist-mlp"),
        "{yaml}"
    );
    kubectl(&["scale", "trainingjob/mnist-mlp", "--replicas", "3"]);
    assert_eq!(
        trainers(),
        Some(json!(3)),
        "scaled through the scale subresource"
    );
    let path = "jsonpath={.spec.cluster.trainers}";
    assert_eq!(
        kubectl(&["get", "trainingjob/mnist-mlp", "-o", path]).trim(),
        "3"
    );
    kubectl(&[
        "patch",
        "trainingjob/mnist-mlp",
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"cluster":{"trainers":2}}}"#,
    ]);
    assert_eq!(trainers(), Some(json!(2)), "merge-patched");
    assert!(kubectl(&["delete", "trainingjob/mnist-mlp"]).contains("deleted"));
    assert_eq!(
        trainers(),
        None,
        "deleted (no finalizer without an operator)"
    );
    kubectl(&["get", "pods"]);
}

/// The real `kubectl apply -f deploy/` on the stand-in, as an administrator installs
/// edl: every object of `deploy/`'s files is created (the CRD, the namespace, the RBAC,
/// the operator's Deployment, the monitoring ConfigMaps), a second apply finds each
/// unchanged, and a TrainingJob applied then is listed. (Client-side validation needs
/// the server's OpenAPI document, which the stand-in does not serve: `--validate=false`;
/// `scripts/test-deploy` validates the same files against the official schemas.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_applies_the_deploy_directory_on_the_stand_in() {
    let dir = tempfile::tempdir().expect("tempdir");
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
    let deploy = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy");
    let out = kubectl(&["apply", "--validate=false", "-f", deploy]);
    for (what, plural, ns, name) in [
        (
            "the CRD",
            "customresourcedefinitions",
            "",
            "trainingjobs.edl.dev",
        ),
        ("the namespace", "namespaces", "", "edl-system"),
        ("the operator", "deployments", "edl-system", "edl-operator"),
        (
            "the operator's account",
            "serviceaccounts",
            "edl-system",
            "edl-operator",
        ),
        ("its role", "clusterroles", "", "edl-operator"),
        ("its binding", "clusterrolebindings", "", "edl-operator"),
        (
            "the dashboard",
            "configmaps",
            "edl-system",
            "edl-grafana-dashboard",
        ),
        (
            "the alert rules",
            "configmaps",
            "edl-system",
            "edl-prometheus-rules",
        ),
    ] {
        assert!(
            api.get(plural, ns, name).is_some(),
            "{what} ({plural} {name}) was not created:\n{out}"
        );
    }
    assert!(!out.contains("unchanged"), "{out}");
    let again = kubectl(&["apply", "--validate=false", "-f", deploy]);
    let lines: Vec<&str> = again.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(
        !lines.is_empty() && lines.iter().all(|l| l.ends_with("unchanged")),
        "a second apply changed something:\n{again}"
    );
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/examples/mnist-mlp.yaml"
    );
    kubectl(&["apply", "--validate=false", "-f", example]);
    assert!(kubectl(&["get", "trainingjobs", "-n", NS]).contains("mnist-mlp"));
}
