//! [`EtcdBackend`]: the [`Backend`] on a real etcd cluster (v3 API, etcd >= 3.3).
//!
//! The client keeps one connection per endpoint and sends each request to a
//! *pinned* endpoint; when that endpoint fails (refused, lost, no leader, no
//! answer) the pin moves to the next one. Every request is bounded by
//! [`EtcdConfig::request_timeout`]. A request is re-sent to the next endpoint within
//! that bound only when that is safe: reads, lease renewals and watch creation
//! always; writes only when the connection failed before the request was sent.
//! Otherwise the error is returned (retryable: see [`crate::retry()`]).
//!
//! A member can hang with its sockets open (SIGSTOPped, overloaded, partitioned
//! behind a proxy): a re-sendable request then gets only its share of the request
//! timeout on each endpoint (`request_timeout / endpoints`, at least 500 ms) before
//! it moves on, so one hung member of three does not stall reads or lease renewals.
//! A write has a single attempt (it may have been applied) with the whole request
//! timeout; when it times out the pin still moves on. A caller that gives up on a
//! request (drops it) after it has waited on an endpoint for a while moves the pin
//! on as well.
//!
//! Responses of up to [`MAX_DECODING_MESSAGE_SIZE`] are accepted, and
//! [`Backend::range`] reads large prefixes in pages of [`RANGE_PAGE_SIZE`] keys,
//! all at the revision of the first page (one consistent snapshot).
//!
//! The client speaks etcd's v3 gRPC API directly, through the stubs in
//! [`edl_proto::etcd`] (generated from etcd's own `.proto` files). With
//! authentication on, each connection authenticates once and again whenever etcd
//! answers that its token is no longer valid (etcd's simple tokens expire).

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use edl_proto::etcd::etcdserverpb::{
    self as pb, auth_client::AuthClient, compare, kv_client::KvClient, lease_client::LeaseClient,
    request_op, response_op, watch_client::WatchClient, watch_request,
};
use edl_proto::etcd::mvccpb;
use tokio::sync::OnceCell;
use tokio::time::Instant;
use tonic::metadata::AsciiMetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::backend::{Backend, WatchStream};
use crate::error::{Error, Result};
use crate::types::{
    Compare, CompareOp, CompareTarget, EventKind, KeyValue, LeaseGrant, LeaseId, Op, OpResponse,
    Revision, Txn, TxnResponse, WatchEvent,
};

