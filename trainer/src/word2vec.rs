//! `word2vec`: skip-gram with negative sampling (Mikolov et al. 2013) over word ids.
//!
//! Samples are sentences of word ids (`Sample::sparse_ids`, as written by
//! `edl data convert --format text`, `<s>`/`<e>` included). Every position of a
//! sentence is a center word; each word at most `window` positions away is a context
//! word, giving a (center, context) pair (a fixed window, not word2vec's randomly
//! shrunk one). Each pair gets `negatives` negative ids drawn by the
//! [`NegativeSampler`] from a generator seeded by the spec seed, the batch seed and
//! the batch's ids, so a batch is reproducible in every process. A negative that
//! happens to equal the context id is kept (rare for a real vocabulary).
//!
//! The loss of a pair with center `c`, context `o` and negatives `n_k` is
//! `softplus(-u_o . v_c) + sum_k softplus(u_{n_k} . v_c)` (that is,
//! `-log s(u_o . v_c) - sum_k log s(-u_{n_k} . v_c)`), where `v` are rows of the input
//! table `emb_in` and `u` rows of the output table `emb_out`; the batch loss is the mean
//! over pairs. A step gathers only the rows the batch touches into two small tensors,
//! so no step ever needs a whole table.
//!
//! Initial rows follow the reference implementation: input rows uniform in
//! `[-0.5/dim, 0.5/dim)`, output rows zero.
//!
//! On the CPU in f32 a step runs `word2vec_cpu.rs` (one pass over the pairs, no
//! autograd); elsewhere candle's autograd computes the same loss, and it is the
//! reference the tests hold the CPU step to.

use candle_core::{DType, Device, Tensor, Var};
use edl_proto::sample::Sample;

use crate::error::{Error, Result};
use crate::model::{
    Batch, BatchData, DenseParam, EvalOutput, MetricKind, Model, Params, SparseGrad, SparseInit,
    SparseTable, StepOutput,
};
use crate::rng::{SplitMix64, hash_str, mix};
use edl_job::model::NegativeSampler;

/// Name of the input (center word) embedding table.
pub const INPUT_TABLE: &str = "emb_in";
/// Name of the output (context word) embedding table.
pub const OUTPUT_TABLE: &str = "emb_out";

const KIND: &str = "word2vec";

/// Hyper-parameters, validated by [`Word2Vec::new`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Word2VecConfig {
    pub(crate) vocab_size: u64,
    pub(crate) dim: usize,
    pub(crate) window: usize,
    pub(crate) negatives: usize,
    pub(crate) sampler: NegativeSampler,
    pub(crate) seed: u64,
}

/// The skip-gram model.
#[derive(Debug)]
pub(crate) struct Word2Vec {
    cfg: Word2VecConfig,
    device: Device,
    dtype: DType,
    /// Steps run `word2vec_cpu.rs` (the CPU in f32) instead of candle's autograd.
    cpu: bool,
}

/// A prepared skip-gram batch: pair indices into the batch's own row lists.
#[derive(Debug, Clone)]
pub(crate) struct SkipGramBatch {
    pairs: usize,
    /// Sorted distinct center ids (rows of `emb_in`).
    rows_in: Vec<u64>,
    /// Sorted distinct context and negative ids (rows of `emb_out`).
    rows_out: Vec<u64>,
    /// Index into `rows_in` of each pair's center.
    center: Vec<u32>,
    /// Index into `rows_out` of each pair's context.
    context: Vec<u32>,
    /// `negatives` indices into `rows_out` for each pair, pair after pair.
    negative: Vec<u32>,
}

impl SkipGramBatch {
    fn pairs(&self, dim: usize) -> crate::word2vec_cpu::Pairs<'_> {
        crate::word2vec_cpu::Pairs {
            dim,
            center: &self.center,
            context: &self.context,
            negative: &self.negative,
        }
    }
}

/// Numerically stable `log(1 + exp(x))`.
fn softplus(x: &Tensor) -> candle_core::Result<Tensor> {
    x.relu()? + x.abs()?.neg()?.exp()?.affine(1.0, 1.0)?.log()?
}

impl Word2Vec {
    pub(crate) fn new(cfg: Word2VecConfig, device: &Device, dtype: DType) -> Result<Self> {
        let bad = |reason: &str| {
            Err(Error::Spec {
                model: KIND,
                reason: reason.to_string(),
            })
        };
        if cfg.vocab_size < 2 {
            return bad("vocab_size must be at least 2");
        }
        if cfg.vocab_size > u64::from(u32::MAX) {
            return bad("vocab_size must be below 2^32");
        }
        if cfg.dim == 0 {
            return bad("dim must be positive");
        }
        if cfg.window == 0 {
            return bad("window must be positive");
        }
        if cfg.negatives == 0 {
            return bad("negatives must be positive");
        }
        Ok(Word2Vec {
            cfg,
            device: device.clone(),
            dtype,
            cpu: device.is_cpu() && dtype == DType::F32,
        })
    }

