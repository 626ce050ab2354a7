//! Cross-module tests: gradient checks of every model, the quality runs on real data and
//! bad input.

use std::collections::HashMap;
use std::time::Instant;

use candle_core::{DType, Device};
use edl_proto::sample::Sample;

use crate::Error;
use crate::OptimizerKind;
use crate::local::{LocalConfig, train_local};
use crate::model::{Model, Params, SparseRows};
use crate::rng::SplitMix64;
use crate::testdata;
use crate::word2vec::{INPUT_TABLE, OUTPUT_TABLE};
use crate::{ModelSpec, NegativeSampler, build, build_on};

/// Loss of `model` in f64 at `params` on `samples` (prepared with `seed`).
fn loss_at(model: &dyn Model, params: &Params, samples: &[Sample]) -> f64 {
    let batch = model.prepare(samples).unwrap();
    let e = model.evaluate(params, &batch).unwrap();
    e.loss_sum / e.count as f64
}

/// Central difference of the loss along one coordinate, with the step actually taken
/// after rounding to f32.
fn numeric(
    model: &dyn Model,
    params: &mut Params,
    samples: &[Sample],
    get: &dyn Fn(&mut Params) -> &mut f32,
    eps: f32,
) -> f64 {
    let x = *get(params);
    let (hi, lo) = (x + eps, x - eps);
    *get(params) = hi;
    let l_hi = loss_at(model, params, samples);
    *get(params) = lo;
    let l_lo = loss_at(model, params, samples);
    *get(params) = x;
    (l_hi - l_lo) / (f64::from(hi) - f64::from(lo))
}

fn close(analytic: f32, numeric: f64) -> bool {
    (f64::from(analytic) - numeric).abs() <= 1e-5 + 1e-4 * numeric.abs()
}

/// Checks the dense gradients of a model computing in f64 against central differences,
/// on up to `per_param` coordinates of each parameter.
fn check_dense_gradients(spec: &ModelSpec, samples: &[Sample], per_param: usize) {
    let model = build_on(spec, &Device::Cpu, DType::F64).unwrap();
    let model = model.as_ref();
    let mut rng = SplitMix64::new(42);
    let mut params = Params {
        dense: model.init_dense(7),
        sparse: HashMap::new(),
    };
    // Non-zero biases, so their gradients and the ReLU pattern are not trivial.
    for p in &mut params.dense {
        for v in p.iter_mut() {
            *v += rng.symmetric(0.1);
        }
    }
    let batch = model.prepare(samples).unwrap();
    let out = model.forward_backward(&params, &batch).unwrap();
    let exact = loss_at(model, &params, samples);
    assert!((f64::from(out.loss) - exact).abs() <= 1e-6 * exact.abs().max(1.0));
    let shapes = model.dense_params();
    assert_eq!(out.dense.len(), shapes.len());
    let mut checked = 0;
    for (i, p) in shapes.iter().enumerate() {
        assert_eq!(out.dense[i].len(), p.len(), "{}", p.name);
        let coords: Vec<usize> = if p.len() <= per_param {
            (0..p.len()).collect()
        } else {
            (0..per_param)
                .map(|_| rng.below(p.len() as u64) as usize)
                .collect()
        };
        for j in coords {
            let n = numeric(
                model,
                &mut params,
                samples,
                &|ps| &mut ps.dense[i][j],
                1.0 / 16384.0,
            );
            let a = out.dense[i][j];
            assert!(
                close(a, n),
                "{}: {}[{j}]: autograd {a}, finite difference {n}",
                model.name(),
                p.name
            );
            checked += 1;
        }
    }
    assert!(checked > 0);
}

fn random_dense(n: usize, width: usize, seed: u64, label: impl Fn(usize) -> Sample) -> Vec<Sample> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|i| {
            let mut s = label(i);
            s.dense = (0..width).map(|_| rng.symmetric(1.0)).collect();
            s
        })
        .collect()
}

