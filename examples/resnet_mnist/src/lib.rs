//! A model of its own for edl: a small residual convolutional net on 28x28 digits, written
//! against `edl_trainer::Model` on candle, with no batch normalisation (a trainer computes
//! gradients of parameters it does not keep, so layers with running state do not fit).
//!
//! ```text
//! x [n,1,28,28] -> conv3x3(1->w) relu -> avgpool2             [n,w,14,14]
//!   -> h + conv3x3(w->w)(relu(conv3x3(w->w)(h))), relu         (residual block)
//!   -> avgpool2                                                [n,w,7,7]
//!   -> h + conv3x3(w->w)(relu(conv3x3(w->w)(h))), relu         (residual block)
//!   -> flatten [n,49w] -> fc (49w->10) -> softmax cross-entropy
//! ```
//!
//! The second convolution of each block starts at zero, so each block starts as the
//! identity (the "fixup" way of training residual nets without normalisation).

use candle_core::{D, DType, Device, Tensor, Var};
use edl_trainer::{
    Batch, DenseParam, Error, EvalOutput, Label, MetricKind, Model, Params, Result, Sample,
    SparseTable, StepOutput,
};

/// Channels of every convolution by default.
pub const DEFAULT_WIDTH: usize = 12;
const SIDE: usize = 28;
const PIXELS: usize = SIDE * SIDE;
const CLASSES: usize = 10;

/// The model: its width and its device.
#[derive(Debug, Clone)]
pub struct ResMnist {
    width: usize,
    device: Device,
    params: Vec<DenseParam>,
}

/// A prepared batch: images `[n,1,28,28]` on the device, labels `[n]` and on the host.
#[derive(Debug)]
struct Digits {
    x: Tensor,
    y: Tensor,
    labels: Vec<u32>,
}

impl ResMnist {
    /// A model with `width` channels, computing on `device`.
    pub fn new(width: usize, device: &Device) -> Result<ResMnist> {
        if width == 0 {
            return Err(Error::Model("width must be positive".into()));
        }
        let w = width;
        let conv = |name: &str, cin: usize| DenseParam {
            name: name.into(),
            shape: vec![w, cin, 3, 3],
        };
        let bias = |name: &str, n: usize| DenseParam {
            name: name.into(),
            shape: vec![n],
        };
        let params = vec![
            conv("stem.w", 1),
            bias("stem.b", w),
            conv("block1.conv1.w", w),
            bias("block1.conv1.b", w),
            conv("block1.conv2.w", w),
            bias("block1.conv2.b", w),
            conv("block2.conv1.w", w),
            bias("block2.conv1.b", w),
            conv("block2.conv2.w", w),
            bias("block2.conv2.b", w),
            DenseParam {
                name: "fc.w".into(),
                shape: vec![CLASSES, w * 49],
            },
            bias("fc.b", CLASSES),
        ];
        Ok(ResMnist {
            width,
            device: device.clone(),
            params,
        })
    }

    /// The logits `[n,10]` for images `x` with parameters `p` (in `dense_params` order).
    fn forward(&self, p: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor> {
        let conv = |x: &Tensor, w: &Tensor, b: &Tensor| -> candle_core::Result<Tensor> {
            x.conv2d(w, 1, 1, 1, 1)?
                .broadcast_add(&b.reshape((1, self.width, 1, 1))?)
        };
        let block = |h: &Tensor, i: usize| -> candle_core::Result<Tensor> {
            let inner = conv(h, &p[i], &p[i + 1])?.relu()?;
            (h + conv(&inner, &p[i + 2], &p[i + 3])?)?.relu()
        };
        let h = conv(x, &p[0], &p[1])?.relu()?.avg_pool2d(2)?;
        let h = block(&h, 2)?.avg_pool2d(2)?;
        let h = block(&h, 6)?.flatten_from(1)?;
        h.matmul(&p[10].t()?)?.broadcast_add(&p[11])
    }

    fn digits<'a>(&self, batch: &'a Batch) -> Result<&'a Digits> {
        batch
            .data::<Digits>()
            .ok_or_else(|| Error::Model("the batch was not prepared by resnet-mnist".into()))
    }

    fn tensors(&self, params: &Params) -> Result<Vec<Tensor>> {
        if params.dense.len() != self.params.len() {
            return Err(Error::Model(format!(
                "{} dense parameters given, the model has {}",
                params.dense.len(),
                self.params.len()
            )));
        }
        Ok(self
            .params
            .iter()
            .zip(&params.dense)
            .map(|(p, v)| Tensor::from_slice(v, p.shape.as_slice(), &self.device))
            .collect::<candle_core::Result<Vec<_>>>()?)
    }
}

