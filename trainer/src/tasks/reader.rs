//! The `cloud_reader`: a trainer's stream of leased tasks and their records.
//!
//! A background fetcher leases tasks from the master and reads each one's chunks with
//! the RecordIO range scanner, keeping up to `read_ahead` read tasks in a bounded buffer
//! so training never waits on I/O. The trainer takes a task, trains its records, and only
//! then acknowledges it with [`Acks::finished`] ([`CloudReader::acks`]): a task is done when its records
//! were trained, not when they were read. End of pass and end of job arrive as items: the
//! reader yields [`Next`]'s `Task`, `PassFinished` and `JobFinished` (the master's
//! [`Answer`]s made ready to train: a task read, a pass end with the pass that ended);
//! `Drained` and `Closed` are only [`Tasks::next`](super::Tasks::next)'s.
//!
//! Read-ahead follows the consumer's demand: the fetcher asks for its first task when the
//! trainer first calls [`CloudReader::next`], and after delivering the end of a pass it
//! asks for no task until the trainer calls `next` again. So no task is leased while the
//! trainer initialises its parameters or evaluates between passes: a task leased then
//! would sit in the buffer until its lease timed out, and the master would count a
//! cut-off toward the task's `max_losses`. Within a pass the buffer keeps the trainer
//! fed as before.
//!
//! A task whose chunks cannot be read (corrupt, truncated, changed since indexing) is
//! failed at the master with the reader's error as the reason, and the fetcher moves on;
//! the master retries it up to `max_failures` times and then reports it failed.
//!
//! Given the trainer's lease state ([`ReaderConfig::lease`]), the fetcher asks for no new
//! task while the lease is uncertain: etcd may have ended it, and the master would then
//! take back every task leased meanwhile (a trainer cut off from etcd alone would
//! otherwise churn through tasks it can never finish).
//!
//! Given the trainer's goodput clock ([`ReaderConfig::goodput`]), a keeper tells the
//! master, every [`KEEP_EVERY`] while the trainer waits on a pserver or the master (a
//! pull, a push or a report in flight and nothing computing, for [`KEEP_EVERY`] or
//! longer: [`GoodputClock::waiting_for`]), that it is alive and waiting, not stuck: the
//! master renews its tasks' leases (`KeepTasks`). So a pserver away for longer than the
//! task timeout, or a stopped peer of a sync step, does not make every waiting trainer
//! look stuck; a trainer that stops itself (SIGSTOP, a hung computation) sends nothing,
//! and its lease times out.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use edl_coord::LeaseState;
use edl_recordio::{ChunkIndex, RangeScanner, ReadOptions};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::goodput::GoodputClock;

use edl_master_client::task::{Answer, LeasedTask};
use edl_master_client::{ClientError, MasterClient, Release};

use super::Next;
use crate::progress::RuntimeError;

/// How often the keeper looks whether the trainer waits on a pserver or the master, and
/// how long a wait lasts before the master is told (a fraction of the shortest task
/// timeout a job would set).
pub const KEEP_EVERY: Duration = Duration::from_millis(500);

/// A wait the keeper logs (once).
const SAY_AFTER: Duration = Duration::from_secs(5);

/// The keeper (see the module docs): until `stop`.
async fn keep_while_waiting(
    client: MasterClient,
    trainer: String,
    clock: GoodputClock,
    stop: CancellationToken,
) {
    let mut said = false;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(KEEP_EVERY) => {}
        }
        let Some(waited) = clock.waiting_for().filter(|w| *w >= KEEP_EVERY) else {
            said = false;
            continue;
        };
        let kept = tokio::select! {
            _ = stop.cancelled() => return,
            kept = client.keep_tasks(&trainer) => kept,
        };
        match kept {
            // Said once per wait, and only of a long one: a sync step waits on its
            // slowest peer every time.
            Ok(kept) if kept > 0 && waited >= SAY_AFTER && !std::mem::replace(&mut said, true) => {
                tracing::info!(
                    tasks = kept,
                    waited_s = waited.as_secs_f64(),
                    "waiting on a pserver or the master: the master keeps this trainer's tasks"
                );
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "could not tell the master this trainer waits"),
        }
    }
}