#[test]
fn gradients_match_finite_differences_linear_and_fit_a_line() {
    let samples = random_dense(5, 3, 1, |i| {
        Sample::regression(vec![], i as f32 * 0.7 - 1.0)
    });
    let mut spec = ModelSpec::Linear {
        inputs: 3,
        standardize: true,
        stats: None,
    };
    spec.fit_stats(&samples).unwrap();
    check_dense_gradients(&spec, &samples, 100);

    let samples = random_dense(4, 13, 2, |i| Sample::regression(vec![], 20.0 + i as f32));
    let mut spec = ModelSpec::FitALine {
        standardize: true,
        stats: None,
    };
    spec.fit_stats(&samples).unwrap();
    check_dense_gradients(&spec, &samples, 100);
}

#[test]
fn gradients_match_finite_differences_mlp() {
    let samples = random_dense(6, 5, 3, |i| Sample::classification(vec![], (i % 3) as u32));
    let spec = ModelSpec::Mlp {
        inputs: 5,
        hidden: vec![4, 3],
        classes: 3,
        standardize: false,
        stats: None,
        init: Default::default(),
    };
    check_dense_gradients(&spec, &samples, 100);
}

#[test]
fn gradients_match_finite_differences_mnist_models() {
    let mnist: Vec<Sample> = testdata::mnist().into_iter().step_by(1250).collect();
    assert_eq!(mnist.len(), 4);
    check_dense_gradients(&ModelSpec::MnistMlp, &mnist, 25);
    check_dense_gradients(&ModelSpec::MnistCnn, &mnist[..2], 25);
}

#[test]
fn gradients_match_finite_differences_word2vec() {
    let spec = ModelSpec::Word2vec {
        vocab_size: 20,
        dim: 4,
        window: 2,
        negatives: 3,
        sampler: NegativeSampler::Zipf,
        seed: 5,
    };
    let model = build_on(&spec, &Device::Cpu, DType::F64).unwrap();
    let model = model.as_ref();
    let samples = vec![
        Sample::sparse(vec![0, 3, 7, 3, 1]),
        Sample::sparse(vec![0, 12, 19, 1]),
    ];
    let batch = model.prepare(&samples).unwrap();
    // Random values for every row (output rows start at zero, which hides errors).
    let mut rng = SplitMix64::new(9);
    let mut params = Params::default();
    for t in model.sparse_tables() {
        let rows: SparseRows = (0..t.rows)
            .map(|r| (r, (0..t.dim).map(|_| rng.symmetric(0.5)).collect()))
            .collect();
        params.sparse.insert(t.name, rows);
    }
    let out = model.forward_backward(&params, &batch).unwrap();
    let touched = model.sparse_rows(&batch);
    assert_eq!(out.sparse.len(), 2);
    for (g, (table, rows)) in out.sparse.iter().zip(&touched) {
        assert_eq!(&g.table, table);
        assert_eq!(&g.rows, rows);
    }
    assert_eq!(touched[0].1, vec![0, 1, 3, 7, 12, 19], "centers");
    for g in &out.sparse {
        for row in 0..20u64 {
            for k in 0..g.dim {
                let table = g.table.clone();
                let n = numeric(
                    model,
                    &mut params,
                    &samples,
                    &|ps| &mut ps.sparse.get_mut(&table).unwrap().get_mut(row).unwrap()[k],
                    1.0 / 16384.0,
                );
                let a = match g.rows.binary_search(&row) {
                    Ok(i) => g.row(i).unwrap()[k],
                    Err(_) => 0.0,
                };
                assert!(
                    close(a, n),
                    "{}[{row}][{k}]: autograd {a}, finite difference {n}",
                    g.table
                );
            }
        }
    }
}

