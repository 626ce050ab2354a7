//! The model interface the trainer runtime drives: parameter layout, initial values,
//! batch preparation, gradients and evaluation.
//!
//! The parameter server owns the parameters and applies optimizer updates; a trainer
//! only computes gradients. A step is: [`Model::prepare_records`] a batch, pull the
//! dense parameters and the sparse rows named by [`Model::sparse_rows`], call
//! [`Model::forward_backward`], push the [`StepOutput`].
//!
//! # Models of your own
//!
//! Implement [`Model`] on candle and run it with [`crate::main`] (see `docs/trainer-api.md`).
//! A model that takes edl's [`Sample`]s implements [`Model::prepare`]; one that decodes
//! its records itself implements [`Model::prepare_records`] instead. Either way it
//! returns a [`Batch`] made with [`Batch::new`] from its own prepared data, which
//! [`Model::forward_backward`] reads back with [`Batch::data`]. Data errors are
//! [`Error::BadRecord`] (the task is failed and retried, the
//! trainer goes on); any other failure is [`Error::Model`] or a
//! candle error (`?` converts it).

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use candle_core::Tensor;
use edl_proto::sample::Sample;

use crate::error::{Error, Result};
pub use crate::sparse_rows::SparseRows;

/// A dense parameter: `f32` values in row-major order of `shape`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DenseParam {
    /// Unique name within the model (`fc0.w`, `conv1.b`, ...).
    pub name: String,
    /// Shape; the parameter holds `shape.iter().product()` values.
    pub shape: Vec<usize>,
}

impl DenseParam {
    /// Number of values.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the parameter holds no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A sparse (embedding) table: `rows` rows of `dim` values, pulled and pushed by row.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SparseTable {
    /// Unique name within the model.
    pub name: String,
    /// Number of rows (the vocabulary size).
    pub rows: u64,
    /// Values per row.
    pub dim: usize,
    /// How rows never trained start (parameter servers create rows lazily with it).
    pub init: SparseInit,
}

/// The initial value of a sparse row, as a distribution (a parameter server draws it from
/// its own seeded generator; [`Model::init_sparse_row`] is the trainer-side equivalent).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum SparseInit {
    /// All zeros.
    Zeros,
    /// Uniform in `[-bound, bound)`.
    Uniform {
        /// Half-width.
        bound: f32,
    },
}

/// Parameter values for one step.
#[derive(Clone, Default, PartialEq)]
pub struct Params {
    /// Dense values, in [`Model::dense_params`] order.
    pub dense: Vec<Vec<f32>>,
    /// Pulled sparse rows by table name. Must hold at least the rows
    /// [`Model::sparse_rows`] names for the batch; other rows are ignored.
    pub sparse: HashMap<String, SparseRows>,
}

impl Params {
    /// The values of `ids` in sparse table `table`, each `dim` wide, in order; an error
    /// names a row not pulled or of another width.
    pub fn rows(&self, table: &str, ids: &[u64], dim: usize) -> Result<Vec<&[f32]>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let missing = |row: u64| Error::MissingSparseRow {
            table: table.to_string(),
            row,
        };
        let pulled = self
            .sparse
            .get(table)
            .ok_or_else(|| missing(ids.first().copied().unwrap_or(0)))?;
        ids.iter()
            .map(|&row| {
                let v = pulled.get(row).ok_or_else(|| missing(row))?;
                if v.len() != dim {
                    return Err(Error::SparseRowWidth {
                        table: table.to_string(),
                        row,
                        found: v.len(),
                        expected: dim,
                    });
                }
                Ok(v)
            })
            .collect()
    }
}

impl fmt::Debug for Params {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dense: Vec<usize> = self.dense.iter().map(Vec::len).collect();
        let sparse: HashMap<&str, usize> = self
            .sparse
            .iter()
            .map(|(k, v)| (k.as_str(), v.len()))
            .collect();
        f.debug_struct("Params")
            .field("dense_lens", &dense)
            .field("sparse_rows", &sparse)
            .finish()
    }
}

/// Gradients of some rows of a sparse table.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseGrad {
    /// The table.
    pub table: String,
    /// Rows, sorted and distinct.
    pub rows: Vec<u64>,
    /// Values per row.
    pub dim: usize,
    /// `rows.len() * dim` values: the gradient of row `rows[i]` is
    /// `values[i * dim..(i + 1) * dim]`.
    pub values: Vec<f32>,
}

impl SparseGrad {
    /// The gradient of the `i`-th row of [`SparseGrad::rows`].
    pub fn row(&self, i: usize) -> Option<&[f32]> {
        self.values.get(i * self.dim..(i + 1) * self.dim)
    }
}

/// What one forward/backward pass computes.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    /// The mean loss over the batch's examples.
    pub loss: f32,
    /// Number of examples the loss is the mean over: samples, or (center, context) pairs
    /// for word2vec.
    pub examples: usize,
    /// Gradient of the mean loss for each dense parameter, same order and layout as
    /// [`Model::dense_params`].
    pub dense: Vec<Vec<f32>>,
    /// Gradient of the mean loss for the touched rows of each sparse table.
    pub sparse: Vec<SparseGrad>,
}

