//! What the decision asks for, in the order the controller applies it.

use edl_job::JobSpec;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;

use crate::crd::TrainingJobStatus;

/// The finalizer that keeps a deleted TrainingJob until its etcd keys are removed.
pub const FINALIZER: &str = "edl.dev/etcd-cleanup";

/// A change to the job's Kueue Workload.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkloadChange {
    /// Create it (`objects::workload`).
    Create(Box<serde_json::Value>),
    /// The job stopped after an eviction: clear its admission (quota given back) so
    /// that Kueue queues it again; the reason.
    Release(String),
    /// The job ended: mark it finished (Kueue frees its quota); the message.
    Finish(String),
    /// Set its `PodsReady` condition (Kueue's wait for pods ready): whether every pod
    /// of the admitted job runs.
    PodsReady(bool),
}

/// A change to the job's etcd keys.
#[derive(Debug, Clone, PartialEq)]
pub enum EtcdAction {
    /// Store the job spec at `job/spec` (before any process starts).
    PublishSpec(Box<JobSpec>),
    /// Set `scale/trainers`.
    WriteScale(u32),
    /// Delete every key of the job (the finalizer's work).
    DeleteJob,
    /// Delete the job's own etcd user and role (`edl-job-<ns>.<job>`), if the operator made
    /// them (the finalizer's work, after the keys).
    RemoveJobUser,
    /// Make the managed etcd's member at this peer URL a new one (its claim was lost):
    /// remove the started member there, add one (`EtcdBackend::replace_member`).
    ReplaceMember(String),
    /// Revoke the etcd leases a process that ended held (`edl_job::holders`), so that
    /// what it held passes on now instead of a lease TTL later: its tasks, its claim.
    Revoke(edl_job::holders::Holder),
}

/// A pod to delete.
#[derive(Debug, Clone, PartialEq)]
pub struct Deletion {
    /// The pod.
    pub name: String,
    /// Seconds it has to stop (`None`: its own `terminationGracePeriodSeconds`, the
    /// trainer's drain).
    pub grace: Option<i64>,
}

/// An Event to record on the TrainingJob.
#[derive(Debug, Clone, PartialEq)]
pub struct JobEvent {
    /// Whether it is a warning.
    pub warning: bool,
    /// CamelCase reason (`ScaledUp`, `PodReplaced`, ...).
    pub reason: String,
    /// What happened.
    pub message: String,
}

/// The finalizer change the plan asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalizerChange {
    /// Add [`FINALIZER`].
    Add,
    /// Remove it: the job's keys are gone.
    Remove,
}

/// What to do.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    /// The finalizer.
    pub finalizer: Option<FinalizerChange>,
    /// etcd changes.
    pub etcd: Vec<EtcdAction>,
    /// Pods to delete.
    pub delete: Vec<Deletion>,
    /// Pods to create.
    pub create_pods: Vec<Pod>,
    /// Services to create.
    pub create_services: Vec<Service>,
    /// PersistentVolumeClaims to create (before the pods that mount them).
    pub create_claims: Vec<PersistentVolumeClaim>,
    /// NetworkPolicies to create (before the pods).
    pub create_network_policies: Vec<NetworkPolicy>,
    /// PodDisruptionBudgets to create.
    pub create_disruption_budgets: Vec<PodDisruptionBudget>,
    /// NetworkPolicies to write over (unconditionally: the operator's is the one).
    pub replace_network_policies: Vec<NetworkPolicy>,
    /// Volcano PodGroups to create (before the pods).
    pub create_pod_groups: Vec<serde_json::Value>,
    /// Volcano PodGroups whose `spec.minMember` to set (the job held at 0 trainers, or
    /// no longer): name, minMember, minResources.
    pub pod_group_min_members: Vec<(String, u32, serde_json::Value)>,
    /// The change to the job's Kueue Workload.
    pub workload: Option<WorkloadChange>,
    /// The new status (`None`: leave it).
    pub status: Option<TrainingJobStatus>,
    /// Events.
    pub events: Vec<JobEvent>,
}

impl Plan {
    pub(super) fn event(&mut self, warning: bool, reason: &str, message: String) {
        self.events.push(JobEvent {
            warning,
            reason: reason.to_owned(),
            message,
        });
    }
}
