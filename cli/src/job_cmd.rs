//! A running job's state and controls, from any machine that reaches etcd: `edl status`,
//! `edl scale`, `edl kill`, `edl logs`. With a kubeconfig context (`--context`) they work
//! on a TrainingJob of that cluster instead ([`crate::kubernetes`]).

use std::io::{Read, Seek, SeekFrom, Write};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use edl_job::{ControlRecord, JobKeys, JobName, JobSpec, Record, RunRecord, ScaleRecord};
use edl_master_client::overview::{
    JobStatus, MASTER_WAIT, STATUS_JSON_VERSION, job_names, job_status_with,
};
use serde::Serialize;

use crate::common::{EtcdArgs, runtime, shutdown_on_signals};
use crate::kubernetes::{self, JobsArgs, KubeArgs};

/// Arguments of `edl status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// etcd connection (a job of `edl run`).
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// A Kubernetes cluster instead (a TrainingJob).
    #[command(flatten)]
    pub kube: KubeArgs,
    /// Only this job.
    pub job: Option<JobName>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// The job token, to ask its master (a job with a token).
    #[arg(long, env = edl_job::env::TOKEN, hide_env_values = true)]
    pub token: Option<String>,
    /// TLS to the job's master.
    #[command(flatten)]
    pub tls: crate::common::TlsArgs,
}

/// Arguments of `edl scale`.
#[derive(Debug, Args)]
pub struct ScaleArgs {
    /// etcd connection (a job of `edl run`).
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// A Kubernetes cluster instead (a TrainingJob).
    #[command(flatten)]
    pub kube: KubeArgs,
    /// The job.
    pub job: JobName,
    /// Desired trainer count (kept within the spec's [min_trainers, max_trainers]; on
    /// Kubernetes, 0 holds the job without trainers, its masters and pservers running).
    #[arg(long)]
    pub trainers: u32,
}

/// Arguments of `edl kill`.
#[derive(Debug, Args)]
pub struct KillArgs {
    /// etcd connection (a job of `edl run`).
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// A Kubernetes cluster instead (a TrainingJob).
    #[command(flatten)]
    pub kube: KubeArgs,
    /// The job.
    pub job: JobName,
}

/// Arguments of `edl logs`.
#[derive(Debug, Args)]
pub struct LogsArgs {
    /// etcd connection (a job of `edl run`).
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// A Kubernetes cluster instead (a TrainingJob).
    #[command(flatten)]
    pub kube: KubeArgs,
    /// The job.
    pub job: JobName,
    /// Only this role: master, pserver or trainer.
    #[arg(long)]
    pub role: Option<String>,
    /// Keep printing what is appended (until Ctrl-C).
    #[arg(long, short)]
    pub follow: bool,
}

/// `edl status` output.
#[derive(Debug, Serialize)]
pub struct Overview {
    /// [`STATUS_JSON_VERSION`].
    pub version: u32,
    /// Jobs.
    pub jobs: Vec<JobStatus>,
    /// Jobs waiting for a master.
    pub pending_jobs: usize,
    /// Running trainers over all jobs.
    pub running_trainers: usize,
    /// This machine's 1-minute load average divided by its cores.
    pub cpu_utilisation: Option<f64>,
}

fn cpu_utilisation() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let load: f64 = text.split_whitespace().next()?.parse().ok()?;
    let cores = std::thread::available_parallelism().ok()?.get() as f64;
    Some(load / cores)
}

