//! The operator's decision: what it observed of one TrainingJob (the resource, its
//! pods and services, the job's state in etcd, the time) in, a [`Plan`] out. Pure and
//! deterministic; the controller (the thin kube-rs edge) gathers the observation and
//! applies the plan, in the plan's order: finalizer, etcd, deletions, creations,
//! status, events.
//!
//! Invariants (checked by the property tests below):
//! - a pod is created only for a slot the spec wants (masters `0..masters`, pservers
//!   `0..pservers * pserver_replicas` (slot `s` holds shard `s % pservers`), trainers
//!   `0..trainers` with `min_trainers <= trainers <= max_trainers` or none (`trainers`
//!   0: the job held without trainers), the etcd when managed) and only when no pod of
//!   that name exists, terminating or not (a replacement waits until its predecessor
//!   is gone);
//! - a pod is deleted only if it exists and is not already terminating;
//! - a job being deleted gets no new pods; its finalizer goes only after its etcd keys
//!   and (when the operator made them) its etcd user and role;
//! - a finished job (Succeeded or Failed) gets no new pods, and its pods still running
//!   are deleted, but for a managed etcd's, which hold its final state until the job
//!   is deleted;
//! - a job admitted through a Kueue Workload runs only while its Workload is admitted,
//!   with no more trainers than Kueue admitted; otherwise it is held as a suspended job
//!   is, and after an eviction its quota is given back only once it has no pods; its
//!   Workload is marked finished when it ends;
//! - a suspended job gets no new pods; its trainers are deleted with their drain grace
//!   period, and its masters and pservers (graceful: a final checkpoint) only once no
//!   trainer pod is left; its etcd pod (managed) stays, holding its state; a pod that
//!   goes while it is suspended, or is made when it resumes, is no recovery;
//! - the job's NetworkPolicy (its pods admit only one another, the operator, and scrapes
//!   of the metrics port) exists before its pods, and so does its Volcano PodGroup when
//!   it asks for Volcano;
//! - a pserver pod mounts a claim of its own (`<job>-checkpoints-<slot>`, made before
//!   it) unless the job names its checkpoint volume; one that does not outlive its pod
//!   (`emptyDir`) or its node (`hostPath`) is a `CheckpointsDurable=False` condition and
//!   a warning Event;
//! - a trainer beyond the desired count is deleted with its drain grace period (SIGTERM:
//!   it hands its task back), never killed outright;
//! - a job its master paused (its etcd full: the space alarm) has the condition
//!   `EtcdSpaceAlarm` and one Warning Event, until the master goes on;
//! - every scale and every replacement is an Event; every problem that keeps a pod from
//!   running (an image that cannot be pulled, an unschedulable pod, a missing volume, an
//!   unreachable etcd, credentials the operator could not make) is a condition and an
//!   Event, never a silent Pending;
//! - when the operator makes a job's credentials, no job process is created before
//!   they exist, and every one requires them; likewise its TLS Secret, unless the job
//!   asked for `plaintext`.
//!
//! Layout: [`reconcile`] runs the decision's phases in order, each a method of a private
//! `Decision` (`reconcile/decision.rs`) (the observation, the status the job had and the one being made, the plan
//! so far); a phase that finds the job over (deleted, invalid, finished, crash-looping)
//! returns the plan itself.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use edl_job::JobSpec;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::crd::{TaskCounts, TrainingJob, TrainingJobStatus};
use crate::objects::{Role, Slot};

use decision::{Decision, Hold};

/// The finalizer that keeps a deleted TrainingJob until its etcd keys are removed.
pub const FINALIZER: &str = "edl.dev/etcd-cleanup";

/// A pod's phase (`status.phase`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodPhase {
    /// Accepted, not all containers started.
    Pending,
    /// Running.
    Running,
    /// Exited 0.
    Succeeded,
    /// Exited otherwise, or was killed.
    Failed,
    /// The node stopped reporting.
    Unknown,
}

impl PodPhase {
    fn ended(self) -> bool {
        matches!(self, PodPhase::Succeeded | PodPhase::Failed)
    }
}

/// A pod of the job as the operator sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct PodView {
    /// Its name.
    pub name: String,
    /// Its slot (from its labels).
    pub slot: Slot,
    /// Its phase.
    pub phase: PodPhase,
    /// It has a deletion timestamp.
    pub terminating: bool,
    /// Why it is not running, when it is not: `(reason, message)` of a waiting container
    /// (`ImagePullBackOff`, `CreateContainerConfigError`, ...) or of the scheduler
    /// (`Unschedulable`: a missing claim, no room).
    pub problem: Option<(String, String)>,
    /// How long it ran, once it ended.
    pub ran_for: Option<Duration>,
    /// Its container's exit code, once it ended.
    pub exit_code: Option<i32>,
}

