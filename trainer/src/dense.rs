//! [`DenseModel`]: the models over dense features with dense parameters only —
//! `fit_a_line`, `linear`, `mlp`, `mnist_mlp` (fully connected) and `mnist_cnn`
//! (convolutional).

use candle_core::{D, DType, Device, Tensor, Var};
use edl_proto::sample::Sample;

use crate::error::{Error, Result};
use crate::fc_cpu;
use crate::model::{
    Batch, BatchData, DenseParam, EvalOutput, MetricKind, Model, Params, SparseTable, StepOutput,
    Target,
};
use crate::rng::{SplitMix64, hash_str, mix};
use edl_job::model::{ModelSpec, Stats, WeightInit};
use rows::{Parsed, Row};

/// MNIST images are 28x28 = 784 pixels.
const MNIST_SIDE: usize = 28;
const MNIST_PIXELS: usize = MNIST_SIDE * MNIST_SIDE;

/// What the network predicts and how it is scored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Task {
    /// One real output, mean squared error (PaddlePaddle's `square_error_cost` + `mean`).
    Regression,
    /// `classes` logits, softmax cross-entropy.
    Classification { classes: usize },
}

/// The network's shape.
#[derive(Debug, Clone)]
enum Arch {
    /// Fully connected layers `fc{i}` (`w: [in, out]`, `b: [out]`), ReLU between them.
    Fc { layers: usize },
    /// `conv0` (20 filters 5x5) - ReLU - maxpool 2x2, `conv1` (50 filters 5x5) - ReLU -
    /// maxpool 2x2, `fc0` 800 -> 10; see [`Conv`] for the layout.
    MnistCnn { conv0: Conv, conv1: Conv },
}

/// A valid (no padding), stride-1 convolution computed as im2col + one matmul, with
/// activations in NHWC layout `[n, h, w, c]` flattened to `[n, h * w * c]`.
///
/// The kernel parameter keeps the usual `[c_out, c_in, k, k]` layout; patches are laid
/// out `(ky, kx, ci)` so that each gathered piece is a run of `c_in` contiguous values.
/// candle 0.11's `conv2d` is correct but slow on the CPU in training (its backward runs a
/// naive transposed convolution, also for the input image, which needs no gradient);
/// gathering patches with `index_select` (whose backward is an `index_add`) and
/// multiplying them with the kernel is an order of magnitude faster and stays within
/// candle's autograd. On the CPU the first layer's patches are built on the host in
/// [`Model::prepare`], since the image needs no gradient; on another device (a GPU) the
/// batch holds the images and the patches are gathered there: 784 values an image to
/// make on the host and upload instead of 24 * 24 * 25 = 14,400.
#[derive(Debug, Clone)]
struct Conv {
    c_in: usize,
    c_out: usize,
    k: usize,
    out_h: usize,
    out_w: usize,
    /// For output position `(y, x)` and kernel offset `(ky, kx)` (in that order), the
    /// input position `(y + ky) * w + x + kx`.
    positions: Vec<u32>,
    /// `positions` as a u32 tensor.
    index: Tensor,
}

impl Conv {
    fn new(
        c_in: usize,
        c_out: usize,
        h: usize,
        w: usize,
        k: usize,
        device: &Device,
    ) -> Result<Self> {
        let (out_h, out_w) = (h + 1 - k, w + 1 - k);
        let mut positions = Vec::with_capacity(out_h * out_w * k * k);
        for y in 0..out_h {
            for x in 0..out_w {
                for ky in 0..k {
                    for kx in 0..k {
                        positions.push(((y + ky) * w + x + kx) as u32);
                    }
                }
            }
        }
        let index = Tensor::from_slice(&positions, positions.len(), device)?;
        Ok(Conv {
            c_in,
            c_out,
            k,
            out_h,
            out_w,
            positions,
            index,
        })
    }

    /// Values per patch.
    fn patch(&self) -> usize {
        self.k * self.k * self.c_in
    }

    /// Host im2col of one NHWC image into `out` (`out_h * out_w * patch` values).
    fn im2col_host(&self, image: &[f32], out: &mut Vec<f32>) {
        let c = self.c_in;
        if c == 1 {
            out.extend(self.positions.iter().map(|&p| image[p as usize]));
            return;
        }
        for &p in &self.positions {
            let start = p as usize * c;
            out.extend_from_slice(&image[start..start + c]);
        }
    }

