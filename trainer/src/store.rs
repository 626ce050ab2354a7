//! Where a trainer's parameters live: the [`ParamStore`] trait and its in-process
//! implementation [`LocalStore`].
//!
//! In a job the store is the parameter servers (an adapter over the pserver client); the
//! trainer runtime only sees this trait, so the same loop runs against a local store in
//! single-process runs and tests.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::Mutex;

/// How a trainer's [`ParamStore::init`] went: the pservers' answer, whichever store.
pub use edl_pserver_client::InitOutcome;
use edl_pserver_client::{LrSchedule, OptimizerConfig, OptimizerKind, Origin};

use crate::local_optim::LocalOptimizer;
use crate::model::{DenseParam, Model, Params, SparseTable, StepOutput};

/// Why a parameter store call failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store cannot be reached now; retrying may work.
    #[error("parameter store unavailable: {0}")]
    Unavailable(String),
    /// The request was refused (shape mismatch, non-finite gradient, ...).
    #[error("parameter store refused: {0}")]
    Refused(String),
    /// The model's computation failed.
    #[error(transparent)]
    Model(#[from] crate::Error),
    /// A task's updates went to a pserver shard restored since from a state without
    /// some of them: the task must be trained again.
    #[error("{0}")]
    Rewound(String),
    /// A push's run of batches was partly applied by another attempt at its task: the
    /// task was taken away from this trainer (the attempt holding it trains the rest).
    #[error("{0}")]
    Superseded(String),
}

/// A task as the store sees it: pushes name their batch within it, and it is recorded
/// as done on every shard before the master is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaskRef {
    /// The pass.
    pub pass: u32,
    /// The task's index in the dataset.
    pub index: u32,
    /// Tasks in the dataset.
    pub tasks: u32,
}

impl TaskRef {
    /// The origin of batch `seq` of this task.
    pub fn batch(&self, seq: u32) -> Origin {
        self.run(seq, 1)
    }

    /// The origin of the `count` batches of this task from batch `seq` on.
    pub fn run(&self, seq: u32, count: u32) -> Origin {
        Origin {
            pass: self.pass,
            task: self.index,
            seq,
            count,
        }
    }
}

/// Where a store's parameters stood when it answered a push or a pull: per pserver
/// shard, (incarnation, updates applied). Empty: the store does not say.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Position(pub Vec<(u64, u64)>);

impl Position {
    /// Whether `self`, the position a push was applied at, is exactly one update after
    /// `before` on every shard, of the same incarnation: nothing but that push changed
    /// the parameters since `before` was answered. False when either does not say.
    pub fn follows(&self, before: &Position) -> bool {
        !self.0.is_empty()
            && self.0.len() == before.0.len()
            && self
                .0
                .iter()
                .zip(&before.0)
                .all(|(&(inc, n), &(was_inc, was_n))| inc != 0 && inc == was_inc && n == was_n + 1)
    }
}

/// The parameters a trainer declares to a [`ParamStore`]: dense parameters with their
/// initial values, and sparse tables (whose rows start from their `init`). Only the
/// trainer that initialises the store has its values used; every trainer declares the
/// same names and shapes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParamInit {
    /// The dense parameters, in the order pulls return them and pushes name them.
    pub dense: Vec<DenseParam>,
    /// Their initial values, one per parameter (`shape`'s product each).
    pub values: Vec<Vec<f32>>,
    /// The sparse tables.
    pub sparse: Vec<SparseTable>,
}

impl ParamInit {
    /// What `model` declares, with its deterministic initial values for `seed`.
    pub fn of(model: &dyn Model, seed: u64) -> ParamInit {
        ParamInit {
            dense: model.dense_params(),
            values: model.init_dense(seed),
            sparse: model.sparse_tables(),
        }
    }
}

/// Parameters shared by a job's trainers.
#[async_trait]
pub trait ParamStore: Send + Sync + std::fmt::Debug {
    /// Makes sure the parameters exist: exactly one trainer of a job initialises them
    /// (with its `params`' values, [`ParamInit::of`] a model: deterministic, the same in
    /// every trainer); the others wait until that is finished. Idempotent.
    async fn init(&self, trainer: &str, params: &ParamInit) -> Result<InitOutcome, StoreError>;

    /// Refreshes `params.dense` with the current dense parameters.
    async fn pull_dense(&self, params: &mut Params) -> Result<(), StoreError>;

    /// Fetches `rows` of sparse tables into `params.sparse` (only those rows).
    async fn pull_sparse(
        &self,
        rows: &[(String, Vec<u64>)],
        params: &mut Params,
    ) -> Result<(), StoreError>;

