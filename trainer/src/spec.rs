//! Building a model from its [`ModelSpec`] (the description lives in `edl_job::model`):
//! [`build`], [`build_on`] and [`check_model`].

use candle_core::{DType, Device};
use edl_job::model::{ModelSpec, Stats};

use crate::dense::DenseModel;
use crate::error::{Error, Result};
use crate::model::Model;
use crate::word2vec::Word2Vec;

/// Checks a model spec's hyper-parameters without data: like [`build`], but a spec that
/// standardises and has no statistics yet is accepted (they are computed later).
pub fn check_model(spec: &ModelSpec) -> Result<()> {
    let mut spec = spec.clone();
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
        ModelSpec::Ctr {
            vocab_size,
            dim,
            slots,
            dense,
            hidden,
        } => Box::new(crate::ctr::Ctr::new(
            crate::ctr::CtrConfig {
                vocab_size: *vocab_size,
                dim: *dim,
                slots: *slots,
                dense: *dense,
                hidden: hidden.clone(),
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
}
