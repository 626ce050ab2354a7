//! The Kubernetes operator end to end: `edl_operator::controller` against the fake API
//! server (`edl_testkit::kube_api`), whose pods the test kubelet
//! (`edl_testkit::kubelet`) runs as real `edl` processes against a real etcd. A
//! TrainingJob trains MNIST to the end while it is scaled 2 -> 4 -> 1 through the scale
//! subresource (surplus trainers drain), loses a trainer pod and a pserver pod to
//! deletions, and reports Succeeded.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use edl_operator::TrainingJob;
use edl_operator::controller::{self, ControllerConfig};
use edl_operator::crd::{EtcdSpec, Phase, TrainingJobStatus, VolumeSource};
use edl_operator::metrics::Metrics;
use edl_testkit::kube_api::{FakeApi, ResourceType};
use edl_testkit::kubelet::{Kubelet, KubeletConfig};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, Config};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::support::{World, edl_bin, wait_until};
use crate::trainer::mnist;

const NS: &str = "ml";
const JOB: &str = "mnist-k8s";

fn uid(api: &FakeApi, pod: &str) -> Option<String> {
    api.get("pods", NS, pod)
        .and_then(|p| p["metadata"]["uid"].as_str().map(str::to_owned))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_training_job_is_scaled_survives_deleted_pods_and_succeeds_on_the_operator() {
    let w = World::new("unused").await;
    let (train, test) = mnist(w.dir.path());
    let checkpoints = w.dir.path().join("checkpoints");
    let pods_dir = w.dir.path().join("pods");
    for d in [&checkpoints, &pods_dir] {
        std::fs::create_dir_all(d).expect("mkdir");
    }
    let api = Arc::new(
        FakeApi::start(vec![
            ResourceType::pods(),
            ResourceType::services(),
            ResourceType::events_v1(),
            ResourceType::trainingjobs(),
        ])
        .await
        .expect("fake API server"),
    );
    let _kubelet = Kubelet::start(
        api.clone(),
        KubeletConfig {
            namespace: NS.to_owned(),
            edl: edl_bin().into(),
            dir: pods_dir.clone(),
            claims: BTreeMap::new(),
        },
    );
    let client = Client::try_from(Config::new(api.url().parse().expect("url"))).expect("client");
    let stop = CancellationToken::new();
    let metrics = Arc::new(Metrics::default());
    let operator = tokio::spawn(controller::run(
        client.clone(),
        ControllerConfig {
            namespace: Some(NS.to_owned()),
            resync: Duration::from_millis(500),
            ..ControllerConfig::default()
        },
        metrics.clone(),
        stop.clone(),
    ));

    let spec = edl_job::JobSpec::parse_toml(&format!(
        "name = \"{JOB}\"\n[data]\ntrain = [\"{train}\"]\ntest = [\"{test}\"]\n\
         [model]\nkind = \"mnist_mlp\"\n\
         [train]\nmode = \"async\"\npasses = 12\nbatch_size = 32\noptimizer = \"adam\"\n\
         learning_rate = 0.001\nseed = 7\n\
         [cluster]\npservers = 1\ntrainers = 2\nmin_trainers = 1\nmax_trainers = 4\n\
         lease_ttl = \"3s\"\ncheckpoint_every = \"2s\"\n"
    ))
    .expect("spec");
    let mut tj = TrainingJob::from_job_spec(&spec, "edl:test", Some(NS));
    tj.spec.etcd = EtcdSpec {
        endpoints: w.etcd.endpoints(),
        ..EtcdSpec::default()
    };
    tj.spec.volumes.checkpoints = Some(VolumeSource {
        host_path: Some(checkpoints.display().to_string()),
        ..VolumeSource::default()
    });
    tj.spec.drain_seconds = 20;
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);
    jobs.create(&PostParams::default(), &tj)
        .await
        .expect("create the job");

    let status = || {
        let jobs = jobs.clone();
        async move { jobs.get(JOB).await.ok().and_then(|j| j.status) }
    };
    let logs = || {
        let mut out = String::new();
        for e in std::fs::read_dir(&pods_dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "log") {
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(5).collect();
                out.push_str(&format!("== {}\n{}\n", p.display(), tail.join("\n")));
            }
        }
        out
    };
    // Running with `n` trainers, all registered, the job not over yet.
    let at = |n: u32| async move {
        status().await.is_some_and(|s: TrainingJobStatus| {
            s.trainers.running == n
                && s.trainers.registered == n
                && s.trainers.desired == n
                && s.phase == Phase::Running
        })
    };
    let within = Duration::from_secs(90);
    assert!(
        wait_until(within, || at(2)).await,
        "two trainers: {:?}\n{}",
        status().await,
        logs()
    );

    let scale = |n: u32| {
        let jobs = jobs.clone();
        async move {
            jobs.patch_scale(
                JOB,
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": {"replicas": n}})),
            )
            .await
            .expect("scale");
        }
    };
    scale(4).await;
    assert!(
        wait_until(within, || at(4)).await,
        "four trainers: {:?}\n{}",
        status().await,
        logs()
    );
    scale(1).await;
    assert!(
        wait_until(within, || at(1)).await,
        "one trainer: {:?}\n{}",
        status().await,
        logs()
    );
    // The three that went drained (SIGTERM: the task handed back, exit 0), then their
    // pods were removed.
    let gone = wait_until(within, || {
        let api = api.clone();
        async move { (1..4).all(|i| api.get("pods", NS, &format!("{JOB}-trainer-{i}")).is_none()) }
    })
    .await;
    assert!(gone, "the surplus trainers' pods stayed:\n{}", logs());
    for i in 1..4 {
        let log = std::fs::read_to_string(pods_dir.join(format!("{JOB}-trainer-{i}.log")))
            .unwrap_or_default();
        assert!(
            log.contains("SIGTERM") && log.contains("drained=true"),
            "trainer {i} did not drain:\n{log}"
        );
    }

    // A deleted trainer pod and a deleted pserver pod come back.
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), NS);
    for pod in [format!("{JOB}-trainer-0"), format!("{JOB}-pserver-0")] {
        let before = uid(&api, &pod);
        pods.delete(&pod, &DeleteParams::default())
            .await
            .expect("delete a pod");
        let back = wait_until(within, || {
            let (api, pod, before) = (api.clone(), pod.clone(), before.clone());
            async move {
                api.get("pods", NS, &pod).is_some_and(|p| {
                    p["metadata"]["uid"].as_str() != before.as_deref()
                        && p["status"]["phase"] == "Running"
                })
            }
        })
        .await;
        assert!(
            back,
            "{pod} was not recreated: {:?}\n{}",
            status().await,
            logs()
        );
        let s = status().await.expect("status");
        assert!(
            !s.phase.is_finished(),
            "the job ended before the faults: {s:?}"
        );
    }

    // It trains to the end.
    let done = wait_until(Duration::from_secs(400), || async move {
        status().await.is_some_and(|s| s.phase.is_finished())
    })
    .await;
    let s = status().await.expect("status");
    assert!(done && s.phase == Phase::Succeeded, "{s:?}\n{}", logs());
    // The last pass as the master reported it when the job ended: every task done,
    // none failed, none left.
    let tasks = s.tasks.clone().expect("tasks");
    assert!(
        tasks.failed == 0 && tasks.todo == 0 && tasks.pending == 0 && tasks.done > 0,
        "{tasks:?}"
    );
    assert_eq!(s.pass, Some(11), "the 12th pass was the last");
    assert!(
        s.recoveries
            .iter()
            .filter(|r| r.reason.contains("deleted"))
            .count()
            >= 2,
        "{:?}",
        s.recoveries
    );
    let events: Vec<String> = api
        .list("events", NS)
        .into_iter()
        .filter_map(|e| e["reason"].as_str().map(str::to_owned))
        .collect();
    for reason in ["ScaledUp", "ScaledDown", "PodReplaced", "Succeeded"] {
        assert!(events.iter().any(|e| e == reason), "{reason} in {events:?}");
    }
    stop.cancel();
    operator.await.expect("operator");
}
