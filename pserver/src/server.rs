//! The pserver process: claims a shard index in etcd, restores its latest checkpoint,
//! serves the gRPC API, follows the trainer registry (sync mode), and checkpoints in the
//! background.
//!
//! A pserver serves only while its etcd lease is valid by its own clock: every RPC checks
//! the lease before it starts and again before it answers, so a pserver that was paused
//! past its TTL (and replaced) answers nothing once it runs again, and exits.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use edl_coord::{
    Backend, Compare, EventKind, Fence, IndexClaim, Lease, MemberEvent, MemberWatch, Op, Registry,
    RetryPolicy, Txn, claim_index_wait, fenced_txn, retry_cancellable,
};
use edl_proto::pserver as pb;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::{RwLock, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use crate::checkpoint::protocol::{
    self, CheckpointConfig, CheckpointEvery, Request as CkptRequest,
};
use crate::checkpoint::{CheckpointDir, ShardEntry, Snapshot};
use crate::error::PsError;
use crate::follow::follow_prefix;
use crate::keys::{PsKeys, valid_id};
use crate::layout::ModelSpec;
use crate::shard::{
    BlockValues, CheckpointHooks, Counters, InitBlocks, PullReply, RawPush, Shard, ShardCore,
    TableRows,
};
use crate::sync::Admit;

/// Default largest message: a push or pull of a whole shard of a large model fits.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 1 << 30;
/// Longest a sync push waits for its step in one call.
pub const MAX_PUSH_WAIT: Duration = Duration::from_secs(30);
/// HTTP/2 flow-control windows: large, so that one stream moves tens of MB at full speed.
pub const STREAM_WINDOW: u32 = 16 << 20;
/// HTTP/2 connection window.
pub const CONNECTION_WINDOW: u32 = 64 << 20;
/// Largest HTTP/2 frame we accept: large frames mean few, large socket reads.
pub const MAX_FRAME: u32 = 4 << 20;
/// Default bound on bulk-path connections served at once.
pub const DEFAULT_MAX_BULK_CONNECTIONS: usize = 1024;
/// Default longest stall of a peer in the middle of a bulk request or response.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(30);

/// Which shard index to claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexChoice {
    /// The lowest free index (waiting for one when all are held).
    Auto,
    /// This index (waiting while another pserver holds it).
    Fixed(u32),
}

/// Pserver configuration.
#[derive(Debug, Clone)]
pub struct PsConfig {
    /// The job (the etcd prefix `/edl/<job>/`).
    pub job: String,
    /// The shared job token every request must carry, if set.
    pub token: Option<String>,
    /// The address clients reach this pserver at; defaults to the listener's address.
    pub advertise: Option<String>,
    /// TTL of the pserver's lease: a dead pserver's index frees within about this long.
    pub lease_ttl: Duration,
    /// The index to claim.
    pub index: IndexChoice,
    /// The shard count: creates `ps/desired` when absent, must match it otherwise.
    /// `None`: read `ps/desired` (it must exist).
    pub shards: Option<u32>,
    /// Checkpoints, if any.
    pub checkpoint: Option<CheckpointConfig>,
    /// Largest gRPC message (a push or pull of one shard).
    pub max_message_bytes: usize,
    /// Pushes and pulls processed at once (CPU-bound work on blocking threads).
    pub workers: usize,
    /// Bulk-path connections served at once; more are closed at once (the clients
    /// retry).
    pub max_bulk_connections: usize,
    /// Longest a bulk-path peer may stall in the middle of a request (between the bytes
    /// of one frame) or of reading a response, before its connection is closed.
    pub io_timeout: Duration,
}

impl PsConfig {
    /// Defaults for job `job`: auto index, 5 s lease, no checkpoints.
    pub fn new(job: impl Into<String>) -> Self {
        PsConfig {
            job: job.into(),
            token: None,
            advertise: None,
            lease_ttl: Duration::from_secs(5),
            index: IndexChoice::Auto,
            shards: None,
            checkpoint: None,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            workers: std::thread::available_parallelism().map_or(4, |n| n.get()),
            max_bulk_connections: DEFAULT_MAX_BULK_CONNECTIONS,
            io_timeout: DEFAULT_IO_TIMEOUT,
        }
    }
}

/// The value of `ps/<index>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PsRecord {
    /// gRPC address.
    pub addr: String,
    /// The claim revision (create revision of the key; 0 in the very first write).
    #[serde(default)]
    pub claim_revision: i64,
    /// The bulk-path protocol version served on the same address (0: none).
    #[serde(default)]
    pub bulk: u32,
    /// Process id.
    #[serde(default)]
    pub pid: u32,
    /// Start time, ms since the Unix epoch.
    #[serde(default)]
    pub started_ms: u64,
}

/// Serves only while the lease is valid and no shutdown was asked.
#[derive(Debug)]
struct Gate {
    lease: Arc<Lease>,
    stop: CancellationToken,
    index: u32,
}

impl Gate {
    fn check(&self) -> Result<(), PsError> {
        if self.stop.is_cancelled() {
            return Err(PsError::NotServing("shutting down".into()));
        }
        if !self.lease.is_valid() {
            return Err(PsError::LeaseLost(self.index));
        }
        Ok(())
    }
}

/// Registered trainers, as seen through the registry watch.
#[derive(Debug, Default)]
struct Members {
    set: RwLock<HashSet<String>>,
}

/// The pserver's operations, whatever the transport (gRPC or the bulk path): checks,
/// then the shard's logic on blocking threads.
#[derive(Debug)]
pub(crate) struct Service {
    shard: Arc<Shard>,
    gate: Arc<Gate>,
    job: String,
    token: Option<String>,
    members: Arc<Members>,
    backend: Arc<dyn Backend>,
    keys: PsKeys,
    permits: Arc<Semaphore>,
    claim_revision: i64,
    max_message_bytes: usize,
    io_timeout: Duration,
}