/// Runs `edl status`.
pub fn status(args: StatusArgs) -> anyhow::Result<()> {
    if args.kube.context.is_some() {
        return match &args.job {
            Some(job) => kubernetes::status(&args.kube, job, args.json),
            None => kubernetes::jobs(JobsArgs {
                kube: args.kube,
                all_namespaces: false,
                json: args.json,
            }),
        };
    }
    let tls = args.tls.load()?;
    runtime()?.block_on(async move {
        let backend = args.etcd.connect().await?;
        let names = match &args.job {
            Some(j) => vec![j.clone()],
            None => job_names(&backend).await?,
        };
        let mut jobs = Vec::new();
        for n in &names {
            jobs.push(job_status_with(&backend, n, args.token.as_deref(), tls.as_ref(), MASTER_WAIT).await?);
        }
        if let Some(j) = &args.job {
            anyhow::ensure!(
                jobs.first()
                    .is_some_and(|s| s.model.is_some() || !s.masters.is_empty()),
                "no job {j} in etcd at {}",
                args.etcd.etcd.join(",")
            );
        }
        let overview = Overview {
            version: STATUS_JSON_VERSION,
            pending_jobs: jobs.iter().filter(|j| j.state == "pending").count(),
            running_trainers: jobs.iter().map(|j| j.trainers.len()).sum(),
            cpu_utilisation: cpu_utilisation(),
            jobs,
        };
        if args.json {
            println!("{}", serde_json::to_string_pretty(&overview)?);
            return Ok(());
        }
        println!(
            "jobs {}  pending {}  running trainers {}  cpu {}",
            overview.jobs.len(),
            overview.pending_jobs,
            overview.running_trainers,
            overview
                .cpu_utilisation
                .map_or("?".into(), |u| format!("{:.0}%", u * 100.0))
        );
        for j in &overview.jobs {
            println!(
                "\n{}  [{}]  model {}",
                j.job,
                j.state,
                j.model.as_deref().unwrap_or("?")
            );
            if let Some(why) = &j.paused {
                println!("  paused: {why}");
            }
            if let Some(p) = j.pass {
                println!("  pass {}/{}", p.current, p.total);
            }
            if let Some(t) = j.tasks {
                println!(
                    "  tasks todo {}  pending {}  done {}  failed {}",
                    t.todo, t.pending, t.done, t.failed
                );
            }
            if let Some(r) = j.records_trained {
                println!("  records trained {r}");
            }
            println!(
                "  trainers {}{}: {}",
                j.trainers.len(),
                j.desired_trainers
                    .map_or(String::new(), |d| format!(" (desired {d})")),
                j.trainers.join(", ")
            );
            for p in &j.pservers {
                print_pserver(p);
            }
            for m in &j.masters {
                println!(
                    "  master {}{}",
                    m.address,
                    if m.leader { " (leader)" } else { "" }
                );
            }
            if let Some(g) = &j.goodput {
                println!(
                    "  goodput of {} trainers: {}",
                    g.trainers.len(),
                    edl_master_client::overview::goodput_line(&g.seconds)
                );
                for (t, s) in g.trainers.iter().filter(|(t, _)| j.trainers.contains(t)) {
                    println!("    {t}: {}", edl_master_client::overview::goodput_line(s));
                }
            }
            for t in &j.stuck {
                println!(
                    "  stuck trainer {}: no report on task {} for {:.1}s ({:.0}s ago; the task was handed out again)",
                    t.trainer, t.task, t.held_s, t.ago_s
                );
            }
            for f in &j.failures {
                println!("  failed {}: {}", f.task, f.reason);
            }
        }
        Ok(())
    })
}

/// Runs `edl scale`.
pub fn scale(args: ScaleArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.trainers >= 1, "--trainers must be at least 1");
    if args.kube.context.is_some() {
        return kubernetes::scale(&args.kube, &args.job, args.trainers);
    }
    runtime()?.block_on(async move {
        let backend = args.etcd.connect().await?;
        let spec = JobSpec::get(&backend, &args.job)
            .await?
            .with_context(|| format!("no job {} in etcd", args.job))?;
        let c = &spec.cluster;
        let want = args.trainers.clamp(c.min_trainers, c.max_trainers());
        if want != args.trainers {
            eprintln!(
                "note: job {} allows {}..={} trainers; asking for {want}",
                args.job,
                c.min_trainers,
                c.max_trainers()
            );
        }
        backend
            .put(
                &JobKeys::new(&args.job).scale_trainers(),
                ScaleRecord::new(want).encode(),
                None,
            )
            .await
            .context("write scale/trainers")?;
        println!("job {}: desired trainers {want}", args.job);
        Ok(())
    })
}

