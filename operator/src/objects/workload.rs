//! A job's Kueue `Workload` (`kueue.x-k8s.io/v1beta1`), made when the operator admits
//! jobs through Kueue (`--kueue`) and the job names a LocalQueue: one pod set per role
//! (the managed etcd's members, masters, pservers, trainers), each with the pod template
//! of its first slot, so that Kueue reserves quota for the whole job before any pod
//! exists; the trainers' `minCount` (`min_trainers`) lets Kueue admit fewer trainers
//! when no more fit (partial admission). Kueue has no integration of its own for the
//! TrainingJob kind: the operator plays the part its job framework plays for the kinds
//! it knows (makes the Workload, runs the job only while it is admitted, stops it on an
//! eviction and then gives the quota back, marks it finished).

use std::collections::BTreeMap;

use serde_json::{Value, json};

use super::{CredentialsRef, QUEUE_LABEL, Role, Slot, desired_slots, meta, pod};
use crate::crd::TrainingJob;

/// Kueue's Workload API: group, version, kind, plural.
pub const WORKLOAD_API: [&str; 4] = ["kueue.x-k8s.io", "v1beta1", "Workload", "workloads"];

/// Kueue's ResourceFlavor API (cluster-wide): group, version, kind, plural.
pub const FLAVOR_API: [&str; 4] = [
    "kueue.x-k8s.io",
    "v1beta1",
    "ResourceFlavor",
    "resourceflavors",
];

/// The flavors Kueue admitted each pod set with (`status.admission.podSetAssignments[]
/// .flavors`, resource to flavor): pod set (a role's name) to its flavors' names, each
/// once, in order.
pub fn admitted_flavors(w: &Value) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for a in w["status"]["admission"]["podSetAssignments"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let Some(set) = a["name"].as_str() else {
            continue;
        };
        let names = out.entry(set.to_owned()).or_default();
        for flavor in a["flavors"]
            .as_object()
            .into_iter()
            .flat_map(|m| m.values())
            .filter_map(Value::as_str)
        {
            if !names.iter().any(|n| n == flavor) {
                names.push(flavor.to_owned());
            }
        }
    }
    out
}

/// Where a ResourceFlavor puts the pods admitted with it: its `spec.nodeLabels` (as a
/// node selector) and `spec.tolerations`. `Err` names what does not read.
pub fn flavor_placement(flavor: &Value) -> Result<FlavorPlacement, String> {
    let name = flavor["metadata"]["name"].as_str().unwrap_or("?");
    let node_selector = match &flavor["spec"]["nodeLabels"] {
        Value::Null => BTreeMap::new(),
        v => serde_json::from_value(v.clone())
            .map_err(|e| format!("ResourceFlavor {name} spec.nodeLabels: {e}"))?,
    };
    let tolerations = match &flavor["spec"]["tolerations"] {
        Value::Null => Vec::new(),
        v => serde_json::from_value(v.clone())
            .map_err(|e| format!("ResourceFlavor {name} spec.tolerations: {e}"))?,
    };
    Ok(FlavorPlacement {
        node_selector,
        tolerations,
    })
}

/// What Kueue's admission adds to the pods of a pod set: the node labels and
/// tolerations of the flavors it was admitted with.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FlavorPlacement {
    /// Node labels a pod must run on (added to its node selector, over the job's).
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations (added to the job's).
    pub tolerations: Vec<k8s_openapi::api::core::v1::Toleration>,
}

impl FlavorPlacement {
    /// This one with `other`'s added (a pod set admitted with several flavors).
    pub fn and(mut self, other: FlavorPlacement) -> FlavorPlacement {
        self.node_selector.extend(other.node_selector);
        for t in other.tolerations {
            if !self.tolerations.contains(&t) {
                self.tolerations.push(t);
            }
        }
        self
    }

    /// Adds this placement to `pod`'s spec.
    pub fn apply(&self, pod: &mut k8s_openapi::api::core::v1::Pod) {
        let Some(spec) = pod.spec.as_mut() else {
            return;
        };
        if !self.node_selector.is_empty() {
            spec.node_selector
                .get_or_insert_with(BTreeMap::new)
                .extend(self.node_selector.clone());
        }
        if !self.tolerations.is_empty() {
            let own = spec.tolerations.get_or_insert_with(Vec::new);
            for t in &self.tolerations {
                if !own.contains(t) {
                    own.push(t.clone());
                }
            }
        }
    }
}

/// The name of `job`'s Workload: `trainingjob-<job>`, as Kueue names a job's.
pub fn workload_name(job: &str) -> String {
    format!("trainingjob-{job}")
}

/// The LocalQueue `tj` names (label `kueue.x-k8s.io/queue-name`), if any.
pub fn queue_name(tj: &TrainingJob) -> Option<&str> {
    tj.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(QUEUE_LABEL))
        .map(String::as_str)
}