#[test]
fn fit_a_line_reaches_least_squares_cost_on_uci_housing() {
    let started = Instant::now();
    let data = testdata::boston();
    assert_eq!(data.len(), 506);
    let (train, test) = testdata::split_every(&data, 5);
    let mut spec = ModelSpec::FitALine {
        standardize: true,
        stats: None,
    };
    spec.fit_stats(&train).unwrap();
    let model = build(&spec).unwrap();
    let cfg = LocalConfig {
        epochs: 300,
        batch_size: 20,
        lr: 0.01,
        optimizer: OptimizerKind::sgd(),
        seed: 1,
        eval_batch_size: 256,
    };
    let report = train_local(model.as_ref(), &train, &test, &cfg).unwrap();
    let optimum = least_squares_test_cost(&train, &test);
    eprintln!(
        "fit_a_line: test cost {:.3} -> {:.3} (least-squares optimum {optimum:.3}); \
         min batch cost {:.3}; {} steps in {:.2?}",
        report.initial_metric,
        report.final_metric,
        report
            .step_loss
            .iter()
            .copied()
            .fold(f32::INFINITY, f32::min),
        report.steps,
        started.elapsed()
    );
    assert_eq!(report.metric.name(), "cost");
    assert!(
        report.final_metric < optimum * 1.03,
        "test cost {} is not within 3% of the least-squares optimum {optimum}",
        report.final_metric
    );
    // PaddlePaddle's fit_a_line check: some training batch reaches an average cost < 10.
    assert!(report.step_loss.iter().any(|&l| l < 10.0));
}

/// The test cost of the exact least-squares fit on `train` (normal equations in f64).
fn least_squares_test_cost(train: &[Sample], test: &[Sample]) -> f64 {
    let row = |s: &Sample| {
        let mut x: Vec<f64> = s.dense.iter().map(|&v| f64::from(v)).collect();
        x.push(1.0);
        x
    };
    let target = |s: &Sample| match s.label {
        Some(edl_proto::sample::sample::Label::Value(v)) => f64::from(v),
        _ => unreachable!(),
    };
    let n = train[0].dense.len() + 1;
    let mut a = vec![vec![0f64; n + 1]; n];
    for s in train {
        let x = row(s);
        let y = target(s);
        for i in 0..n {
            for j in 0..n {
                a[i][j] += x[i] * x[j];
            }
            a[i][n] += x[i] * y;
        }
    }
    for c in 0..n {
        let p = (c..n)
            .max_by(|&i, &j| a[i][c].abs().total_cmp(&a[j][c].abs()))
            .unwrap();
        a.swap(c, p);
        for r in 0..n {
            if r != c {
                let f = a[r][c] / a[c][c];
                let pivot = a[c].clone();
                for (v, pv) in a[r].iter_mut().zip(&pivot) {
                    *v -= f * pv;
                }
            }
        }
    }
    let w: Vec<f64> = (0..n).map(|i| a[i][n] / a[i][i]).collect();
    test.iter()
        .map(|s| {
            let p: f64 = row(s).iter().zip(&w).map(|(x, w)| x * w).sum();
            (p - target(s)).powi(2)
        })
        .sum::<f64>()
        / test.len() as f64
}

#[test]
fn mnist_mlp_reaches_90_percent_held_out() {
    let started = Instant::now();
    let (train, test) = testdata::split_every(&testdata::mnist(), 5);
    assert_eq!((train.len(), test.len()), (4000, 1000));
    let model = build(&ModelSpec::MnistMlp).unwrap();
    let cfg = LocalConfig {
        epochs: 5,
        batch_size: 64,
        lr: 1e-3,
        optimizer: OptimizerKind::adam(),
        seed: 3,
        eval_batch_size: 500,
    };
    let report = train_local(model.as_ref(), &train, &test, &cfg).unwrap();
    eprintln!(
        "mnist_mlp: held-out accuracy {:.4} (initial {:.4}), epoch losses {:?}, \
         {:.0} samples/s, total {:.2?}",
        report.final_metric,
        report.initial_metric,
        report.epoch_loss,
        report.samples_per_sec,
        started.elapsed()
    );
    assert_eq!(report.metric.name(), "accuracy");
    assert!(
        report.final_metric >= 0.90,
        "accuracy {}",
        report.final_metric
    );
}

