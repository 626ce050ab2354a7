//! The leader's queue actor: one task owns the [`Queue`], applies requests in batches,
//! makes each batch durable with one fenced etcd transaction (group commit) and only then
//! replies. Long-polling `GetTask` calls are parked until a task frees up or their wait
//! runs out; lease deadlines are served by the same loop.
//!
//! If a commit fails the in-memory queue may be ahead of etcd: the batch's callers get
//! `Unavailable` (they retry idempotently) and the actor rebuilds the queue from etcd
//! before serving again. If its fence is broken (another master leads) it stops. If etcd
//! is full the job pauses (`space`): requests are refused with `EtcdFull` until a write
//! fits again, then the queue is rebuilt and served.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backoff, RetryPolicy};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::dataset::{self, Dataset, DatasetSpec};
use crate::error::MasterError;
use crate::queue::{self, Ack, Expired, GetTask, Millis, Queue, QueueConfig, Task};
use crate::store::{Loaded, Store};
use edl_master_api::task::{Answer, LeasedTask};

mod handle;
mod space;
#[cfg(test)]
pub(crate) mod tests;

use handle::{Cmd, Reply};
pub use handle::{CoreHandle, StatusReport, StuckTrainer};

/// Most requests applied in one batch by default. Each request changes at most one task
/// record, so a batch's changes usually fit one etcd transaction
/// (`store::MAX_OPS_PER_TXN`); bulk events (a lost trainer holding many tasks, many
/// leases timing out at once) are committed through the store's journal, atomically
/// all the same.
pub const DEFAULT_MAX_BATCH: usize = 100;

/// Longest a `GetTask` may be parked.
pub const MAX_WAIT: Duration = Duration::from_secs(30);

/// A parked `GetTask`.
#[derive(Debug)]
struct Parked {
    trainer: String,
    pass: u32,
    request: u64,
    until: Instant,
    reply: Reply<Answer>,
}

/// A reply to send once the batch is durable.
enum Pending {
    Task(Reply<Answer>, Result<Answer, MasterError>),
    Ack(Reply<bool>, Result<bool, MasterError>),
    Dataset(Reply<(Dataset, bool)>, Result<(Dataset, bool), MasterError>),
    Status(Reply<StatusReport>, StatusReport),
}

/// The actor's state.
pub(crate) struct Core {
    store: Store,
    cfg: QueueConfig,
    max_batch: usize,
    dataset: Option<Dataset>,
    queue: Option<Queue>,
    parked: Vec<Parked>,
    epoch: Instant,
    /// etcd refused a write for lack of space (why, and what to do): the actor waits
    /// for space before it serves again, and its status says the job is paused.
    full: Option<String>,
    /// When this master last freed etcd's space (compaction and defragmentation).
    freed_at: Option<Instant>,
    /// Trainers whose lease timed out while they stayed registered, by trainer, with
    /// when ([`StuckTrainer`]); forgotten when the trainer's registration goes, or after
    /// [`STUCK_KEPT`].
    stuck: BTreeMap<String, (Expired, Millis)>,
    /// Renewals of the leases of trainers waiting on a pserver or the master.
    leases_kept: u64,
    rx: mpsc::Receiver<Cmd>,
}

/// How long a stuck trainer that is still registered is reported.
const STUCK_KEPT: Millis = 10 * 60 * 1000;

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("dataset", &self.dataset.is_some())
            .field("parked", &self.parked.len())
            .finish_non_exhaustive()
    }
}

impl Core {
    /// Loads the durable state and returns the actor and its handle. Pending leases
    /// are re-armed from now.
    #[cfg(test)]
    pub(crate) async fn start(
        store: Store,
        cfg: QueueConfig,
        max_batch: usize,
    ) -> Result<(Core, CoreHandle), MasterError> {
        Core::start_from(store, cfg, max_batch, None).await
    }

