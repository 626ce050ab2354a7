//! Tests of the dense models (`dense.rs`).

use super::*;
use crate::rng::SplitMix64;

fn random(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = SplitMix64::new(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.symmetric(1.0)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// The im2col convolution and the gather pooling compute what candle's `conv2d` and
/// `max_pool2d` compute (in NCHW).
#[test]
fn conv_and_pool_match_candle_reference() {
    let dev = Device::Cpu;
    let (n, c_in, c_out, side, k) = (2, 3, 4, 8, 3);
    let x_nchw = random(&[n, c_in, side, side], 1);
    let kernel = random(&[c_out, c_in, k, k], 2);
    let bias = random(&[c_out], 3);
    let reference = x_nchw
        .conv2d(&kernel, 0, 1, 1, 1)
        .unwrap()
        .broadcast_add(&bias.reshape((1, c_out, 1, 1)).unwrap())
        .unwrap()
        .relu()
        .unwrap();
    let conv = Conv::new(c_in, c_out, side, side, k, &dev).unwrap();
    let x_nhwc = x_nchw
        .permute((0, 2, 3, 1))
        .unwrap()
        .flatten_from(1)
        .unwrap();
    let patches = conv.patches(&x_nhwc).unwrap();
    let ours = conv.forward_relu(&patches, &kernel, &bias).unwrap();
    // Host im2col gives the same patches.
    let mut host = Vec::new();
    for image in x_nhwc.to_vec2::<f32>().unwrap() {
        conv.im2col_host(&image, &mut host);
    }
    assert_eq!(
        host,
        patches.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    );
    let ours_nchw = ours.permute((0, 3, 1, 2)).unwrap();
    let diff = max_abs_diff(&reference, &ours_nchw);
    assert!(diff < 1e-5, "conv differs by {diff}");

    let pooled = max_pool_2x2(&ours).unwrap().permute((0, 3, 1, 2)).unwrap();
    let reference = reference.max_pool2d(2).unwrap();
    let diff = max_abs_diff(&reference, &pooled);
    assert!(diff < 1e-6, "pool differs by {diff}");
}

/// The fully connected step on the CPU (`fc_cpu`) computes what candle's autograd
/// computes: loss, every gradient, and the evaluation, for classifiers with and without
/// hidden layers and for regression.
#[test]
fn the_cpu_fully_connected_step_matches_candles_autograd() {
    let specs = [
        ModelSpec::Mlp {
            inputs: 13,
            hidden: vec![16, 8],
            classes: 3,
            standardize: false,
            stats: None,
            init: Default::default(),
        },
        ModelSpec::Mlp {
            inputs: 7,
            hidden: vec![],
            classes: 4,
            standardize: false,
            stats: None,
            init: Default::default(),
        },
        ModelSpec::Linear {
            inputs: 5,
            standardize: false,
            stats: None,
        },
    ];
    for (k, spec) in specs.iter().enumerate() {
        let model = DenseModel::new(spec, &Device::Cpu, DType::F32).unwrap();
        assert!(model.fc_cpu.is_some(), "{spec:?} runs the fast path");
        let mut rng = SplitMix64::new(k as u64);
        // Initial weights, and biases that are not zero.
        let mut params = Params {
            dense: model.init_dense(k as u64),
            ..Default::default()
        };
        for (p, v) in model.params.iter().zip(&mut params.dense) {
            if p.shape.len() == 1 {
                v.iter_mut().for_each(|b| *b = rng.symmetric(0.5));
            }
        }
        let samples: Vec<Sample> = (0..37)
            .map(|i| {
                let x: Vec<f32> = (0..model.inputs).map(|_| rng.symmetric(2.0)).collect();
                match model.task {
                    Task::Regression => Sample::regression(x, rng.symmetric(3.0)),
                    Task::Classification { classes } => {
                        Sample::classification(x, (i % classes) as u32)
                    }
                }
            })
            .collect();
        let batch = model.prepare(&samples).unwrap();
        let (x, target) = model.batch_parts(&batch).unwrap();
        let fast = model.forward_backward(&params, &batch).unwrap();
        let reference = model
            .forward_backward_candle(&params, x, target, &batch)
            .unwrap();
        assert!(
            (fast.loss - reference.loss).abs() <= 1e-5 * reference.loss.abs().max(1.0),
            "{spec:?}: loss {} vs {}",
            fast.loss,
            reference.loss
        );
        assert_eq!(fast.dense.len(), reference.dense.len());
        for (p, (a, b)) in model
            .params
            .iter()
            .zip(fast.dense.iter().zip(&reference.dense))
        {
            assert_eq!(a.len(), b.len(), "{}", p.name);
            for (i, (u, v)) in a.iter().zip(b).enumerate() {
                assert!(
                    (u - v).abs() <= 1e-5 * (1.0 + v.abs()),
                    "{spec:?} {}[{i}]: {u} vs {v}",
                    p.name
                );
            }
        }
        let fast = model.evaluate(&params, &batch).unwrap();
        let reference = model.evaluate_candle(&params, x, target, &batch).unwrap();
        assert!((fast.loss_sum - reference.loss_sum).abs() <= 1e-4 * reference.loss_sum.abs());
        assert_eq!(
            (fast.count, fast.correct),
            (reference.count, reference.correct)
        );
    }
}

/// `mnist_cnn` as it runs on a GPU (the images in the batch, the first convolution's
/// patches gathered on the device), run here on the CPU, against the host's patches: the
/// same loss, gradients and evaluation.
#[test]
fn the_cnn_with_patches_on_the_device_is_the_cnn_with_host_patches() {
    let host = DenseModel::new(&ModelSpec::MnistCnn, &Device::Cpu, DType::F32).unwrap();
    assert!(
        !host.conv0_on_device,
        "the CPU builds the patches on the host"
    );
    let mut device = DenseModel::new(&ModelSpec::MnistCnn, &Device::Cpu, DType::F32).unwrap();
    device.conv0_on_device = true;
    let samples: Vec<Sample> = crate::testdata::mnist().into_iter().take(24).collect();
    let params = Params {
        dense: host.init_dense(5),
        ..Default::default()
    };
    let (hb, db) = (
        host.prepare(&samples).unwrap(),
        device.prepare(&samples).unwrap(),
    );
    let (hx, _) = host.batch_parts(&hb).unwrap();
    let (dx, _) = device.batch_parts(&db).unwrap();
    assert_eq!(hx.dims(), &[24 * 24 * 24, 25], "host patches");
    assert_eq!(dx.dims(), &[24, 784], "images");
    let (a, b) = (
        host.forward_backward(&params, &hb).unwrap(),
        device.forward_backward(&params, &db).unwrap(),
    );
    assert!(
        (a.loss - b.loss).abs() <= 1e-5 * a.loss.abs(),
        "{} vs {}",
        a.loss,
        b.loss
    );
    assert_eq!(a.dense.len(), host.params.len());
    assert_eq!(a.dense.len(), b.dense.len());
    for (p, (u, v)) in host.params.iter().zip(a.dense.iter().zip(&b.dense)) {
        assert_eq!(u.len(), v.len(), "{}", p.name);
        assert!(u.iter().any(|g| *g != 0.0), "{} has a gradient", p.name);
        for (i, (u, v)) in u.iter().zip(v).enumerate() {
            assert!(
                (u - v).abs() <= 1e-5 * (1.0 + v.abs()),
                "{}[{i}]: {u} vs {v}",
                p.name
            );
        }
    }
    let (a, b) = (
        host.evaluate(&params, &hb).unwrap(),
        device.evaluate(&params, &db).unwrap(),
    );
    assert_eq!((a.count, a.correct), (b.count, b.correct));
    assert!((a.loss_sum - b.loss_sum).abs() <= 1e-4 * a.loss_sum.abs());
}

/// The largest absolute difference between two tensors of one shape.
fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// What a batch holds, on the host: the features, then the targets.
fn batch_host(b: &Batch) -> (Vec<f32>, Vec<f32>) {
    let BatchData::Dense { x, target } = &b.data else {
        panic!("a dense batch");
    };
    let y = match target {
        Target::Values(t) => t.to_vec1::<f32>().unwrap(),
        Target::Classes { ids, .. } => ids.iter().map(|&c| c as f32).collect(),
    };
    (x.flatten_all().unwrap().to_vec1::<f32>().unwrap(), y)
}

/// Records read in place ([`edl_proto::sample::view`]) make the batch, and the errors,
/// that the same samples decoded make: standardised or not, regression or classes, and
/// with a record in a layout read by the full decoder among them.
#[test]
fn records_read_in_place_make_the_batch_decoded_samples_make() {
    use edl_job::model::{ModelSpec, Stats};
    use edl_proto::sample::{encode, view};
    let fit = crate::spec::build(&ModelSpec::FitALine {
        standardize: true,
        stats: Some(Stats {
            mean: (0..13).map(|i| i as f32 * 0.1).collect(),
            std: (0..13).map(|i| 1.0 + i as f32).collect(),
        }),
    })
    .unwrap();
    let mlp = crate::spec::build(&ModelSpec::Mlp {
        inputs: 4,
        hidden: vec![3],
        classes: 3,
        standardize: false,
        stats: None,
        init: Default::default(),
    })
    .unwrap();
    let mut rng = SplitMix64::new(7);
    let mut feats = |n: usize| (0..n).map(|_| rng.symmetric(5.0)).collect::<Vec<f32>>();
    let lines: Vec<Sample> = (0..9)
        .map(|i| Sample::regression(feats(13), i as f32))
        .collect();
    let classes: Vec<Sample> = (0..7)
        .map(|i| Sample::classification(feats(4), i % 3))
        .collect();
    for (model, samples) in [(&fit, &lines), (&mlp, &classes)] {
        let mut records: Vec<Vec<u8>> = samples.iter().map(encode).collect();
        assert!(records.iter().all(|r| view(r).is_some()), "read in place");
        // The second sample's features in two packed fields: decoded, not read in place.
        let s = &samples[1];
        let (a, b) = s.dense.split_at(2);
        let mut split = encode(&Sample {
            dense: a.to_vec(),
            label: None,
            ..s.clone()
        });
        split.extend_from_slice(&encode(&Sample {
            dense: b.to_vec(),
            ..s.clone()
        }));
        assert!(view(&split).is_none());
        records[1] = split;
        let want = batch_host(&model.prepare(samples).unwrap());
        let got = batch_host(&model.prepare_records(&records, 0).unwrap());
        assert_eq!(got, want);
        assert_eq!(got.1.len(), samples.len());

        // Each kind of bad sample: the same error either way.
        let mut nan = samples.to_vec();
        nan[2].dense[3] = f32::NAN;
        let mut short = samples.to_vec();
        short[3].dense.pop();
        let mut unlabelled = samples.to_vec();
        unlabelled[4].label = None;
        for bad in [nan, short, unlabelled] {
            let records: Vec<Vec<u8>> = bad.iter().map(encode).collect();
            let want = model.prepare(&bad).unwrap_err().to_string();
            let got = model.prepare_records(&records, 0).unwrap_err().to_string();
            assert_eq!(got, want);
        }
        let mut garbage: Vec<Vec<u8>> = samples.iter().map(encode).collect();
        garbage[5] = vec![0xff, 0xff, 0xff];
        assert!(matches!(
            model.prepare_records(&garbage, 0),
            Err(Error::BadRecord { index: 5, .. })
        ));
    }
}

/// `init = "xavier"` starts every layer from Xavier's bound (Paddle's `fc` default); the
/// default starts layers before a ReLU from He's, larger.
#[test]
fn weight_init_follows_the_spec() {
    use edl_job::model::{ModelSpec, WeightInit};
    let spec = |init| ModelSpec::Mlp {
        inputs: 784,
        hidden: vec![512],
        classes: 10,
        standardize: false,
        stats: None,
        init,
    };
    let bound = |init| {
        let m = crate::spec::build(&spec(init)).unwrap();
        let w = m.init_dense(5);
        let max = |v: &Vec<f32>| v.iter().fold(0f32, |a, x| a.max(x.abs()));
        (max(&w[0]), max(&w[2]))
    };
    let (he0, he1) = bound(WeightInit::Kaiming);
    let (xa0, xa1) = bound(WeightInit::Xavier);
    let (he, xa) = ((6.0f32 / 784.0).sqrt(), (6.0f32 / (784.0 + 512.0)).sqrt());
    assert!(he0 <= he && he0 > 0.99 * he, "{he0} against {he}");
    assert!(xa0 <= xa && xa0 > 0.99 * xa, "{xa0} against {xa}");
    // The output layer is Xavier's either way.
    assert_eq!(he1, xa1);
    let parsed: ModelSpec = serde_json::from_str(
        r#"{"kind": "mlp", "inputs": 2, "hidden": [3], "classes": 2, "init": "xavier"}"#,
    )
    .unwrap();
    assert!(matches!(
        parsed,
        ModelSpec::Mlp {
            init: WeightInit::Xavier,
            ..
        }
    ));
}

/// A short batch's gradients weigh its part of a full batch; full batches, and the loss,
/// are left as they are.
#[test]
fn a_short_batch_weighs_its_part_of_a_full_one() {
    use crate::model::{SparseGrad, StepOutput};
    let step = || StepOutput {
        loss: 2.0,
        examples: 16,
        dense: vec![vec![4.0, -8.0], vec![1.0]],
        sparse: vec![SparseGrad {
            table: "t".into(),
            rows: vec![3],
            dim: 2,
            values: vec![2.0, 6.0],
        }],
    };
    let mut s = step();
    s.weigh_partial(16, 64);
    assert_eq!(s.dense, vec![vec![1.0, -2.0], vec![0.25]]);
    assert_eq!(s.sparse[0].values, vec![0.5, 1.5]);
    assert_eq!(s.loss, 2.0);
    for (records, size) in [(64, 64), (70, 64), (0, 64)] {
        let mut s = step();
        s.weigh_partial(records, size);
        assert_eq!(s.dense, step().dense);
    }
}
