//! `edl operator`: edl on Kubernetes. `run` runs the operator (controller, leader
//! election, `/metrics`, and with `--autoscale` edl's autoscaler) over the `edl-operator`
//! crate; `crd` prints the TrainingJob
//! resource's definition (`deploy/crd.yaml`); `render` prints the TrainingJob of a job
//! spec and the objects the operator creates for it, without a cluster (what `kubectl
//! apply --dry-run` would get).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Subcommand};
use edl_job::JobSpec;
use std::sync::Arc;

use edl_operator::TrainingJob;
use edl_operator::autoscale::{self, AutoscaleConfig};
use edl_operator::controller::{self, ControllerConfig};
use edl_operator::crd::{EtcdSpec, VolumeSource};
use edl_operator::leader::{self, Election};
use edl_operator::metrics::Metrics;
use edl_operator::reconcile::{Credentials, Observed, Progress, reconcile};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::common::{runtime, shutdown_on_signals};

/// `edl operator` subcommands.
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
    /// etcd user of the jobs' etcd, if it needs one. A user that may manage users (root)
    /// also gives each job on a shared etcd its own etcd user and token, in the Secret
    /// `<job>-edl-credentials` (docs/kubernetes.md, "Credentials").
    #[arg(long, env = "EDL_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// etcd password.
    #[arg(long, env = "EDL_ETCD_PASSWORD", hide_env_values = true)]
    pub etcd_password: Option<String>,
    /// Run edl's autoscaler on the leading replica: it resizes every elastic TrainingJob
    /// (min_trainers < max_trainers) through its scale subresource, from the nodes' room,
    /// the jobs' priorities (their PriorityClass) and observed speeds (docs/autoscaler.md).
    #[arg(long)]
    pub autoscale: bool,
    /// How often the autoscaler decides.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5s")]
    pub autoscale_every: std::time::Duration,
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
    /// The data volume, mounted read-only at /data (relative data globs are relative to
    /// it): claim:NAME (a PersistentVolumeClaim), host:/PATH or empty.
    #[arg(long, value_name = "VOLUME")]
    pub data: Option<VolumeSource>,
    /// The checkpoint volume, at /checkpoints: claim:NAME, host:/PATH or empty.
    #[arg(long, value_name = "VOLUME")]
    pub checkpoints: Option<VolumeSource>,
    /// Client URLs of an existing etcd for the job, comma-separated (default: the job
    /// spec's `cluster.etcd`, else an etcd the operator runs for the job).
    #[arg(long, value_delimiter = ',')]
    pub etcd: Vec<String>,
}

/// Runs an `edl operator` subcommand.
pub fn run(cmd: OperatorCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        OperatorCommand::Run(args) => run_operator(args).map(|()| ExitCode::SUCCESS),
        OperatorCommand::Crd => {
            print!("{}", edl_operator::crd::crd_yaml());
            Ok(ExitCode::SUCCESS)
        }
        OperatorCommand::Render(args) => {
            print!("{}", render(&args)?);
            Ok(ExitCode::SUCCESS)
        }
    }
}

impl JobSource {
    /// The TrainingJob this names, in `namespace`.
    pub fn load(&self, namespace: &str) -> anyhow::Result<TrainingJob> {
        let path = &self.file;
        let text =
            std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        let mut tj = if path.extension().is_some_and(|e| e == "toml") {
            let spec = JobSpec::parse_toml(&text).with_context(|| format!("{}", path.display()))?;
            let image = self.image.as_deref().with_context(|| {
                format!(
                    "{}: a job spec needs --image (the edl image its pods run)",
                    path.display()
                )
            })?;
            TrainingJob::from_job_spec(&spec, image, Some(namespace))
        } else {
            let mut tj: TrainingJob = serde_norway::from_str(&text)
                .with_context(|| format!("{}: not a TrainingJob", path.display()))?;
            tj.metadata.namespace = Some(namespace.to_owned());
            if let Some(image) = &self.image {
                tj.spec.image.clone_from(image);
            }
            tj
        };
        if let Some(v) = &self.data {
            tj.spec.volumes.data = Some(v.clone());
        }
        if let Some(v) = &self.checkpoints {
            tj.spec.volumes.checkpoints = Some(v.clone());
        }
        if !self.etcd.is_empty() {
            tj.spec.etcd = EtcdSpec {
                endpoints: self.etcd.clone(),
                ..EtcdSpec::default()
            };
        }
        Ok(tj)
    }
}

