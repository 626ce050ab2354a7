//! The arguments of `edl run`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use edl_trainer::DeviceChoice;

/// Where the coordination state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CoordChoice {
    /// `--etcd`/the spec's etcd, else a private etcd if one is installed, else memory.
    Auto,
    /// etcd (the given one, or a private one).
    Etcd,
    /// Every role in this process on the in-memory backend.
    Memory,
}

/// Arguments of `edl run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The job spec (TOML).
    pub spec: PathBuf,
    /// etcd client URLs, comma-separated (default: the spec's `cluster.etcd`).
    #[arg(long, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Coordination backend.
    #[arg(long, value_enum, default_value = "auto")]
    pub coord: CoordChoice,
    /// Seeded fault injection: `ACTION-ROLE=EVERY,...,seed=S` with ACTION kill, stop
    /// (SIGSTOP for 2 x the lease TTL) or notice (SIGTERM, then SIGKILL at the
    /// deadline) and ROLE trainer, pserver or master, e.g.
    /// `kill-trainer=10s,kill-pserver=30s,kill-master=60s,stop-trainer=20s,notice-pserver=45s,seed=7`;
    /// `deadline=10s` is a notice's deadline (30 s by default); `until=5m` injects
    /// faults only during the first five minutes.
    #[arg(long)]
    pub chaos: Option<String>,
    /// Write the report (JSON) here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Run directory for logs, checkpoints and the final parameters (default:
    /// `edl-runs/<job>` next to the spec).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Compute device of the trainers: auto, cpu or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    /// No live progress display (log lines only).
    #[arg(long)]
    pub quiet: bool,
    /// Let edl's autoscaler resize the job within `[min_trainers, max_trainers]`: it adds
    /// trainers while the machine's cores allow and they still speed the job up
    /// (docs/autoscaler.md). Needs etcd.
    #[arg(long)]
    pub autoscale: bool,
    /// The cores `--autoscale` may fill (each pserver and trainer counts one; default:
    /// the cores this process may use).
    #[arg(long, value_name = "N", requires = "autoscale", value_parser = clap::value_parser!(u32).range(1..))]
    pub autoscale_cores: Option<u32>,
    /// Run the job locked down (docs/security.md): a random job token; TLS between its
    /// processes with a private CA made for the job (in `<run dir>/tls/`), mutual TLS;
    /// and an etcd user that may touch only the job's keys, created with
    /// `--etcd-user`/`--etcd-password` (an etcd admin), or in the private etcd, where
    /// authentication is turned on. Needs etcd.
    #[arg(long)]
    pub secure: bool,
    /// etcd's credentials and TLS (passed on to every process of the job; with
    /// `--secure`, an admin's, used only to create the job's own user).
    #[command(flatten)]
    pub etcd_access: crate::common::EtcdAccessArgs,
    /// Give up when the job has not finished after this long.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2h")]
    pub timeout: Duration,
}