impl Service {
    /// Checks the job and token a request carries, and that we serve.
    pub(crate) fn authorize(&self, job: &str, token: Option<&str>) -> Result<(), PsError> {
        if job != self.job {
            return Err(PsError::Unauthenticated(format!(
                "this pserver serves job {:?}, the request is for {job:?}",
                self.job
            )));
        }
        if let Some(want) = &self.token
            && token != Some(want.as_str())
        {
            return Err(PsError::Unauthenticated(
                "wrong or missing job token".into(),
            ));
        }
        self.gate.check()
    }

    /// Whether we still serve (the lease is valid and no shutdown was asked).
    pub(crate) fn serving(&self) -> Result<(), PsError> {
        self.gate.check()
    }

    /// Fires when the pserver stops serving.
    pub(crate) fn stopped(&self) -> &CancellationToken {
        &self.gate.stop
    }

    /// Largest request or response accepted.
    pub(crate) fn max_message_bytes(&self) -> usize {
        self.max_message_bytes
    }

    /// Longest a bulk-path peer may stall within a frame.
    pub(crate) fn io_timeout(&self) -> Duration {
        self.io_timeout
    }

    /// Runs CPU-bound work on a blocking thread, at most `workers` at once. The work runs
    /// to completion even if the caller stops waiting.
    async fn blocking<T, F>(&self, f: F) -> Result<T, PsError>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| PsError::NotServing("shutting down".into()))?;
        tokio::task::spawn_blocking(move || {
            let r = f();
            drop(permit);
            r
        })
        .await
        .map_err(|e| PsError::Internal(format!("worker thread failed: {e}")))
    }

    fn core(&self, shard: u32, shards: u32) -> Result<Arc<ShardCore>, PsError> {
        self.shard.check_target(shard, shards)?;
        self.shard.core()
    }

    async fn is_registered(&self, trainer: &str) -> Result<bool, PsError> {
        if self.members.set.read().await.contains(trainer) {
            return Ok(true);
        }
        // The watch may lag a trainer that registered just now.
        let key = format!("{}{trainer}", self.keys.trainers());
        if self.backend.get(&key).await?.is_some() {
            self.members.set.write().await.insert(trainer.to_owned());
            return Ok(true);
        }
        Ok(false)
    }

    pub(crate) async fn init(&self, r: pb::InitRequest) -> Result<pb::InitResponse, PsError> {
        if !valid_id(&r.trainer) {
            return Err(PsError::InvalidArgument(format!(
                "bad trainer id {:?}",
                r.trainer
            )));
        }
        let shard = self.shard.clone();
        let trainer = r.trainer.clone();
        let (already, missing) = self
            .blocking(move || {
                // The target before the spec, so that a request for another shard is told
                // so whatever its spec.
                shard.check_target(r.shard, r.shards)?;
                shard.init(init_blocks(r)?)
            })
            .await??;
        tracing::debug!(shard = self.shard.index(), trainer = %trainer, already, missing, "init blocks received");
        self.gate.check()?;
        Ok(pb::InitResponse {
            already_initialised: already,
            missing_blocks: missing,
        })
    }

    pub(crate) async fn finish_init(
        &self,
        r: pb::FinishInitRequest,
    ) -> Result<pb::FinishInitResponse, PsError> {
        self.shard.check_target(r.shard, r.shards)?;
        let shard = self.shard.clone();
        let already = self.blocking(move || shard.finish_init()).await??;
        if !already {
            tracing::info!(shard = self.shard.index(), trainer = %r.trainer, "shard initialised");
        }
        self.gate.check()?;
        Ok(pb::FinishInitResponse {
            already_initialised: already,
        })
    }

    pub(crate) async fn push(&self, r: pb::PushRequest) -> Result<pb::PushResponse, PsError> {
        // The request may have taken long to arrive (a large bulk push): check again that
        // we serve, and once more right before applying it.
        self.gate.check()?;
        let core = self.core(r.shard, r.shards)?;
        if core.is_sync() {
            return self.sync_push(core, r).await;
        }
        let gate = self.gate.clone();
        let raw = raw_push(r);
        let reply = self
            .blocking(move || {
                let push = core.validate_push(raw)?;
                gate.check()?;
                core.apply_async(&push)
            })
            .await??;
        self.gate.check()?;
        Ok(pb::PushResponse {
            applied: reply.applied,
            step: reply.step,
            done: true,
            next_step: 0,
        })
    }

    async fn sync_push(
        &self,
        core: Arc<ShardCore>,
        req: pb::PushRequest,
    ) -> Result<pb::PushResponse, PsError> {
        let wait = Duration::from_millis(u64::from(req.wait_ms)).min(MAX_PUSH_WAIT);
        let deadline = Instant::now() + wait;
        let c = core.clone();
        let raw = raw_push(req);
        let push = Arc::new(self.blocking(move || c.validate_push(raw)).await??);
        if !self.is_registered(&push.trainer).await? {
            return Err(PsError::NotRegistered(push.trainer.clone()));
        }
        if !core.sync_members_seeded() {
            let set: BTreeSet<String> = self.members.set.read().await.iter().cloned().collect();
            let c = core.clone();
            self.blocking(move || c.sync_set_members(set)).await?;
        }
        core.sync_member_joined(&push.trainer);
        let mut closed = core.subscribe();
        loop {
            let (c, p, gate) = (core.clone(), push.clone(), self.gate.clone());
            let admit = self
                .blocking(move || {
                    gate.check()?;
                    c.sync_push(&p, Instant::now())
                })
                .await??;
            let (step, applied) = match admit {
                Admit::Join { step } => (step, true),
                Admit::InProgress { step } => (step, false),
                Admit::AlreadyApplied { step } => {
                    self.gate.check()?;
                    return Ok(pb::PushResponse {
                        applied: false,
                        step,
                        done: true,
                        next_step: core.next_step(),
                    });
                }
                Admit::Stale { next } => {
                    return Err(PsError::StaleStep {
                        step: push.step,
                        next,
                    });
                }
                Admit::OutOfRange { next } => {
                    return Err(PsError::InvalidArgument(crate::shard::out_of_range(
                        push.step, next,
                    )));
                }
                Admit::Wait => {
                    let changed = tokio::select! {
                        _ = self.gate.stop.cancelled() => return Err(PsError::NotServing("shutting down".into())),
                        _ = tokio::time::sleep_until(deadline) => false,
                        r = closed.changed() => r.is_ok(),
                    };
                    self.gate.check()?;
                    if !changed {
                        return Ok(pb::PushResponse {
                            applied: false,
                            step: push.step,
                            done: false,
                            next_step: core.next_step(),
                        });
                    }
                    continue;
                }
            };
            let reached = tokio::select! {
                _ = self.gate.stop.cancelled() => return Err(PsError::NotServing("shutting down".into())),
                _ = tokio::time::sleep_until(deadline) => None,
                r = closed.wait_for(|c| *c >= step) => Some(r.is_ok()),
            };
            let done = reached.unwrap_or_else(|| *closed.borrow() >= step);
            self.gate.check()?;
            return Ok(pb::PushResponse {
                applied,
                step,
                done,
                next_step: core.next_step(),
            });
        }
    }

    pub(crate) async fn pull(&self, r: pb::PullRequest) -> Result<pb::PullResponse, PsError> {
        let core = self.core(r.shard, r.shards)?;
        let resp = self
            .blocking(move || core.pull(&r.known_versions, r.incarnation))
            .await?;
        self.gate.check()?;
        Ok(pull_response(resp))
    }

    pub(crate) async fn pull_sparse(
        &self,
        r: pb::PullSparseRequest,
    ) -> Result<pb::PullSparseResponse, PsError> {
        let core = self.core(r.shard, r.shards)?;
        // Room for the protobuf framing of the values.
        let max = self.max_message_bytes.saturating_sub(64);
        let values = self
            .blocking(move || core.pull_sparse(r.table, &r.rows, max))
            .await??;
        self.gate.check()?;
        Ok(pb::PullSparseResponse { values })
    }

    pub(crate) async fn leave(&self, r: pb::LeaveRequest) -> Result<pb::LeaveResponse, PsError> {
        let core = self.core(r.shard, r.shards)?;
        let trainer = r.trainer;
        let was = self.blocking(move || core.sync_leave(&trainer)).await?;
        self.gate.check()?;
        Ok(pb::LeaveResponse {
            was_participant: was,
        })
    }

    pub(crate) fn status(&self) -> pb::StatusResponse {
        let mut resp = pb::StatusResponse {
            job: self.job.clone(),
            shard: self.shard.index(),
            shards: self.shard.shards(),
            claim_revision: self.claim_revision,
            ..Default::default()
        };
        if let Ok(core) = self.shard.core() {
            let (blocks, rows) = core.sizes();
            let (participants, contributed) = core.sync_members();
            resp.initialised = true;
            resp.mode = core.spec().config.mode.name().into();
            resp.next_step = core.next_step();
            resp.updates = core.updates();
            resp.blocks = blocks as u32;
            resp.sparse_rows = rows;
            resp.participants = participants;
            resp.contributed = contributed;
            resp.restored_from = core.restored_from();
            resp.counters = Some(counters(&core.counters));
        }
        resp.last_checkpoint = self
            .shard
            .checkpoints()
            .last_written
            .load(std::sync::atomic::Ordering::Relaxed);
        resp
    }
}

