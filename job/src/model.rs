//! [`ModelSpec`]: which built-in model a job trains and its hyper-parameters (part of the
//! job spec), and feature statistics for standardisation ([`Stats`], [`feature_stats`]).
//!
//! This is the description only; the trainer builds the model from it (and checks the
//! values by building it: `edl_trainer::check_model`).

use edl_proto::sample::Sample;
use serde::{Deserialize, Serialize};

/// Feature statistics could not be computed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("cannot compute feature statistics: {0}")]
pub struct StatsError(pub String);

/// A model and its hyper-parameters, tagged by `kind`, e.g. (TOML)
/// `{ kind = "mlp", inputs = 13, hidden = [32], classes = 3, standardize = true }`.
///
/// An unknown `kind`, a missing required field or an unknown field is a deserialisation
/// error naming it; values are checked by the trainer when it builds the model
/// (`edl_trainer::check_model`).
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
        /// How the weights start (default `kaiming`).
        #[serde(default, skip_serializing_if = "WeightInit::is_default")]
        init: WeightInit,
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
    /// Click-through rate, in the shape of PaddleRec's CTR-DNN: `dense` real features and
    /// one id in each of `slots` categorical slots (ids of every slot in one space), each
    /// id's row of the sparse table `emb` looked up, the features and rows fed to ReLU
    /// layers `hidden`, 2 logits, softmax cross-entropy; labels are class ids 0 and 1.
    #[serde(rename = "ctr")]
    Ctr {
        /// Rows of the embedding table: the id space every slot shares.
        vocab_size: u64,
        /// Embedding width (default 9, CTR-DNN's).
        #[serde(default = "default_ctr_dim")]
        dim: usize,
        /// Categorical slots: ids per sample (default 26, Criteo's).
        #[serde(default = "default_ctr_slots")]
        slots: usize,
        /// Dense features per sample (default 13, Criteo's).
        #[serde(default = "default_ctr_dense")]
        dense: usize,
        /// Hidden layer widths (default `[400, 400, 400]`, CTR-DNN's).
        #[serde(default = "default_ctr_hidden")]
        hidden: Vec<usize>,
    },
}

fn default_ctr_dim() -> usize {
    9
}

fn default_ctr_slots() -> usize {
    26
}

fn default_ctr_dense() -> usize {
    13
}

fn default_ctr_hidden() -> Vec<usize> {
    vec![400, 400, 400]
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

/// How a fully connected network's weights start (biases start at zero either way).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightInit {
    /// He (Kaiming) uniform, `U(-a, a)` with `a = sqrt(6 / fan_in)`, for each layer a ReLU
    /// follows; Xavier uniform for the output layer.
    #[default]
    Kaiming,
    /// Xavier (Glorot) uniform, `a = sqrt(6 / (fan_in + fan_out))`, for every layer:
    /// PaddlePaddle's `fc` default (what the side-by-side with Paddle uses).
    Xavier,
}

impl WeightInit {
    fn is_default(&self) -> bool {
        *self == WeightInit::default()
    }
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
    /// Every model kind, as written in a spec.
    pub const KINDS: [&'static str; 7] = [
        "fit_a_line",
        "linear",
        "mlp",
        "mnist_mlp",
        "mnist_cnn",
        "word2vec",
        "ctr",
    ];

    /// The model kind as written in the spec.
    pub fn kind(&self) -> &'static str {
        match self {
            ModelSpec::FitALine { .. } => "fit_a_line",
            ModelSpec::Linear { .. } => "linear",
            ModelSpec::Mlp { .. } => "mlp",
            ModelSpec::MnistMlp => "mnist_mlp",
            ModelSpec::MnistCnn => "mnist_cnn",
            ModelSpec::Word2vec { .. } => "word2vec",
            ModelSpec::Ctr { .. } => "ctr",
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
    pub fn fit_stats(&mut self, train: &[Sample]) -> Result<(), StatsError> {
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

    /// Checks that these statistics fit a model of `inputs` features: the reason when
    /// they do not.
    pub fn check(&self, inputs: usize) -> Result<(), String> {
        let spec = |reason: String| reason;
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
pub fn feature_stats(samples: &[Sample]) -> Result<Stats, StatsError> {
    let first = samples
        .first()
        .ok_or_else(|| StatsError("no samples".into()))?;
    let width = first.dense.len();
    if width == 0 {
        return Err(StatsError("samples have no dense features".into()));
    }
    let mut sum = vec![0f64; width];
    for (i, s) in samples.iter().enumerate() {
        if s.dense.len() != width {
            return Err(StatsError(format!(
                "sample {i} has {} dense features, sample 0 has {width}",
                s.dense.len()
            )));
        }
        for (j, (acc, &v)) in sum.iter_mut().zip(&s.dense).enumerate() {
            if !v.is_finite() {
                return Err(StatsError(format!(
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
    fn feature_stats_rejects_bad_sets() {
        assert!(matches!(feature_stats(&[]), Err(StatsError(_))));
        let ragged = vec![
            Sample::regression(vec![1.0, 2.0], 0.0),
            Sample::regression(vec![1.0], 0.0),
        ];
        let e = feature_stats(&ragged).unwrap_err().to_string();
        assert!(e.contains("sample 1 has 1 dense features"), "{e}");
        let nan = vec![Sample::regression(vec![f32::NAN], 0.0)];
        assert!(matches!(feature_stats(&nan), Err(StatsError(_))));
    }
}
