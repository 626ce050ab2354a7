//! What the decision looks at: one TrainingJob, its pods and objects by label, its
//! state in etcd, its Secrets, its Kueue admission, and the time.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::networking::v1::NetworkPolicySpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::crd::{TaskCounts, TrainingJob};
use crate::objects::{JobNetwork, Slot};

/// A pod's phase (`status.phase`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodPhase {
    /// Accepted, not all containers started.
    Pending,
    /// Running.
    Running,
    /// Exited 0.
    Succeeded,
    /// Exited otherwise, or was killed.
    Failed,
    /// The node stopped reporting.
    Unknown,
}

impl PodPhase {
    pub(super) fn ended(self) -> bool {
        matches!(self, PodPhase::Succeeded | PodPhase::Failed)
    }
}

/// A pod of the job as the operator sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct PodView {
    /// Its name.
    pub name: String,
    /// Its slot (from its labels).
    pub slot: Slot,
    /// Its phase.
    pub phase: PodPhase,
    /// It has a deletion timestamp.
    pub terminating: bool,
    /// Why it is not running, when it is not: `(reason, message)` of a waiting container
    /// (`ImagePullBackOff`, `CreateContainerConfigError`, ...) or of the scheduler
    /// (`Unschedulable`: a missing claim, no room).
    pub problem: Option<(String, String)>,
    /// How long it ran, once it ended.
    pub ran_for: Option<Duration>,
    /// Its container's exit code, once it ended.
    pub exit_code: Option<i32>,
    /// The node it is bound to, once scheduled.
    pub node: Option<String>,
    /// Its uid (with its name, a trainer's id: `<name>.<uid>`).
    pub uid: Option<String>,
}

/// How the job ended, as its state in etcd says.
#[derive(Debug, Clone, PartialEq)]
pub enum Finished {
    /// Every pass trained.
    Succeeded,
    /// Given up, with the reason.
    Failed(String),
}

/// The job's state in etcd.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EtcdState {
    /// Whether `job/spec` is there.
    pub spec_published: bool,
    /// The current pass.
    pub pass: Option<u32>,
    /// The current pass's tasks.
    pub tasks: Option<TaskCounts>,
    /// Trainers registered.
    pub trainers: u32,
    /// Pservers registered.
    pub pservers: u32,
    /// The leading master's address.
    pub leader: Option<String>,
    /// `scale/trainers`.
    pub scale: Option<u32>,
    /// How the job ended, if it has.
    pub finished: Option<Finished>,
    /// Why the master paused the job (its etcd raised the space alarm: full), with
    /// what to do.
    pub paused: Option<String>,
    /// Trainers the master names stuck (a task lease timed out while they stayed
    /// registered), by trainer id (`<pod>.<uid>`).
    pub stuck: Vec<edl_master_client::overview::StuckTrainer>,
}

/// The job's own credentials (the Secret `<job>-edl-credentials`: its token, and on a
/// shared etcd its etcd user), as the controller found or made them.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum JobCredentials {
    /// The operator makes none for this job: it has no admin credentials for the shared
    /// etcd the job uses (or the job is not live). Pods of a job on a shared etcd take
    /// the Secret if it exists (one made by hand).
    #[default]
    NotIssued,
    /// The Secret exists (found, or made this round): every job process requires it.
    Ready,
    /// The operator could not make it: why. No job process starts without it.
    Failed(String),
}

/// The job's TLS Secret (`<job>-edl-tls`), as the controller found or made it.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum JobTls {
    /// The job asked for none (`spec.plaintext`).
    #[default]
    Plaintext,
    /// The Secrets exist: every job pod mounts its role's.
    Ready(TlsRenewals),
    /// The operator could not make it: why. No job process starts without it.
    Failed(String),
}

/// What the controller's look at the job's certificates found this round.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TlsRenewals {
    /// The Secrets whose certificate was issued again this round (a third of its life
    /// or less was left), with when the new one ends (RFC 3339).
    pub renewed: Vec<(String, String)>,
    /// When the job's CA ends (RFC 3339), if a certificate due for renewal already
    /// ends with it: only a new CA helps then.
    pub ca_ends: Option<String>,
}

/// The job's Kueue `Workload`, when the operator admits jobs through Kueue (`--kueue`)
/// and the job names a LocalQueue (label `kueue.x-k8s.io/queue-name`): the job runs
/// only while Kueue admits its Workload.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Admission {
    /// Not admitted through a Workload: the job runs unless suspended.
    #[default]
    NotQueued,
    /// Queued, without its Workload yet (the plan makes it).
    NoWorkload,
    /// Its Workload waits for Kueue (no quota reserved).
    Pending,
    /// Kueue admitted it, with the trainers it admitted (partial admission: as few as
    /// `min_trainers`; `None`: the count asked).
    Admitted {
        /// Trainers admitted.
        trainers: Option<u32>,
        /// Where the admitted flavors put each pod set's pods (by role name).
        placement: BTreeMap<String, crate::objects::FlavorPlacement>,
        /// Its `PodsReady` condition, as the operator last wrote it (`None`: not yet).
        pods_ready: Option<bool>,
    },
    /// Kueue admitted it with a flavor the operator cannot read (a ResourceFlavor
    /// that is gone, or does not read): why. The job waits as if not admitted: placed
    /// without the flavor, its pods could land where the flavor does not allow.
    Unplaced(String),
    /// Kueue evicted it (preempted, its quota gone): why. The job drains, then gives
    /// the quota back.
    Evicted(String),
    /// Its Workload is marked finished (the job ended).
    Finished,
}

/// Everything the decision looks at.
#[derive(Debug, Clone)]
pub struct Observed<'a> {
    /// The resource (spec, metadata, the status it had).
    pub job: &'a TrainingJob,
    /// Its pods (by the job's label).
    pub pods: Vec<PodView>,
    /// The names of its services.
    pub services: BTreeSet<String>,
    /// The names of its PersistentVolumeClaims.
    pub claims: BTreeSet<String>,
    /// Those of them being deleted (kept while a pod that has not ended mounts them):
    /// no pod that mounts one is made, or it would keep it for ever.
    pub claims_going: BTreeSet<String>,
    /// The names of its PodDisruptionBudgets.
    pub disruption_budgets: BTreeSet<String>,
    /// Its NetworkPolicies: name and spec.
    pub network_policies: BTreeMap<String, Option<NetworkPolicySpec>>,
    /// Its Volcano PodGroups (looked for only when it asks for Volcano): name, and
    /// `spec.minMember` (0 if it has none).
    pub pod_groups: BTreeMap<String, u32>,
    /// What its NetworkPolicy lets through besides its own pods.
    pub network: JobNetwork,
    /// Its state in etcd, or why etcd could not be read.
    pub etcd: Result<EtcdState, String>,
    /// Its managed etcd's membership, as the operator (root) read it this round; `None`
    /// when it has none or it did not answer.
    pub etcd_members: Option<Vec<edl_coord::EtcdMember>>,
    /// Its etcd credentials.
    pub credentials: JobCredentials,
    /// Its TLS Secret.
    pub tls: JobTls,
    /// Its Kueue Workload.
    pub admission: Admission,
    /// The nodes of its pods that are not Ready, each with the time it stopped being
    /// Ready (its `Ready` condition's `lastTransitionTime`).
    pub lost_nodes: BTreeMap<String, Time>,
    /// How long a node may be not Ready before its pods are replaced without waiting for
    /// it ([`ControllerConfig::node_lost_after`](crate::controller::ControllerConfig)).
    pub node_lost_after: Duration,
    /// Now.
    pub now: Time,
}
