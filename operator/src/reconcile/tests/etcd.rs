//! The job's etcd: a managed one first, an unreachable one, a full one (the space
//! alarm).

use super::*;

#[test]
fn a_managed_etcd_comes_first_and_an_unreachable_one_is_a_condition_and_one_event() {
    let mut tj = training_job("");
    tj.spec.etcd = EtcdSpec {
        managed: true,
        ..EtcdSpec::default()
    };
    let obs = Observed {
        claims: BTreeSet::new(),
        ..observe(&tj, vec![], Err("connection refused".into()))
    };
    let plan = reconcile(&obs);
    assert_eq!(
        names(&plan.create_pods),
        ["mnist-etcd-0", "mnist-etcd-1", "mnist-etcd-2"],
        "only the etcd before it runs"
    );
    // Each member on a claim of its own, found by its peers by its pod's DNS name, and
    // the job's processes given every member.
    let claims: Vec<String> = plan
        .create_claims
        .iter()
        .filter_map(|c| c.metadata.name.clone())
        .filter(|n| n.contains("-etcd-"))
        .collect();
    assert_eq!(
        claims,
        [
            "mnist-etcd-data-0",
            "mnist-etcd-data-1",
            "mnist-etcd-data-2"
        ]
    );
    let member = serde_json::to_value(&plan.create_pods[1]).expect("json");
    let args = member["spec"]["containers"][0]["command"].to_string();
    for want in [
        "--name=etcd-1",
        "--initial-cluster=etcd-0=https://mnist-etcd-0.mnist.ml.svc:2380,etcd-1=https://mnist-etcd-1.mnist.ml.svc:2380,etcd-2=https://mnist-etcd-2.mnist.ml.svc:2380",
        "--advertise-client-urls=https://mnist-etcd-1.mnist.ml.svc:2379",
        "--auto-compaction-retention=1h",
        "--quota-backend-bytes=2147483648",
        // Clients and peers over mutual TLS with the job's certificate.
        "--cert-file=/etc/edl/tls/tls.crt",
        "--trusted-ca-file=/etc/edl/tls/ca.crt",
        "\"--client-cert-auth\"",
        "--peer-key-file=/etc/edl/tls/tls.key",
        "\"--peer-client-cert-auth\"",
        // Peers only with the members' certificate.
        "--peer-cert-allowed-hostname=mnist-etcd-0.mnist.ml.svc",
    ] {
        assert!(args.contains(want), "{want} in {args}");
    }
    let volumes = member["spec"]["volumes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let tls = volumes
        .iter()
        .find(|v| v["name"] == "tls")
        .expect("a tls volume");
    assert_eq!(tls["secret"]["secretName"], "mnist-edl-tls-etcd");
    assert_eq!(
        member["spec"]["containers"][0]["env"],
        serde_json::json!([{"name": "TMPDIR", "value": "/tmp"}]),
        "no job process variables in an etcd member, only its scratch space"
    );
    // A plaintext job's etcd: no TLS.
    let mut plain = tj.clone();
    plain.spec.plaintext = true;
    let plain_plan = reconcile(&observe(&plain, vec![], Err("refused".into())));
    let plain_args =
        serde_json::to_value(&plain_plan.create_pods[1]).expect("json")["spec"]["containers"][0]
            ["command"]
            .to_string();
    assert!(
        plain_args.contains("--listen-client-urls=http://0.0.0.0:2379")
            && !plain_args.contains("cert-file"),
        "{plain_args}"
    );
    assert_eq!(
        member["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"],
        "mnist-etcd-data-1"
    );
    assert_eq!(
        crate::objects::etcd_endpoints(&tj),
        (0..3)
            .map(|i| format!("https://mnist-etcd-{i}.mnist.ml.svc:2379"))
            .collect::<Vec<_>>()
    );
    assert!(plan.etcd.is_empty());
    assert_eq!(
        plan.create_services.len(),
        1,
        "the etcd's service (the headless one exists)"
    );
    let status = plan.status.clone().expect("status");
    let c = condition(&status, "EtcdReachable");
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "EtcdUnreachable")
    );
    assert!(c.message.contains("connection refused"), "{c:?}");
    assert_eq!(
        plan.events
            .iter()
            .filter(|e| e.reason == "EtcdUnreachable")
            .count(),
        1,
        "{:?}",
        plan.events
    );
    // The same observation again: the condition stands, no second event.
    tj.status = Some(status);
    let members = (0..3)
        .map(|i| pod(Role::Etcd, i, PodPhase::Running))
        .collect();
    let again = reconcile(&observe(&tj, members, Err("connection refused".into())));
    assert!(again.events.is_empty(), "{:?}", again.events);
    assert!(again.create_pods.is_empty());
}

