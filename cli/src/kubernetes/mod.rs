//! The Kubernetes verbs: `edl submit`, `edl jobs`, `edl operator run|crd|render`, and
//! `edl status|scale|kill|logs --context` on a TrainingJob of a cluster.
//!
//! Their arguments are parsed in every build, so `edl --help` is the same everywhere; the
//! verbs themselves need the `kubernetes` cargo feature (on by default; the Kubernetes
//! client, its API types and the `edl-operator` crate are about a third of a release
//! build, which `scripts/quickstart` leaves out). Without it each says so once, with the
//! command that builds it.
//!
//! Layout:
//! - this module: the verbs' arguments and the calls into their implementations.
//! - `verbs`: the verbs against a cluster (over `edl_operator::verbs`).
//! - `operator`: `edl operator` (over the `edl-operator` crate).
//! - `etcd_restore`: `edl operator restore-etcd` and `restore-etcd-member`.

// Without the feature the arguments are parsed and not used.
#![cfg_attr(not(feature = "kubernetes"), allow(unused_variables, dead_code))]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use edl_job::JobName;

#[cfg(feature = "kubernetes")]
mod etcd_restore;
#[cfg(feature = "kubernetes")]
mod operator;
#[cfg(feature = "kubernetes")]
mod verbs;

/// A volume of a TrainingJob: `claim:NAME`, `host:/PATH` or `empty`.
#[cfg(feature = "kubernetes")]
pub type VolumeSource = edl_operator::crd::VolumeSource;
/// A volume of a TrainingJob (checked where the `kubernetes` feature is built).
#[cfg(not(feature = "kubernetes"))]
pub type VolumeSource = String;

/// The error of a Kubernetes verb in a build without the `kubernetes` feature.
#[cfg(not(feature = "kubernetes"))]
fn without_kubernetes(verb: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "`{verb}` needs Kubernetes support, which this edl was built without (the quick \
         start's lean build); build it with `cargo build --release -p edl` (or `cargo \
         install --path cli`)"
    )
}

/// Calls the implementation of `verb`, or, without the `kubernetes` feature, says how
/// to get it.
macro_rules! kubernetes_verb {
    ($verb:expr, $call:expr) => {{
        #[cfg(feature = "kubernetes")]
        {
            $call
        }
        #[cfg(not(feature = "kubernetes"))]
        {
            Err(without_kubernetes($verb))
        }
    }};
}

/// Which cluster: a kubeconfig context and a namespace.
#[derive(Debug, Clone, Args)]
pub struct KubeArgs {
    /// The kubeconfig context of a Kubernetes cluster: the command works on the
    /// TrainingJob there (without it, `status/scale/kill/logs` work through etcd on a
    /// job of `edl run`).
    #[arg(long, env = "EDL_KUBE_CONTEXT")]
    pub context: Option<String>,
    /// The namespace (default: the context's).
    #[arg(long, short = 'n')]
    pub namespace: Option<String>,
}

/// Arguments of `edl submit`.
#[derive(Debug, Args)]
pub struct SubmitArgs {
    /// The job.
    #[command(flatten)]
    pub job: JobSource,
    /// The cluster (default: the kubeconfig's current context).
    #[command(flatten)]
    pub kube: KubeArgs,
}

/// Arguments of `edl jobs`.
#[derive(Debug, Args)]
pub struct JobsArgs {
    /// The cluster (default: the kubeconfig's current context).
    #[command(flatten)]
    pub kube: KubeArgs,
    /// Jobs of every namespace.
    #[arg(long, short = 'A')]
    pub all_namespaces: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// `edl operator` subcommands.
// Parsed once per process: the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum OperatorCommand {
    /// Run the operator: reconcile TrainingJobs into pods against the API server of the
    /// kubeconfig (KUBECONFIG, ~/.kube/config, or the pod's service account), one
    /// replica leading at a time.
    Run(RunArgs),
    /// Print the TrainingJob CustomResourceDefinition as YAML (deploy/crd.yaml).
    Crd,
    /// Print, as YAML, the TrainingJob of a job spec (JOB.toml) or of a TrainingJob
    /// file, then the pods and services the operator creates for it.
    Render(RenderArgs),
    /// Print the pods that restore a TrainingJob's managed etcd from a snapshot, one per
    /// member, to `kubectl apply -f -` while the operator is stopped (docs/kubernetes.md,
    /// "Restoring the managed etcd").
    RestoreEtcd(RestoreEtcdArgs),
    /// Make one managed etcd member's data directory from a snapshot with etcd's own
    /// tool (what the pods of `restore-etcd` run; the data it replaces is kept beside it).
    RestoreEtcdMember(RestoreEtcdMemberArgs),
}

/// Arguments of `edl operator restore-etcd`.
#[derive(Debug, Args)]
pub struct RestoreEtcdArgs {
    /// The TrainingJob (`kubectl get trainingjob JOB -o yaml > job.yaml`).
    #[command(flatten)]
    pub job: JobSource,
    /// Its namespace.
    #[arg(long, short = 'n', default_value = "default")]
    pub namespace: String,
    /// The snapshot: an object URL (read with the job's `storageSecret`), as the job's
    /// master names them (`.../snapshot-<unix ms>-r<revision>.db`).
    #[arg(long, value_name = "URL")]
    pub from: String,
}

