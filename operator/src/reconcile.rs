//! The operator's decision: what it observed of one TrainingJob (the resource, its
//! pods and services, the job's state in etcd, the time) in, a [`Plan`] out. Pure and
//! deterministic; the controller (the thin kube-rs edge) gathers the observation and
//! applies the plan, in the plan's order: finalizer, etcd, deletions, creations,
//! status, events.
//!
//! Invariants (checked by the property tests below):
//! - a pod is created only for a slot the spec wants (masters `0..masters`, pservers
//!   `0..pservers`, trainers `0..trainers` with `min_trainers <= trainers <=
//!   max_trainers`, the etcd when managed) and only when no pod of that name exists,
//!   terminating or not (a replacement waits until its predecessor is gone);
//! - a pod is deleted only if it exists and is not already terminating;
//! - a job being deleted gets no new pods; its finalizer goes only after its etcd keys;
//! - a finished job (Succeeded or Failed) gets no new pods, and its pods still running
//!   are deleted;
//! - a trainer beyond the desired count is deleted with its drain grace period (SIGTERM:
//!   it hands its task back), never killed outright;
//! - every scale and every replacement is an Event; every problem that keeps a pod from
//!   running (an image that cannot be pulled, an unschedulable pod, a missing volume, an
//!   unreachable etcd, credentials the operator could not make) is a condition and an
//!   Event, never a silent Pending;
//! - when the operator makes a job's credentials, no job process is created before
//!   they exist, and every one requires them.
//!
//! Layout: [`reconcile`] runs the decision's phases in order, each a method of a private
//! `Decision` (the observation, the status the job had and the one being made, the plan
//! so far); a phase that finds the job over (deleted, invalid, finished, crash-looping)
//! returns the plan itself.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use edl_job::JobSpec;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::crd::{
    Phase, RECENT_RECOVERIES, Recovery, TaskCounts, TrainerCounts, TrainingJob, TrainingJobStatus,
};
use crate::objects::{self, CredentialsRef, Role, Slot};

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
}

/// The job's own etcd credentials (the Secret `<job>-edl-credentials`), as the
/// controller found or made them.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Credentials {
    /// The operator makes none for this job: it has no admin credentials for the jobs'
    /// etcd, or the job runs its own. Pods of a job on a shared etcd take the Secret if
    /// it exists (one made by hand).
    #[default]
    NotIssued,
    /// The Secret exists (found, or made this round): every job process requires it.
    Ready,
    /// The operator could not make it: why. No job process starts without it.
    Failed(String),
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
    /// Its state in etcd, or why etcd could not be read.
    pub etcd: Result<EtcdState, String>,
    /// Its etcd credentials.
    pub credentials: Credentials,
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

/// The slots `tj` wants, in start order.
pub fn desired_slots(tj: &TrainingJob) -> Vec<Slot> {
    let c = &tj.spec.cluster;
    let trainers = c.trainers.clamp(c.min_trainers, c.max_trainers());
    let mut out = Vec::new();
    if tj.spec.etcd.managed {
        out.push(Slot {
            role: Role::Etcd,
            index: 0,
        });
    }
    for (role, n) in [
        (Role::Master, c.masters),
        (Role::Pserver, c.pservers),
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

/// Deletes (gracefully) every pod of `pods` that still runs: the job is over.
fn stop_running(plan: &mut Plan, pods: &[PodView]) {
    for p in pods.iter().filter(|p| !p.terminating && !p.phase.ended()) {
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
/// ended), its credentials, its services, its ended and surplus pods (a crash loop fails
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
        stop_running(&mut d.plan, &obs.pods);
        return d.plan_if_changed();
    }
    let progress = d.etcd_state();
    if let Some(p) = progress {
        if let Some(end) = &p.finished {
            return d.ended(end);
        }
        if !p.spec_published {
            d.plan
                .etcd
                .push(EtcdAction::PublishSpec(Box::new(spec.clone())));
        }
    }
    let credentials_failed = d.credentials();
    d.services();
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
        }
        plan.finalizer = Some(FinalizerChange::Remove);
    }
    plan
}

/// One decision under way: the observation, the status it had and the one being made,
/// and the plan so far.
struct Decision<'a> {
    obs: &'a Observed<'a>,
    /// The job's name.
    job: String,
    /// The status the job had.
    old: TrainingJobStatus,
    /// The status being made (written only if it differs from `old`).
    status: TrainingJobStatus,
    plan: Plan,
}

