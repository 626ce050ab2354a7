use std::collections::BTreeSet;
use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::crd::{EtcdSpec, JobVolumes, Phase, RECENT_RECOVERIES, TrainerCounts, VolumeSource};

mod admission;
mod replicas;
mod suspension;
mod volumes;

const JOB: &str = "mnist";

fn spec_toml(extra_cluster: &str) -> String {
    format!(
        "name = \"{JOB}\"\n[data]\ntrain = [\"mnist-train-*.recordio\"]\n[model]\n\
         kind = \"mnist_mlp\"\n[cluster]\ntrainers = 2\nmin_trainers = 1\nmax_trainers = 4\n\
         {extra_cluster}\n"
    )
}

fn training_job(extra_cluster: &str) -> TrainingJob {
    let spec = JobSpec::parse_toml(&spec_toml(extra_cluster)).expect("spec");
    let mut tj = TrainingJob::from_job_spec(&spec, "edl:test", Some("ml"));
    tj.spec.etcd = EtcdSpec {
        endpoints: vec!["http://etcd:2379".into()],
        ..EtcdSpec::default()
    };
    tj.spec.volumes = JobVolumes {
        data: Some(VolumeSource {
            claim_name: Some("mnist-data".into()),
            ..VolumeSource::default()
        }),
        ..JobVolumes::default()
    };
    tj.metadata.uid = Some("uid-1".into());
    tj.metadata.generation = Some(1);
    tj.metadata.finalizers = Some(vec![FINALIZER.to_owned()]);
    tj
}

fn at(secs: i64) -> Time {
    Time(k8s_openapi::jiff::Timestamp::from_second(1_800_000_000 + secs).expect("time"))
}

fn slot(role: Role, index: u32) -> Slot {
    Slot { role, index }
}

fn pod(role: Role, index: u32, phase: PodPhase) -> PodView {
    PodView {
        name: slot(role, index).pod_name(JOB),
        slot: slot(role, index),
        phase,
        terminating: false,
        problem: None,
        ran_for: None,
        exit_code: None,
    }
}

fn running(trainers: u32) -> Vec<PodView> {
    let mut pods = vec![
        pod(Role::Master, 0, PodPhase::Running),
        pod(Role::Pserver, 0, PodPhase::Running),
    ];
    pods.extend((0..trainers).map(|i| pod(Role::Trainer, i, PodPhase::Running)));
    pods
}

fn progress(scale: u32) -> EtcdState {
    EtcdState {
        spec_published: true,
        pass: Some(0),
        tasks: Some(TaskCounts {
            todo: 10,
            pending: 2,
            done: 3,
            failed: 0,
        }),
        trainers: scale,
        pservers: 1,
        leader: Some("10.0.0.5:7164".into()),
        scale: Some(scale),
        finished: None,
        paused: None,
    }
}

fn observe<'a>(
    tj: &'a TrainingJob,
    pods: Vec<PodView>,
    etcd: Result<EtcdState, String>,
) -> Observed<'a> {
    Observed {
        job: tj,
        pods,
        services: BTreeSet::from([JOB.to_owned()]),
        claims: crate::objects::claims(tj)
            .into_iter()
            .filter_map(|c| c.metadata.name)
            .collect(),
        network_policies: BTreeSet::from([format!("{JOB}-edl")]),
        pod_groups: BTreeMap::new(),
        operator_namespace: "edl-system".to_owned(),
        etcd,
        credentials: Credentials::NotIssued,
        tls: JobTls::Ready,
        admission: Admission::NotQueued,
        now: at(100),
    }
}

/// The job after a first reconcile and with its pods running: the status the operator
/// wrote then.
fn started(tj: &mut TrainingJob, trainers: u32) {
    let obs = observe(tj, running(trainers), Ok(progress(trainers)));
    let plan = reconcile(&obs);
    let mut status = plan.status.expect("a status");
    assert_eq!(status.phase, Phase::Running, "{status:?}");
    status.trainers.desired = trainers;
    tj.status = Some(status);
}

fn names(pods: &[Pod]) -> Vec<String> {
    pods.iter()
        .map(|p| p.metadata.name.clone().unwrap_or_default())
        .collect()
}

