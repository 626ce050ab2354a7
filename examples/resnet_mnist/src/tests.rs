use edl_trainer::{LocalConfig, OptimizerKind, train_local};

use super::*;

fn digits(n: usize) -> Vec<Sample> {
    // Synthetic "digits": class c lights up a 4x4 patch at a class-specific place.
    (0..n)
        .map(|i| {
            let c = (i % CLASSES) as u32;
            let mut px = vec![0.0f32; PIXELS];
            let (r0, c0) = (2 + (c as usize / 5) * 12, 2 + (c as usize % 5) * 5);
            for r in r0..r0 + 4 {
                for col in c0..c0 + 4 {
                    px[r * SIDE + col] = 0.5 + 0.5 * ((i * 7 + r + col) % 3) as f32 / 2.0;
                }
            }
            Sample::classification(px, c)
        })
        .collect()
}

#[test]
fn gradients_match_finite_differences() {
    // (This is how candle's max_pool2d was found to pass the gradient to every tied
    // maximum, the zeros after a ReLU among them: the model pools by averaging.)
    let model = ResMnist::new(3, &Device::Cpu).unwrap();
    let batch = model.prepare(&digits(4)).unwrap();
    let mut params = Params {
        dense: model.init_dense(1),
        ..Params::default()
    };
    // Non-zero second convolutions and biases, so every gradient is exercised.
    for v in params.dense.iter_mut().flatten() {
        if *v == 0.0 {
            *v = 0.01;
        }
    }
    let out = model.forward_backward(&params, &batch).unwrap();
    let loss = |p: &Params| {
        let e = model.evaluate(p, &batch).unwrap();
        e.loss_sum / e.count as f64
    };
    let eps = 1e-2f32;
    for (i, p) in model.dense_params().iter().enumerate() {
        for j in [0, p.shape.iter().product::<usize>() / 2] {
            let mut plus = params.clone();
            plus.dense[i][j] += eps;
            let mut minus = params.clone();
            minus.dense[i][j] -= eps;
            let numeric = (loss(&plus) - loss(&minus)) / (2.0 * f64::from(eps));
            let analytic = f64::from(out.dense[i][j]);
            assert!(
                (numeric - analytic).abs() <= 5e-3 + 0.1 * numeric.abs(),
                "{}[{j}]: numeric {numeric}, analytic {analytic}",
                p.name
            );
        }
    }
}

#[test]
fn bad_records_are_named_and_a_small_set_is_learnt() {
    let model = ResMnist::new(4, &Device::Cpu).unwrap();
    let mut bad = digits(3);
    bad[1].dense.pop();
    match model.prepare(&bad) {
        Err(e @ Error::BadRecord { index: 1, .. }) => assert!(e.is_bad_data()),
        other => panic!("expected record 1 to be bad, got {other:?}"),
    }
    let data = digits(200);
    let cfg = LocalConfig {
        epochs: 8,
        batch_size: 20,
        lr: 0.01,
        optimizer: OptimizerKind::adam(),
        ..LocalConfig::default()
    };
    let report = train_local(&model, &data, &data, &cfg).unwrap();
    assert!(
        report.final_metric >= 0.95,
        "accuracy {}",
        report.final_metric
    );
}
