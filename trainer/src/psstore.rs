//! [`PsStore`]: the [`ParamStore`] of a job, over the parameter servers' client.
//!
//! - `init`: exactly one trainer initialises the shards (an etcd election inside
//!   [`PsClient::init`], recorded in `params/init`); the others wait and pull.
//! - `pull_dense`: pulls only blocks that changed since this trainer's copy (block
//!   versions in a [`DenseCache`]) and copies them into the model's order. Async mode
//!   prefetches: the next step's pull runs while this step computes (a step then misses
//!   at most this trainer's own last two pushes); after [`ParamStore::flush`] the next
//!   pull is fresh.
//! - `pull_sparse`: only the rows a batch touches.
//! - `push`: async mode pushes under this trainer's own step counter; sync mode pushes the
//!   global step learnt from the last pull. If that step closed without this trainer (it
//!   was slower than the step timeout, or it just joined), the gradients go to the next
//!   step (one step stale) rather than being dropped, a bounded number of times.
//! - Async mode overlaps communication with computation: `push` hands the gradients to a
//!   background task and returns, so the next batch's pull and forward/backward run
//!   while they travel; at most one push is in flight (the next push, [`ParamStore::flush`]
//!   and `idle` wait for it, and report its error). Parameters a trainer computes on
//!   therefore miss at most its own previous step (staleness 1, on top of the other
//!   trainers' asynchrony). Pushes are counted as sent and applied (in order, one in
//!   flight), so `task_done` waits for exactly the pushes made before it, not for a
//!   push made after it: the runtime acknowledges a task while it trains the next.
//! - `idle`: sync mode, a trainer with no task leaves the steps so the others do not wait
//!   for it; its next push brings it back.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use edl_pserver_client::error::ErrorKind;
use edl_pserver_client::{
    DenseCache, DenseInit, Origin, ParamConfig, PsClient, PsClientError, RowInit, SparsePush,
    SparseSpec,
};
use tokio::sync::Mutex;
use tracing::Instrument as _;

use crate::model::{Params, SparseInit, SparseRows, StepOutput};
use crate::store::{InitOutcome, ParamInit, ParamStore, Position, StoreError, TaskRef};

/// How often a sync push that keeps finding its step closed is moved to the next step
/// before its gradients are dropped.
const STALE_RETRIES: usize = 10;

/// A push that waits this long for its answer is logged ("a push waited"): what a
/// pserver's loss costs a trainer (scripts/bench-replicas reads these lines).
const STALL_LOGGED: std::time::Duration = std::time::Duration::from_millis(500);

/// Logs a push that waited at least [`STALL_LOGGED`] since `sent`.
fn note_stall(sent: std::time::Instant) {
    let waited = sent.elapsed();
    if waited >= STALL_LOGGED {
        tracing::info!(
            waited_s = format_args!("{:.3}", waited.as_secs_f64()),
            "a push waited"
        );
    }
}

/// Counters of one [`PsStore`].
#[derive(Debug, Default)]
pub struct PsStoreStats {
    /// Dense pulls.
    pub pulls: AtomicU64,
    /// Bytes of dense values received (only changed blocks move).
    pub pull_bytes: AtomicU64,
    /// Sparse pulls.
    pub sparse_pulls: AtomicU64,
    /// Sparse rows pulled.
    pub sparse_rows: AtomicU64,
    /// The most rows one sparse pull asked for.
    pub max_sparse_rows: AtomicU64,
    /// Pushes applied.
    pub pushes: AtomicU64,
    /// Sync pushes moved to a later step because theirs had closed.
    pub stale_pushes: AtomicU64,
    /// Sync pushes given up after being moved to a later step 10 times (an error).
    pub dropped_pushes: AtomicU64,
}

