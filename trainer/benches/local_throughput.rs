//! Local (single-process) training throughput: samples/s of forward + backward + update
//! on mnist_5k, the baseline the distributed trainer is compared with.
//!
//! `cargo bench -p edl-trainer --bench local_throughput [-- MODEL [EPOCHS] [BATCH] [OPTIMIZER]]`
//! with MODEL `mnist_mlp` (default), `mnist_cnn` or `wide` (784-3584-3584-10, the wide
//! dense job of `scripts/bench-peer`); batch 64 by default; OPTIMIZER `adam`
//! (default, lr 0.001) or `sgd` (lr 0.05, as `scripts/bench-peer`'s job: its ceiling).

use std::time::{Duration, Instant};

use edl_proto::sample::Sample;
use edl_trainer::{LocalConfig, ModelSpec, OptimizerKind, Params, build, train_local};

#[path = "../src/testdata.rs"]
mod testdata;

fn per_step(d: Duration, steps: u64) -> String {
    format!("{:8.1} us", d.as_secs_f64() * 1e6 / steps.max(1) as f64)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let model_name = args.first().map_or("mnist_mlp", String::as_str);
    let epochs: usize = args.get(1).map_or(Ok(3), |s| s.parse())?;
    let batch_size: usize = args.get(2).map_or(Ok(64), |s| s.parse())?;
    let spec = match model_name {
        "mnist_mlp" => ModelSpec::MnistMlp,
        "mnist_cnn" => ModelSpec::MnistCnn,
        // bench-peer's wide dense job: 784-3584-3584-10, 15.7M parameters.
        "wide" => ModelSpec::Mlp {
            inputs: 784,
            hidden: vec![3584, 3584],
            classes: 10,
            standardize: false,
            stats: None,
            init: Default::default(),
        },
        other => {
            return Err(format!("unknown model {other}; use mnist_mlp, mnist_cnn or wide").into());
        }
    };
    let (optimizer, lr) = match args.get(3).map_or("adam", String::as_str) {
        "adam" => (OptimizerKind::adam(), 1e-3),
        "sgd" => (OptimizerKind::sgd(), 0.05),
        other => return Err(format!("unknown optimizer {other}; use adam or sgd").into()),
    };
    let (train, test) = testdata::split_every(&testdata::mnist(), 5);
    let model = build(&spec)?;
    let cfg = LocalConfig {
        epochs,
        batch_size,
        lr,
        optimizer,
        seed: 1,
        eval_batch_size: 500,
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "local_throughput: {model_name}, batch {batch_size}, {epochs} epoch(s) of {} samples, {}, {threads} cpu(s)",
        train.len(),
        args.get(3).map_or("adam", String::as_str)
    );
    let report = train_local(model.as_ref(), &train, &test, &cfg)?;
    let t = report.timing;
    println!(
        "  {:.0} samples/s ({} steps in {:.2?}); held-out {} {:.4}",
        report.samples_per_sec, report.steps, t.total, report.metric, report.final_metric
    );
    println!("  per step: prepare {}", per_step(t.prepare, report.steps));
    println!(
        "            forward+backward {}",
        per_step(t.forward_backward, report.steps)
    );
    println!(
        "            optimizer update {}",
        per_step(t.update, report.steps)
    );

    // Split forward+backward: parameter upload, forward alone (evaluate), the rest.
    let batch: Vec<Sample> = train[..batch_size.min(train.len())].to_vec();
    let batch = model.prepare(&batch)?;
    let params = Params {
        dense: report.params.dense.clone(),
        sparse: Default::default(),
    };
    let reps = 50u32;
    let shapes = model.dense_params();
    let time = |f: &mut dyn FnMut() -> Result<(), Box<dyn std::error::Error>>| {
        let start = Instant::now();
        for _ in 0..reps {
            f()?;
        }
        Ok::<Duration, Box<dyn std::error::Error>>(start.elapsed() / reps)
    };
    let upload = time(&mut || {
        for (p, v) in shapes.iter().zip(&params.dense) {
            std::hint::black_box(candle_core::Tensor::from_slice(
                v,
                p.shape.as_slice(),
                &candle_core::Device::Cpu,
            )?);
        }
        Ok(())
    })?;
    let forward = time(&mut || {
        std::hint::black_box(model.evaluate(&params, &batch)?);
        Ok(())
    })?;
    let step = time(&mut || {
        std::hint::black_box(model.forward_backward(&params, &batch)?);
        Ok(())
    })?;
    println!(
        "  isolated ({reps} reps): parameter upload {:.1} us, forward (evaluate) {:.1} us, \
         forward+backward {:.1} us",
        upload.as_secs_f64() * 1e6,
        forward.as_secs_f64() * 1e6,
        step.as_secs_f64() * 1e6
    );
    Ok(())
}
