//! A `Plan` applied in its order: finalizer, etcd, workload, deletions, creations,
//! status, events, finalizer removal. Each step is idempotent, and writes to the job are
//! fenced by the resourceVersion it was decided on.

use std::sync::Arc;

use edl_coord::Backend;
use edl_job::{JobKeys, JobName, Record, ScaleRecord};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType};
use kube::{Api, Resource, ResourceExt};
use serde_json::json;

use super::admission::apply_workload;
use super::{Ctx, Error, JobApis, kube_err};
use crate::crd::TrainingJob;
use crate::objects::job_etcd_user;
use crate::reconcile::{Deletion, EtcdAction, FINALIZER, FinalizerChange, JobEvent, Plan};

/// Applies `plan` in its order: finalizer, etcd, deletions, creations, status, events
/// (and last the finalizer's removal). Writes to the job are fenced by the
/// resourceVersion `tj` was decided on.
pub(super) async fn apply(
    ctx: &Ctx,
    apis: &JobApis,
    tj: &TrainingJob,
    job: Option<&JobName>,
    plan: &Plan,
    tls: Option<&edl_proto::tls::Tls>,
) -> Result<(), Error> {
    let name = tj.name_any();
    let mut rv = tj.resource_version();
    let mut finalizers: Vec<String> = tj.finalizers().to_vec();
    if plan.finalizer == Some(FinalizerChange::Add) {
        finalizers.push(FINALIZER.to_owned());
        let patch = json!({"metadata": {"finalizers": finalizers, "resourceVersion": rv}});
        let written = apis
            .jobs
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(kube_err("add the finalizer"))?;
        rv = written.resource_version();
    }
    // A new job's name in etcd goes into its status before its first key or pod, and
    // must stay there: a CRD from before it would drop the field, and later rounds would
    // take the job for one from before (its bare name).
    let etcd_job = crate::objects::etcd_job(tj);
    let recorded = tj.status.as_ref().and_then(|s| s.etcd_job.as_deref());
    if recorded != Some(etcd_job.as_str()) && tj.metadata.deletion_timestamp.is_none() {
        let patch = json!({"status": {"etcdJob": etcd_job}, "metadata": {"resourceVersion": rv}});
        let written = apis
            .jobs
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(kube_err("record the job's name in etcd"))?;
        if written.status.as_ref().and_then(|s| s.etcd_job.as_deref()) != Some(etcd_job.as_str()) {
            let message = "the API server dropped status.etcdJob: the installed TrainingJob \
                           CRD is older than this operator; apply its deploy/crd.yaml, then \
                           the job goes on"
                .to_owned();
            let event = JobEvent {
                warning: true,
                reason: "CrdOutdated".to_owned(),
                message: message.clone(),
            };
            record_events(ctx, &written, &[event]).await;
            return Err(Error::Crd(message));
        }
        rv = written.resource_version();
    }
    // A deleted job whose etcd the operator may not log in to: it never wrote there (no
    // user, no keys of its making), so there is nothing to remove and the finalizer goes.
    let cleanup_only = plan
        .etcd
        .iter()
        .all(|a| matches!(a, EtcdAction::DeleteJob | EtcdAction::RemoveJobUser));
    let skip_etcd = cleanup_only && ctx.check_shared_endpoints(tj).is_err();
    if skip_etcd && !plan.etcd.is_empty() {
        // Had its endpoints been allowed once (a list changed since), what it left there
        // stays: say what, so that an admin can remove it.
        let name = crate::objects::etcd_job(tj);
        let event = JobEvent {
            warning: true,
            reason: "EtcdNotCleaned".to_owned(),
            message: format!(
                "the operator may not log in to etcd.endpoints {}, so it removed nothing \
                 there: if the job ever ran on it, remove /edl/{name}/ and the etcd user \
                 edl-job-{name} by hand (etcdctl del --prefix /edl/{name}/; etcdctl user \
                 delete edl-job-{name}; etcdctl role delete edl-job-{name})",
                tj.spec.etcd.endpoints.join(",")
            ),
        };
        record_events(ctx, tj, &[event]).await;
    }
    if !plan.etcd.is_empty() && !skip_etcd {
        apply_etcd(ctx, tj, job, &plan.etcd, tls).await?;
    }
    if let Some(change) = &plan.workload {
        apply_workload(ctx, tj, change).await?;
    }
    delete_pods(ctx, &apis.pods, &plan.delete).await?;
    create_objects(ctx, apis, tj, plan).await?;
    if let Some(status) = &plan.status {
        // A 409 here means the job changed since it was read: the next round decides
        // again from the new version.
        let patch = json!({"status": status, "metadata": {"resourceVersion": rv}});
        apis.jobs
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(kube_err("write the status"))?;
    }
    record_events(ctx, tj, &plan.events).await;
    if plan.finalizer == Some(FinalizerChange::Remove) {
        let left: Vec<String> = finalizers.into_iter().filter(|f| f != FINALIZER).collect();
        let patch = json!({"metadata": {"finalizers": if left.is_empty() { serde_json::Value::Null } else { json!(left) }}});
        apis.jobs
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(kube_err("remove the finalizer"))?;
    }
    Ok(())
}