fn condition<'a>(s: &'a TrainingJobStatus, type_: &str) -> &'a Condition {
    s.conditions
        .iter()
        .find(|c| c.type_ == type_)
        .unwrap_or_else(|| panic!("no {type_} condition in {s:?}"))
}

#[test]
fn a_new_job_gets_its_finalizer_its_spec_in_etcd_and_every_pod() {
    let mut tj = training_job("");
    tj.metadata.finalizers = None;
    let plan = reconcile(&Observed {
        services: BTreeSet::new(),
        claims: BTreeSet::new(),
        network_policies: BTreeSet::new(),
        ..observe(&tj, vec![], Ok(EtcdState::default()))
    });
    assert_eq!(plan.finalizer, Some(FinalizerChange::Add));
    // Its pods admit one another and the operator's pods (from its namespace), and
    // anyone on the metrics port only.
    let [policy] = &plan.create_network_policies[..] else {
        panic!("one NetworkPolicy: {:?}", plan.create_network_policies);
    };
    let p = serde_json::to_value(policy).expect("json");
    assert_eq!(p["metadata"]["name"], "mnist-edl");
    assert_eq!(p["spec"]["podSelector"]["matchLabels"]["edl.dev/job"], JOB);
    assert_eq!(p["spec"]["policyTypes"], serde_json::json!(["Ingress"]));
    let from = &p["spec"]["ingress"][0]["from"];
    assert_eq!(from[0]["podSelector"]["matchLabels"]["edl.dev/job"], JOB);
    assert_eq!(
        from[1]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
        "edl-system"
    );
    assert_eq!(
        from[1]["podSelector"]["matchLabels"]["app.kubernetes.io/name"],
        "edl-operator"
    );
    assert!(
        p["spec"]["ingress"][0]["ports"].is_null(),
        "every port of its own"
    );
    assert!(p["spec"]["ingress"][1]["from"].is_null());
    assert_eq!(p["spec"]["ingress"][1]["ports"][0]["port"], 9090);
    assert_eq!(
        p["spec"]["ingress"].as_array().map(Vec::len),
        Some(2),
        "nothing else"
    );
    let spec = match &plan.etcd[..] {
        [EtcdAction::PublishSpec(spec), EtcdAction::WriteScale(2)] => spec,
        other => panic!("{other:?}"),
    };
    assert_eq!(spec.name, JOB);
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
    assert_eq!(condition(&status, "Running").reason, "PodsStarting");
    assert_eq!(condition(&status, "CheckpointsDurable").status, "True");
}

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
    ] {
        assert!(args.contains(want), "{want} in {args}");
    }
    assert_eq!(
        member["spec"]["volumes"][1]["secret"]["secretName"],
        "mnist-edl-tls"
    );
    assert!(
        member["spec"]["containers"][0]["env"].is_null(),
        "no job process variables in an etcd member"
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

/// The credentials Secret a pod takes (`envFrom`), if any.
fn env_from_secret(p: &Pod) -> Option<k8s_openapi::api::core::v1::SecretEnvSource> {
    let c = &p.spec.as_ref()?.containers[0];
    let sources = c.env_from.as_ref()?;
    assert_eq!(sources.len(), 1, "{sources:?}");
    sources[0].secret_ref.clone()
}

#[test]
fn job_processes_require_the_credentials_the_operator_made_and_take_hand_made_ones() {
    let tj = training_job("");
    let plan = reconcile(&Observed {
        credentials: Credentials::Ready,
        ..observe(&tj, vec![], Ok(EtcdState::default()))
    });
    assert_eq!(plan.create_pods.len(), 4);
    for p in &plan.create_pods {
        let r = env_from_secret(p).expect("the Secret");
        assert_eq!(r.name, "mnist-edl-credentials");
        assert_eq!(
            r.optional, None,
            "required: a pod without it does not start"
        );
    }
    let status = plan.status.expect("status");
    let c = condition(&status, "CredentialsReady");
    assert_eq!((c.status.as_str(), c.reason.as_str()), ("True", "Issued"));
    assert!(c.message.contains("mnist-edl-credentials"), "{c:?}");

    // An operator without admin credentials: the Secret if an administrator made one.
    let plan = reconcile(&observe(&tj, vec![], Ok(EtcdState::default())));
    assert_eq!(plan.create_pods.len(), 4);
    for p in &plan.create_pods {
        let r = env_from_secret(p).expect("the Secret");
        assert_eq!(
            (r.name.as_str(), r.optional),
            ("mnist-edl-credentials", Some(true))
        );
    }
    let status = plan.status.expect("status");
    assert!(
        status
            .conditions
            .iter()
            .all(|c| c.type_ != "CredentialsReady")
    );

    // A job with its own etcd: none, whatever the operator has.
    let mut managed = training_job("");
    managed.spec.etcd = EtcdSpec {
        managed: true,
        ..EtcdSpec::default()
    };
    let plan = reconcile(&observe(&managed, vec![], Ok(EtcdState::default())));
    assert_eq!(
        plan.create_pods.len(),
        7,
        "the etcd's 3 members and the processes"
    );
    assert!(
        plan.create_pods
            .iter()
            .all(|p| env_from_secret(p).is_none())
    );
    // Once the operator made its token: every process requires it, no etcd member
    // takes it.
    let plan = reconcile(&Observed {
        credentials: Credentials::Ready,
        ..observe(&managed, vec![], Ok(EtcdState::default()))
    });
    for p in &plan.create_pods {
        let etcd = p
            .metadata
            .name
            .as_deref()
            .is_some_and(|n| n.contains("-etcd-"));
        let want = if etcd { None } else { Some(None) };
        assert_eq!(
            env_from_secret(p).map(|r| r.optional),
            want,
            "{:?}",
            p.metadata.name
        );
    }
    // Every process speaks to the managed etcd over TLS with the job's certificate.
    let master = plan
        .create_pods
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some("mnist-master-0"))
        .expect("the master's pod");
    let vars =
        serde_json::to_value(master).expect("json")["spec"]["containers"][0]["env"].to_string();
    for want in [
        r#"{"name":"EDL_ETCD_CA","value":"/etc/edl/tls/ca.crt"}"#,
        r#"{"name":"EDL_ETCD_CERT","value":"/etc/edl/tls/tls.crt"}"#,
        r#"{"name":"EDL_ETCD_DOMAIN","value":"mnist.ml.edl.internal"}"#,
    ] {
        assert!(vars.contains(want), "{want} in {vars}");
    }
    let status = plan.status.expect("status");
    assert!(
        condition(&status, "CredentialsReady")
            .message
            .contains("the etcd user and token of Secret mnist-edl-credentials"),
        "{status:?}"
    );
}

