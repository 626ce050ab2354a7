//! The trainer's pserver client: finds the shards through etcd, maps blocks and rows to
//! shards, pushes and pulls to every shard in parallel, follows a shard to its new
//! address when `ps/<i>` changes, and retries idempotently.
//!
//! ```no_run
//! # async fn demo(backend: std::sync::Arc<dyn edl_coord::Backend>) -> Result<(), edl_pserver::PsClientError> {
//! use edl_pserver::client::{ClientConfig, DenseCache, DenseInit, PsClient};
//! use edl_pserver::{Mode, OptimizerConfig, ParamConfig};
//! use tokio_util::sync::CancellationToken;
//!
//! let ps = PsClient::connect(backend, ClientConfig::new("job1"), CancellationToken::new()).await?;
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

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, Election, Lease, Op};
use edl_proto::pserver as pb;
use futures::future::join_all;
use pb::parameter_server_client::ParameterServerClient as GrpcClient;
use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, RwLock, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::{Channel, Endpoint};

use crate::bulk;
use crate::checkpoint::protocol::now_ms;
use crate::error::{ErrorKind, next_step_of};
use crate::follow::{PrefixView, follow_prefix};
use crate::keys::{PsKeys, valid_id};
use crate::layout::{DenseSpec, Layout, Mode, ModelSpec, ParamConfig, SparseSpec, SpecError};
use crate::optim::ClipPlan;
use crate::server::{
    CONNECTION_WINDOW, DEFAULT_MAX_MESSAGE_BYTES, MAX_FRAME, PsRecord, STREAM_WINDOW,
};
use crate::wire;

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum PsClientError {
    /// A shard did not answer within the call's retry budget.
    #[error("shard {shard} of job {job} unreachable for {waited:?}: {last}")]
    Unavailable {
        /// The job.
        job: String,
        /// The shard.
        shard: u32,
        /// How long the call tried.
        waited: Duration,
        /// The last error seen.
        last: String,
    },
    /// A pserver refused the call (malformed request, NaN gradients, ...); retrying will
    /// not help.
    #[error("shard {shard} refused: {status}")]
    Refused {
        /// The shard.
        shard: u32,
        /// The status.
        status: tonic::Status,
    },
    /// The arguments do not fit the model (unknown parameter, wrong length, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Sync mode: the step was applied without this push; pull and push `next`.
    #[error("step {step} was already applied without this trainer; the next step is {next}")]
    StaleStep {
        /// The step pushed.
        step: u64,
        /// The step to push next.
        next: u64,
    },
    /// A pserver probed directly refused or failed the call.
    #[error("the pserver at {addr} refused: {status}")]
    ProbeRefused {
        /// The address.
        addr: String,
        /// The status.
        status: tonic::Status,
    },
    /// A pserver could not be reached at all (direct probes).
    #[error("cannot reach the pserver at {addr}: {msg}")]
    Connect {
        /// The address.
        addr: String,
        /// What failed.
        msg: String,
    },
    /// No trainer initialised the parameters yet.
    #[error("the parameters of job {0} are not initialised yet")]
    NotInitialised(String),
    /// The job was initialised with another model spec.
    #[error("the job's parameters were initialised with another model spec: {0}")]
    SpecMismatch(String),
    /// The spec is invalid.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// etcd failed.
    #[error("etcd: {0}")]
    Coord(edl_coord::Error),
    /// Cancelled.
    #[error("cancelled")]
    Cancelled,
}

// The message includes the cause's text, so the cause is not also its `source()`
// (a report of the chain would say it twice).
impl From<edl_coord::Error> for PsClientError {
    fn from(e: edl_coord::Error) -> Self {
        PsClientError::Coord(e)
    }
}

impl PsClientError {
    /// The gRPC code of a refusal.
    pub fn code(&self) -> Option<Code> {
        match self {
            PsClientError::Refused { status, .. } | PsClientError::ProbeRefused { status, .. } => {
                Some(status.code())
            }
            _ => None,
        }
    }

    /// The pserver's error kind of a refusal.
    pub fn kind(&self) -> Option<ErrorKind> {
        match self {
            PsClientError::Refused { status, .. } | PsClientError::ProbeRefused { status, .. } => {
                ErrorKind::of(status)
            }
            _ => None,
        }
    }
}

type Result<T, E = PsClientError> = std::result::Result<T, E>;

/// Client settings.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// The job.
    pub job: String,
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
}

impl ClientConfig {
    /// Defaults for job `job`: retry for 60 s, connect 3 s, calls 60 s, sync wait 10 s.
    pub fn new(job: impl Into<String>) -> Self {
        ClientConfig {
            job: job.into(),
            token: None,
            retry_for: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(3),
            call_timeout: Duration::from_secs(60),
            sync_wait: Duration::from_secs(10),
            init_lease_ttl: Duration::from_secs(5),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            init_chunk_bytes: 64 << 20,
            bulk: true,
        }
    }
}