/// The gRPC adapter over the pserver's operations.
#[derive(Debug, Clone)]
pub struct PsGrpc {
    svc: Arc<Service>,
}

impl PsGrpc {
    fn check<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let md = req.metadata();
        let job = md
            .get(edl_proto::JOB_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let token = md
            .get(edl_proto::TOKEN_HEADER)
            .and_then(|v| v.to_str().ok());
        Ok(self.svc.authorize(job, token)?)
    }
}

#[tonic::async_trait]
impl pb::parameter_server_server::ParameterServer for PsGrpc {
    async fn init(
        &self,
        req: Request<pb::InitRequest>,
    ) -> Result<Response<pb::InitResponse>, Status> {
        self.check(&req)?;
        Ok(Response::new(self.svc.init(req.into_inner()).await?))
    }

    async fn finish_init(
        &self,
        req: Request<pb::FinishInitRequest>,
    ) -> Result<Response<pb::FinishInitResponse>, Status> {
        self.check(&req)?;
        Ok(Response::new(self.svc.finish_init(req.into_inner()).await?))
    }

    async fn push(
        &self,
        req: Request<pb::PushRequest>,
    ) -> Result<Response<pb::PushResponse>, Status> {
        self.check(&req)?;
        Ok(Response::new(self.svc.push(req.into_inner()).await?))
    }

    async fn pull(
        &self,
        req: Request<pb::PullRequest>,
    ) -> Result<Response<pb::PullResponse>, Status> {
        self.check(&req)?;
        Ok(Response::new(self.svc.pull(req.into_inner()).await?))
    }