/// How the job ended, as its state in etcd says.
#[derive(Debug, Clone, PartialEq)]
pub enum Finished {
    /// Every pass trained.
    Succeeded,
    /// Given up, with the reason.
    Failed(String),
}

/// The job's state in etcd.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EtcdState {
    /// Whether `job/spec` is there.
    pub spec_published: bool,
    /// The current pass.
    pub pass: Option<u32>,
    /// The current pass's tasks.
    pub tasks: Option<TaskCounts>,
    /// Trainers registered.
    pub trainers: u32,
    /// Pservers registered.
    pub pservers: u32,
    /// The leading master's address.
    pub leader: Option<String>,
    /// `scale/trainers`.
    pub scale: Option<u32>,
    /// How the job ended, if it has.
    pub finished: Option<Finished>,
    /// Why the master paused the job (its etcd raised the space alarm: full), with
    /// what to do.
    pub paused: Option<String>,
}

/// The job's own credentials (the Secret `<job>-edl-credentials`: its token, and on a
/// shared etcd its etcd user), as the controller found or made them.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Credentials {
    /// The operator makes none for this job: it has no admin credentials for the shared
    /// etcd the job uses (or the job is not live). Pods of a job on a shared etcd take
    /// the Secret if it exists (one made by hand).
    #[default]
    NotIssued,
    /// The Secret exists (found, or made this round): every job process requires it.
    Ready,
    /// The operator could not make it: why. No job process starts without it.
    Failed(String),
}

/// The job's TLS Secret (`<job>-edl-tls`), as the controller found or made it.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum JobTls {
    /// The job asked for none (`spec.plaintext`).
    #[default]
    Plaintext,
    /// The Secret exists: every job pod mounts it.
    Ready,
    /// The operator could not make it: why. No job process starts without it.
    Failed(String),
}

/// The job's Kueue `Workload`, when the operator admits jobs through Kueue (`--kueue`)
/// and the job names a LocalQueue (label `kueue.x-k8s.io/queue-name`): the job runs
/// only while Kueue admits its Workload.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Admission {
    /// Not admitted through a Workload: the job runs unless suspended.
    #[default]
    NotQueued,
    /// Queued, without its Workload yet (the plan makes it).
    NoWorkload,
    /// Its Workload waits for Kueue (no quota reserved).
    Pending,
    /// Kueue admitted it, with the trainers it admitted (partial admission: as few as
    /// `min_trainers`; `None`: the count asked).
    Admitted {
        /// Trainers admitted.
        trainers: Option<u32>,
    },
    /// Kueue evicted it (preempted, its quota gone): why. The job drains, then gives
    /// the quota back.
    Evicted(String),
    /// Its Workload is marked finished (the job ended).
    Finished,
}

/// A change to the job's Kueue Workload.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkloadChange {
    /// Create it (`objects::workload`).
    Create(Box<serde_json::Value>),
    /// The job stopped after an eviction: clear its admission (quota given back) so
    /// that Kueue queues it again; the reason.
    Release(String),
    /// The job ended: mark it finished (Kueue frees its quota); the message.
    Finish(String),
}

/// Everything the decision looks at.
#[derive(Debug, Clone)]
pub struct Observed<'a> {
    /// The resource (spec, metadata, the status it had).
    pub job: &'a TrainingJob,
    /// Its pods (by the job's label).
    pub pods: Vec<PodView>,
    /// The names of its services.
    pub services: BTreeSet<String>,
    /// The names of its PersistentVolumeClaims.
    pub claims: BTreeSet<String>,
    /// The names of its NetworkPolicies.
    pub network_policies: BTreeSet<String>,
    /// Its Volcano PodGroups (looked for only when it asks for Volcano): name, and
    /// `spec.minMember` (0 if it has none).
    pub pod_groups: BTreeMap<String, u32>,
    /// The operator's namespace (its NetworkPolicy admits the operator's pods from it).
    pub operator_namespace: String,
    /// Its state in etcd, or why etcd could not be read.
    pub etcd: Result<EtcdState, String>,
    /// Its etcd credentials.
    pub credentials: Credentials,
    /// Its TLS Secret.
    pub tls: JobTls,
    /// Its Kueue Workload.
    pub admission: Admission,
    /// Now.
    pub now: Time,
}

