//! Voluntary disruptions: a job with replicated pservers gets one PodDisruptionBudget per
//! shard, and evictions (what `kubectl drain` sends) through the fake API server, which
//! honours budgets as a cluster does, take at most one replica of a shard at a time: the
//! second replica of a shard is refused until the first is back, another shard's is
//! not. Every request is one `deploy/rbac.yaml` allows, the budget rule's verbs each used.

use k8s_openapi::api::core::v1::Pod;
use kube::api::EvictParams;

use super::*;

/// The rule of the jobs' PodDisruptionBudgets.
fn budget_rule(r: &serde_json::Value) -> bool {
    strings(&r["resources"]) == ["poddisruptionbudgets"]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_takes_one_replica_of_a_shard_at_a_time() {
    let etcd = EtcdCluster::start(1).await.expect("etcd");
    let (api, client, operator_client) = fake_api().await;
    let stop = CancellationToken::new();
    // A kubelet of its own: stopped, evicted pods stay terminating (their grace period)
    // as on a node, instead of going at once.
    let kubelet_stop = CancellationToken::new();
    let first_kubelet = kubelet(api.clone(), kubelet_stop.clone());
    let operator = tokio::spawn(controller::run(
        operator_client,
        test_config(),
        Arc::new(Metrics::default()),
        stop.clone(),
    ));
    let mut tj = mnist_on(
        etcd.endpoints(),
        "trainers = 1\npservers = 2\npserver_replicas = 2\n",
    );
    tj.spec.plaintext = true;
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);
    jobs.create(&PostParams::default(), &tj)
        .await
        .expect("create the job");
    let (within, every) = (Duration::from_secs(30), Duration::from_millis(50));
    let running = |name: &'static str| {
        let api = api.clone();
        move || {
            let api = api.clone();
            async move {
                api.get("pods", NS, name).is_some_and(|p| {
                    p["status"]["phase"] == "Running"
                        && p["metadata"]["deletionTimestamp"].is_null()
                })
            }
        }
    };
    let all = wait_until(within, every, || async {
        pod_names(&api, "pserver").len() == 4
            && ["mnist-shard-0", "mnist-shard-1"]
                .iter()
                .all(|b| api.get("poddisruptionbudgets", NS, b).is_some())
    })
    .await;
    assert!(all, "{:?}", api.list("poddisruptionbudgets", NS));
    for p in [
        "mnist-pserver-0",
        "mnist-pserver-1",
        "mnist-pserver-2",
        "mnist-pserver-3",
    ] {
        assert!(
            wait_until(within, every, running(p)).await,
            "{p} not running"
        );
    }
    let budget = api
        .get("poddisruptionbudgets", NS, "mnist-shard-0")
        .expect("shard 0's budget");
    assert_eq!(budget["spec"]["minAvailable"], 1);
    assert_eq!(
        budget["spec"]["selector"]["matchLabels"]["edl.dev/shard"],
        "0"
    );

    kubelet_stop.cancel();
    first_kubelet.await.expect("kubelet");
    // Slots 0 and 2 hold shard 0; 1 and 3 shard 1. A refused eviction is an answer
    // here, not a retry (kube's client retries 429s; `kubectl drain` retries by itself).
    let mut config = Config::new(api.url().parse().expect("url"));
    config.default_retry = false;
    let drainer = Client::try_from(config).expect("client");
    let pods: Api<Pod> = Api::namespaced(drainer, NS);
    let evict = |name: &'static str| {
        let pods = pods.clone();
        async move { pods.evict(name, &EvictParams::default()).await }
    };
    let old = api.get("pods", NS, "mnist-pserver-0").expect("it")["metadata"]["uid"].clone();
    evict("mnist-pserver-0")
        .await
        .expect("the first replica of shard 0 may go");
    match evict("mnist-pserver-2").await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 429, "{s:?}"),
        other => panic!("the last replica of shard 0 was evicted: {other:?}"),
    }
    evict("mnist-pserver-1")
        .await
        .expect("shard 1's budget is its own");
    let terminating = api.get("pods", NS, "mnist-pserver-0").expect("terminating");
    assert!(!terminating["metadata"]["deletionTimestamp"].is_null());
    // Gone and replaced (a new pod of the same slot), the shard may lose its other
    // replica.
    let kubelet = kubelet(api.clone(), stop.clone());
    let back = wait_until(within, every, || async {
        api.get("pods", NS, "mnist-pserver-0")
            .is_some_and(|p| p["metadata"]["uid"] != old && p["status"]["phase"] == "Running")
    })
    .await;
    assert!(back, "{:?}", api.get("pods", NS, "mnist-pserver-0"));
    evict("mnist-pserver-2")
        .await
        .expect("shard 0 has its replica back");

    stop.cancel();
    operator.await.expect("operator");
    kubelet.await.expect("kubelet");
    check_rbac(&operator_accesses(&api), &|r, _| !budget_rule(r));
}