impl PsStoreStats {
    /// A dense pull that received `bytes` of values.
    fn count_pull(&self, bytes: usize) {
        self.pulls.fetch_add(1, Ordering::Relaxed);
        self.pull_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

/// What an async push is sent with: the background push of the per-group loop and the
/// pipeline's waited-for push send it one way.
struct AsyncPush<'a> {
    client: &'a PsClient,
    stats: &'a PsStoreStats,
    answered: &'a Answered,
}

impl AsyncPush<'_> {
    /// Sends a push and waits for its answer: a long wait is logged, the task's
    /// answering incarnations noted, the push counted. Returns the position it was
    /// applied at (unsaid where a shard had applied it before).
    async fn send(
        &self,
        trainer: &str,
        step: u64,
        origin: Option<Origin>,
        names: &[String],
        grads: &StepOutput,
    ) -> Result<Position, StoreError> {
        let (dense, sparse) = push_views(names, grads);
        let sent = std::time::Instant::now();
        let pushed = self
            .client
            .push_from(trainer, step, origin, &dense, &sparse)
            .await;
        note_stall(sent);
        let out = pushed.map_err(map_err)?;
        note_answered(self.answered, origin, &out.incarnations);
        self.stats.pushes.fetch_add(1, Ordering::Relaxed);
        Ok(Position(
            out.incarnations.into_iter().zip(out.updates).collect(),
        ))
    }
}

/// The parameter servers as a [`ParamStore`].
#[derive(Debug)]
pub struct PsStore {
    client: PsClient,
    config: ParamConfig,
    seed: u64,
    cache: Arc<Mutex<DenseCache>>,
    /// Async mode: the pull of the next step's parameters, running while this step
    /// computes.
    prefetch: Mutex<Option<tokio::task::JoinHandle<Result<u64, StoreError>>>>,
    /// The dense parameters' names, in spec order (known after `init`).
    names: std::sync::OnceLock<Vec<String>>,
    stats: Arc<PsStoreStats>,
    inflight: Mutex<Option<tokio::task::JoinHandle<Result<(), StoreError>>>>,
    /// Async pushes sent and applied, and the error of one that failed.
    pushes: tokio::sync::watch::Sender<PushCount>,
    /// Per task being pushed (pass, index): per shard, the oldest incarnation that
    /// answered one of its pushes (0: none yet).
    answered: Arc<Answered>,
}

/// Async pushes handed to the background (`sent`) and applied (`applied`, in order:
/// one is in flight at a time); `failed`: the error of one that failed (the store is
/// broken from then on).
#[derive(Clone, Debug, Default)]
struct PushCount {
    sent: u64,
    applied: u64,
    failed: Option<String>,
}

/// Records how a background push ended when it is dropped: applied, or failed.
struct PushGuard {
    pushes: tokio::sync::watch::Sender<PushCount>,
    failed: Option<String>,
}

impl Drop for PushGuard {
    fn drop(&mut self) {
        let failed = self.failed.take();
        self.pushes.send_modify(|c| match failed {
            None => c.applied += 1,
            Some(e) => c.failed = Some(e),
        });
    }
}

/// Per task (pass, index): per shard, the oldest incarnation that answered its pushes.
type Answered = std::sync::Mutex<HashMap<(u32, u32), Vec<u64>>>;

/// Merges a push's answering incarnations into a task's (the oldest per shard).
fn note_answered(answered: &Answered, origin: Option<Origin>, incarnations: &[u64]) {
    let Some(o) = origin else { return };
    merge_answered(answered, (o.pass, o.task), incarnations);
}

/// Merges `incarnations` into task `key`'s answering incarnations (the oldest per
/// shard; 0: none).
fn merge_answered(answered: &Answered, key: (u32, u32), incarnations: &[u64]) {
    let mut map = answered
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let seen = map
        .entry(key)
        .or_insert_with(|| vec![0; incarnations.len()]);
    seen.resize(incarnations.len().max(seen.len()), 0);
    for (s, &inc) in seen.iter_mut().zip(incarnations) {
        if inc != 0 && (*s == 0 || inc < *s) {
            *s = inc;
        }
    }
}

impl PsStore {
    /// A store over `client`; `config` (mode, optimizer) is what the initialising trainer
    /// installs on the shards, and `seed` seeds the sparse rows' initial values.
    pub fn new(client: PsClient, config: ParamConfig, seed: u64) -> Self {
        PsStore {
            client,
            config,
            seed,
            cache: Arc::new(Mutex::new(DenseCache::new())),
            prefetch: Mutex::new(None),
            names: std::sync::OnceLock::new(),
            stats: Arc::new(PsStoreStats::default()),
            inflight: Mutex::new(None),
            pushes: tokio::sync::watch::Sender::new(PushCount::default()),
            answered: Arc::default(),
        }
    }

