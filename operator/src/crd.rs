//! The `TrainingJob` custom resource (`edl.dev/v1alpha1`, namespaced, short name `tj`).
//!
//! Its spec is the job spec users already write (`data`, `model`, `trainer`, `train`,
//! `cluster`, the tables of `JOB.toml`, with the same keys) plus what a cluster needs:
//! the image, resources per role, etcd, volumes and a priority class. The job's name is
//! the resource's `metadata.name`.
//!
//! The scale subresource is `spec.cluster.trainers` (desired) and
//! `status.trainers.running` (observed), with `status.selector` selecting the trainer
//! pods, so `kubectl scale`, an HPA or edl's autoscaler can resize a job. The schema
//! checks `min_trainers <= trainers <= max_trainers`, or `trainers == 0`: the job held
//! without trainers (its masters and pservers stay); everything else about the job is
//! checked by the operator (parsing it as an [`edl_job::JobSpec`]), which marks the job
//! `Failed` with a condition naming the field.
//!
//! Layout: this file the resource's types; `crd/validate.rs` the operator's check of a
//! job ([`TrainingJob::job_spec`], [`InvalidJob`]).

use std::collections::BTreeMap;

use edl_job::JobSpec;
use edl_job::model::ModelSpec;
use edl_job::spec::{ClusterSpec, DataSpec, Globs, TrainSpec, TrainerSpec};
use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

mod validate;

pub use validate::{InvalidJob, MAX_NAME};

/// The API group of edl's resources.
pub const GROUP: &str = "edl.dev";

/// Where the data volume is mounted in every pod; relative data paths are relative to it.
pub const DATA_MOUNT: &str = "/data";

/// Where the checkpoint volume is mounted in pserver pods.
pub const CHECKPOINT_MOUNT: &str = "/checkpoints";

