//! A job admitted through its Kueue Workload: held until admitted, run with the
//! trainers admitted, drained on an eviction and then its quota given back, its
//! Workload finished when it ends.

use super::*;
use crate::reconcile::{Admission, WorkloadChange};

fn queued() -> TrainingJob {
    let mut tj = training_job("");
    tj.metadata.labels =
        Some([(crate::objects::QUEUE_LABEL.to_owned(), "team-a".to_owned())].into());
    tj
}

fn with(obs: Observed<'_>, admission: Admission) -> Observed<'_> {
    Observed { admission, ..obs }
}

#[test]
fn a_queued_job_makes_its_workload_and_no_pod_until_kueue_admits_it() {
    let tj = queued();
    let plan = reconcile(&with(
        observe(&tj, vec![], Ok(EtcdState::default())),
        Admission::NoWorkload,
    ));
    assert!(plan.create_pods.is_empty(), "{plan:?}");
    let Some(WorkloadChange::Create(w)) = &plan.workload else {
        panic!("no Workload made: {plan:?}");
    };
    assert_eq!(w["metadata"]["name"], "trainingjob-mnist");
    assert_eq!(w["spec"]["queueName"], "team-a");
    let sets: Vec<(String, u64, Option<u64>)> = w["spec"]["podSets"]
        .as_array()
        .expect("pod sets")
        .iter()
        .map(|s| {
            (
                s["name"].as_str().unwrap_or_default().to_owned(),
                s["count"].as_u64().unwrap_or_default(),
                s["minCount"].as_u64(),
            )
        })
        .collect();
    assert_eq!(
        sets,
        [
            ("master".to_owned(), 1, None),
            ("pserver".to_owned(), 1, None),
            ("trainer".to_owned(), 2, Some(1)),
        ]
    );
    assert!(
        w["spec"]["podSets"][2]["template"]["spec"]["containers"][0]["resources"].is_object()
            || w["spec"]["podSets"][2]["template"]["spec"]["containers"][0]["image"] == "edl:test",
        "each pod set carries its pod template: {w}"
    );
    let status = plan.status.expect("status");
    assert_eq!(status.phase, Phase::Suspended);
    let c = condition(&status, "Suspended");
    assert_eq!(c.reason, "AwaitingAdmission");
    assert!(c.message.contains("LocalQueue team-a"), "{c:?}");
    // Still waiting: nothing made again.
    let plan = reconcile(&with(
        observe(&tj, vec![], Ok(EtcdState::default())),
        Admission::Pending,
    ));
    assert!(
        plan.create_pods.is_empty() && plan.workload.is_none(),
        "{plan:?}"
    );
}

#[test]
fn an_admitted_job_runs_with_the_trainers_admitted_and_its_pods_are_not_queued_again() {
    let tj = queued();
    // The trainers' pod set admitted with a GPU flavor: its node labels and toleration.
    let gpu: k8s_openapi::api::core::v1::Toleration = serde_json::from_value(
        serde_json::json!({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}),
    )
    .expect("a toleration");
    let flavor = crate::objects::FlavorPlacement {
        node_selector: BTreeMap::from([("cloud.example/gpu".to_owned(), "a100".to_owned())]),
        tolerations: vec![gpu.clone()],
    };
    let plan = reconcile(&with(
        observe(&tj, vec![], Ok(progress(2))),
        Admission::Admitted {
            trainers: Some(1),
            placement: BTreeMap::from([("trainer".to_owned(), flavor)]),
            pods_ready: None,
        },
    ));
    for p in &plan.create_pods {
        let spec = p.spec.as_ref().expect("spec");
        let on_gpu = spec
            .node_selector
            .as_ref()
            .is_some_and(|s| s.get("cloud.example/gpu").map(String::as_str) == Some("a100"));
        let tolerates = spec.tolerations.iter().flatten().any(|t| *t == gpu);
        let trainer = p.metadata.name.as_deref() == Some("mnist-trainer-0");
        assert_eq!(
            (on_gpu, tolerates),
            (trainer, trainer),
            "{:?}: the flavor is the trainers' only",
            p.metadata.name
        );
    }
    assert_eq!(
        names(&plan.create_pods),
        ["mnist-master-0", "mnist-pserver-0", "mnist-trainer-0"],
        "one trainer of the two asked: partial admission"
    );
    assert!(
        plan.create_pods.iter().all(|p| p
            .metadata
            .labels
            .as_ref()
            .is_some_and(|l| !l.contains_key(crate::objects::QUEUE_LABEL))),
        "admitted as a whole: no pod is Kueue's to queue"
    );
    assert_eq!(plan.status.expect("status").trainers.desired, 1);
    assert!(
        matches!(plan.workload, Some(WorkloadChange::PodsReady(false))),
        "its pods are only being made: {:?}",
        plan.workload
    );
}

#[test]
fn an_evicted_job_drains_and_gives_its_quota_back_only_once_it_has_no_pods() {
    let mut tj = queued();
    started(&mut tj, 2);
    let evicted = Admission::Evicted("Preempted to accommodate a higher priority".into());
    let plan = reconcile(&with(
        observe(&tj, running(2), Ok(progress(2))),
        evicted.clone(),
    ));
    let deleted: Vec<&str> = plan.delete.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(
        deleted,
        ["mnist-trainer-0", "mnist-trainer-1"],
        "trainers drain first"
    );
    assert!(
        plan.workload.is_none(),
        "quota kept while pods run: {plan:?}"
    );
    let status = plan.status.clone().expect("status");
    assert_eq!(condition(&status, "Suspended").reason, "Evicted");
    assert!(
        plan.events
            .iter()
            .any(|e| e.warning && e.reason == "Evicted" && e.message.contains("Preempted")),
        "{:?}",
        plan.events
    );
    tj.status = Some(status);
    let plan = reconcile(&with(observe(&tj, vec![], Ok(progress(2))), evicted));
    assert!(
        matches!(plan.workload, Some(WorkloadChange::Release(_))),
        "no pods left: the quota goes back: {plan:?}"
    );
    // Admitted again: it resumes, one event, no recovery counted.
    let plan = reconcile(&with(
        observe(&tj, vec![], Ok(progress(2))),
        Admission::Admitted {
            trainers: None,
            placement: BTreeMap::new(),
            pods_ready: None,
        },
    ));
    assert_eq!(plan.create_pods.len(), 4, "{plan:?}");
    let status = plan.status.expect("status");
    assert!(status.recoveries.is_empty());
    assert!(
        plan.events
            .iter()
            .any(|e| e.reason == "Resumed" && e.message.contains("Kueue admitted")),
        "{:?}",
        plan.events
    );
}

/// An admitted job's Workload says whether all its pods run (`PodsReady`, for Kueue's
/// wait-for-pods-ready), written only when that changes.
#[test]
fn an_admitted_job_reports_whether_its_pods_are_ready() {
    let mut tj = queued();
    started(&mut tj, 2);
    let admitted = |pods_ready| Admission::Admitted {
        trainers: None,
        placement: BTreeMap::new(),
        pods_ready,
    };
    for (pods, written, want) in [
        (running(2), None, Some(true)),
        (running(2), Some(false), Some(true)),
        (running(2), Some(true), None),
        (running(1), Some(true), Some(false)),
        (running(1), Some(false), None),
    ] {
        let plan = reconcile(&with(
            observe(&tj, pods.clone(), Ok(progress(2))),
            admitted(written),
        ));
        let got = match plan.workload {
            Some(WorkloadChange::PodsReady(r)) => Some(r),
            None => None,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            got,
            want,
            "{} pods running, {written:?} written",
            pods.len()
        );
    }
}

#[test]
fn a_job_that_ends_marks_its_workload_finished_once() {
    let tj = queued();
    let done = EtcdState {
        finished: Some(Finished::Succeeded),
        ..progress(2)
    };
    let plan = reconcile(&with(
        observe(&tj, running(2), Ok(done.clone())),
        Admission::Admitted {
            trainers: None,
            placement: BTreeMap::new(),
            pods_ready: None,
        },
    ));
    assert!(
        matches!(plan.workload, Some(WorkloadChange::Finish(_))),
        "{plan:?}"
    );
    let plan = reconcile(&with(observe(&tj, vec![], Ok(done)), Admission::Finished));
    assert!(plan.workload.is_none(), "already finished: {plan:?}");
}

#[test]
fn a_workload_state_is_read_as_kueue_writes_it() {
    use crate::objects::{WorkloadState, released_workload, workload_state};
    use serde_json::json;
    let admitted = json!({"status": {
        "admission": {"clusterQueue": "cq", "podSetAssignments": [
            {"name": "master", "count": 1}, {"name": "trainer", "count": 3}]},
        "conditions": [
            {"type": "QuotaReserved", "status": "True"},
            {"type": "Admitted", "status": "True"}]}});
    assert_eq!(
        workload_state(&admitted),
        WorkloadState::Admitted(Some(3), None)
    );
    let mut ready = admitted.clone();
    ready["status"]["conditions"]
        .as_array_mut()
        .expect("conditions")
        .push(json!({"type": "PodsReady", "status": "True"}));
    assert_eq!(
        workload_state(&ready),
        WorkloadState::Admitted(Some(3), Some(true))
    );
    let mut reserved_only = admitted.clone();
    reserved_only["status"]["conditions"][1]["status"] = json!("False");
    assert_eq!(
        workload_state(&reserved_only),
        WorkloadState::Pending,
        "quota reserved, admission checks pending"
    );
    let mut evicted = admitted.clone();
    evicted["status"]["conditions"]
        .as_array_mut()
        .expect("conditions")
        .push(
            json!({"type": "Evicted", "status": "True", "reason": "Preempted",
                     "message": "preempted by a higher priority workload"}),
        );
    assert_eq!(
        workload_state(&evicted),
        WorkloadState::Evicted("preempted by a higher priority workload".into())
    );
    let released = released_workload(evicted, "queued again", "2026-01-01T00:00:00Z");
    assert!(released["status"]["admission"].is_null());
    assert_eq!(workload_state(&released), WorkloadState::Pending);
    assert_eq!(workload_state(&json!({})), WorkloadState::Pending);
}

/// Kueue's pod integration (no Workload of the operator's): the managed etcd's members
/// are one pod group of all of them, so Kueue admits and preempts them together and
/// never takes part of the quorum; the job's other pods are workloads of their own.
/// Admitted through a Workload instead, no pod carries the group.
#[test]
fn under_kueues_pod_integration_the_etcd_members_are_one_pod_group() {
    let mut tj = queued();
    tj.spec.etcd = EtcdSpec {
        managed: true,
        members: 3,
        ..EtcdSpec::default()
    };
    fn group(p: &Pod) -> (Option<&str>, Option<&str>) {
        let label = p.metadata.labels.as_ref().and_then(|l| {
            l.get(crate::objects::KUEUE_POD_GROUP_LABEL)
                .map(String::as_str)
        });
        let total = p.metadata.annotations.as_ref().and_then(|a| {
            a.get(crate::objects::KUEUE_POD_GROUP_TOTAL)
                .map(String::as_str)
        });
        (label, total)
    }
    let plan = reconcile(&with(
        Observed {
            claims: BTreeSet::new(),
            ..observe(&tj, vec![], Err("connection refused".into()))
        },
        Admission::NotQueued,
    ));
    assert_eq!(
        names(&plan.create_pods),
        ["mnist-etcd-0", "mnist-etcd-1", "mnist-etcd-2"]
    );
    for p in &plan.create_pods {
        assert_eq!(
            group(p),
            (Some("mnist-etcd"), Some("3")),
            "{:?}",
            p.metadata
        );
    }
    // The etcd up: the other roles come, each a workload of its own.
    let plan = reconcile(&with(
        observe(&tj, vec![], Ok(progress(2))),
        Admission::NotQueued,
    ));
    assert!(
        plan.create_pods.len() > 3,
        "the witness: the other roles are made ({:?})",
        names(&plan.create_pods)
    );
    for p in &plan.create_pods {
        let etcd = p
            .metadata
            .name
            .as_deref()
            .is_some_and(|n| n.contains("-etcd-"));
        let want = if etcd {
            (Some("mnist-etcd"), Some("3"))
        } else {
            (None, None)
        };
        assert_eq!(group(p), want, "{:?}", p.metadata.name);
    }
    // Admitted through the operator's Workload: no pod is Kueue's to queue again.
    let plan = reconcile(&with(
        observe(&tj, vec![], Ok(progress(2))),
        Admission::Admitted {
            trainers: None,
            placement: BTreeMap::new(),
            pods_ready: None,
        },
    ));
    assert!(plan.create_pods.len() > 3, "{:?}", names(&plan.create_pods));
    for p in &plan.create_pods {
        assert_eq!(group(p), (None, None), "{:?}", p.metadata.name);
    }
}
