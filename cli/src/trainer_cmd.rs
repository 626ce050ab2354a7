//! `edl trainer`: an elastic trainer of a job (a thin command over
//! [`edl_trainer::process::run`], which says what a trainer does).
//!
//! With `--spec FILE` it first stores that job spec in etcd (if the job has none);
//! otherwise it waits for the spec `edl run` stored. At the end it prints one JSON line
//! with its totals (`--report FILE` writes the same).
//!
//! Compute threads follow candle's `RAYON_NUM_THREADS` (all cores by default).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use edl_coord::retry_startup;
use edl_job::SpecError;
use edl_trainer::DeviceChoice;
use edl_trainer::process::{TrainerConfig, TrainerError};

use crate::common::{EtcdArgs, EtcdWaitArgs, JobArgs, runtime, shutdown_on_signals};

/// Arguments of `edl trainer`.
#[derive(Debug, Args)]
pub struct TrainerArgs {
    /// etcd connection.
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Retrying etcd at startup.
    #[command(flatten)]
    pub wait: EtcdWaitArgs,
    /// The job.
    #[command(flatten)]
    pub job: JobArgs,
    /// This trainer's id (default: `trainer-<pid>-<random>`).
    #[arg(long)]
    pub id: Option<String>,
    /// Compute device: auto (a GPU when one is usable), cpu, or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    /// Store this TOML job spec in etcd (if the job has none) instead of waiting for one.
    #[arg(long)]
    pub spec: Option<PathBuf>,
    /// How long to wait for the job spec to appear in etcd.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "60s")]
    pub spec_wait: Duration,
    /// TTL of the registration lease (default: the spec's `cluster.lease_ttl`).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub lease_ttl: Option<Duration>,
    /// Serve Prometheus metrics on this address (`GET /metrics`), e.g. 127.0.0.1:0.
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// Write the final totals (JSON) to this file.
    #[arg(long)]
    pub report: Option<PathBuf>,
}

/// Runs `edl trainer`.
pub fn run(args: TrainerArgs) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let shutdown = shutdown_on_signals()?;
        let wait = args.wait.etcd_wait;
        let Some(backend) = args.etcd.connect_waiting(wait, &shutdown).await? else {
            tracing::info!("stopped while starting");
            return Ok(());
        };
        let job = args.job.job.clone();
        if let Some(path) = &args.spec {
            let mut spec = edl_trainer::job::load(path)?;
            anyhow::ensure!(
                spec.name == job,
                "--job {job} but the spec {} names job {}",
                path.display(),
                spec.name
            );
            edl_trainer::job::fit_stats(&mut spec)?;
            edl_trainer::job::check_data_fits_model(&spec)?;
            // Create-if-absent (or the same spec): a retry after a timeout is harmless.
            let published = retry_startup("store the job spec", wait, &shutdown, || async {
                match spec.publish(&backend).await {
                    Err(SpecError::Etcd { error, .. }) if error.is_retryable() => Err(error),
                    other => Ok(other),
                }
            })
            .await;
            match published {
                Ok(r) => {
                    r?;
                }
                Err(edl_coord::Error::Cancelled) => return Ok(()),
                Err(e) => return Err(anyhow::anyhow!("store the job spec in etcd: {e}")),
            }
        }
        let mut cfg = TrainerConfig::new(job);
        if let Some(id) = &args.id {
            cfg.id = id.clone();
        }
        cfg.device = args.device;
        cfg.lease_ttl = args.lease_ttl;
        cfg.metrics_addr = args.metrics_addr;
        cfg.token = args.job.token.clone();
        cfg.spec_wait = args.spec_wait;
        cfg.etcd_wait = wait;
        let rep = match edl_trainer::process::run(backend, cfg, shutdown).await {
            Ok(rep) => rep,
            Err(TrainerError::StoppedBeforeStart) => {
                tracing::info!("stopped while starting");
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        };
        let line = serde_json::to_string(&rep)?;
        println!("{line}");
        if let Some(path) = &args.report {
            std::fs::write(path, format!("{line}\n"))
                .with_context(|| format!("write {}", path.display()))?;
        }
        Ok(())
    })
}