/// The spec of a TrainingJob: the tables of a job spec (`JOB.toml`) and what a cluster
/// needs.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "edl.dev",
    version = "v1alpha1",
    kind = "TrainingJob",
    plural = "trainingjobs",
    shortname = "tj",
    category = "edl",
    namespaced,
    status = "TrainingJobStatus",
    derive = "PartialEq",
    scale(
        spec_replicas_path = ".spec.cluster.trainers",
        status_replicas_path = ".status.trainers.running",
        label_selector_path = ".status.selector"
    ),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Pass", type_ = "integer", json_path = ".status.pass"),
    printcolumn(name = "Trainers", type_ = "integer", json_path = ".status.trainers.running"),
    printcolumn(name = "Desired", type_ = "integer", json_path = ".spec.cluster.trainers"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("!has(self.spec.cluster) || self.spec.cluster.trainers == 0 || self.spec.cluster.min_trainers <= self.spec.cluster.trainers").message("spec.cluster.trainers must be 0 (the job held without trainers) or at least spec.cluster.min_trainers"),
    validation = Rule::new("!has(self.spec.cluster) || !has(self.spec.cluster.max_trainers) || self.spec.cluster.trainers <= self.spec.cluster.max_trainers").message("spec.cluster.trainers must be at most spec.cluster.max_trainers"),
    validation = Rule::new("size(self.metadata.name) <= 40").message("metadata.name: at most 40 characters (pod names add a role and an index)")
)]
#[serde(rename_all = "camelCase")]
pub struct TrainingJobSpec {
    /// `[data]`: RecordIO globs, relative to the data volume's mount (`/data`).
    pub data: DataSpec,
    /// `[model]`: the built-in model (absent when `trainer.entry` brings its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelSpec>,
    /// `[trainer]`: the program that runs as each trainer (default `edl trainer`).
    #[serde(default, skip_serializing_if = "TrainerSpec::is_default")]
    pub trainer: TrainerSpec,
    /// `[train]`: training settings.
    #[serde(default)]
    pub train: TrainSpec,
    /// `[cluster]`: masters, pservers, trainers (the scale subresource) and their bounds.
    #[serde(default)]
    pub cluster: ClusterSpec,
    /// The edl image every pod of the job runs (its `edl` binary, and the trainer
    /// program of `trainer.entry`).
    #[schemars(length(min = 1))]
    pub image: String,
    /// `Always`, `IfNotPresent` or `Never` (default: Kubernetes').
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = "^(Always|IfNotPresent|Never)$"))]
    pub image_pull_policy: Option<String>,
    /// Resources of each role's container.
    #[serde(default, skip_serializing_if = "RoleResources::is_empty")]
    pub resources: RoleResources,
    /// The etcd the job coordinates through.
    #[serde(default)]
    pub etcd: EtcdSpec,
    /// Volumes for the data and the pservers' checkpoints.
    #[serde(default)]
    pub volumes: JobVolumes,
    /// The priority class of the job's pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// Where each role's pods may run and as whom: node selectors, tolerations, affinity,
    /// topology spread, image pull Secrets and service account, for every role (`all`)
    /// and per role (a role's setting replaces `all`'s, field by field).
    #[serde(default, skip_serializing_if = "RolePlacement::is_empty")]
    pub placement: RolePlacement,
    /// Seconds a deleted trainer has to drain (hand its task back) before it is killed
    /// (default 30).
    #[serde(default = "d_grace", skip_serializing_if = "is_d_grace")]
    #[schemars(range(min = 1, max = 3600))]
    pub drain_seconds: u32,
    /// Suspended: the job's pods are stopped and none is made until this is false
    /// again; its state (the task queue in etcd, the pservers' checkpoints) stays, and
    /// it resumes where it stopped. A running job is drained: its trainers hand their
    /// tasks back first, then its masters and pservers stop (each pserver writing a
    /// final checkpoint). An admission queue (Kueue) creates jobs suspended and resumes
    /// them once admitted; a person may suspend one by hand.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub suspend: bool,
    /// No TLS between the job's pods. By default they talk over mutual TLS with the
    /// job's own CA (the Secret `<job>-edl-ca`, which the operator makes and the job
    /// owns), each role with its own certificate (`<job>-edl-tls-<role>`): a pod
    /// accepts only peers with a certificate of that CA.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub plaintext: bool,
    /// Schedule the job's pods with Volcano, as one gang: the operator makes a PodGroup
    /// (`scheduling.volcano.sh/v1beta1`) whose `minMember` is the job at its smallest
    /// (etcd members, masters, pservers and `min_trainers` trainers), and its pods name
    /// the `volcano` scheduler and the group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volcano: Option<VolcanoSpec>,
    /// A Secret of the job's namespace whose keys are the object store's variables
    /// (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT_URL`;
    /// `GOOGLE_APPLICATION_CREDENTIALS`; `AZURE_STORAGE_ACCOUNT_NAME`, ...): every
    /// master, pserver and trainer pod takes them as its environment. Required when the
    /// data globs or `cluster.checkpoint_dir` are object URLs (docs/storage.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_secret: Option<String>,
}

/// How a job is scheduled by Volcano.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolcanoSpec {
    /// The Volcano queue (default: Volcano's `default` queue).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
}

fn d_grace() -> u32 {
    30
}

fn is_d_grace(s: &u32) -> bool {
    *s == d_grace()
}

/// Where a job's pods go, for every role and per role ([`TrainingJobSpec::placement`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolePlacement {
    /// Every role's pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub all: Option<Placement>,
    /// Masters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master: Option<Placement>,
    /// Parameter servers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pserver: Option<Placement>,
    /// Trainers (GPU nodes: their `nodeSelector` and `tolerations`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainer: Option<Placement>,
    /// The job's own etcd (`etcd.managed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd: Option<Placement>,
}

impl RolePlacement {
    fn is_empty(&self) -> bool {
        self == &RolePlacement::default()
    }
}

