//! The edl trainer: the models a job trains and a single-process training baseline. The
//! elastic runtime (master tasks, pserver push/pull) is built on top of [`Model`].
//!
//! A trainer only computes gradients; the parameter servers own the parameters and the
//! optimizers. A [`Model`] declares its dense parameters and sparse (embedding) tables,
//! their initial values, turns [`Sample`](edl_proto::sample::Sample)s into a validated
//! [`Batch`], and computes the mean loss and its gradients with candle's autograd. Math
//! runs on a candle [`Device`](candle_core::Device): the CPU by default, CUDA with the
//! `cuda` feature.
//!
//! Models (see [`ModelSpec`]): `fit_a_line` and `linear` (linear regression, squared
//! error), `mlp` and `mnist_mlp` (ReLU MLP, softmax cross-entropy), `mnist_cnn`
//! (PaddlePaddle's `recognize_digits` CNN) and `word2vec` (skip-gram with negative
//! sampling over two sparse tables).
//!
//! # Layout
//!
//! - [`model`]: the [`Model`] trait and its types ([`Params`], [`Batch`],
//!   [`StepOutput`], [`EvalOutput`], [`MetricKind`], ...).
//! - [`spec`]: [`build`] a model from its [`ModelSpec`] ([`check_model`] checks one);
//!   the description, with feature standardisation ([`Stats`], [`feature_stats`]), is
//!   `edl_job::model`, re-exported here.
//! - `dense.rs`: the dense models (fully connected and convolutional).
//! - [`word2vec`]: skip-gram with negative sampling.
//! - [`local_optim`]: the pservers' optimizers ([`OptimizerKind`]) applied in process.
//! - [`local`]: [`train_local`], the single-process trainer.
//! - [`data`]: [`load_samples`] from RecordIO files.
//! - [`store`]: [`ParamStore`], where parameters live ([`LocalStore`] in process;
//!   the parameter servers in a job).
//! - [`psstore`]: [`PsStore`], the parameter servers as a [`ParamStore`].
//! - [`runtime`]: the elastic trainer loop over the master's `cloud_reader`.
//! - [`process`]: the trainer process ([`process::run`]: spec, session, pservers,
//!   `/metrics`, drain, report) and the [`process::Session`] shared with `edl consume`.
//! - [`job`]: the job spec as a trainer uses it: model and optimizer checks, data checks,
//!   conversion to the pservers' and the runtime's configs.
//! - [`device`]: [`select_device`] (`auto`, `cpu`, `cuda:N`; probes before touching CUDA).
//! - [`error`]: errors ([`Error`]), with retryable and bad-data classification.
//! - `rng.rs`: the stable generator behind initialisation and negative sampling.
//!
//! # Example
//!
//! ```
//! use edl_proto::sample::Sample;
//! use edl_trainer::{LocalConfig, ModelSpec, build, train_local};
//!
//! # fn main() -> edl_trainer::Result<()> {
//! let data: Vec<Sample> = (0..64)
//!     .map(|i| {
//!         let x = i as f32 / 64.0;
//!         Sample::regression(vec![x, 1.0 - x], 3.0 * x + 1.0)
//!     })
//!     .collect();
//! let mut spec = ModelSpec::Linear { inputs: 2, standardize: true, stats: None };
//! spec.fit_stats(&data)?;
//! let model = build(&spec)?;
//! let cfg = LocalConfig { epochs: 50, batch_size: 8, lr: 0.05, ..LocalConfig::default() };
//! let report = train_local(model.as_ref(), &data, &data, &cfg)?;
//! assert!(report.final_metric < 0.01, "cost {}", report.final_metric);
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub mod app;
pub mod data;
mod dense;
pub mod device;
pub mod error;
pub mod job;
pub mod local;
pub mod local_optim;
pub mod model;
pub mod process;
pub mod psstore;
mod rng;
pub mod runtime;
pub mod spec;
pub mod store;
pub mod word2vec;

#[cfg(test)]
mod runtime_tests;
#[cfg(test)]
mod testdata;
#[cfg(test)]
mod tests;

pub use app::{Trainer, main};
pub use data::{check_split, load_records, load_samples};
pub use edl_proto::sample::{Sample, sample::Label};
pub use device::{DeviceChoice, device_name, select_device};
pub use edl_job::model::{ModelSpec, NegativeSampler, Stats, StatsError, feature_stats};
pub use edl_pserver::OptimizerKind;
pub use error::{Error, Result};
pub use local::{LocalConfig, LocalReport, StepTiming, evaluate_all, train_local};
pub use local_optim::LocalOptimizer;
pub use model::{
    Batch, DenseParam, EvalOutput, MetricKind, Model, Params, SparseGrad, SparseInit, SparseTable,
    StepOutput,
};
pub use process::{ModelContext, ModelSource};
pub use psstore::{PsStore, PsStoreStats};
pub use runtime::{Progress, RuntimeConfig, RuntimeError};
pub use spec::{build, build_on, check_model};
pub use store::{InitOutcome, LocalStore, ParamStore, StoreError};