    async fn pull_sparse(
        &self,
        req: Request<pb::PullSparseRequest>,
    ) -> Result<Response<pb::PullSparseResponse>, Status> {
        self.check(&req)?;
        Ok(Response::new(self.svc.pull_sparse(req.into_inner()).await?))
    }

    async fn leave(
        &self,
        req: Request<pb::LeaveRequest>,
    ) -> Result<Response<pb::LeaveResponse>, Status> {
        self.check(&req)?;
        Ok(Response::new(self.svc.leave(req.into_inner()).await?))
    }

    async fn status(
        &self,
        req: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        self.check(&req)?;
        Ok(Response::new(self.svc.status()))
    }
}

/// Creates `ps/desired` with `want` if absent; returns the job's shard count.
async fn resolve_desired(
    backend: &dyn Backend,
    keys: &PsKeys,
    want: Option<u32>,
) -> Result<Result<u32, PsError>, edl_coord::Error> {
    let parse = |v: &[u8]| -> Result<u32, PsError> {
        std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            .filter(|n| *n > 0)
            .ok_or_else(|| {
                PsError::Config(format!(
                    "{} holds {:?}, not a shard count",
                    keys.desired(),
                    String::from_utf8_lossy(v)
                ))
            })
    };
    match want {
        Some(n) => {
            let txn = Txn::new()
                .when([Compare::absent(keys.desired())])
                .and_then([Op::put(keys.desired(), n.to_string())])
                .or_else([Op::get(keys.desired())]);
            let resp = backend.txn(txn).await?;
            if resp.succeeded {
                tracing::info!(key = %keys.desired(), shards = n, "shard count set");
                return Ok(Ok(n));
            }
            let have = resp
                .get(0)
                .and_then(|kvs| kvs.first())
                .map(|kv| parse(&kv.value));
            Ok(match have {
                Some(Ok(h)) if h == n => Ok(n),
                Some(Ok(h)) => Err(PsError::Config(format!(
                    "the job has {h} shards ({}), not {n} as --shards says",
                    keys.desired()
                ))),
                Some(Err(e)) => Err(e),
                None => Err(PsError::Config(format!("{} vanished", keys.desired()))),
            })
        }
        None => Ok(match backend.get(&keys.desired()).await? {
            Some(kv) => parse(&kv.value),
            None => Err(PsError::Config(format!(
                "{} is not set: pass the shard count (--shards)",
                keys.desired()
            ))),
        }),
    }
}

