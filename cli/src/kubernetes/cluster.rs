//! The verbs against a Kubernetes cluster, over `edl_operator::cluster`: `edl submit`,
//! `edl jobs`, and `edl status/scale/kill/logs` when a kubeconfig context is given
//! (`--context`, or `EDL_KUBE_CONTEXT`).

use std::io::Write;

use anyhow::Context;
use clap::Args;
use edl_job::JobName;
use edl_operator::cluster;
use edl_operator::objects::Role;

use crate::common::{runtime, shutdown_on_signals};
use crate::operator_cmd::JobSource;

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

/// Runs `edl submit`.
pub fn submit(args: SubmitArgs) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let (client, ns) = connect(&args.kube).await?;
        let tj = args.job.load(&ns)?;
        let tj = cluster::submit(&client, &ns, tj)
            .await
            .with_context(|| format!("submit {}", args.job.file.display()))?;
        println!(
            "trainingjob {}/{} submitted ({} trainers, {}..={}); `edl status {} --context ...` \
             follows it",
            ns,
            tj.metadata.name.as_deref().unwrap_or(""),
            tj.spec.cluster.trainers,
            tj.spec.cluster.min_trainers,
            tj.spec.cluster.max_trainers(),
            tj.metadata.name.as_deref().unwrap_or(""),
        );
        Ok(())
    })
}

/// Runs `edl jobs`.
pub fn jobs(args: JobsArgs) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let (client, ns) = connect(&args.kube).await?;
        let view = cluster::jobs(&client, (!args.all_namespaces).then_some(ns.as_str())).await?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&view)?);
        } else {
            print!("{}", cluster::render_jobs(&view));
        }
        Ok(())
    })
}

async fn connect(kube: &KubeArgs) -> anyhow::Result<(kube::Client, String)> {
    Ok(cluster::connect(kube.context.as_deref(), kube.namespace.as_deref()).await?)
}

/// `edl status JOB` on a cluster.
pub fn status(kube: &KubeArgs, job: &JobName, json: bool) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let (client, ns) = connect(kube).await?;
        let tj = cluster::status(&client, &ns, job.as_str()).await?;
        if json {
            println!("{}", serde_json::to_string_pretty(&tj)?);
        } else {
            print!("{}", cluster::render_status(&tj));
        }
        Ok(())
    })
}

/// `edl scale JOB --trainers N` on a cluster.
pub fn scale(kube: &KubeArgs, job: &JobName, trainers: u32) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let (client, ns) = connect(kube).await?;
        let want = cluster::scale(&client, &ns, job.as_str(), trainers).await?;
        if want != trainers {
            eprintln!("note: job {job} allows {want} trainers at that end of its range");
        }
        println!("trainingjob {ns}/{job}: desired trainers {want}");
        Ok(())
    })
}

/// `edl kill JOB` on a cluster.
pub fn kill(kube: &KubeArgs, job: &JobName) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let (client, ns) = connect(kube).await?;
        cluster::kill(&client, &ns, job.as_str()).await?;
        println!("trainingjob {ns}/{job}: deleted (its pods stop gracefully; trainers drain)");
        Ok(())
    })
}

/// `edl logs JOB` on a cluster.
pub fn logs(
    kube: &KubeArgs,
    job: &JobName,
    role: Option<Role>,
    follow: bool,
) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let (client, ns) = connect(kube).await?;
        let shutdown = shutdown_on_signals()?;
        let mut out = std::io::stdout();
        let print = |pod: &str, line: &str| {
            let _ = writeln!(out, "[{pod}] {line}");
        };
        tokio::select! {
            r = cluster::logs(&client, &ns, job.as_str(), role, follow, print) => r?,
            _ = shutdown.cancelled() => {}
        }
        Ok(())
    })
}
