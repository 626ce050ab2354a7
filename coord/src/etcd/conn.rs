//! The connection to one endpoint: a channel, the metadata every request carries
//! (require-leader, the auth token), the KV/watch/lease clients, and TLS (the client
//! side of [`edl_proto::tls`], loaded once per backend).

use std::sync::Arc;
use std::time::Duration;

use edl_proto::etcd::etcdserverpb::{
    self as pb, auth_client::AuthClient, kv_client::KvClient, lease_client::LeaseClient,
    watch_client::WatchClient,
};
use edl_proto::tls::{Tls, TlsFiles};
use tonic::metadata::AsciiMetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use super::failure::{Failure, error_chain};
use super::{EtcdAuth, EtcdConfig, EtcdTls, MAX_DECODING_MESSAGE_SIZE};
use crate::error::{Error, Result};

/// What every request carries: etcd's "require a leader" flag and, with
/// authentication on, the connection's current token.
#[derive(Clone)]
pub(super) struct Metadata {
    require_leader: bool,
    token: Arc<std::sync::RwLock<Option<AsciiMetadataValue>>>,
}

impl Interceptor for Metadata {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if self.require_leader {
            // etcd's `rpctypes.MetadataRequireLeaderKey`: a member without a raft
            // leader refuses the request (and cancels the watch) instead of serving
            // what may be stale.
            req.metadata_mut()
                .insert("hasleader", AsciiMetadataValue::from_static("true"));
        }
        let token = match self.token.read() {
            Ok(t) => t.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        if let Some(token) = token {
            req.metadata_mut().insert("token", token);
        }
        Ok(req)
    }
}

pub(super) type Svc = InterceptedService<Channel, Metadata>;

/// The connection to one endpoint, with KV and watch clients that accept large
/// responses.
#[derive(Clone)]
pub(super) struct Conn {
    pub(super) channel: Channel,
    pub(super) meta: Metadata,
    pub(super) kv: KvClient<Svc>,
    pub(super) watch: WatchClient<Svc>,
    pub(super) lease: LeaseClient<Svc>,
}

impl Conn {
    pub(super) fn new(channel: Channel, require_leader: bool) -> Self {
        let meta = Metadata {
            require_leader,
            token: Arc::new(std::sync::RwLock::new(None)),
        };
        Self {
            kv: KvClient::with_interceptor(channel.clone(), meta.clone())
                .max_decoding_message_size(MAX_DECODING_MESSAGE_SIZE),
            watch: WatchClient::with_interceptor(channel.clone(), meta.clone())
                .max_decoding_message_size(MAX_DECODING_MESSAGE_SIZE),
            lease: LeaseClient::with_interceptor(channel.clone(), meta.clone()),
            channel,
            meta,
        }
    }

    /// Gets a fresh token for `auth` and uses it on every later request.
    pub(super) async fn authenticate(&self, auth: &EtcdAuth) -> Result<(), Failure> {
        let resp = AuthClient::new(self.channel.clone())
            .authenticate(pb::AuthenticateRequest {
                name: auth.user.clone(),
                password: auth.password.clone(),
            })
            .await?
            .into_inner();
        let token = AsciiMetadataValue::try_from(resp.token.as_str()).map_err(|_| {
            Failure::from(Error::Malformed(
                "etcd returned an auth token that is not valid ASCII".into(),
            ))
        })?;
        match self.meta.token.write() {
            Ok(mut t) => *t = Some(token),
            Err(poisoned) => *poisoned.into_inner() = Some(token),
        }
        Ok(())
    }
}

/// A channel to one etcd endpoint (`http://host:port`, `https://host:port` or
/// `host:port`), connected within `timeout`.
pub(super) async fn connect_channel(
    endpoint: &str,
    cfg: &EtcdConfig,
    tls: Option<&Tls>,
) -> Result<Channel, Failure> {
    let uri = if endpoint.contains("://") {
        endpoint.to_owned()
    } else if tls.is_some() {
        format!("https://{endpoint}")
    } else {
        format!("http://{endpoint}")
    };
    let mut ep = Endpoint::from_shared(uri).map_err(|e| {
        Failure::from(Error::InvalidArgument(format!(
            "etcd endpoint {endpoint:?} is not a URL: {e}"
        )))
    })?;
    ep = ep
        .connect_timeout(cfg.dial_timeout)
        .tcp_nodelay(true)
        .keep_alive_while_idle(false);
    if let Some((interval, timeout)) = cfg.keep_alive {
        ep = ep
            .http2_keep_alive_interval(interval)
            .keep_alive_timeout(timeout);
    }
    ep = match tls {
        Some(t) => t.secure_endpoint(ep).map_err(|e| {
            Failure::from(Error::InvalidArgument(format!(
                "etcd tls for {endpoint}: {e}"
            )))
        })?,
        None if endpoint.starts_with("https://") => return Err(https_without_tls(endpoint)),
        None => ep,
    };
    ep.connect().await.map_err(|e| Failure {
        error: Error::unavailable(String::new(), error_chain(&e)),
        not_sent: true,
        stale_token: false,
    })
}

/// The TLS settings of the configuration, with its files read and checked once by
/// [`edl_proto::tls`], the client side of edl's own connections too: only the CA is
/// trusted, and the certificate and key are presented when given.
pub(super) async fn load_tls(tls: &EtcdTls) -> Result<Tls> {
    if tls.cert_file.is_some() != tls.key_file.is_some() {
        return Err(Error::InvalidArgument(
            "etcd tls: cert_file and key_file must be given together".into(),
        ));
    }
    let Some(ca) = tls.ca_file.clone() else {
        return Err(Error::InvalidArgument(
            "etcd tls: give the CA that signed etcd's certificate (--etcd-ca): \
             only it is trusted"
                .into(),
        ));
    };
    let files = TlsFiles {
        ca,
        cert: tls.cert_file.clone(),
        key: tls.key_file.clone(),
        domain: tls.domain.clone(),
        client_auth: false,
    };
    match tokio::task::spawn_blocking(move || files.load()).await {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => Err(Error::InvalidArgument(format!("etcd {e}"))),
        Err(e) => Err(Error::InvalidArgument(format!("etcd tls: {e}"))),
    }
}

pub(super) fn https_without_tls(endpoint: &str) -> Failure {
    Error::InvalidArgument(format!(
        "etcd endpoint {endpoint} is https: give the CA that signed its certificate (--etcd-ca)"
    ))
    .into()
}

/// A plain channel to one endpoint, for the test kit's cluster queries (member
/// list, status) that the [`Backend`] does not offer.
pub(crate) async fn probe_channel(endpoint: &str, timeout: Duration) -> Option<Channel> {
    let cfg = EtcdConfig::new([endpoint]).with_dial_timeout(timeout);
    connect_channel(endpoint, &cfg, None).await.ok()
}
