//! `edl bench local`: edl's own single-process loop on a job's built-in model and data,
//! on a device: the ceiling a job's trainers are compared with (docs/benchmarks.md,
//! docs/gpu.md). No etcd, master or pserver: one process prepares each batch, runs the
//! model's step (parameters uploaded and gradients downloaded each step, as a trainer
//! does) and applies the job's optimizer on the host.
//!
//! Prints, per batch size: samples/s over the steps, each step's prepare / forward and
//! backward / update time, and, timed apart on one batch with the trained parameters,
//! the forward pass alone (an evaluation) and the forward and backward pass.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use edl_trainer::{DeviceChoice, LocalConfig, Params};
use serde::Serialize;

/// Arguments of `edl bench local`.
#[derive(Debug, Args)]
pub struct LocalArgs {
    /// The job spec: its built-in `[model]`, data (prepared from `[data.prepare]` if
    /// missing), optimizer, learning rate and seed.
    pub spec: PathBuf,
    /// Batch sizes, comma-separated (default: the spec's).
    #[arg(long, value_delimiter = ',')]
    pub batch: Vec<usize>,
    /// Passes over the training split per batch size.
    #[arg(long, default_value_t = 3)]
    pub passes: usize,
    /// `auto`, `cpu` or `cuda:N` (docs/gpu.md).
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    /// Also write the result as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One batch size's figures.
#[derive(Debug, Clone, Serialize)]
pub struct LocalRow {
    /// Samples per step.
    pub batch: usize,
    /// The device, `cpu` or `cuda:N`.
    pub device: String,
    /// Samples per second over the training steps.
    pub samples_per_s: f64,
    /// Steps taken.
    pub steps: u64,
    /// Per step, microseconds: preparing the batch, the model's step (forward, backward,
    /// the parameters' upload and the gradients' download), the optimizer's update.
    pub prepare_us: f64,
    /// See `prepare_us`.
    pub forward_backward_us: f64,
    /// See `prepare_us`.
    pub update_us: f64,
    /// Timed apart on one batch: the forward pass alone (an evaluation), microseconds.
    pub forward_only_us: f64,
    /// Timed apart on one batch: forward and backward, microseconds.
    pub forward_backward_only_us: f64,
    /// The held-out metric before training.
    pub initial_metric: f64,
    /// The held-out metric after training, and its name.
    pub metric: f64,
    /// See `metric`.
    pub metric_name: String,
}

/// Runs `edl bench local`.
pub fn run(args: LocalArgs) -> anyhow::Result<()> {
    let mut spec = edl_trainer::job::load(&args.spec)?;
    let in_spec = |e: anyhow::Error| e.context(format!("job spec {}", args.spec.display()));
    anyhow::ensure!(
        spec.model.is_some(),
        "job spec {}: no built-in [model]; edl bench local runs edl's own models (a \
         [trainer] entry program is measured by running its job)",
        args.spec.display()
    );
    // The device first: a bad choice is one error before any work.
    let device = edl_trainer::select_device(args.device)?;
    crate::run::prepare_data(&spec).map_err(in_spec)?;
    edl_trainer::job::fit_stats(&mut spec).map_err(|e| in_spec(e.into()))?;
    edl_trainer::job::check_data_fits_model(&spec).map_err(|e| in_spec(e.into()))?;
    let model_spec = spec.model.clone().context("no built-in [model]")?;
    let train =
        edl_trainer::load_samples(&spec.data.train.patterns()).context("the training split")?;
    let test = match &spec.data.test {
        Some(t) => edl_trainer::load_samples(&t.patterns()).context("the test split")?,
        None => train.clone(),
    };
    let device_name = edl_trainer::device_name(&device);
    let optimizer = spec.train.optimizer_config();
    let batches = match args.batch.is_empty() {
        true => vec![spec.train.batch_size],
        false => args.batch.clone(),
    };
    println!(
        "edl bench local: {} on {device_name}, {} training and {} test samples, {} pass(es), {:?}",
        spec.name,
        train.len(),
        test.len(),
        args.passes,
        spec.train.optimizer
    );
    println!(
        "| batch | samples/s | prepare us | forward+backward us | update us | forward alone us | forward+backward alone us | held-out metric |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for &batch_size in &batches {
        anyhow::ensure!(batch_size > 0, "--batch: batch sizes must be positive");
        let model = edl_trainer::build_on(&model_spec, &device, candle_core::DType::F32)?;
        let cfg = LocalConfig {
            epochs: args.passes,
            batch_size,
            lr: optimizer.lr.at(0),
            optimizer: optimizer.kind,
            seed: spec.train.seed,
            eval_batch_size: 256,
        };
        let report = edl_trainer::train_local(model.as_ref(), &train, &test, &cfg)?;
        let t = &report.timing;
        let per_step = |d: Duration| d.as_secs_f64() * 1e6 / report.steps.max(1) as f64;
        // The same batch timed apart, with the trained parameters.
        let one = model.prepare(&train[..batch_size.min(train.len())])?;
        let params = Params {
            dense: report.params.dense.clone(),
            sparse: Default::default(),
        };
        let reps = 20u32;
        let forward = timed(reps, || model.evaluate(&params, &one).map(drop))?;
        let step = timed(reps, || model.forward_backward(&params, &one).map(drop))?;
        let row = LocalRow {
            batch: batch_size,
            device: device_name.clone(),
            samples_per_s: report.samples_per_sec,
            steps: report.steps,
            prepare_us: per_step(t.prepare),
            forward_backward_us: per_step(t.forward_backward),
            update_us: per_step(t.update),
            forward_only_us: forward.as_secs_f64() * 1e6,
            forward_backward_only_us: step.as_secs_f64() * 1e6,
            initial_metric: report.initial_metric,
            metric: report.final_metric,
            metric_name: report.metric.name().to_owned(),
        };
        println!(
            "| {} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} {:.4} |",
            row.batch,
            row.samples_per_s,
            row.prepare_us,
            row.forward_backward_us,
            row.update_us,
            row.forward_only_us,
            row.forward_backward_only_us,
            row.metric_name,
            row.metric
        );
        rows.push(row);
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("write {}", path.display()))?;
    }
    Ok(())
}

/// The mean time of `f` over `reps` calls, after one call to warm up.
fn timed(reps: u32, mut f: impl FnMut() -> edl_trainer::Result<()>) -> anyhow::Result<Duration> {
    f()?;
    let start = Instant::now();
    for _ in 0..reps {
        f()?;
    }
    Ok(start.elapsed() / reps)
}