    fn draw_negative(&self, rng: &mut SplitMix64) -> u64 {
        let v = self.cfg.vocab_size;
        match self.cfg.sampler {
            NegativeSampler::Uniform => rng.below(v),
            NegativeSampler::Zipf => {
                // Density ~ x^-0.75 on [1, v + 1): CDF ~ x^0.25 - 1, inverted.
                let top = ((v + 1) as f64).powf(0.25) - 1.0;
                let x = (1.0 + rng.next_f64() * top).powi(4);
                (x as u64).saturating_sub(1).min(v - 1)
            }
        }
    }

    fn parts<'a>(&self, batch: &'a Batch) -> Result<&'a SkipGramBatch> {
        match &batch.data {
            BatchData::SkipGram(b) if batch.model == KIND => Ok(b),
            _ => Err(Error::BatchMismatch {
                model: KIND,
                batch: batch.model,
            }),
        }
    }

    /// The rows of `table` named by `rows`, concatenated.
    fn gather(&self, params: &Params, table: &str, rows: &[u64]) -> Result<Vec<f32>> {
        Ok(params.rows(table, rows, self.cfg.dim)?.concat())
    }

    /// The mean loss over the batch's pairs, from the gathered rows.
    fn loss(
        &self,
        e_in: &Tensor,
        e_out: &Tensor,
        b: &SkipGramBatch,
    ) -> candle_core::Result<Tensor> {
        let (p, k, d) = (b.pairs, self.cfg.negatives, self.cfg.dim);
        let index = |ids: &[u32]| Tensor::from_slice(ids, ids.len(), &self.device);
        let v = e_in.index_select(&index(&b.center)?, 0)?;
        let u = e_out.index_select(&index(&b.context)?, 0)?;
        let pos = (&v * &u)?.sum(1)?;
        let neg = e_out
            .index_select(&index(&b.negative)?, 0)?
            .reshape((p, k, d))?;
        let neg_score = neg.broadcast_mul(&v.unsqueeze(1)?)?.sum(2)?;
        let total = (softplus(&pos.neg()?)?.sum_all()? + softplus(&neg_score)?.sum_all()?)?;
        total.affine(1.0 / p as f64, 0.0)
    }

    /// A step by `word2vec_cpu.rs`: the gradients are written once, straight
    /// into the vectors pushed.
    fn step_cpu(&self, params: &Params, b: &SkipGramBatch) -> Result<StepOutput> {
        let d = self.cfg.dim;
        let e_in = self.gather(params, INPUT_TABLE, &b.rows_in)?;
        let e_out = self.gather(params, OUTPUT_TABLE, &b.rows_out)?;
        let mut g_in = vec![0f32; e_in.len()];
        let mut g_out = vec![0f32; e_out.len()];
        let value = b
            .pairs(d)
            .loss(&e_in, &e_out, Some((&mut g_in, &mut g_out)));
        if !value.is_finite() {
            return Err(Error::NonFiniteLoss {
                model: KIND,
                loss: value,
            });
        }
        let grad = |table: &str, rows: &[u64], values| SparseGrad {
            table: table.to_string(),
            rows: rows.to_vec(),
            dim: d,
            values,
        };
        Ok(StepOutput {
            loss: value as f32,
            examples: b.pairs,
            dense: Vec::new(),
            sparse: vec![
                grad(INPUT_TABLE, &b.rows_in, g_in),
                grad(OUTPUT_TABLE, &b.rows_out, g_out),
            ],
        })
    }

    fn tensors(
        &self,
        params: &Params,
        b: &SkipGramBatch,
        trainable: bool,
    ) -> Result<(Option<[Var; 2]>, Tensor, Tensor)> {
        let d = self.cfg.dim;
        let data_in = self.gather(params, INPUT_TABLE, &b.rows_in)?;
        let data_out = self.gather(params, OUTPUT_TABLE, &b.rows_out)?;
        let shape_in = (b.rows_in.len(), d);
        let shape_out = (b.rows_out.len(), d);
        if trainable {
            let vin = Var::from_vec(data_in, shape_in, &self.device)?;
            let vout = Var::from_vec(data_out, shape_out, &self.device)?;
            let tin = vin.as_tensor().to_dtype(self.dtype)?;
            let tout = vout.as_tensor().to_dtype(self.dtype)?;
            Ok((Some([vin, vout]), tin, tout))
        } else {
            let tin = Tensor::from_vec(data_in, shape_in, &self.device)?.to_dtype(self.dtype)?;
            let tout = Tensor::from_vec(data_out, shape_out, &self.device)?.to_dtype(self.dtype)?;
            Ok((None, tin, tout))
        }
    }
}

