//! `edl operator`: edl on Kubernetes. `run` runs the operator (controller, leader
//! election, `/metrics`, and with `--autoscale` edl's autoscaler) over the `edl-operator`
//! crate; `crd` prints the TrainingJob resource's definition (`deploy/crd.yaml`); `render`
//! prints the TrainingJob of a job spec and the objects the operator creates for it,
//! without a cluster (what `kubectl apply --dry-run` would get). Their arguments are the
//! parent module's.

use std::collections::BTreeSet;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use edl_autoscaler::policy::PolicyConfig;
use edl_job::JobSpec;
use edl_job::spec::Globs;
use edl_operator::TrainingJob;
use edl_operator::autoscale::{self, AutoscaleConfig};
use edl_operator::controller::{self, ControllerConfig};
use edl_operator::crd::EtcdSpec;
use edl_operator::leader::{self, LeaseElection};
use edl_operator::metrics::Metrics;
use edl_operator::objects::JobNetwork;
use edl_operator::reconcile::{Admission, EtcdState, JobCredentials, JobTls, Observed, reconcile};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::{JobSource, OperatorCommand, Place, RenderArgs, RunArgs};
use crate::common::{runtime, shutdown_on_signals};

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
        OperatorCommand::RestoreEtcd(args) => {
            print!("{}", super::etcd_restore::restore_pods(&args)?);
            Ok(ExitCode::SUCCESS)
        }
        OperatorCommand::RestoreEtcdMember(args) => {
            super::etcd_restore::restore_member(&args)?;
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
        match &self.data {
            Some(Place::Volume(v)) => tj.spec.volumes.data = Some(v.clone()),
            Some(Place::Url(url)) => {
                tj.spec.data.train = under(url, &tj.spec.data.train);
                if let Some(t) = &tj.spec.data.test {
                    tj.spec.data.test = Some(under(url, t));
                }
            }
            None => {}
        }
        match &self.checkpoints {
            Some(Place::Volume(v)) => tj.spec.volumes.checkpoints = Some(v.clone()),
            Some(Place::Url(url)) => tj.spec.cluster.checkpoint_dir = Some(url.clone()),
            None => {}
        }
        if let Some(secret) = &self.storage_secret {
            tj.spec.storage_secret = Some(secret.clone());
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

/// `globs` with each relative pattern put under the object URL `base`.
fn under(base: &str, globs: &Globs) -> Globs {
    let base = base.trim_end_matches('/');
    Globs::Many(
        globs
            .patterns()
            .into_iter()
            .map(|p| {
                if p.contains("://") || p.starts_with('/') {
                    p
                } else {
                    format!("{base}/{}", p.trim_start_matches("./"))
                }
            })
            .collect(),
    )
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
        claims: BTreeSet::new(),
        claims_going: BTreeSet::new(),
        network_policies: Default::default(),
        pod_groups: Default::default(),
        network: JobNetwork::default(),
        disruption_budgets: BTreeSet::new(),
        etcd: Ok(EtcdState::default()),
        etcd_members: None,
        // What an operator without admin credentials for the jobs' etcd creates: job pods
        // on a shared etcd take `<job>-edl-credentials` if it exists.
        credentials: JobCredentials::NotIssued,
        // The job's TLS Secret, which the operator makes before any pod.
        tls: JobTls::Ready(Default::default()),
        admission: Admission::NotQueued,
        lost_nodes: Default::default(),
        node_lost_after: ControllerConfig::default().node_lost_after,
        now: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
    });
    let mut docs = vec![serde_norway::to_string(&tj)?];
    for s in &plan.create_services {
        docs.push(serde_norway::to_string(s)?);
    }
    for b in &plan.create_disruption_budgets {
        docs.push(serde_norway::to_string(b)?);
    }
    for n in &plan.create_network_policies {
        docs.push(serde_norway::to_string(n)?);
    }
    for g in &plan.create_pod_groups {
        docs.push(serde_norway::to_string(g)?);
    }
    for c in &plan.create_claims {
        docs.push(serde_norway::to_string(c)?);
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
    let etcd_auth = args.etcd_access.auth()?;
    anyhow::ensure!(
        etcd_auth.is_none() || !args.etcd_endpoints.is_empty(),
        "--etcd-user needs --etcd-endpoints (or {}): the shared etcd's client URLs, the only \
         place the operator sends its credentials (a TrainingJob names its own endpoints)",
        edl_job::env::ETCD_ENDPOINTS
    );
    let network = JobNetwork {
        operator_namespace: args.lease_namespace.clone(),
        metrics_namespaces: args.metrics_namespaces.clone(),
        egress_namespaces: args.egress_namespaces.clone(),
        egress_cidrs: args.egress_cidrs.clone(),
    };
    network
        .check()
        .map_err(|e| anyhow::anyhow!("{e}: --egress-cidrs or EDL_EGRESS_CIDRS"))?;
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
            etcd_endpoints: args.etcd_endpoints.clone(),
            etcd_tls: args.etcd_access.tls(),
            instance: identity.clone(),
            network,
            kueue: args.kueue,
            node_lost_after: args.node_lost_after,
            ..ControllerConfig::default()
        };
        let election = LeaseElection {
            namespace: args.lease_namespace.clone(),
            name: "edl-operator".to_owned(),
            identity,
            lease: std::time::Duration::from_secs(15),
            renew: std::time::Duration::from_secs(5),
        };
        tracing::info!(namespace = ?args.namespace, "edl operator starting");
        let cost = args.autoscale_change_cost;
        anyhow::ensure!(
            cost.is_finite() && cost >= 0.0,
            "--autoscale-change-cost {cost}: give seconds, 0 or more"
        );
        let autoscale = args.autoscale.then(|| AutoscaleConfig {
            namespace: args.namespace.clone(),
            every: args.autoscale_every,
            policy: if args.autoscale_preempt {
                PolicyConfig::preemptive(args.autoscale_change_cost)
            } else {
                PolicyConfig::default()
            },
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `edl submit --data s3://... --checkpoints s3://... --storage-secret S`: relative
    /// data globs go under the data URL (absolute ones and URLs stay), the checkpoints
    /// URL is the job's `cluster.checkpoint_dir`, no volume is named, and the operator
    /// accepts the job; a `file://` URL (a path on this machine) is refused.
    #[test]
    fn submit_puts_relative_data_under_an_object_url_and_checkpoints_at_one() {
        let dir = tempfile::tempdir().expect("temp dir");
        let spec = dir.path().join("job.toml");
        std::fs::write(
            &spec,
            "name = \"mnist\"\n[data]\ntrain = [\"train-*.recordio\", \"/abs/x.recordio\"]\n\
             test = \"./test-*.recordio\"\n[model]\nkind = \"mnist_mlp\"\n",
        )
        .expect("write");
        let source = JobSource {
            file: spec,
            image: Some("edl:test".into()),
            data: Some("s3://datasets/mnist/".parse().expect("a URL")),
            checkpoints: Some("s3://ckpt/runs".parse().expect("a URL")),
            storage_secret: Some("s3-credentials".into()),
            etcd: Vec::new(),
        };
        let tj = source.load("ml").expect("load");
        assert_eq!(
            tj.spec.data.train.patterns(),
            ["s3://datasets/mnist/train-*.recordio", "/abs/x.recordio"]
        );
        assert_eq!(
            tj.spec.data.test.as_ref().map(Globs::patterns),
            Some(vec!["s3://datasets/mnist/test-*.recordio".to_owned()])
        );
        assert_eq!(
            tj.spec.cluster.checkpoint_dir.as_deref(),
            Some("s3://ckpt/runs")
        );
        assert_eq!(tj.spec.storage_secret.as_deref(), Some("s3-credentials"));
        assert!(tj.spec.volumes.data.is_none() && tj.spec.volumes.checkpoints.is_none());
        tj.job_spec().expect("the operator accepts it");
        let e = "file:///data".parse::<Place>().expect_err("a local URL");
        assert!(e.contains("not in the pods"), "{e}");
        assert!(matches!(
            "claim:data".parse::<Place>(),
            Ok(Place::Volume(_))
        ));
    }
}