/// Claims `ps/<index>` with a create-if-absent transaction, waiting while another
/// pserver holds it.
async fn claim_fixed(
    backend: &dyn Backend,
    keys: &PsKeys,
    index: u32,
    value: &[u8],
    lease: &Lease,
    cancel: &CancellationToken,
) -> Result<IndexClaim, PsError> {
    let key = keys.ps(index);
    let lost = lease.lost();
    let mut delay = Duration::from_millis(50);
    loop {
        let txn = Txn::new()
            .when([Compare::absent(key.clone())])
            .and_then([Op::put_with_lease(key.clone(), value.to_vec(), lease.id())])
            .or_else([Op::get(key.clone())]);
        let attempt = tokio::select! {
            _ = cancel.cancelled() => return Err(PsError::Cancelled),
            _ = lost.cancelled() => return Err(PsError::LeaseLost(index)),
            r = backend.txn(txn) => r,
        };
        let resp = match attempt {
            Ok(r) => r,
            Err(e) if e.is_retryable() => {
                tracing::warn!(key = %key, error = %e, "claim failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        if resp.succeeded {
            return Ok(IndexClaim {
                index,
                fence: Fence {
                    key,
                    revision: resp.revision,
                },
            });
        }
        if let Some(kv) = resp.get(0).and_then(|kvs| kvs.first()) {
            if kv.lease == Some(lease.id()) {
                return Ok(IndexClaim {
                    index,
                    fence: Fence {
                        key,
                        revision: kv.create_revision,
                    },
                });
            }
            tracing::info!(key = %key, holder = %String::from_utf8_lossy(&kv.value), "shard index held by another pserver; waiting for its lease to end");
        }
        let watch = backend.watch_prefix(&key, Some(resp.revision + 1)).await;
        if let Ok(mut watch) = watch {
            loop {
                let ev = tokio::select! {
                    _ = cancel.cancelled() => return Err(PsError::Cancelled),
                    _ = lost.cancelled() => return Err(PsError::LeaseLost(index)),
                    ev = watch.next() => ev,
                };
                match ev {
                    Some(Ok(ev)) if ev.kind == EventKind::Delete && ev.kv.key == key => break,
                    Some(Ok(_)) => {}
                    Some(Err(_)) | None => break,
                }
            }
        } else {
            tokio::time::sleep(delay).await;
        }
    }
}

/// Runs a pserver on `listener` until `shutdown` fires. Returns
/// [`PsError::LeaseLost`] if the lease was lost (the pserver stopped serving at once;
/// the caller should exit and let a fresh process restore from the checkpoint).
pub async fn run(
    backend: Arc<dyn Backend>,
    cfg: PsConfig,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), PsError> {
    if !valid_id(&cfg.job) {
        return Err(PsError::Config(format!("invalid job name {:?}", cfg.job)));
    }
    let local: SocketAddr = listener
        .local_addr()
        .map_err(|e| PsError::Config(format!("listener address: {e}")))?;
    let advertise = cfg.advertise.clone().unwrap_or_else(|| local.to_string());
    let keys = PsKeys::new(&cfg.job);
    let policy = RetryPolicy::default();
    let shards = retry_cancellable(&policy, &shutdown, || {
        resolve_desired(&*backend, &keys, cfg.shards)
    })
    .await??;
    if let IndexChoice::Fixed(i) = cfg.index
        && i >= shards
    {
        return Err(PsError::Config(format!(
            "index {i} is out of range: the job has {shards} shards"
        )));
    }
    // The lease is revoked explicitly at the end, after serving stopped; its own token
    // makes sure it ends on every path.
    let lease_cancel = CancellationToken::new();
    let _lease_guard = lease_cancel.clone().drop_guard();
    let lease = Arc::new(Lease::grant(backend.clone(), cfg.lease_ttl, lease_cancel.clone()).await?);
    let mut record = PsRecord {
        addr: advertise.clone(),
        claim_revision: 0,
        bulk: crate::bulk::VERSION,
        pid: std::process::id(),
        started_ms: protocol::now_ms(),
    };
    let value = serde_json::to_vec(&record).unwrap_or_default();
    let claim = match cfg.index {
        IndexChoice::Auto => claim_index_wait(
            &*backend,
            &keys.ps_prefix(),
            shards,
            value,
            &lease,
            &shutdown,
        )
        .await
        .map_err(|e| match e {
            edl_coord::Error::Cancelled => PsError::Cancelled,
            other => other.into(),
        })?,
        IndexChoice::Fixed(i) => {
            claim_fixed(&*backend, &keys, i, &value, &lease, &shutdown).await?
        }
    };
    let index = claim.index;
    record.claim_revision = claim.fence.revision;
    let value = serde_json::to_vec(&record).unwrap_or_default();
    fenced_txn(
        &*backend,
        &claim.fence,
        Txn::new().and_then([Op::put_with_lease(claim.key(), value, lease.id())]),
    )
    .await?;
    tracing::info!(job = %cfg.job, shard = index, shards, addr = %advertise, claim_revision = claim.fence.revision, "shard claimed");

    let sync_every = match cfg.checkpoint.as_ref().map(|c| c.every) {
        Some(CheckpointEvery::Steps(n)) => Some(n),
        _ => None,
    };
    let checkpoints = Arc::new(CheckpointHooks {
        every_steps: sync_every,
        ..Default::default()
    });
    let shard = Arc::new(Shard::new(
        index,
        shards,
        claim.fence.revision as u64,
        checkpoints.clone(),
    ));
    let dir = cfg
        .checkpoint
        .as_ref()
        .map(|c| CheckpointDir::new(&c.dir, &cfg.job, index));
    if let Some(dir) = &dir {
        let d = dir.clone();
        let _ = tokio::task::spawn_blocking(move || d.remove_temporaries()).await;
        let incarnation = claim.fence.revision as u64;
        let build = |snap| ShardCore::restore(snap, incarnation, checkpoints.clone());
        let restored = retry_cancellable(&policy, &shutdown, || async {
            match protocol::restore_latest(&*backend, &keys, index, shards, build).await {
                Ok(r) => Ok(Ok(r)),
                Err(PsError::Coord(e)) => Err(e),
                Err(e) => Ok(Err(e)),
            }
        })
        .await??;
        match restored {
            Some((manifest, core)) => {
                let step = core.restored_from();
                checkpoints
                    .last_written
                    .store(step, std::sync::atomic::Ordering::Relaxed);
                shard.install(core);
                tracing::info!(
                    shard = index,
                    step,
                    manifest_step = manifest.step,
                    "restored from checkpoint"
                );
            }
            None => tracing::info!(
                shard = index,
                "no checkpoint to restore; waiting for a trainer to initialise the parameters"
            ),
        }
    }

    // The registered trainers, before any sync step can open.
    let members = Arc::new(Members::default());
    let registry = Registry::new(backend.clone(), keys.trainers());
    let (listed, _) = retry_cancellable(&policy, &shutdown, || registry.list()).await?;
    members
        .set
        .write()
        .await
        .extend(listed.into_iter().map(|m| m.id));

    let stop = shutdown.child_token();
    let gate = Arc::new(Gate {
        lease: lease.clone(),
        stop: stop.clone(),
        index,
    });
    let svc = Arc::new(Service {
        shard: shard.clone(),
        gate,
        job: cfg.job.clone(),
        token: cfg.token.clone(),
        members: members.clone(),
        backend: backend.clone(),
        keys: keys.clone(),
        permits: Arc::new(Semaphore::new(cfg.workers.max(1))),
        claim_revision: claim.fence.revision,
        max_message_bytes: cfg.max_message_bytes,
        io_timeout: cfg.io_timeout,
    });
    let grpc = pb::parameter_server_server::ParameterServerServer::new(PsGrpc { svc: svc.clone() })
        .max_decoding_message_size(cfg.max_message_bytes)
        .max_encoding_message_size(cfg.max_message_bytes);
    // One port: bulk connections are told apart from HTTP/2 by their first byte.
    let (conns_tx, conns_rx) = tokio::sync::mpsc::channel(64);
    let acceptor = tokio::spawn(
        crate::bulk::accept(
            listener,
            svc.clone(),
            conns_tx,
            Arc::new(Semaphore::new(cfg.max_bulk_connections.max(1))),
            stop.clone(),
        )
        .in_current_span(),
    );
    let server_stop = stop.clone();
    let mut server = tokio::spawn(
        async move {
            tonic::transport::Server::builder()
                .initial_stream_window_size(Some(STREAM_WINDOW))
                .initial_connection_window_size(Some(CONNECTION_WINDOW))
                .max_frame_size(Some(MAX_FRAME))
                .tcp_nodelay(true)
                .add_service(grpc)
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::ReceiverStream::new(conns_rx),
                    server_stop.cancelled_owned(),
                )
                .await
        }
        .in_current_span(),
    );
    tracing::info!(job = %cfg.job, shard = index, addr = %advertise, "pserver serving");

    let mut tasks = vec![
        acceptor,
        tokio::spawn(
            follow_trainers(
                backend.clone(),
                keys.clone(),
                shard.clone(),
                members,
                stop.clone(),
            )
            .in_current_span(),
        ),
    ];
    if let (Some(c), Some(dir)) = (cfg.checkpoint.clone(), dir) {
        tasks.push(tokio::spawn(
            Checkpointer {
                backend: backend.clone(),
                keys: keys.clone(),
                fence: claim.fence.clone(),
                shard: shard.clone(),
                dir,
                cfg: c,
            }
            .run(stop.clone())
            .in_current_span(),
        ));
    }

    let lost = lease.lost();
    let result = tokio::select! {
        biased;
        _ = shutdown.cancelled() => Ok(()),
        _ = lost.cancelled() => {
            tracing::error!(job = %cfg.job, shard = index, "etcd lease lost; stopped serving (a replacement may hold this index now)");
            Err(PsError::LeaseLost(index))
        }
        r = &mut server => Err(PsError::Config(format!("grpc server ended: {r:?}"))),
    };
    stop.cancel();
    if !server.is_finished() {
        match tokio::time::timeout(Duration::from_secs(5), &mut server).await {
            Ok(Ok(Ok(()))) => {}
            Ok(r) => tracing::warn!(result = ?r, "grpc server ended with an error"),
            Err(_) => {
                tracing::warn!("grpc server did not stop in time");
                server.abort();
            }
        }
    }
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    if result.is_ok() {
        // Free the index at once for a successor.
        match Arc::try_unwrap(lease) {
            Ok(lease) => {
                if let Err(e) = lease.revoke().await {
                    tracing::warn!(error = %e, "lease revoke failed; the index frees when it expires");
                }
            }
            Err(lease) => drop(lease),
        }
        tracing::info!(shard = index, "pserver stopped");
    }
    result
}

/// First delay before the trainer watch is opened again after it ended.
const REWATCH_MIN: Duration = Duration::from_millis(100);
/// Longest delay between attempts to open the trainer watch again.
const REWATCH_MAX: Duration = Duration::from_secs(5);
/// A trainer watch that lived this long resets the re-watch backoff.
const REWATCH_HEALTHY: Duration = Duration::from_secs(30);

/// Follows the trainer registry: registered ids for the sync check and the sync steps'
/// expected trainers (a trainer whose lease ends is dropped from the open step at once),
/// a reconciliation and the step timeout every tick.
///
/// The registry watch ends only on an error that retrying cannot cure (a permission
/// taken away, ...); then the ticks go on (steps still time out) and the watch is
/// opened again with a bounded backoff until `stop` fires. Each new watch starts with a
/// fresh listing of the registry that replaces the members known, so that trainers that
/// left while no watch ran are forgotten.
async fn follow_trainers(
    backend: Arc<dyn Backend>,
    keys: PsKeys,
    shard: Arc<Shard>,
    members: Arc<Members>,
    stop: CancellationToken,
) {
    let registry = Registry::new(backend, keys.trainers());
    let mut events = Some(registry.watch_members(stop.child_token()));
    let mut opened = Instant::now();
    let mut delay = REWATCH_MIN;
    let mut rewatch_at = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let sync_core = || shard.core().ok().filter(|c| c.is_sync());
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            ev = next_member_event(&mut events) => match ev {
                Some(MemberEvent::Joined(m) | MemberEvent::Updated(m)) => {
                    if let Some(core) = sync_core() {
                        core.sync_member_joined(&m.id);
                    }
                    members.set.write().await.insert(m.id);
                }
                Some(MemberEvent::Left(m)) => {
                    members.set.write().await.remove(&m.id);
                    if let Some(core) = sync_core() {
                        let id = m.id.clone();
                        let was = tokio::task::spawn_blocking(move || core.sync_member_left(&id))
                            .await
                            .unwrap_or(false);
                        if was {
                            tracing::info!(shard = shard.index(), trainer = %m.id, "trainer left; its step no longer waits for it");
                        }
                    }
                }
                None => {
                    let error = events.take().and_then(|w| w.take_error());
                    if opened.elapsed() >= REWATCH_HEALTHY {
                        delay = REWATCH_MIN;
                    }
                    tracing::error!(shard = shard.index(), error = ?error, retry_in = ?delay, "trainer registry watch ended; watching again");
                    rewatch_at = Instant::now() + delay;
                    delay = (delay * 2).min(REWATCH_MAX);
                }
            },
            _ = tokio::time::sleep_until(rewatch_at), if events.is_none() => {
                // The new watch reports every change after its own listing; ours
                // replaces what the ended watch left behind. (A trainer leaving in the
                // moment between the two listings stays known until the next re-watch:
                // at worst a step waits for it until the step timeout.)
                let watch = registry.watch_members(stop.child_token());
                match registry.list().await {
                    Ok((listed, _)) => {
                        *members.set.write().await = listed.into_iter().map(|m| m.id).collect();
                        events = Some(watch);
                        opened = Instant::now();
                        tracing::info!(shard = shard.index(), "trainer registry watched again");
                    }
                    Err(e) => {
                        tracing::warn!(shard = shard.index(), error = %e, retry_in = ?delay, "trainer registry listing failed; retrying");
                        rewatch_at = Instant::now() + delay;
                        delay = (delay * 2).min(REWATCH_MAX);
                    }
                }
            }
            _ = tick.tick() => {
                if let Some(core) = sync_core() {
                    let set: BTreeSet<String> = members.set.read().await.iter().cloned().collect();
                    let _ = tokio::task::spawn_blocking(move || {
                        core.sync_set_members(set);
                        core.sync_tick(Instant::now());
                    })
                    .await;
                }
            }
        }
    }
}

