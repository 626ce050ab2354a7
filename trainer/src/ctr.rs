//! `ctr`: a click-through-rate model in the shape of PaddleRec's CTR-DNN (the job
//! Paddle's parameter server is built for).
//!
//! A sample has `dense` real features (`Sample::dense`), exactly `slots` categorical
//! ids (`Sample::sparse_ids`, the `i`-th id is slot `i`'s; ids of every slot share one
//! id space, `0..vocab_size`) and a class id 0 or 1 (clicked). Each id is looked up in
//! one sparse table `emb` of `dim`-wide rows; the network's input is the dense features
//! followed by the slots' rows, in slot order; ReLU hidden layers (`hidden`, PaddleRec's
//! 400-400-400 by default) end in 2 logits, with mean softmax cross-entropy. The table
//! is pulled and pushed by row: a step touches only the rows of its batch's ids, and
//! the gradient of a row several samples share is their sum.
//!
//! The step runs in f32: on the CPU through `fc_cpu.rs` (with the gradient of the
//! inputs carried back into the rows), on any other device through candle
//! (`ctr/on_device.rs`); other dtypes are refused when the model is built.
//! Initial values: weights uniform within Xavier's bound (Paddle's `fc` default),
//! biases zero, rows uniform in `[-0.01, 0.01)`.

use candle_core::{DType, Device};
use edl_proto::sample::{Sample, sample::Label};

use crate::error::{Error, Result};
use crate::fc_cpu::{self, Loss};
use crate::model::{
    Batch, DenseParam, EvalOutput, MetricKind, Model, Params, SparseGrad, SparseInit, SparseTable,
    StepOutput,
};
use crate::rng::{SplitMix64, hash_str, mix};

mod on_device;

/// Name of the embedding table.
pub const TABLE: &str = "emb";

const KIND: &str = "ctr";
/// Half-width of the rows' initial values.
const ROW_INIT: f32 = 0.01;

/// Hyper-parameters, validated by [`Ctr::new`].
#[derive(Debug, Clone)]
pub(crate) struct CtrConfig {
    pub(crate) vocab_size: u64,
    pub(crate) dim: usize,
    pub(crate) slots: usize,
    pub(crate) dense: usize,
    pub(crate) hidden: Vec<usize>,
}

/// The CTR-DNN model.
#[derive(Debug)]
pub(crate) struct Ctr {
    cfg: CtrConfig,
    /// Layer widths: inputs (`dense + slots * dim`), the hidden layers, 2.
    widths: Vec<usize>,
    /// Where candle runs the steps; `None` on the CPU, where `fc_cpu` does.
    device: Option<Device>,
}

/// A prepared batch.
#[derive(Debug)]
struct CtrBatch {
    n: usize,
    /// `[n, dense]` features.
    dense: Vec<f32>,
    /// Sorted distinct ids of the batch (rows of `emb`).
    rows: Vec<u64>,
    /// `[n, slots]`: index into `rows` of each sample's id in each slot.
    index: Vec<u32>,
    /// Class ids (0 or 1).
    labels: Vec<u32>,
}

impl Ctr {
    pub(crate) fn new(cfg: CtrConfig, device: &Device, dtype: DType) -> Result<Self> {
        let bad = |reason: String| {
            Err(Error::Spec {
                model: KIND,
                reason,
            })
        };
        if dtype != DType::F32 {
            return bad(format!("ctr runs in f32 only (asked for {dtype:?})"));
        }
        if cfg.vocab_size < 1 || cfg.vocab_size > u64::from(u32::MAX) {
            return bad("vocab_size must be between 1 and 2^32 - 1".into());
        }
        if cfg.dim == 0 || cfg.slots == 0 {
            return bad("dim and slots must be positive".into());
        }
        if cfg.hidden.contains(&0) {
            return bad("hidden layer widths must be positive".into());
        }
        let mut widths = vec![cfg.dense + cfg.slots * cfg.dim];
        widths.extend(&cfg.hidden);
        widths.push(2);
        let device = (!device.is_cpu()).then(|| device.clone());
        Ok(Ctr {
            cfg,
            widths,
            device,
        })
    }

    fn parts<'a>(&self, batch: &'a Batch) -> Result<&'a CtrBatch> {
        batch.data::<CtrBatch>().ok_or(Error::BatchMismatch {
            model: KIND,
            batch: batch.model(),
        })
    }

    /// The network's inputs `[n, dense + slots * dim]`: the features, then each slot's
    /// row.
    fn inputs(&self, params: &Params, b: &CtrBatch) -> Result<Vec<f32>> {
        let (slots, nd) = (self.cfg.slots, self.cfg.dense);
        let rows = params.rows(TABLE, &b.rows, self.cfg.dim)?;
        let mut x = Vec::with_capacity(b.n * self.widths[0]);
        for s in 0..b.n {
            x.extend_from_slice(&b.dense[s * nd..(s + 1) * nd]);
            for &i in &b.index[s * slots..(s + 1) * slots] {
                x.extend_from_slice(rows[i as usize]);
            }
        }
        Ok(x)
    }
}

