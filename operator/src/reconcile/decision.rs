//! The phases of one decision ([`super::reconcile`] runs them in order): each reads the
//! observation and adds to the status being made and the plan.

use std::collections::{BTreeMap, BTreeSet};

use super::{
    Admission, Credentials, Deletion, EtcdAction, EtcdState, Finished, JobTls, Observed, Plan,
    PodPhase, PodView, describe_end, set_condition, stop_running,
};
use crate::crd::{Phase, RECENT_RECOVERIES, Recovery, TrainerCounts, TrainingJobStatus};
use crate::objects::{self, CredentialsRef, Role, Slot};

/// Why a job is held without pods.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Hold {
    /// `spec.suspend`.
    Suspend,
    /// Its Kueue Workload waits for admission: why.
    Queued {
        /// What it waits for.
        why: String,
    },
    /// Kueue evicted its Workload: why.
    Evicted {
        /// Kueue's reason.
        why: String,
    },
}

impl Hold {
    fn warning(&self) -> bool {
        matches!(self, Hold::Evicted { .. })
    }
}

/// One decision under way: the observation, the status it had and the one being made,
/// and the plan so far.
pub(super) struct Decision<'a> {
    pub(super) obs: &'a Observed<'a>,
    /// The job's name.
    pub(super) job: String,
    /// The status the job had.
    pub(super) old: TrainingJobStatus,
    /// The status being made (written only if it differs from `old`).
    pub(super) status: TrainingJobStatus,
    pub(super) plan: Plan,
}