    /// The counters (shared; they keep counting).
    pub fn stats(&self) -> Arc<PsStoreStats> {
        self.stats.clone()
    }

    /// The client.
    pub fn client(&self) -> &PsClient {
        &self.client
    }

    fn sync(&self) -> bool {
        self.config.mode.is_sync()
    }

    /// Pulls the dense parameters and hands each one's values to `visit` (its index in
    /// the declared order, its values), without copying them first: [`ParamStore::pull_dense`]
    /// copies them into a [`Params`], the Python package into NumPy arrays.
    ///
    /// Async mode prefetches: the pull for the next step starts as soon as this one's
    /// values are visited, and runs while the step computes. The parameters a step
    /// computes on then miss at most this trainer's own last two pushes (the other
    /// trainers' are missed anyway in async SGD). After `flush` (task end, evaluation)
    /// the next pull is a fresh one.
    pub async fn pull_dense_with(
        &self,
        mut visit: impl FnMut(usize, &[f32]) + Send,
    ) -> Result<(), StoreError> {
        let prefetched = self.prefetch.lock().await.take();
        let fresh = match prefetched {
            Some(h) => !matches!(h.await, Ok(Ok(_))),
            None => true,
        };
        let mut cache = self.cache.lock().await;
        if fresh {
            let stats = self.client.pull_dense(&mut cache).await.map_err(map_err)?;
            self.stats.count_pull(stats.bytes);
        }
        for (i, p) in cache.params().iter().enumerate() {
            visit(i, &p.values);
        }
        drop(cache);
        if !self.sync() {
            let (cache, client, stats) =
                (self.cache.clone(), self.client.clone(), self.stats.clone());
            let handle = tokio::spawn(
                async move {
                    let mut cache = cache.lock().await;
                    let pulled = client.pull_dense(&mut cache).await.map_err(map_err)?;
                    stats.count_pull(pulled.bytes);
                    Ok(pulled.bytes as u64)
                }
                .in_current_span(),
            );
            *self.prefetch.lock().await = Some(handle);
        }
        Ok(())
    }

    /// The dense parameters as the pservers hold them (name and shape, in order), as of
    /// the last pull or `init` (empty before either).
    pub async fn dense_layout(&self) -> Vec<(String, Vec<usize>)> {
        let cache = self.cache.lock().await;
        cache
            .params()
            .iter()
            .map(|p| (p.name.clone(), p.shape.clone()))
            .collect()
    }

    /// Fetches rows `ids` of sparse table `table`: their values one row after another.
    pub async fn pull_rows(&self, table: &str, ids: &[u64]) -> Result<Vec<f32>, StoreError> {
        let mut pulled = self.client.pull_sparse(table, ids).await;
        if let Err(PsClientError::Refused { shard, status }) = &pulled
            && ErrorKind::of(status) == Some(ErrorKind::Uninitialised)
        {
            // A shard restored with nothing: a dense pull initialises it from the initial
            // values (as the dense pull of the next step would have), then the rows.
            tracing::warn!(
                shard,
                "a shard lost its parameters; pulling to initialise it, then its rows"
            );
            let mut cache = self.cache.lock().await;
            self.client.pull_dense(&mut cache).await.map_err(map_err)?;
            drop(cache);
            pulled = self.client.pull_sparse(table, ids).await;
        }
        let values = pulled.map_err(map_err)?;
        self.stats.sparse_pulls.fetch_add(1, Ordering::Relaxed);
        self.stats
            .sparse_rows
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        self.stats
            .max_sparse_rows
            .fetch_max(ids.len() as u64, Ordering::Relaxed);
        Ok(values)
    }

    /// [`ParamStore::push`] of gradients the store may keep (no copy is made of them in
    /// async mode, where the push is sent in the background).
    pub async fn push_owned(
        &self,
        trainer: &str,
        step: u64,
        origin: Option<Origin>,
        grads: StepOutput,
    ) -> Result<(), StoreError> {
        if self.sync() {
            self.push_sync(trainer, origin, &grads).await
        } else {
            self.push_async(trainer, step, origin, grads).await
        }
    }