impl Model for Ctr {
    fn name(&self) -> &str {
        KIND
    }

    fn dense_params(&self) -> Vec<DenseParam> {
        self.widths
            .windows(2)
            .enumerate()
            .flat_map(|(i, w)| {
                [
                    DenseParam {
                        name: format!("fc{i}.w"),
                        shape: vec![w[0], w[1]],
                    },
                    DenseParam {
                        name: format!("fc{i}.b"),
                        shape: vec![w[1]],
                    },
                ]
            })
            .collect()
    }

    fn sparse_tables(&self) -> Vec<SparseTable> {
        vec![SparseTable {
            name: TABLE.to_string(),
            rows: self.cfg.vocab_size,
            dim: self.cfg.dim,
            init: SparseInit::Uniform { bound: ROW_INIT },
        }]
    }

    fn init_dense(&self, seed: u64) -> Vec<Vec<f32>> {
        let mut out = Vec::new();
        for (i, w) in self.widths.windows(2).enumerate() {
            let mut rng = SplitMix64::new(mix(seed, hash_str(&format!("fc{i}.w"))));
            let a = (6.0 / (w[0] + w[1]) as f64).sqrt();
            out.push((0..w[0] * w[1]).map(|_| rng.symmetric(a)).collect());
            out.push(vec![0.0; w[1]]);
        }
        out
    }

    fn init_sparse_row(&self, table: &str, row: u64, seed: u64) -> Vec<f32> {
        if table != TABLE {
            return Vec::new();
        }
        let mut rng = SplitMix64::new(mix(mix(seed, hash_str(table)), row));
        (0..self.cfg.dim)
            .map(|_| rng.symmetric(f64::from(ROW_INIT)))
            .collect()
    }

    fn prepare(&self, samples: &[Sample]) -> Result<Batch> {
        if samples.is_empty() {
            return Err(Error::EmptyBatch {
                model: KIND,
                reason: "no samples",
            });
        }
        let (nd, slots) = (self.cfg.dense, self.cfg.slots);
        let mut dense = Vec::with_capacity(samples.len() * nd);
        let mut ids = Vec::with_capacity(samples.len() * slots);
        let mut labels = Vec::with_capacity(samples.len());
        for (index, s) in samples.iter().enumerate() {
            if s.dense.len() != nd {
                return Err(Error::FeatureCount {
                    model: KIND,
                    index,
                    found: s.dense.len(),
                    expected: nd,
                });
            }
            if let Some((feature, &value)) =
                s.dense.iter().enumerate().find(|(_, v)| !v.is_finite())
            {
                return Err(Error::NonFiniteFeature {
                    model: KIND,
                    index,
                    feature,
                    value,
                });
            }
            if s.sparse_ids.len() != slots {
                return Err(Error::Model(format!(
                    "sample {index} has {} sparse ids, model {KIND} takes one per slot ({slots})",
                    s.sparse_ids.len()
                )));
            }
            if let Some(&id) = s.sparse_ids.iter().find(|&&id| id >= self.cfg.vocab_size) {
                return Err(Error::SparseIdOutOfRange {
                    model: KIND,
                    index,
                    id,
                    vocab_size: self.cfg.vocab_size,
                });
            }
            match s.label {
                Some(Label::ClassId(c)) if c < 2 => labels.push(c),
                Some(Label::ClassId(class)) => {
                    return Err(Error::ClassOutOfRange {
                        model: KIND,
                        index,
                        class,
                        classes: 2,
                    });
                }
                other => {
                    return Err(Error::Label {
                        model: KIND,
                        index,
                        found: match other {
                            None => "no label".into(),
                            Some(_) => "a real-valued label".into(),
                        },
                        expected: "a class id (0 or 1)",
                    });
                }
            }
            dense.extend_from_slice(&s.dense);
            ids.extend_from_slice(&s.sparse_ids);
        }
        let mut rows = ids.clone();
        rows.sort_unstable();
        rows.dedup();
        let index = ids
            .iter()
            .map(|id| rows.binary_search(id).unwrap_or_default() as u32)
            .collect();
        let n = samples.len();
        Ok(Batch::new(
            n,
            CtrBatch {
                n,
                dense,
                rows,
                index,
                labels,
            },
        ))
    }