/// Where a pod may run and as whom: the fields of a Kubernetes `PodSpec` of the same names.
/// (Priority is the job's, `priorityClassName`: the autoscaler, Kueue and Volcano read
/// it there.)
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    /// Labels a node must have.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Taints the pod tolerates (a GPU node's `nvidia.com/gpu`, for one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<k8s_openapi::api::core::v1::Toleration>,
    /// Node and pod affinity (a Kubernetes `Affinity`). A replicated pserver's own
    /// anti-affinity (replicas of a shard on different nodes) is added to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "opaque_object")]
    pub affinity: Option<serde_json::Value>,
    /// How the pods spread over topology domains (Kubernetes
    /// `TopologySpreadConstraint`s).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "opaque_list")]
    pub topology_spread_constraints: Vec<serde_json::Value>,
    /// Secrets of the job's namespace to pull the image with.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<k8s_openapi::api::core::v1::LocalObjectReference>,
    /// The pods' service account (its token is not mounted: job processes do not call
    /// the API server; a workload identity webhook may still project its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
}

/// The schema of a Kubernetes object kept as written: an `Affinity` or a
/// `TopologySpreadConstraint`'s full schema in each of a job's five placements would
/// take the CRD past what `kubectl apply` can annotate (256 KiB). The operator reads
/// them when it checks the job: one that is not what its field says is an invalid job,
/// named by its field.
fn opaque_object(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true
    })
}

/// A list of [`opaque_object`]s.
fn opaque_list(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "array",
        "items": opaque_object(g)
    })
}

/// A [`Placement`] read: its kept-as-written fields as Kubernetes types.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodPlacement {
    /// `nodeSelector`.
    pub node_selector: BTreeMap<String, String>,
    /// `tolerations`.
    pub tolerations: Vec<k8s_openapi::api::core::v1::Toleration>,
    /// `affinity`.
    pub affinity: Option<k8s_openapi::api::core::v1::Affinity>,
    /// `topologySpreadConstraints`.
    pub topology_spread_constraints: Vec<k8s_openapi::api::core::v1::TopologySpreadConstraint>,
    /// `imagePullSecrets`.
    pub image_pull_secrets: Vec<k8s_openapi::api::core::v1::LocalObjectReference>,
    /// `serviceAccountName`.
    pub service_account_name: Option<String>,
}

impl Placement {
    /// `role`'s placement over `all`'s: each field of `role` that is set replaces `all`'s.
    pub fn over(role: Option<&Placement>, all: Option<&Placement>) -> Placement {
        let (r, a) = (
            role.cloned().unwrap_or_default(),
            all.cloned().unwrap_or_default(),
        );
        fn pick<T>(r: T, a: T, set: impl Fn(&T) -> bool) -> T {
            if set(&r) { r } else { a }
        }
        Placement {
            node_selector: pick(r.node_selector, a.node_selector, |m| !m.is_empty()),
            tolerations: pick(r.tolerations, a.tolerations, |v| !v.is_empty()),
            affinity: r.affinity.or(a.affinity),
            topology_spread_constraints: pick(
                r.topology_spread_constraints,
                a.topology_spread_constraints,
                |v| !v.is_empty(),
            ),
            image_pull_secrets: pick(r.image_pull_secrets, a.image_pull_secrets, |v| {
                !v.is_empty()
            }),
            service_account_name: r.service_account_name.or(a.service_account_name),
        }
    }

