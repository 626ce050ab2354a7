//! A queued job under an operator that admits through Kueue (`--kueue`), against the
//! fake API server (the test writes the Workload's status as Kueue would) and a real
//! etcd: the Workload is made and no pod before admission; admitted, the job's pods
//! come; evicted, they go and the admission is given back; every request is one
//! `deploy/rbac.yaml` allows, the Workload rules' verbs each used. (The end-to-end
//! run with real processes and its ledger is `tests/e2e/kubernetes/kueue.rs`.)

use super::*;

const WORKLOAD: &str = "trainingjob-mnist";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_job_waits_for_its_workload_runs_when_admitted_and_stops_when_evicted() {
    let etcd = EtcdCluster::start(1).await.expect("etcd");
    let (api, client, operator_client) = fake_api().await;
    let stop = CancellationToken::new();
    let kubelet = kubelet(api.clone(), stop.clone());
    let metrics = Arc::new(Metrics::default());
    let operator = tokio::spawn(controller::run(
        operator_client,
        ControllerConfig {
            namespace: Some(NS.to_owned()),
            resync: Duration::from_millis(300),
            kueue: true,
            ..ControllerConfig::default()
        },
        metrics.clone(),
        stop.clone(),
    ));
    let spec = edl_job::JobSpec::parse_toml(&format!(
        "name = \"{JOB}\"\n[data]\ntrain = [\"/d/a-*.recordio\"]\n[model]\nkind = \"mnist_mlp\"\n\
         [cluster]\ntrainers = 2\nmin_trainers = 1\nmax_trainers = 4\n"
    ))
    .expect("spec");
    let mut tj = TrainingJob::from_job_spec(&spec, "edl:test", Some(NS));
    tj.spec.etcd = EtcdSpec {
        endpoints: etcd.endpoints(),
        ..EtcdSpec::default()
    };
    tj.spec.plaintext = true;
    tj.metadata.labels = Some([("kueue.x-k8s.io/queue-name".to_owned(), "q".to_owned())].into());
    let jobs: Api<TrainingJob> = Api::namespaced(client, NS);
    jobs.create(&PostParams::default(), &tj)
        .await
        .expect("create the job");
    let (within, every) = (Duration::from_secs(30), Duration::from_millis(50));

    let made = wait_until(within, every, || async {
        api.get("workloads", NS, WORKLOAD).is_some()
    })
    .await;
    assert!(made, "no Workload");
    let rounds = metrics.reconciles.get();
    let looked = wait_until(within, every, || async {
        metrics.reconciles.get() >= rounds + 3
    })
    .await;
    assert!(looked, "the operator stopped deciding");
    assert!(
        pod_names(&api, "master").is_empty(),
        "a pod before admission"
    );

    let admitted = json!({
        "admission": {"clusterQueue": "cq", "podSetAssignments": [
            {"name": "trainer", "count": 1}]},
        "conditions": [{"type": "QuotaReserved", "status": "True"},
                       {"type": "Admitted", "status": "True"}]});
    api.patch_status("workloads", NS, WORKLOAD, &admitted)
        .expect("admit");
    let running = wait_until(within, every, || async {
        pod_names(&api, "master").len() == 1 && pod_names(&api, "trainer").len() == 1
    })
    .await;
    assert!(running, "{:?}", events(&api));

    let mut evicted = admitted.clone();
    evicted["conditions"]
        .as_array_mut()
        .expect("conditions")
        .push(
            json!({"type": "Evicted", "status": "True", "reason": "Preempted",
                     "message": "preempted"}),
        );
    api.patch_status("workloads", NS, WORKLOAD, &evicted)
        .expect("evict");
    let released = wait_until(within, every, || async {
        pod_names(&api, "master").is_empty()
            && pod_names(&api, "trainer").is_empty()
            && api
                .get("workloads", NS, WORKLOAD)
                .is_some_and(|w| w["status"]["admission"].is_null())
    })
    .await;
    assert!(released, "{:?}", api.get("workloads", NS, WORKLOAD));
    assert!(
        events(&api).iter().any(|e| e == "Evicted"),
        "{:?}",
        events(&api)
    );

    stop.cancel();
    operator.await.expect("operator");
    kubelet.await.expect("kubelet");
    check_rbac(&operator_accesses(&api), &|r, _| !kueue_rule(r));
}