    fn sparse_rows(&self, batch: &Batch) -> Vec<(String, Vec<u64>)> {
        match self.parts(batch) {
            Ok(b) => vec![(TABLE.to_string(), b.rows.clone())],
            Err(_) => Vec::new(),
        }
    }

    fn forward_backward(&self, params: &Params, batch: &Batch) -> Result<StepOutput> {
        let b = self.parts(batch)?;
        let x = self.inputs(params, b)?;
        let (value, dense, dx) = match &self.device {
            None => {
                let target = Loss::SoftmaxCe(&b.labels);
                fc_cpu::step_with_input_grad(&self.widths, &params.dense, &x, b.n, &target)
            }
            Some(device) => on_device::step(&self.widths, &params.dense, x, &b.labels, device)?,
        };
        if !value.is_finite() {
            return Err(Error::NonFiniteLoss {
                model: KIND,
                loss: value,
            });
        }
        // Each slot's part of the input gradient goes to its row, summed over the samples
        // that share the row.
        let (d, slots, nd, width) = (self.cfg.dim, self.cfg.slots, self.cfg.dense, self.widths[0]);
        let mut values = vec![0f32; b.rows.len() * d];
        for s in 0..b.n {
            for (k, &i) in b.index[s * slots..(s + 1) * slots].iter().enumerate() {
                let from = s * width + nd + k * d;
                let to = i as usize * d;
                for (g, v) in values[to..to + d].iter_mut().zip(&dx[from..from + d]) {
                    *g += v;
                }
            }
        }
        Ok(StepOutput {
            loss: value as f32,
            examples: b.n,
            dense,
            sparse: vec![SparseGrad {
                table: TABLE.to_string(),
                rows: b.rows.clone(),
                dim: d,
                values,
            }],
        })
    }

    fn evaluate(&self, params: &Params, batch: &Batch) -> Result<EvalOutput> {
        let b = self.parts(batch)?;
        let x = self.inputs(params, b)?;
        let (mean, correct) = match &self.device {
            None => {
                let outs = fc_cpu::forward(&self.widths, &params.dense, &x, b.n);
                let out = &outs[outs.len() - 1];
                let mean = fc_cpu::loss(out, b.n, &Loss::SoftmaxCe(&b.labels), None);
                let correct = out
                    .chunks_exact(2)
                    .zip(&b.labels)
                    .filter(|(row, y)| fc_cpu::argmax(row) == **y as usize)
                    .count() as u64;
                (mean, correct)
            }
            Some(device) => on_device::evaluate(&self.widths, &params.dense, x, &b.labels, device)?,
        };
        Ok(EvalOutput {
            loss_sum: mean * b.n as f64,
            count: b.n as u64,
            correct,
        })
    }