#[test]
fn a_job_paused_by_a_full_etcd_is_a_condition_and_one_warning() {
    let mut tj = training_job("");
    started(&mut tj, 2);
    let full = EtcdState {
        paused: Some("etcd is full (its space alarm): compact and defragment it".into()),
        ..progress(2)
    };
    let plan = reconcile(&observe(&tj, running(2), Ok(full.clone())));
    let status = plan.status.clone().expect("status");
    let c = condition(&status, "EtcdSpaceAlarm");
    assert_eq!((c.status.as_str(), c.reason.as_str()), ("True", "EtcdFull"));
    assert!(c.message.contains("compact"), "{c:?}");
    let warned = |p: &Plan| {
        p.events
            .iter()
            .filter(|e| e.warning && e.reason == "EtcdSpaceAlarm")
            .count()
    };
    assert_eq!(warned(&plan), 1);
    tj.status = Some(status);
    let again = reconcile(&observe(&tj, running(2), Ok(full)));
    assert_eq!(warned(&again), 0, "said once");
    // Cleared: the condition turns false.
    let plan = reconcile(&observe(&tj, running(2), Ok(progress(2))));
    let status = plan.status.expect("status");
    assert_eq!(condition(&status, "EtcdSpaceAlarm").status, "False");
    // A job that never was paused has no such condition.
    let mut fresh = training_job("");
    started(&mut fresh, 2);
    let s = fresh.status.clone().expect("status");
    assert!(s.conditions.iter().all(|c| c.type_ != "EtcdSpaceAlarm"));
}

/// A managed etcd's members repel one another by node (required anti-affinity on the
/// node's hostname, selecting exactly the job's members), so a lost node takes one
/// member and never the quorum; a single member has none.
#[test]
fn managed_etcd_members_are_kept_on_different_nodes() {
    for (members, apart) in [(3, true), (1, false)] {
        let mut tj = training_job("");
        tj.spec.etcd = EtcdSpec {
            managed: true,
            members,
            ..EtcdSpec::default()
        };
        let plan = reconcile(&Observed {
            claims: BTreeSet::new(),
            ..observe(&tj, vec![], Err("connection refused".into()))
        });
        assert_eq!(plan.create_pods.len(), members as usize);
        for p in &plan.create_pods {
            let spec = p.spec.as_ref().expect("a pod spec");
            let terms = spec
                .affinity
                .as_ref()
                .and_then(|a| a.pod_anti_affinity.as_ref())
                .and_then(|a| {
                    a.required_during_scheduling_ignored_during_execution
                        .clone()
                });
            let Some(terms) = terms else {
                assert!(!apart, "{members} members: required anti-affinity");
                continue;
            };
            assert!(apart, "one member needs no anti-affinity: {terms:?}");
            assert_eq!(terms.len(), 1);
            assert_eq!(terms[0].topology_key, crate::objects::NODE_TOPOLOGY);
            let selects = terms[0]
                .label_selector
                .as_ref()
                .and_then(|s| s.match_labels.clone())
                .unwrap_or_default();
            // Every member's labels match every member's term.
            for q in &plan.create_pods {
                let labels = q.metadata.labels.clone().unwrap_or_default();
                assert!(
                    selects.iter().all(|(k, v)| labels.get(k) == Some(v)),
                    "{selects:?} against {labels:?}"
                );
            }
            assert_eq!(
                selects.get(crate::objects::ROLE_LABEL).map(String::as_str),
                Some("etcd")
            );
        }
    }
}

/// A managed etcd's membership as the operator reads it: members 0..3 started at their
/// peer URLs.
fn membership(tj: &TrainingJob) -> Vec<edl_coord::EtcdMember> {
    (0..3)
        .map(|i| edl_coord::EtcdMember {
            id: 100 + u64::from(i),
            name: format!("etcd-{i}"),
            peer_urls: vec![crate::objects::etcd_peer_url(tj, i)],
        })
        .collect()
}