/// The YAML documents of `args`' job and of the objects its first reconcile creates.
pub fn render(args: &RenderArgs) -> anyhow::Result<String> {
    let tj = args.job.load(&args.namespace)?;
    tj.job_spec().with_context(|| {
        format!(
            "{}: the operator would fail this job",
            args.job.file.display()
        )
    })?;
    // The objects of a job whose resource exists (its uid is the API server's).
    let mut created = tj.clone();
    created.metadata.uid = Some("00000000-0000-0000-0000-000000000000".to_owned());
    created.metadata.generation = Some(1);
    let plan = reconcile(&Observed {
        job: &created,
        pods: Vec::new(),
        services: BTreeSet::new(),
        etcd: Ok(Progress::default()),
        // What an operator without admin credentials for the jobs' etcd creates: job pods
        // on a shared etcd take `<job>-edl-credentials` if it exists.
        credentials: Credentials::NotIssued,
        now: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
    });
    let mut docs = vec![serde_norway::to_string(&tj)?];
    for s in &plan.create_services {
        docs.push(serde_norway::to_string(s)?);
    }
    for p in &plan.create_pods {
        docs.push(serde_norway::to_string(p)?);
    }
    Ok(docs.into_iter().map(|d| format!("---\n{d}")).collect())
}

fn run_operator(args: RunArgs) -> anyhow::Result<()> {
    let identity = args
        .identity
        .clone()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| format!("edl-operator-{}", std::process::id()));
    let etcd_auth = match (&args.etcd_user, &args.etcd_password) {
        (Some(user), Some(password)) => Some(edl_coord::EtcdAuth {
            user: user.clone(),
            password: password.clone(),
        }),
        (None, None) => None,
        _ => anyhow::bail!("--etcd-user and --etcd-password go together"),
    };
    runtime()?.block_on(async move {
        let shutdown = shutdown_on_signals()?;
        let client = kube::Client::try_default().await.context(
            "connect to the Kubernetes API server (set KUBECONFIG, or run in a pod with a \
             service account)",
        )?;
        let metrics = Arc::new(Metrics::default());
        if let Some(addr) = args.metrics_addr {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("bind --metrics-addr {addr}"))?;
            let m = metrics.clone();
            let app = axum::Router::new().route(
                "/metrics",
                axum::routing::get(move || {
                    let m = m.clone();
                    async move { m.render() }
                }),
            );
            let stop = shutdown.clone();
            tokio::spawn(async move {
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(stop.cancelled_owned())
                    .await;
            });
        }
        let config = ControllerConfig {
            namespace: args.namespace.clone(),
            resync: args.resync,
            etcd_auth,
            instance: identity.clone(),
            ..ControllerConfig::default()
        };
        let election = Election {
            namespace: args.lease_namespace.clone(),
            name: "edl-operator".to_owned(),
            identity,
            lease: std::time::Duration::from_secs(15),
            renew: std::time::Duration::from_secs(5),
        };
        tracing::info!(namespace = ?args.namespace, "edl operator starting");
        let autoscale = args.autoscale.then(|| AutoscaleConfig {
            namespace: args.namespace.clone(),
            every: args.autoscale_every,
            ..AutoscaleConfig::default()
        });
        let c = client.clone();
        leader::run(client, election, shutdown, move |term| {
            let (c, config, metrics) = (c.clone(), config.clone(), metrics.clone());
            let autoscale = autoscale.clone();
            async move {
                metrics.leader.set(1);
                let scaler = async {
                    if let Some(a) = autoscale {
                        autoscale::run(c.clone(), a, metrics.clone(), term.clone()).await;
                    }
                };
                tokio::join!(
                    controller::run(c.clone(), config, metrics.clone(), term.clone()),
                    scaler
                );
                metrics.leader.set(0);
            }
        })
        .await;
        Ok(())
    })
}
