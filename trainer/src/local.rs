//! [`train_local`]: single-process training of a [`Model`] with a
//! [`LocalOptimizer`] — the baseline the distributed trainer is compared with, and the
//! harness of the model quality tests.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use edl_proto::sample::Sample;

use crate::error::{Error, Result};
use edl_pserver_client::OptimizerKind;

use crate::local_optim::LocalOptimizer;
use crate::model::{Batch, EvalOutput, MetricKind, Model, Params};
use crate::rng::{SplitMix64, hash_str, mix};

/// Settings of a local training run.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LocalConfig {
    /// Passes over the training set.
    pub epochs: usize,
    /// Samples per step.
    pub batch_size: usize,
    /// Learning rate.
    pub lr: f32,
    /// The optimizer.
    pub optimizer: OptimizerKind,
    /// Seed of parameter initialisation, shuffling and batch randomness.
    pub seed: u64,
    /// Samples per evaluation batch.
    pub eval_batch_size: usize,
}

impl Default for LocalConfig {
    fn default() -> Self {
        LocalConfig {
            epochs: 1,
            batch_size: 64,
            lr: 1e-3,
            optimizer: OptimizerKind::adam(),
            seed: 0,
            eval_batch_size: 256,
        }
    }
}

/// Where the training time went (summed over steps).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTiming {
    /// [`Model::prepare_seeded`]: validating samples and building batch tensors.
    pub prepare: Duration,
    /// Creating missing sparse rows (word2vec only).
    pub sparse_init: Duration,
    /// [`Model::forward_backward`].
    pub forward_backward: Duration,
    /// The optimizer update.
    pub update: Duration,
    /// Wall time of the training loop (evaluation excluded).
    pub total: Duration,
}

/// What a local run produced.
#[derive(Debug, Clone)]
pub struct LocalReport {
    /// The metric of `initial_metric` and `final_metric`.
    pub metric: MetricKind,
    /// The metric on the test set before training.
    pub initial_metric: f64,
    /// The metric on the test set after training.
    pub final_metric: f64,
    /// Test-set totals before training.
    pub initial_eval: EvalOutput,
    /// Test-set totals after training.
    pub final_eval: EvalOutput,
    /// Mean training loss of each epoch (weighted by examples per step).
    pub epoch_loss: Vec<f64>,
    /// Training loss of each step.
    pub step_loss: Vec<f32>,
    /// Steps taken.
    pub steps: u64,
    /// Training samples per second (forward, backward and update; evaluation excluded).
    pub samples_per_sec: f64,
    /// Where the time went.
    pub timing: StepTiming,
    /// The trained parameters.
    pub params: Params,
}

/// Trains `model` on `train` for `cfg.epochs` passes (shuffled each pass, deterministic
/// from `cfg.seed`) and evaluates it on `test` before and after. An empty `test` gives
/// NaN metrics.
pub fn train_local(
    model: &dyn Model,
    train: &[Sample],
    test: &[Sample],
    cfg: &LocalConfig,
) -> Result<LocalReport> {
    if train.is_empty() {
        return Err(Error::Config("no training samples".into()));
    }
    if cfg.batch_size == 0 || cfg.eval_batch_size == 0 {
        return Err(Error::Config("batch sizes must be positive".into()));
    }
    let mut optimizer = LocalOptimizer::new(cfg.optimizer, cfg.lr)?;
    let mut params = Params {
        dense: model.init_dense(cfg.seed),
        sparse: HashMap::new(),
    };
    let metric = model.metric();
    let initial_eval = evaluate_all(model, &mut params, test, cfg.eval_batch_size, cfg.seed)?;

    let mut samples = train.to_vec();
    let mut timing = StepTiming::default();
    let mut epoch_loss = Vec::with_capacity(cfg.epochs);
    let mut step_loss = Vec::new();
    let mut steps = 0u64;
    let started = Instant::now();
    for epoch in 0..cfg.epochs {
        SplitMix64::new(mix(cfg.seed, epoch as u64)).shuffle(&mut samples);
        let (mut loss_sum, mut examples) = (0f64, 0usize);
        for chunk in samples.chunks(cfg.batch_size) {
            let t0 = Instant::now();
            let batch = model.prepare_seeded(chunk, mix(cfg.seed, steps))?;
            let t1 = Instant::now();
            ensure_rows(model, &mut params, &batch, cfg.seed);
            let t2 = Instant::now();
            let mut out = model.forward_backward(&params, &batch)?;
            out.weigh_partial(chunk.len(), cfg.batch_size);
            let t3 = Instant::now();
            optimizer.step(&mut params, &out)?;
            let t4 = Instant::now();
            timing.prepare += t1 - t0;
            timing.sparse_init += t2 - t1;
            timing.forward_backward += t3 - t2;
            timing.update += t4 - t3;
            loss_sum += f64::from(out.loss) * out.examples as f64;
            examples += out.examples;
            step_loss.push(out.loss);
            steps += 1;
        }
        let mean = loss_sum / examples as f64;
        tracing::debug!(model = model.name(), epoch, loss = mean, "epoch done");
        epoch_loss.push(mean);
    }
    timing.total = started.elapsed();
    let trained = (train.len() * cfg.epochs) as f64;
    let final_eval = evaluate_all(model, &mut params, test, cfg.eval_batch_size, cfg.seed)?;
    Ok(LocalReport {
        metric,
        initial_metric: metric.value(&initial_eval),
        final_metric: metric.value(&final_eval),
        initial_eval,
        final_eval,
        epoch_loss,
        step_loss,
        steps,
        samples_per_sec: trained / timing.total.as_secs_f64().max(1e-9),
        timing,
        params,
    })
}

/// Evaluates `model` over `samples` in batches of `batch_size`, creating (with
/// [`Model::init_sparse_row`] and `seed`) any sparse row the parameters lack. Batch
/// randomness (word2vec negatives) is fixed by `seed`, so two evaluations of the same
/// samples are comparable.
pub fn evaluate_all(
    model: &dyn Model,
    params: &mut Params,
    samples: &[Sample],
    batch_size: usize,
    seed: u64,
) -> Result<EvalOutput> {
    let mut total = EvalOutput::default();
    let eval_seed = mix(seed, hash_str("eval"));
    for (i, chunk) in samples.chunks(batch_size.max(1)).enumerate() {
        let batch = model.prepare_seeded(chunk, mix(eval_seed, i as u64))?;
        ensure_rows(model, params, &batch, seed);
        total.merge(&model.evaluate(params, &batch)?);
    }
    Ok(total)
}

/// Creates the sparse rows `batch` touches that `params` lacks.
fn ensure_rows(model: &dyn Model, params: &mut Params, batch: &Batch, seed: u64) {
    for (table, rows) in model.sparse_rows(batch) {
        let values = params.sparse.entry(table.clone()).or_default();
        for row in rows {
            values.get_or_insert_with(row, || model.init_sparse_row(&table, row, seed));
        }
    }
}