impl StepOutput {
    /// Weighs a batch of `records` records, fewer than the job's `batch_size` (a task's
    /// last batch, where the task's records do not fill it), as the part of a full batch
    /// that it is: its gradients are scaled by `records / batch_size`. Every record then
    /// weighs the same in the updates wherever the tasks' boundaries fall, so that how a
    /// dataset is cut into tasks does not change the training (its mean loss is kept).
    pub fn weigh_partial(&mut self, records: usize, batch_size: usize) {
        if records == 0 || records >= batch_size {
            return;
        }
        let w = records as f32 / batch_size as f32;
        for v in self
            .dense
            .iter_mut()
            .flatten()
            .chain(self.sparse.iter_mut().flat_map(|s| s.values.iter_mut()))
        {
            *v *= w;
        }
    }

    /// Whether every gradient value is finite (a finite loss can still have infinite
    /// or NaN gradients, which the pservers refuse).
    pub fn gradients_finite(&self) -> bool {
        let finite = edl_pserver_client::wire::floats_finite;
        self.dense.iter().all(|g| finite(g)) && self.sparse.iter().all(|s| finite(&s.values))
    }
}

/// Evaluation totals over one batch; [`EvalOutput::merge`] adds batches up.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EvalOutput {
    /// Sum of the per-example losses.
    pub loss_sum: f64,
    /// Number of examples.
    pub count: u64,
    /// Correctly classified examples (0 for regression and word2vec).
    pub correct: u64,
}

impl EvalOutput {
    /// Adds another batch's totals.
    pub fn merge(&mut self, other: &EvalOutput) {
        self.loss_sum += other.loss_sum;
        self.count += other.count;
        self.correct += other.correct;
    }

    /// Mean loss per example (NaN when empty).
    pub fn mean_loss(&self) -> f64 {
        self.loss_sum / self.count as f64
    }

    /// Fraction classified correctly (NaN when empty).
    pub fn accuracy(&self) -> f64 {
        self.correct as f64 / self.count as f64
    }
}

/// The metric a model is judged by in reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MetricKind {
    /// Classification accuracy (higher is better).
    Accuracy,
    /// Mean regression cost, squared error (lower is better).
    Cost,
    /// Mean training loss of an unsupervised model (lower is better).
    Loss,
}

impl MetricKind {
    /// Report name: `accuracy`, `cost` or `loss`.
    pub fn name(self) -> &'static str {
        match self {
            MetricKind::Accuracy => "accuracy",
            MetricKind::Cost => "cost",
            MetricKind::Loss => "loss",
        }
    }

    /// The metric's value for evaluation totals.
    pub fn value(self, eval: &EvalOutput) -> f64 {
        match self {
            MetricKind::Accuracy => eval.accuracy(),
            MetricKind::Cost | MetricKind::Loss => eval.mean_loss(),
        }
    }

    /// Whether a larger value is better.
    pub fn higher_is_better(self) -> bool {
        self == MetricKind::Accuracy
    }
}

impl fmt::Display for MetricKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A validated batch, ready for [`Model::forward_backward`] and [`Model::evaluate`] of
/// the model that prepared it. Its tensors live on that model's device.
#[derive(Debug, Clone)]
pub struct Batch {
    pub(crate) model: &'static str,
    pub(crate) samples: usize,
    pub(crate) data: BatchData,
}

impl Batch {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.samples
    }

    /// Whether the batch has no samples (never true for a prepared batch).
    pub fn is_empty(&self) -> bool {
        self.samples == 0
    }

    /// The kind of the model that prepared it (`user` for a [`Batch::new`] batch).
    pub fn model(&self) -> &'static str {
        self.model
    }

    /// A batch of a model defined outside edl: `len` samples (records) and the model's
    /// own prepared data (tensors on its device, targets, ...), read back by
    /// [`Batch::data`].
    pub fn new<T: Any + Send + Sync>(len: usize, data: T) -> Batch {
        Batch {
            model: USER_BATCH,
            samples: len,
            data: BatchData::User(Arc::new(data)),
        }
    }

    /// The data of a [`Batch::new`] batch, if it holds a `T`.
    pub fn data<T: Any>(&self) -> Option<&T> {
        match &self.data {
            BatchData::User(d) => d.downcast_ref(),
            _ => None,
        }
    }
}

/// What [`Batch::model`] says of a [`Batch::new`] batch.
const USER_BATCH: &str = "user";

/// Model-specific batch contents.
#[derive(Debug, Clone)]
pub(crate) enum BatchData {
    /// Dense features `[n, features]` (standardised if the model says so) and targets.
    Dense { x: Tensor, target: Target },
    /// Skip-gram pairs with their negatives.
    SkipGram(crate::word2vec::SkipGramBatch),
    /// A model's own data ([`Batch::new`]).
    User(Arc<dyn Any + Send + Sync>),
}

