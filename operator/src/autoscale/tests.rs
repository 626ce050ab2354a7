use edl_job::JobSpec;
use serde_json::json;

use super::*;
use crate::crd::{Phase, TaskCounts, TrainingJobStatus};

const T0: f64 = 1_800_000_000.0;

fn node(name: &str, cpu: &str, mem: &str, gpu: u32, ready: bool, cordoned: bool) -> Node {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"unschedulable": cordoned},
        "status": {
            "allocatable": {"cpu": cpu, "memory": mem, "nvidia.com/gpu": gpu.to_string()},
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
        },
    }))
    .expect("node")
}

/// A pod of `job` (`None`: another tenant's) with one container's requests.
fn a_pod(name: &str, job: Option<(&str, &str)>, cpu: &str, node: Option<&str>, phase: &str) -> Pod {
    let mut labels = serde_json::Map::new();
    if let Some((j, role)) = job {
        labels.insert(JOB_LABEL.into(), json!(j));
        labels.insert(ROLE_LABEL.into(), json!(role));
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "ml", "labels": labels},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu, "memory": "1Gi"}}}],
        },
        "status": {"phase": phase},
    }))
    .expect("pod")
}

/// A Running pod `<job>-<role>-<i>` of `job` on node `a`.
fn bound(job: &str, role: &str, i: u32, cpu: &str) -> Pod {
    a_pod(
        &format!("{job}-{role}-{i}"),
        Some((job, role)),
        cpu,
        Some("a"),
        "Running",
    )
}

fn job(name: &str, trainers: u32, min: u32, max: u32, class: Option<&str>) -> TrainingJob {
    let spec = JobSpec::parse_toml(&format!(
        "name = \"{name}\"\n[data]\ntrain = [\"d-*.recordio\"]\n[model]\nkind = \"mnist_mlp\"\n\
         [train]\npasses = 2\n[cluster]\ntrainers = {trainers}\nmin_trainers = {min}\n\
         max_trainers = {max}\n"
    ))
    .expect("spec");
    let mut tj = TrainingJob::from_job_spec(&spec, "edl:test", Some("ml"));
    tj.metadata.uid = Some(format!("uid-{name}"));
    tj.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::from_second(T0 as i64 - 100).expect("time"),
    ));
    tj.spec.priority_class_name = class.map(str::to_owned);
    let mut res = BTreeMap::new();
    res.insert("cpu".to_owned(), Quantity("2".into()));
    res.insert("memory".to_owned(), Quantity("1Gi".into()));
    tj.spec.resources.trainer = Some(k8s_openapi::api::core::v1::ResourceRequirements {
        requests: Some(res),
        ..Default::default()
    });
    tj
}

/// The job's status: `done` of 100 tasks in pass `pass`, `registered` trainers.
fn progress(tj: &mut TrainingJob, pass: u32, done: u64, registered: u32) {
    tj.status = Some(TrainingJobStatus {
        phase: Phase::Running,
        pass: Some(pass),
        tasks: Some(TaskCounts {
            todo: 100 - done,
            pending: 0,
            done,
            failed: 0,
        }),
        ..Default::default()
    });
    if let Some(s) = tj.status.as_mut() {
        s.trainers.registered = registered;
    }
}

fn class(name: &str, value: i32) -> PriorityClass {
    serde_json::from_value(json!({"metadata": {"name": name}, "value": value})).expect("class")
}

fn config() -> AutoscaleConfig {
    AutoscaleConfig {
        window: 10.0,
        ..AutoscaleConfig::default()
    }
}

#[test]
fn quantities_parse_as_kubernetes_writes_them() {
    let q = |s: &str| Quantity(s.into());
    assert_eq!(mem_mib(&q("512Mi")), Some(512));
    assert_eq!(mem_mib(&q("2Gi")), Some(2048));
    assert_eq!(mem_mib(&q("1G")), Some(953));
    assert_eq!(mem_mib(&q("1048576")), Some(1));
    assert_eq!(mem_mib(&q("1.5Gi")), Some(1536));
    assert_eq!(mem_mib(&q("64Ki")), Some(0));
    assert_eq!(mem_mib(&q("lots")), None);
    let list = BTreeMap::from([
        ("cpu".to_owned(), q("1500m")),
        ("memory".to_owned(), q("4Gi")),
        ("nvidia.com/gpu".to_owned(), q("2")),
        ("ephemeral-storage".to_owned(), q("10Gi")),
    ]);
    assert_eq!(
        resources_of(&list),
        Resources {
            cpu_milli: 1500,
            mem_mib: 4096,
            gpu: 2
        }
    );
}