    /// The dense parameters' names, checked against a push's gradients.
    fn names_for(&self, grads: &StepOutput) -> Result<Vec<String>, StoreError> {
        let names: Vec<String> = self.names.get().cloned().unwrap_or_default();
        if names.len() != grads.dense.len() {
            return Err(StoreError::Refused(format!(
                "{} dense gradients for {} parameters (pull before pushing)",
                grads.dense.len(),
                names.len()
            )));
        }
        Ok(names)
    }

    /// Async mode: one push in flight at a time: waits for the previous one (and reports
    /// its error), then sends this one in the background.
    async fn push_async(
        &self,
        trainer: &str,
        step: u64,
        origin: Option<Origin>,
        grads: StepOutput,
    ) -> Result<(), StoreError> {
        let names = self.names_for(&grads)?;
        self.wait_inflight().await?;
        let client = self.client.clone();
        let stats = self.stats.clone();
        let answered = self.answered.clone();
        let trainer = trainer.to_owned();
        let pushes = self.pushes.clone();
        pushes.send_modify(|c| c.sent += 1);
        let handle = tokio::spawn(
            async move {
                // Counts the push as failed unless it is applied (also when the task
                // is dropped unfinished), so nobody waits for it forever.
                let mut guard = PushGuard {
                    pushes,
                    failed: Some("the push was abandoned".into()),
                };
                let push = AsyncPush {
                    client: &client,
                    stats: &stats,
                    answered: &answered,
                };
                if let Err(e) = push
                    .send(&trainer, step, origin, &names, &grads)
                    .await
                    .map(drop)
                {
                    guard.failed = Some(e.to_string());
                    return Err(e);
                }
                guard.failed = None;
                Ok(())
            }
            .in_current_span(),
        );
        *self.inflight.lock().await = Some(handle);
        Ok(())
    }

