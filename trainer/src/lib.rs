//! The edl trainer: the models a job trains and a single-process training baseline. The
//! elastic runtime (master tasks, pserver push/pull) is built on top of [`Model`].
//!
//! A trainer only computes gradients; the parameter servers own the parameters and the
//! optimizers. A [`Model`] declares its dense parameters and sparse (embedding) tables,
//! their initial values, turns [`Sample`]s into a validated
//! [`Batch`], and computes the mean loss and its gradients with candle's autograd. Math
//! runs on a candle [`Device`](candle_core::Device): the CPU by default, CUDA with the
//! `cuda` feature.
//!
//! Models (see [`ModelSpec`]): `fit_a_line` and `linear` (linear regression, squared
//! error), `mlp` and `mnist_mlp` (ReLU MLP, softmax cross-entropy), `mnist_cnn`
//! (PaddlePaddle's `recognize_digits` CNN), `word2vec` (skip-gram with negative
//! sampling over two sparse tables) and `ctr` (click-through rate: dense features and
//! categorical ids through one sparse table into a ReLU network).
//!
//! # A model of your own
//!
//! Implement [`Model`] and hand it to [`main`] (or [`Trainer`]): that program is then an
//! elastic edl trainer that `edl run` starts through `[trainer] entry` (the guide is
//! docs/trainer-api.md; `examples/resnet_mnist` is a whole one). A model keeps its
//! prepared data in a [`Batch::new`]; this one fits `y = w·x + b` and reads its records
//! raw, as `x,y` text, instead of as edl's [`Sample`]s:
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use edl_trainer::{Batch, DenseParam, Error, EvalOutput, MetricKind, Model, Params,
//!                   Result, SparseTable, StepOutput};
//!
//! #[derive(Debug)]
//! struct Line;
//! #[derive(Debug)]
//! struct Xy { x: Tensor, y: Tensor }
//!
//! impl Model for Line {
//!     fn name(&self) -> &str { "line" }
//!     fn dense_params(&self) -> Vec<DenseParam> {
//!         vec![DenseParam { name: "w".into(), shape: vec![1] },
//!              DenseParam { name: "b".into(), shape: vec![1] }]
//!     }
//!     fn sparse_tables(&self) -> Vec<SparseTable> { vec![] }
//!     fn init_dense(&self, _seed: u64) -> Vec<Vec<f32>> { vec![vec![0.0], vec![0.0]] }
//!     fn init_sparse_row(&self, _: &str, _: u64, _: u64) -> Vec<f32> { vec![] }
//!     fn prepare_records(&self, records: &[Vec<u8>], _seed: u64) -> Result<Batch> {
//!         let (mut xs, mut ys) = (vec![], vec![]);
//!         for (index, r) in records.iter().enumerate() {
//!             let bad = || Error::BadRecord { index, reason: "expected x,y".into() };
//!             let text = std::str::from_utf8(r).map_err(|_| bad())?;
//!             let (x, y) = text.split_once(',').ok_or_else(bad)?;
//!             xs.push(x.trim().parse::<f32>().map_err(|_| bad())?);
//!             ys.push(y.trim().parse::<f32>().map_err(|_| bad())?);
//!         }
//!         let n = xs.len();
//!         Ok(Batch::new(n, Xy { x: Tensor::from_vec(xs, n, &Device::Cpu)?,
//!                               y: Tensor::from_vec(ys, n, &Device::Cpu)? }))
//!     }
//!     fn sparse_rows(&self, _: &Batch) -> Vec<(String, Vec<u64>)> { vec![] }
//!     fn forward_backward(&self, p: &Params, batch: &Batch) -> Result<StepOutput> {
//!         let d = batch.data::<Xy>().ok_or_else(|| Error::Model("not my batch".into()))?;
//!         let w = Var::new(p.dense[0].as_slice(), &Device::Cpu)?;
//!         let b = Var::new(p.dense[1].as_slice(), &Device::Cpu)?;
//!         let pred = d.x.broadcast_mul(w.as_tensor())?.broadcast_add(b.as_tensor())?;
//!         let loss = (pred - &d.y)?.sqr()?.mean_all()?;
//!         let grads = loss.backward()?;
//!         let grad = |v: &Var| -> Result<Vec<f32>> {
//!             Ok(grads.get(v.as_tensor()).map_or(Ok(vec![0.0]), |g| g.to_vec1())?)
//!         };
//!         Ok(StepOutput { loss: loss.to_scalar()?, examples: batch.len(),
//!                         dense: vec![grad(&w)?, grad(&b)?], sparse: vec![] })
//!     }
//!     fn evaluate(&self, p: &Params, batch: &Batch) -> Result<EvalOutput> {
//!         let d = batch.data::<Xy>().ok_or_else(|| Error::Model("not my batch".into()))?;
//!         let pred = ((&d.x * f64::from(p.dense[0][0]))? + f64::from(p.dense[1][0]))?;
//!         let sum = (pred - &d.y)?.sqr()?.sum_all()?.to_scalar::<f32>()?;
//!         Ok(EvalOutput { loss_sum: f64::from(sum), count: batch.len() as u64, correct: 0 })
//!     }
//!     fn metric(&self) -> MetricKind { MetricKind::Cost }
//! }
//!
//! // As a trainer program this would be the whole `main`:
//! //     fn main() -> std::process::ExitCode { edl_trainer::main(|_ctx| Ok(Line)) }
//! // Here, a few plain gradient steps on records `x,y` with y = 2x + 1:
//! # fn main() -> edl_trainer::Result<()> {
//! let records: Vec<Vec<u8>> =
//!     (0..32).map(|i| format!("{},{}", i as f32 / 32.0, 2.0 * i as f32 / 32.0 + 1.0).into_bytes()).collect();
//! let batch = Line.prepare_records(&records, 0)?;
//! let mut p = Params { dense: Line.init_dense(0), ..Params::default() };
//! for _ in 0..2000 {
//!     let out = Line.forward_backward(&p, &batch)?;
//!     for (v, g) in p.dense.iter_mut().zip(&out.dense) { v[0] -= 0.5 * g[0]; }
//! }
//! assert!((p.dense[0][0] - 2.0).abs() < 0.05 && (p.dense[1][0] - 1.0).abs() < 0.05);
//! assert!(matches!(Line.prepare_records(&[b"oops".to_vec()], 0),
//!                  Err(Error::BadRecord { index: 0, .. })));
//! # Ok(())
//! # }
//! ```
//!
//! # Layout
//!
//! - [`app`]: [`Trainer`] and [`main`], the one call that runs a model as an elastic
//!   trainer, configured by the environment `edl run` sets or a builder.
//! - [`model`]: the [`Model`] trait and its types ([`Params`], [`Batch`],
//!   [`StepOutput`], [`EvalOutput`], [`MetricKind`], ...).
//! - [`spec`]: [`build`] a model from its [`ModelSpec`] ([`check_model`] checks one);
//!   the description, with feature standardisation ([`Stats`], [`feature_stats`]), is
//!   `edl_job::model`, re-exported here.
//! - `dense.rs`: the dense models (fully connected and convolutional); `fc_cpu.rs`: the
//!   fully connected networks' step in f32 straight on the parameter slices (`gemm`).
//! - [`word2vec`]: skip-gram with negative sampling (`word2vec_cpu.rs`: its step on
//!   the CPU without autograd).
//! - [`ctr`]: the click-through-rate model (PaddleRec's CTR-DNN).
//! - [`local_optim`]: the pservers' optimizers ([`OptimizerKind`]) applied in process.
//! - [`local`]: [`train_local`], the single-process trainer.
//! - [`data`]: [`load_samples`] from RecordIO files.
//! - [`store`]: [`ParamStore`], where parameters live ([`LocalStore`] in process;
//!   the parameter servers in a job).
//! - [`psstore`]: [`PsStore`], the parameter servers as a [`ParamStore`] (through
//!   `edl_pserver_client`).
//! - [`tasks`]: the task stream in one place: the `cloud_reader` ([`tasks::CloudReader`]:
//!   tasks leased from the master through `edl_master_client`, read ahead) and
//!   [`Tasks`], what a training loop says of each; both yield [`Next`].
//! - [`runtime`]: the elastic trainer loop over [`Tasks`].
//! - `progress.rs`: what a training loop reports ([`Progress`]) and stops with
//!   ([`RuntimeError`]); the runtime, [`Tasks`] and the Python package share both.
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
pub mod ctr;
pub mod data;
mod dense;
pub mod device;
pub mod error;
mod fc_cpu;
pub mod goodput;
pub mod job;
pub mod local;
pub mod local_optim;
pub mod model;
pub mod process;
mod progress;
pub mod psstore;
mod rng;
pub mod runtime;
mod sparse_rows;
pub mod spec;
pub mod store;
pub mod tasks;
pub mod word2vec;
mod word2vec_cpu;

#[cfg(test)]
mod testdata;
#[cfg(test)]
mod tests;

pub use app::{Trainer, main};
pub use data::{check_split, load_records, load_samples};
pub use device::{CUDA_BUILD, DeviceChoice, cuda_probe, device_name, select_device};
pub use edl_job::model::{ModelSpec, NegativeSampler, Stats, StatsError, feature_stats};
pub use edl_proto::sample::{Sample, sample::Label};
pub use edl_pserver_client::OptimizerKind;
pub use error::{Error, Result};
pub use local::{LocalConfig, LocalReport, StepTiming, evaluate_all, train_local};
pub use local_optim::LocalOptimizer;
pub use model::{
    Batch, DenseParam, EvalOutput, MetricKind, Model, Params, SparseGrad, SparseInit, SparseRows,
    SparseTable, StepOutput,
};
pub use process::{ModelContext, ModelSource};
pub use progress::{Progress, RuntimeError};
pub use psstore::{PsStore, PsStoreStats};
pub use runtime::RuntimeConfig;
pub use spec::{build, build_on, check_model};
pub use store::{InitOutcome, LocalStore, ParamInit, ParamStore, StoreError};
pub use tasks::{Next, Tasks};
