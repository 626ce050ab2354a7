//! The actor's interface: the requests it takes ([`Cmd`]), what `Status` reports, and
//! the [`CoreHandle`] the gRPC adapter and the followers send them through.

use std::sync::Arc;
use std::time::Duration;

use edl_job::RestoreRecord;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::MAX_WAIT;
use crate::dataset::{Dataset, DatasetSpec};
use crate::error::MasterError;
use crate::queue::{self, FailedTask, QueueCounters};
use edl_master_api::task::{Answer, Release};

/// What `Status` reports.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StatusReport {
    /// Whether a dataset is defined.
    pub dataset_set: bool,
    /// Current pass.
    pub pass: u32,
    /// Passes of the job.
    pub passes: u32,
    /// Every pass done.
    pub finished: bool,
    /// Task counts by state.
    pub counts: queue::StateCounts,
    /// Records per pass.
    pub total_records: u64,
    /// Trainers holding leases.
    pub holders: Vec<String>,
    /// Life counters.
    pub counters: QueueCounters,
    /// Tasks failed for good.
    pub failed: Vec<FailedTask>,
    /// The current lease timeout.
    pub timeout_ms: u64,
    /// Why the job is paused (etcd is full), with what to do; `None` while it runs.
    pub paused: Option<String>,
    /// Trainers whose task lease timed out while they stayed registered, most recent
    /// last: stuck (alive, no progress), or far slower than the job's other tasks.
    pub stuck: Vec<StuckTrainer>,
    /// Renewals of the leases of trainers waiting on a pserver or the master (keeps
    /// that held a task), since this master leads.
    pub leases_kept: u64,
}

/// A trainer whose task lease timed out while it stayed registered (its process lives:
/// a lost one's tasks go back at once): its task was handed out again, and whoever runs
/// it (`edl run`, the operator) may restart it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StuckTrainer {
    /// The trainer.
    pub trainer: String,
    /// The task it held.
    pub task: String,
    /// How long it held the task without a report.
    pub held_ms: u64,
    /// How long ago the lease timed out.
    pub ago_ms: u64,
}

pub(crate) type Reply<T> = oneshot::Sender<Result<T, MasterError>>;

/// A request to the actor.
#[derive(Debug)]
pub(crate) enum Cmd {
    SetDataset {
        spec: DatasetSpec,
        reply: Reply<(Dataset, bool)>,
    },
    GetTask {
        trainer: String,
        pass: u32,
        request: u64,
        wait: Duration,
        reply: Reply<Answer>,
    },
    Finished {
        id: String,
        generation: u64,
        records: u64,
        incarnations: Vec<u64>,
        reply: Reply<bool>,
    },
    Failed {
        id: String,
        generation: u64,
        reason: String,
        trained: u64,
        reply: Reply<bool>,
    },
    Release {
        id: String,
        generation: u64,
        how: Release,
        reply: Reply<bool>,
    },
    /// A trainer waiting on a pserver or the master keeps its leases.
    Keep {
        trainer: String,
        reply: Reply<u32>,
    },
    Status {
        reply: Reply<StatusReport>,
    },
    /// Trainers that left (their registration vanished).
    TrainersLost {
        trainers: Vec<String>,
    },
    /// The registered trainers right now (a consistent listing): holders not in it lost
    /// their registration without us seeing the event.
    Reconcile {
        registered: Vec<String>,
    },
    /// The pserver shards' restore records (each applied once per incarnation).
    Restored {
        records: Vec<RestoreRecord>,
    },
}

impl Cmd {
    /// Refuses the request with `err` (a notification without a reply is dropped: the
    /// queue rebuilt from etcd and the periodic reconciliation make up for it).
    pub(super) fn refuse(self, err: impl Fn() -> MasterError) {
        match self {
            Cmd::SetDataset { reply, .. } => drop(reply.send(Err(err()))),
            Cmd::GetTask { reply, .. } => drop(reply.send(Err(err()))),
            Cmd::Finished { reply, .. }
            | Cmd::Failed { reply, .. }
            | Cmd::Release { reply, .. } => drop(reply.send(Err(err()))),
            Cmd::Keep { reply, .. } => drop(reply.send(Err(err()))),
            Cmd::Status { reply } => drop(reply.send(Err(err()))),
            Cmd::TrainersLost { .. } | Cmd::Reconcile { .. } | Cmd::Restored { .. } => {}
        }
    }
}

