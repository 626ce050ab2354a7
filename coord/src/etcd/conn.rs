//! The connection to one endpoint: a channel, the metadata every request carries
//! (require-leader, the auth token), the KV/watch/lease clients, and TLS.

use std::sync::Arc;
use std::time::Duration;

use edl_proto::etcd::etcdserverpb::{
    self as pb, auth_client::AuthClient, kv_client::KvClient, lease_client::LeaseClient,
    watch_client::WatchClient,
};
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
    tls: Option<&TlsConfig>,
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
    ep = with_tls(ep, endpoint, tls)?;
    ep.connect().await.map_err(|e| Failure {
        error: Error::unavailable(String::new(), error_chain(&e)),
        not_sent: true,
        stale_token: false,
    })
}

#[cfg(feature = "tls")]
pub(super) type TlsConfig = tonic::transport::ClientTlsConfig;
#[cfg(not(feature = "tls"))]
pub(super) type TlsConfig = std::convert::Infallible;

/// The TLS settings of the configuration, with its files read.
#[cfg(feature = "tls")]
pub(super) async fn tls_config(tls: &EtcdTls) -> Result<TlsConfig> {
    use tonic::transport::{Certificate, Identity};
    async fn read(what: &str, path: &std::path::Path) -> Result<Vec<u8>> {
        tokio::fs::read(path).await.map_err(|e| {
            Error::InvalidArgument(format!("read etcd tls {what} {}: {e}", path.display()))
        })
    }
    let mut t = TlsConfig::new();
    if let Some(ca) = &tls.ca_file {
        t = t.ca_certificate(Certificate::from_pem(read("ca", ca).await?));
    }
    match (&tls.cert_file, &tls.key_file) {
        (Some(cert), Some(key)) => {
            t = t.identity(Identity::from_pem(
                read("cert", cert).await?,
                read("key", key).await?,
            ));
        }
        (None, None) => {}
        _ => {
            return Err(Error::InvalidArgument(
                "etcd tls: cert_file and key_file must be given together".into(),
            ));
        }
    }
    if let Some(domain) = &tls.domain {
        t = t.domain_name(domain.clone());
    }
    Ok(t)
}

#[cfg(not(feature = "tls"))]
pub(super) async fn tls_config(_tls: &EtcdTls) -> Result<TlsConfig> {
    Err(Error::InvalidArgument(
        "etcd tls requested but edl-coord was built without its `tls` feature".into(),
    ))
}

#[cfg(feature = "tls")]
pub(super) fn with_tls(
    ep: Endpoint,
    endpoint: &str,
    tls: Option<&TlsConfig>,
) -> Result<Endpoint, Failure> {
    match tls {
        Some(t) => ep.tls_config(t.clone()).map_err(|e| {
            Failure::from(Error::InvalidArgument(format!(
                "etcd tls for {endpoint}: {}",
                error_chain(&e)
            )))
        }),
        None if endpoint.starts_with("https://") => Err(https_without_tls(endpoint)),
        None => Ok(ep),
    }
}

#[cfg(not(feature = "tls"))]
pub(super) fn with_tls(
    ep: Endpoint,
    endpoint: &str,
    _tls: Option<&TlsConfig>,
) -> Result<Endpoint, Failure> {
    if endpoint.starts_with("https://") {
        return Err(https_without_tls(endpoint));
    }
    Ok(ep)
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
