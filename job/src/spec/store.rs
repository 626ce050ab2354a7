//! The job spec in etcd: versioned JSON at `job/spec`, stored once ([`JobSpec::publish`])
//! and read by every trainer and by `edl status`/`scale`/`kill` ([`JobSpec::fetch`],
//! [`JobSpec::from_stored`]).
//!
//! The stored value is [`StoredSpec`]: `{"version": 2, "spec": {...}}` (version 2 added
//! `[trainer]` and made `model` optional; version 1 is still read). A reader refuses a
//! newer version with an error that says so.

use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, Compare, Op, Txn, retry_startup};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::{JobSpec, SpecError};
use crate::keys::JobKeys;
use crate::name::JobName;

/// The version of the stored spec this build writes and reads.
pub const SPEC_VERSION: u32 = 2;

/// The value at `job/spec`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredSpec {
    /// [`SPEC_VERSION`].
    pub version: u32,
    /// The spec, paths resolved and feature statistics filled in.
    pub spec: JobSpec,
}

impl JobSpec {
    /// The bytes stored at `job/spec`.
    pub fn to_stored(&self) -> Vec<u8> {
        let stored = StoredSpec {
            version: SPEC_VERSION,
            spec: self.clone(),
        };
        // Plain data (strings, numbers, finite floats) always serialises.
        serde_json::to_vec(&stored).unwrap_or_default()
    }

    /// Reads the value stored at `job/spec` and validates it.
    pub fn from_stored(bytes: &[u8]) -> Result<JobSpec, SpecError> {
        let stored_err = |reason: String| SpecError::Stored {
            key: "job/spec".into(),
            reason,
        };
        #[derive(Deserialize)]
        struct Version {
            version: u32,
        }
        let v: Version = serde_json::from_slice(bytes)
            .map_err(|e| stored_err(format!("not a stored spec: {e}")))?;
        if v.version > SPEC_VERSION {
            return Err(stored_err(format!(
                "version {} is newer than this edl reads ({SPEC_VERSION}); upgrade edl",
                v.version
            )));
        }
        let stored: StoredSpec =
            serde_json::from_slice(bytes).map_err(|e| stored_err(e.to_string()))?;
        stored.spec.validate()?;
        Ok(stored.spec)
    }

    /// Stores this spec as the job's spec unless one is stored; returns the stored one
    /// (which must be equal to this one, apart from feature statistics and the cluster
    /// section, or it is [`SpecError::Exists`]).
    pub async fn publish(&self, backend: &Arc<dyn Backend>) -> Result<JobSpec, SpecError> {
        let key = JobKeys::new(&self.name).spec();
        let txn = Txn::new()
            .when(vec![Compare::absent(&key)])
            .and_then(vec![Op::put(&key, self.to_stored())])
            .or_else(vec![Op::get(&key)]);
        let resp = backend.txn(txn).await.map_err(|error| SpecError::Etcd {
            what: "store the job spec in etcd",
            error,
        })?;
        if resp.succeeded {
            return Ok(self.clone());
        }
        let stored = match resp.get(0).and_then(|kvs| kvs.first()) {
            Some(kv) => JobSpec::from_stored(&kv.value)?,
            None => {
                return Err(SpecError::Stored {
                    key,
                    reason: "vanished while storing it".into(),
                });
            }
        };
        let mut a = stored.clone();
        let mut b = self.clone();
        for m in [&mut a.model, &mut b.model].into_iter().flatten() {
            m.clear_stats();
        }
        // The cluster section is how this run is laid out, not what the job computes.
        a.cluster = b.cluster.clone();
        if a != b {
            return Err(SpecError::Exists {
                job: self.name.to_string(),
                key,
            });
        }
        Ok(stored)
    }

    /// Reads the job's stored spec, if there is one.
    pub async fn get(
        backend: &Arc<dyn Backend>,
        job: &JobName,
    ) -> Result<Option<JobSpec>, SpecError> {
        let key = JobKeys::new(job).spec();
        match backend.get(&key).await {
            Ok(Some(kv)) => JobSpec::from_stored(&kv.value).map(Some),
            Ok(None) => Ok(None),
            Err(error) => Err(SpecError::Etcd {
                what: "read the job spec",
                error,
            }),
        }
    }

    /// Reads the job's stored spec, waiting up to `wait` for one to appear. An
    /// unavailable etcd is retried for up to `etcd_wait` at a time
    /// ([`edl_coord::retry_startup`]); any other etcd error, and a stored spec that is not
    /// valid, fail at once.
    pub async fn fetch(
        backend: &Arc<dyn Backend>,
        job: &JobName,
        wait: Duration,
        etcd_wait: Duration,
        cancel: &CancellationToken,
    ) -> Result<JobSpec, SpecError> {
        let key = JobKeys::new(job).spec();
        let until = tokio::time::Instant::now() + wait;
        loop {
            let read =
                retry_startup("read the job spec", etcd_wait, cancel, || backend.get(&key)).await;
            match read {
                Ok(Some(kv)) => return JobSpec::from_stored(&kv.value),
                Ok(None) => {}
                Err(edl_coord::Error::Cancelled) => return Err(SpecError::Cancelled),
                Err(error) => {
                    return Err(SpecError::Etcd {
                        what: "read the job spec",
                        error,
                    });
                }
            }
            if tokio::time::Instant::now() >= until {
                return Err(SpecError::Missing {
                    job: job.to_string(),
                    key,
                    wait,
                });
            }
            tokio::select! {
                _ = cancel.cancelled() => return Err(SpecError::Cancelled),
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    }
}