/// A change to the job's etcd keys.
#[derive(Debug, Clone, PartialEq)]
pub enum EtcdAction {
    /// Store the job spec at `job/spec` (before any process starts).
    PublishSpec(Box<JobSpec>),
    /// Set `scale/trainers`.
    WriteScale(u32),
    /// Delete every key of the job (the finalizer's work).
    DeleteJob,
    /// Delete the job's own etcd user and role (`edl-job-<job>`), if the operator made
    /// them (the finalizer's work, after the keys).
    RemoveJobUser,
}

/// A pod to delete.
#[derive(Debug, Clone, PartialEq)]
pub struct Deletion {
    /// The pod.
    pub name: String,
    /// Seconds it has to stop (`None`: its own `terminationGracePeriodSeconds`, the
    /// trainer's drain).
    pub grace: Option<i64>,
}

/// An Event to record on the TrainingJob.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Whether it is a warning.
    pub warning: bool,
    /// CamelCase reason (`ScaledUp`, `PodReplaced`, ...).
    pub reason: String,
    /// What happened.
    pub message: String,
}

/// The finalizer change the plan asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalizerChange {
    /// Add [`FINALIZER`].
    Add,
    /// Remove it: the job's keys are gone.
    Remove,
}

/// What to do.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    /// The finalizer.
    pub finalizer: Option<FinalizerChange>,
    /// etcd changes.
    pub etcd: Vec<EtcdAction>,
    /// Pods to delete.
    pub delete: Vec<Deletion>,
    /// Pods to create.
    pub create_pods: Vec<Pod>,
    /// Services to create.
    pub create_services: Vec<Service>,
    /// PersistentVolumeClaims to create (before the pods that mount them).
    pub create_claims: Vec<PersistentVolumeClaim>,
    /// NetworkPolicies to create (before the pods).
    pub create_network_policies: Vec<NetworkPolicy>,
    /// Volcano PodGroups to create (before the pods).
    pub create_pod_groups: Vec<serde_json::Value>,
    /// Volcano PodGroups whose `spec.minMember` to set (the job held at 0 trainers, or
    /// no longer): name, minMember.
    pub pod_group_min_members: Vec<(String, u32)>,
    /// The change to the job's Kueue Workload.
    pub workload: Option<WorkloadChange>,
    /// The new status (`None`: leave it).
    pub status: Option<TrainingJobStatus>,
    /// Events.
    pub events: Vec<Event>,
}

impl Plan {
    fn event(&mut self, warning: bool, reason: &str, message: String) {
        self.events.push(Event {
            warning,
            reason: reason.to_owned(),
            message,
        });
    }
}

fn has_finalizer(tj: &TrainingJob) -> bool {
    tj.metadata
        .finalizers
        .as_ref()
        .is_some_and(|f| f.iter().any(|x| x == FINALIZER))
}

/// Sets condition `type_` in `conds`, keeping its transition time when its status does
/// not change. Returns whether anything about it changed.
fn set_condition(
    conds: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
    now: &Time,
) -> bool {
    let status = if status { "True" } else { "False" }.to_owned();
    let new = |time: Time| Condition {
        type_: type_.to_owned(),
        status: status.clone(),
        reason: reason.to_owned(),
        message: message.clone(),
        observed_generation: generation,
        last_transition_time: time,
    };
    match conds.iter_mut().find(|c| c.type_ == type_) {
        Some(c) => {
            let changed = c.status != status || c.reason != reason || c.message != message;
            let time = if c.status == status {
                c.last_transition_time.clone()
            } else {
                now.clone()
            };
            *c = new(time);
            changed
        }
        None => {
            conds.push(new(now.clone()));
            true
        }
    }
}

/// The trainers `tj` wants: `spec.cluster.trainers` within `[min_trainers,
/// max_trainers]`, or 0, which holds the job without trainers (its masters and
/// pservers keep its state; edl's autoscaler does so to make room for a job worth
/// more).
pub fn desired_trainers(tj: &TrainingJob) -> u32 {
    let c = &tj.spec.cluster;
    match c.trainers {
        0 => 0,
        n => n.clamp(c.min_trainers, c.max_trainers()),
    }
}

/// The slots `tj` wants, in start order.
pub fn desired_slots(tj: &TrainingJob) -> Vec<Slot> {
    let c = &tj.spec.cluster;
    let trainers = desired_trainers(tj);
    let mut out = Vec::new();
    if tj.spec.etcd.managed {
        out.extend((0..tj.spec.etcd.members.max(1)).map(|index| Slot {
            role: Role::Etcd,
            index,
        }));
    }
    for (role, n) in [
        (Role::Master, c.masters),
        (Role::Pserver, c.pservers * c.pserver_replicas.max(1)),
        (Role::Trainer, trainers),
    ] {
        out.extend((0..n).map(|index| Slot { role, index }));
    }
    out
}