    /// [`Core::start`] from `loaded`, the records as etcd holds them now (a standby's
    /// [`Mirror`](crate::mirror::Mirror)), instead of reading them; `None`: read them.
    pub(crate) async fn start_from(
        store: Store,
        cfg: QueueConfig,
        max_batch: usize,
        loaded: Option<Loaded>,
    ) -> Result<(Core, CoreHandle), MasterError> {
        let (tx, rx) = mpsc::channel(4096);
        let mut core = Core {
            store,
            cfg,
            max_batch: max_batch.max(1),
            dataset: None,
            queue: None,
            parked: Vec::new(),
            epoch: Instant::now(),
            full: None,
            freed_at: None,
            stuck: BTreeMap::new(),
            leases_kept: 0,
            rx,
        };
        match core.reload(loaded).await {
            Ok(()) => {}
            // Started on a full etcd: the run loop waits for space before serving.
            Err(MasterError::EtcdFull(why)) => core.full = Some(why),
            Err(e) => return Err(e),
        }
        Ok((
            core,
            CoreHandle {
                tx,
                recent: Arc::default(),
            },
        ))
    }

    fn now(&self) -> Millis {
        self.epoch.elapsed().as_millis() as Millis
    }

    fn to_instant(&self, ms: Millis) -> Instant {
        self.epoch + Duration::from_millis(ms)
    }

    /// Rebuilds the queue from etcd (or from `loaded`, what etcd holds now) and writes
    /// what the rebuild changed (re-armed leases, reset tasks, rewinds).
    async fn reload(&mut self, loaded: Option<Loaded>) -> Result<(), MasterError> {
        let mut loaded = self.load_queue(loaded).await?;
        if let Some((_, q)) = loaded.as_mut() {
            let changes = q.take_changes();
            self.store.commit(&changes).await?;
            tracing::info!(
                pass = q.pass(),
                tasks = q.tasks().len(),
                pending = q.counts().pending,
                "queue restored from etcd"
            );
        }
        (self.dataset, self.queue) = loaded.unzip();
        Ok(())
    }

    /// The dataset and the queue as etcd holds them (`None` before a dataset is
    /// defined); what the rebuild changed is not written yet.
    async fn load_queue(
        &mut self,
        loaded: Option<Loaded>,
    ) -> Result<Option<(Dataset, Queue)>, MasterError> {
        let l = match loaded {
            Some(l) => l,
            None => match self.store.load().await? {
                Some(l) => l,
                None => return Ok(None),
            },
        };
        let now = self.now();
        let mut cfg = self.cfg.clone();
        cfg.passes = l.dataset.spec.passes;
        let mut q = Queue::restore(cfg, l.meta, l.tasks, l.failed, now);
        if (q.tasks().len() as u64) < l.dataset.tasks {
            return Err(MasterError::Unavailable(format!(
                "etcd holds {} task records, the dataset has {}",
                q.tasks().len(),
                l.dataset.tasks
            )));
        }
        // Every restore record, not only those that change from now on: a restore
        // applied before a failed commit or a failover is applied again (once per
        // incarnation, as always), and later acknowledgements are checked against
        // every one.
        for r in self.store.restores().await? {
            q.rewind(&r);
        }
        Ok(Some((l.dataset, q)))
    }

    /// Runs until `cancel` fires, the handles are dropped or the fence breaks.
    pub(crate) async fn run(mut self, cancel: CancellationToken) -> Result<(), MasterError> {
        let mut batch: Vec<Cmd> = Vec::new();
        loop {
            if let Some(why) = self.full.clone() {
                self.wait_for_space(why, &cancel).await?;
                if self.full.is_some() {
                    break;
                }
            }
            let wake = self.next_wake();
            tokio::select! {
                biased;
                _ = cancel.cancelled() => break,
                cmd = self.rx.recv() => {
                    let Some(cmd) = cmd else { break };
                    batch.push(cmd);
                    while batch.len() < self.max_batch {
                        match self.rx.try_recv() {
                            Ok(cmd) => batch.push(cmd),
                            Err(_) => break,
                        }
                    }
                }
                _ = sleep_until_opt(wake) => {}
            }
            let mut replies = Vec::with_capacity(batch.len());
            for cmd in batch.drain(..) {
                self.apply(cmd, &mut replies).await;
            }
            let now = self.now();
            if let Some(q) = &mut self.queue {
                for e in q.tick(now) {
                    tracing::warn!(
                        trainer = %e.trainer,
                        task = %e.task,
                        held_s = e.held_ms as f64 / 1000.0,
                        "trainer stuck: no report on its task for the task timeout; the \
                         task is handed out again"
                    );
                    self.stuck.insert(e.trainer.clone(), (e, now));
                }
            }
            self.stuck
                .retain(|_, (_, at)| now.saturating_sub(*at) < STUCK_KEPT);
            self.serve_parked(&mut replies);
            let changes = match &mut self.queue {
                Some(q) => q.take_changes(),
                None => Default::default(),
            };
            if !changes.is_empty()
                && let Err(e) = self.store.commit(&changes).await
            {
                fail_all(replies, &e);
                match e {
                    MasterError::NotLeader { .. } => return Err(e),
                    MasterError::EtcdFull(why) => self.full = Some(why),
                    e => {
                        tracing::warn!(error = %e, "queue commit failed; rebuilding from etcd");
                        self.recover(&cancel).await?;
                    }
                }
                continue;
            }
            for r in replies {
                r.send();
            }
        }
        for p in self.parked.drain(..) {
            let _ = p.reply.send(Err(MasterError::Unavailable(
                "the master is stopping".into(),
            )));
        }
        Ok(())
    }

