//! The phase and the Running/Scaling conditions, from the core, the trainers running
//! and the first pod problem.

use std::collections::BTreeMap;

use super::draft::Draft;
use super::{PodPhase, PodView};
use crate::crd::Phase;
use crate::objects::{Role, Slot};

impl Draft<'_> {
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