    /// Pushes the gradients of this trainer's step `step`, of the task batch `origin`
    /// when it comes from a task; a retried push of the same (trainer, step), and any
    /// push of an origin already applied, is applied once.
    async fn push(
        &self,
        trainer: &str,
        step: u64,
        origin: Option<Origin>,
        grads: &StepOutput,
    ) -> Result<(), StoreError>;

    /// Every batch of `task` was pushed: waits until the pushes are applied and records
    /// the task as done where the parameters live. Returns what the master's
    /// acknowledgement carries (per pserver shard, the incarnation that recorded it;
    /// empty for an in-process store), or [`StoreError::Rewound`] when the task must be
    /// trained again. By default: [`flush`](Self::flush).
    async fn task_done(&self, trainer: &str, task: TaskRef) -> Result<Vec<u64>, StoreError> {
        let _ = (trainer, task);
        self.flush().await?;
        Ok(Vec::new())
    }

    /// `task` resumes after batches that an earlier attempt applied, whose pushes were
    /// answered first by `answered` (per pserver shard; 0: none): its
    /// [`task_done`](Self::task_done) names the older of those and its own. A no-op by
    /// default.
    fn resume_after(&self, task: TaskRef, answered: &[u64]) {
        let _ = (task, answered);
    }

    /// `task` is handed back (a drain, after [`flush`](Self::flush)): forgets it, and
    /// says per pserver shard the oldest incarnation that answered its pushes (those of
    /// the attempts it resumed after included; 0: none), for the attempt that resumes
    /// after them. Empty by default.
    fn handed_back(&self, task: TaskRef) -> Vec<u64> {
        let _ = task;
        Vec::new()
    }

    /// Waits until every push made so far is applied (a store may send pushes in the
    /// background), reporting the error of one that failed. A no-op by default.
    async fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Pushes like [`push`](Self::push) and returns once the push is applied (it may
    /// keep the gradients), with the position it was applied at. By default: `push`,
    /// then [`flush`](Self::flush), at no position said.
    async fn push_applied(
        &self,
        trainer: &str,
        step: u64,
        origin: Option<Origin>,
        grads: StepOutput,
    ) -> Result<Position, StoreError> {
        self.push(trainer, step, origin, &grads).await?;
        self.flush().await?;
        Ok(Position::default())
    }

    /// Refreshes `params.dense` with the current dense parameters, fetched now (no
    /// prefetch is used or started), and says the position they are at. By default:
    /// [`pull_dense`](Self::pull_dense), at no position said.
    async fn pull_current(&self, params: &mut Params) -> Result<Position, StoreError> {
        self.pull_dense(params).await?;
        Ok(Position::default())
    }

    /// The update rule a trainer may run locally on its own gradients between pulls
    /// (an asynchronous store): the trainer then computes through its pipeline (see
    /// `runtime`), never waiting on the store. `None` (the default): it may not (sync
    /// mode: every trainer computes on the step's parameters).
    fn local_updates(&self) -> Option<OptimizerConfig> {
        None
    }

    /// This trainer has no work for now (it waits for a task): in sync mode it stops
    /// taking part in steps until its next push, so the other trainers' steps do not wait
    /// for it. A no-op by default.
    async fn idle(&self, trainer: &str) -> Result<(), StoreError> {
        let _ = trainer;
        Ok(())
    }
}

#[derive(Debug)]
struct LocalState {
    params: Params,
    optimizer: LocalOptimizer,
    applied: HashSet<(String, u64)>,
    /// Pushes applied.
    updates: u64,
}

/// An in-process store: parameters and a [`LocalOptimizer`] behind a lock, asynchronous
/// updates. For single-process runs and tests; jobs use the parameter servers.
#[derive(Debug, Clone)]
pub struct LocalStore {
    model: Arc<dyn Model>,
    seed: u64,
    kind: OptimizerKind,
    lr: f32,
    state: Arc<Mutex<Option<LocalState>>>,
}

impl LocalStore {
    /// A store for `model`, updated by `kind` at learning rate `lr`.
    pub fn new(model: Arc<dyn Model>, kind: OptimizerKind, lr: f32, seed: u64) -> Self {
        LocalStore {
            model,
            seed,
            kind,
            lr,
            state: Arc::new(Mutex::new(None)),
        }
    }

    /// A copy of the current parameters (dense, and every sparse row created so far).
    pub async fn snapshot(&self) -> Option<Params> {
        self.state.lock().await.as_ref().map(|s| s.params.clone())
    }

