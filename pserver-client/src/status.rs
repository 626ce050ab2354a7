//! Status of the shards: through etcd and the client's connections, or from one address
//! directly ([`probe`]).

use std::time::Duration;

use edl_proto::pserver as pb;
use futures::future::join_all;
use pb::parameter_server_client::ParameterServerClient as GrpcClient;

use crate::{PsClient, PsClientError, Result};

impl PsClient {
    /// The status of every shard, by index.
    pub async fn status(&self) -> Vec<Result<pb::StatusResponse>> {
        let calls = (0..self.inner.shards).map(|s| {
            self.call(
                s,
                pb::StatusRequest {},
                self.inner.cfg.call_timeout,
                |t, r| async move { t.grpc.clone().status(r).await },
                |_| None,
            )
        });
        join_all(calls).await
    }

    /// The status of one shard.
    pub async fn shard_status(&self, shard: u32) -> Result<pb::StatusResponse> {
        self.call(
            shard,
            pb::StatusRequest {},
            self.inner.cfg.call_timeout,
            |t, r| async move { t.grpc.clone().status(r).await },
            |_| None,
        )
        .await
    }
}

/// Asks the pserver at `addr` for its status directly (no etcd lookup, no retry): for
/// operators and tests. A pserver that lost its lease answers with a
/// [`ErrorKind::NotServing`] refusal.
///
/// [`ErrorKind::NotServing`]: crate::error::ErrorKind::NotServing
pub async fn probe(
    addr: &str,
    job: &str,
    token: Option<&str>,
    tls: Option<&edl_proto::tls::Tls>,
    timeout: Duration,
) -> Result<pb::StatusResponse> {
    let connect_err = |msg: String| PsClientError::Connect {
        addr: addr.to_owned(),
        msg,
    };
    let endpoint = edl_proto::tls::endpoint(addr, tls)
        .map_err(|e| connect_err(e.to_string()))?
        .connect_timeout(timeout)
        .timeout(timeout);
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| connect_err(e.to_string()))?;
    let mut req = tonic::Request::new(pb::StatusRequest {});
    edl_proto::headers::set_credentials(req.metadata_mut(), job, token);
    GrpcClient::new(channel)
        .status(req)
        .await
        .map(tonic::Response::into_inner)
        .map_err(|status| PsClientError::ProbeRefused {
            addr: addr.to_owned(),
            status,
        })
}
