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
pub struct Progress {
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
    pub etcd: Result<Progress, String>,
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
pub fn reconcile(obs: &Observed<'_>) -> Plan {
    let tj = obs.job;
    let mut plan = Plan::default();
    let job = tj.metadata.name.clone().unwrap_or_default();
    let generation = tj.metadata.generation;
    let now = &obs.now;
    let old = tj.status.clone().unwrap_or_default();
    let mut status = old.clone();
    status.observed_generation = generation;
    status.selector = objects::selector(&job, Role::Trainer);

    // Being deleted: remove the job's keys, then let it go. Its pods go with it (owner
    // references).
    if tj.metadata.deletion_timestamp.is_some() {
        if has_finalizer(tj) {
            if !tj.spec.etcd.managed {
                plan.etcd.push(EtcdAction::DeleteJob);
            }
            plan.finalizer = Some(FinalizerChange::Remove);
        }
        return plan;
    }
    if !has_finalizer(tj) && !tj.spec.etcd.managed {
        plan.finalizer = Some(FinalizerChange::Add);
    }
    set_condition(
        &mut status.conditions,
        "Created",
        true,
        "Accepted",
        "the operator accepted the job".to_owned(),
        generation,
        now,
    );

    let spec = match tj.job_spec() {
        Ok(spec) => spec,
        Err(e) => {
            status.phase = Phase::Failed;
            if set_condition(
                &mut status.conditions,
                "Failed",
                true,
                "InvalidSpec",
                e.to_string(),
                generation,
                now,
            ) {
                plan.event(true, "InvalidSpec", e.to_string());
            }
            plan.status = Some(status);
            return plan;
        }
    };

    let desired = desired_slots(tj);
    let want = desired.iter().filter(|s| s.role == Role::Trainer).count() as u32;
    status.trainers.desired = want;
    if old.phase.is_finished() {
        // Over: stop what still runs, change nothing else.
        stop_running(&mut plan, &obs.pods);
        plan.status = (status != old).then_some(status);
        return plan;
    }

    // The job's state in etcd.
    let progress = match &obs.etcd {
        Ok(p) => Some(p),
        Err(e) => {
            let message = format!("cannot read the job's state from etcd: {e}");
            if set_condition(
                &mut status.conditions,
                "EtcdReachable",
                false,
                "EtcdUnreachable",
                message.clone(),
                generation,
                now,
            ) {
                plan.event(true, "EtcdUnreachable", message);
            }
            None
        }
    };
    if let Some(p) = progress {
        set_condition(
            &mut status.conditions,
            "EtcdReachable",
            true,
            "Reachable",
            String::new(),
            generation,
            now,
        );
        status.pass = p.pass;
        status.tasks = p.tasks.clone();
        status.trainers.registered = p.trainers;
        status.pservers = p.pservers;
        status.leader = p.leader.clone();
        if let Some(end) = &p.finished {
            let (phase, cond, reason, message) = match end {
                Finished::Succeeded => (
                    Phase::Succeeded,
                    "Succeeded",
                    "PassesDone",
                    "every pass trained".to_owned(),
                ),
                Finished::Failed(why) => (Phase::Failed, "Failed", "JobFailed", why.clone()),
            };
            status.phase = phase;
            set_condition(
                &mut status.conditions,
                cond,
                true,
                reason,
                message.clone(),
                generation,
                now,
            );
            set_condition(
                &mut status.conditions,
                "Running",
                false,
                reason,
                message.clone(),
                generation,
                now,
            );
            set_condition(
                &mut status.conditions,
                "Scaling",
                false,
                "JobEnded",
                String::new(),
                generation,
                now,
            );
            plan.event(phase == Phase::Failed, cond, message);
            stop_running(&mut plan, &obs.pods);
            plan.status = Some(status);
            return plan;
        }
        if !p.spec_published {
            plan.etcd
                .push(EtcdAction::PublishSpec(Box::new(spec.clone())));
        }
    }

    // The job's credentials, when the operator makes them.
    let credentials_failed = match &obs.credentials {
        Credentials::NotIssued => None,
        Credentials::Ready => {
            set_condition(
                &mut status.conditions,
                "CredentialsReady",
                true,
                "Issued",
                format!(
                    "the job's processes use the etcd user and token of Secret {}",
                    objects::credentials_secret_name(&job)
                ),
                generation,
                now,
            );
            None
        }
        Credentials::Failed(why) => {
            let message = format!("cannot make the job's etcd credentials: {why}");
            if set_condition(
                &mut status.conditions,
                "CredentialsReady",
                false,
                "CredentialsFailed",
                message.clone(),
                generation,
                now,
            ) {
                plan.event(true, "CredentialsFailed", message.clone());
            }
            Some(message)
        }
    };
    let credentials = CredentialsRef::of(tj, obs.credentials != Credentials::NotIssued);

    // Services.
    for s in objects::services(tj) {
        let name = s.metadata.name.clone().unwrap_or_default();
        if !obs.services.contains(&name) {
            plan.create_services.push(s);
        }
    }

    // Pods: replace ended ones, drain surplus trainers, create missing slots.
    let wanted: BTreeSet<Slot> = desired.iter().copied().collect();
    let by_name: BTreeMap<&str, &PodView> = obs.pods.iter().map(|p| (p.name.as_str(), p)).collect();
    let healthy_after = tj.spec.cluster.healthy_after;
    let max_restarts = tj.spec.cluster.max_restarts;
    let mut crash_loop: Option<String> = None;
    for p in &obs.pods {
        if p.terminating {
            continue;
        }
        if !wanted.contains(&p.slot) {
            // A trainer beyond the desired count (or a slot the spec no longer has):
            // SIGTERM, so it drains.
            plan.delete.push(Deletion {
                name: p.name.clone(),
                grace: None,
            });
            continue;
        }
        if p.phase.ended() {
            let what = describe_end(p);
            let healthy = p.ran_for.is_some_and(|d| d >= healthy_after);
            let count = status.restarts.entry(p.name.clone()).or_insert(0);
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
            plan.delete.push(Deletion {
                name: p.name.clone(),
                grace: Some(0),
            });
            if !status.replacing.contains(&p.name) {
                status.replacing.push(p.name.clone());
            }
            status.recoveries.push(Recovery {
                role: p.slot.role.name().to_owned(),
                pod: p.name.clone(),
                reason: what.clone(),
                time: now.0.to_string(),
            });
            plan.event(
                true,
                "PodReplaced",
                format!("pod {} {what}: replacing it", p.name),
            );
        }
    }
    if let Some(why) = crash_loop {
        status.phase = Phase::Failed;
        set_condition(
            &mut status.conditions,
            "Failed",
            true,
            "CrashLoop",
            why.clone(),
            generation,
            now,
        );
        set_condition(
            &mut status.conditions,
            "Running",
            false,
            "CrashLoop",
            why.clone(),
            generation,
            now,
        );
        plan.event(true, "CrashLoop", why);
        plan.delete.clear();
        stop_running(&mut plan, &obs.pods);
        plan.status = Some(status);
        return plan;
    }
    // Missing slots. Job processes need the etcd (and, there, the spec) and their
    // credentials: without them only the managed etcd itself is created.
    let etcd_ready = progress.is_some();
    let processes_ready = etcd_ready && credentials_failed.is_none();
    let was_started = !matches!(old.phase, Phase::Created);
    for slot in &desired {
        let name = slot.pod_name(&job);
        if by_name.contains_key(name.as_str()) {
            continue;
        }
        if slot.role != Role::Etcd && !processes_ready {
            continue;
        }
        let known = slot.role != Role::Trainer || slot.index < old.trainers.desired;
        if let Some(i) = status.replacing.iter().position(|n| *n == name) {
            // The replacement of an ended pod, already counted.
            status.replacing.remove(i);
        } else if was_started && known {
            status.recoveries.push(Recovery {
                role: slot.role.name().to_owned(),
                pod: name.clone(),
                reason: "deleted (or lost with its node)".to_owned(),
                time: now.0.to_string(),
            });
            plan.event(
                true,
                "PodReplaced",
                format!("pod {name} is gone (deleted or lost with its node): recreating it"),
            );
        }
        plan.create_pods.push(objects::pod(tj, *slot, credentials));
    }
    let excess = status.recoveries.len().saturating_sub(RECENT_RECOVERIES);
    status.recoveries.drain(..excess);

    // Scale.
    let running_trainers = obs
        .pods
        .iter()
        .filter(|p| p.slot.role == Role::Trainer && p.phase == PodPhase::Running && !p.terminating)
        .count() as u32;
    if old.trainers.desired != want && was_started {
        let (reason, verb) = if want > old.trainers.desired {
            ("ScaledUp", "up")
        } else {
            ("ScaledDown", "down")
        };
        plan.event(
            false,
            reason,
            format!(
                "trainers {} -> {want}: scaling {verb}{}",
                old.trainers.desired,
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
        plan.etcd.push(EtcdAction::WriteScale(want));
    }
    status.trainers = TrainerCounts {
        running: running_trainers,
        desired: want,
        registered: status.trainers.registered,
    };

    // Phase and conditions.
    let core_running = desired.iter().filter(|s| s.role != Role::Trainer).all(|s| {
        by_name
            .get(s.pod_name(&job).as_str())
            .is_some_and(|p| p.phase == PodPhase::Running && !p.terminating)
    });
    let problem = obs
        .pods
        .iter()
        .filter(|p| !p.terminating && !p.phase.ended())
        .find_map(|p| {
            p.problem
                .as_ref()
                .map(|(r, m)| (r.clone(), format!("pod {}: {m}", p.name)))
        });
    let scaling = running_trainers != want;
    status.phase = match (core_running && running_trainers > 0, scaling) {
        (true, false) => Phase::Running,
        (true, true) => Phase::Scaling,
        (false, _) if matches!(old.phase, Phase::Created | Phase::Pending) => Phase::Pending,
        (false, _) => Phase::Running,
    };
    let (ok, reason, message) = if !etcd_ready {
        (
            false,
            "EtcdUnreachable".to_owned(),
            "the job's etcd cannot be read".to_owned(),
        )
    } else if let Some(why) = &credentials_failed {
        (false, "CredentialsFailed".to_owned(), why.clone())
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
    if set_condition(
        &mut status.conditions,
        "Running",
        ok,
        &reason,
        message.clone(),
        generation,
        now,
    ) && !ok
        && problem.as_ref().is_some_and(|(r, _)| *r == reason)
    {
        plan.event(true, &reason, message);
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
    set_condition(
        &mut status.conditions,
        "Scaling",
        scaling,
        reason,
        scaling_message,
        generation,
        now,
    );

    plan.status = (status != old).then_some(status);
    plan
}

#[cfg(test)]
mod tests;