/// The next event of the trainer watch; pending while there is none.
async fn next_member_event(events: &mut Option<MemberWatch>) -> Option<MemberEvent> {
    match events {
        Some(w) => w.next().await,
        None => std::future::pending().await,
    }
}

/// Attempts to record a checkpoint part and commit its step, on transient etcd errors.
const COMMIT_ATTEMPTS: u32 = 8;
/// How long the coordinator leaves a complete set of parts to its last writer before
/// committing it itself (that writer's commit was lost).
const COMMIT_GRACE: Duration = Duration::from_secs(2);

/// The background checkpoint writer of one shard (and the coordinator on shard 0).
struct Checkpointer {
    backend: Arc<dyn Backend>,
    keys: PsKeys,
    fence: Fence,
    shard: Arc<Shard>,
    dir: CheckpointDir,
    cfg: CheckpointConfig,
}

impl Checkpointer {
    async fn run(self, stop: CancellationToken) {
        let mut view = follow_prefix(
            self.backend.clone(),
            self.keys.checkpoints(),
            stop.child_token(),
        );
        let slot = self.shard.checkpoints().slot.clone();
        let mut handled = 0u64;
        let mut manifest_steps: Vec<u64> = Vec::new();
        let mut newest_manifest = 0u64;
        // Coordinator state (shard 0).
        let mut requested_step = 0u64;
        let mut requested_at = Instant::now();
        let mut requested_updates = 0u64;
        // Coordinator: complete sets of parts without a manifest, and since when.
        let mut uncommitted: BTreeMap<u64, Instant> = BTreeMap::new();
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = slot.wait() => {
                    if let Some(snap) = slot.take() {
                        self.write(snap, &stop).await;
                    }
                }
                r = view.changed() => {
                    if r.is_err() {
                        break;
                    }
                    let v = view.borrow_and_update().clone();
                    if v.revision == 0 {
                        continue;
                    }
                    let ms = protocol::parse_manifests(&self.keys, v.kvs.values());
                    let steps: Vec<u64> = ms.iter().map(|m| m.step).collect();
                    newest_manifest = steps.first().copied().unwrap_or(0);
                    if self.shard.index() == 0 {
                        let complete =
                            protocol::complete_parts(&self.keys, v.kvs.values(), self.shard.shards());
                        let now = Instant::now();
                        uncommitted.retain(|s, _| complete.contains(s));
                        for s in complete.into_iter().filter(|s| *s > newest_manifest) {
                            uncommitted.entry(s).or_insert(now);
                        }
                    }
                    if steps != manifest_steps {
                        manifest_steps = steps;
                        let kept: Vec<_> = ms.into_iter().take(self.cfg.keep.max(1)).collect();
                        let dir = self.dir.clone();
                        let index = self.shard.index();
                        let _ = tokio::task::spawn_blocking(move || protocol::prune_files(&dir, &kept, index)).await;
                    }
                    let req = v
                        .kvs
                        .get(&self.keys.request())
                        .and_then(|kv| serde_json::from_slice::<CkptRequest>(&kv.value).ok());
                    if let Some(req) = req {
                        requested_step = requested_step.max(req.step);
                        if req.step > handled && req.step > newest_manifest {
                            handled = req.step;
                            self.handle_request(req.step, &stop).await;
                        }
                    }
                }
                _ = tick.tick(), if self.shard.index() == 0 => {
                    let Ok(core) = self.shard.core() else { continue };
                    self.commit_lost(&mut uncommitted, newest_manifest, core.spec().config.mode.name())
                        .await;
                    let updates = core.updates();
                    let due = match self.cfg.every {
                        CheckpointEvery::Steps(_) if core.is_sync() => false,
                        CheckpointEvery::Steps(n) => updates >= requested_updates + n,
                        CheckpointEvery::Interval(t) => {
                            requested_at.elapsed() >= t && updates != requested_updates
                        }
                    };
                    if !due {
                        continue;
                    }
                    let step = if core.is_sync() {
                        core.next_step() + 2
                    } else {
                        updates
                    }
                    .max(requested_step + 1)
                    .max(newest_manifest + 1);
                    match protocol::request(&*self.backend, &self.keys, &self.fence, step).await {
                        Ok(()) => {
                            requested_step = step;
                            requested_at = Instant::now();
                            requested_updates = updates;
                        }
                        Err(e) => tracing::warn!(step, error = %e, "checkpoint request failed"),
                    }
                }
            }
        }
    }

    async fn handle_request(&self, step: u64, stop: &CancellationToken) {
        let Ok(core) = self.shard.core() else {
            tracing::debug!(step, "checkpoint requested before initialisation; skipped");
            return;
        };
        if core.is_sync() {
            if core.last_closed() >= step {
                tracing::warn!(
                    shard = self.shard.index(),
                    step,
                    last = core.last_closed(),
                    "requested checkpoint step already applied here; skipping this round"
                );
                return;
            }
            self.shard
                .checkpoints()
                .target
                .store(step, std::sync::atomic::Ordering::Release);
            return;
        }
        let snap = tokio::task::spawn_blocking(move || core.snapshot(step)).await;
        match snap {
            Ok(s) => self.write(s, stop).await,
            Err(e) => tracing::error!(step, error = %e, "snapshot failed"),
        }
    }

    /// Coordinator: commits the steps of `uncommitted` newer than the newest manifest
    /// whose parts have waited [`COMMIT_GRACE`] for their last writer's commit.
    async fn commit_lost(
        &self,
        uncommitted: &mut BTreeMap<u64, Instant>,
        newest_manifest: u64,
        mode: &str,
    ) {
        uncommitted.retain(|s, _| *s > newest_manifest);
        let due: Vec<u64> = uncommitted
            .iter()
            .filter(|(_, since)| since.elapsed() >= COMMIT_GRACE)
            .map(|(s, _)| *s)
            .collect();
        for step in due {
            let shards = self.shard.shards();
            match protocol::try_commit(&*self.backend, &self.keys, &self.fence, step, shards, mode)
                .await
            {
                Ok(committed) => {
                    uncommitted.remove(&step);
                    if committed {
                        tracing::warn!(step, "committed a checkpoint its last writer did not");
                        if let Err(e) =
                            protocol::prune(&*self.backend, &self.keys, &self.fence, self.cfg.keep)
                                .await
                        {
                            tracing::warn!(error = %e, "checkpoint pruning failed");
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(step, error = %e, "checkpoint commit failed; trying again later");
                    uncommitted.insert(step, Instant::now());
                }
            }
        }
    }

    /// Records this shard's part of `step` and commits the step if every part is there,
    /// trying again on transient etcd errors (at most [`COMMIT_ATTEMPTS`] times, until
    /// `stop`).
    async fn record(&self, step: u64, entry: &ShardEntry, mode: &str, stop: &CancellationToken) {
        let shard = self.shard.index();
        let mut delay = Duration::from_millis(50);
        for attempt in 1..=COMMIT_ATTEMPTS {
            let commit = async {
                protocol::register_part(&*self.backend, &self.keys, &self.fence, step, entry)
                    .await?;
                let committed = protocol::try_commit(
                    &*self.backend,
                    &self.keys,
                    &self.fence,
                    step,
                    self.shard.shards(),
                    mode,
                )
                .await?;
                if committed {
                    protocol::prune(&*self.backend, &self.keys, &self.fence, self.cfg.keep).await?;
                }
                Ok::<_, PsError>(())
            };
            match commit.await {
                Ok(()) => return,
                Err(e) if e.is_retryable() && attempt < COMMIT_ATTEMPTS => {
                    tracing::warn!(shard, step, attempt, error = %e, "checkpoint part not recorded in etcd; retrying");
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(delay) => {}
                    }
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
                Err(e) => {
                    tracing::error!(shard, step, error = %e, "checkpoint part not recorded in etcd");
                    return;
                }
            }
        }
    }

    async fn write(&self, snap: Snapshot, stop: &CancellationToken) {
        let step = snap.step;
        let shard = self.shard.index();
        let counters = self.shard.core().ok();
        let started = Instant::now();
        let entry = match protocol::write_snapshot(&self.dir, Arc::new(snap)).await {
            Ok(e) => e,
            Err(e) => {
                if let Some(c) = &counters {
                    c.counters
                        .checkpoints_failed
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                tracing::error!(shard, step, error = %e, "checkpoint write failed; the previous checkpoint stays valid");
                return;
            }
        };
        tracing::info!(shard, step, path = %entry.path, bytes = entry.size, took = ?started.elapsed(), "checkpoint file written");
        if let Some(c) = &counters {
            c.counters
                .checkpoints_written
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        self.shard
            .checkpoints()
            .last_written
            .fetch_max(step, std::sync::atomic::Ordering::Relaxed);
        let mode = counters
            .as_ref()
            .map_or("async", |c| c.spec().config.mode.name());
        self.record(step, &entry, mode, stop).await;
    }
}

// Protobuf and the shard's types meet here, for both transports (gRPC and the bulk path).

/// The shard's view of a push (the target shard and the sync wait stay with the service).
fn raw_push(r: pb::PushRequest) -> RawPush {
    RawPush {
        trainer: r.trainer,
        session: r.session,
        step: r.step,
        dense: r.dense.into_iter().map(block_values).collect(),
        sparse: r
            .sparse
            .into_iter()
            .map(|s| TableRows {
                table: s.table,
                rows: s.rows,
                values: s.values,
            })
            .collect(),
    }
}

fn block_values(b: pb::DenseBlock) -> BlockValues {
    BlockValues {
        id: b.id,
        values: b.values,
    }
}

/// The shard's view of an `Init` request: the spec parsed from its JSON.
fn init_blocks(r: pb::InitRequest) -> Result<InitBlocks, PsError> {
    Ok(InitBlocks {
        shard: r.shard,
        shards: r.shards,
        spec: ModelSpec::from_json(&r.spec_json)?,
        trainer: r.trainer,
        blocks: r.blocks.into_iter().map(block_values).collect(),
    })
}

fn pull_response(r: PullReply) -> pb::PullResponse {
    pb::PullResponse {
        blocks: r
            .blocks
            .into_iter()
            .map(|b| pb::DenseBlock {
                id: b.id,
                version: b.version,
                values: b.values,
            })
            .collect(),
        next_step: r.next_step,
        updates: r.updates,
        incarnation: r.incarnation,
    }
}

/// The protobuf form of a shard's counters.
fn counters(c: &Counters) -> pb::Counters {
    let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
    pb::Counters {
        pushes_applied: g(&c.pushes_applied),
        duplicate_pushes: g(&c.duplicate_pushes),
        stale_pushes: g(&c.stale_pushes),
        nonfinite_rejected: g(&c.nonfinite_rejected),
        invalid_rejected: g(&c.invalid_rejected),
        steps_closed: g(&c.steps_closed),
        trainers_dropped: g(&c.trainers_dropped),
        step_timeouts: g(&c.step_timeouts),
        pulls: g(&c.pulls),
        sparse_rows_pulled: g(&c.sparse_rows_pulled),
        checkpoints_written: g(&c.checkpoints_written),
        checkpoints_failed: g(&c.checkpoints_failed),
    }
}