/// The plan's changes to the job's etcd keys, in order.
async fn apply_etcd(
    ctx: &Ctx,
    tj: &TrainingJob,
    job: Option<&JobName>,
    actions: &[EtcdAction],
    tls: Option<&edl_proto::tls::Tls>,
) -> Result<(), Error> {
    let backend = ctx.backend(tj, tls).await.map_err(|message| Error::Etcd {
        what: "connect to the job's etcd".into(),
        message,
    })?;
    for action in actions {
        let keys = job.map(JobKeys::new);
        let admin = backend.clone();
        let backend: Arc<dyn Backend> = backend.clone();
        let result = match (action, &keys) {
            (EtcdAction::PublishSpec(spec), _) => spec
                .publish(&backend)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            (EtcdAction::WriteScale(n), Some(keys)) => backend
                .put(&keys.scale_trainers(), ScaleRecord::new(*n).encode(), None)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            (EtcdAction::DeleteJob, Some(keys)) => backend
                .delete_prefix(keys.root())
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            // Only an operator with admin credentials made the user.
            (EtcdAction::ReplaceMember(peer_url), _) => admin
                .replace_member(&(ctx.config.resolve.0)(peer_url))
                .await
                .map_err(|e| e.to_string()),
            // Best effort: what is not revoked expires with its lease, and the pod's
            // replacement must not wait on it.
            (EtcdAction::Revoke(holder), Some(keys)) => {
                match edl_job::holders::revoke_held(&backend, keys, holder).await {
                    Ok(leases) => ctx.metrics.revoked(holder.role(), leases.len()),
                    Err(e) => {
                        tracing::warn!(?holder, error = %e, "could not revoke the leases of an ended process; they expire");
                    }
                }
                Ok(())
            }
            (EtcdAction::RemoveJobUser, Some(_)) if ctx.config.etcd_auth.is_none() => Ok(()),
            (EtcdAction::RemoveJobUser, Some(_)) => admin
                .revoke_user(&job_etcd_user(&crate::objects::etcd_job(tj)))
                .await
                .map_err(|e| e.to_string()),
            (_, None) => Ok(()),
        };
        result.map_err(|message| Error::Etcd {
            what: format!("{action:?}"),
            message,
        })?;
    }
    Ok(())
}

/// Deletes the plan's pods (one already gone is fine).
async fn delete_pods(ctx: &Ctx, pods: &Api<Pod>, deletions: &[Deletion]) -> Result<(), Error> {
    for d in deletions {
        let params = DeleteParams {
            grace_period_seconds: d.grace.map(|g| g.max(0) as u32),
            ..DeleteParams::default()
        };
        match pods.delete(&d.name, &params).await {
            Ok(_) => {
                ctx.metrics.pods_deleted.inc();
            }
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(kube_err(format!("delete pod {}", d.name))(e)),
        };
    }
    Ok(())
}