/// Reader settings.
#[derive(Clone, Debug)]
pub struct ReaderConfig {
    /// This trainer's id (its registration under `trainers/`).
    pub trainer: String,
    /// Read tasks buffered ahead of the trainer.
    pub read_ahead: usize,
    /// Long-poll wait of each `GetTask`.
    pub wait: Duration,
    /// The pass to start in (a joining trainer starts in the current one; the master
    /// says so if it is behind).
    pub start_pass: u32,
    /// The state of the trainer's etcd lease, if known: no new task is asked for while
    /// it is [`LeaseState::Uncertain`].
    pub lease: Option<watch::Receiver<LeaseState>>,
    /// The trainer's goodput clock, if it measures one: its totals go with each
    /// `GetTask` (the leader shows them in `Status`).
    pub goodput: Option<GoodputClock>,
}

impl ReaderConfig {
    /// Defaults for trainer `trainer`: 2 tasks ahead, 5 s long-polls, from pass 0, no
    /// lease state.
    pub fn new(trainer: impl Into<String>) -> Self {
        ReaderConfig {
            trainer: trainer.into(),
            read_ahead: 2,
            wait: Duration::from_secs(5),
            start_pass: 0,
            lease: None,
            goodput: None,
        }
    }
}

/// A leased task with its records, read and ready to train.
#[derive(Clone, Debug)]
pub struct TaskData {
    /// The lease (id, generation, pass, file and chunk range).
    pub task: LeasedTask,
    /// Its records, in file order.
    pub records: Vec<Vec<u8>>,
}

/// Why reading failed.
#[derive(Debug, thiserror::Error)]
pub enum ReaderError {
    /// The master could not be reached or refused.
    #[error(transparent)]
    Client(#[from] ClientError),
}

impl From<ReaderError> for RuntimeError {
    fn from(e: ReaderError) -> Self {
        match e {
            ReaderError::Client(c) => RuntimeError::Master(c),
        }
    }
}

/// The trainer's reader of leased tasks.
#[derive(Debug)]
pub struct CloudReader {
    client: MasterClient,
    trainer: String,
    rx: mpsc::Receiver<Result<Next, ReaderError>>,
    /// How many items the consumer asked for (calls of `next`).
    asked: watch::Sender<u64>,
    stop: CancellationToken,
    fetcher: Option<JoinHandle<()>>,
    goodput: Option<GoodputClock>,
}

impl CloudReader {
    /// Starts fetching for `cfg.trainer`.
    pub fn start(client: MasterClient, cfg: ReaderConfig) -> CloudReader {
        let (tx, rx) = mpsc::channel(cfg.read_ahead.max(1));
        let stop = CancellationToken::new();
        let trainer = cfg.trainer.clone();
        let goodput = cfg.goodput.clone();
        let (asked, asks) = watch::channel(0);
        if let Some(clock) = goodput.clone() {
            tokio::spawn(
                keep_while_waiting(client.clone(), trainer.clone(), clock, stop.clone())
                    .in_current_span(),
            );
        }
        let fetcher = tokio::spawn(
            Fetcher {
                client: client.clone(),
                cfg,
                tx,
                stop: stop.clone(),
                indexes: HashMap::new(),
                asks,
                sent: 0,
                gate: Some(0),
            }
            .run()
            .in_current_span(),
        );
        CloudReader {
            client,
            trainer,
            rx,
            asked,
            stop,
            fetcher: Some(fetcher),
            goodput,
        }
    }

    /// The trainer's goodput clock, if it measures one ([`ReaderConfig::goodput`]).
    pub fn goodput(&self) -> Option<&GoodputClock> {
        self.goodput.as_ref()
    }

    /// The next item; `None` after `JobFinished` or an error. The first call starts the
    /// read-ahead, and so does the first call after a `PassFinished` item.
    pub async fn next(&mut self) -> Option<Result<Next, ReaderError>> {
        self.asked.send_modify(|n| *n += 1);
        self.rx.recv().await
    }

    /// The acknowledgements of this reader's tasks as a handle of their own, which can
    /// move to another task: a trainer acknowledges one task while it trains the next.
    pub fn acks(&self) -> Acks {
        Acks {
            client: self.client.clone(),
            trainer: self.trainer.clone(),
        }
    }

    /// Stops fetching and hands back every task read ahead but not yet taken; returns
    /// once the fetcher stopped (it hands back a task it leased meanwhile itself).
    pub async fn drain(mut self) {
        self.release_read_ahead().await;
        if let Some(f) = self.fetcher.take() {
            let _ = f.await;
        }
    }

