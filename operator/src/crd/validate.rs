//! The operator's check of a TrainingJob: the job spec its processes read, or the field
//! at fault ([`InvalidJob`]).

use edl_job::spec::Globs;
use edl_job::{JobName, JobSpec};

use super::{TrainingJob, TrainingJobSpec};
use crate::crd::DATA_MOUNT;

/// A TrainingJob's spec that cannot run, with the field at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct InvalidJob {
    /// The field, as a path in the resource (`spec.cluster.trainers`).
    pub field: String,
    /// What is wrong and how to fix it.
    pub message: String,
}

impl InvalidJob {
    pub(crate) fn new(field: impl Into<String>, message: impl Into<String>) -> InvalidJob {
        InvalidJob {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Checks the job's object URLs (data globs, `cluster.checkpoint_dir`): each parses,
/// the checkpoints are not at a path (in a pod, lost with it), and the store's
/// credentials come from `storageSecret`.
fn check_storage(s: &TrainingJobSpec) -> Result<(), InvalidJob> {
    let mut urls: Vec<(&str, String)> = Vec::new();
    for p in s.data.train.patterns() {
        urls.push(("spec.data.train", p));
    }
    for p in s.data.test.iter().flat_map(Globs::patterns) {
        urls.push(("spec.data.test", p));
    }
    if let Some(l) = &s.etcd.snapshots.location {
        if !l.contains("://") {
            return Err(InvalidJob::new(
                "spec.etcd.snapshots.location",
                format!("{l:?}: snapshots go to an object URL (s3://, gs://, az://)"),
            ));
        }
        urls.push(("spec.etcd.snapshots.location", l.clone()));
    }
    if let Some(dir) = &s.cluster.checkpoint_dir {
        if !dir.contains("://") {
            return Err(InvalidJob::new(
                "spec.cluster.checkpoint_dir",
                format!(
                    "{dir:?}: on a cluster checkpoints go to an object URL (s3://, gs://, \
                     az://); for a volume, leave it unset and use spec.volumes.checkpoints"
                ),
            ));
        }
        urls.push(("spec.cluster.checkpoint_dir", dir.clone()));
    }
    let mut objects = false;
    for (field, url) in urls.iter().filter(|(_, u)| u.contains("://")) {
        let location = edl_storage::Location::parse(url)
            .map_err(|e| InvalidJob::new(*field, e.to_string()))?;
        objects |= location.is_object();
    }
    if objects && s.storage_secret.is_none() {
        return Err(InvalidJob::new(
            "spec.storageSecret",
            "the job's data or checkpoints are object URLs: name the Secret with the \
             store's credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...) in \
             spec.storageSecret",
        ));
    }
    Ok(())
}

/// Checks `spec.etcd.snapshots`: only for a managed etcd (a shared etcd is its
/// admins' to back up), a positive period and count.
fn check_snapshots(s: &TrainingJobSpec) -> Result<(), InvalidJob> {
    let snap = &s.etcd.snapshots;
    if !s.etcd.managed && *snap != super::EtcdSnapshots::default() {
        return Err(InvalidJob::new(
            "spec.etcd.snapshots",
            "only with etcd.managed: a shared etcd is backed up by its administrators",
        ));
    }
    if let Some(every) = &snap.every {
        match humantime::parse_duration(every) {
            Ok(d) if !d.is_zero() => {}
            _ => {
                return Err(InvalidJob::new(
                    "spec.etcd.snapshots.every",
                    format!("{every:?}: give a positive time, such as \"30m\" or \"1h\""),
                ));
            }
        }
    }
    if snap.keep == Some(0) {
        return Err(InvalidJob::new(
            "spec.etcd.snapshots.keep",
            "0: keep at least 1 (or set disabled: true)",
        ));
    }
    Ok(())
}

/// The longest job name the operator accepts: pod names add `-pserver-NNN`, and a pod
/// name is a DNS label (63 characters).
pub const MAX_NAME: usize = 40;

impl TrainingJob {
    /// The job spec the job's processes read from etcd: the resource's name and tables,
    /// data paths relative to the data volume's mount, checked as `edl run` checks a
    /// file. Errors name the field in the resource.
    pub fn job_spec(&self) -> Result<JobSpec, InvalidJob> {
        let name = self.metadata.name.clone().unwrap_or_default();
        if name.is_empty()
            || name.len() > MAX_NAME
            || !name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            || name.starts_with('-')
            || name.ends_with('-')
        {
            return Err(InvalidJob::new(
                "metadata.name",
                format!(
                    "{name:?}: use 1 to {MAX_NAME} lowercase letters, digits and '-' \
                     (a DNS label, as the job's pod names are)"
                ),
            ));
        }
        let job =
            JobName::new(name).map_err(|e| InvalidJob::new("metadata.name", e.to_string()))?;
        let s = &self.spec;
        if !s.cluster.etcd.is_empty() {
            return Err(InvalidJob::new(
                "spec.cluster.etcd",
                "not used on a cluster: set spec.etcd.endpoints (or spec.etcd.managed)",
            ));
        }
        if s.data.prepare.is_some() {
            return Err(InvalidJob::new(
                "spec.data.prepare",
                "not run on a cluster: convert the data with `edl data convert` into the \
                 data volume, and give its RecordIO globs in spec.data.train",
            ));
        }
        if s.etcd.managed && (s.etcd.members.is_multiple_of(2) || s.etcd.members > 7) {
            return Err(InvalidJob::new(
                "spec.etcd.members",
                format!(
                    "{}: use 1, 3, 5 or 7 (an odd count: an even one tolerates no more \
                     losses than the odd count below it)",
                    s.etcd.members
                ),
            ));
        }
        if s.etcd.managed && s.etcd.tls.is_some() {
            return Err(InvalidJob::new(
                "spec.etcd.tls",
                "only with etcd.endpoints: a managed etcd speaks the job's own mutual TLS",
            ));
        }
        if s.etcd.endpoints.is_empty() != s.etcd.managed {
            return Err(InvalidJob::new(
                "spec.etcd",
                "set exactly one of etcd.endpoints and etcd.managed",
            ));
        }
        check_snapshots(s)?;
        check_storage(s)?;
        // What the schema keeps as written must be what its field says.
        let p = &s.placement;
        for (role, placement) in [
            ("all", &p.all),
            ("master", &p.master),
            ("pserver", &p.pserver),
            ("trainer", &p.trainer),
            ("etcd", &p.etcd),
        ] {
            if let Some(placement) = placement {
                placement.read(&format!("spec.placement.{role}"))?;
            }
        }
        // An object URL (`s3://...`) is not a path relative to the data volume.
        let relative = |g: &Globs| {
            g.patterns()
                .iter()
                .any(|p| !std::path::Path::new(p).is_absolute() && !p.contains("://"))
        };
        if s.volumes.data.is_none()
            && (relative(&s.data.train) || s.data.test.as_ref().is_some_and(relative))
        {
            return Err(InvalidJob::new(
                "spec.volumes.data",
                "relative data globs are relative to the data volume: set \
                 spec.volumes.data (a claimName or a hostPath)",
            ));
        }
        let mut spec = JobSpec {
            name: job,
            data: s.data.clone(),
            model: s.model.clone(),
            trainer: s.trainer.clone(),
            train: s.train.clone(),
            cluster: s.cluster.clone(),
        };
        // `trainers` 0 holds the job without trainers: a scale, not a job file's
        // starting count, which is at least the minimum.
        if spec.cluster.trainers == 0 {
            spec.cluster.trainers = spec.cluster.min_trainers;
        }
        // Trainer programs run from the image; only the data is on the volume.
        let entry = std::mem::take(&mut spec.trainer.entry);
        spec.resolve_paths(std::path::Path::new(DATA_MOUNT));
        spec.trainer.entry = entry;
        spec.cluster.etcd = s.etcd.endpoints.clone();
        spec.validate().map_err(|e| {
            let text = e.to_string();
            // SpecError names the key as `table.key`; the resource nests it under spec.
            let field = text
                .split(':')
                .next()
                .filter(|f| !f.contains(' ') && f.contains('.'))
                .map_or_else(|| "spec".to_owned(), |f| format!("spec.{f}"));
            InvalidJob::new(field, text)
        })?;
        Ok(spec)
    }
}