    fn metric(&self) -> MetricKind {
        MetricKind::Accuracy
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    fn model() -> Ctr {
        let cfg = CtrConfig {
            vocab_size: 50,
            dim: 3,
            slots: 4,
            dense: 2,
            hidden: vec![5, 4],
        };
        Ctr::new(cfg, &Device::Cpu, DType::F32).unwrap()
    }

    fn samples() -> Vec<Sample> {
        (0..6u64)
            .map(|i| Sample {
                dense: vec![i as f32 * 0.3 - 0.5, 0.25],
                // Row 7 in slot 0 of every sample: its gradient sums over them.
                sparse_ids: vec![7, 10 + i, 20 + i % 2, 49],
                label: Some(Label::ClassId((i % 2) as u32)),
                ..Default::default()
            })
            .collect()
    }

    fn params(m: &Ctr, batch: &Batch) -> Params {
        let mut p = Params {
            dense: m.init_dense(3),
            ..Default::default()
        };
        let rows: crate::model::SparseRows = m.sparse_rows(batch)[0]
            .1
            .iter()
            .map(|&r| {
                let v = m
                    .init_sparse_row(TABLE, r, 1)
                    .iter()
                    .map(|x| x * 50.0)
                    .collect();
                (r, v)
            })
            .collect();
        p.sparse.insert(TABLE.to_string(), rows);
        p
    }

    /// Every gradient, dense and of the rows, against central differences of the loss.
    #[test]
    fn gradients_match_finite_differences() {
        let m = model();
        let batch = m.prepare(&samples()).unwrap();
        let p = params(&m, &batch);
        let out = m.forward_backward(&p, &batch).unwrap();
        let loss = |p: &Params| f64::from(m.forward_backward(p, &batch).unwrap().loss);
        let h = 1e-2f32;
        let check = |analytic: f32, up: f64, down: f64, what: &str| {
            let fd = (up - down) / (2.0 * f64::from(h));
            assert!(
                (fd - f64::from(analytic)).abs() < 2e-3 + 2e-2 * fd.abs(),
                "{what}: {fd} by differences against {analytic}"
            );
        };
        for (k, g) in out.dense.iter().enumerate() {
            for i in (0..g.len()).step_by(3) {
                let (mut a, mut b) = (p.clone(), p.clone());
                a.dense[k][i] += h;
                b.dense[k][i] -= h;
                check(g[i], loss(&a), loss(&b), &format!("dense {k}[{i}]"));
            }
        }
        let sg = &out.sparse[0];
        assert_eq!(sg.rows, m.sparse_rows(&batch)[0].1);
        for (j, &row) in sg.rows.iter().enumerate() {
            for c in 0..3 {
                let (mut a, mut b) = (p.clone(), p.clone());
                a.sparse.get_mut(TABLE).unwrap().get_mut(row).unwrap()[c] += h;
                b.sparse.get_mut(TABLE).unwrap().get_mut(row).unwrap()[c] -= h;
                check(
                    sg.values[j * 3 + c],
                    loss(&a),
                    loss(&b),
                    &format!("row {row}[{c}]"),
                );
            }
        }
        assert!(
            sg.values.iter().any(|&v| v.abs() > 1e-4),
            "rows with gradients"
        );
        let ev = m.evaluate(&p, &batch).unwrap();
        assert!((ev.loss_sum / ev.count as f64 - f64::from(out.loss)).abs() < 1e-5);
    }

    /// The step through candle (the GPU's path), run here on the CPU, against `fc_cpu`'s:
    /// the same loss, dense gradients, rows' gradients and evaluation.
    #[test]
    fn the_candle_step_is_the_cpu_step() {
        let cpu = model();
        let candle = Ctr {
            device: Some(Device::Cpu),
            ..model()
        };
        let batch = cpu.prepare(&samples()).unwrap();
        let p = params(&cpu, &batch);
        let (a, b) = (
            cpu.forward_backward(&p, &batch).unwrap(),
            candle.forward_backward(&p, &batch).unwrap(),
        );
        let close = |x: f32, y: f32, what: &str| {
            assert!((x - y).abs() <= 1e-5 + 1e-4 * x.abs(), "{what}: {x} vs {y}");
        };
        close(a.loss, b.loss, "loss");
        assert_eq!(a.dense.len(), b.dense.len());
        for (k, (x, y)) in a.dense.iter().zip(&b.dense).enumerate() {
            assert_eq!(x.len(), y.len());
            x.iter()
                .zip(y)
                .for_each(|(x, y)| close(*x, *y, &format!("dense {k}")));
        }
        assert_eq!(a.sparse[0].rows, b.sparse[0].rows);
        let (x, y) = (&a.sparse[0].values, &b.sparse[0].values);
        assert_eq!(x.len(), y.len());
        assert!(x.iter().any(|v| v.abs() > 1e-4), "rows with gradients");
        x.iter().zip(y).for_each(|(x, y)| close(*x, *y, "rows"));
        let (ea, eb) = (
            cpu.evaluate(&p, &batch).unwrap(),
            candle.evaluate(&p, &batch).unwrap(),
        );
        assert_eq!((ea.count, ea.correct), (eb.count, eb.correct));
        close(ea.loss_sum as f32, eb.loss_sum as f32, "evaluation");
    }

    #[test]
    fn bad_samples_are_named() {
        let m = model();
        let mut s = samples();
        s[2].sparse_ids.pop();
        assert!(
            m.prepare(&s)
                .unwrap_err()
                .to_string()
                .contains("sample 2 has 3 sparse ids")
        );
        let mut s = samples();
        s[1].sparse_ids[0] = 50;
        assert!(matches!(
            m.prepare(&s),
            Err(Error::SparseIdOutOfRange {
                index: 1,
                id: 50,
                ..
            })
        ));
        let mut s = samples();
        s[3].label = Some(Label::ClassId(2));
        assert!(matches!(
            m.prepare(&s),
            Err(Error::ClassOutOfRange { index: 3, .. })
        ));
        let mut s = samples();
        s[0].dense[1] = f32::NAN;
        assert!(matches!(
            m.prepare(&s),
            Err(Error::NonFiniteFeature {
                index: 0,
                feature: 1,
                ..
            })
        ));
        let cfg = CtrConfig {
            vocab_size: 50,
            dim: 3,
            slots: 4,
            dense: 2,
            hidden: vec![5],
        };
        assert!(
            Ctr::new(cfg, &Device::Cpu, DType::F64).is_err(),
            "f64 is refused"
        );
    }
}
