//! A trainer's task stream, in one place: [`Tasks`], a trainer's tasks as a training
//! loop drives them — the `cloud_reader`'s items, and what the trainer says of each task
//! once its loop is done with it. The built-in loop ([`crate::runtime::run`]) and the
//! Python package drive the same `Tasks`, so a task is acknowledged one way whatever
//! trains it.
//!
//! A task's answer takes three shapes on its way, each where it is needed: the master's
//! queue answers `queue::GetTask` (inside the master), the wire carries
//! [`Answer`](edl_master_client::task::Answer) (a leased task, wait, pass finished, job
//! finished), and the trainer sees [`Next`] (a task with its records, a pass end with the
//! pass that ended, the job's end, and `Drained` or `Closed` from [`Tasks::next`]).
//!
//! Layout:
//! - this file: [`Tasks`], [`Next`], the acknowledgements in the background.
//! - `reader`: the `cloud_reader` ([`CloudReader`], [`ReaderConfig`], [`Acks`]): leased
//!   tasks read ahead, acknowledged after training. Its in-process tests with a real
//!   master are `reader/tests.rs`.
//!
//! Invariants:
//! - A task is acknowledged ([`Tasks::trained`]) only after every push of it was applied
//!   and the store recorded it as done where the parameters live (per shard, the
//!   incarnation that recorded it travels with the master's acknowledgement); a task a
//!   restored shard lacks updates of is handed back to be trained again instead.
//! - That acknowledgement runs in the background while the caller trains the next task,
//!   one at a time ([`Tasks::trained`]) or up to [`ACKS_IN_FLIGHT`] at a time
//!   ([`Tasks::computed`]); they are settled before a pass end or the job's end is
//!   returned, before a task is handed back or failed, and by [`Tasks::close`]. An
//!   error is returned by the call that settles it.
//! - With [`Tasks::trained`], the next task starts from parameters that hold every push
//!   of the one before: the store is flushed before the acknowledgement starts (its
//!   first pull is fresh). With [`Tasks::computed`] (the runtime's pipeline, which
//!   applies its own gradients locally) nothing is flushed: the acknowledgement waits
//!   for the task's pushes in the background.
//! - While no task arrives for [`IDLE_AFTER`], the store is told the trainer is idle (sync
//!   mode: the others' steps do not wait for it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use edl_master_client::task::LeasedTask;
use edl_master_client::{Release, Resume};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::goodput::{Bucket, GoodputClock};
use crate::progress::{Progress, RuntimeError};
use crate::store::{ParamStore, StoreError, TaskRef};

mod reader;

pub use reader::{Acks, CloudReader, ReaderConfig, ReaderError, TaskData};

/// Acknowledgements a loop that pushes in the background ([`Tasks::computed`]) keeps
/// under way: a task's (a `TaskDone` on every shard, then an etcd commit at the master)
/// then never holds up the next task's start. A killed trainer's tasks being
/// acknowledged are trained again (the master cannot tell them from unread ones).
pub const ACKS_IN_FLIGHT: usize = 2;

/// How long a trainer waits for its next task before it tells the store it is idle.
pub const IDLE_AFTER: Duration = Duration::from_millis(100);

/// What [`Tasks::next`] returns, and what the [`CloudReader`] yields (all but
/// `Drained` and `Closed`): a task's answer from the master in its trainer's shape.
#[derive(Clone, Debug)]
pub enum Next {
    /// A task to train, with its records; say how it went with [`Tasks::trained`],
    /// [`Tasks::hand_back`] or [`Tasks::fail`].
    Task(TaskData),
    /// Pass `ended` is over (every task done or failed); the current one is `next`.
    PassFinished {
        /// The pass that ended.
        ended: u32,
        /// The current pass.
        next: u32,
    },
    /// Every pass is done.
    JobFinished,
    /// `shutdown` fired while waiting: take no more tasks.
    Drained,
    /// The reader stopped (after the job's end or an error it returned).
    Closed,
}

/// A trainer's tasks and their acknowledgements (see the module docs).
#[derive(Debug)]
pub struct Tasks {
    reader: CloudReader,
    acks: Acks,
    store: Arc<dyn ParamStore>,
    trainer: String,
    /// Acknowledgements in flight, oldest first.
    acking: std::collections::VecDeque<JoinHandle<Result<Acked, RuntimeError>>>,
    progress: Progress,
    /// The reader's goodput clock (one of its own when it has none): waits for a task
    /// and for acknowledgements are marked on it; the first task ends its start.
    clock: GoodputClock,
}

