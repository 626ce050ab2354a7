//! [`ModelSpec`]: which model to build and its hyper-parameters (serde, part of the job
//! spec), feature statistics for standardisation, and [`build`].

use candle_core::{DType, Device};
use edl_proto::sample::Sample;
use serde::{Deserialize, Serialize};

use crate::dense::DenseModel;
use crate::error::{Error, Result};
use crate::model::Model;
use crate::word2vec::Word2Vec;

/// A model and its hyper-parameters, tagged by `kind`, e.g. (TOML)
/// `{ kind = "mlp", inputs = 13, hidden = [32], classes = 3, standardize = true }`.
///
/// An unknown `kind`, a missing required field or an unknown field is a deserialisation
/// error naming it; values are checked by [`build`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", deny_unknown_fields)]
pub enum ModelSpec {
    /// Linear regression 13 -> 1 with squared-error cost (UCI Housing). Standardises its
    /// features by default.
    #[serde(rename = "fit_a_line")]
    FitALine {
        /// Standardise features with `stats` (default true).
        #[serde(default = "default_true")]
        standardize: bool,
        /// Feature statistics of the training split (see [`ModelSpec::fit_stats`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stats: Option<Stats>,
    },
    /// Linear regression of any input width, squared-error cost.
    #[serde(rename = "linear")]
    Linear {
        /// Number of dense features.
        inputs: usize,
        /// Standardise features with `stats` (default false).
        #[serde(default)]
        standardize: bool,
        /// Feature statistics of the training split.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stats: Option<Stats>,
    },
    /// Multi-layer perceptron classifier: ReLU hidden layers, softmax cross-entropy.
    #[serde(rename = "mlp")]
    Mlp {
        /// Number of dense features.
        inputs: usize,
        /// Hidden layer widths (may be empty: softmax regression).
        hidden: Vec<usize>,
        /// Number of classes (at least 2).
        classes: usize,
        /// Standardise features with `stats` (default false).
        #[serde(default)]
        standardize: bool,
        /// Feature statistics of the training split.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stats: Option<Stats>,
    },
    /// MNIST MLP: 784-256-10, ReLU, softmax cross-entropy.
    #[serde(rename = "mnist_mlp")]
    MnistMlp,
    /// MNIST CNN of PaddlePaddle's `recognize_digits`: two conv(5x5)-ReLU-maxpool(2x2)
    /// blocks of 20 and 50 filters, then a 10-way softmax layer (without the batch norm
    /// the Fluid example puts after the first block). Kernels are `[c_out, c_in, 5, 5]`;
    /// activations are NHWC, so the 800 inputs of `fc0.w` are ordered (y, x, channel).
    #[serde(rename = "mnist_cnn")]
    MnistCnn,
    /// Skip-gram word2vec with negative sampling over word ids.
    #[serde(rename = "word2vec")]
    Word2vec {
        /// Vocabulary size: rows of both embedding tables.
        vocab_size: u64,
        /// Embedding width.
        dim: usize,
        /// Context words taken on each side of a center word (default 5).
        #[serde(default = "default_window")]
        window: usize,
        /// Negative samples per (center, context) pair (default 5).
        #[serde(default = "default_negatives")]
        negatives: usize,
        /// How negatives are drawn (default `zipf`).
        #[serde(default)]
        sampler: NegativeSampler,
        /// Seed of negative sampling (default 0).
        #[serde(default)]
        seed: u64,
    },
}

fn default_true() -> bool {
    true
}

fn default_window() -> usize {
    5
}

fn default_negatives() -> usize {
    5
}

/// How word2vec draws negative samples.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NegativeSampler {
    /// Uniform over all ids.
    Uniform,
    /// Approximates word2vec's unigram^0.75 distribution without word counts, assuming
    /// ids are ranked by descending frequency (as `edl data convert --format text`
    /// assigns them) and frequencies follow Zipf's law (`f(r) ~ 1/r`): id `r` is drawn
    /// with probability about `(r + 1)^-0.75`, by inverting the continuous CDF.
    #[default]
    Zipf,
}