    /// Stops fetching and hands back every task read ahead but not yet taken, at once:
    /// the fetcher hands back a task it leases meanwhile itself (a long poll in flight
    /// may take its wait to answer).
    pub async fn release_read_ahead(&mut self) {
        self.stop.cancel();
        self.rx.close();
        while let Some(item) = self.rx.recv().await {
            if let Ok(Next::Task(t)) = item
                && let Err(e) = self.acks().release(&t.task, &Release::untrained()).await
            {
                tracing::warn!(task = %t.task.id, error = %e, "handing back a read-ahead task failed");
            }
        }
    }
}

impl Drop for CloudReader {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// What a trainer tells the master about its leased tasks ([`CloudReader::acks`]).
#[derive(Clone, Debug)]
pub struct Acks {
    client: MasterClient,
    trainer: String,
}

impl Acks {
    /// Acknowledges a task whose records were trained. `Ok(false)`: already reported.
    /// A stale lease (the task was taken away meanwhile) is `Err` with `is_stale()`.
    pub async fn finished(
        &self,
        task: &LeasedTask,
        records: u64,
        incarnations: &[u64],
    ) -> Result<bool, ClientError> {
        self.client
            .task_finished(&self.trainer, task, records, incarnations)
            .await
    }

    /// Reports a task that could not be trained (it is retried, up to `max_failures`).
    pub async fn failed(
        &self,
        task: &LeasedTask,
        reason: &str,
        records_trained: u64,
    ) -> Result<bool, ClientError> {
        self.client
            .task_failed(&self.trainer, task, reason, records_trained)
            .await
    }

    /// Hands a task back: see [`Release`].
    pub async fn release(&self, task: &LeasedTask, how: &Release) -> Result<bool, ClientError> {
        self.client.release_task(&self.trainer, task, how).await
    }
}

struct Fetcher {
    client: MasterClient,
    cfg: ReaderConfig,
    tx: mpsc::Sender<Result<Next, ReaderError>>,
    stop: CancellationToken,
    indexes: HashMap<String, Arc<ChunkIndex>>,
    /// The consumer's asks (see [`CloudReader::next`]).
    asks: watch::Receiver<u64>,
    /// Items sent to the consumer.
    sent: u64,
    /// Lease nothing until the consumer asked for more than this many items.
    gate: Option<u64>,
}

impl Fetcher {
    async fn run(mut self) {
        let mut pass = self.cfg.start_pass;
        let mut request: u64 = 1;
        loop {
            if self.stop.is_cancelled()
                || !self.wait_for_demand().await
                || !self.hold_while_uncertain().await
            {
                return;
            }
            let client = self.client.clone();
            let trainer = self.cfg.trainer.clone();
            let goodput = self.cfg.goodput.as_ref().map(GoodputClock::snapshot);
            let call = client.get_task(&trainer, pass, request, self.cfg.wait, goodput.as_ref());
            tokio::pin!(call);
            let next = tokio::select! {
                r = &mut call => r,
                _ = self.stop.cancelled() => {
                    // Finish the call in flight (it is bounded by the long-poll wait): the
                    // master may already have leased a task for it, which must be handed
                    // back rather than left pending under a live registration.
                    let grace = self.cfg.wait + Duration::from_secs(5);
                    if let Ok(Ok(Answer::Task(task))) = tokio::time::timeout(grace, call).await
                        && let Err(e) = self.client.release_task(&self.cfg.trainer, &task, &Release::untrained()).await
                    {
                        tracing::warn!(task = %task.id, error = %e, "handing back a task leased while draining failed");
                    }
                    return;
                }
            };
            match next {
                Ok(Answer::Task(task)) => {
                    request += 1;
                    self.deliver(task).await;
                }
                Ok(Answer::Wait) => {}
                Ok(Answer::PassFinished(next)) if next < pass => {
                    // The queue went back: a pserver shard was restored without some
                    // of the training since; it is trained again.
                    tracing::warn!(
                        from = pass,
                        to = next,
                        "the master went back to an earlier pass (a parameter server was restored)"
                    );
                    pass = next;
                }
                Ok(Answer::PassFinished(next)) => {
                    let ended = pass;
                    pass = next;
                    if self
                        .send(Ok(Next::PassFinished { ended, next }))
                        .await
                        .is_err()
                    {
                        return;
                    }
                    // The trainer may evaluate now: lease nothing until it asks again.
                    self.gate = Some(self.sent);
                }
                Ok(Answer::JobFinished) => {
                    let _ = self.send(Ok(Next::JobFinished)).await;
                    return;
                }
                Err(ClientError::Cancelled) => return,
                Err(e) => {
                    let _ = self.send(Err(e.into())).await;
                    return;
                }
            }
        }
    }