/// Runs `edl kill`.
pub fn kill(args: KillArgs) -> anyhow::Result<()> {
    if args.kube.context.is_some() {
        return kubernetes::kill(&args.kube, &args.job);
    }
    runtime()?.block_on(async move {
        let backend = args.etcd.connect().await?;
        let keys = JobKeys::new(&args.job);
        anyhow::ensure!(
            backend.get(&keys.spec()).await?.is_some(),
            "no job {} in etcd",
            args.job
        );
        backend
            .put(&keys.control(), ControlRecord::stop().encode(), None)
            .await
            .context("write job/control")?;
        println!(
            "job {}: stop requested (edl run stops every process gracefully)",
            args.job
        );
        Ok(())
    })
}

/// Runs `edl logs`.
pub fn logs(args: LogsArgs) -> anyhow::Result<()> {
    if args.kube.context.is_some() {
        return kubernetes::logs(&args.kube, &args.job, args.role.as_deref(), args.follow);
    }
    if let Some(r) = &args.role {
        anyhow::ensure!(
            matches!(r.as_str(), "master" | "pserver" | "trainer"),
            "--role must be master, pserver or trainer"
        );
    }
    runtime()?.block_on(async move {
        let backend = args.etcd.connect().await?;
        let run = backend
            .get(&JobKeys::new(&args.job).run())
            .await?
            .with_context(|| {
                format!(
                    "job {} was not started by `edl run` (no job/run key)",
                    args.job
                )
            })?;
        let run = RunRecord::decode(&run.value)?;
        let dir = std::path::PathBuf::from(run.dir).join("logs");
        let shutdown = shutdown_on_signals()?;
        let mut offsets: std::collections::BTreeMap<std::path::PathBuf, u64> = Default::default();
        loop {
            let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(&dir)
                .with_context(|| {
                    format!(
                        "read {} (logs live on the machine that ran the job)",
                        dir.display()
                    )
                })?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
                    name.ends_with(".log")
                        && args.role.as_deref().is_none_or(|r| name.starts_with(r))
                })
                .collect();
            files.sort();
            let mut out = std::io::stdout().lock();
            for f in files {
                let name = f
                    .file_stem()
                    .and_then(|n| n.to_str())
                    .unwrap_or_default()
                    .to_owned();
                let off = offsets.entry(f.clone()).or_insert(0);
                let mut file = std::fs::File::open(&f)?;
                file.seek(SeekFrom::Start(*off))?;
                let mut buf = Vec::new();
                file.read_to_end(&mut buf)?;
                // Whole lines only: a line being written is printed once complete.
                let whole = buf.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
                *off += whole as u64;
                for line in String::from_utf8_lossy(&buf[..whole]).lines() {
                    writeln!(out, "[{name}] {line}")?;
                }
            }
            out.flush()?;
            if !args.follow {
                return Ok(());
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
        }
    })
}

/// A shard's line in `edl status`; with replicas, one more line per replica.
fn print_pserver(p: &edl_master_client::overview::PserverStatus) {
    let serving = if p.address.is_empty() {
        "(no primary serving)"
    } else {
        &p.address
    };
    let Some(g) = &p.group else {
        println!("  pserver {}: {serving}", p.index);
        return;
    };
    let in_sync = g
        .replicas
        .iter()
        .filter(|r| matches!(r.state, "primary" | "in sync") && r.address.is_some())
        .count();
    let wanted = match g.wanted {
        0 => g.replicas.len(),
        n => n as usize,
    };
    println!(
        "  pserver {}: {serving}  replicas in sync {in_sync}/{wanted}  epoch {}  incarnation {}",
        p.index, g.epoch, g.incarnation
    );
    for r in &g.replicas {
        println!(
            "    {:<8} {}  {}",
            r.state,
            r.member,
            r.address.as_deref().unwrap_or("(gone: its lease ended)")
        );
    }
}