    /// im2col in the graph: `x: [n, h * w * c_in]` to `[n * out_h * out_w, patch]`.
    fn patches(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let n = x.dim(0)?;
        x.reshape((n, (), self.c_in))?
            .index_select(&self.index, 1)?
            .reshape((n * self.out_h * self.out_w, self.patch()))
    }

    /// `relu(patches * kernel + b)` as `[n, out_h, out_w, c_out]`.
    fn forward_relu(
        &self,
        patches: &Tensor,
        kernel: &Tensor,
        bias: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let n = patches.dim(0)? / (self.out_h * self.out_w);
        // [c_out, c_in, k, k] -> [c_out, k, k, c_in], the patch order.
        let kernel = kernel
            .permute((0, 2, 3, 1))?
            .reshape((self.c_out, self.patch()))?;
        patches
            .matmul(&kernel.t()?)?
            .broadcast_add(bias)?
            .relu()?
            .reshape((n, self.out_h, self.out_w, self.c_out))
    }
}

/// How a parameter is initialised.
#[derive(Debug, Clone, Copy)]
enum Init {
    Zeros,
    /// Uniform in `[-a, a)`.
    Uniform(f64),
}

/// A model over dense features; see [`ModelSpec`] for the kinds. A prepared batch holds
/// `x: [n, inputs]` (standardised if the spec says so), or for `mnist_cnn` on the CPU
/// the first convolution's patches `[n * 24 * 24, 25]` (`conv0_on_device`).
#[derive(Debug)]
pub(crate) struct DenseModel {
    kind: &'static str,
    inputs: usize,
    task: Task,
    arch: Arch,
    params: Vec<DenseParam>,
    inits: Vec<Init>,
    /// `(mean, 1/std)` per feature, when standardising.
    standardize: Option<(Vec<f32>, Vec<f32>)>,
    /// The layer widths (inputs, hidden..., outputs) of a fully connected network on
    /// the CPU in f32: its steps run [`crate::fc_cpu`] instead of candle's autograd.
    fc_cpu: Option<Vec<usize>>,
    /// `mnist_cnn` off the CPU: batches hold the images, and the first convolution's
    /// patches are gathered on the device.
    conv0_on_device: bool,
    device: Device,
    dtype: DType,
}

/// Kaiming (He) uniform bound for a layer followed by ReLU.
fn kaiming(fan_in: usize) -> Init {
    Init::Uniform((6.0 / fan_in as f64).sqrt())
}

/// Xavier (Glorot) uniform bound for a layer without ReLU after it.
fn xavier(fan_in: usize, fan_out: usize) -> Init {
    Init::Uniform((6.0 / (fan_in + fan_out) as f64).sqrt())
}