    /// Its fields as Kubernetes types; an error says which field (under `at`, e.g.
    /// `spec.placement.trainer`) is not what it should be.
    pub fn read(&self, at: &str) -> Result<PodPlacement, InvalidJob> {
        let bad = |field: &str, e: serde_json::Error| {
            InvalidJob::new(format!("{at}.{field}"), e.to_string())
        };
        let affinity = match &self.affinity {
            Some(v) => Some(serde_json::from_value(v.clone()).map_err(|e| bad("affinity", e))?),
            None => None,
        };
        let topology_spread_constraints = self
            .topology_spread_constraints
            .iter()
            .map(|v| serde_json::from_value(v.clone()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad("topologySpreadConstraints", e))?;
        Ok(PodPlacement {
            node_selector: self.node_selector.clone(),
            tolerations: self.tolerations.clone(),
            affinity,
            topology_spread_constraints,
            image_pull_secrets: self.image_pull_secrets.clone(),
            service_account_name: self.service_account_name.clone(),
        })
    }
}

/// Resource requirements per role.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RoleResources {
    /// Masters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master: Option<ResourceRequirements>,
    /// Parameter servers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pserver: Option<ResourceRequirements>,
    /// Trainers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainer: Option<ResourceRequirements>,
    /// The job's own etcd (`etcd.managed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd: Option<ResourceRequirements>,
}

impl RoleResources {
    fn is_empty(&self) -> bool {
        self == &RoleResources::default()
    }
}

/// Which etcd the job uses: an existing one (`endpoints`) or one the operator runs for
/// the job (`managed`: `members` pods `<job>-etcd-<i>`, each with its data on a claim of
/// its own, so that losing a member's pod loses nothing).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "(has(self.endpoints) && size(self.endpoints) > 0) != (has(self.managed) && self.managed)",
    "message": "set exactly one of etcd.endpoints and etcd.managed"
}]))]
pub struct EtcdSpec {
    /// Client URLs of an existing etcd.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<String>,
    /// Run an etcd for this job.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub managed: bool,
    /// The image of the managed etcd (default `quay.io/coreos/etcd:v3.5.17`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Members of the managed etcd: 3 (default) keeps it available through the loss of
    /// one; 1 for a small job; at most 7, odd.
    #[serde(default = "d_members", skip_serializing_if = "is_d_members")]
    #[schemars(range(min = 1, max = 7))]
    pub members: u32,
    /// The claims of the managed etcd's members (one each).
    #[serde(default, skip_serializing_if = "ClaimTemplate::is_default")]
    pub claims: ClaimTemplate,
    /// TLS to the existing etcd (`endpoints`, `https://`): the job's pods verify it with
    /// the CA in a Secret of the job's namespace. (A managed etcd always speaks the job's
    /// own mutual TLS.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<SharedEtcdTls>,
    /// Periodic snapshots of the managed etcd (what `etcdctl snapshot save` writes), taken
    /// by the job's leading master into the job's object store; restored with `etcdutl
    /// snapshot restore` (docs/kubernetes.md, "Restoring the managed etcd"). By default,
    /// with an object-store `cluster.checkpoint_dir`: into its `etcd-snapshots` folder
    /// every 30 minutes, the newest 4 kept.
    #[serde(default, skip_serializing_if = "EtcdSnapshots::is_default")]
    pub snapshots: EtcdSnapshots,
}

/// Snapshots of a managed etcd ([`EtcdSpec::snapshots`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EtcdSnapshots {
    /// The folder they go to: an object URL (s3://, gs://, az://), reached with the
    /// credentials of `storageSecret`. Default: `<cluster.checkpoint_dir>/etcd-snapshots`
    /// when that is an object URL; otherwise none are taken unless this is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
    /// Time between snapshots ("30m" by default, "1h", ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every: Option<String>,
    /// Snapshots kept; the oldest are deleted (default 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub keep: Option<u32>,
    /// Take none.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub disabled: bool,
}

impl EtcdSnapshots {
    fn is_default(&self) -> bool {
        *self == EtcdSnapshots::default()
    }

    /// The folder snapshots go to, for a job whose checkpoints go to `checkpoint_dir`;
    /// `None`: none are taken.
    pub fn location(&self, checkpoint_dir: Option<&str>) -> Option<String> {
        if self.disabled {
            return None;
        }
        self.location.clone().or_else(|| {
            checkpoint_dir
                .filter(|d| d.contains("://"))
                .map(|d| format!("{}/etcd-snapshots", d.trim_end_matches('/')))
        })
    }

