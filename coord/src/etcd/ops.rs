//! The [`Backend`] operations on etcd, each one request through [`EtcdBackend::call`].

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use edl_proto::etcd::etcdserverpb::{self as pb, watch_request};

use super::codec::{
    decode_kv, decode_kvs, decode_txn, delete_prefix_request, delete_request, encode_txn,
    prefix_range, put_request, range_one, revision_of, secs, ttl_secs,
};
use super::failure::status_failure;
use super::watch::{EtcdWatch, decode_watch_response};
use super::{EtcdBackend, MAX_RANGE_PAGE_KEYS, RANGE_PAGE_BYTES, RANGE_PAGE_SIZE, Resend};
use crate::backend::{Backend, WatchStream};
use crate::error::{Error, Result};
use crate::types::{FreedSpace, KeyValue, LeaseGrant, LeaseId, Revision, Txn, TxnResponse};
use edl_proto::etcd::mvccpb;

#[async_trait]
impl Backend for EtcdBackend {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        self.call("get", Resend::Always, |mut c| async move {
            let resp = c.kv.range(range_one(key.as_bytes())).await?.into_inner();
            Ok(match resp.kvs.into_iter().next() {
                Some(kv) => Some(decode_kv(kv)?),
                None => None,
            })
        })
        .await
    }

    async fn range(&self, prefix: &str) -> Result<(Vec<KeyValue>, Revision)> {
        // Pages of RANGE_PAGE_SIZE keys at first, then of about RANGE_PAGE_BYTES (up to
        // MAX_RANGE_PAGE_KEYS keys); the later pages read at the revision of the first,
        // so the result is one snapshot. If that revision is compacted away
        // meanwhile, start over (a few times).
        let (start, end) = prefix_range(prefix);
        let mut restarts = 0;
        'snapshot: loop {
            let mut kvs = Vec::new();
            let mut revision: Revision = 0;
            let mut from = start.clone();
            let mut limit = RANGE_PAGE_SIZE;
            loop {
                let page = self
                    .call("range", Resend::Always, |mut c| {
                        let req = pb::RangeRequest {
                            key: from.clone(),
                            range_end: end.clone(),
                            limit,
                            revision,
                            ..Default::default()
                        };
                        async move {
                            let resp = c.kv.range(req).await?.into_inner();
                            let rev = revision_of(resp.header.as_ref());
                            Ok((resp.kvs, resp.more, rev))
                        }
                    })
                    .await;
                match page {
                    Ok((page, more, rev)) => {
                        if revision == 0 {
                            revision = rev;
                        }
                        limit = next_page_keys(&page, limit);
                        let next = page.last().map(|kv| {
                            let mut k = kv.key.clone();
                            k.push(0);
                            k
                        });
                        kvs.extend(decode_kvs(page)?);
                        match next {
                            Some(next) if more => from = next,
                            _ => return Ok((kvs, revision)),
                        }
                    }
                    Err(Error::InvalidArgument(msg))
                        if msg.contains("decoded message length too large") && limit > 1 =>
                    {
                        // Large values: fewer keys per page.
                        limit = (limit / 4).max(1);
                        tracing::debug!(
                            prefix,
                            limit,
                            "etcd range page too large; shrinking pages"
                        );
                    }
                    Err(Error::InvalidArgument(msg))
                        if revision != 0 && msg.contains("compacted") && restarts < 3 =>
                    {
                        restarts += 1;
                        tracing::debug!(
                            prefix,
                            revision,
                            "etcd range revision compacted between pages; starting over"
                        );
                        continue 'snapshot;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision> {
        self.call("put", Resend::IfNotSent, |mut c| {
            let req = put_request(key, value.clone(), lease);
            async move {
                let resp = c.kv.put(req).await?.into_inner();
                Ok(revision_of(resp.header.as_ref()))
            }
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<bool> {
        self.call("delete", Resend::IfNotSent, |mut c| async move {
            Ok(c.kv
                .delete_range(delete_request(key))
                .await?
                .into_inner()
                .deleted
                > 0)
        })
        .await
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<u64> {
        self.call("delete_prefix", Resend::IfNotSent, |mut c| async move {
            let resp =
                c.kv.delete_range(delete_prefix_request(prefix))
                    .await?
                    .into_inner();
            Ok(u64::try_from(resp.deleted).unwrap_or(0))
        })
        .await
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResponse> {
        let mut resp = self
            .call("txn", Resend::IfNotSent, |mut c| {
                let t = encode_txn(&txn);
                async move { Ok(decode_txn(c.kv.txn(t).await?.into_inner())?) }
            })
            .await?;
        // Nested responses carry no header: give them the transaction's revision.
        let rev = resp.revision;
        resp.set_revision(rev);
        Ok(resp)
    }

    async fn compact(&self, revision: Revision) -> Result<()> {
        self.call("compact", Resend::Always, |mut c| async move {
            c.kv.compact(pb::CompactionRequest {
                revision,
                // Returns once the history is gone from the database, not only from
                // the index: a defragmentation right after then frees its pages.
                physical: true,
            })
            .await?;
            Ok(())
        })
        .await
    }

    async fn free_space(&self) -> Result<FreedSpace> {
        self.free_space_now().await
    }

    async fn lease_grant(&self, ttl: Duration) -> Result<LeaseGrant> {
        let ttl = ttl_secs(ttl)?;
        self.call("lease_grant", Resend::IfNotSent, |mut c| async move {
            let resp = c
                .lease
                .lease_grant(pb::LeaseGrantRequest { ttl, id: 0 })
                .await?
                .into_inner();
            if !resp.error.is_empty() {
                return Err(Error::Etcd(format!("lease grant: {}", resp.error)).into());
            }
            Ok(LeaseGrant {
                id: LeaseId(resp.id),
                ttl: secs(resp.ttl),
            })
        })
        .await
    }

    async fn lease_keep_alive_once(&self, id: LeaseId) -> Result<Option<Duration>> {
        self.call("lease_keep_alive", Resend::Always, |mut c| async move {
            // One renewal on a keep-alive stream that ends after it: etcd answers it
            // (TTL 0 when the lease is gone), then closes the stream.
            let request = pb::LeaseKeepAliveRequest { id: id.0 };
            let mut stream = match c.lease.lease_keep_alive(tokio_stream::once(request)).await {
                Ok(s) => s.into_inner(),
                Err(status) => {
                    let f = status_failure(&status);
                    return match f.error {
                        Error::LeaseLost => Ok(None),
                        _ => Err(f),
                    };
                }
            };
            match stream.message().await {
                Ok(Some(resp)) if resp.ttl > 0 => Ok(Some(secs(resp.ttl))),
                Ok(Some(_)) => Ok(None),
                Ok(None) => {
                    Err(Error::unavailable(String::new(), "lease keep-alive stream closed").into())
                }
                Err(status) => {
                    let f = status_failure(&status);
                    match f.error {
                        Error::LeaseLost => Ok(None),
                        _ => Err(f),
                    }
                }
            }
        })
        .await
    }

    async fn lease_revoke(&self, id: LeaseId) -> Result<()> {
        match self
            .call("lease_revoke", Resend::Always, |mut c| async move {
                c.lease
                    .lease_revoke(pb::LeaseRevokeRequest { id: id.0 })
                    .await?;
                Ok(())
            })
            .await
        {
            Err(Error::LeaseLost) => Ok(()),
            other => other,
        }
    }

    async fn lease_ttl(&self, id: LeaseId) -> Result<Option<Duration>> {
        self.call("lease_ttl", Resend::Always, |mut c| async move {
            let resp = c
                .lease
                .lease_time_to_live(pb::LeaseTimeToLiveRequest {
                    id: id.0,
                    keys: false,
                })
                .await?
                .into_inner();
            Ok((resp.ttl >= 0).then(|| secs(resp.ttl)))
        })
        .await
    }

    async fn watch_prefix(
        &self,
        prefix: &str,
        start_revision: Option<Revision>,
    ) -> Result<WatchStream> {
        let (requests, ws, buf, pending_err) = self
            .call("watch", Resend::Always, |mut c| async move {
                let (key, range_end) = prefix_range(prefix);
                let create = pb::WatchCreateRequest {
                    key,
                    range_end,
                    start_revision: start_revision.filter(|r| *r > 0).unwrap_or(0),
                    ..Default::default()
                };
                // The request side stays open for as long as the watch is read.
                let (requests, rx) = tokio::sync::mpsc::channel(1);
                requests
                    .send(pb::WatchRequest {
                        request_union: Some(watch_request::RequestUnion::CreateRequest(create)),
                    })
                    .await
                    .map_err(|_| Error::Etcd("watch request channel closed".into()))?;
                let mut ws = c
                    .watch
                    .watch(tokio_stream::wrappers::ReceiverStream::new(rx))
                    .await?
                    .into_inner();
                // Wait for the server to confirm, so the watch is in place on return.
                let Some(first) = ws.message().await? else {
                    return Err(Error::unavailable(String::new(), "watch stream closed").into());
                };
                let mut buf = VecDeque::new();
                let pending_err = decode_watch_response(first, &mut buf).err();
                Ok((requests, ws, buf, pending_err))
            })
            .await?;
        let pinned = self.inner.pinned.load(Ordering::Relaxed) % self.inner.slots.len();
        let state = EtcdWatch {
            _requests: requests,
            ws,
            buf,
            pending_err,
            done: false,
            endpoint: self.inner.slots[pinned].endpoint.clone(),
        };
        Ok(Box::pin(futures::stream::unfold(
            state,
            EtcdWatch::next_item,
        )))
    }
}

/// Keys to ask for in the next page: about [`RANGE_PAGE_BYTES`] at the mean size of the
/// keys and values of `page`, between [`RANGE_PAGE_SIZE`] and [`MAX_RANGE_PAGE_KEYS`],
/// and never more than four times `limit` (a page of small values may be followed by
/// large ones; a page too large is shrunk on etcd's refusal).
fn next_page_keys(page: &[mvccpb::KeyValue], limit: i64) -> i64 {
    if page.is_empty() {
        return limit;
    }
    let bytes: usize = page.iter().map(|kv| kv.key.len() + kv.value.len()).sum();
    let mean = (bytes / page.len()).max(1);
    let fit = (RANGE_PAGE_BYTES / mean) as i64;
    fit.min(limit.saturating_mul(4))
        .clamp(RANGE_PAGE_SIZE.min(limit), MAX_RANGE_PAGE_KEYS)
}
