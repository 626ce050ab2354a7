//! A job admitted through a Kueue Workload (`edl operator run --kueue`), the test
//! playing Kueue's part by writing the Workload's status as Kueue does (no Kueue runs
//! here): the job waits without pods until admitted, runs with the trainers admitted
//! (partial admission), drains when evicted and gives its quota back, resumes when
//! admitted again, and marks its Workload finished, losing nothing.

use std::sync::Arc;
use std::time::Duration;

use edl_operator::TrainingJob;
use edl_operator::crd::{EtcdSpec, Phase};
use edl_operator::metrics::Metrics;
use kube::Api;
use kube::api::PostParams;
use serde_json::{Value, json};

use super::{NS, OnOperator, final_ledger_holds, mnist_job, pod_logs, succeeded};
use crate::support::{World, wait_until};
use crate::trainer::mnist;

/// The status Kueue writes when it admits a Workload with `trainers` trainers.
fn admitted(trainers: u32) -> Value {
    json!({
        "admission": {"clusterQueue": "cluster-queue", "podSetAssignments": [
            {"name": "master", "count": 1, "flavors": {"cpu": "default"}},
            {"name": "pserver", "count": 1, "flavors": {"cpu": "default"}},
            {"name": "trainer", "count": trainers, "flavors": {"cpu": "default"}}]},
        "conditions": [
            {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved",
             "message": "Quota reserved in ClusterQueue cluster-queue",
             "lastTransitionTime": "2026-11-27T00:00:00Z"},
            {"type": "Admitted", "status": "True", "reason": "Admitted",
             "message": "The workload is admitted",
             "lastTransitionTime": "2026-11-27T00:00:00Z"},
            {"type": "Evicted", "status": "False", "reason": "QuotaReserved",
             "message": "", "lastTransitionTime": "2026-11-27T00:00:00Z"}]
    })
}

