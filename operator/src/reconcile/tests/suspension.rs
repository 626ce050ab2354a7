//! Suspension: drained, held, resumed; created suspended.

use super::*;

#[test]
fn a_suspended_job_drains_its_trainers_then_stops_the_rest_and_resumes_without_recoveries() {
    let mut tj = training_job("");
    started(&mut tj, 2);
    tj.spec.suspend = true;
    let deleted = |plan: &Plan| -> Vec<(String, Option<i64>)> {
        plan.delete
            .iter()
            .map(|d| (d.name.clone(), d.grace))
            .collect()
    };
    // Running: the trainers drain first (their own grace period); the master and the
    // pserver wait for them.
    let plan = reconcile(&observe(&tj, running(2), Ok(progress(2))));
    assert_eq!(
        deleted(&plan),
        [
            ("mnist-trainer-0".to_owned(), None),
            ("mnist-trainer-1".to_owned(), None)
        ]
    );
    assert!(
        plan.create_pods.is_empty() && plan.etcd.is_empty(),
        "{plan:?}"
    );
    let status = plan.status.clone().expect("status");
    assert_eq!(status.phase, Phase::Suspended);
    let c = condition(&status, "Suspended");
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", "Suspended")
    );
    assert!(c.message.contains("4 still running"), "{c:?}");
    assert_eq!(
        plan.events
            .iter()
            .map(|e| e.reason.as_str())
            .collect::<Vec<_>>(),
        ["Suspended"]
    );
    tj.status = Some(status);
    // The trainers drained and exited 0 (no master reports the job any more): they go,
    // not replaced; the master and the pserver stop, gracefully.
    let mut pods = running(0);
    pods.extend((0..2).map(|i| pod(Role::Trainer, i, PodPhase::Succeeded)));
    let no_master = EtcdState {
        pass: None,
        tasks: None,
        trainers: 0,
        ..progress(2)
    };
    let plan = reconcile(&observe(&tj, pods, Ok(no_master.clone())));
    let mut got = deleted(&plan);
    got.sort();
    assert_eq!(
        got,
        [
            ("mnist-master-0".to_owned(), None),
            ("mnist-pserver-0".to_owned(), None),
            ("mnist-trainer-0".to_owned(), None),
            ("mnist-trainer-1".to_owned(), None),
        ]
    );
    assert!(plan.events.is_empty(), "said once: {:?}", plan.events);
    let status = plan.status.clone().expect("status");
    assert!(status.recoveries.is_empty() && status.restarts.is_empty());
    assert_eq!(status.pass, Some(0), "the pass it had stays");
    assert!(status.tasks.is_some(), "the tasks it had stay");
    tj.status = Some(status);
    // No pods: nothing is made while suspended.
    let plan = reconcile(&observe(&tj, vec![], Ok(no_master.clone())));
    assert!(
        plan.create_pods.is_empty() && plan.delete.is_empty(),
        "{plan:?}"
    );
    let status = plan
        .status
        .clone()
        .unwrap_or_else(|| tj.status.clone().expect("status"));
    assert!(
        condition(&status, "Suspended")
            .message
            .contains("no pods running")
    );
    tj.status = Some(status);
    // Resumed: every pod made again, none a recovery.
    tj.spec.suspend = false;
    let plan = reconcile(&observe(&tj, vec![], Ok(no_master)));
    assert_eq!(
        names(&plan.create_pods),
        [
            "mnist-master-0",
            "mnist-pserver-0",
            "mnist-trainer-0",
            "mnist-trainer-1"
        ]
    );
    assert_eq!(
        plan.events
            .iter()
            .map(|e| e.reason.as_str())
            .collect::<Vec<_>>(),
        ["Resumed"]
    );
    let status = plan.status.expect("status");
    assert_eq!(status.phase, Phase::Pending);
    assert!(status.recoveries.is_empty(), "{:?}", status.recoveries);
    assert_eq!(condition(&status, "Suspended").status, "False");
}