/// Initial values of a dense parameter.
#[derive(Debug, Clone, Copy)]
pub struct DenseInit<'a> {
    /// Unique name.
    pub name: &'a str,
    /// Shape.
    pub shape: &'a [usize],
    /// `product(shape)` values.
    pub values: &'a [f32],
}

/// Gradients of rows of a sparse table.
#[derive(Debug, Clone, Copy)]
pub struct SparseGrad<'a> {
    /// The table.
    pub table: &'a str,
    /// Row ids (repeats are summed).
    pub rows: &'a [u64],
    /// `rows.len() * dim` values, row after row.
    pub values: &'a [f32],
}

/// Who initialised the parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InitOutcome {
    /// This call did.
    Initialised,
    /// Another trainer did (before or meanwhile); this call waited for it to finish.
    AlreadyInitialised,
}

/// The value of `params/init`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitRecord {
    /// The trainer that initialised.
    pub trainer: String,
    /// When (ms since the Unix epoch).
    pub at_ms: u64,
    /// The shard count.
    pub shards: u32,
}

/// What a push did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushOutcome {
    /// Sync: the step the gradients were applied in. Async: the step pushed.
    pub step: u64,
    /// False when every shard had already applied it (a retried push).
    pub applied: bool,
}

/// What a pull did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PullStats {
    /// Blocks received (changed since the cache's copy).
    pub blocks: usize,
    /// Bytes of values received.
    pub bytes: usize,
    /// Sync: the step to push next (the most advanced shard's). Async: updates applied
    /// by the shards, summed.
    pub next_step: u64,
}

/// A dense parameter in the cache.
#[derive(Debug, Clone)]
pub struct DenseParam {
    /// Name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Values.
    pub values: Vec<f32>,
}

/// The trainer's copy of the dense parameters, with the version of each block so that a
/// pull only moves blocks that changed.
#[derive(Debug, Clone, Default)]
pub struct DenseCache {
    spec: Option<Arc<ModelSpec>>,
    params: Vec<DenseParam>,
    by_name: HashMap<String, usize>,
    versions: Vec<Vec<u64>>,
    incarnations: Vec<u64>,
    complete: Vec<bool>,
    next_step: u64,
}

impl DenseCache {
    /// An empty cache (filled by the first pull).
    pub fn new() -> Self {
        Self::default()
    }

    /// The values of parameter `name`.
    pub fn get(&self, name: &str) -> Option<&[f32]> {
        self.by_name
            .get(name)
            .map(|&i| self.params[i].values.as_slice())
    }

    /// Every parameter, in spec order.
    pub fn params(&self) -> &[DenseParam] {
        &self.params
    }

    /// The step to push next, as of the last pull (sync mode).
    pub fn next_step(&self) -> u64 {
        self.next_step
    }

    /// Forgets the block versions (keeping the values and their buffers): the next pull
    /// moves every block again.
    pub fn invalidate(&mut self) {
        for v in self.versions.iter_mut().flatten() {
            *v = 0;
        }
    }

    fn reset(&mut self, layout: &Layout) {
        let spec = layout.spec();
        self.params = spec
            .dense
            .iter()
            .map(|d| DenseParam {
                name: d.name.clone(),
                shape: d.shape.clone(),
                values: vec![0.0; d.numel().unwrap_or(0)],
            })
            .collect();
        self.by_name = spec
            .dense
            .iter()
            .enumerate()
            .map(|(i, d)| (d.name.clone(), i))
            .collect();
        let n = layout.shards() as usize;
        self.versions = (0..n)
            .map(|s| vec![0; layout.shard_blocks(s as u32).len()])
            .collect();
        self.incarnations = vec![0; n];
        self.complete = vec![false; n];
        self.spec = Some(spec.clone());
    }
}

#[derive(Debug)]
struct Conn {
    revision: i64,
    addr: String,
    target: Target,
}

/// How to reach one pserver: gRPC, and the bulk path when it offers one.
#[derive(Debug, Clone)]
struct Target {
    grpc: GrpcClient<Channel>,
    bulk: Option<Arc<bulk::Pool>>,
}

#[derive(Debug)]
struct Inner {
    cfg: ClientConfig,
    backend: Arc<dyn Backend>,
    keys: PsKeys,
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

/// Codes worth retrying (possibly at a replacement pserver).
fn retryable(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled
    ) || ErrorKind::of(s) == Some(ErrorKind::NotServing)
}

/// How one attempt of a call ended.
enum Attempt<R> {
    Done(R),
    Retry(String),
    Fail(PsClientError),
}

