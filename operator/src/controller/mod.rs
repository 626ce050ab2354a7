//! The controller: the thin kube-rs edge around [`reconcile`](crate::reconcile). For
//! each TrainingJob (on a change of it or of its pods, and every
//! [`ControllerConfig::resync`] for the job's progress in etcd) it observes, decides and
//! applies the plan in order: finalizer, etcd, deletions, creations, status, events. A
//! step that fails ends the round with the error; the job is reconciled again after a
//! backoff, from a fresh observation (every step is idempotent: a pod that exists, a
//! spec already published, a finalizer already there are no-ops). A round is
//! `reconcile_job`: `observe` (the API server, then `observe_etcd`), the decision, and
//! `apply` (one function per step).
//!
//! Credentials: given admin credentials for the jobs' etcd
//! ([`ControllerConfig::etcd_auth`]), the controller makes sure, while observing a live
//! job on a shared etcd, that the Secret `<job>-edl-credentials` exists: made once, with
//! an etcd user `edl-job-<job>` whose only role may read and write `/edl/<job>/`
//! ([`EtcdBackend::grant_prefix`]) and a random job token; found, it is reused as it is
//! (the password is not reset every round). The decision then gives every job pod the
//! Secret as `envFrom`, so the job's processes work as the job's user, not as the
//! operator.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use edl_coord::{Backend, EtcdBackend};
use edl_job::{JobKeys, JobName, Record, ScaleRecord};
use edl_master_client::overview::job_status_with;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::crd::{TaskCounts, TrainingJob};
use crate::metrics::Metrics;
use crate::objects::{self, INDEX_LABEL, JOB_LABEL, ROLE_LABEL, Role, Slot, job_etcd_user};
mod admission;
mod etcd;
mod secrets;

use admission::{apply_workload, dynamic, observe_workload};
use etcd::EtcdKey;

use secrets::{ensure_credentials, ensure_tls};

use crate::reconcile::{
    Credentials, Deletion, EtcdAction, EtcdState, Event, FINALIZER, FinalizerChange, Finished,
    JobTls, Observed, Plan, PodPhase, PodView, reconcile,
};

/// How the controller runs.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// Only this namespace (default: all).
    pub namespace: Option<String>,
    /// How often a job is reconciled without a change (its progress in etcd).
    pub resync: Duration,
    /// etcd user and password for the jobs' etcd, if it needs them. Given, the user must
    /// be one that may manage users (`root`): each job on a shared etcd gets its own
    /// user and role, in the Secret `<job>-edl-credentials`.
    pub etcd_auth: Option<edl_coord::EtcdAuth>,
    /// How long one etcd request of the operator may take.
    pub etcd_timeout: Duration,
    /// The name events are reported under (`reportingInstance`).
    pub instance: String,
    /// The operator's own namespace: each job's NetworkPolicy admits the operator's pods
    /// from it.
    pub operator_namespace: String,
    /// Admit jobs that name a Kueue LocalQueue (label `kueue.x-k8s.io/queue-name`)
    /// through a Kueue Workload each: such a job runs only while Kueue admits it.
    /// Off: the label is only copied to the job's objects (Kueue's pod integration).
    pub kueue: bool,
    /// How the operator reaches an address inside the cluster (a managed etcd member's
    /// DNS name): as it is on a cluster; the stand-in's test kubelet maps pod addresses
    /// to this host's ports.
    pub resolve: Resolve,
}

/// A map of cluster addresses (in URLs) to the addresses the operator dials.
#[derive(Clone)]
pub struct Resolve(pub Arc<dyn Fn(&str) -> String + Send + Sync>);

impl Default for Resolve {
    fn default() -> Self {
        Resolve(Arc::new(str::to_owned))
    }
}

impl std::fmt::Debug for Resolve {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Resolve")
    }
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            namespace: None,
            resync: Duration::from_secs(5),
            etcd_auth: None,
            etcd_timeout: Duration::from_secs(3),
            instance: "edl-operator".to_owned(),
            operator_namespace: "edl-system".to_owned(),
            resolve: Resolve::default(),
            kueue: false,
        }
    }
}

/// A failed reconcile step.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server refused or could not be reached.
    #[error("{what}: {source}")]
    Kube {
        /// The step.
        what: String,
        /// Why.
        #[source]
        source: kube::Error,
    },
    /// etcd refused or could not be reached.
    #[error("{what}: {message}")]
    Etcd {
        /// The step.
        what: String,
        /// Why.
        message: String,
    },
}

fn kube_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let what = what.into();
    move |source| Error::Kube { what, source }
}