#[test]
fn credentials_the_operator_cannot_make_are_a_condition_and_one_event_and_no_process_starts() {
    let mut tj = training_job("");
    let failed = |tj: &TrainingJob| {
        reconcile(&Observed {
            credentials: Credentials::Failed("etcd: permission denied".into()),
            ..observe(tj, vec![], Ok(EtcdState::default()))
        })
    };
    let plan = failed(&tj);
    assert!(
        plan.create_pods.is_empty(),
        "{:?}",
        names(&plan.create_pods)
    );
    let status = plan.status.clone().expect("status");
    let c = condition(&status, "CredentialsReady");
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "CredentialsFailed")
    );
    assert!(c.message.contains("permission denied"), "{c:?}");
    let running = condition(&status, "Running");
    assert_eq!(running.reason, "CredentialsFailed");
    assert_eq!(status.phase, Phase::Pending);
    let warned = |plan: &Plan| {
        plan.events
            .iter()
            .filter(|e| e.warning && e.reason == "CredentialsFailed")
            .count()
    };
    assert_eq!(warned(&plan), 1, "{:?}", plan.events);
    // The same again: the condition stands, no second event.
    tj.status = Some(status);
    assert_eq!(warned(&failed(&tj)), 0);
}

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
            Just(Credentials::NotIssued),
            Just(Credentials::Ready),
            Just(Credentials::Failed("denied".to_owned())),
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
        if matches!(credentials, Credentials::Failed(_)) {
            prop_assert!(created.is_empty(), "no job process without its credentials");
        }
        for p in &plan.create_pods {
            let optional = env_from_secret(p).map(|r| r.optional);
            let want = match credentials {
                Credentials::Ready => Some(None),
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
