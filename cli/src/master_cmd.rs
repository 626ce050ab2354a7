//! `edl master`: runs a master of a job (one leads, the others stand by).

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use edl_job::MasterLaunch;
use edl_master::MasterConfig;

use crate::common::{ListenArgs, RoleArgs};

/// Arguments of `edl master`.
#[derive(Debug, Args)]
pub struct MasterArgs {
    /// etcd, startup wait, job.
    #[command(flatten)]
    pub role: RoleArgs,
    /// Where to listen.
    #[command(flatten)]
    pub listen: ListenArgs,
    /// Consecutive chunks of one file per task, for datasets defined without saying
    /// (a task is the unit of work a trainer leases).
    #[arg(long, default_value_t = 1)]
    pub chunks_per_task: u32,
    /// A task failing more than this many times in a pass fails for good.
    #[arg(long, default_value_t = 3)]
    pub max_failures: u32,
    /// A task lost more than this many times in a pass fails for good (its trainer lost
    /// or timed out with it, or its training taken away by a pserver restore); losses do
    /// not count as failures.
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
    /// Also serve Prometheus metrics at http://ADDR/metrics, in plain HTTP (behind the
    /// metrics token, else the job token, if any); they are always on the gRPC port.
    #[arg(long, env = edl_job::env::METRICS_ADDR)]
    pub metrics_addr: Option<std::net::SocketAddr>,
}

impl MasterArgs {
    /// The settings these arguments say (what [`MasterLaunch::args`] renders).
    pub fn launch(&self) -> MasterLaunch {
        MasterLaunch {
            chunks_per_task: self.chunks_per_task,
            max_failures: self.max_failures,
            max_losses: self.max_losses,
            lease_ttl: self.lease_ttl,
            task_timeout: self.task_timeout,
            min_task_timeout: self.min_task_timeout,
        }
    }
}

/// Runs `edl master`.
pub fn run(args: MasterArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.chunks_per_task > 0,
        "--chunks-per-task must be at least 1"
    );
    let job = &args.role.job;
    let mut cfg = MasterConfig::launch(job.job.clone(), &args.launch());
    cfg.token = job.token.clone();
    cfg.metrics_token = job.metrics_token.clone();
    cfg.metrics_addr = args.metrics_addr;
    cfg.tls = job.tls.load()?;
    cfg.advertise = args.listen.advertise.clone();
    // Once connected, the master retries etcd for as long as it runs.
    args.role.run(|backend, shutdown| async move {
        let listener = args.listen.bind("master").await?;
        edl_master::run(backend, cfg, listener, shutdown)
            .await
            .context("master")
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::{Cli, Command};

    /// `edl master`'s defaults are the settings' own (one set of defaults for a master
    /// started by hand, by `edl run` and by the operator).
    #[test]
    fn the_defaults_are_the_launch_settings_defaults() {
        let cli = Cli::try_parse_from(["edl", "master", "--etcd", "http://e:1", "--job", "j"])
            .expect("parses");
        let Some(Command::Master(m)) = cli.command else {
            panic!("not a master");
        };
        assert_eq!(m.launch(), edl_job::MasterLaunch::default());
    }
}