struct Ctx {
    client: Client,
    config: ControllerConfig,
    recorder: Recorder,
    metrics: Arc<Metrics>,
    /// One etcd client per endpoint list.
    /// One etcd client per endpoint list and password (a job made again under the same
    /// name has a new managed etcd, with a new root password).
    etcd: Mutex<BTreeMap<EtcdKey, Arc<EtcdBackend>>>,
}

/// The pod as the decision sees it (`None`: not one of the job's pods).
pub fn pod_view(pod: &Pod) -> Option<PodView> {
    let labels = pod.metadata.labels.as_ref()?;
    let slot = Slot {
        role: Role::parse(labels.get(ROLE_LABEL)?)?,
        index: labels.get(INDEX_LABEL)?.parse().ok()?,
    };
    let status = pod.status.as_ref();
    let phase = match status.and_then(|s| s.phase.as_deref()) {
        Some("Running") => PodPhase::Running,
        Some("Succeeded") => PodPhase::Succeeded,
        Some("Failed") => PodPhase::Failed,
        Some("Unknown") => PodPhase::Unknown,
        _ => PodPhase::Pending,
    };
    let container = status
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first());
    let waiting = container
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.waiting.as_ref())
        .filter(|w| {
            !matches!(
                w.reason.as_deref(),
                None | Some("ContainerCreating" | "PodInitializing")
            )
        })
        .map(|w| {
            (
                w.reason.clone().unwrap_or_default(),
                w.message.clone().unwrap_or_default(),
            )
        });
    let unschedulable = status
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| {
            cs.iter().find(|c| {
                c.type_ == "PodScheduled"
                    && c.status == "False"
                    && c.reason.as_deref() == Some("Unschedulable")
            })
        })
        .map(|c| {
            (
                "Unschedulable".to_owned(),
                c.message.clone().unwrap_or_default(),
            )
        });
    let terminated = container
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.terminated.as_ref());
    let ran_for = terminated.and_then(|t| {
        let (start, end) = (t.started_at.as_ref()?, t.finished_at.as_ref()?);
        let secs = end.0.as_second() - start.0.as_second();
        Some(Duration::from_secs(secs.max(0) as u64))
    });
    Some(PodView {
        name: pod.name_any(),
        slot,
        phase,
        terminating: pod.metadata.deletion_timestamp.is_some(),
        problem: waiting.or(unschedulable),
        ran_for,
        exit_code: terminated.map(|t| t.exit_code),
    })
}

/// The job's state in etcd (and its master's, asked with the job's `token` if it has
/// one, over its `tls` if it has that).
async fn progress(
    backend: &Arc<dyn Backend>,
    job: &JobName,
    token: Option<&str>,
    tls: Option<&edl_proto::tls::Tls>,
) -> Result<EtcdState, String> {
    let keys = JobKeys::new(job);
    let spec_published = backend
        .get(&keys.spec())
        .await
        .map_err(|e| e.to_string())?
        .is_some();
    if !spec_published {
        return Ok(EtcdState::default());
    }
    let s = job_status_with(backend, job, token, tls)
        .await
        .map_err(|e| e.to_string())?;
    let finished = match s.state.as_str() {
        "succeeded" => Some(Finished::Succeeded),
        "failed" => Some(Finished::Failed(
            "the job failed (edl status names why)".into(),
        )),
        "stopped" => Some(Finished::Failed("stopped by `edl kill`".into())),
        _ => None,
    };
    Ok(EtcdState {
        spec_published,
        pass: s.pass.map(|p| p.current.saturating_sub(1)),
        tasks: s.tasks.map(|t| TaskCounts {
            todo: t.todo,
            pending: t.pending,
            done: t.done,
            failed: t.failed,
        }),
        trainers: s.trainers.len() as u32,
        // Shards served (a replicated shard between a primary's loss and its
        // successor's claim is listed without an address).
        pservers: s.pservers.iter().filter(|p| !p.address.is_empty()).count() as u32,
        leader: s
            .masters
            .iter()
            .find(|m| m.leader)
            .map(|m| m.address.clone()),
        scale: s.desired_trainers,
        finished,
        paused: s.paused.clone(),
    })
}

