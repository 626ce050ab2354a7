//! Volumes: each pserver's checkpoint claim, and what a job that names an ephemeral
//! checkpoint volume is told.

use super::*;

#[test]
fn replicas_get_a_claim_each_and_kept_claims_are_not_owned() {
    let mut tj = training_job("pservers = 2\npserver_replicas = 2");
    tj.spec.volumes.checkpoint_claims.keep = true;
    tj.spec.volumes.checkpoint_claims.storage_class_name = Some("fast".into());
    let plan = reconcile(&Observed {
        claims: BTreeSet::from(["mnist-checkpoints-1".to_owned()]),
        ..observe(&tj, vec![], Ok(progress(2)))
    });
    let claims: Vec<_> = plan
        .create_claims
        .iter()
        .map(|c| c.metadata.name.clone().unwrap_or_default())
        .collect();
    assert_eq!(
        claims,
        [
            "mnist-checkpoints-0",
            "mnist-checkpoints-2",
            "mnist-checkpoints-3"
        ],
        "one per pserver pod, the existing one kept"
    );
    for c in &plan.create_claims {
        assert!(c.metadata.owner_references.is_none(), "kept: {c:?}");
        let spec = c.spec.as_ref().expect("spec");
        assert_eq!(spec.storage_class_name.as_deref(), Some("fast"));
        assert_eq!(
            spec.access_modes.as_deref(),
            Some(&["ReadWriteOnce".to_owned()][..])
        );
    }
}

#[test]
fn ephemeral_checkpoints_are_a_condition_and_one_warning() {
    for (source, reason) in [
        (
            VolumeSource {
                empty_dir: true,
                ..VolumeSource::default()
            },
            "EmptyDir",
        ),
        (
            VolumeSource {
                host_path: Some("/mnt/ckpt".into()),
                ..VolumeSource::default()
            },
            "HostPath",
        ),
    ] {
        let mut tj = training_job("");
        tj.spec.volumes.checkpoints = Some(source);
        let plan = reconcile(&observe(&tj, vec![], Ok(progress(2))));
        assert!(plan.create_claims.is_empty(), "the job names its volume");
        let status = plan.status.clone().expect("status");
        let c = condition(&status, "CheckpointsDurable");
        assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", reason));
        assert!(c.message.contains("restores nothing"), "{c:?}");
        let warned = |p: &Plan| {
            p.events
                .iter()
                .filter(|e| e.warning && e.reason == "CheckpointsNotDurable")
                .count()
        };
        assert_eq!(warned(&plan), 1, "{:?}", plan.events);
        // Said once: the next round, with that status, says nothing more.
        tj.status = Some(status);
        let again = reconcile(&observe(&tj, vec![], Ok(progress(2))));
        assert_eq!(warned(&again), 0, "{:?}", again.events);
    }
}
