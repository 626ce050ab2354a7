//! A job's spec translated once into each role's settings: [`MasterLaunch`],
//! [`PserverLaunch`] and [`TrainerLaunch`], typed. Whoever starts a role starts it from
//! these, however it starts it:
//!
//! - as a process's arguments (`edl run`'s children, the operator's pods): `args()` (and
//!   a trainer's `vars()`), which `edl master`, `edl pserver` and the trainer API parse
//!   back into the same value (the CLI's tests check the round trip);
//! - in process (`edl run` on the in-memory backend): the server crates turn the same
//!   value into their configuration (`MasterConfig::launch`, `PsConfig::launch`).
//!
//! What is not the job's (where etcd is, the listen address, a trainer's id, the token
//! and TLS files) is the starter's; only the job's settings are here.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::spec::{ClusterSpec, DataSpec, TrainerSpec};

/// How long a role's lease lives unless the job says (`cluster.lease_ttl` does).
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);

fn duration(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// `edl master`'s settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MasterLaunch {
    /// Consecutive chunks of one file per task, for datasets defined without saying.
    pub chunks_per_task: u32,
    /// A task failing more than this many times in a pass fails for good.
    pub max_failures: u32,
    /// A task lost more than this many times in a pass fails for good.
    pub max_losses: u32,
    /// TTL of the master's etcd lease.
    pub lease_ttl: Duration,
    /// Task lease timeout until task durations are known (then it adapts).
    pub task_timeout: Duration,
    /// Shortest adaptive task timeout.
    pub min_task_timeout: Duration,
    /// Snapshots of the job's own etcd, taken by the leader; `None`: none.
    pub snapshots: Option<SnapshotLaunch>,
}

/// Snapshots of the job's own etcd (a managed etcd) that the leading master takes into
/// a folder of the job's storage (`edl master --etcd-snapshots`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotLaunch {
    /// The folder (a URL of the job's object store, or a path).
    pub location: String,
    /// One snapshot every this long.
    pub every: Duration,
    /// Snapshots kept (the oldest are deleted).
    pub keep: u32,
}

impl SnapshotLaunch {
    /// One snapshot every half hour unless the job says.
    pub const DEFAULT_EVERY: Duration = Duration::from_secs(30 * 60);
    /// Four kept unless the job says.
    pub const DEFAULT_KEEP: u32 = 4;

    /// The arguments of `edl master` that say these settings.
    pub fn args(&self) -> Vec<String> {
        vec![
            "--etcd-snapshots".into(),
            self.location.clone(),
            "--etcd-snapshot-every".into(),
            duration(self.every),
            "--etcd-snapshot-keep".into(),
            self.keep.to_string(),
        ]
    }
}

impl Default for MasterLaunch {
    /// `edl master`'s defaults.
    fn default() -> Self {
        MasterLaunch {
            chunks_per_task: 1,
            max_failures: 3,
            max_losses: 10,
            lease_ttl: DEFAULT_LEASE_TTL,
            task_timeout: Duration::from_secs(300),
            min_task_timeout: Duration::from_secs(10),
            snapshots: None,
        }
    }
}

impl MasterLaunch {
    /// A master of the job whose spec has `data` and `cluster`: its chunks per task
    /// (at least 1: 0 in the spec sizes tasks by records) and its lease TTL.
    pub fn of(data: &DataSpec, cluster: &ClusterSpec) -> MasterLaunch {
        MasterLaunch {
            chunks_per_task: data.chunks_per_task.max(1),
            lease_ttl: cluster.lease_ttl,
            min_task_timeout: cluster.min_task_timeout,
            ..MasterLaunch::default()
        }
    }

    /// The arguments of `edl master` that say these settings.
    pub fn args(&self) -> Vec<String> {
        let mut args: Vec<String> = vec![
            "--chunks-per-task".into(),
            self.chunks_per_task.to_string(),
            "--max-failures".into(),
            self.max_failures.to_string(),
            "--max-losses".into(),
            self.max_losses.to_string(),
            "--lease-ttl".into(),
            duration(self.lease_ttl),
            "--task-timeout".into(),
            duration(self.task_timeout),
            "--min-task-timeout".into(),
            duration(self.min_task_timeout),
        ];
        args.extend(self.snapshots.iter().flat_map(SnapshotLaunch::args));
        args
    }
}