/// One round for one job: observe, decide ([`reconcile`]), apply.
async fn reconcile_job(cached: Arc<TrainingJob>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let name = cached.name_any();
    let ns = cached.namespace().unwrap_or_else(|| "default".to_owned());
    ctx.metrics.reconciles.inc();
    let apis = JobApis::new(&ctx.client, &ns);
    // The status carries state (restart counts, recoveries, replacements in flight), so
    // the decision starts from the job as the API server has it now, not from the
    // watch cache, which may not have seen this operator's last status write yet; and
    // every write to the job is fenced by the resourceVersion it was decided on.
    let tj = match apis.jobs.get(&name).await {
        Ok(tj) => tj,
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Action::await_change()),
        Err(e) => return Err(kube_err("read the job")(e)),
    };
    let job_name = JobName::new(name).ok();
    let (obs, tls) = observe(&ctx, &apis, &tj, &ns, job_name.as_ref()).await?;
    let plan = reconcile(&obs);
    apply(&ctx, &apis, &tj, job_name.as_ref(), &plan, tls.as_ref()).await?;
    Ok(Action::requeue(ctx.config.resync))
}

/// The API of a job's namespace for each kind it is made of.
struct JobApis {
    jobs: Api<TrainingJob>,
    pods: Api<Pod>,
    services: Api<Service>,
    claims: Api<PersistentVolumeClaim>,
    network_policies: Api<NetworkPolicy>,
    pod_groups: Api<DynamicObject>,
}

impl JobApis {
    fn new(client: &Client, ns: &str) -> Self {
        JobApis {
            jobs: Api::namespaced(client.clone(), ns),
            pods: Api::namespaced(client.clone(), ns),
            services: Api::namespaced(client.clone(), ns),
            claims: Api::namespaced(client.clone(), ns),
            network_policies: Api::namespaced(client.clone(), ns),
            pod_groups: dynamic(client, ns, objects::POD_GROUP_API),
        }
    }
}

/// What the decision looks at: the job's pods, services and claims (by the job's label), its
/// state in etcd and its credentials, and the time; and the job's TLS as the operator
/// speaks it to the job's processes and its managed etcd.
async fn observe<'a>(
    ctx: &Ctx,
    apis: &JobApis,
    tj: &'a TrainingJob,
    ns: &str,
    job: Option<&JobName>,
) -> Result<(Observed<'a>, Option<edl_proto::tls::Tls>), Error> {
    let selector = ListParams::default().labels(&format!("{JOB_LABEL}={}", tj.name_any()));
    let pods = apis
        .pods
        .list(&selector)
        .await
        .map_err(kube_err("list the job's pods"))?;
    let services = apis
        .services
        .list(&selector)
        .await
        .map_err(kube_err("list the job's services"))?;
    let claims = apis
        .claims
        .list(&selector)
        .await
        .map_err(kube_err("list the job's claims"))?;
    let policies = apis
        .network_policies
        .list(&selector)
        .await
        .map_err(kube_err("list the job's NetworkPolicies"))?;
    // Only a job that asks for Volcano: a cluster without it has no PodGroups.
    let pod_groups = if tj.spec.volcano.is_some() {
        apis.pod_groups
            .list(&selector)
            .await
            .map_err(kube_err("list the job's Volcano PodGroups"))?
            .items
    } else {
        Vec::new()
    };
    // A live job's TLS Secret. An ended or deleted one needs none any more, but for
    // the operator to read its managed etcd, which stays (then taken as it is).
    let (tls, job_tls) = if tj.spec.plaintext {
        (JobTls::Plaintext, None)
    } else if live(tj) {
        match ensure_tls(ctx, tj, ns, true).await {
            Ok(t) => (JobTls::Ready, Some(t)),
            Err(why) => (JobTls::Failed(why), None),
        }
    } else if tj.spec.etcd.managed {
        (JobTls::Plaintext, ensure_tls(ctx, tj, ns, false).await.ok())
    } else {
        (JobTls::Plaintext, None)
    };
    let (etcd, credentials) = observe_etcd(ctx, tj, ns, job, job_tls.as_ref()).await;
    let admission = observe_workload(ctx, tj, ns).await?;
    let observed = Observed {
        job: tj,
        pods: pods.items.iter().filter_map(pod_view).collect(),
        services: services.items.iter().map(ResourceExt::name_any).collect(),
        claims: claims.items.iter().map(ResourceExt::name_any).collect(),
        network_policies: policies.items.iter().map(ResourceExt::name_any).collect(),
        pod_groups: pod_groups
            .iter()
            .map(|g| {
                let min = g.data["spec"]["minMember"].as_u64().unwrap_or(0);
                (g.name_any(), u32::try_from(min).unwrap_or(u32::MAX))
            })
            .collect(),
        operator_namespace: ctx.config.operator_namespace.clone(),
        etcd,
        credentials,
        tls,
        admission,
        now: Time(k8s_openapi::jiff::Timestamp::now()),
    };
    Ok((observed, job_tls))
}

/// Whether `tj` is live: not being deleted, not over, with a valid spec.
fn live(tj: &TrainingJob) -> bool {
    tj.metadata.deletion_timestamp.is_none()
        && !tj.status.as_ref().is_some_and(|s| s.phase.is_finished())
        && tj.job_spec().is_ok()
}