/// How to reach etcd.
#[derive(Clone)]
pub struct EtcdConfig {
    /// Client URLs (`http://host:port`, `https://host:port`, or `host:port`).
    pub endpoints: Vec<String>,
    /// Bound on establishing a connection (and on the first probe in
    /// [`EtcdBackend::connect`], per endpoint).
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
    /// TLS settings (needs the `tls` feature of this crate).
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
/// and its key.
#[derive(Clone, Debug, Default)]
pub struct EtcdTls {
    /// CA certificate(s) to verify the server with (PEM).
    pub ca_file: Option<PathBuf>,
    /// Client certificate (PEM), with `key_file`.
    pub cert_file: Option<PathBuf>,
    /// Client private key (PEM), with `cert_file`.
    pub key_file: Option<PathBuf>,
    /// Server name to verify instead of the endpoint's host.
    pub domain: Option<String>,
}

/// The [`Backend`] on etcd. Cheap to clone.
///
/// The connections run on the tokio runtime that made them: use the backend from
/// that runtime.
#[derive(Clone)]
pub struct EtcdBackend {
    inner: Arc<EtcdInner>,
}

struct EtcdInner {
    cfg: EtcdConfig,
    #[cfg(feature = "tls")]
    tls: Option<tonic::transport::ClientTlsConfig>,
    slots: Vec<Slot>,
    pinned: AtomicUsize,
}

struct Slot {
    endpoint: String,
    conn: OnceCell<Conn>,
}

/// Largest gRPC response accepted from etcd (tonic's default is 4 MiB). Ranges are
/// paginated anyway; this leaves room for large values and watch batches.
pub const MAX_DECODING_MESSAGE_SIZE: usize = 64 << 20;

/// Keys per page of [`Backend::range`] on etcd.
pub const RANGE_PAGE_SIZE: i64 = 1000;

/// Shortest time a re-sendable request waits on one endpoint before moving on.
const MIN_ATTEMPT_TIMEOUT: Duration = Duration::from_millis(500);

/// A caller that drops a request after it waited this long on one endpoint moves
/// the pin to the next endpoint (a healthy member answers in milliseconds).
const ROTATE_ON_DROP_AFTER: Duration = Duration::from_millis(250);

/// What every request carries: etcd's "require a leader" flag and, with
/// authentication on, the connection's current token.
#[derive(Clone)]
struct Metadata {
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

type Svc = InterceptedService<Channel, Metadata>;

/// The connection to one endpoint, with KV and watch clients that accept large
/// responses.
#[derive(Clone)]
struct Conn {
    channel: Channel,
    meta: Metadata,
    kv: KvClient<Svc>,
    watch: WatchClient<Svc>,
    lease: LeaseClient<Svc>,
}

impl Conn {
    fn new(channel: Channel, require_leader: bool) -> Self {
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
    async fn authenticate(&self, auth: &EtcdAuth) -> Result<(), Failure> {
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
async fn connect_channel(
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

/// Moves the pin off an endpoint when the request waiting on it is dropped by its
/// caller after [`ROTATE_ON_DROP_AFTER`] (for example by a lease keeper's own
/// bound, shorter than the per-attempt timeout).
struct RotateOnDrop<'a> {
    inner: &'a EtcdInner,
    slot: usize,
    started: Instant,
    armed: bool,
}

impl Drop for RotateOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed && self.started.elapsed() >= ROTATE_ON_DROP_AFTER {
            tracing::debug!(
                endpoint = %self.inner.slots[self.slot].endpoint,
                "etcd request abandoned by its caller; trying the next endpoint next time"
            );
            self.inner.rotate(self.slot);
        }
    }
}

impl fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("endpoints", &self.inner.cfg.endpoints)
            .field("pinned", &self.inner.pinned.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// A failed attempt: the error, and whether the request certainly never left
/// (so even a write may be re-sent).
struct Failure {
    error: Error,
    not_sent: bool,
    /// etcd refused the connection's auth token (expired): authenticate again and
    /// re-send (the request was not applied).
    stale_token: bool,
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        Failure {
            error,
            not_sent: false,
            stale_token: false,
        }
    }
}

impl From<tonic::Status> for Failure {
    fn from(s: tonic::Status) -> Self {
        status_failure(&s)
    }
}

/// Whether an attempt may be re-sent to another endpoint.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Resend {
    /// Reads, renewals, watch creation: re-sending is harmless.
    Always,
    /// Writes: only if the request never left.
    IfNotSent,
}

fn status_failure(s: &tonic::Status) -> Failure {
    use std::error::Error as _;
    use tonic::Code;
    let mut not_sent = false;
    let mut source = s.source();
    while let Some(err) = source {
        if err.is::<tonic::ConnectError>() {
            not_sent = true;
            break;
        }
        source = err.source();
    }
    let mut msg = s.message().to_owned();
    if let Some(src) = s.source() {
        let chain = error_chain(src);
        if !msg.contains(&chain) {
            msg = if msg.is_empty() {
                chain
            } else {
                format!("{msg}: {chain}")
            };
        }
    }
    let error = match s.code() {
        // gRPC's own size limit (etcd's --max-request-bytes plus 512 KiB): the request
        // can never succeed, like etcd's "request is too large".
        Code::ResourceExhausted if msg.contains("larger than max") => {
            Error::InvalidArgument(format!("etcdserver: request is too large ({msg})"))
        }
        Code::Unavailable
        | Code::ResourceExhausted
        | Code::Unknown
        | Code::Cancelled
        | Code::Aborted
        | Code::DeadlineExceeded => Error::unavailable(String::new(), msg),
        Code::NotFound if msg.contains("lease not found") => Error::LeaseLost,
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
            Error::InvalidArgument(msg)
        }
        Code::Unauthenticated | Code::PermissionDenied => Error::PermissionDenied(msg),
        code => Error::Etcd(format!("{code:?}: {msg}")),
    };
    // etcd's ErrGRPCInvalidAuthToken.
    let stale_token =
        s.code() == Code::Unauthenticated && s.message().contains("invalid auth token");
    Failure {
        error,
        not_sent,
        stale_token,
    }
}

/// An error with its root cause (transport errors say little alone).
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut root = None;
    let mut source = e.source();
    while let Some(s) = source {
        root = Some(s);
        source = s.source();
    }
    if let Some(root) = root {
        let text = root.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
    }
    out
}