/// How often a pserver checkpoints its shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointEvery {
    /// Every this many updates (sync: steps; async: pushes applied by shard 0).
    Steps(u64),
    /// Every this long.
    Interval(Duration),
}

impl FromStr for CheckpointEvery {
    type Err = String;

    /// `100` (steps) or a duration such as `30s`, `5m`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if let Ok(n) = s.parse::<u64>() {
            if n == 0 {
                return Err("checkpoint period must be at least 1 step".into());
            }
            return Ok(CheckpointEvery::Steps(n));
        }
        match humantime::parse_duration(s) {
            Ok(d) if d >= Duration::from_millis(100) => Ok(CheckpointEvery::Interval(d)),
            Ok(d) => Err(format!("checkpoint interval {d:?} is too short (>= 100ms)")),
            Err(e) => Err(format!(
                "{s:?} is neither a step count nor a duration (like 30s): {e}"
            )),
        }
    }
}

impl fmt::Display for CheckpointEvery {
    /// What [`FromStr`] reads back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CheckpointEvery::Steps(n) => write!(f, "{n}"),
            CheckpointEvery::Interval(d) => f.write_str(&duration(*d)),
        }
    }
}

/// Which shard index a pserver claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexChoice {
    /// The lowest free index (waiting for one when all are held).
    Auto,
    /// This index (waiting while another pserver holds it).
    Fixed(u32),
}

impl FromStr for IndexChoice {
    type Err = String;

    /// `auto` or an index.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "auto" {
            return Ok(IndexChoice::Auto);
        }
        s.parse::<u32>()
            .map(IndexChoice::Fixed)
            .map_err(|_| format!("{s:?} is neither `auto` nor a shard index"))
    }
}

impl fmt::Display for IndexChoice {
    /// What [`FromStr`] reads back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IndexChoice::Auto => f.write_str("auto"),
            IndexChoice::Fixed(i) => write!(f, "{i}"),
        }
    }
}

/// `edl pserver`'s settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PserverLaunch {
    /// The shard index to claim.
    pub index: IndexChoice,
    /// The job's shard count (`None`: `ps/desired` must be set already).
    pub shards: Option<u32>,
    /// Replicas of the shard, the primary included.
    pub replicas: u32,
    /// Where checkpoint files go: a directory or an object URL.
    pub checkpoint_dir: String,
    /// The checkpoint period.
    pub checkpoint_every: CheckpointEvery,
    /// Complete checkpoints kept.
    pub keep_checkpoints: usize,
    /// TTL of the pserver's etcd lease.
    pub lease_ttl: Duration,
    /// Largest gRPC message, in MiB.
    pub max_message_mib: usize,
    /// Bulk-path connections served at once.
    pub max_bulk_connections: usize,
}

/// Default bound on bulk-path connections a pserver serves at once: about two per
/// trainer for a thousand trainers, with room (an idle one gives its slot to a new one
/// beyond it).
pub const DEFAULT_MAX_BULK_CONNECTIONS: usize = 4096;

impl PserverLaunch {
    /// `edl pserver`'s defaults, checkpointing under `checkpoint_dir`.
    pub fn new(checkpoint_dir: impl Into<String>) -> PserverLaunch {
        PserverLaunch {
            index: IndexChoice::Auto,
            shards: None,
            replicas: 1,
            checkpoint_dir: checkpoint_dir.into(),
            checkpoint_every: CheckpointEvery::Interval(Duration::from_secs(300)),
            keep_checkpoints: 3,
            lease_ttl: DEFAULT_LEASE_TTL,
            max_message_mib: 1024,
            max_bulk_connections: DEFAULT_MAX_BULK_CONNECTIONS,
        }
    }