    /// What the leading master is told (the spec must be valid:
    /// [`TrainingJob::job_spec`]).
    pub fn launch(&self, checkpoint_dir: Option<&str>) -> Option<edl_job::SnapshotLaunch> {
        let every = self
            .every
            .as_deref()
            .and_then(|e| humantime::parse_duration(e).ok())
            .unwrap_or(edl_job::SnapshotLaunch::DEFAULT_EVERY);
        Some(edl_job::SnapshotLaunch {
            location: self.location(checkpoint_dir)?,
            every,
            keep: self.keep.unwrap_or(edl_job::SnapshotLaunch::DEFAULT_KEEP),
        })
    }
}

/// How a job's pods reach an existing etcd over TLS ([`EtcdSpec::tls`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SharedEtcdTls {
    /// The Secret of the job's namespace that holds the etcd's CA (`ca.crt`) and, with
    /// `clientCertificate`, the pods' client certificate and key (`tls.crt`, `tls.key`).
    /// Every master, pserver and trainer pod mounts it read-only at `/etc/edl/etcd-tls`.
    pub secret_name: String,
    /// The etcd requires client certificates (`--client-cert-auth`): the pods present
    /// the Secret's `tls.crt` and `tls.key`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub client_certificate: bool,
    /// The name the etcd's certificate is checked against, instead of the host dialled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
}

fn d_members() -> u32 {
    3
}

fn is_d_members(n: &u32) -> bool {
    *n == d_members()
}

impl Default for EtcdSpec {
    fn default() -> Self {
        EtcdSpec {
            endpoints: Vec::new(),
            managed: false,
            image: None,
            members: d_members(),
            claims: ClaimTemplate::default(),
            tls: None,
            snapshots: EtcdSnapshots::default(),
        }
    }
}

/// The default image of a managed etcd.
pub const ETCD_IMAGE: &str = "quay.io/coreos/etcd:v3.5.17";

/// The job's volumes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JobVolumes {
    /// The data, mounted read-only at `/data` in every pod (required unless the data
    /// globs are absolute paths inside the image).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<VolumeSource>,
    /// The pservers' checkpoints, mounted at `/checkpoints`: one volume every pserver
    /// pod mounts (a ReadWriteMany claim, a host path, or an `emptyDir`, which is lost
    /// with its pod and is marked by the `CheckpointsDurable` condition). Default: a
    /// PersistentVolumeClaim per pserver pod that the operator makes
    /// (`checkpointClaims`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoints: Option<VolumeSource>,
    /// The claims the operator makes for the pservers' checkpoints when `checkpoints`
    /// is not set: `<job>-checkpoints-<slot>`, one per pserver pod (ReadWriteOnce, so
    /// the replicas of a shard, on different nodes, each have their own).
    #[serde(default, skip_serializing_if = "ClaimTemplate::is_default")]
    pub checkpoint_claims: ClaimTemplate,
}

/// The PersistentVolumeClaims the operator makes for checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClaimTemplate {
    /// The storage class (default: the cluster's default class).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class_name: Option<String>,
    /// The size of each claim, a Kubernetes quantity (default `10Gi`).
    #[serde(default = "d_claim_size")]
    #[schemars(regex(pattern = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"))]
    pub size: String,
    /// Keep the claims (and the checkpoints on them) when the job is deleted; by
    /// default they are deleted with it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keep: bool,
}

fn d_claim_size() -> String {
    "10Gi".to_owned()
}

impl Default for ClaimTemplate {
    fn default() -> Self {
        ClaimTemplate {
            storage_class_name: None,
            size: d_claim_size(),
            keep: false,
        }
    }
}

impl ClaimTemplate {
    fn is_default(&self) -> bool {
        self == &ClaimTemplate::default()
    }
}

