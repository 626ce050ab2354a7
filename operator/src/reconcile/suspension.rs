//! A held job (spec.suspend, or Kueue not admitting it): trainers drain first, then
//! masters and pservers. Resumed with one event.

use super::draft::Draft;
use super::{Deletion, Plan, PodView};
use crate::crd::Phase;
use crate::objects::Role;

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

impl Draft<'_> {
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

    /// [`Draft::suspended`], the plan not yet made.
    pub(super) fn held(mut self, hold: Hold) -> Self {
        let live = |p: &&PodView| !p.terminating && !p.phase.ended();
        // A trainer lost with its node drains nothing: none waits for it.
        let trainers_left = self.obs.pods.iter().any(|p| {
            p.slot.role == Role::Trainer && !p.phase.ended() && self.lost_with_node(p).is_none()
        });
        for p in self.obs.pods.iter().filter(|p| p.slot.role != Role::Etcd) {
            if self.lost_with_node(p).is_some() {
                // Its node would never confirm a graceful end: it goes at once.
                self.plan.delete.push(Deletion {
                    name: p.name.clone(),
                    grace: Some(0),
                });
                continue;
            }
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
}
