//! Volumes: each pserver's checkpoint claim, and what a job that names an ephemeral
//! checkpoint volume is told.

use super::*;
use edl_job::spec::Globs;

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

/// A job whose data and checkpoints are object URLs: no data volume and no checkpoint
/// claims; each pserver gets the URL as `--checkpoint-dir` and mounts nothing for it;
/// every job process (not the etcd) takes the store's credentials from the named
/// Secret; the checkpoints are durable. Without the Secret, or with checkpoints at a
/// path, or at a URL edl cannot use, the job fails naming the field.
#[test]
fn object_storage_needs_no_volumes_and_gives_the_pods_the_storage_secret() {
    let object_job = || {
        let mut tj = training_job("");
        tj.spec.etcd = EtcdSpec {
            managed: true,
            ..EtcdSpec::default()
        };
        tj.spec.volumes.data = None;
        tj.spec.data.train = Globs::Many(vec!["s3://datasets/mnist/train-*.recordio".into()]);
        tj.spec.cluster.checkpoint_dir = Some("s3://ckpt/runs".into());
        tj.spec.storage_secret = Some("s3-credentials".into());
        tj
    };
    let tj = object_job();
    let spec = tj.job_spec().expect("a valid job");
    assert_eq!(
        spec.data.train.patterns(),
        ["s3://datasets/mnist/train-*.recordio"],
        "a URL is not made relative to the data volume"
    );
    let plan = reconcile(&observe(&tj, vec![], Ok(progress(2))));
    assert!(plan.create_claims.iter().all(|c| {
        c.metadata
            .name
            .as_deref()
            .is_some_and(|n| n.contains("-etcd-"))
    }));
    let status = plan.status.clone().expect("status");
    let c = condition(&status, "CheckpointsDurable");
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", "ObjectStore")
    );
    let pods: Vec<Pod> = [
        Slot {
            role: Role::Master,
            index: 0,
        },
        Slot {
            role: Role::Pserver,
            index: 0,
        },
        Slot {
            role: Role::Trainer,
            index: 0,
        },
        Slot {
            role: Role::Etcd,
            index: 0,
        },
    ]
    .into_iter()
    .map(|slot| crate::objects::pod(&tj, slot, crate::objects::CredentialsRef::None))
    .collect();
    for p in &pods {
        let c = &p.spec.as_ref().expect("spec").containers[0];
        let secrets: Vec<&str> = c
            .env_from
            .iter()
            .flatten()
            .filter_map(|e| e.secret_ref.as_ref().map(|s| s.name.as_str()))
            .collect();
        let etcd = c.name == "etcd";
        assert_eq!(secrets.is_empty(), etcd, "{}: {secrets:?}", c.name);
        if !etcd {
            assert_eq!(secrets, ["s3-credentials"], "{}", c.name);
        }
        let mounts: Vec<&str> = c
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| m.name.as_str())
            .collect();
        assert!(
            !mounts.contains(&"checkpoints") && !mounts.contains(&"data"),
            "{}: {mounts:?}",
            c.name
        );
    }
    let command = pods[1].spec.as_ref().expect("spec").containers[0]
        .command
        .clone()
        .expect("command");
    let at = command
        .iter()
        .position(|a| a == "--checkpoint-dir")
        .expect("--checkpoint-dir");
    assert_eq!(command[at + 1], "s3://ckpt/runs");

    for (change, field, said) in [
        (
            Box::new(|tj: &mut TrainingJob| tj.spec.storage_secret = None)
                as Box<dyn Fn(&mut TrainingJob)>,
            "spec.storageSecret",
            "AWS_ACCESS_KEY_ID",
        ),
        (
            Box::new(|tj: &mut TrainingJob| {
                tj.spec.cluster.checkpoint_dir = Some("/checkpoints".into())
            }),
            "spec.cluster.checkpoint_dir",
            "spec.volumes.checkpoints",
        ),
        (
            Box::new(|tj: &mut TrainingJob| {
                tj.spec.data.train = Globs::Many(vec!["ftp://host/x".into()])
            }),
            "spec.data.train",
            "unsupported scheme",
        ),
    ] {
        let mut tj = object_job();
        change(&mut tj);
        let e = tj.job_spec().expect_err("invalid");
        assert_eq!(e.field, field, "{e:?}");
        assert!(e.message.contains(said), "{e:?}");
    }
}
