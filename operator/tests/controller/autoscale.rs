//! The operator's autoscaler (`edl operator run --autoscale`, `edl_operator::autoscale`)
//! against the fake API server, through a real kube client. The test plays the rest of
//! the cluster: it creates the nodes, the jobs' pods (bound to nodes, as a scheduler
//! would) and writes the jobs' progress into their status (as the controller does from
//! etcd). What it shows: a job is grown through the scale subresource once its speed is
//! known, up to its max; a job of a higher PriorityClass that does not fit makes the
//! autoscaler lower the first one, though it was changed moments before, by exactly the
//! trainers that make room; with `preempt`, a job that needs its minimum has a job with
//! much work left held at 0 trainers; every request is one `deploy/rbac.yaml` allows,
//! and its autoscaler rules are used.

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use tokio::time::Instant;

use edl_autoscaler::policy::PolicyConfig;
use edl_operator::autoscale::{self, AutoscaleConfig};

use super::*;

const LOW: &str = "low";
const HIGH: &str = "high";

async fn create_node(client: &Client, api: &FakeApi, name: &str) {
    let nodes: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(json!({"metadata": {"name": name}})).expect("node");
    nodes
        .create(&PostParams::default(), &node)
        .await
        .expect("create a node");
    api.patch_status(
        "nodes",
        "",
        name,
        &json!({
            "allocatable": {"cpu": "16", "memory": "64Gi"},
            "conditions": [{"type": "Ready", "status": "True"}],
        }),
    )
    .expect("node status");
}

/// A pod of `job` requesting `cpu`, bound to `node` and Running, or waiting for a node.
async fn create_pod(
    client: &Client,
    api: &FakeApi,
    job: &str,
    role: &str,
    i: u32,
    cpu: &str,
    node: Option<&str>,
) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let name = format!("{job}-{role}-{i}");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"edl.dev/job": job, "edl.dev/role": role}},
        "spec": {
            "nodeName": node,
            "containers": [{"name": role, "image": "edl:test",
                "resources": {"requests": {"cpu": cpu, "memory": "1Gi"}}}],
        },
    }))
    .expect("pod");
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create a pod");
    let phase = if node.is_some() { "Running" } else { "Pending" };
    api.patch_status("pods", NS, &name, &json!({"phase": phase}))
        .expect("pod status");
}

async fn create_job(
    client: &Client,
    name: &str,
    trainers: u32,
    min: u32,
    max: u32,
    class: Option<&str>,
) {
    let spec = edl_job::JobSpec::parse_toml(&format!(
        "name = \"{name}\"\n[data]\ntrain = [\"/d/a-*.recordio\"]\n[model]\nkind = \"mnist_mlp\"\n\
         [train]\npasses = 10\n[cluster]\ntrainers = {trainers}\nmin_trainers = {min}\n\
         max_trainers = {max}\n"
    ))
    .expect("spec");
    let mut tj = TrainingJob::from_job_spec(&spec, "edl:test", Some(NS));
    tj.spec.priority_class_name = class.map(str::to_owned);
    tj.spec.resources.trainer = Some(
        serde_json::from_value(json!({"requests": {"cpu": "2", "memory": "1Gi"}}))
            .expect("requests"),
    );
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);
    jobs.create(&PostParams::default(), &tj)
        .await
        .expect("create the job");
}

/// The job's progress as the controller reports it: `done` of 1,000 tasks of pass 0.
async fn report(client: &Client, name: &str, done: u64, registered: u32) {
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);
    let status = json!({"status": {
        "phase": "Running",
        "pass": 0,
        "tasks": {"todo": 1000 - done, "pending": 0, "done": done, "failed": 0},
        "trainers": {"running": registered, "desired": registered, "registered": registered},
    }});
    jobs.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("job status");
}

/// The autoscaler of `policy` over the test's namespace, every 200 ms, a speed known
/// after 1 s: its stop, its metrics, its task.
fn start(
    client: Client,
    policy: PolicyConfig,
) -> (CancellationToken, Arc<Metrics>, tokio::task::JoinHandle<()>) {
    let stop = CancellationToken::new();
    let metrics = Arc::new(Metrics::default());
    let config = AutoscaleConfig {
        namespace: Some(NS.to_owned()),
        every: Duration::from_millis(200),
        window: 1.0,
        policy,
    };
    let task = tokio::spawn(autoscale::run(
        client,
        config,
        metrics.clone(),
        stop.clone(),
    ));
    (stop, metrics, task)
}

