//! What an autoscaler sees: the cluster's nodes and the elastic jobs on it, at one instant.
//!
//! The operator builds a [`Snapshot`] from the API server (nodes' allocatable resources,
//! the requests of every pod not finished, the TrainingJobs and their metrics), the
//! simulator from its own state, and `edl run` from the machine it runs on.

use serde::{Deserialize, Serialize};

use crate::Resources;

/// One node: what it offers and what the pods bound to it request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    /// The node's name (for messages only).
    pub name: String,
    /// Allocatable CPU, memory and GPUs.
    pub allocatable: Resources,
    /// The requests of the pods bound to the node and not finished.
    pub requested: Resources,
}

impl Node {
    /// Allocatable minus requested, floored at zero.
    pub fn idle(&self) -> Resources {
        self.allocatable.saturating_sub(&self.requested)
    }
}

/// How many of a job's trainer pods are in which state (pservers and masters are not
/// counted here, as EDL's `JobPods` did not; they are in [`JobView::waiting`] and the
/// nodes' requests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodCounts {
    /// Trainer pods not finished.
    pub total: u32,
    /// Pods running.
    pub running: u32,
    /// Pods not running yet: waiting for a node, or bound and starting (Kubernetes'
    /// phase `Pending`).
    pub pending: u32,
    /// Of those, the pods waiting for a node.
    pub unbound: u32,
}

/// A job's observed training speed with a number of trainers.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    /// Trainers that were running.
    pub trainers: u32,
    /// Work done per second (records/s), in the unit of [`JobView::remaining`].
    pub rate: f64,
}

/// One elastic (or fixed-size) training job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobView {
    /// The job's name (unique in the snapshot).
    pub name: String,
    /// Fewest trainers.
    pub min: u32,
    /// Most trainers (`min == max`: not elastic).
    pub max: u32,
    /// Higher first; jobs of a higher priority get their minimum first and are shrunk last.
    pub priority: i32,
    /// The requests of one trainer pod.
    pub trainer: Resources,
    /// The trainer count asked for now (the job's parallelism).
    pub trainers: u32,
    /// The requests of each of the job's pods (every role) waiting for a node.
    pub waiting: Vec<Resources>,
    /// The job's trainer pods by state.
    pub pods: PodCounts,
    /// When the job was submitted (seconds of the snapshot's clock): older jobs first on ties.
    pub submitted: f64,
    /// When the autoscaler last changed this job's trainer count, if ever.
    pub changed_at: Option<f64>,
    /// Recent speeds of the job (newest last); empty for a job that has not run yet.
    pub speed: Vec<Observation>,
    /// The job's work left (records), when known.
    pub remaining: Option<f64>,
}

impl JobView {
    /// Whether the job can be resized at all.
    pub fn is_elastic(&self) -> bool {
        self.min < self.max
    }

    /// Whether every trainer pod of the job is pending (EDL's "pending job").
    pub fn all_pending(&self) -> bool {
        self.pods.total > 0 && self.pods.pending == self.pods.total
    }

    /// Whether every trainer pod of the job runs.
    pub fn all_running(&self) -> bool {
        self.pods.total > 0 && self.pods.running == self.pods.total
    }
}

/// The cluster and its jobs at one instant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Seconds of the caller's clock.
    pub now: f64,
    /// Every schedulable node.
    pub nodes: Vec<Node>,
    /// The requests of pods not finished and not bound to a node.
    pub unplaced: Resources,
    /// The jobs the autoscaler may resize (and the fixed ones, which it only counts).
    pub jobs: Vec<JobView>,
}

impl Snapshot {
    /// Sum of the nodes' allocatable resources.
    pub fn total(&self) -> Resources {
        self.nodes.iter().map(|n| n.allocatable).sum()
    }

    /// Requests of every pod not finished, bound or not.
    pub fn requested(&self) -> Resources {
        self.nodes.iter().map(|n| n.requested).sum::<Resources>() + self.unplaced
    }
}

/// A new trainer count for one job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Target {
    /// Index of the job in [`Snapshot::jobs`].
    pub job: usize,
    /// Its trainer count before.
    pub from: u32,
    /// Its trainer count to set.
    pub to: u32,
}