impl PsClient {
    /// Connects to the pservers of `cfg.job` through etcd: reads the shard count
    /// (`ps/desired`, waiting up to `retry_for` for it) and follows `ps/<i>`.
    pub async fn connect(
        backend: Arc<dyn Backend>,
        cfg: ClientConfig,
        cancel: CancellationToken,
    ) -> Result<PsClient> {
        if !valid_id(&cfg.job) {
            return Err(PsClientError::InvalidArgument(format!(
                "invalid job name {:?}",
                cfg.job
            )));
        }
        let keys = PsKeys::new(&cfg.job);
        let start = Instant::now();
        let shards = loop {
            if let Some(kv) = backend.get(&keys.desired()).await? {
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
                    job: cfg.job.clone(),
                    shard: 0,
                    waited: start.elapsed(),
                    last: format!("{} is not set (no pserver started)", keys.desired()),
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

    /// The record and claim revision of shard `shard`, waiting until `until`.
    async fn locate(&self, shard: u32, until: Instant) -> Result<(PsRecord, i64), String> {
        let key = self.inner.keys.ps(shard);
        let mut rx = self.inner.view.clone();
        loop {
            {
                let v = rx.borrow_and_update();
                if let Some(kv) = v.kvs.get(&key) {
                    return match serde_json::from_slice::<PsRecord>(&kv.value) {
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
    async fn moved(&self, shard: u32, revision: i64) {
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

    async fn client(&self, shard: u32, until: Instant) -> Result<(Target, i64), String> {
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
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| format!("bad pserver address {addr:?}: {e}"))?
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
                cfg.job.clone(),
                cfg.token.clone(),
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

    fn request<T>(&self, msg: T, timeout: Duration) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        req.set_timeout(timeout);
        let md = req.metadata_mut();
        if let Ok(v) = self.inner.cfg.job.parse() {
            md.insert(edl_proto::JOB_HEADER, v);
        }
        if let Some(t) = &self.inner.cfg.token
            && let Ok(v) = t.parse()
        {
            md.insert(edl_proto::TOKEN_HEADER, v);
        }
        req
    }

    /// Runs `op` on shard `shard`, retrying transient failures (reconnecting to the
    /// shard's current holder) until `retry_for` ends. `classify` may turn a refusal into
    /// a retry or a specific error.
    async fn call<T, R, F, Fut>(
        &self,
        shard: u32,
        msg: T,
        timeout: Duration,
        op: F,
        classify: impl Fn(&tonic::Status) -> Option<Attempt<R>>,
    ) -> Result<R>
    where
        T: Clone,
        F: Fn(Target, tonic::Request<T>) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<tonic::Response<R>, tonic::Status>>,
    {
        let start = Instant::now();
        let until = start + self.inner.cfg.retry_for;
        let mut delay = Duration::from_millis(20);
        loop {
            if self.inner.cancel.is_cancelled() {
                return Err(PsClientError::Cancelled);
            }
            let attempt = match self.client(shard, until).await {
                Ok((c, revision)) => match tokio::select! {
                    r = op(c, self.request(msg.clone(), timeout)) => Some(r),
                    _ = self.moved(shard, revision) => None,
                } {
                    None => {
                        self.inner.conns.lock().await.remove(&shard);
                        Attempt::Retry(format!("shard {shard} moved to another pserver"))
                    }
                    Some(Ok(resp)) => Attempt::Done(resp.into_inner()),
                    Some(Err(s)) => match classify(&s) {
                        Some(a) => a,
                        None if retryable(&s) => {
                            // The shard may have moved: reconnect on the next attempt.
                            self.inner.conns.lock().await.remove(&shard);
                            Attempt::Retry(format!("{}: {}", s.code(), s.message()))
                        }
                        None => Attempt::Fail(PsClientError::Refused { shard, status: s }),
                    },
                },
                Err(e) => Attempt::Retry(e),
            };
            let last = match attempt {
                Attempt::Done(r) => return Ok(r),
                Attempt::Fail(e) => return Err(e),
                Attempt::Retry(last) => last,
            };
            let now = Instant::now();
            if now >= until {
                return Err(PsClientError::Unavailable {
                    job: self.inner.cfg.job.clone(),
                    shard,
                    waited: now - start,
                    last,
                });
            }
            tracing::debug!(shard, error = %last, "pserver call failed; retrying");
            tokio::select! {
                _ = self.inner.cancel.cancelled() => return Err(PsClientError::Cancelled),
                _ = tokio::time::sleep(delay.min(until - now)) => {}
            }
            delay = (delay * 2).min(Duration::from_millis(500));
        }
    }

    /// The layout of the initialised parameters (from `params/spec`).
    pub async fn layout(&self) -> Result<Arc<Layout>> {
        if let Some(l) = self.inner.layout.read().await.clone() {
            return Ok(l);
        }
        let Some(kv) = self
            .inner
            .backend
            .get(&self.inner.keys.params_spec())
            .await?
        else {
            return Err(PsClientError::NotInitialised(self.inner.cfg.job.clone()));
        };
        let json = std::str::from_utf8(&kv.value).map_err(|_| {
            PsClientError::Spec(SpecError::Invalid("params/spec is not UTF-8".into()))
        })?;
        let layout = Arc::new(Layout::new(ModelSpec::from_json(json)?, self.inner.shards)?);
        *self.inner.layout.write().await = Some(layout.clone());
        Ok(layout)
    }

    /// Waits (up to `within`) until some trainer initialised the parameters.
    pub async fn wait_initialised(&self, within: Duration) -> Result<Arc<Layout>> {
        let until = Instant::now() + within;
        loop {
            match self.layout().await {
                Err(PsClientError::NotInitialised(job)) => {
                    if Instant::now() >= until {
                        return Err(PsClientError::NotInitialised(job));
                    }
                    tokio::select! {
                        _ = self.inner.cancel.cancelled() => return Err(PsClientError::Cancelled),
                        _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                    }
                }
                other => return other,
            }
        }
    }

    /// Initialises the parameters unless another trainer did: trainers campaign in an
    /// etcd election under short leases; the leader initialises every shard (if
    /// `params/init` is absent), records `params/init` and `params/spec`, and resigns.
    /// Every other trainer gets [`InitOutcome::AlreadyInitialised`] once the parameters
    /// are ready. If the initialiser dies, the next candidate takes over (shards already
    /// initialised keep their values).
    pub async fn init(
        &self,
        trainer: &str,
        dense: &[DenseInit<'_>],
        sparse: &[SparseSpec],
        config: ParamConfig,
    ) -> Result<InitOutcome> {
        if !valid_id(trainer) {
            return Err(PsClientError::InvalidArgument(format!(
                "trainer id {trainer:?} must be non-empty and contain no '/'"
            )));
        }
        let spec = ModelSpec {
            dense: dense
                .iter()
                .map(|d| DenseSpec {
                    name: d.name.to_owned(),
                    shape: d.shape.to_vec(),
                })
                .collect(),
            sparse: sparse.to_vec(),
            config,
        };
        let layout = Arc::new(Layout::new(spec, self.inner.shards)?);
        for (d, s) in dense.iter().zip(&layout.spec().dense) {
            if Some(d.values.len()) != s.numel() {
                return Err(PsClientError::InvalidArgument(format!(
                    "parameter {:?} has {} values for shape {:?}",
                    d.name,
                    d.values.len(),
                    d.shape
                )));
            }
        }
        let keys = &self.inner.keys;
        let backend = self.inner.backend.clone();
        if backend.get(&keys.params_init()).await?.is_some() {
            return self.adopt(&layout).await;
        }
        let lease = Lease::grant(
            backend.clone(),
            self.inner.cfg.init_lease_ttl,
            self.inner.cancel.child_token(),
        )
        .await?;
        let election = Election::new(backend.clone(), keys.params_init_election());
        let leadership = election
            .campaign(&lease, trainer.as_bytes().to_vec(), &self.inner.cancel)
            .await
            .map_err(|e| match e {
                edl_coord::Error::Cancelled => PsClientError::Cancelled,
                other => other.into(),
            })?;
        let result = async {
            if backend.get(&keys.params_init()).await?.is_some() {
                return self.adopt(&layout).await;
            }
            tracing::info!(
                trainer,
                shards = self.inner.shards,
                "initialising the parameters"
            );
            let sends = (0..self.inner.shards)
                .map(|s| self.init_shard(s, trainer, &layout, |p| dense[p].values));
            for r in join_all(sends).await {
                r?;
            }
            let record = InitRecord {
                trainer: trainer.to_owned(),
                at_ms: now_ms(),
                shards: self.inner.shards,
            };
            let value = serde_json::to_vec(&record).unwrap_or_default();
            leadership
                .fenced_txn(vec![
                    Op::put(keys.params_init(), value),
                    Op::put(keys.params_spec(), layout.spec().to_json()),
                ])
                .await?;
            *self.inner.layout.write().await = Some(layout.clone());
            tracing::info!(trainer, "parameters initialised");
            Ok(InitOutcome::Initialised)
        }
        .await;
        if let Err(e) = leadership.resign().await {
            tracing::debug!(error = %e, "resign failed; the lease ends anyway");
        }
        let _ = lease.revoke().await;
        result
    }

    /// Checks our spec against the job's and adopts the job's layout.
    async fn adopt(&self, ours: &Arc<Layout>) -> Result<InitOutcome> {
        let theirs = self.wait_initialised(self.inner.cfg.retry_for).await?;
        if theirs.spec() != ours.spec() {
            return Err(PsClientError::SpecMismatch(format!(
                "this trainer's spec differs from params/spec of job {}",
                self.inner.cfg.job
            )));
        }
        Ok(InitOutcome::AlreadyInitialised)
    }

    /// Sends shard `shard` its initial blocks (`values(param)` gives a parameter's
    /// values) in messages of bounded size, then `FinishInit`.
    async fn init_shard<'v>(
        &self,
        shard: u32,
        trainer: &str,
        layout: &Layout,
        values: impl Fn(usize) -> &'v [f32],
    ) -> Result<()> {
        let spec_json = layout.spec().to_json();
        let shards = self.inner.shards;
        let mut batches: Vec<Vec<pb::DenseBlock>> = vec![Vec::new()];
        let mut size = 0usize;
        for &id in layout.shard_blocks(shard) {
            let Some(b) = layout.block(id) else { continue };
            let v = values(b.param as usize);
            let Some(slice) = v.get(b.offset..b.offset + b.len) else {
                return Err(PsClientError::InvalidArgument(format!(
                    "values of parameter {} are too short",
                    b.param
                )));
            };
            if size > 0 && size + b.len * 4 > self.inner.cfg.init_chunk_bytes {
                batches.push(Vec::new());
                size = 0;
            }
            size += b.len * 4;
            if let Some(last) = batches.last_mut() {
                last.push(pb::DenseBlock {
                    id,
                    version: 0,
                    values: wire::encode(slice),
                });
            }
        }
        for blocks in batches {
            let msg = pb::InitRequest {
                shard,
                shards,
                trainer: trainer.to_owned(),
                spec_json: spec_json.clone(),
                blocks,
            };
            let resp = self
                .call(
                    shard,
                    msg,
                    self.inner.cfg.call_timeout,
                    |t, r| async move { t.grpc.clone().init(r).await },
                    |s| spec_mismatch(s, shard),
                )
                .await?;
            if resp.already_initialised {
                return Ok(());
            }
        }
        let msg = pb::FinishInitRequest {
            shard,
            shards,
            trainer: trainer.to_owned(),
        };
        self.call(
            shard,
            msg,
            self.inner.cfg.call_timeout,
            |t, r| async move { t.grpc.clone().finish_init(r).await },
            |_| None,
        )
        .await?;
        Ok(())
    }

    /// Fills `cache` with `values` (one vector per dense parameter, in spec order) as
    /// this trainer's copy, so that a shard found without parameters (restarted before
    /// its first checkpoint) can be initialised again from them even before this
    /// trainer's first pull succeeded. The next pull moves every block.
    pub async fn seed_cache(&self, cache: &mut DenseCache, values: &[Vec<f32>]) -> Result<()> {
        let layout = self.layout().await?;
        cache.reset(&layout);
        for (p, v) in cache.params.iter_mut().zip(values) {
            if p.values.len() != v.len() {
                return Err(PsClientError::InvalidArgument(format!(
                    "{} values for parameter {} of {} values",
                    v.len(),
                    p.name,
                    p.values.len()
                )));
            }
            p.values.copy_from_slice(v);
        }
        cache.complete.iter_mut().for_each(|c| *c = true);
        Ok(())
    }

    /// Pulls the dense blocks that changed since `cache`'s copy from every shard in
    /// parallel. A shard that lost its parameters (restarted without a checkpoint) is
    /// initialised again from the cache's copy, when the cache has one.
    pub async fn pull_dense(&self, cache: &mut DenseCache) -> Result<PullStats> {
        let layout = self.layout().await?;
        if cache.spec.as_ref() != Some(layout.spec()) {
            cache.reset(&layout);
        }
        let timeout = self.inner.cfg.call_timeout;
        let pulls = (0..self.inner.shards).map(|s| {
            let msg = pb::PullRequest {
                shard: s,
                shards: self.inner.shards,
                known_versions: cache.versions[s as usize].clone(),
                incarnation: cache.incarnations[s as usize],
            };
            let cache = &*cache;
            let layout = &layout;
            async move {
                loop {
                    let r = self
                        .call(
                            s,
                            msg.clone(),
                            timeout,
                            |t, r| async move {
                                match &t.bulk {
                                    Some(b) => b.pull(r.into_inner(), timeout).await.map(tonic::Response::new),
                                    None => t.grpc.clone().pull(r).await,
                                }
                            },
                            |st| uninitialised(st, s),
                        )
                        .await;
                    match r {
                        Err(PsClientError::Refused { status, .. })
                            if ErrorKind::of(&status) == Some(ErrorKind::Uninitialised)
                                && cache.complete[s as usize] =>
                        {
                            tracing::warn!(shard = s, "shard lost its parameters; initialising it again from this trainer's copy");
                            self.init_shard(s, "reinit", layout, |p| {
                                cache.params.get(p).map_or(&[][..], |d| d.values.as_slice())
                            })
                            .await?;
                        }
                        other => return other,
                    }
                }
            }
        });
        let responses = join_all(pulls).await;
        let mut stats = PullStats::default();
        let sync = layout.spec().config.mode.is_sync();
        for (s, resp) in responses.into_iter().enumerate() {
            let resp = resp?;
            if resp.incarnation != cache.incarnations[s] {
                cache.incarnations[s] = resp.incarnation;
                cache.versions[s].iter_mut().for_each(|v| *v = 0);
            }
            for b in resp.blocks {
                let Some(info) = layout.block(b.id).filter(|i| i.shard == s as u32) else {
                    return Err(PsClientError::InvalidArgument(format!(
                        "shard {s} sent block {} it does not hold",
                        b.id
                    )));
                };
                if Some(b.values.len()) != wire::byte_len(info.len) {
                    return Err(PsClientError::InvalidArgument(format!(
                        "shard {s} sent {} bytes for block {}",
                        b.values.len(),
                        b.id
                    )));
                }
                if let Some(p) = cache.params.get_mut(info.param as usize)
                    && let Some(dst) = p.values.get_mut(info.offset..info.offset + info.len)
                {
                    wire::decode_into(&b.values, dst);
                }
                if let Some(v) = cache.versions[s].get_mut(info.local as usize) {
                    *v = b.version;
                }
                stats.blocks += 1;
                stats.bytes += b.values.len();
            }
            cache.complete[s] = true;
            stats.next_step = if sync {
                stats.next_step.max(resp.next_step)
            } else {
                stats.next_step + resp.updates
            };
        }
        cache.next_step = stats.next_step;
        Ok(stats)
    }

    /// Values of `rows` of sparse table `table`, row after row (`rows.len() * dim`).
    pub async fn pull_sparse(&self, table: &str, rows: &[u64]) -> Result<Vec<f32>> {
        let layout = self.layout().await?;
        let Some(ti) = layout.table_index(table) else {
            return Err(PsClientError::InvalidArgument(format!(
                "unknown table {table:?}"
            )));
        };
        let dim = layout.spec().sparse[ti].dim;
        let mut per_shard: Vec<Vec<usize>> = vec![Vec::new(); self.inner.shards as usize];
        for (i, &r) in rows.iter().enumerate() {
            per_shard[layout.row_shard(r) as usize].push(i);
        }
        let calls = per_shard
            .iter()
            .enumerate()
            .filter(|(_, idx)| !idx.is_empty())
            .map(|(s, idx)| {
                let msg = pb::PullSparseRequest {
                    shard: s as u32,
                    shards: self.inner.shards,
                    table: ti as u32,
                    rows: idx.iter().map(|&i| rows[i]).collect(),
                };
                async move {
                    let r = self
                        .call(
                            s as u32,
                            msg,
                            self.inner.cfg.call_timeout,
                            |t, r| async move { t.grpc.clone().pull_sparse(r).await },
                            |st| uninitialised(st, s as u32),
                        )
                        .await?;
                    Ok::<_, PsClientError>((s, r.values))
                }
            });
        let mut out = vec![0f32; rows.len() * dim];
        for r in join_all(calls).await {
            let (s, values) = r?;
            let idx = &per_shard[s];
            if values.len() != idx.len() * dim * 4 {
                return Err(PsClientError::InvalidArgument(format!(
                    "shard {s} sent {} bytes for {} rows",
                    values.len(),
                    idx.len()
                )));
            }
            for (k, &i) in idx.iter().enumerate() {
                wire::decode_into(
                    &values[k * dim * 4..(k + 1) * dim * 4],
                    &mut out[i * dim..(i + 1) * dim],
                );
            }
        }
        Ok(out)
    }

    /// Pushes the gradients of one step of `trainer` to every shard in parallel.
    ///
    /// The gradients are clipped first as the optimizer config says (by value, then by
    /// the global norm of everything pushed here). A parameter left out contributes
    /// nothing (in sync mode it still counts this trainer in the step's divisor).
    ///
    /// - Async mode: `step` is this trainer's own counter, a different value for each
    ///   push of this client (a retry reuses it); returns once every shard applied it.
    ///   A push more than [`DEDUP_WINDOW`](crate::shard::DEDUP_WINDOW) steps behind this
    ///   client's newest is refused ([`ErrorKind::TooOld`]): whether it was applied can no
    ///   longer be told.
    /// - Sync mode: `step` is the global step (from [`PullStats::next_step`], or the
    ///   previous outcome's step plus one); returns once every shard applied the step, or
    ///   [`PsClientError::StaleStep`] when the step was closed without this trainer (pull,
    ///   then push `next`). The trainer must be registered under `trainers/`. A shard that
    ///   keeps its step open longer than `retry_for` plus twice the step timeout (it
    ///   should have closed it by then) fails the push with
    ///   [`PsClientError::Unavailable`].
    ///
    /// Retrying a push (same client, trainer and step) never applies it twice.
    pub async fn push(
        &self,
        trainer: &str,
        step: u64,
        dense: &[(&str, &[f32])],
        sparse: &[SparseGrad<'_>],
    ) -> Result<PushOutcome> {
        if !valid_id(trainer) {
            return Err(PsClientError::InvalidArgument(format!(
                "trainer id {trainer:?} must be non-empty and contain no '/'"
            )));
        }
        let layout = self.layout().await?;
        let spec = layout.spec();
        let sync = spec.config.mode.is_sync();
        let plan: ClipPlan = spec.config.optimizer.clip.plan(
            dense
                .iter()
                .map(|(_, g)| *g)
                .chain(sparse.iter().map(|s| s.values)),
        );
        let n = self.inner.shards as usize;
        let mut reqs: Vec<pb::PushRequest> = (0..n)
            .map(|s| pb::PushRequest {
                shard: s as u32,
                shards: self.inner.shards,
                trainer: trainer.to_owned(),
                session: self.inner.session,
                step,
                dense: Vec::new(),
                sparse: Vec::new(),
                wait_ms: self
                    .inner
                    .cfg
                    .sync_wait
                    .as_millis()
                    .min(u128::from(u32::MAX)) as u32,
            })
            .collect();
        for (name, grad) in dense {
            let Some(p) = layout.param_index(name) else {
                return Err(PsClientError::InvalidArgument(format!(
                    "unknown parameter {name:?}"
                )));
            };
            let want = spec.dense[p].numel().unwrap_or(0);
            if grad.len() != want {
                return Err(PsClientError::InvalidArgument(format!(
                    "gradient of {name:?} has {} values, the parameter has {want}",
                    grad.len()
                )));
            }
            for b in layout.param_blocks(p) {
                reqs[b.shard as usize].dense.push(pb::DenseBlock {
                    id: b.id,
                    version: 0,
                    values: wire::encode_clipped(&grad[b.offset..b.offset + b.len], &plan),
                });
            }
        }
        for g in sparse {
            let Some(t) = layout.table_index(g.table) else {
                return Err(PsClientError::InvalidArgument(format!(
                    "unknown table {:?}",
                    g.table
                )));
            };
            let dim = spec.sparse[t].dim;
            if Some(g.values.len()) != g.rows.len().checked_mul(dim) {
                return Err(PsClientError::InvalidArgument(format!(
                    "table {:?}: {} values for {} rows of {dim}",
                    g.table,
                    g.values.len(),
                    g.rows.len()
                )));
            }
            let mut rows: Vec<Vec<u64>> = vec![Vec::new(); n];
            let mut vals: Vec<Vec<f32>> = vec![Vec::new(); n];
            for (i, &r) in g.rows.iter().enumerate() {
                let s = layout.row_shard(r) as usize;
                rows[s].push(r);
                vals[s].extend_from_slice(&g.values[i * dim..(i + 1) * dim]);
            }
            for (s, (rows, vals)) in rows.into_iter().zip(vals).enumerate() {
                if !rows.is_empty() {
                    reqs[s].sparse.push(pb::SparseRows {
                        table: t as u32,
                        rows,
                        values: wire::encode_clipped(&vals, &plan),
                    });
                }
            }
        }
        let timeout = self.inner.cfg.call_timeout + self.inner.cfg.sync_wait;
        let give_up = self.sync_push_budget(&spec.config.mode);
        let sends = reqs
            .into_iter()
            .filter(|r| sync || !r.dense.is_empty() || !r.sparse.is_empty())
            .map(|req| async move {
                let shard = req.shard;
                let mut applied = false;
                let start = Instant::now();
                let give_up = start.checked_add(give_up);
                loop {
                    let resp = self
                        .call(
                            shard,
                            req.clone(),
                            timeout,
                            |t, r| async move {
                                match &t.bulk {
                                    Some(b) => b
                                        .push(r.into_inner(), timeout)
                                        .await
                                        .map(tonic::Response::new),
                                    None => t.grpc.clone().push(r).await,
                                }
                            },
                            |st| push_refusal(st, shard, step),
                        )
                        .await?;
                    applied |= resp.applied;
                    if resp.done {
                        return Ok::<_, PsClientError>((resp.step, applied));
                    }
                    // Sync: the step is still open; ask again (an idempotent wait; the
                    // gradients travel again, since a replacement pserver may not have
                    // them), unless the pserver should long have closed it.
                    let now = Instant::now();
                    if give_up.is_some_and(|g| now >= g) {
                        return Err(PsClientError::Unavailable {
                            job: self.inner.cfg.job.clone(),
                            shard,
                            waited: now - start,
                            last: format!(
                                "sync step {} still not applied (the pserver keeps answering \
                                 that it is open; its step timeout should have closed it)",
                                resp.step.max(step)
                            ),
                        });
                    }
                }
            });
        let mut outcome = PushOutcome {
            step,
            applied: false,
        };
        let mut first_err = None;
        for r in join_all(sends).await {
            match r {
                Ok((s, applied)) => {
                    if sync {
                        outcome.step = s;
                    }
                    outcome.applied |= applied;
                }
                Err(e) => {
                    if first_err.is_none() {
                        first_err = Some(e);
                    }
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(outcome),
        }
    }

    /// Sync mode: how long one push waits for its step before it gives up: `retry_for`,
    /// plus what a live pserver may take to close the step (twice the step timeout: the
    /// step before it may still be open, then its own; and one server-side wait).
    fn sync_push_budget(&self, mode: &Mode) -> Duration {
        let step_timeout = match mode {
            Mode::Sync { step_timeout_ms } => Duration::from_millis(*step_timeout_ms),
            Mode::Async => Duration::ZERO,
        };
        self.inner
            .cfg
            .retry_for
            .saturating_add(step_timeout.saturating_mul(2))
            .saturating_add(self.inner.cfg.sync_wait)
    }

    /// Sync mode: `trainer` stops taking part in steps (until its next push), so the
    /// steps of the others do not wait for it (call it when a trainer runs out of work).
    pub async fn leave(&self, trainer: &str) -> Result<()> {
        let calls = (0..self.inner.shards).map(|s| {
            let msg = pb::LeaveRequest {
                shard: s,
                shards: self.inner.shards,
                trainer: trainer.to_owned(),
            };
            self.call(
                s,
                msg,
                self.inner.cfg.call_timeout,
                |t, r| async move { t.grpc.clone().leave(r).await },
                |_| None,
            )
        });
        for r in join_all(calls).await {
            r?;
        }
        Ok(())
    }

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

fn spec_mismatch<R>(s: &tonic::Status, shard: u32) -> Option<Attempt<R>> {
    (ErrorKind::of(s) == Some(ErrorKind::SpecMismatch)).then(|| {
        Attempt::Fail(PsClientError::SpecMismatch(format!(
            "shard {shard}: {}",
            s.message()
        )))
    })
}

fn uninitialised<R>(s: &tonic::Status, shard: u32) -> Option<Attempt<R>> {
    (ErrorKind::of(s) == Some(ErrorKind::Uninitialised)).then(|| {
        Attempt::Fail(PsClientError::Refused {
            shard,
            status: s.clone(),
        })
    })
}

fn push_refusal<R>(s: &tonic::Status, shard: u32, step: u64) -> Option<Attempt<R>> {
    match ErrorKind::of(s) {
        Some(ErrorKind::StaleStep) => Some(Attempt::Fail(PsClientError::StaleStep {
            step,
            next: next_step_of(s).unwrap_or(step + 1),
        })),
        // Another trainer's pull initialises a shard that lost its parameters.
        Some(ErrorKind::Uninitialised) => Some(Attempt::Retry(format!(
            "shard {shard} has no parameters yet"
        ))),
        _ => None,
    }
}

/// Asks the pserver at `addr` for its status directly (no etcd lookup, no retry): for
/// operators and tests. A pserver that lost its lease answers with a
/// [`ErrorKind::NotServing`] refusal.
pub async fn probe(
    addr: &str,
    job: &str,
    token: Option<&str>,
    timeout: Duration,
) -> Result<pb::StatusResponse> {
    let connect_err = |msg: String| PsClientError::Connect {
        addr: addr.to_owned(),
        msg,
    };
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| connect_err(e.to_string()))?
        .connect_timeout(timeout)
        .timeout(timeout);
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| connect_err(e.to_string()))?;
    let mut req = tonic::Request::new(pb::StatusRequest {});
    if let Ok(v) = job.parse() {
        req.metadata_mut().insert(edl_proto::JOB_HEADER, v);
    }
    if let Some(t) = token
        && let Ok(v) = t.parse()
    {
        req.metadata_mut().insert(edl_proto::TOKEN_HEADER, v);
    }
    GrpcClient::new(channel)
        .status(req)
        .await
        .map(tonic::Response::into_inner)
        .map_err(|status| PsClientError::ProbeRefused {
            addr: addr.to_owned(),
            status,
        })
}
