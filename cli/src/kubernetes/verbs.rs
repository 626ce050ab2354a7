//! The verbs against a Kubernetes cluster, over `edl_operator::verbs`: `edl submit`,
//! `edl jobs`, and `edl status/scale/kill/logs` when a kubeconfig context is given
//! (`--context`, or `EDL_KUBE_CONTEXT`). Their arguments are the parent module's.

use std::io::Write;

use anyhow::Context;
use edl_job::JobName;
use edl_operator::objects::Role;
use edl_operator::verbs;

use super::{JobsArgs, KubeArgs, SubmitArgs};
use crate::common::{runtime, shutdown_on_signals};

/// Runs `edl submit`.
pub fn submit(args: SubmitArgs) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let (client, ns) = connect(&args.kube).await?;
        let tj = args.job.load(&ns)?;
        let tj = verbs::submit(&client, &ns, tj)
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
        let view = verbs::jobs(&client, (!args.all_namespaces).then_some(ns.as_str())).await?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&view)?);
        } else {
            print!("{}", verbs::render_jobs(&view));
        }
        Ok(())
    })
}

async fn connect(kube: &KubeArgs) -> anyhow::Result<(kube::Client, String)> {
    Ok(verbs::connect(kube.context.as_deref(), kube.namespace.as_deref()).await?)
}

/// `edl status JOB` on a cluster.
pub fn status(kube: &KubeArgs, job: &JobName, json: bool) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let (client, ns) = connect(kube).await?;
        let tj = verbs::status(&client, &ns, job.as_str()).await?;
        if json {
            println!("{}", serde_json::to_string_pretty(&tj)?);
        } else {
            print!("{}", verbs::render_status(&tj));
        }
        Ok(())
    })
}

/// `edl scale JOB --trainers N` on a cluster.
pub fn scale(kube: &KubeArgs, job: &JobName, trainers: u32) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let (client, ns) = connect(kube).await?;
        let want = verbs::scale(&client, &ns, job.as_str(), trainers).await?;
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
        verbs::kill(&client, &ns, job.as_str()).await?;
        println!("trainingjob {ns}/{job}: deleted (its pods stop gracefully; trainers drain)");
        Ok(())
    })
}

/// `edl logs JOB` on a cluster.
pub fn logs(
    kube: &KubeArgs,
    job: &JobName,
    role: Option<&str>,
    follow: bool,
) -> anyhow::Result<()> {
    let role = match role {
        None => None,
        Some(r) => Some(
            Role::parse(r)
                .with_context(|| format!("--role {r}: use master, pserver, trainer or etcd"))?,
        ),
    };
    runtime()?.block_on(async move {
        let (client, ns) = connect(kube).await?;
        let shutdown = shutdown_on_signals()?;
        let mut out = std::io::stdout();
        let print = |pod: &str, line: &str| {
            let _ = writeln!(out, "[{pod}] {line}");
        };
        tokio::select! {
            r = verbs::logs(&client, &ns, job.as_str(), role, follow, print) => r?,
            _ = shutdown.cancelled() => {}
        }
        Ok(())
    })
}