impl ModelSpec {
    /// The model kind as written in the spec.
    pub fn kind(&self) -> &'static str {
        match self {
            ModelSpec::FitALine { .. } => "fit_a_line",
            ModelSpec::Linear { .. } => "linear",
            ModelSpec::Mlp { .. } => "mlp",
            ModelSpec::MnistMlp => "mnist_mlp",
            ModelSpec::MnistCnn => "mnist_cnn",
            ModelSpec::Word2vec { .. } => "word2vec",
        }
    }

    /// Whether the model standardises its features (then it needs [`Stats`]).
    pub fn standardize(&self) -> bool {
        match self {
            ModelSpec::FitALine { standardize, .. }
            | ModelSpec::Linear { standardize, .. }
            | ModelSpec::Mlp { standardize, .. } => *standardize,
            _ => false,
        }
    }

    /// The stored feature statistics, if any.
    pub fn stats(&self) -> Option<&Stats> {
        match self {
            ModelSpec::FitALine { stats, .. }
            | ModelSpec::Linear { stats, .. }
            | ModelSpec::Mlp { stats, .. } => stats.as_ref(),
            _ => None,
        }
    }

    /// Checks the hyper-parameters without data: like [`build`], but a spec that
    /// standardises and has no statistics yet is accepted (they are computed later).
    pub fn validate(&self) -> Result<()> {
        let mut spec = self.clone();
        let width = match &spec {
            ModelSpec::FitALine { .. } => Some(13),
            ModelSpec::Linear { inputs, .. } | ModelSpec::Mlp { inputs, .. } => Some(*inputs),
            _ => None,
        };
        if let (true, None, Some(n)) = (spec.standardize(), spec.stats(), width) {
            let placeholder = Stats {
                mean: vec![0.0; n],
                std: vec![1.0; n],
            };
            match &mut spec {
                ModelSpec::FitALine { stats, .. }
                | ModelSpec::Linear { stats, .. }
                | ModelSpec::Mlp { stats, .. } => *stats = Some(placeholder),
                _ => {}
            }
        }
        build(&spec).map(|_| ())
    }

    /// Forgets stored feature statistics (to compare two specs by their settings).
    pub fn clear_stats(&mut self) {
        match self {
            ModelSpec::FitALine { stats, .. }
            | ModelSpec::Linear { stats, .. }
            | ModelSpec::Mlp { stats, .. } => *stats = None,
            _ => {}
        }
    }

    /// Computes feature statistics over the training split and stores them in the spec
    /// (only for a model that standardises; otherwise nothing is done).
    pub fn fit_stats(&mut self, train: &[Sample]) -> Result<()> {
        if !self.standardize() {
            return Ok(());
        }
        let computed = feature_stats(train)?;
        match self {
            ModelSpec::FitALine { stats, .. }
            | ModelSpec::Linear { stats, .. }
            | ModelSpec::Mlp { stats, .. } => *stats = Some(computed),
            _ => {}
        }
        Ok(())
    }
}

/// Per-feature mean and standard deviation, for standardising `x' = (x - mean) / std`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Mean of each feature.
    pub mean: Vec<f32>,
    /// Population standard deviation of each feature; 1 for a constant feature.
    pub std: Vec<f32>,
}

impl Stats {
    /// Number of features.
    pub fn width(&self) -> usize {
        self.mean.len()
    }

    pub(crate) fn check(&self, model: &'static str, inputs: usize) -> Result<()> {
        let spec = |reason: String| Error::Spec { model, reason };
        if self.mean.len() != inputs || self.std.len() != inputs {
            return Err(spec(format!(
                "feature stats have {} means and {} deviations, the model has {inputs} inputs",
                self.mean.len(),
                self.std.len()
            )));
        }
        if let Some(i) = self.mean.iter().position(|m| !m.is_finite()) {
            return Err(spec(format!("feature stats: mean {i} is not finite")));
        }
        if let Some(i) = self.std.iter().position(|s| !(s.is_finite() && *s > 0.0)) {
            return Err(spec(format!(
                "feature stats: deviation {i} is {}, must be positive",
                self.std[i]
            )));
        }
        Ok(())
    }
}

/// Mean and standard deviation of each dense feature over `samples` (the training
/// split), computed in `f64`. Errors on an empty set, rows of different widths or a
/// non-finite value.
pub fn feature_stats(samples: &[Sample]) -> Result<Stats> {
    let first = samples
        .first()
        .ok_or_else(|| Error::Stats("no samples".into()))?;
    let width = first.dense.len();
    if width == 0 {
        return Err(Error::Stats("samples have no dense features".into()));
    }
    let mut sum = vec![0f64; width];
    for (i, s) in samples.iter().enumerate() {
        if s.dense.len() != width {
            return Err(Error::Stats(format!(
                "sample {i} has {} dense features, sample 0 has {width}",
                s.dense.len()
            )));
        }
        for (j, (acc, &v)) in sum.iter_mut().zip(&s.dense).enumerate() {
            if !v.is_finite() {
                return Err(Error::Stats(format!(
                    "sample {i} has a non-finite value {v} in feature {j}"
                )));
            }
            *acc += f64::from(v);
        }
    }
    let n = samples.len() as f64;
    let mean: Vec<f64> = sum.iter().map(|s| s / n).collect();
    let mut var = vec![0f64; width];
    for s in samples {
        for ((acc, &v), m) in var.iter_mut().zip(&s.dense).zip(&mean) {
            let d = f64::from(v) - m;
            *acc += d * d;
        }
    }
    let std = var
        .iter()
        .map(|v| {
            let s = (v / n).sqrt();
            if s > 1e-12 { s as f32 } else { 1.0 }
        })
        .collect();
    Ok(Stats {
        mean: mean.iter().map(|&m| m as f32).collect(),
        std,
    })
}

/// Builds a model on the CPU, computing in `f32`.
pub fn build(spec: &ModelSpec) -> Result<Box<dyn Model>> {
    build_on(spec, &Device::Cpu, DType::F32)
}