impl Model for ResMnist {
    fn name(&self) -> &str {
        "resnet-mnist"
    }

    fn dense_params(&self) -> Vec<DenseParam> {
        self.params.clone()
    }

    fn sparse_tables(&self) -> Vec<SparseTable> {
        Vec::new()
    }

    /// He-normal convolutions (the second of each block zero), small fc, zero biases;
    /// deterministic from `seed`.
    fn init_dense(&self, seed: u64) -> Vec<Vec<f32>> {
        let mut rng = SplitMix(seed ^ 0x005e_ed0f_4e57);
        self.params
            .iter()
            .map(|p| {
                let n: usize = p.shape.iter().product();
                let fan_in: usize = p.shape[1..].iter().product::<usize>().max(1);
                let std = match p.name.as_str() {
                    name if name.ends_with(".b") || name.ends_with("conv2.w") => 0.0,
                    "fc.w" => (1.0 / fan_in as f64).sqrt(),
                    _ => (2.0 / fan_in as f64).sqrt(),
                };
                (0..n).map(|_| (rng.normal() * std) as f32).collect()
            })
            .collect()
    }

    fn init_sparse_row(&self, _table: &str, _row: u64, _seed: u64) -> Vec<f32> {
        Vec::new()
    }

    /// Samples of 784 pixel values in [0, 1] and a class id 0..10 (`edl data convert
    /// --format mnist-csv`); anything else is a bad record, named.
    fn prepare(&self, samples: &[Sample]) -> Result<Batch> {
        if samples.is_empty() {
            return Err(Error::BadRecord {
                index: 0,
                reason: "empty batch".into(),
            });
        }
        let mut x = Vec::with_capacity(samples.len() * PIXELS);
        let mut labels = Vec::with_capacity(samples.len());
        for (index, s) in samples.iter().enumerate() {
            let bad = |reason: String| Error::BadRecord { index, reason };
            if s.dense.len() != PIXELS {
                return Err(bad(format!("{} pixels, expected {PIXELS}", s.dense.len())));
            }
            if let Some(v) = s.dense.iter().find(|v| !v.is_finite()) {
                return Err(bad(format!("pixel value {v}")));
            }
            let label = match s.label {
                Some(Label::ClassId(c)) if (c as usize) < CLASSES => c,
                other => return Err(bad(format!("label {other:?} is not a class id 0..10"))),
            };
            x.extend_from_slice(&s.dense);
            labels.push(label);
        }
        let n = samples.len();
        let digits = Digits {
            x: Tensor::from_vec(x, (n, 1, SIDE, SIDE), &self.device)?,
            y: Tensor::from_slice(&labels, n, &self.device)?,
            labels,
        };
        Ok(Batch::new(n, digits))
    }

    fn sparse_rows(&self, _batch: &Batch) -> Vec<(String, Vec<u64>)> {
        Vec::new()
    }

    fn forward_backward(&self, params: &Params, batch: &Batch) -> Result<StepOutput> {
        let d = self.digits(batch)?;
        let vars = self
            .tensors(params)?
            .into_iter()
            .map(|t| Var::from_tensor(&t))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let p: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let loss = candle_nn::loss::cross_entropy(&self.forward(&p, &d.x)?, &d.y)?;
        let value = loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let grads = loss.backward()?;
        let dense = vars
            .iter()
            .zip(&self.params)
            .map(|(v, p)| match grads.get(v.as_tensor()) {
                Some(g) => g.flatten_all()?.to_vec1::<f32>(),
                None => Ok(vec![0.0; p.shape.iter().product()]),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(StepOutput {
            loss: value,
            examples: batch.len(),
            dense,
            sparse: Vec::new(),
        })
    }

    fn evaluate(&self, params: &Params, batch: &Batch) -> Result<EvalOutput> {
        let d = self.digits(batch)?;
        let logits = self.forward(&self.tensors(params)?, &d.x)?;
        let mean = candle_nn::loss::cross_entropy(&logits, &d.y)?.to_scalar::<f32>()?;
        let predicted = logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
        let correct = predicted
            .iter()
            .zip(&d.labels)
            .filter(|(p, y)| p == y)
            .count();
        Ok(EvalOutput {
            loss_sum: f64::from(mean) * d.labels.len() as f64,
            count: d.labels.len() as u64,
            correct: correct as u64,
        })
    }

    fn metric(&self) -> MetricKind {
        MetricKind::Accuracy
    }
}

/// A small seeded generator (SplitMix64) with Box-Muller normals.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn uniform(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

#[cfg(test)]
mod tests;