/// Fills in the endpoint of an `Unavailable` error.
fn with_endpoint(mut e: Error, endpoint: &str) -> Error {
    if let Error::Unavailable { endpoints, .. } = &mut e {
        endpoints.retain(|s| !s.is_empty());
        if endpoints.is_empty() {
            endpoints.push(endpoint.to_owned());
        }
    }
    e
}

#[cfg(feature = "tls")]
type TlsConfig = tonic::transport::ClientTlsConfig;
#[cfg(not(feature = "tls"))]
type TlsConfig = std::convert::Infallible;

/// The TLS settings of the configuration, with its files read.
#[cfg(feature = "tls")]
async fn tls_config(tls: &EtcdTls) -> Result<TlsConfig> {
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
async fn tls_config(_tls: &EtcdTls) -> Result<TlsConfig> {
    Err(Error::InvalidArgument(
        "etcd tls requested but edl-coord was built without its `tls` feature".into(),
    ))
}

#[cfg(feature = "tls")]
fn with_tls(ep: Endpoint, endpoint: &str, tls: Option<&TlsConfig>) -> Result<Endpoint, Failure> {
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
fn with_tls(ep: Endpoint, endpoint: &str, _tls: Option<&TlsConfig>) -> Result<Endpoint, Failure> {
    if endpoint.starts_with("https://") {
        return Err(https_without_tls(endpoint));
    }
    Ok(ep)
}

fn https_without_tls(endpoint: &str) -> Failure {
    Error::InvalidArgument(format!(
        "etcd endpoint {endpoint} is https: give the CA that signed its certificate (--etcd-ca)"
    ))
    .into()
}

impl EtcdBackend {
    /// Connects to the cluster: probes the endpoints in order (each within the dial
    /// timeout) and pins the first that answers. Fails with
    /// [`Error::Unavailable`] naming every endpoint when none answers.
    pub async fn connect(cfg: EtcdConfig) -> Result<Self> {
        if cfg.endpoints.is_empty() {
            return Err(Error::InvalidArgument("no etcd endpoints given".into()));
        }
        if cfg.dial_timeout.is_zero() || cfg.request_timeout.is_zero() {
            return Err(Error::InvalidArgument(
                "etcd dial and request timeouts must be positive".into(),
            ));
        }
        #[cfg(feature = "tls")]
        let tls = match &cfg.tls {
            Some(t) => Some(tls_config(t).await?),
            None => None,
        };
        #[cfg(not(feature = "tls"))]
        if let Some(t) = &cfg.tls {
            tls_config(t).await?;
        }
        let slots = cfg
            .endpoints
            .iter()
            .map(|e| Slot {
                endpoint: e.clone(),
                conn: OnceCell::new(),
            })
            .collect();
        let backend = EtcdBackend {
            inner: Arc::new(EtcdInner {
                cfg,
                #[cfg(feature = "tls")]
                tls,
                slots,
                pinned: AtomicUsize::new(0),
            }),
        };
        let mut errors = Vec::new();
        for (i, slot) in backend.inner.slots.iter().enumerate() {
            let probe = async {
                let mut conn = backend.conn(i).await?;
                conn.kv.range(range_one(b"health")).await?;
                Ok::<(), Failure>(())
            };
            match tokio::time::timeout(backend.inner.cfg.dial_timeout, probe).await {
                Ok(Ok(())) => {
                    backend.inner.pinned.store(i, Ordering::Relaxed);
                    tracing::info!(endpoint = %slot.endpoint, "connected to etcd");
                    return Ok(backend);
                }
                Ok(Err(f)) if !f.error.is_retryable() => return Err(f.error),
                Ok(Err(f)) => errors.push((slot.endpoint.as_str(), unavailable_msg(&f.error))),
                Err(_) => errors.push((
                    slot.endpoint.as_str(),
                    format!("no answer within {:?}", backend.inner.cfg.dial_timeout),
                )),
            }
        }
        // The endpoints are in the error's own text: name each again only when there
        // are several, to say which failed how.
        let msg = match errors.as_slice() {
            [(_, only)] => only.clone(),
            many => many
                .iter()
                .map(|(endpoint, e)| format!("{endpoint}: {e}"))
                .collect::<Vec<_>>()
                .join("; "),
        };
        Err(Error::Unavailable {
            endpoints: backend.inner.cfg.endpoints.clone(),
            msg,
        })
    }

    /// The configured endpoints.
    pub fn endpoints(&self) -> &[String] {
        &self.inner.cfg.endpoints
    }

    /// The configuration.
    pub fn config(&self) -> &EtcdConfig {
        &self.inner.cfg
    }

    async fn conn(&self, i: usize) -> Result<Conn, Failure> {
        let slot = &self.inner.slots[i];
        let cfg = &self.inner.cfg;
        let conn = slot
            .conn
            .get_or_try_init(|| async {
                #[cfg(feature = "tls")]
                let tls = self.inner.tls.as_ref();
                #[cfg(not(feature = "tls"))]
                let tls = None;
                let channel = connect_channel(&slot.endpoint, cfg, tls).await?;
                let conn = Conn::new(channel, cfg.require_leader);
                if let Some(auth) = &cfg.auth {
                    conn.authenticate(auth).await?;
                }
                Ok::<_, Failure>(conn)
            })
            .await?;
        Ok(conn.clone())
    }

    fn rotate(&self, from: usize) {
        self.inner.rotate(from);
    }

    /// Runs one request on the pinned endpoint, moving the pin and re-sending as
    /// allowed by `resend`, all within the request timeout.
    ///
    /// A re-sendable request gets `request_timeout / endpoints` (at least
    /// [`MIN_ATTEMPT_TIMEOUT`]) per endpoint, so a hung member costs one share of
    /// the timeout, not all of it. A write gets one attempt with the whole timeout.
    async fn call<T, F, Fut>(&self, op: &'static str, resend: Resend, mut f: F) -> Result<T>
    where
        F: FnMut(Conn) -> Fut,
        Fut: Future<Output = Result<T, Failure>>,
    {
        let timeout = self.inner.cfg.request_timeout;
        let started = Instant::now();
        let deadline = started + timeout;
        let n = self.inner.slots.len();
        let share = timeout / u32::try_from(n).unwrap_or(u32::MAX).max(1);
        let per_attempt = share.max(MIN_ATTEMPT_TIMEOUT).min(timeout);
        let mut tried: Vec<String> = Vec::new();
        let mut last_msg = String::new();
        let mut all_timed_out = true;
        for _ in 0..n {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            let i = self.inner.pinned.load(Ordering::Relaxed) % n;
            let endpoint = &self.inner.slots[i].endpoint;
            let attempt_deadline = match resend {
                Resend::Always => (now + per_attempt).min(deadline),
                Resend::IfNotSent => deadline,
            };
            let attempt = async {
                let conn = self.conn(i).await?;
                match f(conn.clone()).await {
                    Err(failure) if failure.stale_token => {
                        // The token expired: the request was refused, not applied.
                        let Some(auth) = &self.inner.cfg.auth else {
                            return Err(failure);
                        };
                        tracing::debug!(endpoint = %endpoint, "etcd auth token expired; authenticating again");
                        conn.authenticate(auth).await?;
                        f(conn).await
                    }
                    other => other,
                }
            };
            let mut guard = RotateOnDrop {
                inner: &self.inner,
                slot: i,
                started: now,
                armed: true,
            };
            let result = tokio::time::timeout_at(attempt_deadline, attempt).await;
            guard.armed = false;
            if !tried.contains(endpoint) {
                tried.push(endpoint.clone());
            }
            match result {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(failure)) => {
                    let error = with_endpoint(failure.error, endpoint);
                    if !error.is_retryable() {
                        return Err(error);
                    }
                    tracing::debug!(op, endpoint = %endpoint, error = %error, "etcd request failed");
                    self.rotate(i);
                    all_timed_out = false;
                    last_msg = unavailable_msg(&error);
                    if resend == Resend::IfNotSent && !failure.not_sent {
                        break;
                    }
                }
                Err(_) => {
                    let waited = now.elapsed();
                    tracing::debug!(op, endpoint = %endpoint, ?waited, "etcd request got no answer; trying the next endpoint");
                    self.rotate(i);
                    last_msg = format!("no answer within {waited:?}");
                    if resend == Resend::IfNotSent {
                        // The write may have been applied: it is not re-sent.
                        return Err(Error::Timeout(started.elapsed()));
                    }
                }
            }
        }
        if tried.is_empty() || all_timed_out {
            return Err(Error::Timeout(started.elapsed()));
        }
        Err(Error::Unavailable {
            endpoints: tried,
            msg: last_msg,
        })
    }
}

impl EtcdInner {
    fn rotate(&self, from: usize) {
        let n = self.slots.len();
        if n > 1 {
            let _ = self.pinned.compare_exchange(
                from,
                (from + 1) % n,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }
}

fn unavailable_msg(e: &Error) -> String {
    match e {
        Error::Unavailable { msg, .. } => msg.clone(),
        other => other.to_string(),
    }
}

fn decode_kv(kv: mvccpb::KeyValue) -> Result<KeyValue> {
    let key = String::from_utf8(kv.key)
        .map_err(|e| Error::Malformed(format!("non-UTF-8 key {:?}", e.as_bytes())))?;
    Ok(KeyValue {
        key,
        value: kv.value,
        create_revision: kv.create_revision,
        mod_revision: kv.mod_revision,
        version: kv.version,
        lease: (kv.lease != 0).then_some(LeaseId(kv.lease)),
    })
}

fn decode_kvs(kvs: Vec<mvccpb::KeyValue>) -> Result<Vec<KeyValue>> {
    kvs.into_iter().map(decode_kv).collect()
}

fn revision_of(header: Option<&pb::ResponseHeader>) -> Revision {
    header.map_or(0, |h| h.revision)
}

fn decode_txn(resp: pb::TxnResponse) -> Result<TxnResponse> {
    let revision = revision_of(resp.header.as_ref());
    let mut responses = Vec::with_capacity(resp.responses.len());
    for op in resp.responses {
        let r = match op.response {
            Some(response_op::Response::ResponsePut(_)) => OpResponse::Put,
            Some(response_op::Response::ResponseRange(r)) => OpResponse::Get(decode_kvs(r.kvs)?),
            Some(response_op::Response::ResponseDeleteRange(d)) => OpResponse::Delete {
                deleted: u64::try_from(d.deleted).unwrap_or(0),
            },
            Some(response_op::Response::ResponseTxn(t)) => OpResponse::Txn(decode_txn(t)?),
            None => {
                return Err(Error::Malformed(
                    "txn response op without a response".into(),
                ));
            }
        };
        responses.push(r);
    }
    Ok(TxnResponse {
        succeeded: resp.succeeded,
        revision,
        responses,
    })
}

fn encode_compare(c: &Compare) -> pb::Compare {
    use compare::{CompareResult as R, CompareTarget as T, TargetUnion as U};
    let result = match c.op {
        CompareOp::Equal => R::Equal,
        CompareOp::NotEqual => R::NotEqual,
        CompareOp::Less => R::Less,
        CompareOp::Greater => R::Greater,
    };
    let (target, value) = match &c.target {
        CompareTarget::Value(v) => (T::Value, U::Value(v.clone())),
        CompareTarget::CreateRevision(r) => (T::Create, U::CreateRevision(*r)),
        CompareTarget::ModRevision(r) => (T::Mod, U::ModRevision(*r)),
        CompareTarget::Version(v) => (T::Version, U::Version(*v)),
        CompareTarget::Lease(l) => (T::Lease, U::Lease(l.map_or(0, |l| l.0))),
    };
    pb::Compare {
        result: result as i32,
        target: target as i32,
        key: c.key.clone().into_bytes(),
        range_end: Vec::new(),
        target_union: Some(value),
    }
}

/// A range request for exactly `key`.
fn range_one(key: &[u8]) -> pb::RangeRequest {
    pb::RangeRequest {
        key: key.to_vec(),
        ..Default::default()
    }
}

/// The `(key, range_end)` of every key starting with `prefix` (etcd's
/// `WithPrefix`): the whole key space for the empty prefix.
fn prefix_range(prefix: &str) -> (Vec<u8>, Vec<u8>) {
    let start = if prefix.is_empty() {
        vec![0]
    } else {
        prefix.as_bytes().to_vec()
    };
    (start, prefix_end(prefix.as_bytes()))
}

fn range_prefix(prefix: &str) -> pb::RangeRequest {
    let (key, range_end) = prefix_range(prefix);
    pb::RangeRequest {
        key,
        range_end,
        ..Default::default()
    }
}

fn put_request(key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> pb::PutRequest {
    pb::PutRequest {
        key: key.as_bytes().to_vec(),
        value,
        lease: lease.map_or(0, |l| l.0),
        ..Default::default()
    }
}

fn delete_request(key: &str) -> pb::DeleteRangeRequest {
    pb::DeleteRangeRequest {
        key: key.as_bytes().to_vec(),
        ..Default::default()
    }
}

fn delete_prefix_request(prefix: &str) -> pb::DeleteRangeRequest {
    let (key, range_end) = prefix_range(prefix);
    pb::DeleteRangeRequest {
        key,
        range_end,
        ..Default::default()
    }
}

fn encode_op(op: &Op) -> pb::RequestOp {
    use request_op::Request;
    let request = match op {
        Op::Put { key, value, lease } => {
            Request::RequestPut(put_request(key, value.clone(), *lease))
        }
        Op::Get { key } => Request::RequestRange(range_one(key.as_bytes())),
        Op::GetPrefix { prefix } => Request::RequestRange(range_prefix(prefix)),
        Op::Delete { key } => Request::RequestDeleteRange(delete_request(key)),
        Op::DeletePrefix { prefix } => Request::RequestDeleteRange(delete_prefix_request(prefix)),
        Op::Txn(t) => Request::RequestTxn(encode_txn(t)),
    };
    pb::RequestOp {
        request: Some(request),
    }
}

fn encode_txn(t: &Txn) -> pb::TxnRequest {
    pb::TxnRequest {
        compare: t.compares.iter().map(encode_compare).collect(),
        success: t.success.iter().map(encode_op).collect(),
        failure: t.failure.iter().map(encode_op).collect(),
    }
}

/// The end of the key range of `prefix` (etcd's `GetPrefixRangeEnd`): `[0]`, meaning
/// "to the end of the key space", for the empty prefix or one of only `0xff` bytes.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn ttl_secs(ttl: Duration) -> Result<i64> {
    if ttl.is_zero() {
        return Err(Error::InvalidArgument("lease ttl must be positive".into()));
    }
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(secs).map_err(|_| Error::InvalidArgument("too large lease TTL".into()))
}

fn secs(ttl: i64) -> Duration {
    Duration::from_secs(u64::try_from(ttl).unwrap_or(0))
}

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
        // Pages of RANGE_PAGE_SIZE keys; the later pages read at the revision of the
        // first, so the result is one snapshot. If that revision is compacted away
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
                physical: false,
            })
            .await?;
            Ok(())
        })
        .await
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

