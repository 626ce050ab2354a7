//! The paddlecloud-style verbs against a cluster, over the TrainingJob resource: `edl
//! submit` ([`submit`]), `edl jobs` ([`jobs`]), and the cluster forms of `edl status`
//! ([`status`]), `edl scale` ([`scale`], through the scale subresource, as `kubectl
//! scale` or an autoscaler would), `edl kill` ([`kill`]: the resource is deleted; its
//! pods get SIGTERM, so trainers drain, and the finalizer removes the job's etcd keys)
//! and `edl logs` ([`logs`], the pods' logs through the API server).
//!
//! Each verb is one or two API requests; what they print is rendered here too
//! ([`render_jobs`], [`render_status`]) so it is tested without a cluster.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use futures::{AsyncBufReadExt, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams};
use kube::config::KubeConfigOptions;
use kube::{Api, Client, Config};
use serde::Serialize;

use crate::TrainingJob;
use crate::crd::{Phase, TrainingJobStatus};
use crate::objects::{JOB_LABEL, ROLE_LABEL, Role};

/// What went wrong, said once with the fix where there is one.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// No usable kubeconfig.
    #[error("kubeconfig{}: {cause} (set KUBECONFIG to a kubeconfig with the cluster, and --context)", context.as_ref().map_or(String::new(), |c| format!(" context {c}")))]
    Config {
        /// The context asked for.
        context: Option<String>,
        /// Why (said once: the kube error's text already holds its causes).
        cause: String,
    },
    /// The job cannot run; names the field.
    #[error("{0}")]
    Invalid(#[from] crate::crd::InvalidJob),
    /// A job of that name exists.
    #[error("TrainingJob {namespace}/{name} exists (`edl kill {name}` removes it)")]
    Exists {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
    /// No such job.
    #[error("no TrainingJob {namespace}/{name}")]
    NotFound {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
    /// The API server refused or failed.
    #[error("Kubernetes API: {0}")]
    Api(#[from] kube::Error),
}

/// A client for the kubeconfig's `context` (or its current context, or the pod's service
/// account), and the namespace to use: `namespace`, else the context's.
pub async fn connect(
    context: Option<&str>,
    namespace: Option<&str>,
) -> Result<(Client, String), ClusterError> {
    let config_error = |e: &dyn std::error::Error| ClusterError::Config {
        context: context.map(str::to_owned),
        cause: e.to_string(),
    };
    let config = match context {
        Some(c) => Config::from_kubeconfig(&KubeConfigOptions {
            context: Some(c.to_owned()),
            ..KubeConfigOptions::default()
        })
        .await
        .map_err(|e| config_error(&e))?,
        None => Config::infer().await.map_err(|e| config_error(&e))?,
    };
    let ns = namespace.map_or_else(|| config.default_namespace.clone(), str::to_owned);
    let client = Client::try_from(config).map_err(ClusterError::Api)?;
    Ok((client, ns))
}

fn is_code(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

/// Creates `tj` in `namespace` after checking it as the operator will.
pub async fn submit(
    client: &Client,
    namespace: &str,
    mut tj: TrainingJob,
) -> Result<TrainingJob, ClusterError> {
    tj.metadata.namespace = Some(namespace.to_owned());
    tj.job_spec()?;
    let name = tj.metadata.name.clone().unwrap_or_default();
    let api: Api<TrainingJob> = Api::namespaced(client.clone(), namespace);
    api.create(&PostParams::default(), &tj)
        .await
        .map_err(|e| match e {
            e if is_code(&e, 409) => ClusterError::Exists {
                namespace: namespace.to_owned(),
                name,
            },
            e => ClusterError::Api(e),
        })
}

/// One job in `edl jobs`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobRow {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// When it was submitted (RFC 3339).
    pub submitted: String,
    /// Its phase.
    pub phase: Phase,
    /// Its pods not running yet.
    pub pending_pods: u32,
    /// Trainer pods running.
    pub running_trainers: u32,
    /// Trainers desired.
    pub desired_trainers: u32,
    /// CPU requested by its running pods, in millicores.
    pub cpu_millis: u64,
    /// The pass it is in.
    pub pass: Option<u32>,
    /// Passes in all.
    pub passes: u32,
}

/// `edl jobs`: every job, and the cluster's totals (EDL's collector view).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobsView {
    /// The jobs, oldest first.
    pub jobs: Vec<JobRow>,
    /// Jobs with a pod not running yet, or not started.
    pub pending_jobs: usize,
    /// Trainer pods running over all jobs.
    pub running_trainers: u32,
    /// CPU requested by running job pods, in millicores.
    pub cpu_millis: u64,
    /// Allocatable CPU of the cluster's nodes, in millicores, when nodes can be listed.
    pub allocatable_cpu_millis: Option<u64>,
}

/// A CPU quantity (`2`, `500m`, `1.5`) in millicores.
pub fn cpu_millis(q: &Quantity) -> Option<u64> {
    let s = q.0.trim();
    if let Some(m) = s.strip_suffix('m') {
        return m.parse().ok();
    }
    let v: f64 = s.parse().ok()?;
    (v.is_finite() && v >= 0.0).then(|| (v * 1000.0).round() as u64)
}

fn pod_cpu_millis(pod: &Pod) -> u64 {
    pod.spec.as_ref().map_or(0, |s| {
        s.containers
            .iter()
            .filter_map(|c| c.resources.as_ref()?.requests.as_ref()?.get("cpu"))
            .filter_map(cpu_millis)
            .sum()
    })
}

fn phase_of(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

/// The jobs of `namespace` (all namespaces when `None`) with their pods.
pub async fn jobs(client: &Client, namespace: Option<&str>) -> Result<JobsView, ClusterError> {
    let (tjs, pods): (Api<TrainingJob>, Api<Pod>) = match namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let list = tjs.list(&ListParams::default()).await?;
    let pods = pods.list(&ListParams::default().labels(JOB_LABEL)).await?;
    let mut by_job: BTreeMap<(String, String), Vec<&Pod>> = BTreeMap::new();
    for p in &pods.items {
        let labels = p.metadata.labels.as_ref();
        if let Some(job) = labels.and_then(|l| l.get(JOB_LABEL)) {
            let ns = p.metadata.namespace.clone().unwrap_or_default();
            by_job.entry((ns, job.clone())).or_default().push(p);
        }
    }
    let mut rows: Vec<JobRow> = list
        .items
        .iter()
        .map(|tj| {
            let ns = tj.metadata.namespace.clone().unwrap_or_default();
            let name = tj.metadata.name.clone().unwrap_or_default();
            let pods = by_job
                .remove(&(ns.clone(), name.clone()))
                .unwrap_or_default();
            let running = |p: &&&Pod| phase_of(p) == "Running";
            let status = tj.status.clone().unwrap_or_default();
            JobRow {
                submitted: tj
                    .metadata
                    .creation_timestamp
                    .as_ref()
                    .map_or(String::new(), |t| t.0.to_string()),
                phase: status.phase,
                pending_pods: pods.iter().filter(|p| phase_of(p) == "Pending").count() as u32,
                running_trainers: pods
                    .iter()
                    .filter(running)
                    .filter(|p| {
                        p.metadata.labels.as_ref().and_then(|l| l.get(ROLE_LABEL))
                            == Some(&Role::Trainer.name().to_owned())
                    })
                    .count() as u32,
                desired_trainers: tj.spec.cluster.trainers,
                cpu_millis: pods.iter().filter(running).map(|p| pod_cpu_millis(p)).sum(),
                pass: status.pass,
                passes: tj.spec.train.passes,
                namespace: ns,
                name,
            }
        })
        .collect();
    rows.sort_by(|a, b| (&a.submitted, &a.name).cmp(&(&b.submitted, &b.name)));
    // Nodes are cluster-wide: a user allowed only their namespace cannot list them.
    let nodes: Api<Node> = Api::all(client.clone());
    let allocatable_cpu_millis = nodes.list(&ListParams::default()).await.ok().map(|l| {
        l.items
            .iter()
            .filter_map(|n| n.status.as_ref()?.allocatable.as_ref()?.get("cpu"))
            .filter_map(cpu_millis)
            .sum()
    });
    Ok(JobsView {
        pending_jobs: rows
            .iter()
            .filter(|r| r.pending_pods > 0 || matches!(r.phase, Phase::Created | Phase::Pending))
            .count(),
        running_trainers: rows.iter().map(|r| r.running_trainers).sum(),
        cpu_millis: rows.iter().map(|r| r.cpu_millis).sum(),
        allocatable_cpu_millis,
        jobs: rows,
    })
}

/// `edl jobs` as a table.
pub fn render_jobs(view: &JobsView) -> String {
    let mut out = String::new();
    let cpu = |m: u64| format!("{:.1}", m as f64 / 1000.0);
    let _ = writeln!(
        out,
        "SUBMITTED-JOBS {}  PENDING-JOBS {}  RUNNING-TRAINERS {}  CPU {}{}",
        view.jobs.len(),
        view.pending_jobs,
        view.running_trainers,
        cpu(view.cpu_millis),
        view.allocatable_cpu_millis
            .filter(|a| *a > 0)
            .map_or(String::new(), |a| format!(
                "/{} ({:.0}%)",
                cpu(a),
                view.cpu_millis as f64 * 100.0 / a as f64
            ))
    );
    let _ = writeln!(
        out,
        "{:<12} {:<32} {:<20} {:<10} {:>7} {:>16} {:>5} {:>9}",
        "NAMESPACE", "NAME", "SUBMITTED", "PHASE", "PENDING", "RUNNING-TRAINERS", "CPU", "PASS"
    );
    for r in &view.jobs {
        let _ = writeln!(
            out,
            "{:<12} {:<32} {:<20} {:<10} {:>7} {:>16} {:>5} {:>9}",
            r.namespace,
            r.name,
            r.submitted,
            format!("{:?}", r.phase),
            r.pending_pods,
            format!("{}/{}", r.running_trainers, r.desired_trainers),
            cpu(r.cpu_millis),
            r.pass
                .map_or("-".to_owned(), |p| format!("{}/{}", p + 1, r.passes)),
        );
    }
    out
}

async fn get(client: &Client, namespace: &str, name: &str) -> Result<TrainingJob, ClusterError> {
    let api: Api<TrainingJob> = Api::namespaced(client.clone(), namespace);
    api.get_opt(name)
        .await?
        .ok_or_else(|| ClusterError::NotFound {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
}

/// The job as the API server has it.
pub async fn status(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<TrainingJob, ClusterError> {
    get(client, namespace, name).await
}

/// `edl status JOB` on a cluster.
pub fn render_status(tj: &TrainingJob) -> String {
    let s: TrainingJobStatus = tj.status.clone().unwrap_or_default();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}/{}  [{:?}]  image {}",
        tj.metadata.namespace.as_deref().unwrap_or(""),
        tj.metadata.name.as_deref().unwrap_or(""),
        s.phase,
        tj.spec.image
    );
    if let Some(p) = s.pass {
        let _ = writeln!(out, "  pass {}/{}", p + 1, tj.spec.train.passes);
    }
    if let Some(t) = &s.tasks {
        let _ = writeln!(
            out,
            "  tasks todo {}  pending {}  done {}  failed {}",
            t.todo, t.pending, t.done, t.failed
        );
    }
    let _ = writeln!(
        out,
        "  trainers running {}  desired {}  registered {}  (min {}, max {})",
        s.trainers.running,
        s.trainers.desired,
        s.trainers.registered,
        tj.spec.cluster.min_trainers,
        tj.spec.cluster.max_trainers()
    );
    let _ = writeln!(out, "  pservers {}", s.pservers);
    if let Some(l) = &s.leader {
        let _ = writeln!(out, "  leader master {l}");
    }
    for c in &s.conditions {
        let _ = writeln!(
            out,
            "  condition {} = {} ({}): {}",
            c.type_, c.status, c.reason, c.message
        );
    }
    for r in &s.recoveries {
        let _ = writeln!(
            out,
            "  recovered {} {} at {}: {}",
            r.role, r.pod, r.time, r.reason
        );
    }
    out
}

/// Sets the job's desired trainer count through the scale subresource, kept within the
/// spec's `[min_trainers, max_trainers]` (0 holds the job without trainers); returns the
/// count asked for.
pub async fn scale(
    client: &Client,
    namespace: &str,
    name: &str,
    trainers: u32,
) -> Result<u32, ClusterError> {
    let tj = get(client, namespace, name).await?;
    let c = &tj.spec.cluster;
    let want = match trainers {
        0 => 0,
        n => n.clamp(c.min_trainers, c.max_trainers()),
    };
    let api: Api<TrainingJob> = Api::namespaced(client.clone(), namespace);
    api.patch_scale(
        name,
        &PatchParams::default(),
        &Patch::Merge(&serde_json::json!({"spec": {"replicas": want}})),
    )
    .await?;
    Ok(want)
}

/// Deletes the job: its pods get SIGTERM and their grace period (trainers drain), the
/// operator's finalizer removes its etcd keys.
pub async fn kill(client: &Client, namespace: &str, name: &str) -> Result<(), ClusterError> {
    let api: Api<TrainingJob> = Api::namespaced(client.clone(), namespace);
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(e) if is_code(&e, 404) => Err(ClusterError::NotFound {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        }),
        Err(e) => Err(e.into()),
    }
}

/// The job's pods (of `role`, if given), by name.
async fn job_pods(
    client: &Client,
    namespace: &str,
    name: &str,
    role: Option<Role>,
) -> Result<Vec<String>, ClusterError> {
    let mut selector = format!("{JOB_LABEL}={name}");
    if let Some(r) = role {
        let _ = write!(selector, ",{ROLE_LABEL}={}", r.name());
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let mut names: Vec<String> = pods
        .list(&ListParams::default().labels(&selector))
        .await?
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    names.sort();
    Ok(names)
}

/// Writes the logs of the job's pods (of `role`) as `[pod] line` to `out`; with
/// `follow`, keeps writing what they append until every followed pod has ended (pods
/// created later are not followed: run it again). A pod whose container has not
/// started is said as such.
pub async fn logs(
    client: &Client,
    namespace: &str,
    name: &str,
    role: Option<Role>,
    follow: bool,
    mut out: impl FnMut(&str, &str),
) -> Result<(), ClusterError> {
    get(client, namespace, name).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let names = job_pods(client, namespace, name, role).await?;
    if !follow {
        for pod in &names {
            match pods.logs(pod, &LogParams::default()).await {
                Ok(text) => text.lines().for_each(|l| out(pod, l)),
                Err(kube::Error::Api(s)) if s.code == 400 => out(pod, &format!("({})", s.message)),
                Err(e) => return Err(e.into()),
            }
        }
        return Ok(());
    }
    let params = LogParams {
        follow: true,
        ..LogParams::default()
    };
    let mut streams = Vec::new();
    for pod in names {
        match pods.log_stream(&pod, &params).await {
            Ok(s) => streams.push(
                s.lines()
                    .map_ok(move |l| (pod.clone(), l))
                    .map_err(kube::Error::ReadEvents)
                    .boxed(),
            ),
            Err(kube::Error::Api(s)) if s.code == 400 => out(&pod, &format!("({})", s.message)),
            Err(e) => return Err(e.into()),
        }
    }
    let mut all = futures::stream::select_all(streams);
    while let Some(line) = all.next().await {
        let (pod, l) = line?;
        out(&pod, &l);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_quantities_are_read_in_millicores() {
        for (q, m) in [
            ("2", Some(2000)),
            ("500m", Some(500)),
            ("1.5", Some(1500)),
            ("x", None),
        ] {
            assert_eq!(cpu_millis(&Quantity(q.to_owned())), m, "{q}");
        }
    }

    #[test]
    fn the_jobs_table_has_the_collector_columns() {
        let view = JobsView {
            jobs: vec![JobRow {
                namespace: "ml".into(),
                name: "mnist".into(),
                submitted: "2026-11-23T10:00:00Z".into(),
                phase: Phase::Running,
                pending_pods: 1,
                running_trainers: 3,
                desired_trainers: 4,
                cpu_millis: 3500,
                pass: Some(2),
                passes: 10,
            }],
            pending_jobs: 1,
            running_trainers: 3,
            cpu_millis: 3500,
            allocatable_cpu_millis: Some(7000),
        };
        let text = render_jobs(&view);
        assert!(
            text.starts_with(
                "SUBMITTED-JOBS 1  PENDING-JOBS 1  RUNNING-TRAINERS 3  CPU 3.5/7.0 (50%)"
            ),
            "{text}"
        );
        let row = text.lines().nth(2).expect("a row");
        for cell in ["mnist", "Running", "3/4", "3.5", "3/10"] {
            assert!(row.split_whitespace().any(|c| c == cell), "{cell} in {row}");
        }
    }
}