/// How the acknowledgement of a task trained whole went.
#[derive(Debug)]
enum Acked {
    /// The master took it (or it had been taken away meanwhile: `false`).
    Finished {
        records: u64,
        taken: bool,
        started: Instant,
    },
    /// A pserver shard restored meanwhile lacks some of its updates: handed back to be
    /// trained again.
    Again,
}

/// How a task's pushes ended, for its acknowledgement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pushes {
    /// Every one applied (or already applied).
    Applied,
    /// A shard refused one because another attempt at the task applied part of its
    /// batches: the task was taken away from this trainer (why).
    TakenAway(String),
}

/// A task whose pushes were refused because another attempt at it holds it now: not
/// acknowledged; handed back in case this trainer still holds the lease (a refusal
/// says another attempt pushed, so normally it does not, and the master says stale).
async fn taken_away(
    acks: &Acks,
    task: &LeasedTask,
    records: u64,
    started: Instant,
    why: &str,
) -> Acked {
    let how = Release::Drained {
        trained: records,
        resume: None,
    };
    match acks.release(task, &how).await {
        Ok(_) => tracing::warn!(task = %task.id, "handed the task back: {why}"),
        Err(e) if e.is_stale() => {
            tracing::info!(task = %task.id, "the task was taken away while training; the attempt holding it trains the rest")
        }
        Err(e) => {
            tracing::warn!(task = %task.id, error = %e, "handing the task back failed; the master requeues it when its lease ends")
        }
    }
    Acked::Finished {
        records,
        taken: false,
        started,
    }
}

/// The store's view of a leased task.
pub fn task_ref(t: &LeasedTask) -> TaskRef {
    TaskRef {
        pass: t.pass,
        index: t.index,
        tasks: t.tasks,
    }
}

impl Tasks {
    /// The tasks of `reader`, trained by `trainer` into `store`.
    pub fn new(
        reader: CloudReader,
        store: Arc<dyn ParamStore>,
        trainer: impl Into<String>,
    ) -> Tasks {
        Tasks {
            acks: reader.acks(),
            clock: reader.goodput().cloned().unwrap_or_default(),
            reader,
            store,
            trainer: trainer.into(),
            acking: Default::default(),
            progress: Progress::default(),
        }
    }

    /// The counts so far (tasks and records acknowledged, recomputed and failed tasks,
    /// the pass); the caller keeps its own in [`Tasks::progress_mut`].
    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    /// The counts, for the caller's own (steps, losses, evaluations).
    pub fn progress_mut(&mut self) -> &mut Progress {
        &mut self.progress
    }

    /// The trainer's goodput clock, for the loop's own spans (computing, pulls and
    /// pushes, evaluations).
    pub fn clock(&self) -> &GoodputClock {
        &self.clock
    }

    /// The next item of the reader. A pass end and the job's end come after the
    /// acknowledgement in flight settled; `shutdown` ends the wait with
    /// [`Next::Drained`].
    pub async fn next(&mut self, shutdown: &CancellationToken) -> Result<Next, RuntimeError> {
        let next = self
            .next_unless(shutdown, std::future::pending::<()>(), true)
            .await?;
        Ok(next.unwrap_or(Next::Closed))
    }