impl DenseModel {
    pub(crate) fn new(spec: &ModelSpec, device: &Device, dtype: DType) -> Result<Self> {
        let kind = spec.kind();
        let bad = |reason: String| Error::Spec {
            model: kind,
            reason,
        };
        let weights = match spec {
            ModelSpec::Mlp { init, .. } => *init,
            _ => WeightInit::default(),
        };
        let (inputs, hidden, task, arch): (usize, Vec<usize>, Task, Arch) = match spec {
            ModelSpec::FitALine { .. } => (13, vec![], Task::Regression, Arch::Fc { layers: 1 }),
            ModelSpec::Linear { inputs, .. } => {
                (*inputs, vec![], Task::Regression, Arch::Fc { layers: 1 })
            }
            ModelSpec::Mlp {
                inputs,
                hidden,
                classes,
                ..
            } => {
                if *classes < 2 {
                    return Err(bad(format!("classes is {classes}, must be at least 2")));
                }
                (
                    *inputs,
                    hidden.clone(),
                    Task::Classification { classes: *classes },
                    Arch::Fc {
                        layers: hidden.len() + 1,
                    },
                )
            }
            ModelSpec::MnistMlp => (
                MNIST_PIXELS,
                vec![256],
                Task::Classification { classes: 10 },
                Arch::Fc { layers: 2 },
            ),
            ModelSpec::MnistCnn => (
                MNIST_PIXELS,
                vec![],
                Task::Classification { classes: 10 },
                Arch::MnistCnn {
                    conv0: Conv::new(1, 20, MNIST_SIDE, MNIST_SIDE, 5, device)?,
                    conv1: Conv::new(20, 50, 12, 12, 5, device)?,
                },
            ),
            ModelSpec::Word2vec { .. } | ModelSpec::Ctr { .. } => {
                return Err(bad(format!("{} is not a dense model", spec.kind())));
            }
        };
        if inputs == 0 {
            return Err(bad("inputs is 0, must be positive".into()));
        }
        if let Some(i) = hidden.iter().position(|&h| h == 0) {
            return Err(bad(format!("hidden layer {i} has width 0")));
        }
        let standardize = if spec.standardize() {
            let stats: &Stats = spec.stats().ok_or_else(|| {
                bad(
                    "standardize is set but the spec has no feature stats; compute them over \
                     the training split (ModelSpec::fit_stats)"
                        .into(),
                )
            })?;
            stats.check(inputs).map_err(bad)?;
            Some((
                stats.mean.clone(),
                stats.std.iter().map(|s| 1.0 / s).collect(),
            ))
        } else {
            None
        };
        let outputs = match task {
            Task::Regression => 1,
            Task::Classification { classes } => classes,
        };
        let mut params = Vec::new();
        let mut inits = Vec::new();
        let mut push = |name: String, shape: Vec<usize>, init: Init| {
            params.push(DenseParam { name, shape });
            inits.push(init);
        };
        match arch {
            Arch::Fc { .. } => {
                let mut widths = vec![inputs];
                widths.extend(&hidden);
                widths.push(outputs);
                let last = widths.len() - 2;
                for (i, pair) in widths.windows(2).enumerate() {
                    let (fan_in, fan_out) = (pair[0], pair[1]);
                    let init = if i == last || weights == WeightInit::Xavier {
                        xavier(fan_in, fan_out)
                    } else {
                        kaiming(fan_in)
                    };
                    push(format!("fc{i}.w"), vec![fan_in, fan_out], init);
                    push(format!("fc{i}.b"), vec![fan_out], Init::Zeros);
                }
            }
            Arch::MnistCnn { .. } => {
                push("conv0.w".into(), vec![20, 1, 5, 5], kaiming(25));
                push("conv0.b".into(), vec![20], Init::Zeros);
                push("conv1.w".into(), vec![50, 20, 5, 5], kaiming(20 * 25));
                push("conv1.b".into(), vec![50], Init::Zeros);
                push("fc0.w".into(), vec![800, 10], xavier(800, 10));
                push("fc0.b".into(), vec![10], Init::Zeros);
            }
        }
        let fc_cpu = match arch {
            Arch::Fc { .. } if device.is_cpu() && dtype == DType::F32 => Some(
                std::iter::once(inputs)
                    .chain(params.iter().step_by(2).map(|p| p.shape[1]))
                    .collect(),
            ),
            _ => None,
        };
        Ok(DenseModel {
            kind,
            inputs,
            task,
            arch,
            params,
            inits,
            standardize,
            fc_cpu,
            conv0_on_device: !device.is_cpu(),
            device: device.clone(),
            dtype,
        })
    }

    /// Checks the parameter count and sizes.
    fn check_params(&self, params: &Params) -> Result<()> {
        if params.dense.len() != self.params.len() {
            return Err(Error::ParamCount {
                model: self.kind,
                found: params.dense.len(),
                expected: self.params.len(),
            });
        }
        for (p, v) in self.params.iter().zip(&params.dense) {
            if v.len() != p.len() {
                return Err(Error::ParamSize {
                    model: self.kind,
                    param: p.name.clone(),
                    found: v.len(),
                    expected: p.len(),
                });
            }
        }
        Ok(())
    }