/// Creates the plan's services, NetworkPolicy, PodGroup and claims, then its pods (one
/// that exists already is fine).
async fn create_objects(
    ctx: &Ctx,
    apis: &JobApis,
    tj: &TrainingJob,
    plan: &Plan,
) -> Result<(), Error> {
    for s in &plan.create_services {
        match apis.services.create(&PostParams::default(), s).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(kube_err("create a service")(e)),
        }
    }
    for n in &plan.create_network_policies {
        match apis
            .network_policies
            .create(&PostParams::default(), n)
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(kube_err("create the job's NetworkPolicy")(e)),
        }
    }
    for b in &plan.create_disruption_budgets {
        match apis
            .disruption_budgets
            .create(&PostParams::default(), b)
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(kube_err("create a PodDisruptionBudget of the job")(e)),
        }
    }
    for n in &plan.replace_network_policies {
        apis.network_policies
            .replace(&n.name_any(), &PostParams::default(), n)
            .await
            .map_err(kube_err("update the job's NetworkPolicy"))?;
    }
    for g in &plan.create_pod_groups {
        let object: DynamicObject = serde_json::from_value(g.clone())
            .map_err(|e| kube_err("make the job's Volcano PodGroup")(kube::Error::SerdeError(e)))?;
        match apis
            .pod_groups
            .create(&PostParams::default(), &object)
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(kube_err("create the job's Volcano PodGroup")(e)),
        }
    }
    for (name, min, resources) in &plan.pod_group_min_members {
        let patch = serde_json::json!({"spec": {"minMember": min, "minResources": resources}});
        apis.pod_groups
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(kube_err("set the minMember of the job's Volcano PodGroup"))?;
    }
    for c in &plan.create_claims {
        match apis.claims.create(&PostParams::default(), c).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(kube_err(format!("create claim {}", c.name_any()))(e)),
        }
    }
    for p in &plan.create_pods {
        match apis.pods.create(&PostParams::default(), p).await {
            Ok(_) => {
                ctx.metrics.pods_created.inc();
            }
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(kube::Error::Api(s)) if s.code == 403 => {
                // Refused by an admission policy (Pod Security admission, a webhook):
                // the job's people see why on the job, not only in the operator's log.
                let refused = JobEvent {
                    warning: true,
                    reason: "PodRefused".to_owned(),
                    message: format!(
                        "the API server refused pod {}: {} (the namespace's admission \
                         policy; docs/kubernetes.md, \"Pod Security\", says what edl's \
                         pods meet and what a job's spec can break)",
                        p.name_any(),
                        s.message
                    ),
                };
                record_events(ctx, tj, std::slice::from_ref(&refused)).await;
                return Err(kube_err(format!("create pod {}", p.name_any()))(
                    kube::Error::Api(s),
                ));
            }
            Err(e) => {
                return Err(kube_err(format!("create pod {}", p.name_any()))(e));
            }
        }
    }
    Ok(())
}

/// Records the plan's events on the job, counting scales and recoveries. An event
/// that cannot be recorded is logged: it is for people, the job goes on without it.
async fn record_events(ctx: &Ctx, tj: &TrainingJob, events: &[JobEvent]) {
    let reference = tj.object_ref(&());
    for e in events {
        if e.reason.starts_with("Scaled") {
            ctx.metrics.scale_events.inc();
        }
        if e.reason == "PodReplaced" {
            ctx.metrics.recoveries.inc();
        }
        let event = Event {
            type_: if e.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: e.reason.clone(),
            note: Some(e.message.chars().take(1000).collect()),
            action: "Reconcile".to_owned(),
            secondary: None,
        };
        if let Err(err) = ctx.recorder.publish(&event, &reference).await {
            tracing::warn!(job = %tj.name_any(), reason = %e.reason, error = %err, "cannot record an event");
        }
    }
}
