//! A job as seen from outside (`edl status`, the Kubernetes operator): its state, pass and
//! tasks, trainers, pservers and masters, from its keys in etcd and from its leading
//! master's status.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use edl_coord::Backend;
use edl_job::{
    GroupRecord, JobKeys, JobName, JobSpec, JobStateRecord, MemberRecord, PserverRecord, Record,
    ScaleRecord,
};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::{Goodput, MasterClient, MasterClientConfig};
use edl_proto::master as pb;

/// The version of the JSON that `edl status --json` prints (docs/json.md). Bumped
/// when a field changes meaning or goes away; new fields may appear within a version.
pub const STATUS_JSON_VERSION: u32 = 1;

/// Where a job is in its passes.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PassProgress {
    /// The pass being trained, 1-based; equal to `total` once the last pass ended.
    pub current: u32,
    /// Passes of the job.
    pub total: u32,
}

/// A job's tasks by state (of the current pass).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct TaskCounts {
    /// Waiting to be leased.
    pub todo: u64,
    /// Leased to a trainer.
    pub pending: u64,
    /// Acknowledged.
    pub done: u64,
    /// Failed for good.
    pub failed: u64,
}

/// One pserver shard.
#[derive(Debug, Clone, Serialize)]
pub struct PserverStatus {
    /// Shard index.
    pub index: u32,
    /// The address of the pserver serving it (with replicas, its primary); empty while
    /// none does (a replicated shard between a primary's loss and its successor's claim).
    pub address: String,
    /// A replicated shard's group (`--replicas` or `pserver_replicas` above 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<GroupStatus>,
}

/// A replicated shard's group (`ps-group/<index>`, docs/replication.md).
#[derive(Debug, Clone, Serialize)]
pub struct GroupStatus {
    /// Replicas wanted, the primary included (0: the record does not say).
    pub wanted: u32,
    /// Raised each time the primary changes: the fence on every replica's answers.
    pub epoch: u64,
    /// Changed only by a restore from a checkpoint (every replica was lost).
    pub incarnation: u64,
    /// The primary first, then the in-sync backups, the joining ones, and the spare
    /// members registered for the shard but not in its group.
    pub replicas: Vec<ReplicaStatus>,
}

/// One replica of a shard.
#[derive(Debug, Clone, Serialize)]
pub struct ReplicaStatus {
    /// Its member id (`<shard>-<pid>-<random>`).
    pub member: String,
    /// `primary`, `in sync` (a backup holding every acknowledged push), `joining`
    /// (catching up) or `spare` (registered, not in the group).
    pub state: &'static str,
    /// Its address; `None` when its process is gone (its lease ended) while the group
    /// still names it.
    pub address: Option<String>,
}

/// The replica groups of `keys`' job, by shard.
async fn groups(
    backend: &Arc<dyn Backend>,
    keys: &JobKeys,
) -> edl_coord::Result<std::collections::BTreeMap<u32, GroupStatus>> {
    let (records, _) = backend.range(&keys.ps_groups()).await?;
    let (members, _) = backend.range(&keys.ps_members()).await?;
    let members: std::collections::BTreeMap<String, String> = members
        .iter()
        .filter_map(|kv| {
            let id = keys.ps_member_id(&kv.key)?;
            let addr = MemberRecord::decode(&kv.value)
                .map_or_else(|e| format!("(unreadable member record: {e})"), |m| m.addr);
            Some((id.to_owned(), addr))
        })
        .collect();
    let mut out = std::collections::BTreeMap::new();
    for kv in &records {
        let Some(index) = kv
            .key
            .strip_prefix(&keys.ps_groups())
            .and_then(|i| i.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(g) = GroupRecord::decode(&kv.value) else {
            continue;
        };
        if g.replicas == 1 {
            // A shard of one replica: a group of one, shown as a plain shard.
            continue;
        }
        let named = std::iter::once((&g.primary, "primary"))
            .chain(g.backups.iter().map(|m| (m, "in sync")))
            .chain(g.joining.iter().map(|m| (m, "joining")));
        let mut replicas: Vec<ReplicaStatus> = named
            .map(|(m, state)| ReplicaStatus {
                member: m.clone(),
                state,
                address: members.get(m).cloned(),
            })
            .collect();
        let prefix = format!("{index}-");
        for (m, addr) in &members {
            if m.starts_with(&prefix) && !replicas.iter().any(|r| &r.member == m) {
                replicas.push(ReplicaStatus {
                    member: m.clone(),
                    state: "spare",
                    address: Some(addr.clone()),
                });
            }
        }
        out.insert(
            index,
            GroupStatus {
                wanted: g.replicas,
                epoch: g.epoch,
                incarnation: g.incarnation,
                replicas,
            },
        );
    }
    Ok(out)
}

/// One master.
#[derive(Debug, Clone, Serialize)]
pub struct MasterStatus {
    /// Its address.
    pub address: String,
    /// Whether it leads (the others stand by).
    pub leader: bool,
}

/// A task that failed for good.
#[derive(Debug, Clone, Serialize)]
pub struct TaskFailure {
    /// Task id.
    pub task: String,
    /// Why.
    pub reason: String,
}

/// A trainer whose task lease timed out while it stayed registered (stuck, or far
/// slower than the job's other tasks): its task was handed out again.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StuckTrainer {
    /// The trainer id.
    pub trainer: String,
    /// The task it held.
    pub task: String,
    /// Seconds it held the task without a report.
    pub held_s: f64,
    /// Seconds since its lease timed out.
    pub ago_s: f64,
}

