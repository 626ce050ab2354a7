//! `edl master`: runs a master of a job (one leads, the others stand by).

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use edl_coord::{EtcdAuth, EtcdBackend, EtcdConfig};
use edl_job::{MasterLaunch, SnapshotLaunch};
use edl_master::MasterConfig;
use edl_master::snapshots::SnapshotConfig;

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
    /// Snapshots of the job's own etcd.
    #[command(flatten)]
    pub snapshots: SnapshotArgs,
    /// While standing by, keep a copy of the queue's records (about 1 KB of memory a
    /// task, as the leader holds), so that taking over rebuilds the queue from memory
    /// instead of reading every task record from etcd (docs/design.md, section 5).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub standby_copy: bool,
}

/// Snapshots of the job's own etcd (a managed etcd), taken by the leading master.
#[derive(Debug, Args)]
pub struct SnapshotArgs {
    /// Take periodic snapshots of the job's etcd (what `etcdctl snapshot save` writes)
    /// into this folder (a URL of an object store, or a path). Needs a user with etcd's
    /// root role: EDL_ETCD_SNAPSHOT_USER (default root) and EDL_ETCD_SNAPSHOT_PASSWORD,
    /// unless etcd has authentication off.
    #[arg(long)]
    pub etcd_snapshots: Option<String>,
    /// One snapshot every this long.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30m")]
    pub etcd_snapshot_every: Duration,
    /// Snapshots kept; the oldest are deleted.
    #[arg(long, default_value_t = SnapshotLaunch::DEFAULT_KEEP)]
    pub etcd_snapshot_keep: u32,
    /// The user snapshots are taken as (it needs the root role).
    #[arg(long, env = edl_job::env::ETCD_SNAPSHOT_USER, default_value = "root")]
    pub etcd_snapshot_user: String,
    /// Its password (only from the environment: a process's arguments are visible to
    /// every user of the machine).
    #[arg(skip = std::env::var(edl_job::env::ETCD_SNAPSHOT_PASSWORD).ok())]
    pub etcd_snapshot_password: Option<String>,
}

impl SnapshotArgs {
    /// The settings these arguments say.
    pub fn launch(&self) -> Option<SnapshotLaunch> {
        self.etcd_snapshots.as_ref().map(|location| SnapshotLaunch {
            location: location.clone(),
            every: self.etcd_snapshot_every,
            keep: self.etcd_snapshot_keep,
        })
    }

    /// How the master reaches etcd to take snapshots (`job`: how the role reaches it),
    /// and where they go; `None` when none are asked for.
    fn config(&self, job: &EtcdConfig) -> anyhow::Result<Option<Snapshots>> {
        let Some(launch) = self.launch() else {
            return Ok(None);
        };
        anyhow::ensure!(
            !launch.every.is_zero() && launch.keep > 0,
            "--etcd-snapshot-every and --etcd-snapshot-keep must be positive"
        );
        let (store, folder) = edl_storage::Location::parse(&launch.location)
            .and_then(|l| l.open())
            .with_context(|| format!("--etcd-snapshots {}", launch.location))?;
        let auth = match (&self.etcd_snapshot_password, &job.auth) {
            (Some(password), _) => Some(EtcdAuth {
                user: self.etcd_snapshot_user.clone(),
                password: password.clone(),
            }),
            (None, None) => None,
            (None, Some(_)) => anyhow::bail!(
                "--etcd-snapshots: etcd has authentication on, and a snapshot needs a user with \
                 its root role: set {} (and {} if not root)",
                edl_job::env::ETCD_SNAPSHOT_PASSWORD,
                edl_job::env::ETCD_SNAPSHOT_USER
            ),
        };
        Ok(Some(Snapshots {
            etcd: EtcdConfig {
                auth,
                ..job.clone()
            },
            store,
            folder,
            every: launch.every,
            keep: launch.keep as usize,
        }))
    }
}

/// Snapshots as asked for, before etcd is connected.
struct Snapshots {
    etcd: EtcdConfig,
    store: edl_storage::Store,
    folder: String,
    every: Duration,
    keep: usize,
}

impl Snapshots {
    async fn connect(self) -> anyhow::Result<SnapshotConfig> {
        Ok(SnapshotConfig {
            etcd: EtcdBackend::connect(self.etcd)
                .await
                .context("--etcd-snapshots: connecting to etcd")?,
            store: self.store,
            folder: self.folder,
            every: self.every,
            keep: self.keep,
        })
    }
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
            snapshots: self.snapshots.launch(),
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
    cfg.standby_copy = args.standby_copy;
    cfg.token = job.token.clone();
    cfg.metrics_token = job.metrics_token.clone();
    cfg.metrics_addr = args.metrics_addr;
    cfg.tls = job.tls.load()?;
    cfg.advertise = args.listen.advertise.clone();
    let snapshots = args.snapshots.config(&args.role.etcd.config()?)?;
    // Once connected, the master retries etcd for as long as it runs.
    args.role.run(|backend, shutdown| async move {
        if let Some(s) = snapshots {
            cfg.snapshots = Some(s.connect().await?);
        }
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

    /// What the operator renders for a master that snapshots its etcd parses back into
    /// the same settings.
    #[test]
    fn snapshot_settings_go_through_the_arguments_unchanged() {
        let launch = edl_job::MasterLaunch {
            snapshots: Some(edl_job::SnapshotLaunch {
                location: "s3://b/job/etcd-snapshots".into(),
                every: std::time::Duration::from_secs(600),
                keep: 2,
            }),
            ..edl_job::MasterLaunch::default()
        };
        let mut argv: Vec<String> = ["edl", "master", "--etcd", "http://e:1", "--job", "j"]
            .map(str::to_owned)
            .to_vec();
        argv.extend(launch.args());
        let cli = Cli::try_parse_from(argv).expect("parses");
        let Some(Command::Master(m)) = cli.command else {
            panic!("not a master");
        };
        assert_eq!(m.launch(), launch);
    }
}