/// The Workload of `tj` (which names a queue), owned by `tj`.
pub fn workload(tj: &TrainingJob) -> Value {
    let job = tj.metadata.name.clone().unwrap_or_default();
    let slots = desired_slots(tj);
    let c = &tj.spec.cluster;
    let pod_sets: Vec<Value> = [Role::Etcd, Role::Master, Role::Pserver, Role::Trainer]
        .into_iter()
        .filter_map(|role| {
            let count = slots.iter().filter(|s| s.role == role).count();
            let first = pod(tj, Slot { role, index: 0 }, CredentialsRef::of(tj, false));
            let mut set = json!({
                "name": role.name(),
                "count": count,
                "template": {
                    "metadata": {"labels": first.metadata.labels},
                    "spec": first.spec,
                },
            });
            if role == Role::Trainer && c.min_trainers < count as u32 {
                set["minCount"] = json!(c.min_trainers);
            }
            (count > 0).then_some(set)
        })
        .collect();
    let mut spec = json!({
        "queueName": queue_name(tj).unwrap_or_default(),
        "podSets": pod_sets,
    });
    if let Some(p) = &tj.spec.priority_class_name {
        spec["priorityClassName"] = json!(p);
        spec["priorityClassSource"] = json!("scheduling.k8s.io/priorityclass");
    }
    let [group, version, kind, _] = WORKLOAD_API;
    json!({
        "apiVersion": format!("{group}/{version}"),
        "kind": kind,
        "metadata": meta(tj, workload_name(&job), None),
        "spec": spec,
    })
}

/// How far Kueue got with a Workload, read from it as found (`None`: not there).
#[derive(Debug, Clone, PartialEq)]
pub enum WorkloadState {
    /// Not admitted (no quota reserved, or admission checks pending).
    Pending,
    /// Admitted, with the trainers admitted (`podSetAssignments`) and its `PodsReady`
    /// condition, if it has one.
    Admitted(Option<u32>, Option<bool>),
    /// Admitted, then evicted: Kueue's message.
    Evicted(String),
    /// Marked finished.
    Finished,
}

fn condition<'a>(w: &'a Value, type_: &str) -> Option<&'a Value> {
    w["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

fn is_true(w: &Value, type_: &str) -> bool {
    condition(w, type_).is_some_and(|c| c["status"] == "True")
}

/// The state of Workload `w`.
pub fn workload_state(w: &Value) -> WorkloadState {
    let admission = &w["status"]["admission"];
    if is_true(w, "Finished") {
        WorkloadState::Finished
    } else if admission.is_null() {
        WorkloadState::Pending
    } else if is_true(w, "Evicted") {
        let why = condition(w, "Evicted")
            .and_then(|c| c["message"].as_str().or(c["reason"].as_str()))
            .unwrap_or("evicted");
        WorkloadState::Evicted(why.to_owned())
    } else if is_true(w, "Admitted") {
        let pods_ready = condition(w, "PodsReady").map(|c| c["status"] == "True");
        let trainers = admission["podSetAssignments"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|a| a["name"] == Role::Trainer.name())
            .and_then(|a| a["count"].as_u64())
            .and_then(|n| u32::try_from(n).ok());
        WorkloadState::Admitted(trainers, pods_ready)
    } else {
        WorkloadState::Pending
    }
}

/// Sets condition `type_` in Workload `w`'s status (keeping its transition time when its
/// status stays), as of `now` (RFC 3339).
pub fn set_workload_condition(
    w: &mut Value,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    now: &str,
) {
    let status = if status { "True" } else { "False" };
    if !w["status"].is_object() {
        w["status"] = json!({});
    }
    if !w["status"]["conditions"].is_array() {
        w["status"]["conditions"] = json!([]);
    }
    let conditions = w["status"]["conditions"]
        .as_array_mut()
        .expect("made an array above");
    let time = conditions
        .iter()
        .find(|c| c["type"] == type_ && c["status"] == status)
        .map_or_else(|| json!(now), |c| c["lastTransitionTime"].clone());
    conditions.retain(|c| c["type"] != type_);
    conditions.push(json!({
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": time,
    }));
}

/// Workload `w` with its admission cleared after the job stopped on an eviction: no
/// quota reserved (`QuotaReserved` and `Admitted` False), so that Kueue queues it again.
pub fn released_workload(mut w: Value, why: &str, now: &str) -> Value {
    if let Some(status) = w["status"].as_object_mut() {
        status.remove("admission");
    }
    set_workload_condition(&mut w, "QuotaReserved", false, "Pending", why, now);
    set_workload_condition(&mut w, "Admitted", false, "NoReservation", why, now);
    w
}

/// Workload `w` marked finished (Kueue frees its quota).
pub fn finished_workload(mut w: Value, message: &str, now: &str) -> Value {
    set_workload_condition(&mut w, "Finished", true, "JobFinished", message, now);
    w
}
