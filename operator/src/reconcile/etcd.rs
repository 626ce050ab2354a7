//! The job's state in etcd into the status: EtcdReachable, and the master's pause
//! (EtcdSpaceAlarm); the managed etcd's members whose claim is lost (EtcdMembersWhole).

use super::draft::Draft;
use super::{EtcdAction, EtcdState};
use crate::objects::{self, Role, Slot};

impl<'a> Draft<'a> {
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
        // The master's progress; the last known while no master answers (a failover).
        if p.tasks.is_some() {
            self.status.pass = p.pass;
            self.status.tasks = p.tasks.clone();
        }
        self.status.trainers.registered = p.trainers;
        self.status.pservers = p.pservers;
        self.status.leader = p.leader.clone();
        Some(p)
    }

    /// The managed etcd's members whose claim is lost: once the etcd has formed, a
    /// member's claim that is gone means its data is, and the member must not come back
    /// under its old identity (it would have forgotten what it acknowledged). While the
    /// etcd answers, the member is replaced in its membership ([`EtcdAction::ReplaceMember`]:
    /// the started one removed, a new one added at its URL) before its claim and pod are
    /// made again, where it joins the others and gets their data. While the etcd does not
    /// answer, such a member waits: its claim and pod are not made (a member on an
    /// empty claim must never bootstrap a cluster of its own), and the returned pod
    /// names are held back ([`Draft::held`]). Said by `EtcdMembersWhole` (present once a
    /// member was lost) and a Warning Event.
    pub(super) fn lost_members(&mut self) {
        let tj = self.obs.job;
        if !tj.spec.etcd.managed {
            return;
        }
        if self.obs.etcd_members.is_some() {
            self.status.etcd_formed = true;
        }
        if !self.old.etcd_formed {
            return;
        }
        let mut replaced = Vec::new();
        let mut waiting = Vec::new();
        for i in 0..tj.spec.etcd.members.max(1) {
            let claim = objects::etcd_claim_name(&self.job, i);
            if self.obs.claims.contains(&claim) {
                continue;
            }
            let pod = Slot {
                role: Role::Etcd,
                index: i,
            }
            .pod_name(&self.job);
            let url = objects::etcd_peer_url(tj, i);
            match &self.obs.etcd_members {
                Some(members) => {
                    let started_there = members
                        .iter()
                        .any(|m| m.started() && m.peer_urls.contains(&url));
                    let added = members.iter().any(|m| m.peer_urls.contains(&url));
                    if started_there || !added {
                        self.plan.etcd.push(EtcdAction::ReplaceMember(url));
                        replaced.push(pod);
                    }
                    // Its new claim (a finished job's claims are made nowhere else).
                    let planned = self
                        .plan
                        .create_claims
                        .iter()
                        .any(|c| c.metadata.name.as_deref() == Some(claim.as_str()));
                    if !planned {
                        self.plan.create_claims.extend(
                            objects::etcd_claims(tj)
                                .into_iter()
                                .filter(|c| c.metadata.name.as_deref() == Some(claim.as_str())),
                        );
                    }
                }
                None => {
                    self.plan
                        .create_claims
                        .retain(|c| c.metadata.name.as_deref() != Some(claim.as_str()));
                    waiting.push(pod.clone());
                    self.held.insert(pod);
                }
            }
        }
        if !replaced.is_empty() {
            let message = format!(
                "the claim of etcd member {} is gone, and its data with it: replaced in the \
                 etcd's membership, it joins the others on a new claim and gets their data",
                replaced.join(", ")
            );
            self.condition("EtcdMembersWhole", false, "MemberReplaced", message.clone());
            self.plan.event(true, "EtcdMemberReplaced", message);
        } else if !waiting.is_empty() {
            let message = format!(
                "the claim of etcd member {} is gone, and its data with it; the etcd does not \
                 answer, so it cannot be replaced in the membership yet: it waits (a member on \
                 an empty claim must not start a cluster of its own)",
                waiting.join(", ")
            );
            if self.condition("EtcdMembersWhole", false, "MemberLost", message.clone()) {
                self.plan.event(true, "EtcdMemberLost", message);
            }
        } else if self
            .status
            .conditions
            .iter()
            .any(|c| c.type_ == "EtcdMembersWhole" && c.status == "False")
        {
            self.condition(
                "EtcdMembersWhole",
                true,
                "Whole",
                "every member of the managed etcd has its claim".to_owned(),
            );
        }
    }
}
