//! A job's Volcano PodGroup (`scheduling.volcano.sh/v1beta1`), made when the job asks
//! for Volcano (`spec.volcano`): Volcano's scheduler binds the job's pods only when the
//! job at its smallest fits at once (gang scheduling), so a job never holds half its
//! pods while waiting for the rest; trainers beyond `min_trainers` are placed as room
//! allows, as an elastic job grows. The pods name the scheduler and the group. The
//! group's `minMember` follows the job: a job held at 0 trainers counts none.

use serde_json::{Value, json};

use super::{Role, desired_slots, meta};
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

/// The PodGroup of `tj` (which asks for Volcano), owned by `tj`.
pub fn pod_group(tj: &TrainingJob) -> Value {
    let job = tj.metadata.name.clone().unwrap_or_default();
    let mut spec = json!({"minMember": min_member(tj)});
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