    /// Applies `trainer`'s step `step` unless it was before: the pushes applied since
    /// the start, then, or `None` for a repeat.
    async fn apply(
        &self,
        trainer: &str,
        step: u64,
        grads: &StepOutput,
    ) -> Result<Option<u64>, StoreError> {
        let mut state = self.state.lock().await;
        let s = state
            .as_mut()
            .ok_or_else(|| StoreError::Unavailable("parameters not initialised".into()))?;
        if !s.applied.insert((trainer.to_owned(), step)) {
            return Ok(None);
        }
        for g in &grads.sparse {
            let stored = s.params.sparse.entry(g.table.clone()).or_default();
            for &id in &g.rows {
                stored
                    .get_or_insert_with(id, || self.model.init_sparse_row(&g.table, id, self.seed));
            }
        }
        s.optimizer.step(&mut s.params, grads)?;
        s.updates += 1;
        Ok(Some(s.updates))
    }
}

#[async_trait]
impl ParamStore for LocalStore {
    async fn init(&self, _trainer: &str, init: &ParamInit) -> Result<InitOutcome, StoreError> {
        let mut state = self.state.lock().await;
        if state.is_some() {
            return Ok(InitOutcome::AlreadyInitialised);
        }
        let params = Params {
            dense: init.values.clone(),
            sparse: HashMap::new(),
        };
        *state = Some(LocalState {
            params,
            optimizer: LocalOptimizer::new(self.kind, self.lr)?,
            applied: HashSet::new(),
            updates: 0,
        });
        Ok(InitOutcome::Initialised)
    }

    async fn pull_dense(&self, params: &mut Params) -> Result<(), StoreError> {
        let state = self.state.lock().await;
        let s = state
            .as_ref()
            .ok_or_else(|| StoreError::Unavailable("parameters not initialised".into()))?;
        params.dense.clone_from(&s.params.dense);
        Ok(())
    }

    async fn pull_sparse(
        &self,
        rows: &[(String, Vec<u64>)],
        params: &mut Params,
    ) -> Result<(), StoreError> {
        let mut state = self.state.lock().await;
        let s = state
            .as_mut()
            .ok_or_else(|| StoreError::Unavailable("parameters not initialised".into()))?;
        params.sparse.clear();
        for (table, ids) in rows {
            let stored = s.params.sparse.entry(table.clone()).or_default();
            let out = params.sparse.entry(table.clone()).or_default();
            for &id in ids {
                let row = stored
                    .get_or_insert_with(id, || self.model.init_sparse_row(table, id, self.seed));
                out.insert(id, row);
            }
        }
        Ok(())
    }

    async fn push(
        &self,
        trainer: &str,
        step: u64,
        _origin: Option<Origin>,
        grads: &StepOutput,
    ) -> Result<(), StoreError> {
        self.apply(trainer, step, grads).await.map(drop)
    }

    /// Applied at once; the position is (1, pushes applied), unsaid for a repeat.
    async fn push_applied(
        &self,
        trainer: &str,
        step: u64,
        _origin: Option<Origin>,
        grads: StepOutput,
    ) -> Result<Position, StoreError> {
        let applied = self.apply(trainer, step, &grads).await?;
        Ok(Position(applied.map(|n| vec![(1, n)]).unwrap_or_default()))
    }

    async fn pull_current(&self, params: &mut Params) -> Result<Position, StoreError> {
        let state = self.state.lock().await;
        let s = state
            .as_ref()
            .ok_or_else(|| StoreError::Unavailable("parameters not initialised".into()))?;
        params.dense.clone_from(&s.params.dense);
        Ok(Position(vec![(1, s.updates)]))
    }

    fn local_updates(&self) -> Option<OptimizerConfig> {
        Some(OptimizerConfig {
            kind: self.kind,
            lr: LrSchedule::constant(self.lr),
            clip: Default::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Position;

    #[test]
    fn a_position_follows_one_update_later_on_every_shard_of_the_same_incarnation() {
        let before = Position(vec![(7, 10), (9, 3)]);
        assert!(Position(vec![(7, 11), (9, 4)]).follows(&before));
        // Another update between, on one shard.
        assert!(!Position(vec![(7, 12), (9, 4)]).follows(&before));
        // A shard restored since (another incarnation), whatever its count.
        assert!(!Position(vec![(7, 11), (8, 4)]).follows(&before));
        // A repeat (0: the shard had applied it before), unsaid positions, other shapes.
        assert!(!Position(vec![(7, 11), (9, 0)]).follows(&before));
        assert!(!Position::default().follows(&before));
        assert!(!Position(vec![(7, 1)]).follows(&Position::default()));
        assert!(!Position(vec![(7, 11)]).follows(&before));
        assert!(!Position(vec![(0, 1)]).follows(&Position(vec![(0, 0)])));
    }
}