#[test]
fn mnist_cnn_loss_falls_in_one_short_epoch() {
    // The full accuracy run (thousands of samples, several epochs) is too slow for a
    // unit test on a small CPU; one epoch over 1000 samples shows it learns.
    let started = Instant::now();
    let (train, test) = testdata::split_every(&testdata::mnist(), 5);
    let train: Vec<Sample> = train.into_iter().step_by(4).collect();
    let test: Vec<Sample> = test.into_iter().step_by(2).collect();
    assert_eq!((train.len(), test.len()), (1000, 500));
    let model = build(&ModelSpec::MnistCnn).unwrap();
    let cfg = LocalConfig {
        epochs: 1,
        batch_size: 32,
        lr: 2e-3,
        optimizer: OptimizerKind::adam(),
        seed: 4,
        eval_batch_size: 250,
    };
    let report = train_local(model.as_ref(), &train, &test, &cfg).unwrap();
    let first = report.step_loss[0];
    let tail = &report.step_loss[report.step_loss.len() - 5..];
    let last = tail.iter().sum::<f32>() / tail.len() as f32;
    eprintln!(
        "mnist_cnn: step loss {first:.3} -> {last:.3} (mean of last 5); held-out accuracy \
         {:.4} after 1 epoch of 1000 samples; {:.0} samples/s; total {:.2?}",
        report.final_metric,
        report.samples_per_sec,
        started.elapsed()
    );
    assert!(last < 0.5 * first, "loss {first} -> {last}");
    assert!(
        report.final_metric > 0.7,
        "accuracy {}",
        report.final_metric
    );
}

#[test]
fn word2vec_loss_falls_30_percent_in_two_passes_touching_few_rows() {
    let started = Instant::now();
    let (sentences, vocab_size) = testdata::ptb_subset();
    let spec = ModelSpec::Word2vec {
        vocab_size,
        dim: 32,
        window: 2,
        negatives: 5,
        sampler: NegativeSampler::Zipf,
        seed: 11,
    };
    let model = build(&spec).unwrap();
    let cfg = LocalConfig {
        epochs: 2,
        batch_size: 16,
        lr: 0.02,
        optimizer: OptimizerKind::adam(),
        seed: 5,
        eval_batch_size: 64,
    };
    let mut widest = 0;
    for chunk in sentences.chunks(cfg.batch_size) {
        let batch = model.prepare(chunk).unwrap();
        for (table, rows) in model.sparse_rows(&batch) {
            assert!(
                rows.windows(2).all(|w| w[0] < w[1]),
                "{table} rows sorted, distinct"
            );
            assert!((rows.len() as u64) < vocab_size, "{table}: a whole table");
            widest = widest.max(rows.len());
        }
    }
    let report = train_local(model.as_ref(), &sentences, &sentences, &cfg).unwrap();
    let touched: usize = report.params.sparse.values().map(SparseRows::len).sum();
    eprintln!(
        "word2vec: vocab {vocab_size}, loss {:.4} -> {:.4} ({:.1}% lower), epoch losses {:?}; \
         widest batch touches {widest} rows; {touched} rows created of {}; {:.0} sentences/s; \
         total {:.2?}",
        report.initial_metric,
        report.final_metric,
        100.0 * (1.0 - report.final_metric / report.initial_metric),
        report.epoch_loss,
        2 * vocab_size,
        report.samples_per_sec,
        started.elapsed()
    );
    assert_eq!(report.metric.name(), "loss");
    assert!(
        report.final_metric <= 0.7 * report.initial_metric,
        "loss {} -> {}",
        report.initial_metric,
        report.final_metric
    );
}