/// The managed etcd's first members bootstrap it (`new`); once it answered (formed),
/// a member whose claim is gone is replaced in the membership before its claim and pod
/// are made again, which joins it (`existing`); while the etcd does not answer, such a
/// member waits, its claim and pod not made; one added and not yet started needs no
/// change; a member on its own claim is left alone.
#[test]
fn a_member_whose_claim_is_lost_is_replaced_in_the_membership_first() {
    let managed = |tj: &mut TrainingJob| {
        tj.spec.etcd = EtcdSpec {
            managed: true,
            ..EtcdSpec::default()
        };
    };
    let mut tj = training_job("");
    managed(&mut tj);
    let state = |p: &Pod| {
        let args =
            serde_json::to_value(p).expect("json")["spec"]["containers"][0]["command"].to_string();
        args.contains("--initial-cluster-state=existing")
    };
    // Not formed yet: the members bootstrap, and reading the membership marks it formed.
    let plan = reconcile(&Observed {
        claims: BTreeSet::new(),
        ..observe(&tj, vec![], Err("connection refused".into()))
    });
    assert_eq!(plan.create_pods.len(), 3);
    assert!(plan.create_pods.iter().all(|p| !state(p)), "new at first");
    assert!(plan.etcd.is_empty());
    let plan = reconcile(&Observed {
        etcd_members: Some(membership(&tj)),
        ..observe(&tj, vec![], Ok(progress(2)))
    });
    assert!(plan.status.expect("status").etcd_formed, "formed");

    let mut tj = training_job("");
    started(&mut tj, 2);
    managed(&mut tj);
    tj.status.as_mut().expect("status").etcd_formed = true;
    let mut pods = running(2);
    pods.extend([
        pod(Role::Etcd, 0, PodPhase::Running),
        pod(Role::Etcd, 1, PodPhase::Running),
    ]);
    let all_claims = observe(&tj, vec![], Ok(progress(2))).claims;
    let without_2: BTreeSet<String> = all_claims
        .iter()
        .filter(|c| *c != "mnist-etcd-data-2")
        .cloned()
        .collect();
    let url = crate::objects::etcd_peer_url(&tj, 2);
    // Member 2's claim being deleted (kept while a pod mounts it), its pod gone: no pod
    // is made on it (it would keep the claim for ever), nor is the member replaced yet.
    let plan = reconcile(&Observed {
        claims_going: BTreeSet::from(["mnist-etcd-data-2".to_owned()]),
        etcd_members: Some(membership(&tj)),
        ..observe(&tj, pods.clone(), Ok(progress(2)))
    });
    assert!(
        plan.create_pods.is_empty(),
        "{:?}",
        names(&plan.create_pods)
    );
    assert!(plan.etcd.is_empty());
    assert!(
        plan.status.as_ref().is_none_or(|s| s.recoveries.is_empty()),
        "not a recovery while it waits"
    );
    // Member 2's pod and claim gone (its node and local volume lost), the etcd answering.
    let plan = reconcile(&Observed {
        claims: without_2.clone(),
        etcd_members: Some(membership(&tj)),
        ..observe(&tj, pods.clone(), Ok(progress(2)))
    });
    assert_eq!(plan.etcd, [EtcdAction::ReplaceMember(url.clone())]);
    assert_eq!(
        plan.create_claims
            .iter()
            .filter_map(|c| c.metadata.name.as_deref())
            .collect::<Vec<_>>(),
        ["mnist-etcd-data-2"]
    );
    assert_eq!(names(&plan.create_pods), ["mnist-etcd-2"]);
    assert!(state(&plan.create_pods[0]), "it joins the formed etcd");
    assert!(
        plan.events
            .iter()
            .any(|e| e.warning && e.reason == "EtcdMemberReplaced")
    );
    let status = plan.status.expect("status");
    assert_eq!(
        condition(&status, "EtcdMembersWhole").reason,
        "MemberReplaced"
    );

    // Replaced already (a round whose claim or pod was not made): nothing to change.
    let mut replaced = membership(&tj);
    replaced[2] = edl_coord::EtcdMember {
        id: 999,
        name: String::new(),
        peer_urls: vec![url.clone()],
    };
    let plan = reconcile(&Observed {
        claims: without_2.clone(),
        etcd_members: Some(replaced),
        ..observe(&tj, pods.clone(), Ok(progress(2)))
    });
    assert!(plan.etcd.is_empty(), "{:?}", plan.etcd);
    assert_eq!(names(&plan.create_pods), ["mnist-etcd-2"]);

    // The etcd not answering: member 2 waits, said once.
    let plan = reconcile(&Observed {
        claims: without_2,
        ..observe(&tj, pods.clone(), Err("no quorum".into()))
    });
    assert!(plan.etcd.is_empty());
    assert!(
        !names(&plan.create_pods).contains(&"mnist-etcd-2".to_owned()),
        "{:?}",
        names(&plan.create_pods)
    );
    assert!(
        !plan
            .create_claims
            .iter()
            .any(|c| c.metadata.name.as_deref() == Some("mnist-etcd-data-2")),
        "no empty claim for it"
    );
    assert!(plan.events.iter().any(|e| e.reason == "EtcdMemberLost"));
    let status = plan.status.expect("status");
    assert_eq!(condition(&status, "EtcdMembersWhole").reason, "MemberLost");
    assert!(
        status.recoveries.iter().all(|r| r.pod != "mnist-etcd-2"),
        "a member waiting is not a recovery yet"
    );

    // Every claim there (member 2's pod only gone): made again on its claim, as before.
    let plan = reconcile(&Observed {
        claims: all_claims,
        etcd_members: Some(membership(&tj)),
        ..observe(&tj, pods, Ok(progress(2)))
    });
    assert!(plan.etcd.is_empty());
    assert_eq!(names(&plan.create_pods), ["mnist-etcd-2"]);
}

