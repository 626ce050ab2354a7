//! What a training loop reports: its [`Progress`] while it runs and at the end, and the
//! [`RuntimeError`] it stops with. The runtime's loop ([`crate::runtime::run`]), the task
//! stream ([`crate::Tasks`]) and the Python package's loop share both.

use edl_master_client::ClientError;

use crate::model::MetricKind;
use crate::store::StoreError;

/// What a trainer reports while it runs and at the end.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Progress {
    /// The pass of the task being trained.
    pub pass: u32,
    /// Tasks finished (acknowledged).
    pub tasks: u64,
    /// Records trained in acknowledged tasks.
    pub records: u64,
    /// Gradient steps pushed.
    pub steps: u64,
    /// Loss of the last step.
    pub last_loss: f32,
    /// Samples per second over the last task.
    pub samples_per_sec: f64,
    /// Evaluations on the test split, one per finished pass: (pass, metric, value, loss).
    pub evals: Vec<(u32, MetricKind, f64, f64)>,
    /// Tasks failed because of their data.
    pub failed_tasks: u64,
    /// Batches skipped because their loss was not finite.
    pub skipped_batches: u64,
    /// The trainer drained (SIGTERM) instead of reaching the end of the job.
    pub drained: bool,
    /// Whether this trainer initialised the parameters.
    pub initialised: bool,
    /// Evaluation on the test split before this trainer's first step: (metric, value,
    /// loss).
    pub initial_eval: Option<(MetricKind, f64, f64)>,
    /// Records of the task handed back when draining that were trained before (they are
    /// trained again by whoever gets the task: the master counts them as duplicates).
    pub handed_back_trained: u64,
    /// Tasks trained whole and handed back to be trained again: a parameter server
    /// restored meanwhile lacked some of their updates.
    pub recomputed_tasks: u64,
    /// When the first gradient step was pushed (wall clock: comparable across the
    /// processes of a machine, for spawn -> first step and the steady rate).
    pub first_step_at: Option<std::time::SystemTime>,
    /// When the last gradient step was pushed.
    pub last_step_at: Option<std::time::SystemTime>,
}

/// Why the runtime stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The master could not be reached (past the client's retry budget) or refused.
    #[error("master: {0}")]
    Master(ClientError),
    /// The parameter store failed.
    #[error("parameter store: {0}")]
    Store(StoreError),
    /// The model failed on data that passed validation (a bug or a device error).
    #[error("model: {0}")]
    Model(crate::Error),
}

// The message includes the cause's text, so the cause is not also its `source()`
// (a report of the chain would say it twice).
impl From<crate::Error> for RuntimeError {
    fn from(e: crate::Error) -> Self {
        RuntimeError::Model(e)
    }
}

// The message includes the cause's text, so the cause is not also its `source()`
// (a report of the chain would say it twice).
impl From<StoreError> for RuntimeError {
    fn from(e: StoreError) -> Self {
        RuntimeError::Store(e)
    }
}

// The message includes the cause's text, so the cause is not also its `source()`
// (a report of the chain would say it twice).
impl From<ClientError> for RuntimeError {
    fn from(e: ClientError) -> Self {
        RuntimeError::Master(e)
    }
}