/// A handle to the actor.
#[derive(Clone, Debug)]
pub struct CoreHandle {
    pub(super) tx: mpsc::Sender<Cmd>,
    /// The last status report and when it was made, for [`CoreHandle::recent_status`].
    pub(super) recent: Arc<std::sync::Mutex<Option<(Instant, StatusReport)>>>,
}

impl CoreHandle {
    async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Cmd) -> Result<T, MasterError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(make(reply))
            .await
            .map_err(|_| MasterError::NotLeader { leader: None })?;
        rx.await
            .map_err(|_| MasterError::Unavailable("the master is stepping down".into()))?
    }

    /// Defines the dataset or checks it is the same; returns it and whether it was new.
    pub async fn set_dataset(&self, spec: DatasetSpec) -> Result<(Dataset, bool), MasterError> {
        self.call(|reply| Cmd::SetDataset { spec, reply }).await
    }

    /// Leases a task (long-polls up to `wait`).
    pub async fn get_task(
        &self,
        trainer: String,
        pass: u32,
        request: u64,
        wait: Duration,
    ) -> Result<Answer, MasterError> {
        self.call(|reply| Cmd::GetTask {
            trainer,
            pass,
            request,
            wait: wait.min(MAX_WAIT),
            reply,
        })
        .await
    }

    /// A task's records were trained, and recorded as done by `incarnations` of the
    /// pserver shards. `Ok(false)`: the same report was already applied.
    pub async fn finished(
        &self,
        id: String,
        generation: u64,
        records: u64,
        incarnations: Vec<u64>,
    ) -> Result<bool, MasterError> {
        self.call(|reply| Cmd::Finished {
            id,
            generation,
            records,
            incarnations,
            reply,
        })
        .await
    }

    /// A task could not be processed.
    pub async fn failed(
        &self,
        id: String,
        generation: u64,
        reason: String,
        trained: u64,
    ) -> Result<bool, MasterError> {
        self.call(|reply| Cmd::Failed {
            id,
            generation,
            reason,
            trained,
            reply,
        })
        .await
    }

    /// A task is handed back: see [`Release`].
    pub async fn release(
        &self,
        id: String,
        generation: u64,
        how: Release,
    ) -> Result<bool, MasterError> {
        self.call(|reply| Cmd::Release {
            id,
            generation,
            how,
            reply,
        })
        .await
    }

    /// Trainer `trainer` is waiting on a pserver or the master, not stuck: the leases of
    /// the tasks it holds are renewed ([`crate::queue::Queue::keep`]); how many it holds.
    pub async fn keep(&self, trainer: String) -> Result<u32, MasterError> {
        self.call(|reply| Cmd::Keep { trainer, reply }).await
    }

    /// The queue's state.
    pub async fn status(&self) -> Result<StatusReport, MasterError> {
        self.call(|reply| Cmd::Status { reply }).await
    }

    /// A status report at most `max_age` old: a scrape of `/metrics`, however frequent,
    /// costs the actor (whose report walks the task table) at most one report per
    /// `max_age`; concurrent scrapes share it.
    pub async fn recent_status(&self, max_age: Duration) -> Result<StatusReport, MasterError> {
        let fresh = |recent: &Option<(Instant, StatusReport)>| {
            recent
                .as_ref()
                .filter(|(at, _)| at.elapsed() < max_age)
                .map(|(_, r)| r.clone())
        };
        if let Some(r) = fresh(&self.recent.lock().unwrap_or_else(|p| p.into_inner())) {
            return Ok(r);
        }
        let r = self.status().await?;
        *self.recent.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), r.clone()));
        Ok(r)
    }

    /// Trainers whose registration vanished.
    pub(crate) async fn trainers_lost(&self, trainers: Vec<String>) {
        let _ = self.tx.send(Cmd::TrainersLost { trainers }).await;
    }

    /// The pserver shards' restore records, as they are in etcd now.
    pub(crate) async fn restored(&self, records: Vec<RestoreRecord>) {
        let _ = self.tx.send(Cmd::Restored { records }).await;
    }

    /// The registered trainers, listed consistently.
    pub(crate) async fn reconcile(&self, registered: Vec<String>) {
        let _ = self.tx.send(Cmd::Reconcile { registered }).await;
    }
}