/// Appends the events of one watch response; an error when the watch ended
/// (compacted, cancelled by the server) or an event cannot be decoded.
fn decode_watch_response(resp: pb::WatchResponse, buf: &mut VecDeque<WatchEvent>) -> Result<()> {
    if resp.compact_revision != 0 {
        return Err(Error::Compacted {
            compact_revision: resp.compact_revision,
        });
    }
    for ev in resp.events {
        let kind = match mvccpb::event::EventType::try_from(ev.r#type) {
            Ok(mvccpb::event::EventType::Put) => EventKind::Put,
            Ok(mvccpb::event::EventType::Delete) => EventKind::Delete,
            Err(_) => {
                return Err(Error::Malformed(format!(
                    "unknown watch event type {}",
                    ev.r#type
                )));
            }
        };
        let Some(kv) = ev.kv else {
            return Err(Error::Malformed("watch event without key-value".into()));
        };
        buf.push_back(WatchEvent {
            kind,
            kv: decode_kv(kv)?,
        });
    }
    if resp.canceled {
        let reason = if resp.cancel_reason.is_empty() {
            "watch cancelled by the server".to_owned()
        } else {
            resp.cancel_reason
        };
        if reason.contains("permission denied") {
            return Err(Error::PermissionDenied(reason));
        }
        return Err(Error::unavailable(String::new(), reason));
    }
    Ok(())
}

