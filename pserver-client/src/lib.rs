//! The edl parameter servers' client ([`PsClient`]): finds the shards through etcd, maps
//! blocks and rows to shards, pushes and pulls to every shard in parallel, follows a
//! shard to its new address when `ps/<i>` changes, and retries idempotently. The
//! trainer, the Python binding and `edl` use it; it does not depend on the pserver
//! (`edl_pserver`), which depends on it instead for what both sides of the wire share.
//!
//! ```no_run
//! # async fn demo(backend: std::sync::Arc<dyn edl_coord::Backend>) -> Result<(), edl_pserver_client::PsClientError> {
//! use edl_job::JobName;
//! use edl_pserver_client::{DenseCache, DenseInit, PsClient, PsClientConfig};
//! use edl_pserver_client::{Mode, OptimizerConfig, ParamConfig};
//! use tokio_util::sync::CancellationToken;
//!
//! let job = JobName::new("job1").expect("a valid job name");
//! let ps = PsClient::connect(backend, PsClientConfig::new(job), CancellationToken::new()).await?;
//! let w = vec![0.0f32; 784 * 10];
//! let dense = [DenseInit { name: "w", shape: &[784, 10], values: &w }];
//! let cfg = ParamConfig::new(Mode::sync(), OptimizerConfig::adam(1e-3));
//! // Exactly one trainer initialises; the others get `AlreadyInitialised`.
//! ps.init("trainer-0", &dense, &[], cfg).await?;
//! let mut cache = DenseCache::new();
//! let mut step = ps.pull_dense(&mut cache).await?.next_step;
//! loop {
//!     let grad = vec![0.01f32; 784 * 10]; // computed on cache.get("w")
//!     let outcome = ps.push("trainer-0", step, &[("w", &grad)], &[]).await?;
//!     step = outcome.step + 1;
//!     ps.pull_dense(&mut cache).await?; // only changed blocks travel
//! #   break;
//! }
//! # Ok(()) }
//! ```
//!
//! Retries are safe: a push carries (trainer, session, step) and a pserver applies each
//! at most once; pulls and status calls are read-only; `Init` is idempotent.
//!
//! What both sides of the wire share is the contract crate `edl_pserver_api`, below both
//! this client and the pserver (which never depends on its client): the parameter layout
//! (the client routes blocks and rows to shards with it, the pserver checks and holds
//! them by it), the optimizers' update rules, the floats' encoding, the bulk path's
//! framing, the error kinds a refusal carries, a push's [`Origin`] and the transport's
//! limits. This crate re-exports them, so a client's user needs no other crate.
//!
//! Layout (the client's parts each add the methods of one concern to [`PsClient`]):
//! - [`error`]: [`PsClientError`], and whether a refusal can be retried (the pserver's
//!   [`ErrorKind`](error::ErrorKind)s of a refusal are the contract's).
//! - `connection`: finding a shard's pserver in `ps/` and connecting to it (gRPC, and
//!   the bulk path when it offers one); a call in flight is abandoned when the shard
//!   moves.
//! - `bulk`: the client's pool of bulk-path connections to one pserver.
//! - `retry`: one call to one shard, retried until `retry_for` ends, and how each kind
//!   of refusal is treated.
//! - `init`: initialising the parameters once for the job (an etcd election among the
//!   trainers) and the job's layout.
//! - `cache`: the trainer's copy of the dense parameters ([`DenseCache`]).
//! - `pull`: dense blocks that changed and sparse rows, from every shard in parallel.
//! - `push`: gradients to every shard in parallel, and `Leave`.
//! - `status`: shard status through etcd, and [`probe`] of one address.
//! - re-exported from the contract: [`layout`] ([`ParamSpec`], [`ParamConfig`], [`Mode`]),
//!   [`optim`] (the update rules; the trainer's single-process baseline reuses them),
//!   [`wire`], [`Origin`] and the transport's limits ([`DEFAULT_MAX_MESSAGE_BYTES`],
//!   [`STREAM_WINDOW`], [`CONNECTION_WINDOW`], [`MAX_FRAME`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use edl_coord::Backend;
use tokio::sync::{Mutex, RwLock, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::layout::Layout;

use edl_coord::{PrefixView, follow_prefix};
use edl_job::{JobKeys, JobName};

mod bulk;
mod cache;
mod connection;
pub mod error;
mod init;
mod pull;
mod push;
mod retry;
mod status;

pub use cache::{CachedParam, DenseCache};
pub use edl_pserver_api::layout::{DenseSpec, Mode, ParamConfig, ParamSpec, RowInit, SparseSpec};
pub use edl_pserver_api::optim::{
    Clip, LrSchedule, Optimizer, OptimizerConfig, OptimizerKind, SlotState,
};
pub use edl_pserver_api::{
    CONNECTION_WINDOW, DEFAULT_MAX_MESSAGE_BYTES, MAX_FRAME, Origin, STREAM_WINDOW, layout, optim,
    wire,
};
pub use error::PsClientError;
pub use init::{DenseInit, InitOutcome, InitRecord};
pub use pull::PullStats;
pub use push::{PushOutcome, SparsePush};
pub use status::probe;

use connection::Conn;

type Result<T, E = PsClientError> = std::result::Result<T, E>;

/// Client settings.
#[derive(Clone, Debug)]
pub struct PsClientConfig {
    /// The job.
    pub job: JobName,
    /// The job token, if the job has one.
    pub token: Option<String>,
    /// How long one call keeps retrying (reconnecting, waiting for a replacement
    /// pserver) before it gives up.
    pub retry_for: Duration,
    /// Connect timeout to a pserver.
    pub connect_timeout: Duration,
    /// Deadline of one attempt of a call (large pushes and pulls included).
    pub call_timeout: Duration,
    /// Sync mode: how long one push call may wait for its step on the server before the
    /// client asks again.
    pub sync_wait: Duration,
    /// TTL of the lease held while initialising (a dead initialiser is replaced within it).
    pub init_lease_ttl: Duration,
    /// Largest message sent or received.
    pub max_message_bytes: usize,
    /// Largest `Init` message (bigger shards are sent in several).
    pub init_chunk_bytes: usize,
    /// Moves dense pushes and pulls over the pservers' bulk path (plain TCP on the same
    /// port, floats outside protobuf) when they offer it; gRPC otherwise.
    pub bulk: bool,
    /// Dial pservers over TLS (gRPC and the bulk path); `None`: plain.
    pub tls: Option<edl_proto::tls::Tls>,
    /// Told when a call starts retrying after a failure and when it ends (a trainer
    /// counts that time as recovering).
    pub observer: Option<Arc<dyn RetryObserver>>,
}

/// Told when a call is being retried after a failure (an unreachable pserver, a shard
/// moved or not serving yet): `retrying(true)` before its second attempt, `retrying(false)`
/// when the call ends, however it ends. Calls may overlap: each says both.
pub trait RetryObserver: Send + Sync + std::fmt::Debug {
    /// A call began (`true`) or ended (`false`) retrying.
    fn retrying(&self, on: bool);
}

impl PsClientConfig {
    /// Defaults for job `job`: retry for 60 s, connect 3 s, calls 60 s, sync wait 10 s.
    pub fn new(job: JobName) -> Self {
        PsClientConfig {
            job,
            token: None,
            retry_for: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(3),
            call_timeout: Duration::from_secs(60),
            sync_wait: Duration::from_secs(10),
            init_lease_ttl: Duration::from_secs(5),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            init_chunk_bytes: 64 << 20,
            bulk: true,
            tls: None,
            observer: None,
        }
    }
}

#[derive(Debug)]
struct Inner {
    cfg: PsClientConfig,
    backend: Arc<dyn Backend>,
    keys: JobKeys,
    shards: u32,
    view: watch::Receiver<Arc<PrefixView>>,
    conns: Mutex<HashMap<u32, Conn>>,
    layout: RwLock<Option<Arc<Layout>>>,
    session: u64,
    cancel: CancellationToken,
}

/// A client of a job's pservers. Cheap to clone (shared connections).
#[derive(Debug, Clone)]
pub struct PsClient {
    inner: Arc<Inner>,
}

impl PsClient {
    /// Connects to the pservers of `cfg.job` through etcd: reads the shard count
    /// (`ps/desired`, waiting up to `retry_for` for it) and follows `ps/<i>`.
    pub async fn connect(
        backend: Arc<dyn Backend>,
        cfg: PsClientConfig,
        cancel: CancellationToken,
    ) -> Result<PsClient> {
        let keys = JobKeys::new(&cfg.job);
        let start = Instant::now();
        let shards = loop {
            // etcd unavailable is retried like a missing key, within `retry_for`.
            let (found, last) = match backend.get(&keys.desired()).await {
                Ok(kv) => (
                    kv,
                    format!("{} is not set (no pserver started)", keys.desired()),
                ),
                Err(e) if e.is_retryable() => (None, e.to_string()),
                Err(e) => return Err(e.into()),
            };
            if let Some(kv) = found {
                match std::str::from_utf8(&kv.value)
                    .ok()
                    .and_then(|s| s.trim().parse::<u32>().ok())
                    .filter(|n| *n > 0)
                {
                    Some(n) => break n,
                    None => {
                        return Err(PsClientError::InvalidArgument(format!(
                            "{} holds {:?}, not a shard count",
                            keys.desired(),
                            String::from_utf8_lossy(&kv.value)
                        )));
                    }
                }
            }
            if start.elapsed() >= cfg.retry_for {
                return Err(PsClientError::Unavailable {
                    job: cfg.job.to_string(),
                    shard: 0,
                    waited: start.elapsed(),
                    last,
                });
            }
            tokio::select! {
                _ = cancel.cancelled() => return Err(PsClientError::Cancelled),
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        };
        let view = follow_prefix(backend.clone(), keys.ps_prefix(), cancel.child_token());
        Ok(PsClient {
            inner: Arc::new(Inner {
                cfg,
                backend,
                keys,
                shards,
                view,
                conns: Mutex::new(HashMap::new()),
                layout: RwLock::new(None),
                session: rand::random::<u64>() | 1,
                cancel,
            }),
        })
    }

    /// The shard count.
    pub fn shards(&self) -> u32 {
        self.inner.shards
    }

    /// This client's push session (random; a new client starts a new sequence of steps).
    pub fn session(&self) -> u64 {
        self.inner.session
    }
}