/// Index of `id` in the sorted, distinct `rows` (present by construction).
fn position(rows: &[u64], id: u64) -> u32 {
    rows.binary_search(&id).unwrap_or_default() as u32
}

impl Model for Word2Vec {
    fn name(&self) -> &str {
        KIND
    }

    fn dense_params(&self) -> Vec<DenseParam> {
        Vec::new()
    }

    fn sparse_tables(&self) -> Vec<SparseTable> {
        [INPUT_TABLE, OUTPUT_TABLE]
            .iter()
            .map(|name| SparseTable {
                name: (*name).to_string(),
                rows: self.cfg.vocab_size,
                dim: self.cfg.dim,
                init: if *name == INPUT_TABLE {
                    SparseInit::Uniform {
                        bound: 0.5 / self.cfg.dim as f32,
                    }
                } else {
                    SparseInit::Zeros
                },
            })
            .collect()
    }

    fn init_dense(&self, _seed: u64) -> Vec<Vec<f32>> {
        Vec::new()
    }

    fn init_sparse_row(&self, table: &str, row: u64, seed: u64) -> Vec<f32> {
        let dim = self.cfg.dim;
        match table {
            INPUT_TABLE => {
                let mut rng = SplitMix64::new(mix(mix(seed, hash_str(table)), row));
                let a = 0.5 / dim as f64;
                (0..dim).map(|_| rng.symmetric(a)).collect()
            }
            OUTPUT_TABLE => vec![0.0; dim],
            _ => Vec::new(),
        }
    }

    fn prepare(&self, samples: &[Sample]) -> Result<Batch> {
        self.prepare_seeded(samples, 0)
    }

    fn prepare_seeded(&self, samples: &[Sample], seed: u64) -> Result<Batch> {
        if samples.is_empty() {
            return Err(Error::EmptyBatch {
                model: KIND,
                reason: "no samples",
            });
        }
        let mut content = mix(self.cfg.seed, seed);
        for (index, s) in samples.iter().enumerate() {
            if !s.dense.is_empty() {
                return Err(Error::FeatureCount {
                    model: KIND,
                    index,
                    found: s.dense.len(),
                    expected: 0,
                });
            }
            for &id in &s.sparse_ids {
                if id >= self.cfg.vocab_size {
                    return Err(Error::SparseIdOutOfRange {
                        model: KIND,
                        index,
                        id,
                        vocab_size: self.cfg.vocab_size,
                    });
                }
                content = mix(content, id);
            }
            content = mix(content, u64::MAX);
        }
        let w = self.cfg.window;
        let mut centers = Vec::new();
        let mut contexts = Vec::new();
        for s in samples {
            let ids = &s.sparse_ids;
            for (i, &c) in ids.iter().enumerate() {
                let lo = i.saturating_sub(w);
                let hi = (i + w + 1).min(ids.len());
                for (j, &o) in ids.iter().enumerate().take(hi).skip(lo) {
                    if j != i {
                        centers.push(c);
                        contexts.push(o);
                    }
                }
            }
        }
        let pairs = centers.len();
        if pairs == 0 {
            return Err(Error::EmptyBatch {
                model: KIND,
                reason: "no sentence has two words, so there are no (center, context) pairs",
            });
        }
        let mut rng = SplitMix64::new(content);
        let negatives: Vec<u64> = (0..pairs * self.cfg.negatives)
            .map(|_| self.draw_negative(&mut rng))
            .collect();
        let mut rows_in = centers.clone();
        rows_in.sort_unstable();
        rows_in.dedup();
        let mut rows_out: Vec<u64> = contexts.iter().chain(&negatives).copied().collect();
        rows_out.sort_unstable();
        rows_out.dedup();
        let index = |rows: &[u64], ids: &[u64]| -> Vec<u32> {
            ids.iter().map(|&id| position(rows, id)).collect()
        };
        let center = index(&rows_in, &centers);
        let context = index(&rows_out, &contexts);
        let negative = index(&rows_out, &negatives);
        Ok(Batch {
            model: KIND,
            samples: samples.len(),
            data: BatchData::SkipGram(SkipGramBatch {
                pairs,
                rows_in,
                rows_out,
                center,
                context,
                negative,
            }),
        })
    }

    fn sparse_rows(&self, batch: &Batch) -> Vec<(String, Vec<u64>)> {
        match self.parts(batch) {
            Ok(b) => vec![
                (INPUT_TABLE.to_string(), b.rows_in.clone()),
                (OUTPUT_TABLE.to_string(), b.rows_out.clone()),
            ],
            Err(_) => Vec::new(),
        }
    }

