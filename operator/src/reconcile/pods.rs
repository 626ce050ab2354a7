//! Surplus pods drained, ended ones replaced (restart counts, crash loop), missing ones
//! created (recoveries).

use std::collections::BTreeSet;

use super::draft::Draft;
use super::ending::stop_running;
use super::{Admission, Deletion, EtcdAction, JobCredentials, Plan, PodPhase, PodView};
use crate::crd::{Phase, RECENT_RECOVERIES, Recovery};
use crate::objects::{self, CredentialsRef, Role, Slot};

impl Draft<'_> {
    /// Drains the pods of slots the job does not want (surplus trainers) and replaces
    /// the ended ones, counting restarts, and those lost with their node; why the job
    /// is crash-looping, if a pod ended too often too soon.
    pub(super) fn ended_and_surplus_pods(&mut self, desired: &[Slot]) -> Option<String> {
        let wanted: BTreeSet<Slot> = desired.iter().copied().collect();
        let cluster = &self.obs.job.spec.cluster;
        let (healthy_after, max_restarts) = (cluster.healthy_after, cluster.max_restarts);
        let mut crash_loop: Option<String> = None;
        for p in self.obs.pods.iter() {
            if let Some(what) = self.lost_with_node(p) {
                if wanted.contains(&p.slot) {
                    self.replace(p, what);
                } else {
                    // Surplus: gone for good, without waiting for its node.
                    self.plan.delete.push(Deletion {
                        name: p.name.clone(),
                        grace: Some(0),
                    });
                }
                continue;
            }
            if p.terminating {
                continue;
            }
            if !wanted.contains(&p.slot) {
                // A trainer beyond the desired count (or a slot the spec no longer has):
                // SIGTERM, so it drains.
                self.plan.delete.push(Deletion {
                    name: p.name.clone(),
                    grace: None,
                });
                continue;
            }
            if let Some(what) = self.stuck(p) {
                // Alive but stuck: its task is already handed out again. Its leases go
                // and it is deleted at once, to be made again (not counted against
                // max_restarts: a running pod does not say how long it ran).
                self.revoke_leases_of(p);
                self.replace(p, what);
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
            self.revoke_leases_of_ended(p);
            self.replace(p, what);
        }
        crash_loop
    }

    /// A job pod whose container ended (the kubelet saw its process exit): the leases
    /// its process held are revoked before it is replaced, so that the master hands a
    /// trainer's tasks out again, a pserver's shard is claimed again or its replica
    /// replaced, or a standby master leads, at once instead of a lease TTL later. Only
    /// for a process known dead: a pod lost with its node may still run there, and its
    /// lease decides; and only while etcd answers (else the lease ends by itself
    /// meanwhile).
    fn revoke_leases_of_ended(&mut self, p: &PodView) {
        if p.phase.ended() {
            self.revoke_leases_of(p);
        }
    }

    /// Revokes the leases of pod `p`'s process (while etcd answers): a trainer's by its
    /// id, a pserver's or master's by its [instance](edl_job::env::INSTANCE), each its
    /// pod's incarnation.
    fn revoke_leases_of(&mut self, p: &PodView) {
        use edl_job::holders::Holder;
        let (Some(id), true) = (incarnation(p), self.obs.etcd.is_ok()) else {
            return;
        };
        let holder = match p.slot.role {
            Role::Trainer => Holder::Trainer { id },
            Role::Pserver => Holder::Pserver {
                pid: None,
                addr: None,
                instance: Some(id),
            },
            Role::Master => Holder::Master {
                addr: None,
                instance: Some(id),
            },
            Role::Etcd => return,
        };
        self.plan.etcd.push(EtcdAction::Revoke(holder));
    }

    /// Why trainer pod `p`, still running, is stuck, when the master names its trainer
    /// stuck: a task lease timed out while it stayed registered.
    fn stuck(&self, p: &PodView) -> Option<String> {
        if p.slot.role != Role::Trainer || p.phase.ended() {
            return None;
        }
        let id = incarnation(p)?;
        let etcd = self.obs.etcd.as_ref().ok()?;
        let s = etcd.stuck.iter().find(|s| s.trainer == id)?;
        Some(format!(
            "stuck: no report on its task {} for {:.1}s (the task timeout); its task was \
             handed out again",
            s.task, s.held_s
        ))
    }

    /// Why `p` is lost with its node, when its node has not been Ready for
    /// [`Observed::node_lost_after`](super::Observed::node_lost_after) or longer: a
    /// pod there may never end by itself (its node's kubelet cannot confirm it), and
    /// the cluster evicts it only after its own toleration, so it is deleted at once
    /// (grace 0) and made again where the scheduler puts it. A pod whose process still
    /// runs on a node cut off from the cluster is fenced by etcd (its lease, its
    /// incarnation), as any duplicate is.
    pub(super) fn lost_with_node(&self, p: &PodView) -> Option<String> {
        let node = p.node.as_deref()?;
        let since = self.obs.lost_nodes.get(node)?;
        let secs = self.obs.now.0.as_second() - since.0.as_second();
        let bound = self.obs.node_lost_after;
        (secs >= 0 && secs as u64 >= bound.as_secs()).then(|| {
            format!(
                "lost with node {node} (not Ready for {}, over the operator's \
                 --node-lost-after {})",
                humantime::format_duration(std::time::Duration::from_secs(secs as u64)),
                humantime::format_duration(bound)
            )
        })
    }

    /// A finished job's managed etcd holds its final state (status, checkpoints'
    /// manifests, ledgers) until the job is deleted: an ended member (killed by its
    /// liveness probe, say) is replaced, and a missing one made again, on its claim.
    pub(super) fn keep_managed_etcd(&mut self, desired: &[Slot]) {
        if !self.obs.job.spec.etcd.managed {
            return;
        }
        let etcd_pods: Vec<PodView> = self
            .obs
            .pods
            .iter()
            .filter(|p| p.slot.role == Role::Etcd)
            .cloned()
            .collect();
        for p in &etcd_pods {
            if let Some(what) = self.lost_with_node(p) {
                self.replace(p, what);
            } else if !p.terminating && p.phase.ended() {
                self.replace(p, describe_end(p));
            }
        }
        let members: Vec<Slot> = desired
            .iter()
            .filter(|s| s.role == Role::Etcd)
            .copied()
            .collect();
        self.missing_pods(&members, false);
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
        let credentials = CredentialsRef::of(tj, self.obs.credentials != JobCredentials::NotIssued);
        let existing: BTreeSet<&str> = self.obs.pods.iter().map(|p| p.name.as_str()).collect();
        // A job resuming makes its pods as a new one does: none is a recovery.
        let was_started = !matches!(self.old.phase, Phase::Created | Phase::Suspended);
        for slot in desired {
            let name = slot.pod_name(&self.job);
            if existing.contains(name.as_str()) {
                continue;
            }
            if (slot.role != Role::Etcd && !processes_ready) || self.held.contains(&name) {
                continue;
            }
            let mut pod = objects::pod(tj, *slot, credentials);
            // A claim being deleted goes once no pod mounts it: the pod waits for its
            // new one (a lost etcd member's is [`Draft::lost_members`]'s to replace).
            let mounts_going = pod
                .spec
                .iter()
                .flat_map(|s| s.volumes.iter().flatten())
                .filter_map(|v| v.persistent_volume_claim.as_ref())
                .any(|c| self.obs.claims_going.contains(&c.claim_name));
            if mounts_going {
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
            if self.obs.admission != Admission::NotQueued {
                // Admitted as a whole through the Workload: Kueue's pod integration must
                // not queue each pod again.
                objects::admitted_through_workload(&mut pod);
            }
            // Placed where the flavors it was admitted with say.
            if let Admission::Admitted { placement, .. } = &self.obs.admission
                && let Some(p) = placement.get(slot.role.name())
            {
                p.apply(&mut pod);
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
}

/// A trainer pod's trainer id, as its environment makes it (`objects`: `<pod>.<uid>`).
/// Pod `p`'s incarnation ([`objects::INCARNATION`]): a trainer's id, a pserver's or
/// master's instance.
fn incarnation(p: &PodView) -> Option<String> {
    Some(format!("{}.{}", p.name, p.uid.as_ref()?))
}

fn describe_end(p: &PodView) -> String {
    match (p.phase, p.exit_code) {
        (PodPhase::Succeeded, _) => "exited 0 before the job ended".to_owned(),
        (_, Some(code)) => format!("failed: exit code {code}"),
        _ => "failed".to_owned(),
    }
}