/// The leading master of a job on a managed etcd snapshots it: by default into the
/// `etcd-snapshots` folder of an object-store checkpoint dir every 30 minutes, the
/// newest 4 kept; where the job says otherwise, as it says; with none to go to, or
/// disabled, none. Only the master gets the etcd's root password (by reference to
/// `<job>-etcd-root`, never in the pod's spec). A shared etcd's snapshots are its
/// administrators' (refused), as are a period of 0, a count of 0 and a local path.
#[test]
fn the_leading_master_snapshots_a_managed_etcd_into_the_jobs_object_store() {
    use crate::crd::EtcdSnapshots;
    use crate::objects::{CredentialsRef, pod};
    let job = |snapshots: EtcdSnapshots, checkpoint_dir: Option<&str>| {
        let mut tj = training_job("");
        tj.spec.etcd = EtcdSpec {
            managed: true,
            snapshots,
            ..EtcdSpec::default()
        };
        tj.spec.cluster.checkpoint_dir = checkpoint_dir.map(str::to_owned);
        tj.spec.storage_secret = Some("store".into());
        tj
    };
    // The master's snapshot arguments, and whether the root password is in its env.
    let master = |tj: &TrainingJob| {
        tj.job_spec().expect("a valid job");
        let p = pod(tj, slot(Role::Master, 0), CredentialsRef::Required);
        let c = &p.spec.expect("spec").containers[0];
        let command = c.command.clone().unwrap_or_default();
        let args: Vec<String> = command
            .iter()
            .skip_while(|a| *a != "--etcd-snapshots")
            .take(6)
            .cloned()
            .collect();
        let root = c
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "EDL_ETCD_SNAPSHOT_PASSWORD");
        let root = root.map(|e| {
            assert!(e.value.is_none(), "never the password itself");
            let r = e
                .value_from
                .as_ref()
                .and_then(|v| v.secret_key_ref.clone())
                .expect("from a Secret's key");
            (r.name, r.key)
        });
        (args.join(" "), root)
    };
    let root = Some(("mnist-etcd-root".to_owned(), "password".to_owned()));
    let tj = job(EtcdSnapshots::default(), Some("s3://bucket/ckpt/"));
    assert_eq!(
        master(&tj),
        (
            "--etcd-snapshots s3://bucket/ckpt/etcd-snapshots --etcd-snapshot-every 30m \
             --etcd-snapshot-keep 4"
                .to_owned(),
            root.clone()
        )
    );
    // No other role gets the password.
    for role in [Role::Pserver, Role::Trainer, Role::Etcd] {
        let p = pod(&tj, slot(role, 0), CredentialsRef::Required);
        let env = p.spec.expect("spec").containers[0]
            .env
            .clone()
            .unwrap_or_default();
        assert!(
            env.iter().all(|e| e.name != "EDL_ETCD_SNAPSHOT_PASSWORD"),
            "{role:?}"
        );
    }
    let asked = EtcdSnapshots {
        location: Some("gs://snaps/mnist".into()),
        every: Some("10m".into()),
        keep: Some(2),
        disabled: false,
    };
    assert_eq!(
        master(&job(asked.clone(), None)),
        (
            "--etcd-snapshots gs://snaps/mnist --etcd-snapshot-every 10m --etcd-snapshot-keep 2"
                .to_owned(),
            root
        )
    );
    assert_eq!(
        master(&job(EtcdSnapshots::default(), None)),
        (String::new(), None)
    );
    let off = EtcdSnapshots {
        disabled: true,
        ..EtcdSnapshots::default()
    };
    assert_eq!(
        master(&job(off, Some("s3://bucket/ckpt"))),
        (String::new(), None)
    );

    let invalid = |tj: TrainingJob| tj.job_spec().expect_err("invalid").field;
    let mut shared = job(asked.clone(), None);
    shared.spec.etcd.managed = false;
    shared.spec.etcd.endpoints = vec!["http://etcd:2379".into()];
    assert_eq!(invalid(shared), "spec.etcd.snapshots");
    for (bad, field) in [
        (
            EtcdSnapshots {
                every: Some("0s".into()),
                ..asked.clone()
            },
            "spec.etcd.snapshots.every",
        ),
        (
            EtcdSnapshots {
                keep: Some(0),
                ..asked.clone()
            },
            "spec.etcd.snapshots.keep",
        ),
        (
            EtcdSnapshots {
                location: Some("/var/snapshots".into()),
                ..asked.clone()
            },
            "spec.etcd.snapshots.location",
        ),
    ] {
        assert_eq!(invalid(job(bad, None)), field);
    }
}

