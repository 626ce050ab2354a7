//! The invariants of the module doc, over arbitrary pods, specs and observations.

use proptest::prelude::*;

use super::*;

fn arb_phase() -> impl Strategy<Value = PodPhase> {
    prop_oneof![
        Just(PodPhase::Pending),
        Just(PodPhase::Running),
        Just(PodPhase::Succeeded),
        Just(PodPhase::Failed),
        Just(PodPhase::Unknown),
    ]
}

fn arb_pod() -> impl Strategy<Value = PodView> {
    (
        prop_oneof![Just(Role::Master), Just(Role::Pserver), Just(Role::Trainer)],
        0u32..6,
        arb_phase(),
        any::<bool>(),
        0u64..100,
    )
        .prop_map(|(role, index, phase, terminating, ran)| PodView {
            terminating,
            ran_for: phase.ended().then(|| Duration::from_secs(ran)),
            exit_code: (phase == PodPhase::Failed).then_some(1),
            ..pod(role, index, phase)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn plans_keep_the_invariants(
        pods in proptest::collection::vec(arb_pod(), 0..12),
        trainers in 1u32..=4,
        masters in 1u32..3,
        pservers in 1u32..3,
        prev_desired in 0u32..5,
        deleting in any::<bool>(),
        etcd_up in any::<bool>(),
        finished in any::<bool>(),
        suspend in any::<bool>(),
        credentials in prop_oneof![
            Just(JobCredentials::NotIssued),
            Just(JobCredentials::Ready),
            Just(JobCredentials::Failed("denied".to_owned())),
        ],
    ) {
        let mut tj = training_job("");
        tj.spec.cluster.trainers = trainers;
        tj.spec.cluster.masters = masters;
        tj.spec.cluster.pservers = pservers;
        tj.spec.suspend = suspend;
        tj.status = Some(TrainingJobStatus {
            phase: Phase::Running,
            trainers: TrainerCounts { desired: prev_desired, ..TrainerCounts::default() },
            ..TrainingJobStatus::default()
        });
        if deleting {
            tj.metadata.deletion_timestamp = Some(at(1));
        }
        // One pod object per name, as the API server keeps them.
        let mut seen = BTreeSet::new();
        let pods: Vec<PodView> = pods.into_iter().filter(|p| seen.insert(p.name.clone())).collect();
        let mut p = progress(trainers);
        if finished {
            p.finished = Some(Finished::Succeeded);
        }
        let etcd = if etcd_up { Ok(p) } else { Err("down".to_owned()) };
        let plan = reconcile(&Observed {
            credentials: credentials.clone(),
            ..observe(&tj, pods.clone(), etcd)
        });

        let wanted: BTreeSet<String> = desired_slots(&tj).iter().map(|s| s.pod_name(JOB)).collect();
        let existing: BTreeSet<&str> = pods.iter().map(|p| p.name.as_str()).collect();
        let created = names(&plan.create_pods);
        for name in &created {
            prop_assert!(wanted.contains(name), "created {name}, not wanted");
            prop_assert!(!existing.contains(name.as_str()), "created {name} over an existing pod");
        }
        prop_assert_eq!(created.len(), created.iter().collect::<BTreeSet<_>>().len());
        let trainers_created = created.iter().filter(|n| n.contains("-trainer-")).count() as u32;
        prop_assert!(trainers_created <= tj.spec.cluster.max_trainers());
        let mut deleted = BTreeSet::new();
        for d in &plan.delete {
            let p = pods.iter().find(|p| p.name == d.name);
            prop_assert!(p.is_some_and(|p| !p.terminating), "deleted {} (absent or terminating)", d.name);
            prop_assert!(deleted.insert(d.name.clone()), "deleted {} twice", d.name);
            if !wanted.contains(&d.name) {
                prop_assert_eq!(d.grace, None, "a surplus pod drains: {}", &d.name);
            }
        }
        if deleting {
            prop_assert!(created.is_empty() && plan.delete.is_empty());
            prop_assert_eq!(plan.finalizer, Some(FinalizerChange::Remove));
        }
        if finished && etcd_up {
            prop_assert!(created.is_empty());
        }
        if suspend {
            prop_assert!(created.is_empty(), "a suspended job gets no pods");
        }
        if suspend && !deleting && !(finished && etcd_up) {
            // (A job that ended stops every pod at once.)
            let trainers_left = pods.iter().any(|p| p.slot.role == Role::Trainer && !p.phase.ended());
            for d in &plan.delete {
                let p = pods.iter().find(|p| p.name == d.name).expect("deleted an existing pod");
                prop_assert!(p.slot.role != Role::Etcd, "the managed etcd stays");
                if !p.phase.ended() {
                    prop_assert_eq!(d.grace, None, "a live pod drains: {}", &d.name);
                    prop_assert!(
                        p.slot.role == Role::Trainer || !trainers_left,
                        "{} stopped before the trainers drained", &d.name
                    );
                }
            }
        }
        if !etcd_up && !deleting {
            prop_assert!(plan.etcd.is_empty());
            prop_assert!(created.is_empty(), "no job process without its etcd");
        }
        if matches!(credentials, JobCredentials::Failed(_)) {
            prop_assert!(created.is_empty(), "no job process without its credentials");
        }
        for p in &plan.create_pods {
            let optional = env_from_secret(p).map(|r| r.optional);
            let want = match credentials {
                JobCredentials::Ready => Some(None),
                _ => Some(Some(true)),
            };
            prop_assert_eq!(optional, want, "{:?}", p.metadata.name);
        }
        if let Some(s) = &plan.status {
            prop_assert!(s.recoveries.len() <= RECENT_RECOVERIES);
            prop_assert!(s.trainers.desired >= tj.spec.cluster.min_trainers);
            prop_assert!(s.trainers.desired <= tj.spec.cluster.max_trainers());
        }
    }
}
