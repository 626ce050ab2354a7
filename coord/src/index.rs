//! Claiming an index in `[0, n)` (a pserver shard slot) under a lease.

use std::time::Duration;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::backend::Backend;
use crate::election::dir_prefix;
use crate::error::{Error, Result};
use crate::lease::Lease;
use crate::retry::{Backoff, RetryPolicy};
use crate::types::{Compare, EventKind, Fence, Op, Revision, Txn};

/// A claimed index: key `<prefix><index>`, held by the caller's lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexClaim {
    /// The index.
    pub index: u32,
    /// Fencing token of the claim: the key and its create revision (the claim
    /// revision). Writes guarded by [`Fence::compare`] fail once the claim is gone.
    pub fence: Fence,
}

impl IndexClaim {
    /// The claimed key.
    pub fn key(&self) -> &str {
        &self.fence.key
    }
}

/// Parses the index of a key below `prefix`; only canonical decimal numbers count.
fn parse_index(prefix: &str, key: &str) -> Option<u32> {
    let rest = key.strip_prefix(prefix)?;
    let i: u32 = rest.parse().ok()?;
    (i.to_string() == rest).then_some(i)
}

/// Claims the lowest free index in `[0, n)` under `prefix` with a create-if-absent
/// transaction attached to `lease`. If this lease already holds an index there,
/// that claim is returned (so a retry after an ambiguous timeout is safe). Fails
/// with [`Error::NoFreeIndex`] when every index is taken. Other keys under `prefix`
/// (not canonical numbers, or `>= n`) are ignored.
pub async fn claim_index(
    backend: &dyn Backend,
    prefix: &str,
    n: u32,
    value: impl Into<Vec<u8>>,
    lease: &Lease,
) -> Result<IndexClaim> {
    match try_claim(backend, &dir_prefix(prefix), n, &value.into(), lease).await? {
        Ok(claim) => Ok(claim),
        Err(_) => Err(Error::NoFreeIndex { n }),
    }
}

/// Like [`claim_index`], but when every index is taken waits for one to be freed
/// (a claim deleted or its lease ended) and tries again, until `cancel` fires
/// ([`Error::Cancelled`]) or the lease is lost ([`Error::LeaseLost`]). Transient
/// errors are retried with backoff; an error that retrying cannot cure (permission
/// denied, ...) is returned.
pub async fn claim_index_wait(
    backend: &dyn Backend,
    prefix: &str,
    n: u32,
    value: impl Into<Vec<u8>>,
    lease: &Lease,
    cancel: &CancellationToken,
) -> Result<IndexClaim> {
    let prefix = dir_prefix(prefix);
    let value = value.into();
    let lost = lease.lost();
    let new_backoff = || {
        Backoff::new(
            RetryPolicy::forever().with_delays(Duration::from_millis(50), Duration::from_secs(1)),
        )
    };
    let mut backoff = new_backoff();
    // Waits for the next backoff delay, or fails when cancelled or the lease is lost.
    macro_rules! pause {
        () => {{
            let delay = backoff.next_delay().unwrap_or(Duration::from_secs(1));
            tokio::select! {
                _ = cancel.cancelled() => return Err(Error::Cancelled),
                _ = lost.cancelled() => return Err(Error::LeaseLost),
                _ = tokio::time::sleep(delay) => {}
            }
        }};
    }
    loop {
        let attempt = tokio::select! {
            _ = cancel.cancelled() => return Err(Error::Cancelled),
            _ = lost.cancelled() => return Err(Error::LeaseLost),
            r = try_claim(backend, &prefix, n, &value, lease) => r,
        };
        let full_at = match attempt {
            Ok(Ok(claim)) => return Ok(claim),
            Ok(Err(rev)) => rev,
            Err(e) if e.is_retryable() => {
                tracing::debug!(prefix = %prefix, error = %e, "index claim failed; retrying");
                pause!();
                continue;
            }
            Err(e) => return Err(e),
        };
        tracing::debug!(prefix = %prefix, n, "every index taken; waiting for one to be freed");
        let watch = tokio::select! {
            _ = cancel.cancelled() => return Err(Error::Cancelled),
            _ = lost.cancelled() => return Err(Error::LeaseLost),
            w = backend.watch_prefix(&prefix, Some(full_at + 1)) => w,
        };
        let mut watch = match watch {
            Ok(w) => w,
            Err(e) if e.is_retryable() || matches!(e, Error::Compacted { .. }) => {
                tracing::debug!(prefix = %prefix, error = %e, "index watch failed; retrying");
                pause!();
                continue;
            }
            Err(e) => return Err(e),
        };
        loop {
            let item = tokio::select! {
                _ = cancel.cancelled() => return Err(Error::Cancelled),
                _ = lost.cancelled() => return Err(Error::LeaseLost),
                item = watch.next() => item,
            };
            match item {
                Some(Ok(ev))
                    if ev.kind == EventKind::Delete
                        && parse_index(&prefix, &ev.kv.key).is_some_and(|i| i < n) =>
                {
                    // Progress: a slot was freed.
                    backoff = new_backoff();
                    break;
                }
                Some(Ok(_)) => {}
                // History compacted: list again at once.
                Some(Err(Error::Compacted { .. })) => break,
                Some(Err(e)) if e.is_retryable() => {
                    tracing::debug!(prefix = %prefix, error = %e, "index watch lost; retrying");
                    pause!();
                    break;
                }
                Some(Err(e)) => return Err(e),
                None => {
                    pause!();
                    break;
                }
            }
        }
    }
}

