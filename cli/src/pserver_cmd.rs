//! `edl pserver`: runs a parameter server of a job (one shard of the parameters).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use edl_pserver::{CheckpointConfig, CheckpointEvery, IndexChoice, PsConfig};

use crate::common::{EtcdArgs, EtcdWaitArgs, JobArgs, runtime, shutdown_on_signals};

/// Arguments of `edl pserver`.
#[derive(Debug, Args)]
pub struct PserverArgs {
    /// etcd connection.
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Retrying etcd at startup.
    #[command(flatten)]
    pub wait: EtcdWaitArgs,
    /// The job.
    #[command(flatten)]
    pub job: JobArgs,
    /// The shard index to claim: `auto` (the lowest free one) or a number. Either way the
    /// claim waits while another live pserver holds the index.
    #[arg(long, default_value = "auto", value_parser = parse_index)]
    pub index: IndexChoice,
    /// The job's shard count: sets `ps/desired` when the job has none; must match it
    /// otherwise. Without it, `ps/desired` must already be set.
    #[arg(long)]
    pub shards: Option<u32>,
    /// Where checkpoint files go (`<dir>/<job>/ps-<index>/`).
    #[arg(long)]
    pub checkpoint_dir: PathBuf,
    /// Checkpoint period: a step count (e.g. `1000`) or a duration (e.g. `30s`, `10m`).
    #[arg(long, default_value = "5m", value_parser = parse_every)]
    pub checkpoint_every: CheckpointEvery,
    /// Complete checkpoints kept.
    #[arg(long, default_value_t = 3)]
    pub keep_checkpoints: usize,
    /// Address to serve on: gRPC and the bulk data path share it (port 0 picks a free
    /// port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Address trainers reach this pserver at (default: the bound listen address).
    #[arg(long)]
    pub advertise: Option<String>,
    /// TTL of the pserver's etcd lease: a dead pserver's index frees within about this.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub lease_ttl: Duration,
    /// Largest gRPC message in MiB (a push or pull of one shard).
    #[arg(long, default_value_t = 1024)]
    pub max_message_mib: usize,
    /// Write the bound address to this file once serving (for scripts and tests).
    #[arg(long)]
    pub addr_file: Option<PathBuf>,
}

fn parse_index(s: &str) -> Result<IndexChoice, String> {
    if s == "auto" {
        return Ok(IndexChoice::Auto);
    }
    s.parse::<u32>()
        .map(IndexChoice::Fixed)
        .map_err(|_| format!("{s:?} is neither `auto` nor a shard index"))
}

fn parse_every(s: &str) -> Result<CheckpointEvery, String> {
    s.parse()
}

/// Runs `edl pserver`.
pub fn run(args: PserverArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.shards != Some(0), "--shards must be at least 1");
    anyhow::ensure!(
        args.keep_checkpoints >= 1,
        "--keep-checkpoints must be at least 1"
    );
    runtime()?.block_on(async move {
        let shutdown = shutdown_on_signals()?;
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
        std::fs::create_dir_all(&args.checkpoint_dir)
            .with_context(|| format!("create checkpoint dir {}", args.checkpoint_dir.display()))?;
        let mut cfg = PsConfig::new(args.job.job.clone());
        cfg.token = args.job.token.clone();
        cfg.tls = args.job.tls.load()?;
        cfg.advertise = args.advertise.clone();
        cfg.lease_ttl = args.lease_ttl;
        cfg.etcd_wait = args.wait.etcd_wait;
        cfg.index = args.index;
        cfg.shards = args.shards;
        cfg.max_message_bytes = args.max_message_mib.saturating_mul(1 << 20);
        cfg.checkpoint = Some(CheckpointConfig {
            keep: args.keep_checkpoints,
            ..CheckpointConfig::new(&args.checkpoint_dir, args.checkpoint_every)
        });
        if let Some(path) = &args.addr_file {
            std::fs::write(path, addr.to_string())
                .with_context(|| format!("write {}", path.display()))?;
        }
        println!("pserver listening on {addr}");
        edl_pserver::run(backend, cfg, listener, shutdown)
            .await
            .context("pserver")?;
        Ok(())
    })
}