    /// Waits until the consumer asked for more items than the gate; `false` when
    /// stopped meanwhile.
    async fn wait_for_demand(&mut self) -> bool {
        let Some(gate) = self.gate else {
            return true;
        };
        tokio::select! {
            _ = self.stop.cancelled() => false,
            // The reader dropped (its sender gone) stops the fetcher too.
            r = self.asks.wait_for(|&n| n > gate) => {
                self.gate = None;
                r.is_ok()
            }
        }
    }

    /// Waits while the trainer's lease is uncertain; `false` when stopped meanwhile.
    async fn hold_while_uncertain(&mut self) -> bool {
        let Some(lease) = self.cfg.lease.as_mut() else {
            return true;
        };
        if *lease.borrow_and_update() != LeaseState::Uncertain {
            return true;
        }
        let trainer = &self.cfg.trainer;
        tracing::warn!(%trainer, "etcd has not confirmed this trainer's lease: no new task until it does");
        tokio::select! {
            _ = self.stop.cancelled() => false,
            // The lease dropped (its sender gone) ends the hold as well: the trainer stops.
            r = lease.wait_for(|s| *s != LeaseState::Uncertain) => {
                if r.is_ok_and(|s| *s == LeaseState::Held) {
                    tracing::info!(%trainer, "lease confirmed; asking for tasks again");
                }
                true
            }
        }
    }

    async fn send(&mut self, item: Result<Next, ReaderError>) -> Result<(), ()> {
        tokio::select! {
            _ = self.stop.cancelled() => return Err(()),
            r = self.tx.send(item) => r.map_err(|_| ())?,
        }
        self.sent += 1;
        Ok(())
    }

