//! A job's life as the driver sees it: a new job (finalizer, spec in etcd, every pod),
//! an invalid one, a finished one, a deleted one.

use super::*;

/// A job's NetworkPolicy that is not the one the operator's configuration makes (an
/// earlier operator's, a hand-edited one, or the configuration changed) is written over;
/// the operator's own is left alone.
#[test]
fn a_network_policy_other_than_the_operators_is_replaced() {
    let tj = training_job("");
    let name = format!("{JOB}-edl");
    let scrapes = JobNetwork {
        metrics_namespaces: vec!["monitoring".to_owned()],
        ..JobNetwork::default()
    };
    let mut earlier = crate::objects::network_policy(&tj, &JobNetwork::default()).spec;
    if let Some(s) = earlier.as_mut() {
        s.egress = None;
        s.policy_types = Some(vec!["Ingress".to_owned()]);
    }
    for (stored, network, replaced) in [
        (earlier.clone(), JobNetwork::default(), true),
        (None, JobNetwork::default(), true),
        (
            crate::objects::network_policy(&tj, &JobNetwork::default()).spec,
            scrapes.clone(),
            true,
        ),
        (
            crate::objects::network_policy(&tj, &scrapes).spec,
            scrapes.clone(),
            false,
        ),
    ] {
        let plan = reconcile(&Observed {
            network_policies: BTreeMap::from([(name.clone(), stored.clone())]),
            network: network.clone(),
            ..observe(&tj, running(2), Ok(progress(2)))
        });
        assert!(plan.create_network_policies.is_empty(), "it exists");
        if replaced {
            let [p] = &plan.replace_network_policies[..] else {
                panic!("{stored:?} under {network:?}: {plan:?}");
            };
            assert_eq!(p.metadata.name.as_deref(), Some(name.as_str()));
            assert_eq!(p.spec, crate::objects::network_policy(&tj, &network).spec);
        } else {
            assert!(plan.replace_network_policies.is_empty(), "{plan:?}");
        }
    }
}

#[test]
fn a_new_job_gets_its_finalizer_its_spec_in_etcd_and_every_pod() {
    let mut tj = training_job("");
    tj.metadata.finalizers = None;
    let plan = reconcile(&Observed {
        services: BTreeSet::new(),
        claims: BTreeSet::new(),
        network_policies: BTreeMap::new(),
        ..observe(&tj, vec![], Ok(EtcdState::default()))
    });
    assert_eq!(plan.finalizer, Some(FinalizerChange::Add));
    // Its NetworkPolicy, the one the operator's configuration makes (what it lets
    // through: `objects::network`'s tests).
    let [policy] = &plan.create_network_policies[..] else {
        panic!("one NetworkPolicy: {:?}", plan.create_network_policies);
    };
    assert_eq!(policy.metadata.name.as_deref(), Some("mnist-edl"));
    assert_eq!(
        policy.spec,
        crate::objects::network_policy(&tj, &JobNetwork::default()).spec
    );
    let spec = match &plan.etcd[..] {
        [EtcdAction::PublishSpec(spec), EtcdAction::WriteScale(2)] => spec,
        other => panic!("{other:?}"),
    };
    // Published under the job's name in etcd, its namespace in it; its processes are
    // given the same.
    assert_eq!(spec.name.as_str(), "ml.mnist");
    for pod in &plan.create_pods {
        let env = &pod.spec.as_ref().expect("spec").containers[0].env;
        let job = env
            .iter()
            .flatten()
            .find(|e| e.name == edl_job::env::JOB)
            .and_then(|e| e.value.clone());
        assert_eq!(job.as_deref(), Some("ml.mnist"), "{:?}", pod.metadata.name);
    }
    assert_eq!(
        spec.data.train.patterns(),
        vec!["/data/mnist-train-*.recordio".to_owned()],
        "data globs are relative to the data volume"
    );
    assert_eq!(
        names(&plan.create_pods),
        [
            "mnist-master-0",
            "mnist-pserver-0",
            "mnist-trainer-0",
            "mnist-trainer-1"
        ]
    );
    assert_eq!(plan.create_services.len(), 1, "the headless service");
    // The pserver's checkpoints on a claim of its own, made with the job.
    let claims: Vec<_> = plan
        .create_claims
        .iter()
        .map(|c| c.metadata.name.clone().unwrap_or_default())
        .collect();
    assert_eq!(claims, ["mnist-checkpoints-0"]);
    let claim = &plan.create_claims[0];
    assert_eq!(
        claim.metadata.owner_references.as_ref().map(|o| o.len()),
        Some(1),
        "deleted with the job"
    );
    let request = claim
        .spec
        .as_ref()
        .and_then(|s| s.resources.as_ref())
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
        .map(|q| q.0.clone());
    assert_eq!(request.as_deref(), Some("10Gi"));
    let ps = &plan.create_pods[1];
    let mounted: Vec<_> = ps
        .spec
        .as_ref()
        .and_then(|s| s.volumes.clone())
        .unwrap_or_default()
        .into_iter()
        .filter_map(|v| v.persistent_volume_claim.map(|c| c.claim_name))
        .collect();
    assert!(
        mounted.contains(&"mnist-checkpoints-0".to_owned()),
        "{mounted:?}"
    );
    assert!(plan.delete.is_empty() && plan.events.is_empty(), "{plan:?}");
    let status = plan.status.expect("status");
    assert_eq!(status.phase, Phase::Pending);
    assert_eq!(status.trainers.desired, 2);
    assert_eq!(status.selector, "edl.dev/job=mnist,edl.dev/role=trainer");
    assert_eq!(
        status.etcd_job.as_deref(),
        Some("ml.mnist"),
        "kept from now on"
    );
    assert_eq!(condition(&status, "Running").reason, "PodsStarting");
    assert_eq!(condition(&status, "CheckpointsDurable").status, "True");
}