async fn replicas(client: &Client, name: &str) -> Option<i32> {
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);
    jobs.get_scale(name).await.ok()?.spec?.replicas
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_autoscaler_grows_a_job_then_makes_room_for_a_higher_priority_one() {
    let (api, client, operator_client) = fake_api().await;
    for n in ["n1", "n2"] {
        create_node(&client, &api, n).await;
    }
    // The low job: a pserver and 2 trainers on n1, 10 tasks/s.
    create_job(&client, LOW, 2, 1, 12, None).await;
    create_pod(&client, &api, LOW, "pserver", 0, "1", Some("n1")).await;
    for i in 0..2 {
        create_pod(&client, &api, LOW, "trainer", i, "2", Some("n1")).await;
    }
    report(&client, LOW, 0, 2).await;

    let (stop, metrics, autoscaler) = start(operator_client, PolicyConfig::default());
    // Progress at 10 tasks/s with 2 trainers, until the job is grown.
    let started = Instant::now();
    let within = Duration::from_secs(20);
    let mut grown = None;
    while started.elapsed() < within {
        let done = (started.elapsed().as_secs_f64() * 10.0) as u64;
        report(&client, LOW, done.min(999), 2).await;
        grown = replicas(&client, LOW).await.filter(|&r| r != 2);
        if grown.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // 32 CPU, 31.04 usable: room for 15 trainers of 2 CPU beside the pserver; max 12.
    assert_eq!(grown, Some(12), "grown to its max once its speed was known");
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "not before a window of steady speed"
    );
    let grown_at = Instant::now();
    assert_eq!(metrics.autoscaler_changes.get(), 1);

    // The controller and the scheduler act: 10 more trainers, alternating nodes
    // (n1: 1 + 6 x 2 = 13 CPU used, n2: 12).
    for i in 2..12 {
        let node = if i % 2 == 0 { "n2" } else { "n1" };
        create_pod(&client, &api, LOW, "trainer", i, "2", Some(node)).await;
    }
    report(&client, LOW, 100, 12).await;

    // A job of a higher priority needs 8 trainers and a pserver (17 CPU); 6.04 are free.
    let classes: Api<PriorityClass> = Api::all(client.clone());
    let urgent: PriorityClass =
        serde_json::from_value(json!({"metadata": {"name": "urgent"}, "value": 100}))
            .expect("class");
    classes
        .create(&PostParams::default(), &urgent)
        .await
        .expect("create the class");
    create_job(&client, HIGH, 8, 8, 8, Some("urgent")).await;
    create_pod(&client, &api, HIGH, "pserver", 0, "1", None).await;
    for i in 0..8 {
        create_pod(&client, &api, HIGH, "trainer", i, "2", None).await;
    }
    let lowered = wait_until(
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async { replicas(&client, LOW).await == Some(6) },
    )
    .await;
    assert!(lowered, "low: {:?}", replicas(&client, LOW).await);
    // The three holes (1 on n1, 2 on n2... as 2-CPU slots: 1 and 2) take 3 of the 8
    // trainers; 5 take a low trainer's node each, and one more keeps the cluster within
    // 97%: 12 -> 6. Admission does not wait for the low job's 15 s after a change.
    assert!(
        grown_at.elapsed() < Duration::from_secs(15),
        "the positive witness: low was still within its min_interval when lowered"
    );
    assert_eq!(
        replicas(&client, HIGH).await,
        Some(8),
        "a fixed job is not resized"
    );
    assert_eq!(metrics.autoscaler_changes.get(), 2);

    stop.cancel();
    autoscaler.await.expect("autoscaler");
    check_rbac(&operator_accesses(&api), &|r, _| !autoscaler_rule(r));
}

/// `--autoscale-preempt`: a job that needs its minimum and finds no room has a job with
/// much work left held at 0 trainers through the scale subresource (its pserver stays).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_preempt_the_autoscaler_holds_a_long_job_at_zero_for_a_new_one() {
    let (api, client, operator_client) = fake_api().await;
    create_node(&client, &api, "n1").await;
    // n1: 16 CPU, 15.52 usable. Another tenant's 9 CPU, and the low job at its minimum.
    create_pod(&client, &api, "tenant", "web", 0, "9", Some("n1")).await;
    create_job(&client, LOW, 2, 2, 8, None).await;
    create_pod(&client, &api, LOW, "pserver", 0, "1", Some("n1")).await;
    for i in 0..2 {
        create_pod(&client, &api, LOW, "trainer", i, "2", Some("n1")).await;
    }
    report(&client, LOW, 0, 2).await;
    let (stop, metrics, autoscaler) = start(operator_client, PolicyConfig::preemptive(30.0));
    // 10 tasks/s at 2 trainers: 10,000 tasks take about 1,000 s.
    let started = Instant::now();
    let report_until = |secs: f64| {
        let client = client.clone();
        async move {
            while started.elapsed().as_secs_f64() < secs {
                let done = (started.elapsed().as_secs_f64() * 10.0) as u64;
                report(&client, LOW, done.min(999), 2).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    report_until(2.0).await;
    assert_eq!(
        replicas(&client, LOW).await,
        Some(2),
        "no room to grow: left alone"
    );

    // The new job: a pserver and 2 trainers (5 CPU) waiting; 1.52 CPU are free.
    create_job(&client, HIGH, 2, 2, 4, None).await;
    create_pod(&client, &api, HIGH, "pserver", 0, "1", None).await;
    for i in 0..2 {
        create_pod(&client, &api, HIGH, "trainer", i, "2", None).await;
    }
    let held = wait_until(
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async { replicas(&client, LOW).await == Some(0) },
    )
    .await;
    assert!(held, "low: {:?}", replicas(&client, LOW).await);
    assert_eq!(
        replicas(&client, HIGH).await,
        Some(2),
        "the new job keeps its minimum"
    );
    assert_eq!(metrics.autoscaler_changes.get(), 1);
    stop.cancel();
    autoscaler.await.expect("autoscaler");
    check_rbac(&operator_accesses(&api), &|r, _| !autoscaler_rule(r));
}
