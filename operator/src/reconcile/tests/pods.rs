//! Pods: a failed one replaced and counted, a crash loop, a deleted one recreated (a
//! recovery), one that cannot start (a condition and one event).

use super::*;

/// A pserver's or master's pod that ended: the leases its process held are revoked by
/// its instance (its pod's incarnation, which its records name) before it is replaced,
/// so its shard is claimed again or a standby leads at once; an etcd member's are not
/// the job's to revoke.
#[test]
fn an_ended_pserver_or_master_pod_has_its_leases_revoked_by_its_instance() {
    use edl_job::holders::Holder;
    let mut tj = training_job("");
    started(&mut tj, 2);
    for (index, holder) in [
        (
            0,
            Holder::Master {
                addr: None,
                instance: Some("mnist-master-0.uid-0".into()),
            },
        ),
        (
            1,
            Holder::Pserver {
                pid: None,
                addr: None,
                instance: Some("mnist-pserver-0.uid-0".into()),
            },
        ),
    ] {
        let mut pods = running(2);
        pods[index].phase = PodPhase::Failed;
        pods[index].exit_code = Some(137);
        let plan = reconcile(&observe(&tj, pods, Ok(progress(2))));
        assert_eq!(plan.etcd, [EtcdAction::Revoke(holder)]);
        assert_eq!(plan.delete.len(), 1, "{:?}", plan.delete);
        // Not while etcd cannot be read: the lease ends by itself meanwhile.
        let mut pods = running(2);
        pods[index].phase = PodPhase::Failed;
        let plan = reconcile(&observe(&tj, pods, Err("etcd unreachable".into())));
        assert!(plan.etcd.is_empty(), "{:?}", plan.etcd);
        assert_eq!(
            plan.delete.len(),
            1,
            "replaced all the same: {:?}",
            plan.delete
        );
    }
}

#[test]
fn a_failed_pod_is_replaced_once_and_counted_and_a_crash_loop_fails_the_job() {
    let mut tj = training_job("max_restarts = 2\nhealthy_after = \"30s\"");
    started(&mut tj, 2);
    let crash = |pods: &mut Vec<PodView>, ran: u64| {
        let p = &mut pods[3];
        p.phase = PodPhase::Failed;
        p.exit_code = Some(137);
        p.ran_for = Some(Duration::from_secs(ran));
    };
    let mut pods = running(2);
    crash(&mut pods, 5);
    let plan = reconcile(&observe(&tj, pods, Ok(progress(2))));
    assert_eq!(
        plan.delete,
        [Deletion {
            name: "mnist-trainer-1".into(),
            grace: Some(0)
        }]
    );
    assert!(
        plan.create_pods.is_empty(),
        "the replacement waits for the old pod to go"
    );
    assert_eq!(plan.events.len(), 1);
    assert_eq!(plan.events[0].reason, "PodReplaced");
    assert!(
        plan.events[0].message.contains("exit code 137"),
        "{:?}",
        plan.events
    );
    // The ended trainer's leases are revoked before it is replaced (its tasks go back
    // now), by the id its pod gave it; no other pod's.
    assert_eq!(
        plan.etcd,
        [EtcdAction::Revoke(edl_job::holders::Holder::Trainer {
            id: "mnist-trainer-1.uid-1".into()
        })]
    );
    let status = plan.status.expect("status");
    assert_eq!(status.restarts["mnist-trainer-1"], 1);
    assert_eq!(status.recoveries.len(), 1);
    tj.status = Some(status);

    // Gone: recreated, without a second recovery.
    let plan = reconcile(&observe(&tj, running(1), Ok(progress(1))));
    assert_eq!(names(&plan.create_pods), ["mnist-trainer-1"]);
    assert!(plan.events.is_empty(), "{:?}", plan.events);
    let status = plan.status.expect("status");
    assert_eq!(status.recoveries.len(), 1);
    assert!(status.replacing.is_empty());
    tj.status = Some(status);

    // A failure after a healthy run does not count.
    let mut pods = running(2);
    crash(&mut pods, 60);
    let plan = reconcile(&observe(&tj, pods, Ok(progress(2))));
    let status = plan.status.expect("status");
    assert_eq!(status.restarts["mnist-trainer-1"], 0);
    tj.status = Some(status);

    // Three quick failures in a row: more than max_restarts = 2.
    for n in 1..=3 {
        let mut pods = running(2);
        crash(&mut pods, 1);
        let plan = reconcile(&observe(&tj, pods, Ok(progress(2))));
        let status = plan.status.clone().expect("status");
        if n <= 2 {
            // One trainer short while it is replaced.
            assert_eq!(status.phase, Phase::Scaling, "replaced, try {n}");
            assert_eq!(plan.delete.len(), 1);
        } else {
            assert_eq!(status.phase, Phase::Failed);
            let c = condition(&status, "Failed");
            assert_eq!(c.reason, "CrashLoop");
            assert!(
                c.message.contains("mnist-trainer-1") && c.message.contains("max_restarts"),
                "{c:?}"
            );
            assert!(plan.create_pods.is_empty());
            assert_eq!(
                plan.delete.len(),
                3,
                "the pods still running stop: {plan:?}"
            );
        }
        tj.status = Some(status);
    }
    // Failed is final: no pod is created, whatever is observed.
    let plan = reconcile(&observe(&tj, vec![], Ok(progress(2))));
    assert!(plan.create_pods.is_empty() && plan.delete.is_empty());
}