/// One claim pass: `Ok(Ok(claim))`, or `Ok(Err(rev))` when everything was taken as
/// of revision `rev`.
async fn try_claim(
    backend: &dyn Backend,
    prefix: &str,
    n: u32,
    value: &[u8],
    lease: &Lease,
) -> Result<std::result::Result<IndexClaim, Revision>> {
    if n == 0 {
        return Err(Error::InvalidArgument(
            "cannot claim an index in an empty range".into(),
        ));
    }
    let (kvs, rev) = backend.range(prefix).await?;
    let mut taken = std::collections::BTreeSet::new();
    for kv in &kvs {
        let Some(i) = parse_index(prefix, &kv.key).filter(|i| *i < n) else {
            continue;
        };
        if kv.lease == Some(lease.id()) {
            return Ok(Ok(IndexClaim {
                index: i,
                fence: Fence {
                    key: kv.key.clone(),
                    revision: kv.create_revision,
                },
            }));
        }
        taken.insert(i);
    }
    if taken.len() >= usize::try_from(n).unwrap_or(usize::MAX) {
        return Ok(Err(rev));
    }
    for index in (0..n).filter(|i| !taken.contains(i)) {
        let key = format!("{prefix}{index}");
        let txn = Txn::new()
            .when([Compare::absent(key.clone())])
            .and_then([Op::put_with_lease(key.clone(), value, lease.id())]);
        let resp = backend.txn(txn).await?;
        if resp.succeeded {
            tracing::info!(key = %key, lease = %lease.id(), revision = resp.revision, "index claimed");
            return Ok(Ok(IndexClaim {
                index,
                fence: Fence {
                    key,
                    revision: resp.revision,
                },
            }));
        }
    }
    Ok(Err(rev))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_canonical_indices_parse() {
        assert_eq!(parse_index("ps/", "ps/0"), Some(0));
        assert_eq!(parse_index("ps/", "ps/12"), Some(12));
        assert_eq!(parse_index("ps/", "ps/desired"), None);
        assert_eq!(parse_index("ps/", "ps/01"), None);
        assert_eq!(parse_index("ps/", "ps/+1"), None);
        assert_eq!(parse_index("ps/", "other/1"), None);
    }
}
