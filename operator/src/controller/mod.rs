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
//! Layout: the round and the loop are here ([`run`]); then
//! - `config.rs`: how it runs ([`ControllerConfig`], [`Resolve`]);
//! - `observe.rs`: the API server and the job's etcd -> [`Observed`](crate::reconcile::Observed)
//!   (the job's credentials and TLS Secret made on the way);
//! - `apply.rs`: a [`Plan`](crate::reconcile::Plan) -> writes, in order;
//! - `admission.rs`: Kueue's Workload and Volcano's PodGroup API;
//! - `etcd.rs`: the operator's clients of the jobs' etcds;
//! - `secrets.rs`: the job's Secrets, made while observing.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use edl_coord::EtcdBackend;
use edl_job::JobName;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::DynamicObject;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Client, ResourceExt};
use tokio_util::sync::CancellationToken;

use crate::crd::TrainingJob;
use crate::metrics::Metrics;
use crate::objects;
use crate::reconcile::reconcile;

mod admission;
mod apply;
mod config;
mod etcd;
mod observe;
mod secrets;

use admission::dynamic;
use apply::apply;
use etcd::EtcdKey;
use observe::observe;

pub use config::{ControllerConfig, Resolve};
pub use observe::pod_view;

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
    /// The installed CustomResourceDefinition is not this operator's.
    #[error("{0}")]
    Crd(String),
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
    /// One etcd client per endpoint list and password (a job made again under the same
    /// name has a new managed etcd, with a new root password).
    etcd: Mutex<BTreeMap<EtcdKey, Arc<EtcdBackend>>>,
    /// The cluster's nodes, as a watch last saw them: whether a job pod's node is lost.
    nodes: reflector::Store<Node>,
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
    // Its name in etcd (`<namespace>.<name>`, objects::etcd_job); Kubernetes names stay
    // `<name>-...` in the namespace.
    let job_name = JobName::new(objects::etcd_job(&tj)).ok();
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
    disruption_budgets: Api<k8s_openapi::api::policy::v1::PodDisruptionBudget>,
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
            disruption_budgets: Api::namespaced(client.clone(), ns),
            pod_groups: dynamic(client, ns, objects::POD_GROUP_API),
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
    // The nodes, watched: a job pod on a node not Ready for long is replaced.
    let (nodes_reader, nodes_writer) = reflector::store::<Node>();
    let node_watch = watcher(Api::<Node>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .reflect(nodes_writer)
        .for_each(|event| async move {
            if let Err(e) = event {
                tracing::warn!(error = %e, "watching the nodes (a job pod on a lost node is not replaced until the watch works)");
            }
        });
    let node_stop = shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = node_stop.cancelled() => {}
            _ = node_watch => {}
        }
    });
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
        nodes: nodes_reader,
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