/// Where a job's trainers' time went (docs/design.md, "Goodput"), as the leading master
/// heard it with their `GetTask`s (it keeps the latest of each trainer that spoke to it
/// while it led, departed ones included).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct JobGoodput {
    /// Seconds per bucket, summed over the trainers (trainer-seconds).
    pub seconds: BTreeMap<&'static str, f64>,
    /// Per trainer id, its seconds per bucket.
    pub trainers: BTreeMap<String, BTreeMap<&'static str, f64>>,
}

impl JobGoodput {
    /// From a master's `Status`; `None` when no trainer sent any.
    pub fn of(status: &pb::StatusResponse) -> Option<JobGoodput> {
        let mut job = Goodput::default();
        let mut trainers = BTreeMap::new();
        for t in &status.goodput {
            let g = t.goodput.as_ref().map(Goodput::from).unwrap_or_default();
            job.add(&g);
            trainers.insert(t.trainer.clone(), g.named().collect());
        }
        (!trainers.is_empty()).then(|| JobGoodput {
            seconds: job.named().collect(),
            trainers,
        })
    }
}

/// `1234.5 s: computing 61.0%, communicating 20.1%, ...`: the total, then each bucket
/// with a share of at least 0.05%, in the buckets' order.
pub fn goodput_line(seconds: &BTreeMap<&'static str, f64>) -> String {
    let total: f64 = seconds.values().sum();
    let shares: Vec<String> = crate::Bucket::ALL
        .iter()
        .filter_map(|b| {
            let s = seconds.get(b.name()).copied().unwrap_or(0.0);
            (total > 0.0 && s / total >= 0.0005)
                .then(|| format!("{} {:.1}%", b.name(), 100.0 * s / total))
        })
        .collect();
    format!("{total:.1} s: {}", shares.join(", "))
}

/// One job in `edl status`.
#[derive(Debug, Serialize)]
pub struct JobStatus {
    /// Name.
    pub job: String,
    /// running, paused (etcd is full), pending, succeeded, failed, stopped.
    pub state: String,
    /// The model kind.
    pub model: Option<String>,
    /// Current pass and passes (when a master answers).
    pub pass: Option<PassProgress>,
    /// Tasks by state (when a master answers).
    pub tasks: Option<TaskCounts>,
    /// Records trained so far.
    pub records_trained: Option<u64>,
    /// Registered trainers.
    pub trainers: Vec<String>,
    /// Desired trainers (`edl scale`), if set.
    pub desired_trainers: Option<u32>,
    /// Pserver shards, by index.
    pub pservers: Vec<PserverStatus>,
    /// Masters, the leader first.
    pub masters: Vec<MasterStatus>,
    /// The last (at most five) tasks failed for good.
    pub failures: Vec<TaskFailure>,
    /// Trainers stuck on a task (their lease timed out while they stayed registered).
    pub stuck: Vec<StuckTrainer>,
    /// Why the job is paused (etcd is full), with what to do (state `paused`).
    pub paused: Option<String>,
    /// Where its trainers' time went (when a master answers and trainers measured it).
    pub goodput: Option<JobGoodput>,
}

/// The jobs with a spec in etcd.
pub async fn job_names(backend: &Arc<dyn Backend>) -> edl_coord::Result<Vec<JobName>> {
    let (kvs, _) = backend.range(edl_job::keys::ROOT).await?;
    let names: BTreeSet<JobName> = kvs
        .iter()
        .filter_map(|kv| JobKeys::job_of_spec_key(&kv.key))
        .collect();
    Ok(names.into_iter().collect())
}

/// How long `edl status` waits for a job's leading master ([`job_status`]): through a
/// failover's first seconds.
pub const MASTER_WAIT: Duration = Duration::from_secs(2);

/// A job's state: from its keys in etcd, and from its leading master when one answers
/// (within about [`MASTER_WAIT`]).
pub async fn job_status(backend: &Arc<dyn Backend>, job: &JobName) -> edl_coord::Result<JobStatus> {
    job_status_with(backend, job, None, None, MASTER_WAIT).await
}

