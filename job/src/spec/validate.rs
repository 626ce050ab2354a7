//! [`JobSpec::validate`]: every value of a spec checked, and [`SpecError`], the spec's one
//! error type (parse, validation and storage).

use std::path::PathBuf;
use std::time::Duration;

use super::{JobSpec, MAX_PSERVERS};

/// The most batches a trainer sums into one push (`train.batches_per_push`).
pub const MAX_BATCHES_PER_PUSH: u32 = 1024;

/// Why a job spec cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// The file cannot be read.
    #[error("read job spec {}: {error}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        error: String,
    },
    /// An error in a spec file (the file named once, around the inner error).
    #[error("job spec {}: {error}", path.display())]
    InFile {
        /// The file.
        path: PathBuf,
        /// What is wrong in it.
        error: Box<SpecError>,
    },
    /// Not valid TOML, or an unknown, missing or mistyped key.
    #[error("{}{message}", at.map_or(String::new(), |(l, c)| format!("line {l}, column {c}: ")))]
    Syntax {
        /// Line and column (1-based), when known.
        at: Option<(usize, usize)>,
        /// The parser's message (names the key).
        message: String,
    },
    /// A value out of range.
    #[error("{field}: {reason}")]
    Invalid {
        /// The key, e.g. `train.passes`.
        field: &'static str,
        /// What it must be.
        reason: String,
    },
    /// The spec stored in etcd cannot be read.
    #[error("the stored job spec at {key}: {reason}")]
    Stored {
        /// Its key.
        key: String,
        /// Why.
        reason: String,
    },
    /// Another spec is stored under the same job name.
    #[error(
        "job {job} already exists in etcd with a different spec (at {key}); use another name \
         or remove the old job's keys"
    )]
    Exists {
        /// The job.
        job: String,
        /// The key of the stored spec.
        key: String,
    },
    /// No spec appeared in time.
    #[error(
        "job {job} has no spec at {key} after {wait:?} (start it with `edl run`, or pass --spec)"
    )]
    Missing {
        /// The job.
        job: String,
        /// The key waited on.
        key: String,
        /// How long.
        wait: Duration,
    },
    /// Waiting was cancelled.
    #[error("cancelled while waiting for the job spec")]
    Cancelled,
    /// etcd failed.
    #[error("{what}: {error}")]
    Etcd {
        /// What was being done.
        what: &'static str,
        /// The error.
        error: edl_coord::Error,
    },
}

fn invalid(field: &'static str, reason: impl Into<String>) -> SpecError {
    SpecError::Invalid {
        field,
        reason: reason.into(),
    }
}

fn ensure(ok: bool, field: &'static str, reason: &str) -> Result<(), SpecError> {
    if ok {
        Ok(())
    } else {
        Err(invalid(field, reason))
    }
}

impl JobSpec {
    /// Checks every value this crate can check. (The model's hyper-parameters are
    /// checked by the trainer, by building the model: `edl_trainer::job::check`.)
    pub fn validate(&self) -> Result<(), SpecError> {
        ensure(
            !self.data.train.patterns().is_empty(),
            "data.train",
            "no files given",
        )?;
        if self.model.is_none() && self.trainer.entry.is_empty() {
            return Err(invalid(
                "model",
                "missing: name a built-in model ([model] kind = \"mlp\", ...), or run your own \
                 trainer program ([trainer] entry = [\"path/to/program\", ...])",
            ));
        }
        ensure(
            self.trainer.entry.first().is_none_or(|p| !p.is_empty()),
            "trainer.entry",
            "the program (the first element) is empty",
        )?;
        ensure(
            self.trainer.register_within() >= Duration::from_secs(1),
            "trainer.register_within",
            "must be at least 1s",
        )?;
        let t = &self.train;
        ensure(t.passes >= 1, "train.passes", "must be at least 1")?;
        ensure(t.batch_size >= 1, "train.batch_size", "must be at least 1")?;
        ensure(
            t.eval_batch_size >= 1,
            "train.eval_batch_size",
            "must be at least 1",
        )?;
        let fixed = match t.batches_per_push {
            super::PerPush::Fixed(n) => n,
            super::PerPush::Adaptive => 1,
        };
        ensure(
            (1..=MAX_BATCHES_PER_PUSH).contains(&fixed),
            "train.batches_per_push",
            "must be 1..=1024 or \"adaptive\"",
        )?;
        ensure(
            fixed == 1 || !t.mode().is_sync(),
            "train.batches_per_push",
            "merges asynchronous pushes; sync mode steps one batch per trainer (set mode = \"async\" or remove it)",
        )?;
        ensure(
            t.learning_rate.is_finite() && t.learning_rate > 0.0,
            "train.learning_rate",
            "must be a positive number",
        )?;
        t.optimizer_config()
            .validate()
            .map_err(|e| invalid("train", e.to_string()))?;
        let c = &self.cluster;
        ensure(c.masters >= 1, "cluster.masters", "must be at least 1")?;
        ensure(
            (1..=MAX_PSERVERS).contains(&c.pservers),
            "cluster.pservers",
            "must be 1..=256",
        )?;
        ensure(
            (1..=8).contains(&c.pserver_replicas),
            "cluster.pserver_replicas",
            "must be 1..=8",
        )?;
        ensure(
            c.min_trainers >= 1,
            "cluster.min_trainers",
            "must be at least 1",
        )?;
        if !(c.min_trainers <= c.trainers && c.trainers <= c.max_trainers()) {
            return Err(invalid(
                "cluster",
                format!(
                    "need min_trainers <= trainers <= max_trainers ({} <= {} <= {})",
                    c.min_trainers,
                    c.trainers,
                    c.max_trainers()
                ),
            ));
        }
        ensure(
            c.lease_ttl >= Duration::from_secs(1),
            "cluster.lease_ttl",
            "must be at least 1s",
        )?;
        ensure(
            c.healthy_after >= Duration::from_secs(1),
            "cluster.healthy_after",
            "must be at least 1s",
        )?;
        ensure(
            c.min_task_timeout >= Duration::from_secs(1),
            "cluster.min_task_timeout",
            "must be at least 1s",
        )?;
        ensure(
            c.checkpoint_keep >= 1,
            "cluster.checkpoint_keep",
            "must be at least 1",
        )?;
        Ok(())
    }
}