#[test]
fn a_deleted_pod_is_recreated_as_a_recovery() {
    let mut tj = training_job("");
    started(&mut tj, 2);
    let mut pods = running(2);
    pods.remove(1); // the pserver
    let plan = reconcile(&observe(&tj, pods, Ok(progress(2))));
    assert_eq!(names(&plan.create_pods), ["mnist-pserver-0"]);
    assert_eq!(plan.events.len(), 1);
    assert!(
        plan.events[0].message.contains("mnist-pserver-0"),
        "{:?}",
        plan.events
    );
    let status = plan.status.expect("status");
    assert_eq!(status.recoveries[0].role, "pserver");
}

#[test]
fn a_pod_that_cannot_start_is_a_condition_and_one_event_not_a_silent_pending() {
    let mut tj = training_job("");
    let mut pods = running(2);
    pods[0].phase = PodPhase::Pending;
    pods[0].problem = Some((
        "ImagePullBackOff".into(),
        "Back-off pulling image \"edl:test\"".into(),
    ));
    let plan = reconcile(&observe(&tj, pods.clone(), Ok(progress(2))));
    let status = plan.status.expect("status");
    assert_eq!(status.phase, Phase::Pending);
    let c = condition(&status, "Running");
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "ImagePullBackOff")
    );
    assert!(
        c.message.contains("mnist-master-0") && c.message.contains("edl:test"),
        "{c:?}"
    );
    assert_eq!(plan.events.len(), 1);
    assert!(plan.events[0].warning);
    tj.status = Some(status);
    let again = reconcile(&observe(&tj, pods, Ok(progress(2))));
    assert!(again.events.is_empty(), "{:?}", again.events);
}