impl<'a> Decision<'a> {
    fn new(obs: &'a Observed<'a>) -> Self {
        let tj = obs.job;
        let job = tj.metadata.name.clone().unwrap_or_default();
        let old = tj.status.clone().unwrap_or_default();
        let mut status = old.clone();
        status.observed_generation = tj.metadata.generation;
        status.selector = objects::selector(&job, Role::Trainer);
        Decision {
            obs,
            job,
            old,
            status,
            plan: Plan::default(),
        }
    }

    /// Sets condition `type_` of the new status (see [`set_condition`]); whether
    /// anything about it changed.
    fn condition(&mut self, type_: &str, status: bool, reason: &str, message: String) -> bool {
        set_condition(
            &mut self.status.conditions,
            type_,
            status,
            reason,
            message,
            self.obs.job.metadata.generation,
            &self.obs.now,
        )
    }

    /// The plan, with the new status when it differs from the old one.
    fn plan_if_changed(mut self) -> Plan {
        self.plan.status = (self.status != self.old).then_some(self.status);
        self.plan
    }

    /// The plan, with the new status.
    fn plan_with_status(mut self) -> Plan {
        self.plan.status = Some(self.status);
        self.plan
    }

    /// The job's spec is invalid: it fails, saying why once.
    fn invalid_spec(mut self, why: String) -> Plan {
        self.status.phase = Phase::Failed;
        if self.condition("Failed", true, "InvalidSpec", why.clone()) {
            self.plan.event(true, "InvalidSpec", why);
        }
        self.plan_with_status()
    }

