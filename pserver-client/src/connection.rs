//! Finding a shard's pserver and connecting to it: the address and claim revision come
//! from `ps/<shard>` (a live view of `ps/`); connections are cached per shard and claim
//! revision, made without holding the cache (a shard that cannot be reached stalls no
//! call to the others), and a call in flight is abandoned once `ps/<shard>` no longer
//! holds the claim it was made to.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use edl_proto::pserver as pb;
use pb::parameter_server_client::ParameterServerClient as GrpcClient;
use tokio::time::Instant;
use tonic::transport::Channel;

use crate::PsClient;
use crate::bulk;
use crate::{CONNECTION_WINDOW, MAX_FRAME, STREAM_WINDOW};
use edl_coord::PrefixView;
use edl_job::{PserverRecord, Record};

/// The connection to a shard's pserver, for the claim it was made to.
#[derive(Debug)]
pub(super) struct Conn {
    revision: i64,
    addr: String,
    target: Target,
}

/// How to reach one pserver: gRPC, and the bulk path when it offers one.
#[derive(Debug, Clone)]
pub(super) struct Target {
    pub(super) grpc: GrpcClient<Channel>,
    pub(super) bulk: Option<Arc<bulk::Pool>>,
}

impl PsClient {
    /// The record and claim revision of shard `shard`, waiting until `until`.
    pub(super) async fn locate(
        &self,
        shard: u32,
        until: Instant,
    ) -> Result<(PserverRecord, i64), String> {
        let key = self.inner.keys.ps(shard);
        let mut rx = self.inner.view.clone();
        loop {
            {
                let v = rx.borrow_and_update();
                if let Some(kv) = v.kvs.get(&key) {
                    return match PserverRecord::decode(&kv.value) {
                        Ok(r) => Ok((r, kv.create_revision)),
                        Err(e) => Err(format!("{key} holds an unreadable record: {e}")),
                    };
                }
            }
            tokio::select! {
                _ = self.inner.cancel.cancelled() => return Err("cancelled".into()),
                _ = tokio::time::sleep_until(until) => return Err(format!("no pserver holds shard {shard}")),
                r = rx.changed() => if r.is_err() { return Err("etcd follower stopped".into()) },
            }
        }
    }

    /// Resolves once `ps/<shard>` no longer holds the claim of `revision` (the pserver
    /// lost its lease or was replaced): a call in flight to it is abandoned then.
    pub(super) async fn moved(&self, shard: u32, revision: i64) {
        let key = self.inner.keys.ps(shard);
        let mut rx = self.inner.view.clone();
        let gone = |v: &Arc<PrefixView>| {
            v.revision > 0
                && v.kvs
                    .get(&key)
                    .is_none_or(|kv| kv.create_revision != revision)
        };
        if rx.wait_for(gone).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    pub(super) async fn client(&self, shard: u32, until: Instant) -> Result<(Target, i64), String> {
        let (record, revision) = self.locate(shard, until).await?;
        let addr = record.addr;
        let cached = |conns: &HashMap<u32, Conn>| {
            conns
                .get(&shard)
                .filter(|c| c.revision == revision && c.addr == addr)
                .map(|c| c.target.clone())
        };
        if let Some(target) = cached(&*self.inner.conns.lock().await) {
            return Ok((target, revision));
        }
        // Connect without holding the map: a shard that cannot be reached must not stall
        // the calls to the others.
        let endpoint = edl_proto::tls::endpoint(&addr, self.inner.cfg.tls.as_ref())
            .map_err(|e| format!("pserver at {addr:?}: {e}"))?
            .connect_timeout(self.inner.cfg.connect_timeout)
            .tcp_nodelay(true)
            .initial_stream_window_size(Some(STREAM_WINDOW))
            .initial_connection_window_size(Some(CONNECTION_WINDOW))
            .max_frame_size(Some(MAX_FRAME));
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| format!("connect to shard {shard} at {addr}: {e}"))?;
        let max = self.inner.cfg.max_message_bytes;
        let client = GrpcClient::new(channel)
            .max_decoding_message_size(max)
            .max_encoding_message_size(max);
        let cfg = &self.inner.cfg;
        let bulk = (cfg.bulk && record.bulk >= 1).then(|| {
            Arc::new(bulk::Pool::new(
                addr.clone(),
                cfg.job.to_string(),
                cfg.token.clone(),
                cfg.tls.clone(),
                cfg.connect_timeout,
                cfg.max_message_bytes,
            ))
        });
        let mut conns = self.inner.conns.lock().await;
        if let Some(target) = cached(&conns) {
            // Another call connected meanwhile: share its connection.
            return Ok((target, revision));
        }
        tracing::debug!(shard, addr = %addr, revision, bulk = bulk.is_some(), "connected to pserver");
        let target = Target { grpc: client, bulk };
        conns.insert(
            shard,
            Conn {
                revision,
                addr,
                target: target.clone(),
            },
        );
        Ok((target, revision))
    }

    pub(super) fn request<T>(&self, msg: T, timeout: Duration) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        req.set_timeout(timeout);
        edl_proto::headers::set_credentials(
            req.metadata_mut(),
            self.inner.cfg.job.as_str(),
            self.inner.cfg.token.as_deref(),
        );
        req
    }
}