    /// Reads a leased task and queues it; a task that cannot be read is failed at the
    /// master; one that cannot be queued (stopping) is handed back.
    async fn deliver(&mut self, task: LeasedTask) {
        let index = self.indexes.get(&task.path).cloned();
        let t = task.clone();
        let read = tokio::task::spawn_blocking(move || read_task(&t, index)).await;
        let read = match read {
            Ok(r) => r,
            Err(e) => Err(ReadError::Bad(format!(
                "reading task {} panicked: {e}",
                task.id
            ))),
        };
        match read {
            Ok((records, index)) => {
                if let Some(index) = index {
                    self.indexes.insert(task.path.clone(), index);
                }
                let data = TaskData {
                    task: task.clone(),
                    records,
                };
                if self.send(Ok(Next::Task(data))).await.is_err()
                    && let Err(e) = self
                        .client
                        .release_task(&self.cfg.trainer, &task, &Release::untrained())
                        .await
                {
                    if matches!(e, ClientError::Cancelled) {
                        // Shutting down: the lease ends with the trainer's registration.
                        tracing::debug!(task = %task.id, "shutting down before handing back an unread task");
                    } else {
                        tracing::warn!(task = %task.id, error = %e, "handing back an unread task failed");
                    }
                }
            }
            Err(ReadError::Unavailable(reason)) => {
                // The store is down or slow (after its own retries): the data is not
                // bad, so the task goes back unfailed and this reader waits a moment.
                tracing::warn!(task = %task.id, reason = %reason, "cannot reach the task's data; handing it back");
                if let Err(e) = self
                    .client
                    .release_task(&self.cfg.trainer, &task, &Release::untrained())
                    .await
                {
                    tracing::warn!(task = %task.id, error = %e, "handing back a task failed");
                }
                tokio::select! {
                    _ = self.stop.cancelled() => {}
                    _ = tokio::time::sleep(UNAVAILABLE_PAUSE) => {}
                }
            }
            Err(ReadError::Bad(reason)) => {
                tracing::warn!(task = %task.id, reason = %reason, "cannot read task; failing it");
                self.indexes.remove(&task.path);
                if let Err(e) = self
                    .client
                    .task_failed(&self.cfg.trainer, &task, &reason, 0)
                    .await
                {
                    tracing::warn!(task = %task.id, error = %e, "reporting a failed task failed");
                }
            }
        }
    }
}

/// A task's records, with its file's index (none for an object) to keep for the next
/// task of the same file.
type TaskRead = (Vec<Vec<u8>>, Option<Arc<ChunkIndex>>);

/// How long a reader waits after its task's data store could not be reached.
const UNAVAILABLE_PAUSE: std::time::Duration = std::time::Duration::from_secs(1);

/// Why a task could not be read.
#[derive(Debug)]
enum ReadError {
    /// The data is missing, changed or damaged: the task fails, saying why.
    Bad(String),
    /// Its store could not be reached: the task goes back, not failed.
    Unavailable(String),
}

impl From<String> for ReadError {
    fn from(s: String) -> Self {
        ReadError::Bad(s)
    }
}

impl From<edl_storage::Error> for ReadError {
    fn from(e: edl_storage::Error) -> Self {
        if e.is_transient() {
            ReadError::Unavailable(e.to_string())
        } else {
            ReadError::Bad(e.to_string())
        }
    }
}

/// Reads the records of a task's chunk range (blocking I/O). Returns them with the
/// file's index, cached for the next task of the same file (an object's task is read
/// without one: [`read_object_task`]).
fn read_task(task: &LeasedTask, cached: Option<Arc<ChunkIndex>>) -> Result<TaskRead, ReadError> {
    if edl_storage::blocking::is_object_url(&task.path) {
        return read_object_task(task).map(|records| (records, None));
    }
    let index = match cached {
        Some(i) => i,
        None => Arc::new(ChunkIndex::build(PathBuf::from(&task.path)).map_err(|e| e.to_string())?),
    };
    let (begin, end) = (task.chunk_begin as usize, task.chunk_end as usize);
    let first = index.chunks.get(begin).map(|c| c.offset);
    if end > index.chunks.len() || begin >= end || first != Some(task.offset_begin) {
        return Err(ReadError::Bad(format!(
            "{} changed since the master indexed it: chunks {begin}..{end} at byte {} not found",
            task.path, task.offset_begin
        )));
    }
    let mut scanner = RangeScanner::open(&index, begin..end, ReadOptions::default())
        .map_err(|e| e.to_string())?;
    let mut records = Vec::with_capacity(task.records as usize);
    while let Some(r) = scanner.next_record().map_err(|e| e.to_string())? {
        records.push(r.to_vec());
    }
    if records.len() as u64 != task.records {
        return Err(ReadError::Bad(format!(
            "{} chunks {begin}..{end}: read {} records, the master indexed {}",
            task.path,
            records.len(),
            task.records
        )));
    }
    Ok((records, Some(index)))
}

/// Reads a task of an object: its byte range in one ranged read, then its chunks from
/// it (each checked as from a file: a damaged one fails the task with the object's URL
/// and the chunk's byte offset).
fn read_object_task(task: &LeasedTask) -> Result<Vec<Vec<u8>>, ReadError> {
    use edl_recordio::ChunkReader;
    let mut object = edl_storage::blocking::ObjectReader::open(&task.path)?;
    if object.len() < task.offset_end || task.offset_begin >= task.offset_end {
        return Err(ReadError::Bad(format!(
            "{} changed since the master indexed it: bytes {}..{} not found ({} bytes now)",
            task.path,
            task.offset_begin,
            task.offset_end,
            object.len()
        )));
    }
    object.prefetch(task.offset_begin..task.offset_end)?;
    let mut chunks = ChunkReader::new(object, PathBuf::from(&task.path), ReadOptions::default())
        .starting_at(task.offset_begin, u64::from(task.chunk_begin));
    let mut records = Vec::with_capacity(task.records as usize);
    for _ in task.chunk_begin..task.chunk_end {
        match chunks.next_chunk().map_err(|e| e.to_string())? {
            Some(chunk) => records.extend(chunk.iter().map(<[u8]>::to_vec)),
            None => {
                return Err(ReadError::Bad(format!(
                    "{} ends before chunk {} of the task",
                    task.path, task.chunk_end
                )));
            }
        }
    }
    if records.len() as u64 != task.records {
        return Err(ReadError::Bad(format!(
            "{} chunks {}..{}: read {} records, the master indexed {}",
            task.path,
            task.chunk_begin,
            task.chunk_end,
            records.len(),
            task.records
        )));
    }
    Ok(records)
}

#[cfg(test)]
mod tests;