#[test]
fn the_snapshot_counts_what_holds_room_and_only_live_jobs() {
    let nodes = [
        node("a", "16", "64Gi", 0, true, false),
        node("b", "16", "64Gi", 0, false, false),
        node("c", "16", "64Gi", 0, true, true),
    ];
    let mut deleting = bound("j", "trainer", 2, "2");
    deleting.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::from_second(T0 as i64).expect("time"),
        ));
    let pods = [
        bound("j", "pserver", 0, "1"),
        bound("j", "trainer", 0, "2"),
        a_pod("j-trainer-1", Some(("j", "trainer")), "2", None, "Pending"),
        deleting,
        a_pod("other", None, "3", Some("a"), "Running"),
        a_pod("done", None, "8", Some("a"), "Succeeded"),
        a_pod("elsewhere", None, "4", Some("b"), "Running"),
        a_pod("queued", None, "5", None, "Pending"),
    ];
    let mut j = job("j", 2, 1, 4, Some("high"));
    progress(&mut j, 0, 10, 1);
    let mut finished = job("old", 2, 1, 4, None);
    progress(&mut finished, 1, 100, 0);
    if let Some(s) = finished.status.as_mut() {
        s.phase = Phase::Succeeded;
    }
    let mut a = Autoscaler::new(config());
    let classes = [class("high", 1000)];
    let jobs = [j, finished];
    let (snap, _) = a.pass(&Objects {
        nodes: &nodes,
        pods: &pods,
        priority_classes: &classes,
        jobs: &jobs,
        now: T0,
    });
    // Only node a: b is not ready, c cordoned.
    assert_eq!(snap.nodes.len(), 1);
    // a: the pserver, a trainer, the draining trainer and another tenant's pod.
    assert_eq!(snap.nodes[0].requested.cpu_milli, 1000 + 2000 + 2000 + 3000);
    assert_eq!(snap.unplaced.cpu_milli, 2000 + 5000);
    assert_eq!(
        snap.jobs.len(),
        1,
        "the finished job is not the autoscaler's"
    );
    let v = &snap.jobs[0];
    assert_eq!(v.name, "ml/j");
    assert_eq!((v.min, v.max, v.trainers, v.priority), (1, 4, 2, 1000));
    assert_eq!(v.trainer.cpu_milli, 2000);
    assert_eq!(v.trainer.mem_mib, 1024);
    assert_eq!(
        v.pods,
        PodCounts {
            total: 2,
            running: 1,
            pending: 1,
            unbound: 1
        }
    );
    assert_eq!(v.waiting.len(), 1);
    assert_eq!(v.remaining, Some(190.0));
    assert_eq!(v.submitted, T0 - 100.0);
    assert!(v.speed.is_empty(), "one sample is no speed yet");
}

#[test]
fn a_job_with_room_grows_once_its_speed_is_known_and_then_is_left_alone() {
    let nodes = [node("a", "32", "128Gi", 0, true, false)];
    let pods = [
        bound("j", "pserver", 0, "1"),
        bound("j", "trainer", 0, "2"),
        bound("j", "trainer", 1, "2"),
    ];
    let mut a = Autoscaler::new(config());
    let pass = |a: &mut Autoscaler, t: f64, done: u64| {
        let mut j = job("j", 2, 1, 8, None);
        progress(&mut j, 0, done, 2);
        let jobs = [j];
        a.pass(&Objects {
            nodes: &nodes,
            pods: &pods,
            priority_classes: &[],
            jobs: &jobs,
            now: t,
        })
        .1
    };
    assert_eq!(pass(&mut a, T0, 0), vec![], "no speed: not grown");
    assert_eq!(pass(&mut a, T0 + 5.0, 5), vec![], "window not over");
    let grown = pass(&mut a, T0 + 10.0, 10);
    assert_eq!(
        grown,
        vec![Change {
            namespace: "ml".into(),
            name: "j".into(),
            from: 2,
            to: 8
        }],
        "room for 6 more trainers of 2 CPU: grown to its max"
    );
    // The same objects again (the controller has not acted yet): left alone.
    assert_eq!(pass(&mut a, T0 + 15.0, 15), vec![]);
}

