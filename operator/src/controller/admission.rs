//! The job's admission objects of other systems, which edl has no types for: Kueue's
//! Workload (read and written as JSON) and Volcano's PodGroup API.

use std::collections::BTreeMap;

use kube::api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use super::{Ctx, Error, kube_err};
use crate::crd::TrainingJob;
use crate::objects::{self, WorkloadState};
use crate::reconcile::{Admission, WorkloadChange};

/// The API of Kueue's Workloads in `ns`.
pub(super) fn workloads_api(ctx: &Ctx, ns: &str) -> Api<DynamicObject> {
    dynamic(&ctx.client, ns, objects::WORKLOAD_API)
}

/// The API in `ns` of a kind edl has no types for: group, version, kind, plural.
pub(super) fn dynamic(client: &Client, ns: &str, api: [&str; 4]) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &resource(api))
}

/// A kind edl has no types for: group, version, kind, plural.
fn resource([group, version, kind, plural]: [&str; 4]) -> ApiResource {
    ApiResource {
        group: group.to_owned(),
        version: version.to_owned(),
        api_version: format!("{group}/{version}"),
        kind: kind.to_owned(),
        plural: plural.to_owned(),
    }
}

/// `tj`'s Kueue Workload, when the operator admits jobs through Kueue and `tj` names a
/// queue.
pub(super) async fn observe_workload(
    ctx: &Ctx,
    tj: &TrainingJob,
    ns: &str,
) -> Result<Admission, Error> {
    if !ctx.config.kueue || objects::queue_name(tj).is_none() {
        return Ok(Admission::NotQueued);
    }
    let name = objects::workload_name(&tj.name_any());
    let found = workloads_api(ctx, ns)
        .get_opt(&name)
        .await
        .map_err(kube_err(format!("read Workload {name}")))?;
    let Some(w) = found else {
        return Ok(Admission::NoWorkload);
    };
    let value = serde_json::to_value(&w).unwrap_or_default();
    Ok(match objects::workload_state(&value) {
        WorkloadState::Pending => Admission::Pending,
        WorkloadState::Admitted(trainers, pods_ready) => match flavors(ctx, &value).await {
            Ok(placement) => Admission::Admitted {
                trainers,
                placement,
                pods_ready,
            },
            Err(why) => Admission::Unplaced(why),
        },
        WorkloadState::Evicted(why) => Admission::Evicted(why),
        WorkloadState::Finished => Admission::Finished,
    })
}

/// Where the flavors Kueue admitted Workload `w` with put each pod set: the node labels
/// and tolerations of each flavor (read from its ResourceFlavor), by pod set; `Err`
/// says which flavor could not be read, and why.
async fn flavors(
    ctx: &Ctx,
    w: &serde_json::Value,
) -> Result<BTreeMap<String, objects::FlavorPlacement>, String> {
    let api: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &resource(objects::FLAVOR_API));
    let mut read: BTreeMap<String, objects::FlavorPlacement> = BTreeMap::new();
    let mut out = BTreeMap::new();
    for (set, names) in objects::admitted_flavors(w) {
        let mut placement = objects::FlavorPlacement::default();
        for name in names {
            if !read.contains_key(&name) {
                let flavor = api.get(&name).await.map_err(|e| {
                    format!("its ResourceFlavor {name} cannot be read ({e}): create it, or let Kueue admit the job again")
                })?;
                let value = serde_json::to_value(&flavor).unwrap_or_default();
                let p = objects::flavor_placement(&value)?;
                read.insert(name.clone(), p);
            }
            placement = placement.and(read[&name].clone());
        }
        out.insert(set, placement);
    }
    Ok(out)
}

/// The field manager of the Workload conditions the operator owns (`PodsReady`,
/// `Finished`).
const FIELD_MANAGER: &str = "edl-operator";

/// The field manager of a Workload's admission, Kueue's: the admission is cleared
/// under it, as Kueue's own job integrations do after an eviction.
const ADMISSION_MANAGER: &str = "kueue-admission";

/// The Workload conditions the operator applies as [`FIELD_MANAGER`].
const OWN_CONDITIONS: [&str; 2] = ["PodsReady", "Finished"];

/// Applies the plan's change to the job's Workload: made, or its status applied
/// (server-side apply). The operator's own conditions as [`FIELD_MANAGER`], each apply
/// naming all it keeps (an apply that leaves one out removes it). A release (after an
/// eviction) as Kueue's job integrations do it: under Kueue's admission manager, with
/// force, the status without its admission (so the admission, which that manager owns,
/// goes) and `QuotaReserved`/`Admitted` False, fenced by the resourceVersion it was read
/// at (a Workload admitted again meanwhile is not released).
pub(super) async fn apply_workload(
    ctx: &Ctx,
    tj: &TrainingJob,
    change: &WorkloadChange,
) -> Result<(), Error> {
    let ns = tj.namespace().unwrap_or_else(|| "default".to_owned());
    let api = workloads_api(ctx, &ns);
    let name = objects::workload_name(&tj.name_any());
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let status = match change {
        WorkloadChange::Create(w) => {
            let object: DynamicObject = serde_json::from_value((**w).clone()).map_err(|e| {
                kube_err(format!("make Workload {name}"))(kube::Error::SerdeError(e))
            })?;
            return match api.create(&PostParams::default(), &object).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
                Err(e) => Err(kube_err(format!("create Workload {name}"))(e)),
            };
        }
        WorkloadChange::Release(why) => (why.as_str(), Some(true)),
        WorkloadChange::Finish(message) => (message.as_str(), Some(false)),
        WorkloadChange::PodsReady(true) => (
            "All pods reached readiness and the workload is running",
            None,
        ),
        WorkloadChange::PodsReady(false) => ("Not all pods are ready or succeeded", None),
    };
    let found = api
        .get(&name)
        .await
        .map_err(kube_err(format!("read Workload {name}")))?;
    let value = serde_json::to_value(&found).unwrap_or_default();
    let identity = json!({
        "apiVersion": value["apiVersion"], "kind": value["kind"],
        "metadata": {"name": name, "namespace": ns},
    });
    let (manager, config) = match status {
        (why, Some(true)) => {
            let released = objects::released_workload(value.clone(), why, &now);
            let mut config = identity;
            config["metadata"]["resourceVersion"] = value["metadata"]["resourceVersion"].clone();
            config["status"] = released["status"].clone();
            (ADMISSION_MANAGER, config)
        }
        (message, finished) => {
            let new = match finished {
                Some(_) => objects::finished_workload(value, message, &now),
                None => {
                    let ready = matches!(change, WorkloadChange::PodsReady(true));
                    let reason = if ready { "PodsReady" } else { "WaitForStart" };
                    let mut w = value;
                    objects::set_workload_condition(
                        &mut w,
                        "PodsReady",
                        ready,
                        reason,
                        message,
                        &now,
                    );
                    w
                }
            };
            let own: Vec<serde_json::Value> = new["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|c| OWN_CONDITIONS.iter().any(|t| c["type"] == *t))
                .cloned()
                .collect();
            let mut config = identity;
            config["status"] = json!({ "conditions": own });
            (FIELD_MANAGER, config)
        }
    };
    api.patch_status(
        &name,
        &PatchParams::apply(manager).force(),
        &Patch::Apply(&config),
    )
    .await
    .map_err(kube_err(format!("apply the status of Workload {name}")))?;
    Ok(())
}