struct EtcdWatch {
    /// Kept so the request side of the stream stays open.
    _requests: tokio::sync::mpsc::Sender<pb::WatchRequest>,
    ws: tonic::Streaming<pb::WatchResponse>,
    buf: VecDeque<WatchEvent>,
    pending_err: Option<Error>,
    done: bool,
    endpoint: String,
}

impl EtcdWatch {
    async fn next_item(mut self) -> Option<(Result<WatchEvent>, Self)> {
        loop {
            if let Some(ev) = self.buf.pop_front() {
                return Some((Ok(ev), self));
            }
            if self.done {
                return None;
            }
            if let Some(e) = self.pending_err.take() {
                self.done = true;
                let e = with_endpoint(e, &self.endpoint);
                return Some((Err(e), self));
            }
            match self.ws.message().await {
                Ok(Some(resp)) => {
                    if let Err(e) = decode_watch_response(resp, &mut self.buf) {
                        self.pending_err = Some(e);
                    }
                }
                Ok(None) => {
                    self.pending_err =
                        Some(Error::unavailable(String::new(), "watch stream closed"));
                }
                Err(status) => self.pending_err = Some(status_failure(&status).error),
            }
        }
    }
}

/// A plain channel to one endpoint, for the test kit's cluster queries (member
/// list, status) that the [`Backend`] does not offer.
pub(crate) async fn probe_channel(endpoint: &str, timeout: Duration) -> Option<Channel> {
    let cfg = EtcdConfig::new([endpoint]).with_dial_timeout(timeout);
    connect_channel(endpoint, &cfg, None).await.ok()
}
