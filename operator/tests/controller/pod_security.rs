//! Pod Security admission: in a namespace that enforces the `restricted` Pod Security
//! Standard (the fake API server's admission refuses any pod short of it, as a real
//! cluster's does), a job's pods of every role, the managed etcd's members included,
//! are admitted as the operator makes them, and a job whose spec breaks the standard
//! (a `hostPath` data volume) is told so on the job, with the API server's reasons.

use k8s_openapi::api::core::v1::Namespace;

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_role_runs_under_the_restricted_pod_security_standard() {
    let etcd = EtcdCluster::start(1).await.expect("etcd");
    let mut types = ResourceType::for_operator();
    types.extend(
        ResourceType::for_deploy()
            .into_iter()
            .filter(|t| t.plural == "namespaces"),
    );
    let api = Arc::new(FakeApi::start(types).await.expect("fake API server"));
    let client = Client::try_from(Config::new(api.url().parse().expect("url"))).expect("client");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let restricted: Namespace = serde_json::from_value(json!({
        "metadata": {"name": NS, "labels": {"pod-security.kubernetes.io/enforce": "restricted"}},
    }))
    .expect("namespace");
    namespaces
        .create(&PostParams::default(), &restricted)
        .await
        .expect("create the namespace");
    let stop = CancellationToken::new();
    let kubelet = kubelet(api.clone(), stop.clone());
    let operator = tokio::spawn(controller::run(
        client.clone(),
        test_config(),
        Arc::new(Metrics::default()),
        stop.clone(),
    ));
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);
    // With the default mutual TLS (each role's Secret mounted) on a shared etcd.
    let tls = mnist_on(etcd.endpoints(), "trainers = 1\npservers = 1\n");
    // A managed etcd: its members' pods, which nothing here runs.
    let mut managed = mnist_on(Vec::new(), "trainers = 1\n");
    managed.metadata.name = Some("managed".to_owned());
    managed.spec.etcd = EtcdSpec {
        managed: true,
        members: 3,
        ..EtcdSpec::default()
    };
    // Its data on the node's disk: what the restricted standard forbids.
    let mut host = mnist_on(etcd.endpoints(), "trainers = 1\n");
    host.metadata.name = Some("host".to_owned());
    host.spec.volumes.data = Some(VolumeSource {
        host_path: Some("/srv/mnist".to_owned()),
        ..VolumeSource::default()
    });
    for tj in [&tls, &managed, &host] {
        jobs.create(&PostParams::default(), tj)
            .await
            .expect("create the job");
    }
    let named = |prefix: &'static str| {
        let api = api.clone();
        move || {
            let mut names: Vec<String> = api
                .list("pods", NS)
                .into_iter()
                .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_owned))
                .filter(|n| n.starts_with(prefix))
                .collect();
            names.sort();
            names
        }
    };
    let (within, every) = (Duration::from_secs(30), Duration::from_millis(50));
    let (tls_pods, managed_pods, host_pods) =
        (named("mnist-"), named("managed-etcd-"), named("host-"));
    let admitted = wait_until(within, every, || async {
        tls_pods().len() == 3 && managed_pods().len() == 3
    })
    .await;
    assert!(
        admitted,
        "every role's pods are admitted: {:?} {:?} {:?}",
        tls_pods(),
        managed_pods(),
        events(&api)
    );
    assert_eq!(
        tls_pods(),
        ["mnist-master-0", "mnist-pserver-0", "mnist-trainer-0"]
    );
    let refused = wait_until(within, every, || async {
        !warnings(&api, "host", "PodRefused").is_empty()
    })
    .await;
    assert!(refused, "no PodRefused event: {:?}", events(&api));
    let why = warnings(&api, "host", "PodRefused").join("\n");
    assert!(
        why.contains("violates PodSecurity \"restricted:latest\"")
            && why.contains("hostPath volumes (volumes \"data\")")
            && why.contains("docs/kubernetes.md"),
        "{why}"
    );
    assert!(host_pods().is_empty(), "{:?}", host_pods());
    stop.cancel();
    let _ = operator.await;
    let _ = kubelet.await;
}
