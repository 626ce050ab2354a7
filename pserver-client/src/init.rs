//! Initialising the job's parameters exactly once: trainers campaign in an etcd election
//! under short leases; the leader sends every shard its initial blocks (in messages of
//! bounded size), records `params/init` and `params/spec`, and resigns; the others adopt
//! the job's layout once it is there. Also the layout itself, read from `params/spec`.

use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backoff, Election, Lease, Op, RetryPolicy};
use edl_proto::pserver as pb;
use futures::future::join_all;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::retry::spec_mismatch;
use crate::{PsClient, PsClientError, Result};

use crate::layout::{DenseSpec, Layout, LayoutError, ParamConfig, ParamSpec, SparseSpec};
use crate::wire;
use edl_job::valid_member_id;

/// Initial values of a dense parameter.
#[derive(Debug, Clone, Copy)]
pub struct DenseInit<'a> {
    /// Unique name.
    pub name: &'a str,
    /// Shape.
    pub shape: &'a [usize],
    /// `product(shape)` values.
    pub values: &'a [f32],
}

/// Who initialised the parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InitOutcome {
    /// This call did.
    Initialised,
    /// Another trainer did (before or meanwhile); this call waited for it to finish.
    AlreadyInitialised,
}

/// The value of `params/init`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitRecord {
    /// The trainer that initialised.
    pub trainer: String,
    /// When (ms since the Unix epoch).
    pub at_ms: u64,
    /// The shard count.
    pub shards: u32,
}

impl PsClient {
    /// The layout of the initialised parameters (from `params/spec`).
    pub async fn layout(&self) -> Result<Arc<Layout>> {
        if let Some(l) = self.inner.layout.read().await.clone() {
            return Ok(l);
        }
        let Some(kv) = self
            .inner
            .backend
            .get(&self.inner.keys.params_spec())
            .await?
        else {
            return Err(PsClientError::NotInitialised(
                self.inner.cfg.job.to_string(),
            ));
        };
        let json = std::str::from_utf8(&kv.value).map_err(|_| {
            PsClientError::Spec(LayoutError::Invalid("params/spec is not UTF-8".into()))
        })?;
        let layout = Arc::new(Layout::new(ParamSpec::from_json(json)?, self.inner.shards)?);
        *self.inner.layout.write().await = Some(layout.clone());
        Ok(layout)
    }

    /// Waits (up to `within`) until some trainer initialised the parameters.
    pub async fn wait_initialised(&self, within: Duration) -> Result<Arc<Layout>> {
        let until = Instant::now() + within;
        loop {
            match self.layout().await {
                Err(PsClientError::NotInitialised(job)) => {
                    if Instant::now() >= until {
                        return Err(PsClientError::NotInitialised(job));
                    }
                    tokio::select! {
                        _ = self.inner.cancel.cancelled() => return Err(PsClientError::Cancelled),
                        _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                    }
                }
                other => return other,
            }
        }
    }

