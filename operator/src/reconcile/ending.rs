//! A job that is over: being deleted (keys, then user, then finalizer), invalid, ended
//! in etcd. What still runs is stopped, except a managed etcd.

use super::draft::Draft;
use super::{Deletion, EtcdAction, FINALIZER, FinalizerChange, Finished, Plan, PodView};
use crate::crd::{Phase, TrainingJob};
use crate::objects::Role;

impl Draft<'_> {
    /// The job's spec is invalid: it fails, saying why once.
    pub(super) fn invalid_spec(mut self, why: String) -> Plan {
        self.status.phase = Phase::Failed;
        if self.condition("Failed", true, "InvalidSpec", why.clone()) {
            self.plan.event(true, "InvalidSpec", why);
        }
        self.plan_with_status()
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
}

pub(super) fn has_finalizer(tj: &TrainingJob) -> bool {
    tj.metadata
        .finalizers
        .as_ref()
        .is_some_and(|f| f.iter().any(|x| x == FINALIZER))
}

/// The plan for a job being deleted: remove its keys, then let it go. Its pods go
/// with it (owner references).
pub(super) fn being_deleted(tj: &TrainingJob) -> Plan {
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

/// Deletes (gracefully) every pod of `pods` that still runs but the managed etcd's: the
/// job is over. The etcd keeps the job's final state (its status, its checkpoints'
/// manifests, the pservers' final commits) until the job is deleted.
pub(super) fn stop_running(plan: &mut Plan, pods: &[PodView]) {
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
