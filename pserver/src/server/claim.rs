//! The job's shard count and this pserver's claim of a shard index in etcd.
//!
//! `ps/desired` holds the shard count: the first pserver given one creates it, the
//! others must agree with it. `ps/<index>` is claimed under the pserver's lease (a dead
//! pserver's index frees when its lease ends) and holds its [`PserverRecord`](edl_job::PserverRecord); the key's
//! create revision is the claim's fence, so a replaced pserver cannot write after its
//! successor.

use std::time::Duration;

use edl_coord::{
    Backend, Backoff, Compare, EventKind, Fence, IndexClaim, Lease, Op, RetryPolicy, Txn,
};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::error::PsError;
use edl_job::JobKeys;

/// Creates `ps/desired` with `want` if absent; returns the job's shard count.
pub(super) async fn resolve_desired(
    backend: &dyn Backend,
    keys: &JobKeys,
    want: Option<u32>,
) -> Result<Result<u32, PsError>, edl_coord::Error> {
    let parse = |v: &[u8]| -> Result<u32, PsError> {
        std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            .filter(|n| *n > 0)
            .ok_or_else(|| {
                PsError::Config(format!(
                    "{} holds {:?}, not a shard count",
                    keys.desired(),
                    String::from_utf8_lossy(v)
                ))
            })
    };
    match want {
        Some(n) => {
            let txn = Txn::new()
                .when([Compare::absent(keys.desired())])
                .and_then([Op::put(keys.desired(), n.to_string())])
                .or_else([Op::get(keys.desired())]);
            let resp = backend.txn(txn).await?;
            if resp.succeeded {
                tracing::info!(key = %keys.desired(), shards = n, "shard count set");
                return Ok(Ok(n));
            }
            let have = resp
                .get(0)
                .and_then(|kvs| kvs.first())
                .map(|kv| parse(&kv.value));
            Ok(match have {
                Some(Ok(h)) if h == n => Ok(n),
                Some(Ok(h)) => Err(PsError::Config(format!(
                    "the job has {h} shards ({}), not {n} as --shards says",
                    keys.desired()
                ))),
                Some(Err(e)) => Err(e),
                None => Err(PsError::Config(format!("{} vanished", keys.desired()))),
            })
        }
        None => Ok(match backend.get(&keys.desired()).await? {
            Some(kv) => parse(&kv.value),
            None => Err(PsError::Config(format!(
                "{} is not set: pass the shard count (--shards)",
                keys.desired()
            ))),
        }),
    }
}

/// Claims `ps/<index>` with a create-if-absent transaction, waiting while another
/// pserver holds it.
pub(super) async fn claim_fixed(
    backend: &dyn Backend,
    keys: &JobKeys,
    index: u32,
    value: &[u8],
    lease: &Lease,
    cancel: &CancellationToken,
) -> Result<IndexClaim, PsError> {
    let key = keys.ps(index);
    let lost = lease.lost();
    let mut backoff = Backoff::new(
        RetryPolicy::forever().with_delays(Duration::from_millis(50), Duration::from_secs(1)),
    );
    loop {
        let txn = Txn::new()
            .when([Compare::absent(key.clone())])
            .and_then([Op::put_with_lease(key.clone(), value.to_vec(), lease.id())])
            .or_else([Op::get(key.clone())]);
        let attempt = tokio::select! {
            _ = cancel.cancelled() => return Err(PsError::Cancelled),
            _ = lost.cancelled() => return Err(PsError::LeaseLost(index)),
            r = backend.txn(txn) => r,
        };
        let resp = match attempt {
            Ok(r) => r,
            Err(e) if e.is_retryable() => {
                tracing::warn!(key = %key, error = %e, "claim failed; retrying");
                tokio::select! {
                    _ = lost.cancelled() => return Err(PsError::LeaseLost(index)),
                    more = backoff.wait(cancel) => if !more {
                        return Err(PsError::Cancelled);
                    },
                }
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        if resp.succeeded {
            return Ok(IndexClaim {
                index,
                fence: Fence {
                    key,
                    revision: resp.revision,
                },
            });
        }
        if let Some(kv) = resp.get(0).and_then(|kvs| kvs.first()) {
            if kv.lease == Some(lease.id()) {
                return Ok(IndexClaim {
                    index,
                    fence: Fence {
                        key,
                        revision: kv.create_revision,
                    },
                });
            }
            tracing::info!(key = %key, holder = %String::from_utf8_lossy(&kv.value), "shard index held by another pserver; waiting for its lease to end");
        }
        let watch = backend.watch_prefix(&key, Some(resp.revision + 1)).await;
        if let Ok(mut watch) = watch {
            loop {
                let ev = tokio::select! {
                    _ = cancel.cancelled() => return Err(PsError::Cancelled),
                    _ = lost.cancelled() => return Err(PsError::LeaseLost(index)),
                    ev = watch.next() => ev,
                };
                match ev {
                    Some(Ok(ev)) if ev.kind == EventKind::Delete && ev.kv.key == key => break,
                    Some(Ok(_)) => {}
                    Some(Err(_)) | None => break,
                }
            }
        } else {
            tokio::select! {
                _ = lost.cancelled() => return Err(PsError::LeaseLost(index)),
                more = backoff.wait(cancel) => if !more {
                    return Err(PsError::Cancelled);
                },
            }
        }
    }
}