    /// Initialises the parameters unless another trainer did: trainers campaign in an
    /// etcd election under short leases; the leader initialises every shard (if
    /// `params/init` is absent), records `params/init` and `params/spec`, and resigns.
    /// Every other trainer gets [`InitOutcome::AlreadyInitialised`] once the parameters
    /// are ready. If the initialiser dies, the next candidate takes over (shards already
    /// initialised keep their values). An unavailable etcd is retried, the whole
    /// initialisation again, for up to `retry_for` (every step is safe to repeat).
    pub async fn init(
        &self,
        trainer: &str,
        dense: &[DenseInit<'_>],
        sparse: &[SparseSpec],
        config: ParamConfig,
    ) -> Result<InitOutcome> {
        let started = Instant::now();
        let mut backoff = Backoff::new(
            RetryPolicy::forever().with_delays(Duration::from_millis(100), Duration::from_secs(2)),
        );
        loop {
            match self.init_once(trainer, dense, sparse, config.clone()).await {
                Err(PsClientError::Coord(e))
                    if e.is_retryable() && started.elapsed() < self.inner.cfg.retry_for =>
                {
                    tracing::warn!(trainer, error = %e, "initialising the parameters: etcd unavailable; retrying");
                    if !backoff.wait(&self.inner.cancel).await {
                        return Err(PsClientError::Cancelled);
                    }
                }
                other => return other,
            }
        }
    }

    async fn init_once(
        &self,
        trainer: &str,
        dense: &[DenseInit<'_>],
        sparse: &[SparseSpec],
        config: ParamConfig,
    ) -> Result<InitOutcome> {
        if !valid_member_id(trainer) {
            return Err(PsClientError::InvalidArgument(format!(
                "trainer id {trainer:?} must be non-empty and contain no '/'"
            )));
        }
        let spec = ParamSpec {
            dense: dense
                .iter()
                .map(|d| DenseSpec {
                    name: d.name.to_owned(),
                    shape: d.shape.to_vec(),
                })
                .collect(),
            sparse: sparse.to_vec(),
            config,
        };
        let layout = Arc::new(Layout::new(spec, self.inner.shards)?);
        for (d, s) in dense.iter().zip(&layout.spec().dense) {
            if Some(d.values.len()) != s.numel() {
                return Err(PsClientError::InvalidArgument(format!(
                    "parameter {:?} has {} values for shape {:?}",
                    d.name,
                    d.values.len(),
                    d.shape
                )));
            }
        }
        let keys = &self.inner.keys;
        let backend = self.inner.backend.clone();
        if backend.get(&keys.params_init()).await?.is_some() {
            return self.adopt(&layout).await;
        }
        let lease = Lease::grant(
            backend.clone(),
            self.inner.cfg.init_lease_ttl,
            self.inner.cancel.child_token(),
        )
        .await?;
        let election = Election::new(backend.clone(), keys.params_init_election());
        let leadership = election
            .campaign(&lease, trainer.as_bytes().to_vec(), &self.inner.cancel)
            .await
            .map_err(|e| match e {
                edl_coord::Error::Cancelled => PsClientError::Cancelled,
                other => other.into(),
            })?;
        let result = async {
            if backend.get(&keys.params_init()).await?.is_some() {
                return self.adopt(&layout).await;
            }
            tracing::info!(
                trainer,
                shards = self.inner.shards,
                "initialising the parameters"
            );
            let sends = (0..self.inner.shards)
                .map(|s| self.init_shard(s, trainer, &layout, |p| dense[p].values));
            for r in join_all(sends).await {
                r?;
            }
            let record = InitRecord {
                trainer: trainer.to_owned(),
                at_ms: now_ms(),
                shards: self.inner.shards,
            };
            let value = serde_json::to_vec(&record).unwrap_or_default();
            leadership
                .fenced_txn(vec![
                    Op::put(keys.params_init(), value),
                    Op::put(keys.params_spec(), layout.spec().to_json()),
                ])
                .await?;
            *self.inner.layout.write().await = Some(layout.clone());
            tracing::info!(trainer, "parameters initialised");
            Ok(InitOutcome::Initialised)
        }
        .await;
        if let Err(e) = leadership.resign().await {
            tracing::debug!(error = %e, "resign failed; the lease ends anyway");
        }
        let _ = lease.revoke().await;
        result
    }

    /// Checks our spec against the job's and adopts the job's layout.
    async fn adopt(&self, ours: &Arc<Layout>) -> Result<InitOutcome> {
        let theirs = self.wait_initialised(self.inner.cfg.retry_for).await?;
        if theirs.spec() != ours.spec() {
            return Err(PsClientError::SpecMismatch(format!(
                "this trainer's spec differs from params/spec of job {}",
                self.inner.cfg.job
            )));
        }
        Ok(InitOutcome::AlreadyInitialised)
    }

    /// Sends shard `shard` its initial blocks (`values(param)` gives a parameter's
    /// values) in messages of bounded size, then `FinishInit`.
    pub(super) async fn init_shard<'v>(
        &self,
        shard: u32,
        trainer: &str,
        layout: &Layout,
        values: impl Fn(usize) -> &'v [f32],
    ) -> Result<()> {
        let spec_json = layout.spec().to_json();
        let shards = self.inner.shards;
        let mut batches: Vec<Vec<pb::DenseBlock>> = vec![Vec::new()];
        let mut size = 0usize;
        for &id in layout.shard_blocks(shard) {
            let Some(b) = layout.block(id) else { continue };
            let v = values(b.param as usize);
            let Some(slice) = v.get(b.offset..b.offset + b.len) else {
                return Err(PsClientError::InvalidArgument(format!(
                    "values of parameter {} are too short",
                    b.param
                )));
            };
            if size > 0 && size + b.len * 4 > self.inner.cfg.init_chunk_bytes {
                batches.push(Vec::new());
                size = 0;
            }
            size += b.len * 4;
            if let Some(last) = batches.last_mut() {
                last.push(pb::DenseBlock {
                    id,
                    version: 0,
                    values: wire::encode(slice),
                });
            }
        }
        for blocks in batches {
            let msg = pb::InitRequest {
                shard,
                shards,
                trainer: trainer.to_owned(),
                spec_json: spec_json.clone(),
                blocks,
            };
            let resp = self
                .call(
                    shard,
                    msg,
                    self.inner.cfg.call_timeout,
                    |t, r| async move { t.grpc.clone().init(r).await },
                    |s| spec_mismatch(s, shard),
                )
                .await?;
            if resp.already_initialised {
                return Ok(());
            }
        }
        let msg = pb::FinishInitRequest {
            shard,
            shards,
            trainer: trainer.to_owned(),
        };
        self.call(
            shard,
            msg,
            self.inner.cfg.call_timeout,
            |t, r| async move { t.grpc.clone().finish_init(r).await },
            |_| None,
        )
        .await?;
        Ok(())
    }
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