#[test]
fn a_job_created_suspended_makes_no_pods_and_a_managed_etcd_stays() {
    let mut tj = training_job("");
    tj.spec.suspend = true;
    tj.metadata.labels = Some(std::collections::BTreeMap::from([(
        crate::objects::QUEUE_LABEL.to_owned(),
        "team-a".to_owned(),
    )]));
    let plan = reconcile(&Observed {
        services: BTreeSet::new(),
        claims: BTreeSet::new(),
        ..observe(&tj, vec![], Ok(EtcdState::default()))
    });
    assert!(
        plan.create_pods.is_empty() && plan.create_claims.is_empty(),
        "{plan:?}"
    );
    assert_eq!(plan.status.expect("status").phase, Phase::Suspended);
    // Admitted: its pods carry the queue's label.
    tj.spec.suspend = false;
    let plan = reconcile(&observe(&tj, vec![], Ok(progress(2))));
    assert!(!plan.create_pods.is_empty());
    for p in &plan.create_pods {
        let labels = p.metadata.labels.as_ref().expect("labels");
        assert_eq!(
            labels.get(crate::objects::QUEUE_LABEL).map(String::as_str),
            Some("team-a")
        );
    }
    // A managed etcd is not stopped by a suspension: it holds the job's state.
    let mut managed = training_job("");
    managed.spec.etcd = EtcdSpec {
        managed: true,
        ..EtcdSpec::default()
    };
    managed.spec.suspend = true;
    let mut pods = running(1);
    pods.push(pod(Role::Etcd, 0, PodPhase::Running));
    let plan = reconcile(&observe(&managed, pods, Ok(progress(1))));
    assert!(
        plan.delete
            .iter()
            .all(|d| !d.name.starts_with("mnist-etcd")),
        "{:?}",
        plan.delete
    );
    assert_eq!(plan.delete.len(), 1, "the trainer first: {:?}", plan.delete);
}

/// Suspended while a trainer is on a node lost past the bound: that trainer goes at once
/// (grace 0; its node would never confirm a graceful end) and nothing waits for it, so
/// the master and the pserver stop once the other trainer, terminating, is gone; a
/// trainer whose node is lost for less than the bound is waited for as any (the witness
/// that the bound, not the node's name, decides).
#[test]
fn a_suspension_does_not_wait_for_a_pod_on_a_lost_node() {
    let mut tj = training_job("");
    started(&mut tj, 2);
    tj.spec.suspend = true;
    let mut pods = running(2);
    for p in &mut pods {
        p.node = Some(
            if p.name == "mnist-trainer-1" {
                "n1"
            } else {
                "n2"
            }
            .to_owned(),
        );
    }
    pods[2].terminating = true;
    let lost_since = |secs: i64| Observed {
        lost_nodes: BTreeMap::from([("n1".to_owned(), at(100 - secs))]),
        ..observe(&tj, pods.clone(), Ok(progress(2)))
    };
    let deleted = |plan: &Plan| -> Vec<(String, Option<i64>)> {
        plan.delete
            .iter()
            .map(|d| (d.name.clone(), d.grace))
            .collect()
    };
    assert_eq!(
        pods[2].name, "mnist-trainer-0",
        "the trainer still draining"
    );
    // Lost for a minute: waited for, as the draining one is.
    assert_eq!(
        deleted(&reconcile(&lost_since(60))),
        [("mnist-trainer-1".to_owned(), None)]
    );
    // Lost past the bound: it goes at once.
    assert_eq!(
        deleted(&reconcile(&lost_since(600))),
        [("mnist-trainer-1".to_owned(), Some(0))]
    );
    // The other trainer gone: the master and the pserver stop, not waiting for it.
    let rest: Vec<PodView> = pods
        .iter()
        .filter(|p| p.slot.role != Role::Trainer || p.name == "mnist-trainer-1")
        .cloned()
        .collect();
    let plan = reconcile(&Observed {
        lost_nodes: BTreeMap::from([("n1".to_owned(), at(-500))]),
        ..observe(&tj, rest, Ok(progress(2)))
    });
    assert_eq!(
        deleted(&plan),
        [
            ("mnist-master-0".to_owned(), None),
            ("mnist-pserver-0".to_owned(), None),
            ("mnist-trainer-1".to_owned(), Some(0)),
        ]
    );
}