    fn batch_parts<'a>(&self, batch: &'a Batch) -> Result<(&'a Tensor, &'a Target)> {
        match &batch.data {
            BatchData::Dense { x, target } if batch.model == self.kind => Ok((x, target)),
            _ => Err(Error::BatchMismatch {
                model: self.kind,
                batch: batch.model,
            }),
        }
    }

    /// Network outputs `[n, outputs]` from parameter tensors in the compute dtype.
    fn forward(&self, p: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor> {
        match &self.arch {
            &Arch::Fc { layers } => {
                let mut h = x.clone();
                for i in 0..layers {
                    h = h.matmul(&p[2 * i])?.broadcast_add(&p[2 * i + 1])?;
                    if i + 1 < layers {
                        h = h.relu()?;
                    }
                }
                Ok(h)
            }
            Arch::MnistCnn { conv0, conv1 } => {
                // `x` holds conv0's patches, built by `prepare`, or the images.
                let patches = match self.conv0_on_device {
                    true => conv0.patches(x)?,
                    false => x.clone(),
                };
                let h = max_pool_2x2(&conv0.forward_relu(&patches, &p[0], &p[1])?)?;
                let h = conv1.patches(&h.flatten_from(1)?)?;
                let h = max_pool_2x2(&conv1.forward_relu(&h, &p[2], &p[3])?)?;
                h.flatten_from(1)?.matmul(&p[4])?.broadcast_add(&p[5])
            }
        }
    }

    /// The mean loss over the batch.
    fn loss(&self, out: &Tensor, target: &Target) -> candle_core::Result<Tensor> {
        match target {
            Target::Values(y) => out.squeeze(1)?.sub(y)?.sqr()?.mean_all(),
            Target::Classes { tensor, .. } => candle_nn::loss::cross_entropy(out, tensor),
        }
    }
}

/// 2x2 max pooling with stride 2 of NHWC `[n, h, w, c]` (even `h`, `w`), differentiable
/// through candle's autograd as a `gather` of each window's (first) maximum.
///
/// candle 0.11's own `max_pool2d` backward scales the gradient of a window's maximum by
/// `maxima / 4` instead of `1 / maxima` (a quarter of the true gradient for a unique
/// maximum), which the gradient check catches; this formulation is exact.
fn max_pool_2x2(x: &Tensor) -> candle_core::Result<Tensor> {
    let (n, h, w, c) = x.dims4()?;
    let (ho, wo) = (h / 2, w / 2);
    let windows = x
        .reshape((n, ho, 2, wo, 2, c))?
        .permute((0, 1, 3, 5, 2, 4))?
        .reshape((n, ho, wo, c, 4))?;
    let argmax = windows.detach().argmax_keepdim(4)?;
    windows.gather(&argmax, 4)?.reshape((n, ho, wo, c))
}

impl Model for DenseModel {
    fn name(&self) -> &str {
        self.kind
    }

    fn dense_params(&self) -> Vec<DenseParam> {
        self.params.clone()
    }

    fn sparse_tables(&self) -> Vec<SparseTable> {
        Vec::new()
    }

    fn init_dense(&self, seed: u64) -> Vec<Vec<f32>> {
        self.params
            .iter()
            .zip(&self.inits)
            .map(|(p, init)| match *init {
                Init::Zeros => vec![0.0; p.len()],
                Init::Uniform(a) => {
                    let mut rng = SplitMix64::new(mix(seed, hash_str(&p.name)));
                    (0..p.len()).map(|_| rng.symmetric(a)).collect()
                }
            })
            .collect()
    }

    fn init_sparse_row(&self, _table: &str, _row: u64, _seed: u64) -> Vec<f32> {
        Vec::new()
    }

    fn prepare(&self, samples: &[Sample]) -> Result<Batch> {
        let rows: Vec<Row<'_>> = samples.iter().map(Row::of_sample).collect();
        self.prepare_rows(&rows)
    }

    /// Dense samples are read in place from their records ([`edl_proto::sample::view`]),
    /// their features copied once, into the batch; a record in another layout is decoded.
    fn prepare_records(&self, records: &[Vec<u8>], _seed: u64) -> Result<Batch> {
        let parsed = records
            .iter()
            .enumerate()
            .map(|(index, r)| Parsed::read(index, r))
            .collect::<Result<Vec<Parsed<'_>>>>()?;
        let rows: Vec<Row<'_>> = parsed.iter().map(Parsed::row).collect();
        self.prepare_rows(&rows)
    }

    fn sparse_rows(&self, _batch: &Batch) -> Vec<(String, Vec<u64>)> {
        Vec::new()
    }

    fn forward_backward(&self, params: &Params, batch: &Batch) -> Result<StepOutput> {
        self.check_params(params)?;
        let (x, target) = self.batch_parts(batch)?;
        if let Some(widths) = &self.fc_cpu {
            let (value, dense) =
                fc_cpu::step_batch(widths, &params.dense, x, target, batch.samples)?;
            return self.step_output(value, batch, dense);
        }
        self.forward_backward_candle(params, x, target, batch)
    }

