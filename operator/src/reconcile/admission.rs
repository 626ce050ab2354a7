//! Admission by other systems: Kueue's Workload (held, evicted, released, finished)
//! and Volcano's PodGroup (minMember).

use super::draft::Draft;
use super::suspension::Hold;
use super::{Admission, Plan, WorkloadChange};
use crate::objects::{self, Role, Slot};

impl Draft<'_> {
    /// The job waits for its Workload's admission (made now if it is not there), or was
    /// evicted: it is held without pods as a suspended job is. Evicted, once it has no
    /// pods left (its managed etcd aside), it gives its quota back so that Kueue queues
    /// it again.
    pub(super) fn awaiting_admission(mut self) -> Plan {
        let tj = self.obs.job;
        let name = objects::workload_name(&self.job);
        let queue = objects::queue_name(tj).unwrap_or_default();
        let waiting = || Hold::Queued {
            why: format!("waiting for Kueue to admit Workload {name} (LocalQueue {queue})"),
        };
        let hold = match &self.obs.admission {
            Admission::NoWorkload => {
                self.plan.workload = Some(WorkloadChange::Create(Box::new(objects::workload(tj))));
                waiting()
            }
            Admission::Unplaced(why) => Hold::Queued {
                why: format!("Kueue admitted Workload {name} (LocalQueue {queue}), but {why}"),
            },
            Admission::Evicted(why) => Hold::Evicted {
                why: format!("Kueue evicted Workload {name}: {why}"),
            },
            _ => waiting(),
        };
        let evicted = matches!(hold, Hold::Evicted { .. });
        let mut d = self.held(hold);
        let stopped = !d.obs.pods.iter().any(|p| p.slot.role != Role::Etcd);
        if evicted && stopped {
            d.plan.workload = Some(WorkloadChange::Release(
                "the job stopped after its eviction: queued again".to_owned(),
            ));
        }
        d.plan_if_changed()
    }

    /// The admitted job's Workload says whether every pod it wants (`desired`) runs
    /// (`PodsReady`, which Kueue's wait-for-pods-ready reads: a job whose pods do not
    /// come up in its timeout is evicted and queued again), written when that changes.
    pub(super) fn pods_ready(&mut self, desired: &[Slot]) {
        let Admission::Admitted { pods_ready, .. } = &self.obs.admission else {
            return;
        };
        let running = |slot: &Slot| {
            self.obs
                .pods
                .iter()
                .any(|p| p.slot == *slot && p.phase == super::PodPhase::Running && !p.terminating)
        };
        let ready = desired.iter().all(running);
        if *pods_ready != Some(ready) && self.plan.workload.is_none() {
            self.plan.workload = Some(WorkloadChange::PodsReady(ready));
        }
    }

    /// The job ended: its Workload, if Kueue has it and it is not marked yet, is marked
    /// finished.
    pub(super) fn finish_workload(&mut self) {
        if matches!(
            self.obs.admission,
            Admission::Pending
                | Admission::Admitted { .. }
                | Admission::Unplaced(_)
                | Admission::Evicted(_)
        ) {
            self.plan.workload = Some(WorkloadChange::Finish(format!(
                "TrainingJob {} ended",
                self.job
            )));
        }
    }

    /// Creates the job's Volcano PodGroup when it asks for Volcano and has none, or sets
    /// its `minMember` (and `minResources`) when it changed.
    pub(super) fn pod_group(&mut self) {
        let tj = self.obs.job;
        let group = objects::pod_group_name(&self.job);
        if tj.spec.volcano.is_some() {
            let want = objects::min_member(tj);
            match self.obs.pod_groups.get(&group) {
                None => self.plan.create_pod_groups.push(objects::pod_group(tj)),
                Some(&has) if has != want => {
                    let resources = objects::min_resources(tj);
                    self.plan
                        .pod_group_min_members
                        .push((group, want, resources));
                }
                Some(_) => {}
            }
        }
    }
}

/// `desired` with at most `admitted` trainers (Kueue's partial admission admits no
/// fewer than `min_trainers`).
pub(super) fn within_admission(mut desired: Vec<Slot>, admitted: u32) -> Vec<Slot> {
    desired.retain(|s| s.role != Role::Trainer || s.index < admitted);
    desired
}