    fn forward_backward(&self, params: &Params, batch: &Batch) -> Result<StepOutput> {
        let b = self.parts(batch)?;
        if self.cpu {
            return self.step_cpu(params, b);
        }
        let (vars, e_in, e_out) = self.tensors(params, b, true)?;
        let loss = self.loss(&e_in, &e_out, b)?;
        let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        if !value.is_finite() {
            return Err(Error::NonFiniteLoss {
                model: KIND,
                loss: value,
            });
        }
        let grads = loss.backward()?;
        let mut sparse = Vec::with_capacity(2);
        if let Some(vars) = vars {
            for (var, (table, rows)) in vars
                .iter()
                .zip([(INPUT_TABLE, &b.rows_in), (OUTPUT_TABLE, &b.rows_out)])
            {
                let values = match grads.get(var.as_tensor()) {
                    Some(g) => g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
                    None => vec![0.0; rows.len() * self.cfg.dim],
                };
                sparse.push(SparseGrad {
                    table: table.to_string(),
                    rows: rows.clone(),
                    dim: self.cfg.dim,
                    values,
                });
            }
        }
        Ok(StepOutput {
            loss: value as f32,
            examples: b.pairs,
            dense: Vec::new(),
            sparse,
        })
    }

    fn evaluate(&self, params: &Params, batch: &Batch) -> Result<EvalOutput> {
        let b = self.parts(batch)?;
        let mean = if self.cpu {
            let e_in = self.gather(params, INPUT_TABLE, &b.rows_in)?;
            let e_out = self.gather(params, OUTPUT_TABLE, &b.rows_out)?;
            b.pairs(self.cfg.dim).loss(&e_in, &e_out, None)
        } else {
            let (_, e_in, e_out) = self.tensors(params, b, false)?;
            self.loss(&e_in, &e_out, b)?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?
        };
        Ok(EvalOutput {
            loss_sum: mean * b.pairs as f64,
            count: b.pairs as u64,
            correct: 0,
        })
    }

    fn metric(&self) -> MetricKind {
        MetricKind::Loss
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::testdata;

    /// The CPU step and candle's autograd give the same loss and gradients on PTB
    /// batches whose rows are trained (random, not the initial zeros of `emb_out`).
    #[test]
    fn the_cpu_step_matches_candles_autograd() {
        let (sentences, vocab_size) = testdata::ptb_subset();
        let cfg = Word2VecConfig {
            vocab_size,
            dim: 16,
            window: 2,
            negatives: 5,
            sampler: NegativeSampler::Zipf,
            seed: 3,
        };
        let cpu = Word2Vec::new(cfg, &Device::Cpu, DType::F32).unwrap();
        let mut reference = Word2Vec::new(cfg, &Device::Cpu, DType::F32).unwrap();
        assert!(cpu.cpu, "the CPU in f32 takes the CPU step");
        reference.cpu = false;
        let mut rng = SplitMix64::new(9);
        for (i, chunk) in sentences.chunks(7).take(20).enumerate() {
            let batch = cpu.prepare_seeded(chunk, i as u64).unwrap();
            let mut params = Params::default();
            for (table, rows) in cpu.sparse_rows(&batch) {
                let t: crate::model::SparseRows = rows
                    .iter()
                    .map(|&r| (r, (0..cfg.dim).map(|_| rng.symmetric(0.5)).collect()))
                    .collect();
                params.sparse.insert(table, t);
            }
            let a = cpu.forward_backward(&params, &batch).unwrap();
            let b = reference.forward_backward(&params, &batch).unwrap();
            assert!(
                (a.loss - b.loss).abs() < 1e-5 * b.loss.abs().max(1.0),
                "batch {i}: loss {} against {}",
                a.loss,
                b.loss
            );
            assert_eq!(a.examples, b.examples);
            for (ga, gb) in a.sparse.iter().zip(&b.sparse) {
                assert_eq!((&ga.table, &ga.rows, ga.dim), (&gb.table, &gb.rows, gb.dim));
                let worst = ga
                    .values
                    .iter()
                    .zip(&gb.values)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max);
                assert!(
                    worst < 1e-6,
                    "batch {i}, {}: gradients differ by {worst}",
                    ga.table
                );
                assert!(
                    gb.values.iter().any(|&v| v != 0.0),
                    "a batch with gradients"
                );
            }
            let ea = cpu.evaluate(&params, &batch).unwrap();
            let eb = reference.evaluate(&params, &batch).unwrap();
            assert_eq!(ea.count, eb.count);
            assert!((ea.loss_sum - eb.loss_sum).abs() < 1e-4 * eb.loss_sum.abs().max(1.0));
        }
    }
}
