//! `edl operator run --autoscale`: edl's multi-job autoscaler on a cluster. Every
//! [`AutoscaleConfig::every`] the leading operator lists the nodes, the pods, the
//! PriorityClasses and the TrainingJobs, builds a [`Snapshot`], asks
//! [`edl_autoscaler::policy::decide`] for new trainer counts, and sets each through the
//! TrainingJob's scale subresource (as `kubectl scale` would). The controller then
//! creates trainers or drains surplus ones; the autoscaler never deletes a pod. With
//! [`PolicyConfig::preempt`] (`--autoscale-preempt`) it may set an elastic job's trainers
//! to 0: the job is held without trainers, its masters and pservers keeping its state,
//! until the policy gives it its minimum again.
//!
//! What the snapshot holds, from the API objects:
//! - **nodes**: those schedulable (not `spec.unschedulable`) and `Ready`; allocatable
//!   `cpu`, `memory` and `nvidia.com/gpu`;
//! - **requests**: the sum of each pod's containers' requests (init containers are not
//!   counted); every pod bound to a listed node and not finished counts on its node (other
//!   tenants' pods too, and pods being deleted, which keep their node while they drain);
//!   pods not bound count as `unplaced`;
//! - **jobs**: the TrainingJobs not finished nor being deleted (of `--namespace`, if
//!   given): min and max trainers, the desired count (`spec.cluster.trainers`), the
//!   requests of one trainer (from the pod the operator would create), the priority (the
//!   value of the PriorityClass named by `spec.priorityClassName`; 0 without one), the
//!   creation time, the trainer pods by state, the requests of its pods waiting for a
//!   node;
//! - **speed and work left**: from the job's status, which the controller keeps from the
//!   job's etcd: tasks done over all passes, and trainers registered. A speed is observed
//!   over a window in which the registered count did not change ([`JobMemory`]). What
//!   the autoscaler remembers (speeds, its last change of each job) lives in this
//!   process: a new leader starts without it and learns again.
//!
//! [`Autoscaler::pass`] is pure (objects and time in, changes out); [`run`] is the loop
//! around it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use edl_autoscaler::observe::{JobMemory, task_progress};
use edl_autoscaler::policy::{self, PolicyConfig};
use edl_autoscaler::{JobView, PodCounts, Resources, Snapshot};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use tokio_util::sync::CancellationToken;

use crate::TrainingJob;
use crate::metrics::Metrics;
use crate::objects::{CredentialsRef, JOB_LABEL, ROLE_LABEL, Role, Slot, pod};
use crate::verbs::cpu_millis;

/// How the autoscaler runs.
#[derive(Debug, Clone)]
pub struct AutoscaleConfig {
    /// Only the TrainingJobs of this namespace (nodes and pods are always all: other
    /// namespaces' pods take room on the nodes too).
    pub namespace: Option<String>,
    /// Seconds between passes.
    pub every: Duration,
    /// Seconds a job's trainer count must hold to give a speed.
    pub window: f64,
    /// The policy's settings.
    pub policy: PolicyConfig,
}

impl Default for AutoscaleConfig {
    fn default() -> Self {
        AutoscaleConfig {
            namespace: None,
            every: Duration::from_secs(5),
            window: 15.0,
            policy: PolicyConfig::default(),
        }
    }
}

/// What one pass sees: the API objects, and the time (seconds since the Unix epoch).
#[derive(Debug, Clone, Copy)]
pub struct Objects<'a> {
    /// Every node.
    pub nodes: &'a [Node],
    /// Every pod.
    pub pods: &'a [Pod],
    /// Every PriorityClass.
    pub priority_classes: &'a [PriorityClass],
    /// The TrainingJobs the autoscaler may resize.
    pub jobs: &'a [TrainingJob],
    /// Now.
    pub now: f64,
}

/// A new trainer count for a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The job's namespace.
    pub namespace: String,
    /// The job's name.
    pub name: String,
    /// Its desired trainers before.
    pub from: u32,
    /// Its desired trainers to set.
    pub to: u32,
}

/// The autoscaler's memory of the jobs between passes.
#[derive(Debug, Clone)]
pub struct Autoscaler {
    config: AutoscaleConfig,
    memory: BTreeMap<(String, String), JobMemory>,
}

impl Autoscaler {
    /// An autoscaler that has seen nothing yet.
    pub fn new(config: AutoscaleConfig) -> Autoscaler {
        Autoscaler {
            config,
            memory: BTreeMap::new(),
        }
    }

    /// One pass: the snapshot of `objects` (jobs' speeds sampled), and the changes the
    /// policy asks for. The changes are taken as applied (`applied` after a failure
    /// forgets one).
    pub fn pass(&mut self, objects: &Objects<'_>) -> (Snapshot, Vec<Change>) {
        let (snapshot, keys) = self.snapshot(objects);
        let targets = policy::decide(&self.config.policy, &snapshot);
        let mut changes = Vec::new();
        for t in targets {
            let (namespace, name) = keys[t.job].clone();
            if let Some(m) = self.memory.get_mut(&(namespace.clone(), name.clone())) {
                m.changed(objects.now);
            }
            changes.push(Change {
                namespace,
                name,
                from: t.from,
                to: t.to,
            });
        }
        (snapshot, changes)
    }