#[test]
fn bad_input_is_a_typed_error() {
    let fit = build(&ModelSpec::FitALine {
        standardize: false,
        stats: None,
    })
    .unwrap();
    let e = fit
        .prepare(&[
            Sample::regression(vec![0.0; 13], 1.0),
            Sample::regression(vec![0.0; 12], 1.0),
        ])
        .unwrap_err();
    assert!(matches!(
        e,
        Error::FeatureCount {
            index: 1,
            found: 12,
            expected: 13,
            ..
        }
    ));
    assert_eq!(
        e.to_string(),
        "sample 1 has 12 dense features, model fit_a_line expects 13"
    );
    assert!(e.is_bad_data());

    let e = fit
        .prepare(&[Sample::classification(vec![0.0; 13], 1)])
        .unwrap_err();
    assert!(matches!(e, Error::Label { .. }), "{e}");
    let mut nan = Sample::regression(vec![0.0; 13], 1.0);
    nan.dense[4] = f32::NAN;
    assert!(matches!(
        fit.prepare(&[nan]),
        Err(Error::NonFiniteFeature { feature: 4, .. })
    ));
    assert!(matches!(fit.prepare(&[]), Err(Error::EmptyBatch { .. })));

    let mlp = build(&ModelSpec::Mlp {
        inputs: 2,
        hidden: vec![3],
        classes: 3,
        standardize: false,
        stats: None,
        init: Default::default(),
    })
    .unwrap();
    let e = mlp
        .prepare(&[Sample::classification(vec![0.0, 1.0], 5)])
        .unwrap_err();
    assert!(matches!(
        e,
        Error::ClassOutOfRange {
            class: 5,
            classes: 3,
            ..
        }
    ));
    assert_eq!(
        e.to_string(),
        "sample 0 has class id 5, model mlp has 3 classes (0..3)"
    );
    let unlabelled = Sample {
        version: 1,
        dense: vec![0.0, 1.0],
        ..Default::default()
    };
    let e = mlp.prepare(&[unlabelled]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "sample 0 has no label, model mlp needs a class id"
    );

    // Parameters that do not fit, a batch of another model.
    let batch = mlp
        .prepare(&[Sample::classification(vec![0.0, 1.0], 2)])
        .unwrap();
    let mut params = Params {
        dense: mlp.init_dense(0),
        sparse: HashMap::new(),
    };
    assert!(mlp.forward_backward(&params, &batch).is_ok());
    params.dense[1].pop();
    assert!(matches!(
        mlp.forward_backward(&params, &batch),
        Err(Error::ParamSize { .. })
    ));
    params.dense.pop();
    assert!(matches!(
        mlp.evaluate(&params, &batch),
        Err(Error::ParamCount { .. })
    ));
    assert!(matches!(
        fit.forward_backward(
            &Params {
                dense: fit.init_dense(0),
                ..Params::default()
            },
            &batch
        ),
        Err(Error::BatchMismatch { .. })
    ));
    // Non-finite parameters give a typed error rather than NaN gradients.
    let mut bad = Params {
        dense: mlp.init_dense(0),
        sparse: HashMap::new(),
    };
    bad.dense[3][0] = f32::NAN;
    assert!(matches!(
        mlp.forward_backward(&bad, &batch),
        Err(Error::NonFiniteLoss { .. })
    ));

    let w2v = build(&ModelSpec::Word2vec {
        vocab_size: 10,
        dim: 4,
        window: 2,
        negatives: 2,
        sampler: NegativeSampler::Uniform,
        seed: 0,
    })
    .unwrap();
    let e = w2v.prepare(&[Sample::sparse(vec![1, 10])]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "sample 0 has sparse id 10, model word2vec has a vocabulary of 10"
    );
    assert!(matches!(
        w2v.prepare(&[Sample::regression(vec![1.0], 0.0)]),
        Err(Error::FeatureCount { expected: 0, .. })
    ));
    assert!(matches!(
        w2v.prepare(&[Sample::sparse(vec![3])]),
        Err(Error::EmptyBatch { .. })
    ));
    let batch = w2v.prepare(&[Sample::sparse(vec![1, 2, 3])]).unwrap();
    assert!(matches!(
        w2v.forward_backward(&Params::default(), &batch),
        Err(Error::MissingSparseRow { .. })
    ));
}