/// Builds a model computing on `device` in `dtype` (`F32`, or `F64` for exact gradient
/// checks; half types only where the device supports them). Parameters and gradients
/// are `f32` whatever the compute dtype.
pub fn build_on(spec: &ModelSpec, device: &Device, dtype: DType) -> Result<Box<dyn Model>> {
    if !dtype.is_float() {
        return Err(Error::Spec {
            model: spec.kind(),
            reason: format!("compute dtype {dtype:?} is not a float type"),
        });
    }
    Ok(match spec {
        ModelSpec::Word2vec {
            vocab_size,
            dim,
            window,
            negatives,
            sampler,
            seed,
        } => Box::new(Word2Vec::new(
            crate::word2vec::Word2VecConfig {
                vocab_size: *vocab_size,
                dim: *dim,
                window: *window,
                negatives: *negatives,
                sampler: *sampler,
                seed: *seed,
            },
            device,
            dtype,
        )?),
        _ => Box::new(DenseModel::new(spec, device, dtype)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_with_defaults_and_reject_bad_input() {
        let s: ModelSpec = serde_json::from_str(
            r#"{"kind":"mlp","inputs":13,"hidden":[32],"classes":3,"standardize":true}"#,
        )
        .unwrap();
        assert_eq!(s.kind(), "mlp");
        assert!(s.standardize());
        let s: ModelSpec = serde_json::from_str(r#"{"kind":"fit_a_line"}"#).unwrap();
        assert!(s.standardize(), "fit_a_line standardises by default");
        let s: ModelSpec =
            serde_json::from_str(r#"{"kind":"word2vec","vocab_size":100,"dim":8}"#).unwrap();
        assert_eq!(
            s,
            ModelSpec::Word2vec {
                vocab_size: 100,
                dim: 8,
                window: 5,
                negatives: 5,
                sampler: NegativeSampler::Zipf,
                seed: 0
            }
        );
        let s: ModelSpec = serde_json::from_str(r#"{"kind":"mnist_cnn"}"#).unwrap();
        assert_eq!(s, ModelSpec::MnistCnn);

        let err = serde_json::from_str::<ModelSpec>(r#"{"kind":"resnet"}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown variant `resnet`"), "{err}");
        let err = serde_json::from_str::<ModelSpec>(r#"{"kind":"mlp","inputs":4,"classes":2}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing field `hidden`"), "{err}");
        let err = serde_json::from_str::<ModelSpec>(r#"{"kind":"linear","inputs":4,"hiden":1}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `hiden`"), "{err}");
        let err = serde_json::from_str::<ModelSpec>(r#"{"inputs":4}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing field `kind`"), "{err}");
    }

    #[test]
    fn spec_with_stats_round_trips() {
        let mut spec = ModelSpec::Linear {
            inputs: 2,
            standardize: true,
            stats: None,
        };
        let train = vec![
            Sample::regression(vec![1.0, 5.0], 0.0),
            Sample::regression(vec![3.0, 5.0], 0.0),
        ];
        spec.fit_stats(&train).unwrap();
        let stats = spec.stats().unwrap();
        assert_eq!(stats.mean, vec![2.0, 5.0]);
        assert_eq!(stats.std, vec![1.0, 1.0], "constant feature gets std 1");
        let json = serde_json::to_string(&spec).unwrap();
        assert_eq!(serde_json::from_str::<ModelSpec>(&json).unwrap(), spec);
    }

    #[test]
    fn invalid_values_are_spec_errors() {
        for (json, needle) in [
            (r#"{"kind":"linear","inputs":0}"#, "inputs"),
            (
                r#"{"kind":"mlp","inputs":3,"hidden":[0],"classes":2}"#,
                "hidden",
            ),
            (
                r#"{"kind":"mlp","inputs":3,"hidden":[],"classes":1}"#,
                "classes",
            ),
            (
                r#"{"kind":"linear","inputs":3,"standardize":true}"#,
                "stats",
            ),
            (
                r#"{"kind":"linear","inputs":3,"standardize":true,"stats":{"mean":[0],"std":[1]}}"#,
                "inputs",
            ),
            (
                r#"{"kind":"word2vec","vocab_size":0,"dim":4}"#,
                "vocab_size",
            ),
            (
                r#"{"kind":"word2vec","vocab_size":10,"dim":4,"window":0}"#,
                "window",
            ),
        ] {
            let spec: ModelSpec = serde_json::from_str(json).unwrap();
            match build(&spec) {
                Err(e @ Error::Spec { .. }) => {
                    assert!(e.to_string().contains(needle), "{json}: {e}")
                }
                other => panic!("{json}: expected a spec error, got {other:?}"),
            }
        }
    }

    #[test]
    fn feature_stats_rejects_bad_sets() {
        assert!(matches!(feature_stats(&[]), Err(Error::Stats(_))));
        let ragged = vec![
            Sample::regression(vec![1.0, 2.0], 0.0),
            Sample::regression(vec![1.0], 0.0),
        ];
        let e = feature_stats(&ragged).unwrap_err().to_string();
        assert!(e.contains("sample 1 has 1 dense features"), "{e}");
        let nan = vec![Sample::regression(vec![f32::NAN], 0.0)];
        assert!(matches!(feature_stats(&nan), Err(Error::Stats(_))));
    }
}
