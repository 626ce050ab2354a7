//! A lost node: the fake API server marks it not Ready (the node lifecycle controller's
//! `Ready: Unknown` and unreachable taint) and the test evicts its pods, which then stay
//! terminating (no kubelet confirms them), as on a cluster. The operator, watching the
//! nodes, leaves them while the node has been gone for less than `--node-lost-after`,
//! and past it deletes them at once and makes them again on a node that answers.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Node;

use super::*;

/// Which node new pods are bound to, and which nodes are lost (their pods are left as
/// they are, terminating ones too).
#[derive(Default)]
struct Nodes {
    current: String,
    lost: BTreeSet<String>,
}

/// Binds new pods to `nodes.current` and marks them Running; removes terminating pods
/// whose node answers; until `stop`.
fn node_kubelet(
    api: Arc<FakeApi>,
    nodes: Arc<std::sync::Mutex<Nodes>>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    on_pod_changes(api, stop, move |api| {
        let n = nodes.lock().unwrap_or_else(|e| e.into_inner());
        for pod in api.list("pods", NS) {
            let name = pod["metadata"]["name"].as_str().unwrap_or_default();
            let node = pod["spec"]["nodeName"].as_str();
            if node.is_some_and(|node| n.lost.contains(node)) {
                continue;
            }
            if !pod["metadata"]["deletionTimestamp"].is_null() {
                let _ = api.delete("pods", NS, name, Some(0));
            } else if node.is_none() {
                let _ = api.bind(NS, name, &n.current);
                let _ = api.patch_status(
                    "pods",
                    NS,
                    name,
                    &json!({"phase": "Running", "podIP": "127.0.0.1"}),
                );
            }
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_on_a_node_lost_past_the_bound_are_made_again_elsewhere() {
    let etcd = EtcdCluster::start(1).await.expect("etcd");
    let (api, client, operator_client) = fake_api().await;
    let node_api: Api<Node> = Api::all(client.clone());
    for name in ["n1", "n2"] {
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": name},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }))
        .expect("node");
        node_api
            .create(&PostParams::default(), &node)
            .await
            .expect("create the node");
    }
    let stop = CancellationToken::new();
    let nodes = Arc::new(std::sync::Mutex::new(Nodes {
        current: "n1".to_owned(),
        ..Nodes::default()
    }));
    let kubelet = node_kubelet(api.clone(), nodes.clone(), stop.clone());
    let metrics = Arc::new(Metrics::default());
    let operator = tokio::spawn(controller::run(
        operator_client,
        ControllerConfig {
            node_lost_after: Duration::from_secs(120),
            ..test_config()
        },
        metrics.clone(),
        stop.clone(),
    ));
    let mut tj = mnist_on(etcd.endpoints(), "trainers = 2\npservers = 1\n");
    tj.spec.plaintext = true;
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);
    jobs.create(&PostParams::default(), &tj)
        .await
        .expect("create the job");
    let on = |node: &'static str| {
        let api = api.clone();
        move || -> BTreeMap<String, String> {
            api.list("pods", NS)
                .into_iter()
                .filter(|p| p["spec"]["nodeName"] == node && p["status"]["phase"] == "Running")
                .filter_map(|p| {
                    let name = p["metadata"]["name"].as_str()?.to_owned();
                    Some((name, p["metadata"]["uid"].as_str()?.to_owned()))
                })
                .collect()
        }
    };
    let (on_n1, on_n2) = (on("n1"), on("n2"));
    let (within, every) = (Duration::from_secs(30), Duration::from_millis(50));
    assert!(
        wait_until(within, every, || async { on_n1().len() == 4 }).await,
        "{:?}",
        api.list("pods", NS)
    );
    let before = on_n1();

    // n1 stops answering just now; its pods are evicted and stay terminating.
    {
        let mut n = nodes.lock().unwrap_or_else(|e| e.into_inner());
        n.lost.insert("n1".to_owned());
        n.current = "n2".to_owned();
    }
    api.node_not_ready("n1", std::time::SystemTime::now())
        .expect("n1 not ready");
    for name in before.keys() {
        api.delete("pods", NS, name, Some(30)).expect("evict");
    }
    // Within the bound: rounds go by (the witness: the reconciles counted), the pods
    // are left as they are.
    let rounds = metrics.reconciles.get();
    assert!(
        wait_until(within, every, || async {
            metrics.reconciles.get() >= rounds + 5
        })
        .await
    );
    assert_eq!(on_n1(), before, "replaced before the bound");
    assert!(on_n2().is_empty(), "{:?}", on_n2());

    // Gone for five minutes (as the node's Ready condition says): past the bound, each
    // is deleted and made again on n2.
    api.node_not_ready(
        "n1",
        std::time::SystemTime::now() - Duration::from_secs(300),
    )
    .expect("n1 not ready for long");
    let moved = wait_until(within, every, || async {
        on_n2().len() == 4 && on_n1().is_empty()
    })
    .await;
    assert!(moved, "n1: {:?}, n2: {:?}", on_n1(), on_n2());
    let after = on_n2();
    assert_eq!(
        after.keys().collect::<Vec<_>>(),
        before.keys().collect::<Vec<_>>(),
        "the same slots"
    );
    assert!(
        after.iter().all(|(name, uid)| before[name] != *uid),
        "new pods"
    );
    let recoveries = jobs
        .get(JOB)
        .await
        .expect("the job")
        .status
        .expect("status")
        .recoveries;
    for name in before.keys() {
        assert!(
            recoveries
                .iter()
                .any(|r| r.pod == *name && r.reason.starts_with("lost with node n1")),
            "{name}: {recoveries:?}"
        );
    }
    stop.cancel();
    let _ = operator.await;
    let _ = kubelet.await;
}
