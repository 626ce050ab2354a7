//! `edl pserver`: runs a parameter server of a job (one shard of the parameters).

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use edl_job::PserverLaunch;
use edl_pserver::{CheckpointEvery, IndexChoice, PsConfig};

use crate::common::{ListenArgs, RoleArgs};

/// Arguments of `edl pserver`.
#[derive(Debug, Args)]
pub struct PserverArgs {
    /// etcd, startup wait, job.
    #[command(flatten)]
    pub role: RoleArgs,
    /// Where to listen.
    #[command(flatten)]
    pub listen: ListenArgs,
    /// The shard index to claim: `auto` (the lowest free one) or a number. Either way the
    /// claim waits while another live pserver holds the index.
    #[arg(long, default_value = "auto")]
    pub index: IndexChoice,
    /// The job's shard count: sets `ps/desired` when the job has none; must match it
    /// otherwise. Without it, `ps/desired` must already be set.
    #[arg(long)]
    pub shards: Option<u32>,
    /// Where checkpoint files go (`<dir>/<job>/ps-<index>/`): a directory, or an object
    /// URL such as `s3://bucket/checkpoints` (credentials from the environment,
    /// docs/storage.md).
    #[arg(long)]
    pub checkpoint_dir: String,
    /// Checkpoint period: a step count (e.g. `1000`) or a duration (e.g. `30s`, `10m`).
    #[arg(long, default_value = "5m")]
    pub checkpoint_every: CheckpointEvery,
    /// Complete checkpoints kept.
    #[arg(long, default_value_t = 3)]
    pub keep_checkpoints: usize,
    /// TTL of the pserver's etcd lease: a dead pserver's index frees within about this.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub lease_ttl: Duration,
    /// Largest gRPC message in MiB (a push or pull of one shard).
    #[arg(long, default_value_t = 1024)]
    pub max_message_mib: usize,
    /// Bulk-path connections served at once. A new one over the bound takes the slot of
    /// the connection idle longest; it is closed only while every slot is in the middle
    /// of a request. A trainer uses about two at a time.
    #[arg(long, default_value_t = edl_job::launch::DEFAULT_MAX_BULK_CONNECTIONS)]
    pub max_bulk_connections: usize,
    /// Replicas of the shard, the primary included (docs/replication.md): start this
    /// many `edl pserver --index <i> --replicas <n>` processes for each shard; a lost
    /// process then costs no checkpoint restore while another replica is in sync. 1: a
    /// lost pserver is restored from its checkpoint.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=8))]
    pub replicas: u32,
    /// Serve Prometheus metrics at http://ADDR/metrics (behind the metrics token, else
    /// the job token, if any).
    #[arg(long, env = edl_job::env::METRICS_ADDR)]
    pub metrics_addr: Option<std::net::SocketAddr>,
}

impl PserverArgs {
    /// The settings these arguments say (what [`PserverLaunch::args`] renders).
    pub fn launch(&self) -> PserverLaunch {
        PserverLaunch {
            index: self.index,
            shards: self.shards,
            replicas: self.replicas,
            checkpoint_dir: self.checkpoint_dir.clone(),
            checkpoint_every: self.checkpoint_every,
            keep_checkpoints: self.keep_checkpoints,
            lease_ttl: self.lease_ttl,
            max_message_mib: self.max_message_mib,
            max_bulk_connections: self.max_bulk_connections,
        }
    }
}

/// Runs `edl pserver`.
pub fn run(args: PserverArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.shards != Some(0), "--shards must be at least 1");
    anyhow::ensure!(
        args.keep_checkpoints >= 1,
        "--keep-checkpoints must be at least 1"
    );
    let job = &args.role.job;
    let mut cfg = PsConfig::launch(job.job.clone(), &args.launch());
    cfg.token = job.token.clone();
    cfg.metrics_token = job.metrics_token.clone();
    cfg.tls = job.tls.load()?;
    cfg.advertise = args.listen.advertise.clone();
    cfg.etcd_wait = args.role.wait.etcd_wait;
    cfg.metrics_addr = args.metrics_addr;
    // A backup reaches its primary as a client does.
    cfg.peer_tls = cfg.tls.clone();
    anyhow::ensure!(
        cfg.replicas == 1 || matches!(cfg.index, IndexChoice::Fixed(_)),
        "--replicas {} needs --index: each replica names the shard it holds",
        cfg.replicas
    );
    // The bulk slots, and room beside them for gRPC, etcd and checkpoint files.
    let open_files = edl_role::raise_open_files();
    let needed = (args.max_bulk_connections as u64).saturating_add(1024);
    if open_files < needed {
        tracing::warn!(
            open_files,
            max_bulk_connections = args.max_bulk_connections,
            "the open-file limit is below --max-bulk-connections plus 1024: with many \
             trainers connections will be refused (raise `ulimit -n`, or lower \
             --max-bulk-connections)"
        );
    }
    crate::run::check_checkpoint_dir(&args.checkpoint_dir)?;
    args.role.run(|backend, shutdown| async move {
        let listener = args.listen.bind("pserver").await?;
        edl_pserver::run(backend, cfg, listener, shutdown)
            .await
            .context("pserver")
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::{Cli, Command};

    /// `edl pserver`'s defaults are the settings' own (one set of defaults for a pserver
    /// started by hand, by `edl run` and by the operator).
    #[test]
    fn the_defaults_are_the_launch_settings_defaults() {
        let cli = Cli::try_parse_from([
            "edl",
            "pserver",
            "--etcd",
            "http://e:1",
            "--job",
            "j",
            "--checkpoint-dir",
            "/c",
        ])
        .expect("parses");
        let Some(Command::Pserver(p)) = cli.command else {
            panic!("not a pserver");
        };
        assert_eq!(p.launch(), edl_job::PserverLaunch::new("/c"));
    }
}
