//! One decision under way: the observation, the status the job had and the one being
//! made, and the plan so far. Conditions keep their transition time when their status
//! holds.

use std::collections::BTreeSet;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use super::{Observed, Plan};
use crate::crd::TrainingJobStatus;
use crate::objects::{self, Role};

/// One decision under way: the observation, the status it had and the one being made,
/// and the plan so far.
pub(super) struct Draft<'a> {
    pub(super) obs: &'a Observed<'a>,
    /// The job's name.
    pub(super) job: String,
    /// The status the job had.
    pub(super) old: TrainingJobStatus,
    /// The status being made (written only if it differs from `old`).
    pub(super) status: TrainingJobStatus,
    pub(super) plan: Plan,
    /// Pods not to be made this round ([`Draft::lost_members`]: a managed etcd's member
    /// whose claim is lost while the etcd does not answer).
    pub(super) held: BTreeSet<String>,
}

impl<'a> Draft<'a> {
    pub(super) fn new(obs: &'a Observed<'a>) -> Self {
        let tj = obs.job;
        let job = tj.metadata.name.clone().unwrap_or_default();
        let old = tj.status.clone().unwrap_or_default();
        let mut status = old.clone();
        status.observed_generation = tj.metadata.generation;
        status.selector = objects::selector(&job, Role::Trainer);
        status.etcd_job = Some(objects::etcd_job(tj));
        Draft {
            obs,
            job,
            old,
            status,
            plan: Plan::default(),
            held: BTreeSet::new(),
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