#[test]
fn a_higher_priority_job_takes_trainers_from_a_lower_one() {
    let nodes = [node("a", "16", "64Gi", 0, true, false)];
    let mut pods = vec![bound("low", "pserver", 0, "1")];
    for i in 0..7 {
        pods.push(bound("low", "trainer", i, "2"));
    }
    pods.push(a_pod(
        "high-pserver-0",
        Some(("high", "pserver")),
        "1",
        None,
        "Pending",
    ));
    for i in 0..3 {
        pods.push(a_pod(
            &format!("high-trainer-{i}"),
            Some(("high", "trainer")),
            "2",
            None,
            "Pending",
        ));
    }
    let mut low = job("low", 7, 1, 8, None);
    progress(&mut low, 0, 50, 7);
    let mut high = job("high", 3, 3, 3, Some("urgent"));
    progress(&mut high, 0, 0, 0);
    let mut a = Autoscaler::new(config());
    let jobs = [low, high];
    let classes = [class("urgent", 100)];
    let (_, changes) = a.pass(&Objects {
        nodes: &nodes,
        pods: &pods,
        priority_classes: &classes,
        jobs: &jobs,
        now: T0,
    });
    // 16 CPU, 15.52 usable: low holds 15; high needs 7: low drains 4 trainers (to 3).
    assert_eq!(
        changes,
        vec![Change {
            namespace: "ml".into(),
            name: "low".into(),
            from: 7,
            to: 3
        }]
    );
    // A change that could not be applied is not remembered as one.
    a.not_applied(&changes[0]);
    assert_eq!(
        a.memory[&("ml".to_owned(), "low".to_owned())].changed_at,
        None
    );
}

#[test]
fn with_preempt_a_new_job_holds_a_long_one_at_zero_trainers() {
    // 16 CPU (15.52 usable): another tenant's 9, the long job's pserver and 2 trainers
    // (its minimum). The new job needs a pserver and 2 trainers (5 CPU); 1.52 are free.
    let nodes = [node("a", "16", "64Gi", 0, true, false)];
    let mut pods = vec![
        a_pod("other", None, "9", Some("a"), "Running"),
        bound("long", "pserver", 0, "1"),
        bound("long", "trainer", 0, "2"),
        bound("long", "trainer", 1, "2"),
    ];
    let mut a = Autoscaler::new(AutoscaleConfig {
        policy: PolicyConfig::preemptive(30.0),
        ..config()
    });
    // The long job's speed: 1 task/s at 2 trainers, with 2 passes of 100 tasks.
    for (t, done) in [(T0, 0), (T0 + 10.0, 10)] {
        let mut long = job("long", 2, 2, 8, None);
        progress(&mut long, 0, done, 2);
        let jobs = [long];
        let (_, changes) = a.pass(&Objects {
            nodes: &nodes,
            pods: &pods,
            priority_classes: &[],
            jobs: &jobs,
            now: t,
        });
        assert_eq!(changes, vec![], "nothing else wants room: left alone");
    }
    pods.push(a_pod(
        "new-pserver-0",
        Some(("new", "pserver")),
        "1",
        None,
        "Pending",
    ));
    for i in 0..2 {
        pods.push(a_pod(
            &format!("new-trainer-{i}"),
            Some(("new", "trainer")),
            "2",
            None,
            "Pending",
        ));
    }
    let mut long = job("long", 2, 2, 8, None);
    progress(&mut long, 0, 20, 2);
    let jobs = [long, job("new", 2, 2, 4, None)];
    let (_, changes) = a.pass(&Objects {
        nodes: &nodes,
        pods: &pods,
        priority_classes: &[],
        jobs: &jobs,
        now: T0 + 20.0,
    });
    // The new job, never seen running, goes first; the long one, with 180 s left at its
    // minimum, is held at 0 (its pserver stays).
    assert_eq!(
        changes,
        vec![Change {
            namespace: "ml".into(),
            name: "long".into(),
            from: 2,
            to: 0
        }]
    );
    // Without preempt the new job waits, and the long one keeps its trainers.
    let mut plain = Autoscaler::new(config());
    let (_, changes) = plain.pass(&Objects {
        nodes: &nodes,
        pods: &pods,
        priority_classes: &[],
        jobs: &jobs,
        now: T0 + 20.0,
    });
    assert_eq!(changes, vec![]);
}