/// The job's own credentials, for a live, valid job on its managed etcd, or on a shared
/// etcd when the operator may make users; then the job's state, its master asked with the job's token (over
/// the job's TLS, `tls`, when it has it).
async fn observe_etcd(
    ctx: &Ctx,
    tj: &TrainingJob,
    ns: &str,
    job: Option<&JobName>,
    tls: Option<&edl_proto::tls::Tls>,
) -> (Result<EtcdState, String>, Credentials) {
    let Some(job) = job else {
        // An invalid name fails the job in the decision; etcd is not needed.
        return (Ok(EtcdState::default()), Credentials::NotIssued);
    };
    // A job gets its own etcd user and token: on a shared etcd when the operator may
    // make users, always on its managed etcd.
    let issues = (ctx.config.etcd_auth.is_some() || tj.spec.etcd.managed) && live(tj);
    let b = match ctx.backend(tj, tls).await {
        Ok(b) => b,
        Err(e) => return (Err(e), Credentials::NotIssued),
    };
    let (credentials, token) = if issues {
        match ensure_credentials(ctx, &b, tj, ns, job).await {
            Ok(token) => (Credentials::Ready, token),
            Err(why) => (Credentials::Failed(why), None),
        }
    } else {
        (Credentials::NotIssued, None)
    };
    let b: Arc<dyn Backend> = b;
    let etcd = progress(&b, job, token.as_deref(), tls).await;
    // An etcd that cannot be read is said once, by its own condition: no job process
    // starts then anyway.
    let credentials = match (&etcd, credentials) {
        (Err(_), Credentials::Failed(_)) => Credentials::NotIssued,
        (_, c) => c,
    };
    (etcd, credentials)
}

/// Applies `plan` in its order: finalizer, etcd, deletions, creations, status, events
/// (and last the finalizer's removal). Writes to the job are fenced by the
/// resourceVersion `tj` was decided on.
async fn apply(
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
    if !plan.etcd.is_empty() {
        apply_etcd(ctx, tj, job, &plan.etcd, tls).await?;
    }
    if let Some(change) = &plan.workload {
        apply_workload(ctx, tj, change).await?;
    }
    delete_pods(ctx, &apis.pods, &plan.delete).await?;
    create_objects(ctx, apis, plan).await?;
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
            (EtcdAction::RemoveJobUser, Some(_)) if ctx.config.etcd_auth.is_none() => Ok(()),
            (EtcdAction::RemoveJobUser, Some(_)) => admin
                .revoke_user(&job_etcd_user(tj.name_any().as_str()))
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
async fn create_objects(ctx: &Ctx, apis: &JobApis, plan: &Plan) -> Result<(), Error> {
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
    for (name, min) in &plan.pod_group_min_members {
        let patch = serde_json::json!({"spec": {"minMember": min}});
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
            Err(e) => {
                return Err(kube_err(format!("create pod {}", p.name_any()))(e));
            }
        }
    }
    Ok(())
}

/// Records the plan's events on the job, counting scales and recoveries. An event
/// that cannot be recorded is logged: it is for people, the job goes on without it.
async fn record_events(ctx: &Ctx, tj: &TrainingJob, events: &[Event]) {
    let reference = tj.object_ref(&());
    for e in events {
        if e.reason.starts_with("Scaled") {
            ctx.metrics.scale_events.inc();
        }
        if e.reason == "PodReplaced" {
            ctx.metrics.recoveries.inc();
        }
        let event = KubeEvent {
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

fn error_policy(_tj: Arc<TrainingJob>, error: &Error, ctx: Arc<Ctx>) -> Action {
    ctx.metrics.reconcile_errors.inc();
    tracing::warn!(%error, "reconcile failed; retrying");
    Action::requeue(Duration::from_secs(2))
}

/// Runs the controller until `shutdown` fires.
pub async fn run(
    client: Client,
    config: ControllerConfig,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    let (jobs, pods): (Api<TrainingJob>, Api<Pod>) = match &config.namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "edl-operator".to_owned(),
            instance: Some(config.instance.clone()),
        },
    );
    let ctx = Arc::new(Ctx {
        client,
        config,
        recorder,
        metrics,
        etcd: Mutex::new(BTreeMap::new()),
    });
    let managed = watcher::Config::default().labels("app.kubernetes.io/managed-by=edl-operator");
    Controller::new(jobs, watcher::Config::default())
        .owns(pods, managed)
        .graceful_shutdown_on(shutdown.cancelled_owned())
        .run(reconcile_job, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "controller");
            }
        })
        .await;
}