/// Where a volume comes from: exactly one of the fields.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "[has(self.claimName), has(self.hostPath), has(self.emptyDir) && self.emptyDir].filter(x, x).size() == 1",
    "message": "set exactly one of claimName, hostPath and emptyDir"
}]))]
pub struct VolumeSource {
    /// A PersistentVolumeClaim of the job's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_name: Option<String>,
    /// A directory on the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// An empty directory living as long as the pod.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub empty_dir: bool,
}

impl std::str::FromStr for VolumeSource {
    type Err = String;

    /// `claim:NAME` (a PersistentVolumeClaim), `host:/PATH` (a directory on the node) or
    /// `empty` (an emptyDir), as `edl submit --data/--checkpoints` take them.
    fn from_str(s: &str) -> Result<VolumeSource, String> {
        let v = match s.split_once(':') {
            Some(("claim", name)) if !name.is_empty() => VolumeSource {
                claim_name: Some(name.to_owned()),
                ..VolumeSource::default()
            },
            Some(("host", path)) if path.starts_with('/') => VolumeSource {
                host_path: Some(path.to_owned()),
                ..VolumeSource::default()
            },
            None if s == "empty" => VolumeSource {
                empty_dir: true,
                ..VolumeSource::default()
            },
            _ => {
                return Err(format!(
                    "{s:?}: use claim:NAME, host:/ABSOLUTE/PATH or empty"
                ));
            }
        };
        Ok(v)
    }
}

/// Where a job is in its life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Phase {
    /// Accepted; no pod is running yet.
    #[default]
    Created,
    /// Pods are being created or are not all running.
    Pending,
    /// Training.
    Running,
    /// Running with fewer or more trainers than desired, while they start or drain.
    Scaling,
    /// `spec.suspend`: its pods are stopped (or draining); it resumes where it stopped.
    Suspended,
    /// Every pass done.
    Succeeded,
    /// Given up (the Failed condition says why).
    Failed,
}

impl Phase {
    /// Whether the job is over.
    pub fn is_finished(self) -> bool {
        matches!(self, Phase::Succeeded | Phase::Failed)
    }
}

/// Trainer counts.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TrainerCounts {
    /// Trainer pods running (the scale subresource's `status.replicas`).
    pub running: u32,
    /// Trainers desired (`spec.cluster.trainers`).
    pub desired: u32,
    /// Trainers registered with the job in etcd.
    #[serde(default)]
    pub registered: u32,
}

/// The job's tasks in its current pass, as the master's queue holds them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TaskCounts {
    /// Waiting to be leased.
    pub todo: u64,
    /// Leased to a trainer.
    pub pending: u64,
    /// Done this pass.
    pub done: u64,
    /// Failed for good.
    pub failed: u64,
}

/// A recovery: a pod the operator replaced, or a process the job replaced on its own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Recovery {
    /// `master`, `pserver`, `trainer` or `etcd`.
    pub role: String,
    /// The pod.
    pub pod: String,
    /// Why it was replaced (`Failed: exit code 137`, `Deleted`, ...).
    pub reason: String,
    /// When (RFC 3339).
    pub time: String,
}

/// The most recoveries a status keeps.
pub const RECENT_RECOVERIES: usize = 10;

/// The observed state of a [`TrainingJob`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TrainingJobStatus {
    /// Where the job is.
    #[serde(default)]
    pub phase: Phase,
    /// Created, Running, Scaling, Succeeded, Failed (standard `metav1.Condition`s).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The current pass (0-based), from the job's state in etcd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pass: Option<u32>,
    /// The current pass's tasks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks: Option<TaskCounts>,
    /// Trainers.
    #[serde(default)]
    pub trainers: TrainerCounts,
    /// Parameter servers registered.
    #[serde(default)]
    pub pservers: u32,
    /// The leading master's address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leader: Option<String>,
    /// The latest recoveries, newest last.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recoveries: Vec<Recovery>,
    /// Replacements of each pod slot since its last healthy run (for the crash-loop
    /// limit `cluster.max_restarts`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub restarts: BTreeMap<String, u32>,
    /// Pods the operator deleted to replace them (ended ones), until their replacement
    /// is created.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replacing: Vec<String>,
    /// The managed etcd has formed (the operator read its membership once): a member
    /// made from now on joins it (`--initial-cluster-state=existing`), and one whose
    /// claim is lost is replaced in the membership first.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub etcd_formed: bool,
    /// The label selector of the trainer pods (the scale subresource's selector).
    #[serde(default)]
    pub selector: String,
    /// The job's name in its etcd: `<namespace>.<name>`, written before the job's first
    /// key or pod; a job whose status predates it keeps its bare name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd_job: Option<String>,
}