/// [`job_status`], reaching the master with the job's token and TLS, and waiting for it
/// (a refused or failed call tried again, a call unanswered) for about `wait` at most.
pub async fn job_status_with(
    backend: &Arc<dyn Backend>,
    job: &JobName,
    token: Option<&str>,
    tls: Option<&edl_proto::tls::Tls>,
    wait: Duration,
) -> edl_coord::Result<JobStatus> {
    let keys = JobKeys::new(job);
    let spec = backend
        .get(&keys.spec())
        .await?
        .and_then(|kv| JobSpec::from_stored(&kv.value).ok());
    let (trainers, _) = backend.range(&keys.trainers()).await?;
    let trainers: Vec<String> = trainers
        .iter()
        .filter_map(|kv| keys.trainer_id(&kv.key).map(str::to_owned))
        .collect();
    let (ps, _) = backend.range(&keys.ps_prefix()).await?;
    let pservers: Vec<PserverStatus> = ps
        .iter()
        .filter_map(|kv| {
            let index = keys.ps_index(&kv.key)?;
            let address = match PserverRecord::decode(&kv.value) {
                Ok(r) => r.addr,
                Err(e) => format!("(unreadable claim: {e})"),
            };
            Some(PserverStatus {
                index,
                address,
                group: None,
            })
        })
        .collect();
    let mut pservers = pservers;
    for (index, group) in groups(backend, &keys).await? {
        match pservers.iter_mut().find(|p| p.index == index) {
            Some(p) => p.group = Some(group),
            None => pservers.push(PserverStatus {
                index,
                address: String::new(),
                group: Some(group),
            }),
        }
    }
    pservers.sort_by_key(|p| p.index);
    let (mut masters, _) = backend.range(&keys.master_election()).await?;
    masters.sort_by_key(|kv| kv.create_revision);
    let masters: Vec<MasterStatus> = masters
        .iter()
        .enumerate()
        .map(|(i, kv)| MasterStatus {
            address: String::from_utf8_lossy(&kv.value).into_owned(),
            leader: i == 0,
        })
        .collect();
    let desired_trainers = backend
        .get(&keys.scale_trainers())
        .await?
        .and_then(|kv| ScaleRecord::decode(&kv.value).ok())
        .map(|r| r.trainers);
    let recorded = backend
        .get(&keys.state())
        .await?
        .and_then(|kv| JobStateRecord::decode(&kv.value).ok())
        .map(|r| r.state.name().to_owned());
    let status = if masters.is_empty() {
        None
    } else {
        let mut cfg = MasterClientConfig::new(job.clone());
        cfg.token = token.map(str::to_owned);
        cfg.tls = tls.cloned();
        cfg.retry_for = wait;
        cfg.call_timeout = wait;
        MasterClient::new(backend.clone(), cfg, CancellationToken::new())
            .status()
            .await
            .ok()
    };
    let state = match (&recorded, &status) {
        (Some(s), _) => s.clone(),
        (None, Some(s)) if s.finished => "succeeded".into(),
        (None, Some(s)) if !s.paused.is_empty() => "paused".into(),
        (None, Some(_)) => "running".into(),
        (None, None) => "pending".into(),
    };
    let paused = status
        .as_ref()
        .map(|s| s.paused.clone())
        .filter(|p| !p.is_empty());
    Ok(JobStatus {
        job: job.to_string(),
        paused,
        state,
        model: spec.map(|s| s.model.as_ref().map_or("entry", |m| m.kind()).to_owned()),
        pass: status.as_ref().map(|s| PassProgress {
            current: (s.pass + 1).min(s.passes.max(1)),
            total: s.passes.max(1),
        }),
        tasks: status.as_ref().map(|s| TaskCounts {
            todo: s.todo,
            pending: s.pending,
            done: s.done,
            failed: s.failed,
        }),
        records_trained: status
            .as_ref()
            .and_then(|s| s.counters.map(|c| c.records_trained)),
        trainers,
        desired_trainers,
        pservers,
        masters,
        goodput: status.as_ref().and_then(JobGoodput::of),
        stuck: status
            .as_ref()
            .map(|s| {
                s.stuck
                    .iter()
                    .map(|t| StuckTrainer {
                        trainer: t.trainer.clone(),
                        task: t.task.clone(),
                        held_s: t.held_ms as f64 / 1000.0,
                        ago_s: t.ago_ms as f64 / 1000.0,
                    })
                    .collect()
            })
            .unwrap_or_default(),
        failures: status
            .map(|s| {
                s.failed_tasks
                    .into_iter()
                    .rev()
                    .take(5)
                    .map(|f| TaskFailure {
                        task: f.id,
                        reason: f.reason,
                    })
                    .collect()
            })
            .unwrap_or_default(),
    })
}