impl<'a> Decision<'a> {
    pub(super) fn new(obs: &'a Observed<'a>) -> Self {
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
    pub(super) fn condition(
        &mut self,
        type_: &str,
        status: bool,
        reason: &str,
        message: String,
    ) -> bool {
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
    pub(super) fn plan_if_changed(mut self) -> Plan {
        self.plan.status = (self.status != self.old).then_some(self.status);
        self.plan
    }

    /// The plan, with the new status.
    pub(super) fn plan_with_status(mut self) -> Plan {
        self.plan.status = Some(self.status);
        self.plan
    }

    /// The job's spec is invalid: it fails, saying why once.
    pub(super) fn invalid_spec(mut self, why: String) -> Plan {
        self.status.phase = Phase::Failed;
        if self.condition("Failed", true, "InvalidSpec", why.clone()) {
            self.plan.event(true, "InvalidSpec", why);
        }
        self.plan_with_status()
    }

    /// The job's state in etcd into the status and the `EtcdReachable` condition;
    /// `None` (one event) when etcd cannot be read.
    pub(super) fn etcd_state(&mut self) -> Option<&'a EtcdState> {
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
        match &p.paused {
            Some(why) => {
                let message = format!("the master paused the job: {why}");
                if self.condition("EtcdSpaceAlarm", true, "EtcdFull", message.clone()) {
                    self.plan.event(true, "EtcdSpaceAlarm", message);
                }
            }
            None if self
                .status
                .conditions
                .iter()
                .any(|c| c.type_ == "EtcdSpaceAlarm") =>
            {
                self.condition(
                    "EtcdSpaceAlarm",
                    false,
                    "Cleared",
                    "the job's etcd takes writes again".to_owned(),
                );
            }
            None => {}
        }
        self.status.pass = p.pass;
        self.status.tasks = p.tasks.clone();
        self.status.trainers.registered = p.trainers;
        self.status.pservers = p.pservers;
        self.status.leader = p.leader.clone();
        Some(p)
    }

    /// etcd says the job ended: its phase and conditions say how, and what still runs
    /// is stopped.
    pub(super) fn ended(mut self, end: &Finished) -> Plan {
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

    /// `spec.suspend` (or, `hold`, a Kueue Workload not admitted): the job drains and
    /// stays without pods. Its trainers go first (their grace period: each hands its
    /// task back); once none is left, its masters and pservers (each pserver writes a
    /// final checkpoint); a managed etcd stays, as it holds the job's state. Pods that
    /// ended are removed, not replaced. The `Suspended` condition (and one event) says
    /// so, and the pass and tasks the job had stay in the status while no master
    /// reports them.
    pub(super) fn suspended(self, hold: Hold) -> Plan {
        self.held(hold).plan_if_changed()
    }

    /// [`Decision::suspended`], the plan not yet made.
    pub(super) fn held(mut self, hold: Hold) -> Self {
        let live = |p: &&PodView| !p.terminating && !p.phase.ended();
        let trainers_left = self
            .obs
            .pods
            .iter()
            .any(|p| p.slot.role == Role::Trainer && !p.phase.ended());
        for p in self.obs.pods.iter().filter(|p| p.slot.role != Role::Etcd) {
            // A master or pserver still running waits for the trainers to drain.
            let waits = !p.phase.ended() && p.slot.role != Role::Trainer && trainers_left;
            if !p.terminating && !waits {
                self.plan.delete.push(Deletion {
                    name: p.name.clone(),
                    grace: None,
                });
            }
        }
        self.status.replacing.clear();
        if self.status.pass.is_none() {
            self.status.pass = self.old.pass;
        }
        if self.status.tasks.is_none() {
            self.status.tasks = self.old.tasks.clone();
        }
        let running = self.obs.pods.iter().filter(live).count();
        self.status.trainers.running = self
            .obs
            .pods
            .iter()
            .filter(live)
            .filter(|p| p.slot.role == Role::Trainer)
            .count() as u32;
        self.status.phase = Phase::Suspended;
        let (reason, why, until) = match &hold {
            Hold::Suspend => (
                "Suspended",
                "spec.suspend is true".to_owned(),
                "when spec.suspend is false",
            ),
            Hold::Queued { why } => ("AwaitingAdmission", why.clone(), "once Kueue admits it"),
            Hold::Evicted { why } => ("Evicted", why.clone(), "once Kueue admits it again"),
        };
        let message = if running == 0 {
            format!("{why}: the job has no pods running; it resumes where it stopped {until}")
        } else {
            format!(
                "{why}: stopping the job's pods ({running} still running; trainers drain \
                 first, then masters and pservers, which write a final checkpoint)"
            )
        };
        let changed = self.condition("Suspended", true, reason, message.clone());
        if changed && (self.old.phase != Phase::Suspended || self.old_reason() != Some(reason)) {
            self.plan.event(hold.warning(), reason, message.clone());
        }
        self.condition("Running", false, reason, message);
        self.condition("Scaling", false, reason, String::new());
        self
    }

    /// The reason of the `Suspended` condition the job had.
    fn old_reason(&self) -> Option<&str> {
        self.old
            .conditions
            .iter()
            .find(|c| c.type_ == "Suspended")
            .map(|c| c.reason.as_str())
    }

    /// A job that was suspended (or held by Kueue) and no longer is: the `Suspended`
    /// condition turns false, with one event.
    pub(super) fn resumed(&mut self) {
        if self.old.phase == Phase::Suspended {
            let message = match self.old_reason() {
                Some("AwaitingAdmission" | "Evicted") => {
                    "Kueue admitted the job's Workload: starting the job's pods".to_owned()
                }
                _ => "spec.suspend is false: starting the job's pods again".to_owned(),
            };
            self.condition("Suspended", false, "Resumed", message.clone());
            self.plan.event(false, "Resumed", message);
        }
    }

    /// The job's credentials, when the operator makes them, into the
    /// `CredentialsReady` condition; why they could not be made, if so.
    pub(super) fn credentials(&mut self) -> Option<String> {
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

    /// The job's TLS Secret into the `TLSReady` condition; why it could not be made,
    /// if so (one event).
    pub(super) fn tls(&mut self) -> Option<String> {
        match &self.obs.tls {
            JobTls::Plaintext => None,
            JobTls::Ready => {
                let message = format!(
                    "the job's pods talk over mutual TLS with the CA of Secret {}",
                    objects::tls_secret_name(&self.job)
                );
                self.condition("TLSReady", true, "Issued", message);
                None
            }
            JobTls::Failed(why) => {
                let message = format!(
                    "cannot make the job's TLS Secret: {why} (or set spec.plaintext to run \
                     the job without TLS between its pods)"
                );
                if self.condition("TLSReady", false, "TLSFailed", message.clone()) {
                    self.plan.event(true, "TLSFailed", message.clone());
                }
                Some(message)
            }
        }
    }

    /// Creates the services, the NetworkPolicy and (Volcano) the PodGroup that are
    /// missing.
    pub(super) fn services(&mut self) {
        let tj = self.obs.job;
        let group = objects::pod_group_name(&self.job);
        if tj.spec.volcano.is_some() {
            let want = objects::min_member(tj);
            match self.obs.pod_groups.get(&group) {
                None => self.plan.create_pod_groups.push(objects::pod_group(tj)),
                Some(&has) if has != want => {
                    self.plan.pod_group_min_members.push((group, want));
                }
                Some(_) => {}
            }
        }
        for s in objects::services(self.obs.job) {
            let name = s.metadata.name.clone().unwrap_or_default();
            if !self.obs.services.contains(&name) {
                self.plan.create_services.push(s);
            }
        }
        let policy = objects::network_policy(self.obs.job, &self.obs.operator_namespace);
        let name = policy.metadata.name.clone().unwrap_or_default();
        if !self.obs.network_policies.contains(&name) {
            self.plan.create_network_policies.push(policy);
        }
    }

    /// Creates the checkpoint claims that are missing; says, by the `CheckpointsDurable`
    /// condition (and a warning Event when it turns false), whether a pserver pod that
    /// is replaced finds its checkpoints.
    pub(super) fn checkpoint_volumes(&mut self) {
        let tj = self.obs.job;
        for c in objects::claims(tj) {
            let name = c.metadata.name.clone().unwrap_or_default();
            if !self.obs.claims.contains(&name) {
                self.plan.create_claims.push(c);
            }
        }
        let (durable, reason, message) = match &tj.spec.volumes.checkpoints {
            _ if tj.spec.cluster.checkpoint_dir.is_some() => (
                true,
                "ObjectStore",
                "the pservers checkpoint to the object store of spec.cluster.checkpoint_dir"
                    .to_owned(),
            ),
            None => (
                true,
                "Claims",
                format!(
                    "each pserver pod checkpoints to a claim of its own ({}-checkpoints-<slot>)",
                    self.job
                ),
            ),
            Some(v) if v.claim_name.is_some() => (
                true,
                "Claim",
                "the pservers checkpoint to the claim in spec.volumes.checkpoints".to_owned(),
            ),
            Some(v) if v.host_path.is_some() => (
                false,
                "HostPath",
                "spec.volumes.checkpoints is a host path: a pserver pod replaced on another \
                 node restores nothing; remove it to get a claim per pserver"
                    .to_owned(),
            ),
            Some(_) => (
                false,
                "EmptyDir",
                "spec.volumes.checkpoints is an emptyDir: a replaced pserver pod restores \
                 nothing and its shard starts again from its initial values; remove it to get \
                 a claim per pserver"
                    .to_owned(),
            ),
        };
        if self.condition("CheckpointsDurable", durable, reason, message.clone()) && !durable {
            self.plan.event(true, "CheckpointsNotDurable", message);
        }
    }

    /// Drains the pods of slots the job does not want (surplus trainers) and replaces
    /// the ended ones, counting restarts; why the job is crash-looping, if a pod ended
    /// too often too soon.
    pub(super) fn ended_and_surplus_pods(&mut self, desired: &[Slot]) -> Option<String> {
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
    pub(super) fn replace(&mut self, p: &PodView, what: String) {
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
    pub(super) fn crash_loop(mut self, why: String) -> Plan {
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
    pub(super) fn missing_pods(&mut self, desired: &[Slot], processes_ready: bool) {
        let tj = self.obs.job;
        let credentials = CredentialsRef::of(tj, self.obs.credentials != Credentials::NotIssued);
        let existing: BTreeSet<&str> = self.obs.pods.iter().map(|p| p.name.as_str()).collect();
        // A job resuming makes its pods as a new one does: none is a recovery.
        let was_started = !matches!(self.old.phase, Phase::Created | Phase::Suspended);
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
            let mut pod = objects::pod(tj, *slot, credentials);
            if self.obs.admission != Admission::NotQueued {
                // Admitted as a whole through the Workload: Kueue's pod integration must
                // not queue each pod again.
                if let Some(labels) = pod.metadata.labels.as_mut() {
                    labels.remove(objects::QUEUE_LABEL);
                }
            }
            self.plan.create_pods.push(pod);
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
    pub(super) fn scale(&mut self, want: u32, progress: Option<&EtcdState>) -> u32 {
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
    pub(super) fn phase_and_conditions(
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
        // `trainers` 0: the job is held without trainers, its core running.
        let held = want == 0 && core_running;
        self.status.phase = match (core_running && (running_trainers > 0 || held), scaling) {
            (true, false) => Phase::Running,
            (true, true) => Phase::Scaling,
            (false, _)
                if matches!(
                    self.old.phase,
                    Phase::Created | Phase::Pending | Phase::Suspended
                ) =>
            {
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
        } else if held {
            (
                false,
                "NoTrainers".to_owned(),
                "spec.cluster.trainers is 0: the job is held without trainers, its \
                 masters and pservers keeping its state; it goes on when trainers are \
                 asked for (edl's autoscaler holds a job so to make room for one worth \
                 more: docs/autoscaler.md)"
                    .to_owned(),
            )
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
    pub(super) fn core_running(&self, desired: &[Slot]) -> bool {
        let by_name: BTreeMap<&str, &PodView> =
            self.obs.pods.iter().map(|p| (p.name.as_str(), p)).collect();
        desired.iter().filter(|s| s.role != Role::Trainer).all(|s| {
            by_name
                .get(s.pod_name(&self.job).as_str())
                .is_some_and(|p| p.phase == PodPhase::Running && !p.terminating)
        })
    }

    /// The first problem of a live pod that keeps it from running: `(reason, message)`.
    pub(super) fn first_problem(&self) -> Option<(String, String)> {
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