impl TrainingJob {
    /// A TrainingJob for a job spec (`edl submit`): the spec's name becomes the
    /// resource's name, its tables the resource's; its data globs are kept as written
    /// (relative ones are then relative to the data volume), so parse the file with
    /// [`JobSpec::parse_toml`], not `load`, which makes them absolute on this machine.
    pub fn from_job_spec(spec: &JobSpec, image: &str, namespace: Option<&str>) -> TrainingJob {
        let mut job = TrainingJob::new(
            spec.name.as_str(),
            TrainingJobSpec {
                data: spec.data.clone(),
                model: spec.model.clone(),
                trainer: spec.trainer.clone(),
                train: spec.train.clone(),
                cluster: ClusterSpec {
                    etcd: Vec::new(),
                    ..spec.cluster.clone()
                },
                image: image.to_owned(),
                image_pull_policy: None,
                resources: RoleResources::default(),
                etcd: if spec.cluster.etcd.is_empty() {
                    EtcdSpec {
                        managed: true,
                        ..EtcdSpec::default()
                    }
                } else {
                    EtcdSpec {
                        endpoints: spec.cluster.etcd.clone(),
                        ..EtcdSpec::default()
                    }
                },
                volumes: JobVolumes::default(),
                priority_class_name: None,
                placement: RolePlacement::default(),
                drain_seconds: d_grace(),
                suspend: false,
                plaintext: false,
                volcano: None,
                storage_secret: None,
            },
        );
        // Lists, always: the schema gives the globs one type.
        job.spec.data.train = Globs::Many(spec.data.train.patterns());
        if let Some(t) = &spec.data.test {
            job.spec.data.test = Some(Globs::Many(t.patterns()));
        }
        job.metadata.namespace = namespace.map(str::to_owned);
        job
    }

    /// Whether the job is live: not being deleted, not over, with a valid spec.
    pub(crate) fn is_live(&self) -> bool {
        self.metadata.deletion_timestamp.is_none()
            && !self.status.as_ref().is_some_and(|s| s.phase.is_finished())
            && self.job_spec().is_ok()
    }
}