    /// Retries `reload` until it works, etcd is found full (then the run loop waits
    /// for space), the fence breaks or we are cancelled.
    async fn recover(&mut self, cancel: &CancellationToken) -> Result<(), MasterError> {
        let mut backoff = Backoff::new(
            RetryPolicy::forever().with_delays(Duration::from_millis(50), Duration::from_secs(2)),
        );
        for p in self.parked.drain(..) {
            let _ = p.reply.send(Err(MasterError::Unavailable(
                "master state being rebuilt".into(),
            )));
        }
        loop {
            match self.reload(None).await {
                Ok(()) => return Ok(()),
                Err(e @ MasterError::NotLeader { .. }) => return Err(e),
                Err(MasterError::EtcdFull(why)) => {
                    self.full = Some(why);
                    return Ok(());
                }
                Err(e) => tracing::warn!(error = %e, "rebuilding the queue failed; retrying"),
            }
            if !backoff.wait(cancel).await {
                return Err(MasterError::Unavailable("stopping".into()));
            }
        }
    }

    fn next_wake(&self) -> Option<Instant> {
        let lease = self
            .queue
            .as_ref()
            .and_then(Queue::next_deadline)
            .map(|ms| self.to_instant(ms));
        let parked = self.parked.iter().map(|p| p.until).min();
        match (lease, parked) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn lease(&self, task: Task) -> Answer {
        let path = self
            .dataset
            .as_ref()
            .and_then(|d| d.files.get(task.spec.file as usize))
            .map(|f| f.path.clone())
            .unwrap_or_default();
        let (index, tasks) = self.queue.as_ref().map_or((0, 0), |q| {
            (q.position(&task.spec.id).unwrap_or(0), q.len())
        });
        Answer::Task(LeasedTask {
            id: task.spec.id.clone(),
            path,
            chunk_begin: task.spec.chunk_begin,
            chunk_end: task.spec.chunk_end,
            records: task.spec.records,
            pass: task.pass,
            generation: task.generation,
            failures: task.failures,
            offset_begin: task.spec.offset_begin,
            offset_end: task.spec.offset_end,
            index: index as u32,
            tasks: tasks as u32,
            dispatches: task.dispatches,
            resume: task.resume.as_ref().map(|r| edl_master_api::Resume {
                batch: r.batch,
                records: r.records,
                answered: r.answered.clone(),
            }),
        })
    }

    fn try_get(&mut self, trainer: &str, pass: u32, request: u64) -> Answer {
        let now = self.now();
        let Some(q) = &mut self.queue else {
            return Answer::Wait;
        };
        match q.get_task(trainer, pass, request, now) {
            GetTask::Task(t) => self.lease(t),
            GetTask::Wait => Answer::Wait,
            GetTask::PassFinished { next_pass } => Answer::PassFinished(next_pass),
            GetTask::JobFinished => Answer::JobFinished,
        }
    }

    async fn apply(&mut self, cmd: Cmd, replies: &mut Vec<Pending>) {
        match cmd {
            Cmd::SetDataset { spec, reply } => {
                let r = self.set_dataset(spec).await;
                replies.push(Pending::Dataset(reply, r));
            }
            Cmd::GetTask {
                trainer,
                pass,
                request,
                wait,
                reply,
            } => match self.try_get(&trainer, pass, request) {
                Answer::Wait if !wait.is_zero() => self.parked.push(Parked {
                    trainer,
                    pass,
                    request,
                    until: Instant::now() + wait,
                    reply,
                }),
                r => replies.push(Pending::Task(reply, Ok(r))),
            },
            Cmd::Finished {
                id,
                generation,
                records,
                incarnations,
                reply,
            } => {
                let now = self.now();
                let r = match self.restores_before(&incarnations).await {
                    Ok(()) => self
                        .with_queue(|q| q.finished(&id, generation, records, &incarnations, now)),
                    Err(e) => Err(e),
                };
                replies.push(Pending::Ack(reply, r));
            }
            Cmd::Failed {
                id,
                generation,
                reason,
                trained,
                reply,
            } => {
                let r = self.with_queue(|q| q.failed(&id, generation, &reason, trained));
                if r.is_ok() {
                    tracing::warn!(task = %id, reason = %reason, "task failed");
                }
                replies.push(Pending::Ack(reply, r));
            }
            Cmd::Release {
                id,
                generation,
                how,
                reply,
            } => {
                let r = self.with_queue(|q| q.released(&id, generation, &how));
                replies.push(Pending::Ack(reply, r));
            }
            Cmd::Keep { trainer, reply } => {
                // Nothing to make durable: answered at once.
                let now = self.now();
                let kept = self.queue.as_mut().map_or(0, |q| q.keep(&trainer, now));
                if kept > 0 {
                    self.leases_kept += 1;
                    tracing::debug!(%trainer, tasks = kept, "waiting on a pserver or the master: its leases kept");
                }
                let _ = reply.send(Ok(u32::try_from(kept).unwrap_or(u32::MAX)));
            }
            Cmd::Status { reply } => replies.push(Pending::Status(reply, self.status())),
            Cmd::TrainersLost { trainers } => {
                for t in &trainers {
                    self.stuck.remove(t);
                }
                if let Some(q) = &mut self.queue {
                    for t in trainers {
                        let revoked = q.trainer_lost(&t);
                        if !revoked.is_empty() {
                            tracing::warn!(trainer = %t, tasks = ?revoked, "trainer lost; its tasks are back in todo");
                        }
                    }
                }
            }
            Cmd::Restored { records } => {
                if let Some(q) = &mut self.queue {
                    for r in &records {
                        q.rewind(r);
                    }
                }
            }
            Cmd::Reconcile { registered } => {
                if let Some(q) = &mut self.queue {
                    let gone: Vec<String> = q
                        .holders()
                        .filter(|h| !registered.iter().any(|r| r == h))
                        .map(str::to_owned)
                        .collect();
                    for t in gone {
                        let revoked = q.trainer_lost(&t);
                        tracing::warn!(trainer = %t, tasks = ?revoked, "lease holder is not registered; its tasks are back in todo");
                    }
                }
            }
        }
    }

    /// Reads the restore records when an acknowledgement names a pserver incarnation
    /// the queue has not checked: a pserver publishes its restore before it serves, so
    /// the record is in etcd before any acknowledgement through it, and is applied before
    /// that acknowledgement, however late the follower delivers it (a record applied
    /// after passes completed on its own incarnation would take the queue back to them).
    async fn restores_before(&mut self, incarnations: &[u64]) -> Result<(), MasterError> {
        if !self
            .queue
            .as_ref()
            .is_some_and(|q| q.unchecked(incarnations))
        {
            return Ok(());
        }
        let records = self.store.restores().await?;
        if let Some(q) = &mut self.queue {
            q.restores_read(&records, incarnations);
        }
        Ok(())
    }

    fn with_queue(
        &mut self,
        f: impl FnOnce(&mut Queue) -> Result<Ack, queue::Reject>,
    ) -> Result<bool, MasterError> {
        match &mut self.queue {
            None => Err(MasterError::InvalidArgument(
                "no dataset is defined yet".into(),
            )),
            Some(q) => f(q).map(|a| a == Ack::Applied).map_err(MasterError::from),
        }
    }

    async fn set_dataset(&mut self, spec: DatasetSpec) -> Result<(Dataset, bool), MasterError> {
        if let Some(ds) = &self.dataset {
            spec.check_same(&ds.spec)?;
            return Ok((ds.clone(), false));
        }
        spec.validate()?;
        let indexed = {
            let spec = spec.clone();
            tokio::task::spawn_blocking(move || dataset::index(&spec))
                .await
                .map_err(|e| MasterError::Unavailable(format!("indexing task failed: {e}")))??
        };
        let (ds, specs) = indexed;
        let mut cfg = self.cfg.clone();
        cfg.passes = spec.passes;
        let mut q = Queue::new(cfg, specs);
        let changes = q.take_changes();
        self.store
            .create_dataset(&ds, &changes)
            .await
            .map_err(|e| match e {
                MasterError::TooLarge(m) => MasterError::InvalidArgument(format!(
                    "the dataset cannot be stored: {m} (a dataset of very many files: merge \
                     them into fewer, larger RecordIO files)"
                )),
                e => e,
            })?;
        tracing::info!(
            files = ds.files.len(),
            tasks = ds.tasks,
            records = ds.records,
            passes = spec.passes,
            "dataset defined"
        );
        self.dataset = Some(ds.clone());
        self.queue = Some(q);
        Ok((ds, true))
    }

    /// Answers parked calls that can be answered: a task freed up, the pass or job
    /// ended, or their wait ran out.
    fn serve_parked(&mut self, replies: &mut Vec<Pending>) {
        if self.parked.is_empty() {
            return;
        }
        let now = Instant::now();
        let parked = std::mem::take(&mut self.parked);
        for p in parked {
            if p.reply.is_closed() {
                continue;
            }
            match self.try_get(&p.trainer, p.pass, p.request) {
                Answer::Wait if p.until > now => self.parked.push(p),
                r => replies.push(Pending::Task(p.reply, Ok(r))),
            }
        }
    }

    /// The status report.
    /// The stuck trainers, most recent last.
    fn stuck_report(&self) -> Vec<StuckTrainer> {
        let now = self.now();
        let mut stuck: Vec<StuckTrainer> = self
            .stuck
            .values()
            .map(|(e, at)| StuckTrainer {
                trainer: e.trainer.clone(),
                task: e.task.clone(),
                held_ms: e.held_ms,
                ago_ms: now.saturating_sub(*at),
            })
            .collect();
        stuck.sort_by_key(|s| std::cmp::Reverse(s.ago_ms));
        stuck
    }

    fn status(&self) -> StatusReport {
        let Some(q) = &self.queue else {
            return StatusReport {
                paused: self.full.clone(),
                ..StatusReport::default()
            };
        };
        StatusReport {
            dataset_set: true,
            pass: q.pass(),
            passes: q.config().passes,
            finished: q.is_finished(),
            counts: q.counts(),
            total_records: self.dataset.as_ref().map(|d| d.records).unwrap_or(0),
            holders: q.holders().map(str::to_owned).collect(),
            counters: q.meta().counters.clone(),
            failed: q.meta().failed.clone(),
            timeout_ms: q.timeout(),
            paused: self.full.clone(),
            stuck: self.stuck_report(),
            leases_kept: self.leases_kept,
        }
    }
}

impl Pending {
    fn send(self) {
        match self {
            Pending::Task(tx, r) => {
                let _ = tx.send(r);
            }
            Pending::Ack(tx, r) => {
                let _ = tx.send(r);
            }
            Pending::Dataset(tx, r) => {
                let _ = tx.send(r);
            }
            Pending::Status(tx, r) => {
                let _ = tx.send(Ok(r));
            }
        }
    }
}

/// Fails every reply of a batch that could not be made durable.
fn fail_all(replies: Vec<Pending>, e: &MasterError) {
    let err = || match e {
        MasterError::NotLeader { leader } => MasterError::NotLeader {
            leader: leader.clone(),
        },
        MasterError::EtcdFull(why) => MasterError::EtcdFull(why.clone()),
        other => MasterError::Unavailable(other.to_string()),
    };
    for r in replies {
        match r {
            Pending::Task(tx, _) => {
                let _ = tx.send(Err(err()));
            }
            Pending::Ack(tx, _) => {
                let _ = tx.send(Err(err()));
            }
            Pending::Dataset(tx, _) => {
                let _ = tx.send(Err(err()));
            }
            Pending::Status(tx, _) => {
                let _ = tx.send(Err(err()));
            }
        }
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