/// The pods that restore the managed etcd from a snapshot: one per member, each on its
/// member's claim with the member's own name, data directory, members and peer URL (so
/// the member's pod starts on the restored data), a token of the restored cluster's own,
/// the job's image (which ships etcd's restore tool), the storage Secret's credentials
/// for the snapshot's object store, run once, hardened like the member, and without the
/// job's label (the operator neither counts nor deletes them).
#[test]
fn the_etcd_restore_pods_make_each_member_on_its_claim_as_its_pod_runs_it() {
    let mut tj = training_job("");
    tj.spec.etcd = EtcdSpec {
        managed: true,
        ..EtcdSpec::default()
    };
    tj.spec.storage_secret = Some("store".into());
    let url = "s3://snaps/mnist/etcd/snapshot-1-r2.db";
    let pods = crate::objects::etcd_restore_pods(&tj, url);
    assert_eq!(
        names(&pods),
        [
            "mnist-etcd-0-restore",
            "mnist-etcd-1-restore",
            "mnist-etcd-2-restore"
        ]
    );
    let members = reconcile(&Observed {
        claims: BTreeSet::new(),
        ..observe(&tj, vec![], Err("connection refused".into()))
    })
    .create_pods;
    for (i, (restore, member)) in pods.iter().zip(&members).enumerate() {
        let (r, m) = (
            serde_json::to_value(restore).expect("json"),
            serde_json::to_value(member).expect("json"),
        );
        let command: Vec<String> =
            serde_json::from_value(r["spec"]["containers"][0]["command"].clone()).expect("argv");
        let member_args: Vec<String> =
            serde_json::from_value(m["spec"]["containers"][0]["command"].clone()).expect("argv");
        let flag = |args: &[String], name: &str| -> Option<String> {
            let eq = format!("{name}=");
            args.iter().enumerate().find_map(|(k, a)| {
                a.strip_prefix(&eq)
                    .map(str::to_owned)
                    .or_else(|| (a == name).then(|| args.get(k + 1).cloned()).flatten())
            })
        };
        assert_eq!(
            command[..5],
            ["edl", "operator", "restore-etcd-member", "--from", url]
        );
        for name in [
            "--name",
            "--data-dir",
            "--initial-cluster",
            "--initial-advertise-peer-urls",
        ] {
            let (got, want) = (flag(&command, name), flag(&member_args, name));
            assert!(want.is_some(), "member {i} has {name}");
            assert_eq!(got, want, "member {i}: {name}");
        }
        assert_eq!(
            flag(&command, "--initial-cluster-token").as_deref(),
            Some("mnist-restored")
        );
        let container = &r["spec"]["containers"][0];
        assert_eq!(container["image"], tj.spec.image.as_str());
        assert_eq!(
            container["envFrom"],
            serde_json::json!([{"secretRef": {"name": "store"}}])
        );
        assert!(
            container["livenessProbe"].is_null() && container["ports"].is_null(),
            "{container}"
        );
        assert_eq!(
            container["securityContext"],
            m["spec"]["containers"][0]["securityContext"]
        );
        assert_eq!(r["spec"]["securityContext"], m["spec"]["securityContext"]);
        assert_eq!(r["spec"]["restartPolicy"], "Never");
        assert_eq!(
            r["spec"]["volumes"], m["spec"]["volumes"],
            "the member's claim"
        );
        assert_eq!(
            container["volumeMounts"],
            m["spec"]["containers"][0]["volumeMounts"]
        );
        assert_eq!(
            r["metadata"]["labels"],
            serde_json::json!({crate::objects::ETCD_RESTORE_LABEL: "mnist"})
        );
    }
}