/// The CustomResourceDefinition of [`TrainingJob`] as YAML (`deploy/crd.yaml`).
pub fn crd_yaml() -> String {
    use kube::CustomResourceExt;
    let crd = TrainingJob::crd();
    let body = serde_norway::to_string(&crd).unwrap_or_else(|e| {
        // The CRD is our own types serialised: this cannot fail.
        unreachable!("serialise the CRD: {e}")
    });
    format!(
        "# The TrainingJob resource (generated from operator/src/crd.rs: `edl operator crd`).\n\
         ---\n{body}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `deploy/crd.yaml` is the generated CRD (`UPDATE_DEPLOY=1` rewrites it).
    #[test]
    fn the_deployed_crd_is_the_generated_one() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/crd.yaml");
        let want = crd_yaml();
        if std::env::var_os("UPDATE_DEPLOY").is_some() {
            std::fs::write(&path, &want).expect("write deploy/crd.yaml");
        }
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            have == want,
            "deploy/crd.yaml is not the CRD of operator/src/crd.rs: regenerate it with \
             `UPDATE_DEPLOY=1 cargo test -p edl-operator the_deployed_crd`"
        );
        // `kubectl apply` keeps the object it applied, as JSON, in an annotation, and the
        // API server refuses annotations over 256 KiB.
        use kube::CustomResourceExt;
        let json = serde_json::to_string(&TrainingJob::crd()).expect("json");
        assert!(
            json.len() < 256 * 1024,
            "the CRD is {} bytes of JSON: too large for `kubectl apply`",
            json.len()
        );
    }

    #[test]
    fn the_crd_has_the_scale_subresource_and_the_bounds() {
        use kube::CustomResourceExt;
        let crd = serde_json::to_value(TrainingJob::crd()).expect("json");
        let v = &crd["spec"]["versions"][0];
        assert_eq!(v["name"], "v1alpha1");
        let scale = &v["subresources"]["scale"];
        assert_eq!(scale["specReplicasPath"], ".spec.cluster.trainers");
        assert_eq!(scale["statusReplicasPath"], ".status.trainers.running");
        assert_eq!(scale["labelSelectorPath"], ".status.selector");
        assert!(v["subresources"]["status"].is_object());
        let text = crd.to_string();
        assert!(text.contains("self.spec.cluster.min_trainers <= self.spec.cluster.trainers"));
        let spec = &v["schema"]["openAPIV3Schema"]["properties"]["spec"];
        assert_eq!(
            spec["properties"]["data"]["properties"]["train"]["type"],
            "array"
        );
        assert_eq!(
            spec["properties"]["model"]["x-kubernetes-preserve-unknown-fields"],
            true
        );
        assert_eq!(crd["spec"]["names"]["shortNames"][0], "tj");
    }

    #[test]
    fn a_managed_etcd_has_an_odd_member_count() {
        let spec = JobSpec::parse_toml(
            "name = \"wine\"\n[data]\ntrain = \"/d/wine-*.recordio\"\n\
             [model]\nkind = \"mlp\"\ninputs = 13\nhidden = [32]\nclasses = 3\n",
        )
        .expect("spec");
        let mut tj = TrainingJob::from_job_spec(&spec, "edl:1", Some("ml"));
        assert!(tj.spec.etcd.managed && tj.spec.etcd.members == 3);
        assert!(tj.job_spec().is_ok());
        for bad in [0, 2, 4, 9] {
            tj.spec.etcd.members = bad;
            let e = tj.job_spec().expect_err("refused");
            assert_eq!(e.field, "spec.etcd.members", "{e}");
        }
        tj.spec.etcd.members = 1;
        assert!(tj.job_spec().is_ok());
    }

    #[test]
    fn a_job_spec_round_trips_through_the_resource() {
        let spec = JobSpec::parse_toml(
            "name = \"wine\"\n[data]\ntrain = \"wine-*.recordio\"\ntest = \"wine-test-*.recordio\"\n\
             [model]\nkind = \"mlp\"\ninputs = 13\nhidden = [32]\nclasses = 3\n\
             [cluster]\ntrainers = 3\nmax_trainers = 6\n",
        )
        .expect("spec");
        let mut tj = TrainingJob::from_job_spec(&spec, "edl:1", Some("ml"));
        assert!(
            tj.spec.etcd.managed,
            "no etcd in the spec: the operator runs one"
        );
        tj.spec.volumes.data = Some(VolumeSource {
            claim_name: Some("wine".into()),
            ..VolumeSource::default()
        });
        // Through JSON, as the API server stores it.
        let json = serde_json::to_string(&tj).expect("json");
        let back: TrainingJob = serde_json::from_str(&json).expect("parse");
        assert_eq!(back, tj);
        let job = back.job_spec().expect("valid");
        assert_eq!(job.name, "wine");
        assert_eq!(job.model, spec.model);
        assert_eq!(job.cluster.trainers, 3);
        assert_eq!(
            job.data.test.expect("test").patterns(),
            vec!["/data/wine-test-*.recordio".to_owned()]
        );
    }
}
