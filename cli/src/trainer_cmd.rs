//! `edl trainer`: an elastic trainer of a job with the spec's built-in model: a thin
//! command over the public trainer API, [`edl_trainer::Trainer`] (which says what a
//! trainer does), the same one a `[trainer] entry` program calls.
//!
//! With `--spec FILE` it first stores that job spec in etcd (if the job has none);
//! otherwise it waits for the spec `edl run` stored. At the end it prints one JSON line
//! with its totals (`--report FILE` writes the same).
//!
//! Compute threads follow candle's `RAYON_NUM_THREADS` (all cores by default).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use edl_trainer::app::RunMode;
use edl_trainer::{DeviceChoice, ModelSource, Trainer};

use crate::common::RoleArgs;

/// Arguments of `edl trainer`.
#[derive(Debug, Args)]
pub struct TrainerArgs {
    /// etcd, startup wait, job.
    #[command(flatten)]
    pub role: RoleArgs,
    /// This trainer's id (default: `trainer-<pid>-<random>`).
    #[arg(long, env = edl_job::env::TRAINER_ID)]
    pub id: Option<String>,
    /// Compute device: auto (a GPU when one is usable), cpu, or cuda:N.
    #[arg(long, env = edl_job::env::DEVICE, default_value = "auto")]
    pub device: DeviceChoice,
    /// Store this TOML job spec in etcd (if the job has none) instead of waiting for one.
    #[arg(long)]
    pub spec: Option<PathBuf>,
    /// How long to wait for the job spec to appear in etcd.
    #[arg(long, env = edl_job::env::SPEC_WAIT, value_parser = humantime::parse_duration, default_value = "60s")]
    pub spec_wait: Duration,
    /// TTL of the registration lease (default: the spec's `cluster.lease_ttl`).
    #[arg(long, env = edl_job::env::LEASE_TTL, value_parser = humantime::parse_duration)]
    pub lease_ttl: Option<Duration>,
    /// Serve Prometheus metrics on this address (`GET /metrics`), e.g. 127.0.0.1:0.
    #[arg(long, env = edl_job::env::METRICS_ADDR)]
    pub metrics_addr: Option<SocketAddr>,
    /// Write the final totals (JSON) to this file.
    #[arg(long, env = edl_job::env::REPORT)]
    pub report: Option<PathBuf>,
    /// `train`, or `evaluate`: evaluate the job's current parameters once (the final
    /// ones once it finished) instead of training, and report the metric.
    #[arg(long, env = edl_job::env::MODE, default_value = "train", value_parser = ["train", "evaluate"])]
    pub mode: String,
}

/// Runs `edl trainer`: the public trainer API ([`edl_trainer::Trainer`]) with the spec's
/// built-in model.
pub fn run(args: TrainerArgs) -> anyhow::Result<()> {
    let role = &args.role;
    let mut t = Trainer::new(role.job.job.clone(), role.etcd.config()?)
        .device(args.device)
        .spec_wait(args.spec_wait)
        .etcd_wait(role.wait.etcd_wait);
    if let Some(id) = &args.id {
        t = t.id(id.clone());
    }
    if let Some(ttl) = args.lease_ttl {
        t = t.lease_ttl(ttl);
    }
    if let Some(addr) = args.metrics_addr {
        t = t.metrics_addr(addr);
    }
    if let Some(token) = &role.job.token {
        t = t.token(token.clone());
    }
    if let Some(token) = &role.job.metrics_token {
        t = t.metrics_token(token.clone());
    }
    if let Some(tls) = role.job.tls.load()? {
        t = t.tls(tls);
    }
    if let Some(path) = &args.report {
        t = t.report(path.clone());
    }
    if args.mode == "evaluate" {
        t = t.mode(RunMode::Evaluate);
    }
    if let Some(path) = &args.spec {
        let mut spec = edl_trainer::job::load(path)?;
        let job = &role.job.job;
        anyhow::ensure!(
            spec.name == *job,
            "--job {job} but the spec {} names job {}",
            path.display(),
            spec.name
        );
        edl_trainer::job::fit_stats(&mut spec)?;
        edl_trainer::job::check_data_fits_model(&spec)?;
        t = t.publish_spec(spec);
    }
    t.run_source(ModelSource::builtin())?;
    Ok(())
}