    /// The job's state in etcd into the status and the `EtcdReachable` condition;
    /// `None` (one event) when etcd cannot be read.
    fn etcd_state(&mut self) -> Option<&'a EtcdState> {
        let p = match &self.obs.etcd {
            Ok(p) => p,
            Err(e) => {
                let message = format!("cannot read the job's state from etcd: {e}");
                if self.condition("EtcdReachable", false, "EtcdUnreachable", message.clone()) {
                    self.plan.event(true, "EtcdUnreachable", message);
                }
                return None;
            }
        };
        self.condition("EtcdReachable", true, "Reachable", String::new());
        self.status.pass = p.pass;
        self.status.tasks = p.tasks.clone();
        self.status.trainers.registered = p.trainers;
        self.status.pservers = p.pservers;
        self.status.leader = p.leader.clone();
        Some(p)
    }

    /// etcd says the job ended: its phase and conditions say how, and what still runs
    /// is stopped.
    fn ended(mut self, end: &Finished) -> Plan {
        let (phase, cond, reason, message) = match end {
            Finished::Succeeded => (
                Phase::Succeeded,
                "Succeeded",
                "PassesDone",
                "every pass trained".to_owned(),
            ),
            Finished::Failed(why) => (Phase::Failed, "Failed", "JobFailed", why.clone()),
        };
        self.status.phase = phase;
        self.condition(cond, true, reason, message.clone());
        self.condition("Running", false, reason, message.clone());
        self.condition("Scaling", false, "JobEnded", String::new());
        self.plan.event(phase == Phase::Failed, cond, message);
        stop_running(&mut self.plan, &self.obs.pods);
        self.plan_with_status()
    }

    /// The job's credentials, when the operator makes them, into the
    /// `CredentialsReady` condition; why they could not be made, if so.
    fn credentials(&mut self) -> Option<String> {
        match &self.obs.credentials {
            Credentials::NotIssued => None,
            Credentials::Ready => {
                let message = format!(
                    "the job's processes use the etcd user and token of Secret {}",
                    objects::credentials_secret_name(&self.job)
                );
                self.condition("CredentialsReady", true, "Issued", message);
                None
            }
            Credentials::Failed(why) => {
                let message = format!("cannot make the job's etcd credentials: {why}");
                if self.condition(
                    "CredentialsReady",
                    false,
                    "CredentialsFailed",
                    message.clone(),
                ) {
                    self.plan.event(true, "CredentialsFailed", message.clone());
                }
                Some(message)
            }
        }
    }

    /// Creates the services that are missing.
    fn services(&mut self) {
        for s in objects::services(self.obs.job) {
            let name = s.metadata.name.clone().unwrap_or_default();
            if !self.obs.services.contains(&name) {
                self.plan.create_services.push(s);
            }
        }
    }

    /// Drains the pods of slots the job does not want (surplus trainers) and replaces
    /// the ended ones, counting restarts; why the job is crash-looping, if a pod ended
    /// too often too soon.
    fn ended_and_surplus_pods(&mut self, desired: &[Slot]) -> Option<String> {
        let wanted: BTreeSet<Slot> = desired.iter().copied().collect();
        let cluster = &self.obs.job.spec.cluster;
        let (healthy_after, max_restarts) = (cluster.healthy_after, cluster.max_restarts);
        let mut crash_loop: Option<String> = None;
        for p in self.obs.pods.iter().filter(|p| !p.terminating) {
            if !wanted.contains(&p.slot) {
                // A trainer beyond the desired count (or a slot the spec no longer has):
                // SIGTERM, so it drains.
                self.plan.delete.push(Deletion {
                    name: p.name.clone(),
                    grace: None,
                });
                continue;
            }
            if !p.phase.ended() {
                continue;
            }
            let what = describe_end(p);
            let healthy = p.ran_for.is_some_and(|d| d >= healthy_after);
            let count = self.status.restarts.entry(p.name.clone()).or_insert(0);
            *count = if healthy { 0 } else { *count + 1 };
            if *count > max_restarts {
                crash_loop = Some(format!(
                    "pod {} {what}, {} times in a row within {} of its start \
                     (cluster.max_restarts = {max_restarts})",
                    p.name,
                    *count,
                    humantime::format_duration(healthy_after)
                ));
                continue;
            }
            self.replace(p, what);
        }
        crash_loop
    }

    /// Deletes the ended pod `p` at once, to be created again: a recovery and an event.
    fn replace(&mut self, p: &PodView, what: String) {
        self.plan.delete.push(Deletion {
            name: p.name.clone(),
            grace: Some(0),
        });
        if !self.status.replacing.contains(&p.name) {
            self.status.replacing.push(p.name.clone());
        }
        self.status.recoveries.push(Recovery {
            role: p.slot.role.name().to_owned(),
            pod: p.name.clone(),
            reason: what.clone(),
            time: self.obs.now.0.to_string(),
        });
        self.plan.event(
            true,
            "PodReplaced",
            format!("pod {} {what}: replacing it", p.name),
        );
    }

    /// A pod ended too often too soon: the job fails, and what still runs is stopped
    /// (no pod is replaced).
    fn crash_loop(mut self, why: String) -> Plan {
        self.status.phase = Phase::Failed;
        self.condition("Failed", true, "CrashLoop", why.clone());
        self.condition("Running", false, "CrashLoop", why.clone());
        self.plan.event(true, "CrashLoop", why);
        self.plan.delete.clear();
        stop_running(&mut self.plan, &self.obs.pods);
        self.plan_with_status()
    }

    /// Creates the pods of the slots that have none. Without `processes_ready` (the
    /// etcd, the spec there, the credentials) only the managed etcd itself is created.
    /// A pod of a started job that is gone is a recovery, unless it replaces an ended
    /// one (already counted). Keeps the last [`RECENT_RECOVERIES`].
    fn missing_pods(&mut self, desired: &[Slot], processes_ready: bool) {
        let tj = self.obs.job;
        let credentials = CredentialsRef::of(tj, self.obs.credentials != Credentials::NotIssued);
        let existing: BTreeSet<&str> = self.obs.pods.iter().map(|p| p.name.as_str()).collect();
        let was_started = !matches!(self.old.phase, Phase::Created);
        for slot in desired {
            let name = slot.pod_name(&self.job);
            if existing.contains(name.as_str()) {
                continue;
            }
            if slot.role != Role::Etcd && !processes_ready {
                continue;
            }
            let known = slot.role != Role::Trainer || slot.index < self.old.trainers.desired;
            if let Some(i) = self.status.replacing.iter().position(|n| *n == name) {
                // The replacement of an ended pod, already counted.
                self.status.replacing.remove(i);
            } else if was_started && known {
                self.status.recoveries.push(Recovery {
                    role: slot.role.name().to_owned(),
                    pod: name.clone(),
                    reason: "deleted (or lost with its node)".to_owned(),
                    time: self.obs.now.0.to_string(),
                });
                self.plan.event(
                    true,
                    "PodReplaced",
                    format!("pod {name} is gone (deleted or lost with its node): recreating it"),
                );
            }
            self.plan
                .create_pods
                .push(objects::pod(tj, *slot, credentials));
        }
        let excess = self
            .status
            .recoveries
            .len()
            .saturating_sub(RECENT_RECOVERIES);
        self.status.recoveries.drain(..excess);
    }

    /// A change of the desired trainer count (`want`) is an event and is written to
    /// `scale/trainers`; the trainer counts go into the status. Returns the trainers
    /// running.
    fn scale(&mut self, want: u32, progress: Option<&EtcdState>) -> u32 {
        let running_trainers = self
            .obs
            .pods
            .iter()
            .filter(|p| {
                p.slot.role == Role::Trainer && p.phase == PodPhase::Running && !p.terminating
            })
            .count() as u32;
        let was_started = !matches!(self.old.phase, Phase::Created);
        let before = self.old.trainers.desired;
        if before != want && was_started {
            let (reason, verb) = if want > before {
                ("ScaledUp", "up")
            } else {
                ("ScaledDown", "down")
            };
            self.plan.event(
                false,
                reason,
                format!(
                    "trainers {before} -> {want}: scaling {verb}{}",
                    if verb == "down" {
                        " (the surplus trainers drain)"
                    } else {
                        ""
                    }
                ),
            );
        }
        if let Some(p) = progress
            && p.scale != Some(want)
        {
            self.plan.etcd.push(EtcdAction::WriteScale(want));
        }
        self.status.trainers = TrainerCounts {
            running: running_trainers,
            desired: want,
            registered: self.status.trainers.registered,
        };
        running_trainers
    }

    /// The job's phase and its `Running` and `Scaling` conditions, from whether its
    /// core (every pod but the trainers) runs, how many trainers run, and the first
    /// problem of a pod that keeps it from running (an event when it is news).
    fn phase_and_conditions(
        &mut self,
        desired: &[Slot],
        want: u32,
        running_trainers: u32,
        etcd_ready: bool,
        credentials_failed: Option<String>,
    ) {
        let core_running = self.core_running(desired);
        let problem = self.first_problem();
        let scaling = running_trainers != want;
        self.status.phase = match (core_running && running_trainers > 0, scaling) {
            (true, false) => Phase::Running,
            (true, true) => Phase::Scaling,
            (false, _) if matches!(self.old.phase, Phase::Created | Phase::Pending) => {
                Phase::Pending
            }
            (false, _) => Phase::Running,
        };
        let (ok, reason, message) = if !etcd_ready {
            (
                false,
                "EtcdUnreachable".to_owned(),
                "the job's etcd cannot be read".to_owned(),
            )
        } else if let Some(why) = credentials_failed {
            (false, "CredentialsFailed".to_owned(), why)
        } else if core_running && running_trainers > 0 {
            (true, "Training".to_owned(), String::new())
        } else if let Some((r, m)) = &problem {
            (false, r.clone(), m.clone())
        } else {
            (
                false,
                "PodsStarting".to_owned(),
                "waiting for the job's pods to run".to_owned(),
            )
        };
        if self.condition("Running", ok, &reason, message.clone())
            && !ok
            && problem.as_ref().is_some_and(|(r, _)| *r == reason)
        {
            self.plan.event(true, &reason, message);
        }
        let scaling_message = if scaling {
            let mut m = format!("{running_trainers} of {want} trainers running");
            if let Some((_, why)) = problem.as_ref().filter(|_| core_running) {
                m.push_str(&format!("; {why}"));
            }
            m
        } else {
            String::new()
        };
        let reason = match running_trainers.cmp(&want) {
            std::cmp::Ordering::Less => "ScalingUp",
            std::cmp::Ordering::Greater => "ScalingDown",
            std::cmp::Ordering::Equal => "AtDesired",
        };
        self.condition("Scaling", scaling, reason, scaling_message);
    }

    /// Whether every desired pod but the trainers runs (and is not terminating).
    fn core_running(&self, desired: &[Slot]) -> bool {
        let by_name: BTreeMap<&str, &PodView> =
            self.obs.pods.iter().map(|p| (p.name.as_str(), p)).collect();
        desired.iter().filter(|s| s.role != Role::Trainer).all(|s| {
            by_name
                .get(s.pod_name(&self.job).as_str())
                .is_some_and(|p| p.phase == PodPhase::Running && !p.terminating)
        })
    }

    /// The first problem of a live pod that keeps it from running: `(reason, message)`.
    fn first_problem(&self) -> Option<(String, String)> {
        self.obs
            .pods
            .iter()
            .filter(|p| !p.terminating && !p.phase.ended())
            .find_map(|p| {
                p.problem
                    .as_ref()
                    .map(|(r, m)| (r.clone(), format!("pod {}: {m}", p.name)))
            })
    }
}

#[cfg(test)]
mod tests;
