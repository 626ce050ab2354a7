//! Scaling: up, down (the highest trainers drain), to zero and back.

use super::*;

#[test]
fn scaling_up_creates_trainers_and_scaling_down_drains_the_highest() {
    let mut tj = training_job("");
    started(&mut tj, 2);
    tj.spec.cluster.trainers = 4;
    let plan = reconcile(&observe(&tj, running(2), Ok(progress(2))));
    assert_eq!(
        names(&plan.create_pods),
        ["mnist-trainer-2", "mnist-trainer-3"]
    );
    assert!(plan.delete.is_empty());
    assert_eq!(plan.etcd, [EtcdAction::WriteScale(4)]);
    assert_eq!(plan.events.len(), 1, "{:?}", plan.events);
    assert_eq!(plan.events[0].reason, "ScaledUp");
    assert!(
        plan.events[0].message.contains("2 -> 4"),
        "{:?}",
        plan.events
    );
    let status = plan.status.expect("status");
    assert_eq!(status.phase, Phase::Scaling);
    assert_eq!(condition(&status, "Scaling").status, "True");
    assert!(
        status.recoveries.is_empty(),
        "new trainers are not recoveries"
    );
    tj.status = Some(status);

    // All four run: Running again, no event.
    let plan = reconcile(&observe(&tj, running(4), Ok(progress(4))));
    assert!(plan.create_pods.is_empty() && plan.delete.is_empty() && plan.events.is_empty());
    let status = plan.status.expect("status");
    assert_eq!(status.phase, Phase::Running);
    assert_eq!(status.trainers.running, 4);
    tj.status = Some(status);

    // Down to 1: the three highest drain (their own grace period), nothing is created.
    tj.spec.cluster.trainers = 1;
    let plan = reconcile(&observe(&tj, running(4), Ok(progress(4))));
    assert!(plan.create_pods.is_empty());
    assert_eq!(
        plan.delete,
        (1..4)
            .map(|i| Deletion {
                name: format!("mnist-trainer-{i}"),
                grace: None
            })
            .collect::<Vec<_>>()
    );
    assert_eq!(plan.etcd, [EtcdAction::WriteScale(1)]);
    assert_eq!(plan.events[0].reason, "ScaledDown");
    // While they drain (terminating), nothing more is asked of them.
    tj.status = plan.status;
    let mut pods = running(4);
    for p in &mut pods[3..] {
        p.terminating = true;
    }
    let plan = reconcile(&observe(&tj, pods, Ok(progress(1))));
    assert!(
        plan.delete.is_empty() && plan.create_pods.is_empty(),
        "{plan:?}"
    );
}

#[test]
fn a_job_scaled_to_zero_drains_its_trainers_keeps_its_core_and_grows_again() {
    let mut tj = training_job("");
    tj.spec.volcano = Some(crate::crd::VolcanoSpec::default());
    started(&mut tj, 2);
    let spec_ok = tj.job_spec().expect("a job held at 0 is a valid job");
    tj.spec.cluster.trainers = 0;
    assert_eq!(
        tj.job_spec().expect("valid at 0").cluster.trainers,
        spec_ok.cluster.min_trainers,
        "the published spec starts at the minimum"
    );
    let with_group = |tj: &TrainingJob, pods, min_member: u32| {
        let mut obs = observe(tj, pods, Ok(progress(2)));
        obs.pod_groups = BTreeMap::from([(JOB.to_owned(), min_member)]);
        reconcile(&obs)
    };
    // The trainers drain (their own grace period); the master and the pserver stay; the
    // PodGroup no longer counts a trainer.
    let plan = with_group(&tj, running(2), 3);
    let deleted: Vec<_> = plan
        .delete
        .iter()
        .map(|d| (d.name.as_str(), d.grace))
        .collect();
    assert_eq!(
        deleted,
        [("mnist-trainer-0", None), ("mnist-trainer-1", None)]
    );
    assert!(plan.create_pods.is_empty(), "{:?}", plan.create_pods);
    // The master's and the pserver's default requests.
    assert_eq!(
        plan.pod_group_min_members,
        [(
            JOB.to_owned(),
            2,
            serde_json::json!({"cpu": "750m", "memory": "768Mi"})
        )]
    );
    assert_eq!(plan.etcd, [EtcdAction::WriteScale(0)]);
    assert!(
        plan.events
            .iter()
            .any(|e| e.reason == "ScaledDown" && e.message.contains("2 -> 0")),
        "{:?}",
        plan.events
    );
    let status = plan.status.clone().expect("status");
    assert_eq!(status.trainers.desired, 0);
    tj.status = Some(status);
    // Drained: the job runs without trainers, and says why.
    let plan = with_group(&tj, running(0), 2);
    assert!(plan.delete.is_empty() && plan.create_pods.is_empty());
    assert!(plan.pod_group_min_members.is_empty());
    let status = plan
        .status
        .clone()
        .unwrap_or_else(|| tj.status.clone().expect("status"));
    assert_eq!(status.phase, Phase::Running);
    let c = condition(&status, "Running");
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "NoTrainers")
    );
    assert!(c.message.contains("spec.cluster.trainers is 0"), "{c:?}");
    assert!(status.recoveries.is_empty(), "{:?}", status.recoveries);
    tj.status = Some(status);
    // Given trainers again: made, none a recovery, and the PodGroup counts the minimum.
    tj.spec.cluster.trainers = 3;
    let plan = with_group(&tj, running(0), 2);
    assert_eq!(
        names(&plan.create_pods),
        ["mnist-trainer-0", "mnist-trainer-1", "mnist-trainer-2"]
    );
    // ... and the one trainer of `min_trainers`.
    assert_eq!(
        plan.pod_group_min_members,
        [(
            JOB.to_owned(),
            3,
            serde_json::json!({"cpu": "1750m", "memory": "1792Mi"})
        )]
    );
    let status = plan.status.expect("status");
    assert!(status.recoveries.is_empty(), "{:?}", status.recoveries);
}