    /// Sync mode: pushes to the global step learnt from the last pull; a step that closed
    /// without this trainer moves the gradients to the next one, a bounded number of
    /// times.
    async fn push_sync(
        &self,
        trainer: &str,
        origin: Option<Origin>,
        grads: &StepOutput,
    ) -> Result<(), StoreError> {
        let names = self.names_for(grads)?;
        let (dense, sparse) = push_views(&names, grads);
        let mut global = self.cache.lock().await.next_step();
        let sent = std::time::Instant::now();
        for _ in 0..=STALE_RETRIES {
            let pushed = self
                .client
                .push_from(trainer, global, origin, &dense, &sparse)
                .await;
            match pushed {
                Ok(out) => {
                    note_stall(sent);
                    note_answered(&self.answered, origin, &out.incarnations);
                    self.stats.pushes.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                Err(PsClientError::StaleStep { next, .. }) => {
                    self.stats.stale_pushes.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(
                        step = global,
                        next,
                        "sync step closed without this trainer; pushing to the next one"
                    );
                    global = next;
                }
                Err(PsClientError::Uninitialised { shard }) => {
                    // Restored with nothing: the pull initialises it from the initial
                    // values (its pushes so far are trained again: the restore says
                    // so to the master), and the step restarts there.
                    tracing::warn!(
                        shard,
                        "a shard lost its parameters; pulling to initialise it, then pushing again"
                    );
                    let mut cache = self.cache.lock().await;
                    self.client.pull_dense(&mut cache).await.map_err(map_err)?;
                    global = cache.next_step();
                }
                Err(e) => return Err(map_err(e)),
            }
        }
        self.stats.dropped_pushes.fetch_add(1, Ordering::Relaxed);
        // Never acknowledge a batch whose gradients were not applied: the trainer stops
        // with this error and its task goes back to the queue.
        Err(StoreError::Unavailable(format!(
            "sync push of trainer {trainer} kept finding its step closed ({STALE_RETRIES} times)"
        )))
    }

    /// Waits for the push in flight, if any.
    async fn wait_inflight(&self) -> Result<(), StoreError> {
        let handle = self.inflight.lock().await.take();
        match handle {
            Some(h) => h
                .await
                .map_err(|e| StoreError::Unavailable(format!("push task failed: {e}")))?,
            None => Ok(()),
        }
    }

    /// Waits until the async pushes sent before this call are applied (not for those
    /// sent after it), or one failed.
    async fn pushes_applied(&self) -> Result<(), StoreError> {
        let target = self.pushes.borrow().sent;
        let mut rx = self.pushes.subscribe();
        let count = rx
            .wait_for(|c| c.applied >= target || c.failed.is_some())
            .await
            .map_err(|_| StoreError::Unavailable("the parameter store was dropped".into()))?;
        match &count.failed {
            Some(e) => Err(StoreError::Unavailable(format!("a push failed: {e}"))),
            None => Ok(()),
        }
    }
}

fn map_err(e: PsClientError) -> StoreError {
    match e {
        PsClientError::Unavailable { .. }
        | PsClientError::Coord(_)
        | PsClientError::NotInitialised(_)
        | PsClientError::Connect { .. }
        | PsClientError::Cancelled => StoreError::Unavailable(e.to_string()),
        PsClientError::Overlap { .. } => StoreError::Superseded(e.to_string()),
        other => StoreError::Refused(other.to_string()),
    }
}

fn row_init(init: SparseInit, seed: u64) -> RowInit {
    match init {
        SparseInit::Zeros => RowInit::Zeros,
        SparseInit::Uniform { bound } => RowInit::Uniform {
            low: -bound,
            high: bound,
            seed,
        },
    }
}

#[async_trait]
impl ParamStore for PsStore {
    async fn init(&self, trainer: &str, init: &ParamInit) -> Result<InitOutcome, StoreError> {
        let values = &init.values;
        if init.dense.len() != values.len() {
            return Err(StoreError::Refused(format!(
                "{} initial values for {} dense parameters",
                values.len(),
                init.dense.len()
            )));
        }
        let dense: Vec<DenseInit<'_>> = init
            .dense
            .iter()
            .zip(values)
            .map(|(p, v)| DenseInit {
                name: &p.name,
                shape: &p.shape,
                values: v,
            })
            .collect();
        let sparse: Vec<SparseSpec> = init
            .sparse
            .iter()
            .map(|t| SparseSpec {
                name: t.name.clone(),
                dim: t.dim,
                init: row_init(t.init, self.seed),
            })
            .collect();
        let outcome = self
            .client
            .init(trainer, &dense, &sparse, self.config.clone())
            .await
            .map_err(map_err)?;
        // The initial values are this trainer's copy until its first pull: a shard that
        // restarted before its first checkpoint is initialised again from them.
        let mut cache = self.cache.lock().await;
        self.client
            .seed_cache(&mut cache, values)
            .await
            .map_err(map_err)?;
        let _ = self
            .names
            .set(cache.params().iter().map(|p| p.name.clone()).collect());
        Ok(outcome)
    }

    async fn pull_dense(&self, params: &mut Params) -> Result<(), StoreError> {
        let mut n = 0;
        self.pull_dense_with(|i, values| {
            if params.dense.len() <= i {
                params.dense.resize_with(i + 1, Vec::new);
            }
            let dst = &mut params.dense[i];
            dst.clear();
            dst.extend_from_slice(values);
            n = i + 1;
        })
        .await?;
        params.dense.truncate(n);
        Ok(())
    }

    async fn pull_sparse(
        &self,
        rows: &[(String, Vec<u64>)],
        params: &mut Params,
    ) -> Result<(), StoreError> {
        // The tables in parallel: one round trip, not one a table.
        let pulled = futures::future::try_join_all(rows.iter().map(|(table, ids)| async move {
            Ok::<_, StoreError>((table, ids, self.pull_rows(table, ids).await?))
        }))
        .await?;
        params.sparse.clear();
        for (table, ids, values) in pulled {
            let dim = if ids.is_empty() {
                0
            } else {
                values.len() / ids.len()
            };
            // The decoded buffer becomes the rows: no copy, no vector a row.
            let n = values.len();
            let out = SparseRows::from_values(dim, ids.clone(), values).ok_or_else(|| {
                StoreError::Refused(format!(
                    "a pull of {} rows of {table} gave {n} values",
                    ids.len()
                ))
            })?;
            params.sparse.insert(table.clone(), out);
        }
        Ok(())
    }

