//! Pulls from every shard in parallel: the dense blocks that changed since the cache's
//! copy, and sparse rows (both over the bulk path when the pserver offers it). A shard that
//! lost its parameters is initialised again from the cache's copy, when it has one.

use edl_proto::pserver as pb;
use futures::future::join_all;

use crate::cache::DenseCache;
use crate::error::ErrorKind;
use crate::retry::uninitialised;
use crate::wire;
use crate::{PsClient, PsClientError, Result};

/// What a pull did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PullStats {
    /// Blocks received (changed since the cache's copy).
    pub blocks: usize,
    /// Bytes of values received.
    pub bytes: usize,
    /// Sync: the step to push next (the most advanced shard's). Async: updates applied
    /// by the shards, summed.
    pub next_step: u64,
}

impl PsClient {
    /// Pulls the dense blocks that changed since `cache`'s copy from every shard in
    /// parallel. A shard that lost its parameters (restarted without a checkpoint) is
    /// initialised again from the initial values the cache was seeded with, when it was.
    pub async fn pull_dense(&self, cache: &mut DenseCache) -> Result<PullStats> {
        /// Initialisations of one shard by one pull, each after the shard was found
        /// empty again (a pserver replaced over and over): then the pull fails.
        const MAX_REINITS: u32 = 8;
        let layout = self.layout().await?;
        if cache.spec.as_ref() != Some(layout.spec()) {
            cache.reset(&layout);
        }
        let timeout = self.inner.cfg.call_timeout;
        let pulls = (0..self.inner.shards).map(|s| {
            let msg = pb::PullRequest {
                shard: s,
                shards: self.inner.shards,
                known_versions: cache.versions[s as usize].clone(),
                incarnation: cache.incarnations[s as usize],
            };
            let cache = &*cache;
            let layout = &layout;
            async move {
                let mut inits = 0;
                loop {
                    let r = self
                        .call(
                            s,
                            msg.clone(),
                            timeout,
                            |t, r| async move {
                                match &t.bulk {
                                    Some(b) => b.pull(r.into_inner(), timeout).await.map(tonic::Response::new),
                                    None => t.grpc.clone().pull(r).await,
                                }
                            },
                            |st| uninitialised(st, s),
                        )
                        .await;
                    match r {
                        Err(PsClientError::Refused { status, .. })
                            if ErrorKind::of(&status) == Some(ErrorKind::Uninitialised) =>
                        {
                            let Some(initial) = &cache.initial else {
                                return Err(PsClientError::Refused { shard: s, status });
                            };
                            inits += 1;
                            if inits > MAX_REINITS {
                                return Err(PsClientError::Refused { shard: s, status });
                            }
                            tracing::warn!(shard = s, "shard lost its parameters (no checkpoint); initialising it again from the initial values");
                            let init = self.init_shard(s, "reinit", layout, |p| {
                                initial.get(p).map_or(&[][..], |v| v.as_slice())
                            });
                            match init.await {
                                Ok(()) => {}
                                // Restored with nothing again before the initialisation
                                // finished (a new incarnation): pull and initialise it.
                                Err(PsClientError::Refused { status, .. })
                                    if ErrorKind::of(&status) == Some(ErrorKind::Uninitialised) => {}
                                Err(e) => return Err(e),
                            }
                        }
                        other => return other,
                    }
                }
            }
        });
        let responses = join_all(pulls).await;
        let mut stats = PullStats::default();
        let sync = layout.spec().config.mode.is_sync();
        for (s, resp) in responses.into_iter().enumerate() {
            let resp = resp?;
            if resp.incarnation != cache.incarnations[s] {
                cache.incarnations[s] = resp.incarnation;
                cache.versions[s].iter_mut().for_each(|v| *v = 0);
            }
            for b in resp.blocks {
                let Some(info) = layout.block(b.id).filter(|i| i.shard == s as u32) else {
                    return Err(PsClientError::InvalidArgument(format!(
                        "shard {s} sent block {} it does not hold",
                        b.id
                    )));
                };
                if Some(b.values.len()) != wire::byte_len(info.len) {
                    return Err(PsClientError::InvalidArgument(format!(
                        "shard {s} sent {} bytes for block {}",
                        b.values.len(),
                        b.id
                    )));
                }
                if let Some(p) = cache.params.get_mut(info.param as usize)
                    && let Some(dst) = p.values.get_mut(info.offset..info.offset + info.len)
                {
                    wire::decode_into(&b.values, dst);
                }
                if let Some(v) = cache.versions[s].get_mut(info.local as usize) {
                    *v = b.version;
                }
                stats.blocks += 1;
                stats.bytes += b.values.len();
            }
            if let Some(u) = cache.updates.get_mut(s) {
                *u = resp.updates;
            }
            stats.next_step = if sync {
                stats.next_step.max(resp.next_step)
            } else {
                stats.next_step + resp.updates
            };
        }
        cache.next_step = stats.next_step;
        Ok(stats)
    }

    /// Values of `rows` of sparse table `table`, row after row (`rows.len() * dim`).
    pub async fn pull_sparse(&self, table: &str, rows: &[u64]) -> Result<Vec<f32>> {
        let layout = self.layout().await?;
        let Some(ti) = layout.table_index(table) else {
            return Err(PsClientError::InvalidArgument(format!(
                "unknown table {table:?}"
            )));
        };
        let dim = layout.spec().sparse[ti].dim;
        let mut per_shard: Vec<Vec<usize>> = vec![Vec::new(); self.inner.shards as usize];
        for (i, &r) in rows.iter().enumerate() {
            per_shard[layout.row_shard(r) as usize].push(i);
        }
        let calls = per_shard
            .iter()
            .enumerate()
            .filter(|(_, idx)| !idx.is_empty())
            .map(|(s, idx)| {
                let msg = pb::PullSparseRequest {
                    shard: s as u32,
                    shards: self.inner.shards,
                    table: ti as u32,
                    rows: idx.iter().map(|&i| rows[i]).collect(),
                };
                async move {
                    let r = self
                        .call(
                            s as u32,
                            msg,
                            self.inner.cfg.call_timeout,
                            |t, r| async move {
                                match &t.bulk {
                                    Some(b) => b
                                        .pull_sparse(r.into_inner(), self.inner.cfg.call_timeout)
                                        .await
                                        .map(tonic::Response::new),
                                    None => t.grpc.clone().pull_sparse(r).await,
                                }
                            },
                            |st| uninitialised(st, s as u32),
                        )
                        .await?;
                    Ok::<_, PsClientError>((s, r.values))
                }
            });
        let mut out = vec![0f32; rows.len() * dim];
        for r in join_all(calls).await {
            let (s, values) = r?;
            let idx = &per_shard[s];
            if values.len() != idx.len() * dim * 4 {
                return Err(PsClientError::InvalidArgument(format!(
                    "shard {s} sent {} bytes for {} rows",
                    values.len(),
                    idx.len()
                )));
            }
            for (k, &i) in idx.iter().enumerate() {
                wire::decode_into(
                    &values[k * dim * 4..(k + 1) * dim * 4],
                    &mut out[i * dim..(i + 1) * dim],
                );
            }
        }
        Ok(out)
    }
}
