//! Admission systems, against the fake API server and a real etcd. A queued job under
//! an operator that admits through Kueue (`--kueue`; the test writes the Workload's
//! status as Kueue would): the Workload is made and no pod before admission; admitted, the job's pods
//! come; evicted, they go and the admission is given back; every request is one
//! `deploy/rbac.yaml` allows, the Workload rules' verbs each used. (The end-to-end
//! run with real processes and its ledger is `tests/e2e/kubernetes/kueue.rs`.) A job
//! that asks for Volcano gets its PodGroup, and its pods name the scheduler and group.

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
            kueue: true,
            ..test_config()
        },
        metrics.clone(),
        stop.clone(),
    ));
    let mut tj = mnist_on(
        etcd.endpoints(),
        "trainers = 2\nmin_trainers = 1\nmax_trainers = 4\n",
    );
    tj.spec.plaintext = true;
    tj.metadata.labels = Some([("kueue.x-k8s.io/queue-name".to_owned(), "q".to_owned())].into());
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);
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

    // The trainers admitted on a GPU flavor (its node labels and toleration go on
    // their pods), the others on one without either.
    let flavors: Api<kube::api::DynamicObject> = Api::all_with(
        client.clone(),
        &kube::api::ApiResource {
            group: "kueue.x-k8s.io".to_owned(),
            version: "v1beta1".to_owned(),
            api_version: "kueue.x-k8s.io/v1beta1".to_owned(),
            kind: "ResourceFlavor".to_owned(),
            plural: "resourceflavors".to_owned(),
        },
    );
    let admitted = json!({
        "admission": {"clusterQueue": "cq", "podSetAssignments": [
            {"name": "master", "count": 1, "flavors": {"cpu": "default-flavor"}},
            {"name": "trainer", "count": 1,
             "flavors": {"cpu": "default-flavor", "nvidia.com/gpu": "gpu-a100"}}]},
        "conditions": [{"type": "QuotaReserved", "status": "True"},
                       {"type": "Admitted", "status": "True"}]});
    // Kueue writes the admission by server-side apply, as its admission manager.
    api.apply_status(
        "workloads",
        NS,
        WORKLOAD,
        "kueue-admission",
        &admitted,
        true,
    )
    .expect("admit");
    // Admitted with flavors that are not there yet: the job waits, saying which, and
    // makes no pod (placed without its flavor, a trainer could land off its nodes).
    let said = wait_until(within, every, || async {
        condition(&api, NS, JOB, "Suspended").is_some_and(|(status, reason, message)| {
            status == "True"
                && reason == "AwaitingAdmission"
                && message.contains("ResourceFlavor")
                && message.contains("create it")
        })
    })
    .await;
    assert!(said, "{:?}", condition(&api, NS, JOB, "Suspended"));
    assert!(
        pod_names(&api, "master").is_empty(),
        "a pod without its flavor"
    );
    for flavor in [
        json!({"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "ResourceFlavor",
               "metadata": {"name": "default-flavor"}, "spec": {}}),
        json!({"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "ResourceFlavor",
               "metadata": {"name": "gpu-a100"},
               "spec": {"nodeLabels": {"cloud.example/gpu": "a100"},
                        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                         "effect": "NoSchedule"}]}}),
    ] {
        flavors
            .create(
                &PostParams::default(),
                &serde_json::from_value(flavor).expect("a flavor"),
            )
            .await
            .expect("create a ResourceFlavor");
    }

    let running = wait_until(within, every, || async {
        pod_names(&api, "master").len() == 1 && pod_names(&api, "trainer").len() == 1
    })
    .await;
    assert!(running, "{:?}", events(&api));
    // Its pods up, the Workload says so (Kueue's wait for pods ready).
    let ready = wait_until(within, every, || async {
        api.get("workloads", NS, WORKLOAD).is_some_and(|w| {
            w["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "PodsReady" && c["status"] == "True")
        })
    })
    .await;
    assert!(ready, "{:?}", api.get("workloads", NS, WORKLOAD));
    for p in api.list("pods", NS) {
        let trainer = p["metadata"]["labels"]["edl.dev/role"] == "trainer";
        let on_gpu = p["spec"]["nodeSelector"]["cloud.example/gpu"] == "a100";
        let tolerates = p["spec"]["tolerations"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|t| t["key"] == "nvidia.com/gpu");
        assert_eq!(
            (on_gpu, tolerates),
            (trainer, trainer),
            "{}: the GPU flavor is the trainers'",
            p["metadata"]["name"]
        );
    }

    let mut evicted = admitted.clone();
    evicted["conditions"]
        .as_array_mut()
        .expect("conditions")
        .push(
            json!({"type": "Evicted", "status": "True", "reason": "Preempted",
                     "message": "preempted"}),
        );
    api.apply_status("workloads", NS, WORKLOAD, "kueue-admission", &evicted, true)
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
    // The operator's own conditions are applied under its field manager, which owns them
    // and nothing of Kueue's.
    let wl = api.get("workloads", NS, WORKLOAD).expect("the Workload");
    let own = wl["metadata"]["managedFields"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["manager"] == "edl-operator")
        .cloned()
        .unwrap_or_default();
    assert_eq!(own["operation"], "Apply", "{wl}");
    assert_eq!(own["subresource"], "status");
    let owned: Vec<&String> = own["fieldsV1"]["f:status"]["f:conditions"]
        .as_object()
        .map(|m| m.keys().collect())
        .unwrap_or_default();
    assert_eq!(owned, [r#"k:{"type":"PodsReady"}"#], "{own}");
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

/// A job that asks for Volcano gets its PodGroup (the job at its smallest as
/// `minMember`, its queue) before its pods, each of which names the `volcano`
/// scheduler and the group; the PodGroup is made once, and its `minMember` follows the
/// job held at 0 trainers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volcano_job_gets_its_pod_group_before_its_pods() {
    let etcd = EtcdCluster::start(1).await.expect("etcd");
    let (api, client, operator_client) = fake_api().await;
    let stop = CancellationToken::new();
    let kubelet = kubelet(api.clone(), stop.clone());
    let metrics = Arc::new(Metrics::default());
    let operator = tokio::spawn(controller::run(
        operator_client,
        test_config(),
        metrics.clone(),
        stop.clone(),
    ));
    let mut tj = mnist_on(
        etcd.endpoints(),
        "trainers = 3\nmin_trainers = 2\nmax_trainers = 4\n",
    );
    tj.spec.plaintext = true;
    tj.spec.volcano = Some(edl_operator::crd::VolcanoSpec {
        queue: Some("research".to_owned()),
    });
    let jobs: Api<TrainingJob> = Api::namespaced(client, NS);
    jobs.create(&PostParams::default(), &tj)
        .await
        .expect("create the job");
    let (within, every) = (Duration::from_secs(30), Duration::from_millis(50));
    let running = wait_until(within, every, || async {
        pod_names(&api, "trainer").len() == 3
    })
    .await;
    assert!(running, "{:?}", events(&api));
    let group = api.get("podgroups", NS, JOB).expect("the PodGroup");
    assert_eq!(
        group["spec"]["minMember"], 4,
        "a master, a pserver, 2 trainers"
    );
    assert_eq!(group["spec"]["queue"], "research");
    // What those four request (the roles' defaults: 250m + 500m + 2 x 1 CPU).
    assert_eq!(
        group["spec"]["minResources"],
        json!({"cpu": "2750m", "memory": "2816Mi"})
    );
    for p in api.list("pods", NS) {
        assert_eq!(
            p["spec"]["schedulerName"], "volcano",
            "{}",
            p["metadata"]["name"]
        );
        assert_eq!(
            p["metadata"]["annotations"]["scheduling.k8s.io/group-name"],
            JOB
        );
    }
    let rounds = metrics.reconciles.get();
    let more = wait_until(within, every, || async {
        metrics.reconciles.get() >= rounds + 3
    })
    .await;
    assert!(more, "the operator stopped deciding");
    // Held at 0 trainers: they drain, the master and the pserver stay, and the group no
    // longer counts a trainer.
    jobs.patch_scale(
        JOB,
        &PatchParams::default(),
        &Patch::Merge(&json!({"spec": {"replicas": 0}})),
    )
    .await
    .expect("scale to 0");
    let held = wait_until(within, every, || async {
        pod_names(&api, "trainer").is_empty()
            && api.get("podgroups", NS, JOB).is_some_and(|g| {
                g["spec"]["minMember"] == 2
                    && g["spec"]["minResources"] == json!({"cpu": "750m", "memory": "768Mi"})
            })
    })
    .await;
    assert!(held, "{:?}", events(&api));
    assert_eq!(pod_names(&api, "master").len(), 1);
    assert_eq!(pod_names(&api, "pserver").len(), 1);
    stop.cancel();
    operator.await.expect("operator");
    kubelet.await.expect("kubelet");
    let accesses = operator_accesses(&api);
    let creates = accesses
        .iter()
        .filter(|a| a.resource == "podgroups" && a.verb == "create")
        .count();
    assert_eq!(creates, 1, "the PodGroup is made once");
    // Before its pods: the operator's first PodGroup create comes before its first pod
    // create (the scheduler must find the group a pod names).
    let first = |resource: &str| {
        accesses
            .iter()
            .position(|a| a.resource == resource && a.verb == "create")
    };
    let (group, pod) = (first("podgroups"), first("pods"));
    assert!(
        matches!((group, pod), (Some(g), Some(p)) if g < p),
        "the PodGroup (create #{group:?}) before any pod (create #{pod:?})"
    );
    check_rbac(&accesses, &|r, _| !volcano_rule(r));
}
