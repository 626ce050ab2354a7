//! `edl master`: runs a master of a job (one leads, the others stand by).

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use edl_master::{MasterConfig, queue::TimeoutPolicy};

use crate::common::{EtcdArgs, EtcdWaitArgs, JobArgs, runtime, shutdown_on_signals};

/// Arguments of `edl master`.
#[derive(Debug, Args)]
pub struct MasterArgs {
    /// etcd connection.
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Retrying etcd at startup.
    #[command(flatten)]
    pub wait: EtcdWaitArgs,
    /// The job.
    #[command(flatten)]
    pub job: JobArgs,
    /// Address to serve gRPC on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Address trainers reach this master at (default: the bound listen address).
    #[arg(long)]
    pub advertise: Option<String>,
    /// Consecutive chunks of one file per task, for datasets defined without saying
    /// (a task is the unit of work a trainer leases).
    #[arg(long, default_value_t = 1)]
    pub chunks_per_task: u32,
    /// A task failing more than this many times in a pass fails for good.
    #[arg(long, default_value_t = 3)]
    pub max_failures: u32,
    /// A task whose trainer is lost (or times out) with it more than this many times in a
    /// pass fails for good; losses do not count as failures.
    #[arg(long, default_value_t = 10)]
    pub max_losses: u32,
    /// TTL of the master's etcd lease: a dead leader is replaced within about this.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub lease_ttl: Duration,
    /// Task lease timeout until task durations are known (then it adapts).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5m")]
    pub task_timeout: Duration,
    /// Shortest adaptive task timeout.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub min_task_timeout: Duration,
    /// Write the bound address to this file once serving (for scripts and tests).
    #[arg(long)]
    pub addr_file: Option<std::path::PathBuf>,
}

/// Runs `edl master`.
pub fn run(args: MasterArgs) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let shutdown = shutdown_on_signals()?;
        // Once connected, the master retries etcd for as long as it runs.
        let Some(backend) = args
            .etcd
            .connect_waiting(args.wait.etcd_wait, &shutdown)
            .await?
        else {
            return Ok(());
        };
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("listen on {}", args.listen))?;
        let addr = listener.local_addr().context("listener address")?;
        if let Some(path) = &args.addr_file {
            std::fs::write(path, addr.to_string())
                .with_context(|| format!("write {}", path.display()))?;
        }
        let mut cfg = MasterConfig::new(args.job.job.clone());
        cfg.token = args.job.token.clone();
        cfg.tls = args.job.tls.load()?;
        cfg.advertise = args.advertise.clone();
        cfg.lease_ttl = args.lease_ttl;
        cfg.reconcile_every = args.lease_ttl;
        cfg.queue.max_failures = args.max_failures;
        cfg.queue.max_losses = args.max_losses;
        anyhow::ensure!(
            args.chunks_per_task > 0,
            "--chunks-per-task must be at least 1"
        );
        cfg.default_chunks_per_task = args.chunks_per_task;
        cfg.queue.timeout = TimeoutPolicy {
            initial: args.task_timeout.as_millis() as u64,
            floor: args.min_task_timeout.as_millis() as u64,
            ..TimeoutPolicy::default()
        };
        println!("master listening on {addr}");
        edl_master::run(backend, cfg, listener, shutdown)
            .await
            .context("master")?;
        Ok(())
    })
}