/// Arguments of `edl operator restore-etcd-member`: `etcdutl snapshot restore`'s.
#[derive(Debug, Args)]
pub struct RestoreEtcdMemberArgs {
    /// The snapshot: an object URL (credentials from the environment, as for data) or a
    /// file.
    #[arg(long, value_name = "URL")]
    pub from: String,
    /// The member's name (its etcd's `--name`).
    #[arg(long)]
    pub name: String,
    /// The member's data directory (its etcd's `--data-dir`); what is there is moved to
    /// `<dir>.replaced` first (an older one is deleted).
    #[arg(long)]
    pub data_dir: PathBuf,
    /// Every member's `name=peer URL` (its etcd's `--initial-cluster`).
    #[arg(long)]
    pub initial_cluster: String,
    /// This member's peer URL.
    #[arg(long)]
    pub initial_advertise_peer_urls: String,
    /// The restored cluster's token.
    #[arg(long)]
    pub initial_cluster_token: String,
}

/// Arguments of `edl operator run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Only TrainingJobs of this namespace (default: all).
    #[arg(long)]
    pub namespace: Option<String>,
    /// Serve Prometheus metrics on this address (`GET /metrics`).
    #[arg(long)]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// The namespace of the leader election Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub lease_namespace: String,
    /// This replica's identity in the election (default: the host name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// How often a job's progress is read from its etcd.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5s")]
    pub resync: std::time::Duration,
    /// The shared etcd's credentials and TLS (`--etcd-user`, `--etcd-password`: a user
    /// that may manage users, e.g. root, also gives each job on it its own etcd user and
    /// token in the Secret `<job>-edl-credentials`; `--etcd-ca`, `--etcd-cert`,
    /// `--etcd-key`, `--etcd-domain`: TLS to it). docs/kubernetes.md, "Credentials".
    #[command(flatten)]
    pub etcd_access: crate::common::EtcdAccessArgs,
    /// The client URLs of the shared etcd that --etcd-user is for (comma-separated; needed
    /// with it): the operator sends its credentials only there, and refuses a job whose
    /// `etcd.endpoints` names another.
    #[arg(long, env = edl_job::env::ETCD_ENDPOINTS, value_delimiter = ',', value_name = "URLS")]
    pub etcd_endpoints: Vec<String>,
    /// Namespaces whose pods may scrape the jobs' metrics port (9090), comma-separated:
    /// where the cluster's Prometheus runs. Each job's NetworkPolicy denies everything it
    /// does not name; without this only the operator's pods scrape.
    #[arg(
        long,
        env = "EDL_METRICS_NAMESPACES",
        value_delimiter = ',',
        value_name = "NAMESPACES"
    )]
    pub metrics_namespaces: Vec<String>,
    /// Namespaces the jobs' pods may connect to, on any port (comma-separated): where a
    /// shared etcd or an object store runs in the cluster. Besides these, a job's pods
    /// reach only one another and the cluster DNS.
    #[arg(
        long,
        env = "EDL_EGRESS_NAMESPACES",
        value_delimiter = ',',
        value_name = "NAMESPACES"
    )]
    pub egress_namespaces: Vec<String>,
    /// Networks outside the cluster the jobs' pods may connect to, on any port
    /// (comma-separated CIDRs, like 10.20.0.0/16): a shared etcd or an object store
    /// outside it, a NodeLocal DNS cache (169.254.20.10/32).
    #[arg(
        long,
        env = "EDL_EGRESS_CIDRS",
        value_delimiter = ',',
        value_name = "CIDRS"
    )]
    pub egress_cidrs: Vec<String>,
    /// Run edl's autoscaler on the leading replica: it resizes every elastic TrainingJob
    /// (min_trainers < max_trainers) through its scale subresource, from the nodes' room,
    /// the jobs' priorities (their PriorityClass) and observed speeds (docs/autoscaler.md).
    #[arg(long)]
    pub autoscale: bool,
    /// How often the autoscaler decides.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5s")]
    pub autoscale_every: std::time::Duration,
    /// Let the autoscaler hold elastic jobs at 0 trainers (their masters and pservers
    /// stay) so that a job worth more need not wait, and admit jobs by their estimated
    /// time left: the settings measured best on every scenario of `edl sim`
    /// (docs/autoscaler.md).
    #[arg(long, requires = "autoscale")]
    pub autoscale_preempt: bool,
    /// Seconds of progress the autoscaler takes a trainer-count change to cost a job (it
    /// changes a job only when that saves more); with `--autoscale-preempt`.
    #[arg(
        long,
        value_name = "SECONDS",
        requires = "autoscale_preempt",
        default_value_t = 30.0
    )]
    pub autoscale_change_cost: f64,
    /// Admit each TrainingJob that names a Kueue LocalQueue (label
    /// `kueue.x-k8s.io/queue-name`) through a Kueue Workload of its own: the job runs
    /// only while Kueue admits it (docs/kubernetes.md, Kueue).
    #[arg(long)]
    pub kueue: bool,
    /// How long a node may be not Ready before the job pods bound to it are deleted at
    /// once and made again elsewhere (the cluster itself evicts them only after 5
    /// minutes, and then leaves them terminating until the node answers).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2m")]
    pub node_lost_after: std::time::Duration,
}

