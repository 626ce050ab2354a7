//! [`EtcdBackend`]: the [`Backend`](crate::Backend) on a real etcd cluster (v3 API, etcd >= 3.3).
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
//! timeout; when it times out the pin still moves on. A write whose member loses its
//! raft leader or elects another while it waits ends then, as a timeout (`leader`: a
//! proposal forwarded to a leader that died is never answered). A caller that gives up on a
//! request (drops it) after it has waited on an endpoint for a while moves the pin
//! on as well.
//!
//! Responses of up to [`MAX_DECODING_MESSAGE_SIZE`] are accepted, and
//! [`Backend::range`](crate::Backend::range) reads large prefixes in pages of [`RANGE_PAGE_SIZE`] keys,
//! all at the revision of the first page (one consistent snapshot).
//!
//! The client speaks etcd's v3 gRPC API directly, through the stubs in
//! [`edl_proto::etcd`] (generated from etcd's own `.proto` files). With
//! authentication on, each connection authenticates once and again whenever etcd
//! answers that its token is no longer valid (etcd's simple tokens expire).

//!
//! Layout: [`config`](EtcdConfig) (how to reach etcd), `conn` (one endpoint's
//! connection, auth and TLS), `failure` (errors and whether a request may be re-sent),
//! `leader` (a write in flight when its member's leader changes),
//! `codec` (edl's types to etcd's messages), `ops` (the [`Backend`](crate::Backend) operations),
//! `watch` (watch streams), `space` (freeing a full etcd), `snapshot` (a member's
//! database, as `etcdctl snapshot save` writes it), `members` and `admin` (the
//! membership, users and roles, for a tool that runs the etcd); this file holds the backend, its pinned endpoint and the
//! call loop.

mod admin;
mod codec;
mod config;
mod conn;
mod failure;
mod leader;
mod members;
mod ops;
mod snapshot;
mod space;
mod watch;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::OnceCell;
use tokio::time::Instant;

pub use admin::random_secret;
use codec::range_one;
pub use config::{EtcdAuth, EtcdConfig, EtcdTls};
pub(crate) use conn::probe_channel;
use conn::{Conn, connect_channel, load_tls};
use failure::{Failure, Resend, unavailable_msg, with_endpoint};
pub use members::EtcdMember;
pub use snapshot::{EtcdSnapshot, SNAPSHOT_HASH_LEN, SnapshotCheck};

use crate::error::{Error, Result};

/// The [`Backend`](crate::Backend) on etcd. Cheap to clone.
///
/// The connections run on the tokio runtime that made them: use the backend from
/// that runtime.
#[derive(Clone)]
pub struct EtcdBackend {
    inner: Arc<EtcdInner>,
}

struct EtcdInner {
    cfg: EtcdConfig,
    /// The TLS settings of `cfg.tls`, loaded once.
    tls: Option<edl_proto::tls::Tls>,
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

/// Keys of the first page of [`Backend::range`](crate::Backend::range) on etcd.
pub const RANGE_PAGE_SIZE: i64 = 1000;

/// Most keys per page of [`Backend::range`](crate::Backend::range): later pages grow to
/// about [`RANGE_PAGE_BYTES`], up to this many keys. etcd (3.4) collects every revision
/// from a page's first key to the range's end before it applies the limit, so reading N
/// keys in pages of P costs it about N²/2P: a million task records in pages of 1,000
/// took minutes, in pages of 100,000 a second or two.
pub const MAX_RANGE_PAGE_KEYS: i64 = 100_000;

/// Bytes of keys and values a page of [`Backend::range`](crate::Backend::range) aims
/// at (well under [`MAX_DECODING_MESSAGE_SIZE`]).
pub const RANGE_PAGE_BYTES: usize = 8 << 20;

/// Shortest time a re-sendable request waits on one endpoint before moving on.
const MIN_ATTEMPT_TIMEOUT: Duration = Duration::from_millis(500);

/// A caller that drops a request after it waited this long on one endpoint moves
/// the pin to the next endpoint (a healthy member answers in milliseconds).
const ROTATE_ON_DROP_AFTER: Duration = Duration::from_millis(250);

/// How an attempt ended without an answer.
enum Ended {
    /// Its share of the request timeout passed.
    TimedOut,
    /// A write's member lost its leader or elected another while it waited
    /// (`leader`).
    LeaderMoved,
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

impl EtcdBackend {
    /// Connects to the cluster: probes the endpoints in order (each within the dial
    /// timeout) and pins the first that answers. Fails with
    /// [`Error::Unavailable`] naming every endpoint when none answers.
    pub async fn connect(cfg: EtcdConfig) -> Result<Self> {
        let tls = match &cfg.tls {
            Some(t) => Some(load_tls(t).await?),
            None => None,
        };
        Self::connect_loaded(cfg, tls).await
    }