    /// A change could not be applied: the job is not counted as changed.
    pub fn not_applied(&mut self, change: &Change) {
        if let Some(m) = self
            .memory
            .get_mut(&(change.namespace.clone(), change.name.clone()))
        {
            m.changed_at = None;
        }
    }

    fn snapshot(&mut self, o: &Objects<'_>) -> (Snapshot, Vec<(String, String)>) {
        let mut nodes: Vec<edl_autoscaler::Node> = Vec::new();
        let mut index: BTreeMap<String, usize> = BTreeMap::new();
        for n in o.nodes.iter().filter(|n| schedulable(n)) {
            let name = n.name_any();
            index.insert(name.clone(), nodes.len());
            let alloc = n
                .status
                .as_ref()
                .and_then(|s| s.allocatable.as_ref())
                .map(resources_of)
                .unwrap_or_default();
            nodes.push(edl_autoscaler::Node {
                name,
                allocatable: alloc,
                requested: Resources::default(),
            });
        }
        let mut unplaced = Resources::default();
        // Per job (namespace, name): trainer pods by state, waiting pods' requests.
        let mut per_job: BTreeMap<(String, String), (PodCounts, Vec<Resources>)> = BTreeMap::new();
        for p in o.pods.iter().filter(|p| !finished(p)) {
            let req = pod_requests(p);
            let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
            let bound = node.is_some();
            match node.and_then(|n| index.get(&n).copied()) {
                Some(i) => nodes[i].requested += req,
                None if !bound => unplaced += req,
                // Bound to a node not listed (cordoned, not ready): not the cluster's room.
                None => {}
            }
            let labels = p.labels();
            let Some(job) = labels.get(JOB_LABEL) else {
                continue;
            };
            let key = (p.namespace().unwrap_or_default(), job.clone());
            let entry = per_job.entry(key).or_default();
            if !bound {
                entry.1.push(req);
            }
            let trainer = labels.get(ROLE_LABEL).map(String::as_str) == Some(Role::Trainer.name());
            if trainer && p.metadata.deletion_timestamp.is_none() {
                let c = &mut entry.0;
                c.total += 1;
                match phase(p) {
                    "Running" => c.running += 1,
                    _ => {
                        c.pending += 1;
                        if !bound {
                            c.unbound += 1;
                        }
                    }
                }
            }
        }
        let priorities: BTreeMap<String, i32> = o
            .priority_classes
            .iter()
            .map(|pc| (pc.name_any(), pc.value))
            .collect();
        let mut jobs = Vec::new();
        let mut keys = Vec::new();
        let live: Vec<&TrainingJob> = o.jobs.iter().filter(|tj| active(tj)).collect();
        for tj in live {
            let key = (tj.namespace().unwrap_or_default(), tj.name_any());
            let (pods, waiting) = per_job.remove(&key).unwrap_or_default();
            let memory = self
                .memory
                .entry(key.clone())
                .or_insert_with(|| JobMemory::new(self.config.window));
            let progress = progress(tj);
            if let Some((done, _)) = progress {
                let registered = tj.status.as_ref().map_or(0, |s| s.trainers.registered);
                memory.sample(o.now, registered, done);
            }
            let c = &tj.spec.cluster;
            let trainer_pod = pod(
                tj,
                Slot {
                    role: Role::Trainer,
                    index: 0,
                },
                // Only its resources are read.
                CredentialsRef::None,
            );
            jobs.push(JobView {
                name: format!("{}/{}", key.0, key.1),
                min: c.min_trainers,
                max: c.max_trainers(),
                priority: tj
                    .spec
                    .priority_class_name
                    .as_ref()
                    .and_then(|n| priorities.get(n).copied())
                    .unwrap_or(0),
                trainer: pod_requests(&trainer_pod),
                trainers: c.trainers,
                waiting,
                pods,
                submitted: tj
                    .metadata
                    .creation_timestamp
                    .as_ref()
                    .map_or(o.now, |t| t.0.as_millisecond() as f64 / 1000.0),
                changed_at: memory.changed_at,
                speed: memory.speed.clone(),
                remaining: progress.map(|(_, left)| left),
            });
            keys.push(key);
        }
        // Forget the jobs that are gone.
        self.memory.retain(|k, _| keys.contains(k));
        let snapshot = Snapshot {
            now: o.now,
            nodes,
            unplaced,
            jobs,
        };
        (snapshot, keys)
    }
}

/// Tasks done over all passes, and tasks left, from the job's status (`None` before the
/// job's master published its queue).
fn progress(tj: &TrainingJob) -> Option<(f64, f64)> {
    let s = tj.status.as_ref()?;
    let t = s.tasks.as_ref()?;
    task_progress(
        s.pass.unwrap_or(0),
        tj.spec.train.passes,
        t.todo,
        t.pending,
        t.done,
        t.failed,
    )
}