/// Arguments of `edl operator render`.
#[derive(Debug, Args)]
pub struct RenderArgs {
    /// The job.
    #[command(flatten)]
    pub job: JobSource,
    /// The namespace.
    #[arg(long, short = 'n', default_value = "default")]
    pub namespace: String,
}

/// A TrainingJob from a file: a job spec (`.toml`) or a TrainingJob (`.yaml`, `.json`),
/// with what a cluster needs on top (`edl operator render`, `edl submit`).
#[derive(Debug, Args)]
pub struct JobSource {
    /// A job spec (`.toml`) or a TrainingJob (`.yaml`, `.json`).
    pub file: PathBuf,
    /// The edl image of the job's pods (required for a job spec).
    #[arg(long, env = "EDL_IMAGE")]
    pub image: Option<String>,
    /// Where the data is; relative data globs are relative to it. A volume mounted
    /// read-only at /data: claim:NAME (a PersistentVolumeClaim), host:/PATH or empty; or
    /// an object URL (s3://bucket/prefix/, gs://, az://), read with the credentials of
    /// --storage-secret.
    #[arg(long, value_name = "VOLUME|URL")]
    pub data: Option<Place>,
    /// Where the pservers checkpoint. One volume for every pserver, at /checkpoints:
    /// claim:NAME (shared: ReadWriteMany), host:/PATH or empty; or an object URL
    /// (s3://bucket/checkpoints), with the credentials of --storage-secret. Default: a
    /// claim per pserver pod, made by the operator.
    #[arg(long, value_name = "VOLUME|URL")]
    pub checkpoints: Option<Place>,
    /// The Secret whose keys are the object store's variables (AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ...), given to the job's pods: needed for
    /// data or checkpoints at object URLs (docs/storage.md).
    #[arg(long, value_name = "SECRET")]
    pub storage_secret: Option<String>,
    /// Client URLs of an existing etcd for the job, comma-separated (default: the job
    /// spec's `cluster.etcd`, else an etcd the operator runs for the job).
    #[arg(long, value_delimiter = ',')]
    pub etcd: Vec<String>,
}

/// A volume, or an object URL: where `edl submit` puts a job's data or checkpoints.
#[derive(Debug, Clone)]
pub enum Place {
    /// A Kubernetes volume.
    Volume(VolumeSource),
    /// An object URL (`s3://bucket/prefix`).
    Url(String),
}

impl std::str::FromStr for Place {
    type Err = String;

    fn from_str(s: &str) -> Result<Place, String> {
        if !s.contains("://") {
            return s.parse().map(Place::Volume).map_err(|e| e.to_string());
        }
        match edl_storage::Location::parse(s) {
            Ok(l) if l.is_object() => Ok(Place::Url(s.to_owned())),
            Ok(_) => Err(format!(
                "{s:?}: a file:// URL is a path on this machine, not in the pods; use \
                 claim:NAME, host:/PATH or an object URL"
            )),
            Err(e) => Err(e.to_string()),
        }
    }
}

/// Runs `edl submit`.
pub fn submit(args: SubmitArgs) -> anyhow::Result<()> {
    kubernetes_verb!("edl submit", verbs::submit(args))
}

/// Runs `edl jobs`.
pub fn jobs(args: JobsArgs) -> anyhow::Result<()> {
    kubernetes_verb!("edl jobs", verbs::jobs(args))
}

/// `edl status JOB --context CTX`.
pub fn status(kube: &KubeArgs, job: &JobName, json: bool) -> anyhow::Result<()> {
    kubernetes_verb!("edl status --context", verbs::status(kube, job, json))
}

/// `edl scale JOB --trainers N --context CTX`.
pub fn scale(kube: &KubeArgs, job: &JobName, trainers: u32) -> anyhow::Result<()> {
    kubernetes_verb!("edl scale --context", verbs::scale(kube, job, trainers))
}

/// `edl kill JOB --context CTX`.
pub fn kill(kube: &KubeArgs, job: &JobName) -> anyhow::Result<()> {
    kubernetes_verb!("edl kill --context", verbs::kill(kube, job))
}

/// `edl logs JOB --context CTX`: `role` is master, pserver, trainer or etcd.
pub fn logs(
    kube: &KubeArgs,
    job: &JobName,
    role: Option<&str>,
    follow: bool,
) -> anyhow::Result<()> {
    kubernetes_verb!("edl logs --context", verbs::logs(kube, job, role, follow))
}

/// Runs an `edl operator` subcommand.
pub fn operator(cmd: OperatorCommand) -> anyhow::Result<ExitCode> {
    kubernetes_verb!("edl operator", operator::run(cmd))
}
