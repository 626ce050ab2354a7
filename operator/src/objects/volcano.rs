//! A job's Volcano PodGroup (`scheduling.volcano.sh/v1beta1`), made when the job asks
//! for Volcano (`spec.volcano`): Volcano's scheduler binds the job's pods only when the
//! job at its smallest fits at once (gang scheduling), so a job never holds half its
//! pods while waiting for the rest; trainers beyond `min_trainers` are placed as room
//! allows, as an elastic job grows. The pods name the scheduler and the group. The
//! group's `minMember` follows the job: a job held at 0 trainers counts none; its
//! `minResources` is what those pods request together, so Volcano's queues count the
//! job at its smallest before any pod is bound.

use serde_json::{Value, json};

use super::{Role, desired_slots, meta, with_requests};
use crate::crd::TrainingJob;

/// Volcano's PodGroup API: group, version, kind, plural.
pub const POD_GROUP_API: [&str; 4] = ["scheduling.volcano.sh", "v1beta1", "PodGroup", "podgroups"];

/// The scheduler a Volcano job's pods name.
pub const VOLCANO_SCHEDULER: &str = "volcano";

/// The annotation naming a pod's PodGroup.
pub const POD_GROUP_ANNOTATION: &str = "scheduling.k8s.io/group-name";

/// The name of `job`'s PodGroup: `<job>`.
pub fn pod_group_name(job: &str) -> String {
    job.to_owned()
}

/// The pods of `tj` at its smallest: every slot but the trainers beyond `min_trainers`
/// (none while the job is held at 0 trainers, so that a pod it replaces then is not
/// kept waiting for trainers it does not want).
pub fn min_member(tj: &TrainingJob) -> u32 {
    let c = &tj.spec.cluster;
    let others = desired_slots(tj)
        .iter()
        .filter(|s| s.role != Role::Trainer)
        .count() as u32;
    others + c.min_trainers.min(c.trainers)
}

/// What the pods of `tj` at its smallest ([`min_member`]) request together: `cpu`,
/// `memory` and `nvidia.com/gpu` (each role's requests: [`super::with_requests`]).
pub fn min_resources(tj: &TrainingJob) -> Value {
    let c = &tj.spec.cluster;
    let r = &tj.spec.resources;
    let mut total = edl_autoscaler::Resources::ZERO;
    for slot in desired_slots(tj) {
        if slot.role == Role::Trainer && slot.index >= c.min_trainers.min(c.trainers) {
            continue;
        }
        let given = match slot.role {
            Role::Etcd => &r.etcd,
            Role::Master => &r.master,
            Role::Pserver => &r.pserver,
            Role::Trainer => &r.trainer,
        };
        let requests = with_requests(slot.role, given.clone())
            .requests
            .unwrap_or_default();
        total += crate::autoscale::resources_of(&requests);
    }
    let mut out = json!({
        "cpu": format!("{}m", total.cpu_milli),
        "memory": format!("{}Mi", total.mem_mib),
    });
    if total.gpu > 0 {
        out["nvidia.com/gpu"] = json!(total.gpu.to_string());
    }
    out
}

/// The PodGroup of `tj` (which asks for Volcano), owned by `tj`.
pub fn pod_group(tj: &TrainingJob) -> Value {
    let job = tj.metadata.name.clone().unwrap_or_default();
    let mut spec = json!({"minMember": min_member(tj), "minResources": min_resources(tj)});
    if let Some(q) = tj.spec.volcano.as_ref().and_then(|v| v.queue.as_ref()) {
        spec["queue"] = json!(q);
    }
    if let Some(p) = &tj.spec.priority_class_name {
        spec["priorityClassName"] = json!(p);
    }
    let [group, version, kind, _] = POD_GROUP_API;
    json!({
        "apiVersion": format!("{group}/{version}"),
        "kind": kind,
        "metadata": meta(tj, pod_group_name(&job), None),
        "spec": spec,
    })
}