    /// [`Tasks::next`], unless `interrupt` completes while no item has arrived: then
    /// `None`, and nothing is lost (the wait is cancel-safe; call again to go on). A
    /// loop that hands tasks to other threads uses it to let them say how their tasks
    /// went while it waits. `idle`: whether no task of this trainer is being trained,
    /// so that a wait longer than [`IDLE_AFTER`] tells the store the trainer is idle.
    pub async fn next_unless(
        &mut self,
        shutdown: &CancellationToken,
        interrupt: impl std::future::Future<Output = ()>,
        idle: bool,
    ) -> Result<Option<Next>, RuntimeError> {
        tokio::pin!(interrupt);
        let waiting = self.clock.span(Bucket::WaitingForTask);
        let item = {
            let next = self.reader.next();
            tokio::pin!(next);
            let idle_after = async {
                if idle {
                    tokio::time::sleep(IDLE_AFTER).await;
                } else {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => None,
                item = &mut next => Some(item),
                _ = &mut interrupt => return Ok(None),
                _ = idle_after => {
                    // No task at hand: in sync mode, stop holding up the others' steps.
                    if let Err(e) = self.store.idle(&self.trainer).await {
                        tracing::warn!(error = %e, "could not leave the sync steps while idle");
                    }
                    tokio::select! {
                        biased;
                        _ = shutdown.cancelled() => None,
                        item = &mut next => Some(item),
                        _ = &mut interrupt => return Ok(None),
                    }
                }
            }
        };
        let Some(item) = item else {
            self.progress.drained = true;
            return Ok(Some(Next::Drained));
        };
        let Some(item) = item else {
            return Ok(Some(Next::Closed));
        };
        let next = match item? {
            Next::Task(t) => {
                self.clock.started();
                self.progress.pass = t.task.pass;
                if let Some(r) = &t.task.resume {
                    // Its done record names the shards' incarnations that answered
                    // the batches applied before the hand-back, too.
                    self.store.resume_after(task_ref(&t.task), &r.answered);
                }
                Next::Task(t)
            }
            Next::PassFinished { ended, next } => {
                self.settle().await?;
                tracing::info!(trainer = %self.trainer, pass = ended, next, "pass finished");
                self.progress.pass = next;
                Next::PassFinished { ended, next }
            }
            Next::JobFinished => {
                self.settle().await?;
                Next::JobFinished
            }
            // The reader yields neither.
            other @ (Next::Drained | Next::Closed) => other,
        };
        drop(waiting);
        Ok(Some(next))
    }

    /// Task `task` was trained whole (`records`, since `started`): its pushes are
    /// flushed, then it is acknowledged in the background (after the one before).
    pub async fn trained(
        &mut self,
        task: LeasedTask,
        records: u64,
        started: Instant,
    ) -> Result<(), RuntimeError> {
        // The next task starts from parameters that hold every push of this one (its
        // first pull is fresh): with tasks of a batch or two, training only on prefetched
        // values (missing this trainer's last two pushes) measurably lowered async
        // accuracy.
        let _waiting = self.clock.span(Bucket::Communicating);
        self.store.flush().await?;
        self.settle().await?;
        self.acking.push_back(tokio::spawn(acknowledge(
            self.store.clone(),
            self.acks.clone(),
            self.trainer.clone(),
            task,
            records,
            started,
        )));
        Ok(())
    }

    /// Task `task` was trained whole (`records`, since `started`) by a loop that pushes
    /// in the background (the runtime's pipeline): it is acknowledged in the background
    /// once `applied` says its pushes are applied (or handed back, when it says the task
    /// was taken away), with at most
    /// [`ACKS_IN_FLIGHT`] acknowledgements under way (this call waits for the oldest
    /// beyond that). Nothing is flushed: the loop's next task does not wait for them.
    pub async fn computed(
        &mut self,
        task: LeasedTask,
        records: u64,
        started: Instant,
        applied: impl std::future::Future<Output = Result<Pushes, StoreError>> + Send + 'static,
    ) -> Result<(), RuntimeError> {
        let _waiting = self.clock.span(Bucket::Communicating);
        while self
            .acking
            .front()
            .is_some_and(|h| h.is_finished() || self.acking.len() >= ACKS_IN_FLIGHT)
        {
            self.settle_oldest().await?;
        }
        let (store, acks, trainer) = (self.store.clone(), self.acks.clone(), self.trainer.clone());
        self.acking.push_back(tokio::spawn(async move {
            match applied.await? {
                Pushes::Applied => acknowledge(store, acks, trainer, task, records, started).await,
                Pushes::TakenAway(why) => {
                    Ok(taken_away(&acks, &task, records, started, &why).await)
                }
            }
        }));
        Ok(())
    }

    /// Hands `task` back (a drain) after this attempt trained `trained` of its records.
    /// `resume_at`, when the loop knows it: the batch (counted from the task's first)
    /// before which every batch is applied, and their records; the next attempt resumes
    /// there, and they are not trained again. `None` leaves the task to be trained from
    /// where this attempt started. The tasks read ahead are handed back next, and the
    /// trainer leaves the sync steps.
    pub async fn hand_back(
        &mut self,
        task: &LeasedTask,
        trained: u64,
        resume_at: Option<(u32, u64)>,
    ) -> Result<(), RuntimeError> {
        let _waiting = self.clock.span(Bucket::Communicating);
        self.store.flush().await?;
        self.settle().await?;
        self.idle().await;
        // Per shard, the oldest incarnation that answered the task's pushes (and those
        // of the attempts it resumed after): what a finishing attempt's done record
        // must name, so that a shard restored since trains the task again whole.
        let answered = self.store.handed_back(task_ref(task));
        let resume = resume_at
            .filter(|&(batch, _)| batch > 0)
            .map(|(batch, records)| Resume {
                batch,
                records,
                answered,
            });
        let how = Release::Drained { trained, resume };
        match self.acks.release(task, &how).await {
            Ok(_) => {
                tracing::info!(task = %task.id, trained, resume_at = ?resume_at.map(|r| r.0), "handed the task back")
            }
            Err(e) => {
                tracing::warn!(task = %task.id, error = %e, "handing the task back failed; the master will requeue it when this trainer's registration ends")
            }
        }
        // Then the tasks read ahead (the master dispatches hand-backs in dataset order).
        self.reader.release_read_ahead().await;
        self.progress.handed_back_trained += trained;
        self.progress.drained = true;
        Ok(())
    }

    /// Fails `task` for `reason` (its data is bad), after `trained` of its records were
    /// trained; the master retries it up to `max_failures` times.
    pub async fn fail(
        &mut self,
        task: &LeasedTask,
        reason: &str,
        trained: u64,
    ) -> Result<(), RuntimeError> {
        let _waiting = self.clock.span(Bucket::Communicating);
        self.store.flush().await?;
        self.settle().await?;
        tracing::warn!(task = %task.id, reason = %reason, "failing task: bad data");
        self.progress.failed_tasks += 1;
        match self.acks.failed(task, reason, trained).await {
            Err(e) if !e.is_stale() => Err(e.into()),
            _ => Ok(()),
        }
    }

    /// Tells the store this trainer is not computing for now (best effort; sync mode:
    /// the others' steps do not wait for it).
    pub async fn idle(&self) {
        if let Err(e) = self.store.idle(&self.trainer).await {
            tracing::warn!(error = %e, "could not leave the sync steps");
        }
    }

    /// Waits for the acknowledgements in flight, if any, and counts them.
    pub async fn settle(&mut self) -> Result<(), RuntimeError> {
        let _waiting = self.clock.span(Bucket::Communicating);
        while !self.acking.is_empty() {
            self.settle_oldest().await?;
        }
        Ok(())
    }

    /// Waits for the oldest acknowledgement in flight, if any, and counts it.
    async fn settle_oldest(&mut self) -> Result<(), RuntimeError> {
        let Some(handle) = self.acking.pop_front() else {
            return Ok(());
        };
        let acked = handle.await.map_err(|e| {
            StoreError::Unavailable(format!("acknowledging a task panicked: {e}"))
        })??;
        let state = &mut self.progress;
        match acked {
            Acked::Finished {
                records,
                taken: true,
                started,
            } => {
                state.tasks += 1;
                state.records += records;
                let secs = started.elapsed().as_secs_f64().max(1e-9);
                state.samples_per_sec = records as f64 / secs;
            }
            Acked::Finished { taken: false, .. } => {}
            Acked::Again => state.recomputed_tasks += 1,
        }
        Ok(())
    }

    /// Settles the acknowledgement in flight and stops the reader (tasks read ahead are
    /// handed back); the final counts.
    pub async fn close(mut self) -> Result<Progress, RuntimeError> {
        let _waiting = self.clock.span(Bucket::Communicating);
        let settled = self.settle().await;
        self.reader.drain().await;
        settled.map(|()| self.progress)
    }
}

/// Acknowledges task `task`, trained whole (`records`): waits until its pushes are
/// applied and it is recorded as done where the parameters live, then tells the
/// master; or hands it back to be trained again when a shard was restored meanwhile.
async fn acknowledge(
    store: Arc<dyn ParamStore>,
    acks: Acks,
    trainer: String,
    task: LeasedTask,
    records: u64,
    started: Instant,
) -> Result<Acked, RuntimeError> {
    match store.task_done(&trainer, task_ref(&task)).await {
        Ok(incarnations) => match acks.finished(&task, records, &incarnations).await {
            Ok(_) => Ok(Acked::Finished {
                records,
                taken: true,
                started,
            }),
            Err(e) if e.is_stale() => {
                tracing::warn!(task = %task.id, "task was taken away while training; its records were trained anyway");
                Ok(Acked::Finished {
                    records,
                    taken: false,
                    started,
                })
            }
            Err(e) => Err(e.into()),
        },
        Err(StoreError::Rewound(why)) => {
            tracing::warn!(task = %task.id, reason = %why, "training the task again");
            let how = Release::Recompute { trained: records };
            if let Err(e) = acks.release(&task, &how).await
                && !e.is_stale()
            {
                return Err(e.into());
            }
            Ok(Acked::Again)
        }
        Err(e) => Err(e.into()),
    }
}
