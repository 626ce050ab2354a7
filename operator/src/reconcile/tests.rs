//! The decision's tests, by concept (`tests/<concept>.rs`), and the helpers they share:
//! a job, its pods, its state in etcd, an observation of them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use edl_job::JobSpec;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use super::*;
use crate::crd::{
    EtcdSpec, JobVolumes, Phase, RECENT_RECOVERIES, TaskCounts, TrainerCounts, TrainingJob,
    TrainingJobStatus, VolumeSource,
};
use crate::objects::{JobNetwork, Role, Slot, desired_slots};

mod admission;
mod etcd;
mod lifecycle;
mod placement;
mod pods;
mod property;
mod replicas;
mod scale;
mod secrets;
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
        node: None,
        uid: Some(format!("uid-{index}")),
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
        stuck: Vec::new(),
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
        claims_going: BTreeSet::new(),
        network_policies: BTreeMap::from([(
            format!("{JOB}-edl"),
            crate::objects::network_policy(tj, &JobNetwork::default()).spec,
        )]),
        pod_groups: BTreeMap::new(),
        network: JobNetwork::default(),
        disruption_budgets: crate::objects::disruption_budgets(tj)
            .into_iter()
            .filter_map(|b| b.metadata.name)
            .collect(),
        etcd,
        etcd_members: None,
        credentials: JobCredentials::NotIssued,
        tls: JobTls::Ready(TlsRenewals::default()),
        admission: Admission::NotQueued,
        lost_nodes: BTreeMap::new(),
        node_lost_after: Duration::from_secs(120),
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

/// The credentials Secret a pod takes (`envFrom`), if any; the metrics Secret is taken
/// beside it, the same way.
fn env_from_secret(p: &Pod) -> Option<k8s_openapi::api::core::v1::SecretEnvSource> {
    let c = &p.spec.as_ref()?.containers[0];
    let sources = c.env_from.as_ref()?;
    assert_eq!(sources.len(), 2, "{sources:?}");
    let (credentials, metrics) = (
        sources[0].secret_ref.clone()?,
        sources[1].secret_ref.clone()?,
    );
    assert_eq!(
        (metrics.name.as_str(), metrics.optional),
        ("mnist-edl-metrics", credentials.optional),
        "{sources:?}"
    );
    Some(credentials)
}