#[test]
fn an_invalid_job_fails_with_a_condition_naming_the_field() {
    for (change, field) in [
        (
            Box::new(|tj: &mut TrainingJob| tj.metadata.name = Some("MNIST_1".into()))
                as Box<dyn Fn(&mut TrainingJob)>,
            "metadata.name",
        ),
        (
            Box::new(|tj: &mut TrainingJob| tj.spec.volumes.data = None),
            "spec.volumes.data",
        ),
        (
            Box::new(|tj: &mut TrainingJob| {
                tj.spec.cluster.healthy_after = Duration::from_millis(10)
            }),
            "spec.cluster.healthy_after",
        ),
        (
            Box::new(|tj: &mut TrainingJob| tj.spec.cluster.etcd = vec!["http://x:1".into()]),
            "spec.cluster.etcd",
        ),
    ] {
        let mut tj = training_job("");
        change(&mut tj);
        let plan = reconcile(&observe(&tj, vec![], Ok(EtcdState::default())));
        assert!(
            plan.create_pods.is_empty() && plan.etcd.is_empty(),
            "{plan:?}"
        );
        let status = plan.status.expect("status");
        assert_eq!(status.phase, Phase::Failed);
        let c = condition(&status, "Failed");
        assert_eq!(c.reason, "InvalidSpec");
        assert!(c.message.starts_with(field), "{field}: {c:?}");
        assert_eq!(plan.events.len(), 1);
    }
}

#[test]
fn a_finished_job_stops_its_pods_and_says_so_once() {
    let mut tj = training_job("");
    started(&mut tj, 2);
    let mut p = progress(2);
    p.finished = Some(Finished::Succeeded);
    let plan = reconcile(&observe(&tj, running(2), Ok(p.clone())));
    let status = plan.status.expect("status");
    assert_eq!(status.phase, Phase::Succeeded);
    assert_eq!(condition(&status, "Succeeded").status, "True");
    assert_eq!(plan.delete.len(), 4);
    assert!(plan.create_pods.is_empty());
    assert_eq!(plan.events.len(), 1);
    tj.status = Some(status);
    let mut pods = running(2);
    for p in &mut pods {
        p.phase = PodPhase::Succeeded;
    }
    let again = reconcile(&observe(&tj, pods, Ok(p)));
    assert_eq!(again, Plan::default(), "nothing more to do");
}

