//! [`EtcdConfig`]: how to reach etcd (endpoints, timeouts, keep-alive, auth, TLS).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// How to reach etcd.
#[derive(Clone)]
pub struct EtcdConfig {
    /// Client URLs (`http://host:port`, `https://host:port`, or `host:port`).
    pub endpoints: Vec<String>,
    /// Bound on establishing a connection (and on the first probe in
    /// [`EtcdBackend::connect`](super::EtcdBackend::connect), per endpoint).
    pub dial_timeout: Duration,
    /// Bound on every request, retries across endpoints included.
    pub request_timeout: Duration,
    /// HTTP/2 keep-alive `(interval, timeout)` while streams (watches) are open, so a
    /// silent server (paused, partitioned) is detected. etcd refuses pings more
    /// frequent than its `--grpc-keepalive-min-time` (5 s by default).
    pub keep_alive: Option<(Duration, Duration)>,
    /// Ask members without a raft leader to refuse requests (and cancel watches), so
    /// a partitioned member is skipped instead of serving stale state.
    pub require_leader: bool,
    /// User and password, when etcd has authentication enabled.
    pub auth: Option<EtcdAuth>,
    /// TLS settings.
    pub tls: Option<EtcdTls>,
}

impl EtcdConfig {
    /// A configuration with the given endpoints and default timeouts: dial 5 s,
    /// request 5 s, keep-alive every 10 s (5 s timeout), leader required.
    pub fn new<I, S>(endpoints: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            dial_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
            keep_alive: Some((Duration::from_secs(10), Duration::from_secs(5))),
            require_leader: true,
            auth: None,
            tls: None,
        }
    }

    /// Sets the dial timeout.
    pub fn with_dial_timeout(mut self, timeout: Duration) -> Self {
        self.dial_timeout = timeout;
        self
    }

    /// Sets the request timeout.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Sets user and password.
    pub fn with_auth(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.auth = Some(EtcdAuth {
            user: user.into(),
            password: password.into(),
        });
        self
    }

    /// Sets TLS.
    pub fn with_tls(mut self, tls: EtcdTls) -> Self {
        self.tls = Some(tls);
        self
    }
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("dial_timeout", &self.dial_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("keep_alive", &self.keep_alive)
            .field("require_leader", &self.require_leader)
            .field("auth", &self.auth)
            .field("tls", &self.tls)
            .finish()
    }
}

/// etcd credentials. `Debug` does not print the password.
#[derive(Clone)]
pub struct EtcdAuth {
    /// User name.
    pub user: String,
    /// Password.
    pub password: String,
}

impl fmt::Debug for EtcdAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdAuth")
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// TLS to etcd: PEM files for the CA and, for client authentication, a certificate
/// and its key. Loaded by [`edl_proto::tls`], the client side of edl's own
/// connections: the CA is required and is the only root trusted (not the system's).
#[derive(Clone, Debug, Default)]
pub struct EtcdTls {
    /// CA certificate(s) to verify the server with (PEM). Required: without it
    /// [`EtcdBackend::connect`](super::EtcdBackend::connect) says so.
    pub ca_file: Option<PathBuf>,
    /// Client certificate (PEM), with `key_file`.
    pub cert_file: Option<PathBuf>,
    /// Client private key (PEM), with `cert_file`.
    pub key_file: Option<PathBuf>,
    /// Server name to verify instead of the endpoint's host.
    pub domain: Option<String>,
}