/// A node that has not been Ready for `node_lost_after` takes its pods with it: each is
/// deleted at once (grace 0), a terminating one too (its node will never confirm it),
/// counted as a recovery naming the node, and made again; a node not Ready for less,
/// or a Ready one, changes nothing (the witness: the same pods on a node lost long
/// enough are replaced).
#[test]
fn pods_on_a_node_lost_past_the_bound_are_replaced_at_once() {
    let mut tj = training_job("");
    started(&mut tj, 2);
    let on = |mut p: PodView, node: &str, terminating: bool| {
        p.node = Some(node.to_owned());
        p.terminating = terminating;
        p
    };
    let pods = vec![
        on(pod(Role::Master, 0, PodPhase::Running), "n2", false),
        on(pod(Role::Pserver, 0, PodPhase::Running), "n1", false),
        on(pod(Role::Trainer, 0, PodPhase::Running), "n1", true),
        on(pod(Role::Trainer, 1, PodPhase::Running), "n2", false),
    ];
    let lost_since = |secs: i64| Observed {
        lost_nodes: BTreeMap::from([("n1".to_owned(), at(100 - secs))]),
        ..observe(&tj, pods.clone(), Ok(progress(2)))
    };
    // Not Ready for a minute, under the two-minute bound: the cluster may yet recover it.
    let plan = reconcile(&lost_since(60));
    assert!(plan.delete.is_empty(), "{:?}", plan.delete);
    // Past it.
    let plan = reconcile(&lost_since(150));
    // A pod lost with its node may still run there: its lease decides, nothing revoked.
    assert!(
        !plan.etcd.iter().any(|a| matches!(a, EtcdAction::Revoke(_))),
        "{:?}",
        plan.etcd
    );
    assert_eq!(
        plan.delete,
        [
            Deletion {
                name: "mnist-pserver-0".to_owned(),
                grace: Some(0)
            },
            Deletion {
                name: "mnist-trainer-0".to_owned(),
                grace: Some(0)
            },
        ]
    );
    let status = plan.status.expect("status");
    for name in ["mnist-pserver-0", "mnist-trainer-0"] {
        assert!(
            status
                .recoveries
                .iter()
                .any(|r| r.pod == name
                    && r.reason.contains("lost with node n1 (not Ready for 2m 30s")),
            "{name}: {:?}",
            status.recoveries
        );
    }
    assert_eq!(status.replacing, ["mnist-pserver-0", "mnist-trainer-0"]);
    // Gone, they are made again (not counted twice).
    let plan = reconcile(&Observed {
        pods: pods
            .iter()
            .filter(|p| p.node.as_deref() == Some("n2"))
            .cloned()
            .collect(),
        ..observe(
            &{
                let mut t = tj.clone();
                t.status = Some(status.clone());
                t
            },
            Vec::new(),
            Ok(progress(2)),
        )
    });
    assert_eq!(
        names(&plan.create_pods),
        ["mnist-pserver-0", "mnist-trainer-0"]
    );
    let after = plan.status.expect("status");
    assert_eq!(
        after.recoveries.len(),
        status.recoveries.len(),
        "{:?}",
        after.recoveries
    );
}

/// A trainer the master names stuck (alive, its task lease timed out) has its leases
/// revoked and its pod deleted at once, with an event naming it and its task; the
/// other trainer, and a stuck name that is no pod of the job, are left alone.
#[test]
fn a_trainer_the_master_names_stuck_is_replaced_with_its_leases_revoked() {
    let mut tj = training_job("");
    started(&mut tj, 2);
    let stuck = |trainer: &str| edl_master_client::overview::StuckTrainer {
        trainer: trainer.into(),
        task: "0-00007".into(),
        held_s: 12.5,
        ago_s: 0.4,
    };
    let state = EtcdState {
        stuck: vec![stuck("mnist-trainer-1.uid-1"), stuck("gone.uid-9")],
        ..progress(2)
    };
    let plan = reconcile(&observe(&tj, running(2), Ok(state)));
    assert_eq!(
        plan.delete,
        [Deletion {
            name: "mnist-trainer-1".into(),
            grace: Some(0)
        }]
    );
    assert_eq!(
        plan.etcd,
        [EtcdAction::Revoke(edl_job::holders::Holder::Trainer {
            id: "mnist-trainer-1.uid-1".into()
        })]
    );
    assert_eq!(plan.events.len(), 1, "{:?}", plan.events);
    assert_eq!(plan.events[0].reason, "PodReplaced");
    assert!(
        plan.events[0].message.contains("stuck") && plan.events[0].message.contains("0-00007"),
        "{:?}",
        plan.events
    );
    let status = plan.status.expect("status");
    assert!(
        status
            .recoveries
            .iter()
            .any(|r| r.pod == "mnist-trainer-1" && r.reason.starts_with("stuck")),
        "{:?}",
        status.recoveries
    );
}