fn active(tj: &TrainingJob) -> bool {
    tj.metadata.deletion_timestamp.is_none()
        && !tj.spec.suspend
        && !tj.status.as_ref().is_some_and(|s| s.phase.is_finished())
}

fn schedulable(n: &Node) -> bool {
    let cordoned = n
        .spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false);
    let ready = n
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    !cordoned && ready
}

fn phase(p: &Pod) -> &str {
    p.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

fn finished(p: &Pod) -> bool {
    matches!(phase(p), "Succeeded" | "Failed")
}

/// The requests of a pod's containers.
pub fn pod_requests(p: &Pod) -> Resources {
    p.spec.as_ref().map_or_else(Resources::default, |s| {
        s.containers
            .iter()
            .filter_map(|c| c.resources.as_ref()?.requests.as_ref())
            .map(resources_of)
            .sum()
    })
}

/// `cpu`, `memory` and `nvidia.com/gpu` of a resource list (what cannot be parsed is 0).
pub fn resources_of(list: &BTreeMap<String, Quantity>) -> Resources {
    Resources {
        cpu_milli: list.get("cpu").and_then(cpu_millis).unwrap_or(0),
        mem_mib: list.get("memory").and_then(mem_mib).unwrap_or(0),
        gpu: list
            .get("nvidia.com/gpu")
            .and_then(|q| q.0.trim().parse().ok())
            .unwrap_or(0),
    }
}

/// A memory quantity (`512Mi`, `2Gi`, `1G`, `1000000`, `1e9`) in MiB, rounded down.
pub fn mem_mib(q: &Quantity) -> Option<u64> {
    let s = q.0.trim();
    const UNITS: [(&str, f64); 12] = [
        ("Ki", 1024.0),
        ("Mi", 1024.0 * 1024.0),
        ("Gi", 1024.0 * 1024.0 * 1024.0),
        ("Ti", 1024.0 * 1024.0 * 1024.0 * 1024.0),
        ("Pi", 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0),
        ("Ei", 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
        ("E", 1e18),
    ];
    let (num, mult) = UNITS
        .iter()
        .find_map(|(u, m)| s.strip_suffix(u).map(|n| (n, *m)))
        .unwrap_or((s, 1.0));
    let v: f64 = num.parse().ok()?;
    let bytes = v * mult;
    (bytes.is_finite() && bytes >= 0.0).then(|| (bytes / (1024.0 * 1024.0)) as u64)
}

/// Runs the autoscaler until `shutdown` fires (on the leading replica, beside the
/// controller). A pass that cannot list the objects is skipped with a warning.
pub async fn run(
    client: Client,
    config: AutoscaleConfig,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    let every = config.every;
    let namespace = config.namespace.clone();
    let mut autoscaler = Autoscaler::new(config);
    let nodes: Api<Node> = Api::all(client.clone());
    let pods: Api<Pod> = Api::all(client.clone());
    let classes: Api<PriorityClass> = Api::all(client.clone());
    let jobs: Api<TrainingJob> = match &namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    tracing::info!(every = ?every, "autoscaler running");
    loop {
        let lp = ListParams::default();
        let listed = tokio::select! {
            _ = shutdown.cancelled() => return,
            l = async {
                tokio::try_join!(nodes.list(&lp), pods.list(&lp), classes.list(&lp), jobs.list(&lp))
            } => l,
        };
        match listed {
            Ok((n, p, c, j)) => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                let objects = Objects {
                    nodes: &n.items,
                    pods: &p.items,
                    priority_classes: &c.items,
                    jobs: &j.items,
                    now,
                };
                let (_, changes) = autoscaler.pass(&objects);
                for change in changes {
                    let api: Api<TrainingJob> = Api::namespaced(client.clone(), &change.namespace);
                    let patch = serde_json::json!({"spec": {"replicas": change.to}});
                    match api
                        .patch_scale(&change.name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                    {
                        Ok(_) => {
                            metrics.autoscaler_changes.inc();
                            let job = format!("{}/{}", change.namespace, change.name);
                            let (from, to) = (change.from, change.to);
                            match (from, to) {
                                (_, 0) => tracing::info!(
                                    %job, from,
                                    "autoscaler: job held without trainers, for a job worth more"
                                ),
                                (0, _) => tracing::info!(%job, to, "autoscaler: job resumed"),
                                _ => tracing::info!(%job, from, to, "autoscaler: trainers"),
                            }
                        }
                        Err(e) => {
                            autoscaler.not_applied(&change);
                            tracing::warn!(
                                job = %format!("{}/{}", change.namespace, change.name),
                                error = %e,
                                "autoscaler: cannot set the trainer count; asked again later"
                            );
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "autoscaler: cannot list the cluster; skipped"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

#[cfg(test)]
mod tests;