/// Queued, admitted with one trainer of the two asked, evicted mid-training (the
/// trainer drains, the pserver writes a final checkpoint, then the admission is given
/// back), admitted again with two: the job succeeds with every pass in its final
/// ledger, no pod counted as a recovery, and its Workload marked finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_queued_through_kueue_runs_only_while_admitted_and_an_eviction_loses_nothing() {
    const QUEUED_JOB: &str = "mnist-queued";
    const PASSES: u32 = 8;
    let workload = format!("trainingjob-{QUEUED_JOB}");
    let w = World::new("unused").await;
    let (train, test) = mnist(w.dir.path());
    let metrics = Arc::new(Metrics::default());
    let OnOperator {
        pods_dir,
        api,
        client,
        _kubelet,
        stop,
        operator,
        ..
    } = OnOperator::start_with(&w, None, metrics.clone(), true).await;
    let mut tj = mnist_job(
        QUEUED_JOB,
        (&train, &test),
        PASSES,
        "3s",
        EtcdSpec {
            endpoints: w.etcd.endpoints(),
            ..EtcdSpec::default()
        },
    );
    tj.metadata.labels =
        Some([("kueue.x-k8s.io/queue-name".to_owned(), "team-a".to_owned())].into());
    assert_eq!(tj.spec.cluster.trainers, 2);
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);
    jobs.create(&PostParams::default(), &tj)
        .await
        .expect("create the job");
    // The flavor Kueue admits it with (`default`: no node labels, no tolerations),
    // which a cluster has before Kueue admits anything with it.
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
    let flavor = json!({"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "ResourceFlavor",
                        "metadata": {"name": "default"}, "spec": {}});
    flavors
        .create(
            &PostParams::default(),
            &serde_json::from_value(flavor).expect("a ResourceFlavor"),
        )
        .await
        .expect("create the ResourceFlavor");
    let status = || {
        let jobs = jobs.clone();
        async move { jobs.get(QUEUED_JOB).await.ok().and_then(|j| j.status) }
    };
    let job_pods = || -> Vec<Value> {
        api.list("pods", NS)
            .into_iter()
            .filter(|p| p["metadata"]["labels"]["edl.dev/job"] == QUEUED_JOB)
            .collect()
    };
    let reason = |s: &edl_operator::crd::TrainingJobStatus| {
        s.conditions
            .iter()
            .find(|c| c.type_ == "Suspended" && c.status == "True")
            .map(|c| c.reason.clone())
    };
    let within = Duration::from_secs(120);

    // Queued: the Workload is made, the job waits without pods.
    let waiting = wait_until(within, || async {
        api.get("workloads", NS, &workload).is_some()
            && status()
                .await
                .is_some_and(|s| reason(&s).as_deref() == Some("AwaitingAdmission"))
    })
    .await;
    assert!(waiting, "{:?}", status().await);
    let wl = api.get("workloads", NS, &workload).expect("the Workload");
    assert_eq!(wl["spec"]["queueName"], "team-a");
    assert_eq!(wl["spec"]["podSets"][2]["minCount"], 1);
    let seen = metrics.reconciles.get();
    let looked = wait_until(within, || async { metrics.reconciles.get() >= seen + 4 }).await;
    assert!(looked, "the operator stopped reconciling");
    assert!(job_pods().is_empty(), "a pod was made before admission");

    // Admitted with one trainer: Kueue writes the admission by server-side apply, as its
    // admission manager (which the release must clear under).
    api.apply_status(
        "workloads",
        NS,
        &workload,
        "kueue-admission",
        &admitted(1),
        true,
    )
    .expect("admit");
    let training = wait_until(within, || async {
        status()
            .await
            .is_some_and(|s| s.pass >= Some(1) && s.phase == Phase::Running)
    })
    .await;
    assert!(training, "{:?}\n{}", status().await, pod_logs(&pods_dir));
    let trainers: Vec<String> = job_pods()
        .iter()
        .filter(|p| p["metadata"]["labels"]["edl.dev/role"] == "trainer")
        .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(
        trainers,
        [format!("{QUEUED_JOB}-trainer-0")],
        "one trainer admitted"
    );
    assert!(
        job_pods()
            .iter()
            .all(|p| p["metadata"]["labels"]["kueue.x-k8s.io/queue-name"].is_null()),
        "admitted as a whole: no pod for Kueue's pod integration"
    );

    // Evicted (preempted): the job drains, then gives its quota back.
    let mut evicted = admitted(1);
    evicted["conditions"][2] = json!({"type": "Evicted", "status": "True",
        "reason": "Preempted", "message": "Preempted to accommodate a workload of priority 100",
        "lastTransitionTime": "2026-11-27T00:01:00Z"});
    api.apply_status(
        "workloads",
        NS,
        &workload,
        "kueue-admission",
        &evicted,
        true,
    )
    .expect("evict");
    let released = wait_until(within, || async {
        let wl = api.get("workloads", NS, &workload).unwrap_or_default();
        job_pods().is_empty() && wl["status"]["admission"].is_null()
    })
    .await;
    assert!(released, "{:?}\n{}", status().await, pod_logs(&pods_dir));
    // Queued again: it waits for a new admission (the eviction itself is an Event,
    // checked at the end).
    let queued_again = wait_until(within, || async {
        status()
            .await
            .is_some_and(|s| reason(&s).as_deref() == Some("AwaitingAdmission"))
    })
    .await;
    assert!(queued_again, "{:?}", status().await);
    let wl = api.get("workloads", NS, &workload).expect("the Workload");
    let quota = wl["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "QuotaReserved")
        .cloned()
        .unwrap_or_default();
    assert_eq!(quota["status"], "False", "{wl}");
    let ps_log = std::fs::read_to_string(pods_dir.join(format!("{QUEUED_JOB}-pserver-0.log")))
        .unwrap_or_default();
    assert!(
        ps_log.contains("final checkpoint written"),
        "the pserver wrote no final checkpoint:\n{ps_log}"
    );

    // Admitted again, with both trainers.
    api.apply_status(
        "workloads",
        NS,
        &workload,
        "kueue-admission",
        &admitted(2),
        true,
    )
    .expect("admit again");
    let s = succeeded(&jobs, QUEUED_JOB, &pods_dir).await;
    assert!(s.recoveries.is_empty(), "{:?}", s.recoveries);
    assert_eq!(s.trainers.desired, 2);
    final_ledger_holds(&api, &pods_dir, &w.backend, QUEUED_JOB, PASSES).await;
    let finished = wait_until(within, || async {
        api.get("workloads", NS, &workload).is_some_and(|wl| {
            wl["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Finished" && c["status"] == "True")
        })
    })
    .await;
    assert!(finished, "{:?}", api.get("workloads", NS, &workload));
    let events: Vec<String> = api
        .list("events", NS)
        .into_iter()
        .filter_map(|e| e["reason"].as_str().map(str::to_owned))
        .collect();
    for reason in ["AwaitingAdmission", "Evicted", "Resumed", "Succeeded"] {
        assert!(events.iter().any(|e| e == reason), "{reason} in {events:?}");
    }
    assert!(!events.iter().any(|e| e == "PodReplaced"), "{events:?}");
    stop.cancel();
    operator.await.expect("operator");
}