    /// [`connect`](EtcdBackend::connect) with TLS already loaded (from PEM held in
    /// memory, say) in place of `cfg.tls`'s files.
    pub async fn connect_with_tls(cfg: EtcdConfig, tls: edl_proto::tls::Tls) -> Result<Self> {
        Self::connect_loaded(cfg, Some(tls)).await
    }

    async fn connect_loaded(cfg: EtcdConfig, tls: Option<edl_proto::tls::Tls>) -> Result<Self> {
        if cfg.endpoints.is_empty() {
            return Err(Error::InvalidArgument("no etcd endpoints given".into()));
        }
        if cfg.dial_timeout.is_zero() || cfg.request_timeout.is_zero() {
            return Err(Error::InvalidArgument(
                "etcd dial and request timeouts must be positive".into(),
            ));
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
                tls,
                slots,
                pinned: AtomicUsize::new(0),
            }),
        };
        let mut errors = Vec::new();
        for (i, slot) in backend.inner.slots.iter().enumerate() {
            let probe = async {
                let mut conn = backend.conn(i).await?;
                match conn.kv.range(range_one(b"health")).await {
                    Ok(_) => Ok(()),
                    Err(s) => {
                        let f = Failure::from(s);
                        // A user limited to its own prefix (a job's user) may not read
                        // the probe's key: authentication worked and etcd answered.
                        if matches!(f.error, Error::PermissionDenied(_))
                            && backend.inner.cfg.auth.is_some()
                            && !f.stale_token
                        {
                            Ok(())
                        } else {
                            Err(f)
                        }
                    }
                }
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
                let channel = connect_channel(&slot.endpoint, cfg, self.inner.tls.as_ref()).await?;
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
            // A write also ends when its member's leader changes under it (`leader`).
            let result = match resend {
                Resend::Always => tokio::time::timeout_at(attempt_deadline, attempt)
                    .await
                    .map_err(|_| Ended::TimedOut),
                Resend::IfNotSent => tokio::select! {
                    r = tokio::time::timeout_at(attempt_deadline, attempt) => r.map_err(|_| Ended::TimedOut),
                    () = self.leader_moved(i) => Err(Ended::LeaderMoved),
                },
            };
            guard.armed = false;
            if !tried.contains(endpoint) {
                tried.push(endpoint.clone());
            }
            match result {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(failure)) => {
                    let error = with_endpoint(failure.error, endpoint);
                    // A full etcd is full on every member: trying another is no use.
                    if !error.is_retryable() || error.is_no_space() {
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
                Err(Ended::LeaderMoved) => {
                    // The member is fine (it has, or soon has, a new leader): the pin
                    // stays. The write may have been applied: not re-sent.
                    tracing::debug!(op, endpoint = %endpoint, waited = ?now.elapsed(), "etcd's leader changed under a write in flight; ending it as a timeout");
                    return Err(Error::Timeout(started.elapsed()));
                }
                Err(Ended::TimedOut) => {
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