#[test]
fn init_is_deterministic_and_sparse_rows_lazy() {
    let mlp = build(&ModelSpec::MnistMlp).unwrap();
    assert_eq!(mlp.init_dense(1), mlp.init_dense(1));
    assert_ne!(mlp.init_dense(1), mlp.init_dense(2));
    let names: Vec<String> = mlp.dense_params().into_iter().map(|p| p.name).collect();
    assert_eq!(names, ["fc0.w", "fc0.b", "fc1.w", "fc1.b"]);
    let w = &mlp.init_dense(1)[0];
    let bound = (6.0f32 / 784.0).sqrt();
    assert!(w.iter().all(|v| v.abs() <= bound));
    assert!(w.iter().any(|v| v.abs() > 0.9 * bound));

    let w2v = build(&ModelSpec::Word2vec {
        vocab_size: 1_000_000,
        dim: 8,
        window: 2,
        negatives: 2,
        sampler: NegativeSampler::Zipf,
        seed: 0,
    })
    .unwrap();
    let r = w2v.init_sparse_row(INPUT_TABLE, 123_456, 9);
    assert_eq!(r, w2v.init_sparse_row(INPUT_TABLE, 123_456, 9));
    assert_ne!(r, w2v.init_sparse_row(INPUT_TABLE, 123_457, 9));
    assert!(r.iter().all(|v| v.abs() <= 0.5 / 8.0));
    assert_eq!(w2v.init_sparse_row(OUTPUT_TABLE, 5, 9), vec![0.0; 8]);
    assert!(w2v.init_sparse_row("nope", 5, 9).is_empty());
    // Same batch and seed: same negatives; another seed: others.
    let s = [Sample::sparse(vec![1, 2, 3, 4, 5])];
    let rows = |seed| w2v.sparse_rows(&w2v.prepare_seeded(&s, seed).unwrap());
    assert_eq!(rows(1), rows(1));
    assert_ne!(rows(1), rows(2));
    // Zipf draws favour small (frequent) ids.
    let out = &rows(3)[1].1;
    assert!(out.iter().filter(|&&id| id < 1000).count() > 3, "{out:?}");
}

#[test]
fn local_training_is_deterministic_from_its_seed() {
    let samples = random_dense(40, 4, 8, |i| Sample::classification(vec![], (i % 2) as u32));
    let spec = ModelSpec::Mlp {
        inputs: 4,
        hidden: vec![8],
        classes: 2,
        standardize: false,
        stats: None,
        init: Default::default(),
    };
    let model = build(&spec).unwrap();
    let cfg = LocalConfig {
        epochs: 3,
        batch_size: 8,
        lr: 0.01,
        ..LocalConfig::default()
    };
    let a = train_local(model.as_ref(), &samples, &samples, &cfg).unwrap();
    let b = train_local(model.as_ref(), &samples, &samples, &cfg).unwrap();
    assert_eq!(a.step_loss, b.step_loss);
    assert_eq!(a.params, b.params);
    let c = train_local(
        model.as_ref(),
        &samples,
        &samples,
        &LocalConfig { seed: 1, ..cfg },
    )
    .unwrap();
    assert_ne!(a.params, c.params);
    // Bad configurations are errors, not panics.
    for bad in [
        LocalConfig {
            batch_size: 0,
            ..LocalConfig::default()
        },
        LocalConfig {
            lr: f32::NAN,
            ..LocalConfig::default()
        },
        LocalConfig {
            optimizer: OptimizerKind::Adam {
                beta1: 1.0,
                beta2: 0.9,
                eps: 1e-8,
                weight_decay: 0.0,
            },
            ..LocalConfig::default()
        },
    ] {
        assert!(matches!(
            train_local(model.as_ref(), &samples, &samples, &bad),
            Err(Error::Config(_))
        ));
    }
    assert!(matches!(
        train_local(model.as_ref(), &[], &samples, &cfg),
        Err(Error::Config(_))
    ));
}

#[test]
fn non_finite_gradients_are_told_apart() {
    use crate::model::{SparseGrad, StepOutput};
    let mut out = StepOutput {
        loss: 1.0,
        examples: 2,
        dense: vec![vec![0.5, -1.0]],
        sparse: vec![SparseGrad {
            table: "emb".into(),
            rows: vec![3],
            dim: 2,
            values: vec![0.1, 0.2],
        }],
    };
    assert!(out.gradients_finite());
    out.sparse[0].values[1] = f32::NAN;
    assert!(!out.gradients_finite(), "a NaN sparse gradient");
    out.sparse[0].values[1] = 0.0;
    out.dense[0][0] = f32::INFINITY;
    assert!(
        !out.gradients_finite(),
        "an infinite dense gradient with a finite loss"
    );
}
