//! The job spec ([`edl_job::JobSpec`]) as a trainer uses it: the check only a trainer can
//! make (the model builds), the data checks before a job starts, and the conversion of a
//! spec to the pservers' parameter config and the trainer runtime's config.

use std::path::Path;
use std::sync::Arc;

use edl_job::{JobSpec, SpecError};
use edl_pserver_client::ParamConfig;

use crate::RuntimeConfig;
use crate::error::Result;

/// Reads, parses, resolves and validates a TOML spec, model included.
pub fn load(path: &Path) -> std::result::Result<JobSpec, SpecError> {
    let spec = JobSpec::load(path)?;
    check(&spec).map_err(|error| SpecError::InFile {
        path: path.to_path_buf(),
        error: Box::new(error),
    })?;
    Ok(spec)
}

/// The check of a spec that needs the trainer: the built-in model's hyper-parameters
/// (by building it), if the spec names one.
pub fn check(spec: &JobSpec) -> std::result::Result<(), SpecError> {
    let Some(model) = &spec.model else {
        return Ok(());
    };
    crate::check_model(model).map_err(|e| SpecError::Invalid {
        field: "model",
        reason: e.to_string(),
    })
}

/// Computes the feature statistics of the training split when the model standardises
/// its features and has none yet.
pub fn fit_stats(spec: &mut JobSpec) -> Result<()> {
    let train = spec.data.train.patterns();
    let Some(model) = &mut spec.model else {
        return Ok(());
    };
    if !model.standardize() || model.stats().is_some() {
        return Ok(());
    }
    model.fit_stats(&crate::load_samples(&train)?)?;
    Ok(())
}

/// Checks that the first records of every file of the training and test splits fit the
/// built-in model (feature count, label kind, class ids): one error naming the file and
/// the fix when they do not. Call after [`fit_stats`]. A model of a trainer program's
/// own is not known here: its data is checked by its trainers.
pub fn check_data_fits_model(spec: &JobSpec) -> Result<()> {
    let Some(model) = &spec.model else {
        return Ok(());
    };
    let model = crate::build(model)?;
    crate::check_split(model.as_ref(), &spec.data.train.patterns())?;
    if let Some(test) = &spec.data.test {
        crate::check_split(model.as_ref(), &test.patterns())?;
    }
    Ok(())
}

/// The trainer runtime's settings for trainer `id` of the job, with the held-out split
/// `test` (read by the caller: [`crate::load_records`] of the spec's `data.test`).
pub fn runtime_config(spec: &JobSpec, id: &str, test: Option<Arc<Vec<Vec<u8>>>>) -> RuntimeConfig {
    let mut cfg = RuntimeConfig::new(id);
    cfg.batch_size = spec.train.batch_size;
    cfg.seed = spec.train.seed;
    cfg.test = test;
    cfg.eval_batch_size = spec.train.eval_batch_size;
    cfg.batches_per_push = spec.train.batches_per_push;
    cfg
}

/// The pservers' configuration: the spec's mode and optimizer (converted by
/// `edl_job`), and the block size.
pub fn param_config(spec: &JobSpec) -> ParamConfig {
    let mut cfg = ParamConfig::new(spec.train.mode(), spec.train.optimizer_config());
    if let Some(b) = spec.train.block_size {
        cfg.block_size = b;
    }
    cfg
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINE: &str = r#"
name = "wine"
[data]
train = "/data/wine-*.recordio"
[model]
kind = "mlp"
inputs = 13
hidden = [32]
classes = 3
standardize = true
[train]
mode = "sync"
optimizer = "adam"
"#;

    #[test]
    fn a_spec_becomes_the_pservers_config() {
        let spec = JobSpec::parse_toml(WINE).expect("valid");
        assert!(param_config(&spec).mode.is_sync());
        assert_eq!(
            param_config(&spec).optimizer.kind,
            match edl_pserver_client::OptimizerKind::adam() {
                k @ edl_pserver_client::OptimizerKind::Adam { .. } => k,
                _ => unreachable!(),
            }
        );
    }

    #[test]
    fn the_trainer_check_names_the_model_and_the_spec_names_the_optimizer() {
        let bad = JobSpec::parse_toml(&WINE.replace("hidden = [32]", "hidden = [0]")).unwrap();
        let e = check(&bad).expect_err("bad model");
        assert!(e.to_string().starts_with("model: "), "{e}");
        let mut bad = JobSpec::parse_toml(&format!("{WINE}momentum = 1.5\n")).unwrap();
        bad.train.optimizer = edl_job::spec::OptimizerName::Momentum;
        let e = bad.validate().expect_err("bad momentum");
        assert!(e.to_string().starts_with("train: "), "{e}");
    }
}