/// A finished job's managed etcd keeps its final state until the job is deleted, so it
/// stays whole: a member that ended (killed by its liveness probe) is replaced, one that
/// is gone is made again; nothing else of the job comes back.
#[test]
fn a_finished_jobs_managed_etcd_stays_whole() {
    let mut tj = training_job("");
    started(&mut tj, 2);
    tj.spec.etcd = EtcdSpec {
        managed: true,
        members: 3,
        ..EtcdSpec::default()
    };
    if let Some(s) = tj.status.as_mut() {
        s.phase = Phase::Succeeded;
    }
    let mut killed = pod(Role::Etcd, 1, PodPhase::Failed);
    killed.exit_code = Some(137);
    let pods = vec![pod(Role::Etcd, 0, PodPhase::Running), killed];
    let plan = reconcile(&observe(&tj, pods, Ok(progress(2))));
    assert_eq!(
        plan.delete,
        [Deletion {
            name: "mnist-etcd-1".to_owned(),
            grace: Some(0)
        }],
        "the ended member goes, to be made again"
    );
    assert_eq!(
        names(&plan.create_pods),
        ["mnist-etcd-2"],
        "the gone one comes back"
    );
    let status = plan.status.expect("status");
    assert_eq!(status.phase, Phase::Succeeded);
    assert!(
        status
            .recoveries
            .iter()
            .any(|r| r.pod == "mnist-etcd-1" && r.reason.contains("137")),
        "{:?}",
        status.recoveries
    );
    // Without a managed etcd, a finished job makes nothing (the witness above: it does).
    let mut plain = training_job("");
    started(&mut plain, 2);
    if let Some(s) = plain.status.as_mut() {
        s.phase = Phase::Succeeded;
    }
    let plan = reconcile(&observe(&plain, vec![], Ok(progress(2))));
    assert!(plan.create_pods.is_empty(), "{plan:?}");
}

#[test]
fn a_deleted_job_drops_its_keys_then_its_finalizer() {
    let mut tj = training_job("");
    tj.metadata.deletion_timestamp = Some(at(50));
    let plan = reconcile(&observe(&tj, running(2), Ok(progress(2))));
    assert_eq!(
        plan.etcd,
        [EtcdAction::DeleteJob, EtcdAction::RemoveJobUser],
        "its keys, then its etcd user"
    );
    assert_eq!(plan.finalizer, Some(FinalizerChange::Remove));
    assert!(plan.create_pods.is_empty() && plan.delete.is_empty() && plan.status.is_none());
}

/// A job's name in etcd: `<namespace>.<name>` for a new job and from its status on; a job
/// whose status an operator from before wrote keeps its bare name (its state is under
/// it), and the next status says so; a status naming another job is not followed.
#[test]
fn a_jobs_name_in_etcd_carries_its_namespace_and_a_job_from_before_keeps_its_own() {
    use crate::objects::etcd_job;
    let mut tj = training_job("");
    tj.status = None;
    assert_eq!(etcd_job(&tj), "ml.mnist", "a new job");
    let mut other = tj.clone();
    other.metadata.namespace = Some("team-b".into());
    assert_eq!(
        etcd_job(&other),
        "team-b.mnist",
        "the same name in another namespace"
    );
    tj.status = Some(TrainingJobStatus {
        etcd_job: Some("ml.mnist".into()),
        ..TrainingJobStatus::default()
    });
    assert_eq!(etcd_job(&tj), "ml.mnist", "kept");
    // A status without the field and without what every operator writes (the trainers'
    // selector): the first write, of the name alone, was dropped (a CRD from before);
    // still a new job.
    tj.status = Some(TrainingJobStatus::default());
    assert_eq!(
        etcd_job(&tj),
        "ml.mnist",
        "a dropped first write is not a job from before"
    );
    // Started under an operator that keyed jobs by name alone.
    tj.status = Some(TrainingJobStatus {
        phase: Phase::Running,
        selector: "edl.dev/job=mnist,edl.dev/role=trainer".into(),
        ..TrainingJobStatus::default()
    });
    assert_eq!(etcd_job(&tj), "mnist", "a job from before keeps its keys");
    let plan = reconcile(&observe(&tj, vec![], Ok(EtcdState::default())));
    assert_eq!(
        plan.status.and_then(|s| s.etcd_job).as_deref(),
        Some("mnist"),
        "and its status now says so"
    );
    for forged in ["team-b.mnist", "other", ""] {
        tj.status = Some(TrainingJobStatus {
            etcd_job: Some(forged.into()),
            ..TrainingJobStatus::default()
        });
        assert_eq!(etcd_job(&tj), "ml.mnist", "{forged:?} is not followed");
    }
}