fn describe_end(p: &PodView) -> String {
    match (p.phase, p.exit_code) {
        (PodPhase::Succeeded, _) => "exited 0 before the job ended".to_owned(),
        (_, Some(code)) => format!("failed: exit code {code}"),
        _ => "failed".to_owned(),
    }
}

/// `desired` with at most `admitted` trainers (Kueue's partial admission admits no
/// fewer than `min_trainers`).
fn within_admission(mut desired: Vec<Slot>, admitted: u32) -> Vec<Slot> {
    desired.retain(|s| s.role != Role::Trainer || s.index < admitted);
    desired
}

/// Deletes (gracefully) every pod of `pods` that still runs but the managed etcd's: the
/// job is over. The etcd keeps the job's final state (its status, its checkpoints'
/// manifests, the pservers' final commits) until the job is deleted.
fn stop_running(plan: &mut Plan, pods: &[PodView]) {
    for p in pods
        .iter()
        .filter(|p| !p.terminating && !p.phase.ended() && p.slot.role != Role::Etcd)
    {
        plan.delete.push(Deletion {
            name: p.name.clone(),
            grace: None,
        });
    }
}

/// Decides what to do about one TrainingJob.
///
/// The phases, in order (each ends the decision when it says the job is over): a job
/// being deleted only loses its keys and finalizer; an invalid spec fails the job; a
/// finished job only stops its pods; then the job's state in etcd (which may say it
/// ended), its suspension, its credentials, its services and checkpoint claims, its ended and surplus pods (a crash loop fails
/// the job), its missing pods, its scale, and last its phase and conditions.
pub fn reconcile(obs: &Observed<'_>) -> Plan {
    let tj = obs.job;
    if tj.metadata.deletion_timestamp.is_some() {
        return being_deleted(tj);
    }
    let mut d = Decision::new(obs);
    if !has_finalizer(tj) && !tj.spec.etcd.managed {
        d.plan.finalizer = Some(FinalizerChange::Add);
    }
    d.condition(
        "Created",
        true,
        "Accepted",
        "the operator accepted the job".to_owned(),
    );
    let spec = match tj.job_spec() {
        Ok(spec) => spec,
        Err(e) => return d.invalid_spec(e.to_string()),
    };
    let desired = desired_slots(tj);
    let want = desired.iter().filter(|s| s.role == Role::Trainer).count() as u32;
    d.status.trainers.desired = want;
    if d.old.phase.is_finished() {
        // Over: stop what still runs, change nothing else.
        d.finish_workload();
        stop_running(&mut d.plan, &obs.pods);
        return d.plan_if_changed();
    }
    let progress = d.etcd_state();
    if let Some(p) = progress {
        if let Some(end) = &p.finished {
            d.finish_workload();
            return d.ended(end);
        }
        if !p.spec_published {
            d.plan
                .etcd
                .push(EtcdAction::PublishSpec(Box::new(spec.clone())));
        }
    }
    if tj.spec.suspend {
        return d.suspended(Hold::Suspend);
    }
    let desired = match &obs.admission {
        Admission::NoWorkload | Admission::Pending | Admission::Evicted(_) => {
            return d.awaiting_admission();
        }
        Admission::Admitted {
            trainers: Some(admitted),
        } => within_admission(desired, *admitted),
        _ => desired,
    };
    let want = desired.iter().filter(|s| s.role == Role::Trainer).count() as u32;
    d.status.trainers.desired = want;
    d.resumed();
    let credentials_failed = d.credentials();
    let tls_failed = d.tls();
    let credentials_failed = credentials_failed.or(tls_failed);
    d.services();
    d.checkpoint_volumes();
    if let Some(why) = d.ended_and_surplus_pods(&desired) {
        return d.crash_loop(why);
    }
    // Job processes need the etcd (and, there, the spec) and their credentials.
    let processes_ready = progress.is_some() && credentials_failed.is_none();
    d.missing_pods(&desired, processes_ready);
    let running_trainers = d.scale(want, progress);
    d.phase_and_conditions(
        &desired,
        want,
        running_trainers,
        progress.is_some(),
        credentials_failed,
    );
    d.plan_if_changed()
}

/// The plan for a job being deleted: remove its keys, then let it go. Its pods go
/// with it (owner references).
fn being_deleted(tj: &TrainingJob) -> Plan {
    let mut plan = Plan::default();
    if has_finalizer(tj) {
        if !tj.spec.etcd.managed {
            plan.etcd.push(EtcdAction::DeleteJob);
            plan.etcd.push(EtcdAction::RemoveJobUser);
        }
        plan.finalizer = Some(FinalizerChange::Remove);
    }
    plan
}

mod admission;
mod decision;
#[cfg(test)]
mod tests;