    fn evaluate(&self, params: &Params, batch: &Batch) -> Result<EvalOutput> {
        self.check_params(params)?;
        let (x, target) = self.batch_parts(batch)?;
        let Some(widths) = &self.fc_cpu else {
            return self.evaluate_candle(params, x, target, batch);
        };
        let n = batch.samples;
        let (mean, correct) = fc_cpu::evaluate_batch(widths, &params.dense, x, target, n)?;
        Ok(EvalOutput {
            loss_sum: mean * n as f64,
            count: n as u64,
            correct,
        })
    }

    fn metric(&self) -> MetricKind {
        match self.task {
            Task::Regression => MetricKind::Cost,
            Task::Classification { .. } => MetricKind::Accuracy,
        }
    }
}

impl DenseModel {
    /// The step's output from its mean loss (refused when not finite) and gradients.
    fn step_output(&self, value: f64, batch: &Batch, dense: Vec<Vec<f32>>) -> Result<StepOutput> {
        if !value.is_finite() {
            return Err(Error::NonFiniteLoss {
                model: self.kind,
                loss: value,
            });
        }
        Ok(StepOutput {
            loss: value as f32,
            examples: batch.samples,
            dense,
            sparse: Vec::new(),
        })
    }

    /// [`Model::forward_backward`] through candle's autograd (any device and dtype).
    fn forward_backward_candle(
        &self,
        params: &Params,
        x: &Tensor,
        target: &Target,
        batch: &Batch,
    ) -> Result<StepOutput> {
        // One copy of every parameter to the device and one of the loss and every
        // gradient back: each copy between the host and a GPU waits for the GPU.
        let host = params.dense.concat();
        let len = host.len();
        let all = Tensor::from_vec(host, len, &self.device)?;
        let mut at = 0;
        let mut vars = Vec::with_capacity(self.params.len());
        for p in &self.params {
            let t = all.narrow(0, at, p.len())?.reshape(p.shape.as_slice())?;
            vars.push(Var::from_tensor(&t)?);
            at += p.len();
        }
        let tensors = vars
            .iter()
            .map(|v| v.as_tensor().to_dtype(self.dtype))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let out = self.forward(&tensors, x)?;
        let loss = self.loss(&out, target)?;
        let grads = loss.backward()?;
        let mut parts = vec![loss.to_dtype(DType::F32)?.reshape(1)?];
        for var in &vars {
            if let Some(g) = grads.get(var.as_tensor()) {
                parts.push(g.to_dtype(DType::F32)?.flatten_all()?);
            }
        }
        let flat = Tensor::cat(&parts, 0)?.to_vec1::<f32>()?;
        let value = f64::from(flat[0]);
        if !value.is_finite() {
            return self.step_output(value, batch, Vec::new());
        }
        let mut at = 1;
        let mut dense = Vec::with_capacity(vars.len());
        for (var, p) in vars.iter().zip(&self.params) {
            dense.push(match grads.get(var.as_tensor()) {
                Some(_) => {
                    at += p.len();
                    flat[at - p.len()..at].to_vec()
                }
                None => vec![0.0; p.len()],
            });
        }
        self.step_output(value, batch, dense)
    }

    /// [`Model::evaluate`] through candle (any device and dtype).
    fn evaluate_candle(
        &self,
        params: &Params,
        x: &Tensor,
        target: &Target,
        batch: &Batch,
    ) -> Result<EvalOutput> {
        let tensors = self
            .params
            .iter()
            .zip(&params.dense)
            .map(|(p, v)| {
                Tensor::from_slice(v, p.shape.as_slice(), &self.device)?.to_dtype(self.dtype)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let out = self.forward(&tensors, x)?;
        let mean = self
            .loss(&out, target)?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?;
        let correct = match target {
            Target::Values(_) => 0,
            Target::Classes { ids, .. } => {
                let predicted = out.argmax(D::Minus1)?.to_vec1::<u32>()?;
                predicted.iter().zip(ids).filter(|(p, y)| p == y).count() as u64
            }
        };
        Ok(EvalOutput {
            loss_sum: mean * batch.samples as f64,
            count: batch.samples as u64,
            correct,
        })
    }
}

mod rows;

#[cfg(test)]
mod tests;