    /// Pserver slot `slot` of the job whose spec has `cluster`, checkpointing under
    /// `checkpoint_dir`: it holds shard `slot % pservers`, one of the job's
    /// `pserver_replicas` replicas of it.
    pub fn of(cluster: &ClusterSpec, slot: u32, checkpoint_dir: impl Into<String>) -> Self {
        let shards = cluster.pservers.max(1);
        PserverLaunch {
            index: IndexChoice::Fixed(slot % shards),
            shards: Some(shards),
            replicas: cluster.pserver_replicas.max(1),
            checkpoint_every: CheckpointEvery::Interval(cluster.checkpoint_every),
            keep_checkpoints: cluster.checkpoint_keep,
            lease_ttl: cluster.lease_ttl,
            ..PserverLaunch::new(checkpoint_dir)
        }
    }

    /// The arguments of `edl pserver` that say these settings.
    pub fn args(&self) -> Vec<String> {
        let mut args = vec!["--index".into(), self.index.to_string()];
        if let Some(shards) = self.shards {
            args.extend(["--shards".into(), shards.to_string()]);
        }
        args.extend([
            "--replicas".into(),
            self.replicas.to_string(),
            "--checkpoint-dir".into(),
            self.checkpoint_dir.clone(),
            "--checkpoint-every".into(),
            self.checkpoint_every.to_string(),
            "--keep-checkpoints".into(),
            self.keep_checkpoints.to_string(),
            "--lease-ttl".into(),
            duration(self.lease_ttl),
            "--max-message-mib".into(),
            self.max_message_mib.to_string(),
            "--max-bulk-connections".into(),
            self.max_bulk_connections.to_string(),
        ]);
        args
    }
}

/// A trainer's settings: the program, and what the job tells it through the
/// environment contract (docs/trainer-api.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainerLaunch {
    /// The program and its arguments (`[trainer] entry`); empty: `edl trainer`.
    pub entry: Vec<String>,
    /// TTL of the trainer's registration lease.
    pub lease_ttl: Duration,
    /// The job's own variables (`[trainer] env`), set after the contract's.
    pub env: BTreeMap<String, String>,
}

impl TrainerLaunch {
    /// A trainer of the job whose spec has `trainer` and `cluster`.
    pub fn of(trainer: &TrainerSpec, cluster: &ClusterSpec) -> TrainerLaunch {
        TrainerLaunch {
            entry: trainer.entry.clone(),
            lease_ttl: cluster.lease_ttl,
            env: trainer.env.clone(),
        }
    }

    /// The program's variables that say these settings, in the order to set them: the
    /// contract's (the lease TTL, `train` as the mode), then the job's own.
    pub fn vars(&self) -> Vec<(String, String)> {
        let mut vars = vec![
            (crate::env::LEASE_TTL.to_owned(), duration(self.lease_ttl)),
            (crate::env::MODE.to_owned(), "train".to_owned()),
        ];
        vars.extend(self.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        vars
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_periods_and_indexes_read_back_what_they_print() {
        for every in [
            CheckpointEvery::Steps(7),
            CheckpointEvery::Interval(Duration::from_millis(1500)),
            CheckpointEvery::Interval(Duration::from_secs(300)),
        ] {
            assert_eq!(every.to_string().parse::<CheckpointEvery>(), Ok(every));
        }
        assert_eq!("100".parse(), Ok(CheckpointEvery::Steps(100)));
        assert_eq!(
            "30s".parse(),
            Ok(CheckpointEvery::Interval(Duration::from_secs(30)))
        );
        assert!("0".parse::<CheckpointEvery>().is_err());
        assert!("10ms".parse::<CheckpointEvery>().is_err());
        assert!("soon".parse::<CheckpointEvery>().is_err());
        for index in [IndexChoice::Auto, IndexChoice::Fixed(3)] {
            assert_eq!(index.to_string().parse::<IndexChoice>(), Ok(index));
        }
        assert!("first".parse::<IndexChoice>().is_err());
    }
}