/// Targets of a dense batch.
#[derive(Debug, Clone)]
pub(crate) enum Target {
    /// Real values `[n]` in the compute dtype.
    Values(Tensor),
    /// Class ids: `[n]` u32 tensor and the same ids on the host.
    Classes { tensor: Tensor, ids: Vec<u32> },
}

/// A trainable model. Implementations are pure functions of the parameters and the
/// batch; they keep no training state, so one instance serves many threads.
///
/// Batches come from [`Model::prepare_records`], which by default decodes each record as
/// a [`Sample`] and calls [`Model::prepare_seeded`] (so [`Model::prepare`]); a model
/// that reads raw records overrides `prepare_records` and leaves `prepare` alone.
pub trait Model: Send + Sync + fmt::Debug {
    /// The model kind (`fit_a_line`, `mlp`, `mnist_cnn`, `word2vec`, ...).
    fn name(&self) -> &str;

    /// The dense parameters, in the order of [`Params::dense`] and of gradients.
    fn dense_params(&self) -> Vec<DenseParam>;

    /// The sparse tables (empty except for word2vec).
    fn sparse_tables(&self) -> Vec<SparseTable>;

    /// Initial dense values, deterministic from `seed`.
    fn init_dense(&self, seed: u64) -> Vec<Vec<f32>>;

    /// The initial value of one sparse row, deterministic from `(table, row, seed)`, so any
    /// shard can create rows lazily. Empty for a table the model does not have.
    fn init_sparse_row(&self, table: &str, row: u64, seed: u64) -> Vec<f32>;

    /// Decodes and validates a batch of samples (feature count, labels, ids in range).
    /// The default says the model reads raw records ([`Model::prepare_records`]).
    fn prepare(&self, samples: &[Sample]) -> Result<Batch> {
        let _ = samples;
        Err(Error::Model(format!(
            "model {} implements neither prepare (samples) nor prepare_records (raw records)",
            self.name()
        )))
    }

    /// Like [`Model::prepare`], with a seed for the batch's random choices (word2vec's
    /// negative samples). The same samples and seed give the same batch; models without
    /// random choices ignore the seed.
    fn prepare_seeded(&self, samples: &[Sample], seed: u64) -> Result<Batch> {
        let _ = seed;
        self.prepare(samples)
    }

    /// A batch from raw records (a task's records, in file order; `seed` as for
    /// [`Model::prepare_seeded`]). The default decodes each record as a [`Sample`] (a
    /// record that is not one is [`Error::BadRecord`]) and calls `prepare_seeded`.
    fn prepare_records(&self, records: &[Vec<u8>], seed: u64) -> Result<Batch> {
        let samples = records
            .iter()
            .enumerate()
            .map(|(index, r)| {
                edl_proto::sample::decode(r).map_err(|e| Error::BadRecord {
                    index,
                    reason: format!("not a valid sample: {e}"),
                })
            })
            .collect::<Result<Vec<Sample>>>()?;
        self.prepare_seeded(&samples, seed)
    }

    /// The rows of each sparse table the batch touches, sorted and distinct.
    fn sparse_rows(&self, batch: &Batch) -> Vec<(String, Vec<u64>)>;

    /// The mean loss over the batch and its gradients.
    fn forward_backward(&self, params: &Params, batch: &Batch) -> Result<StepOutput>;

    /// Loss totals (and correct predictions) over the batch, without gradients.
    fn evaluate(&self, params: &Params, batch: &Batch) -> Result<EvalOutput>;

    /// The metric reports use.
    fn metric(&self) -> MetricKind;
}

/// A boxed model (what [`crate::build_on`] returns) is a model: it can be handed to
/// [`crate::main`] as is.
impl Model for Box<dyn Model> {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn dense_params(&self) -> Vec<DenseParam> {
        (**self).dense_params()
    }
    fn sparse_tables(&self) -> Vec<SparseTable> {
        (**self).sparse_tables()
    }
    fn init_dense(&self, seed: u64) -> Vec<Vec<f32>> {
        (**self).init_dense(seed)
    }
    fn init_sparse_row(&self, table: &str, row: u64, seed: u64) -> Vec<f32> {
        (**self).init_sparse_row(table, row, seed)
    }
    fn prepare(&self, samples: &[Sample]) -> Result<Batch> {
        (**self).prepare(samples)
    }
    fn prepare_seeded(&self, samples: &[Sample], seed: u64) -> Result<Batch> {
        (**self).prepare_seeded(samples, seed)
    }
    fn prepare_records(&self, records: &[Vec<u8>], seed: u64) -> Result<Batch> {
        (**self).prepare_records(records, seed)
    }
    fn sparse_rows(&self, batch: &Batch) -> Vec<(String, Vec<u64>)> {
        (**self).sparse_rows(batch)
    }
    fn forward_backward(&self, params: &Params, batch: &Batch) -> Result<StepOutput> {
        (**self).forward_backward(params, batch)
    }
    fn evaluate(&self, params: &Params, batch: &Batch) -> Result<EvalOutput> {
        (**self).evaluate(params, batch)
    }
    fn metric(&self) -> MetricKind {
        (**self).metric()
    }
}