    async fn push(
        &self,
        trainer: &str,
        step: u64,
        origin: Option<Origin>,
        grads: &StepOutput,
    ) -> Result<(), StoreError> {
        if self.sync() {
            self.push_sync(trainer, origin, grads).await
        } else {
            // Sent in the background: the store keeps its own copy.
            self.push_async(trainer, step, origin, grads.clone()).await
        }
    }

    async fn push_applied(
        &self,
        trainer: &str,
        step: u64,
        origin: Option<Origin>,
        grads: StepOutput,
    ) -> Result<Position, StoreError> {
        if self.sync() {
            self.push_sync(trainer, origin, &grads).await?;
            return Ok(Position::default());
        }
        let names = self.names_for(&grads)?;
        let push = AsyncPush {
            client: &self.client,
            stats: &self.stats,
            answered: &self.answered,
        };
        push.send(trainer, step, origin, &names, &grads).await
    }

    async fn pull_current(&self, params: &mut Params) -> Result<Position, StoreError> {
        let mut cache = self.cache.lock().await;
        let pulled = self.client.pull_dense(&mut cache).await.map_err(map_err)?;
        self.stats.count_pull(pulled.bytes);
        let values = cache.params();
        params.dense.resize_with(values.len(), Vec::new);
        for (dst, p) in params.dense.iter_mut().zip(values) {
            dst.clear();
            dst.extend_from_slice(&p.values);
        }
        Ok(Position(cache.positions()))
    }

    fn local_updates(&self) -> Option<edl_pserver_client::OptimizerConfig> {
        (!self.sync()).then(|| self.config.optimizer.clone())
    }

    async fn flush(&self) -> Result<(), StoreError> {
        self.wait_inflight().await?;
        // A prefetch may predate the pushes just applied: drop it, the next pull is fresh.
        if let Some(h) = self.prefetch.lock().await.take() {
            let _ = h.await;
        }
        Ok(())
    }

    async fn task_done(&self, trainer: &str, task: TaskRef) -> Result<Vec<u64>, StoreError> {
        // The task's pushes, not a prefetch (the next task's first pull may use it).
        self.pushes_applied().await?;
        let shards = self.client.shards() as usize;
        let answered = self
            .answered
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&(task.pass, task.index))
            .unwrap_or_else(|| vec![0; shards]);
        match self
            .client
            .task_done(trainer, task.pass, task.index, task.tasks, &answered)
            .await
        {
            Ok(incarnations) => Ok(incarnations),
            Err(e @ PsClientError::Rewound { .. }) => Err(StoreError::Rewound(e.to_string())),
            Err(e) => Err(map_err(e)),
        }
    }

    fn resume_after(&self, task: TaskRef, answered: &[u64]) {
        merge_answered(&self.answered, (task.pass, task.index), answered);
    }

    fn handed_back(&self, task: TaskRef) -> Vec<u64> {
        self.answered
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&(task.pass, task.index))
            .unwrap_or_default()
    }

    async fn idle(&self, trainer: &str) -> Result<(), StoreError> {
        self.wait_inflight().await?;
        if self.sync() {
            self.client.leave(trainer).await.map_err(map_err)?;
        }
        Ok(())
    }
}

/// A step's gradients as the borrowed views the pserver client pushes: dense values by
/// parameter name, sparse rows by table.
fn push_views<'a>(
    names: &'a [String],
    grads: &'a StepOutput,
) -> (Vec<(&'a str, &'a [f32])>, Vec<SparsePush<'a>>) {
    let dense = names
        .iter()
        .zip(&grads.dense)
        .map(|(n, g)| (n.as_str(), g.as_slice()))
        .collect();
    let sparse = grads
        .sparse
        .iter()
        .map(|s| SparsePush {
            table: &s.table,
            rows: &s.rows,
            values: &s.values,
        })
        .collect();
    (dense, sparse)
}

#[cfg(test)]
mod tests;
