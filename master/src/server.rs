//! The master process: campaigns for leadership, serves the gRPC API, and while it leads
//! runs the queue actor and follows the trainer registry.
//!
//! Every master serves gRPC from the start; a standby answers `Unavailable` with the
//! leader's address (`x-edl-leader`). When the leader's etcd lease is lost its actor stops
//! at once (it must never write beside its successor; its writes are fenced anyway) and it
//! campaigns again with a new lease.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use edl_coord::{
    Backend, Backoff, Election, Lease, MemberEvent, Membership, Registry, RetryPolicy,
};
use edl_job::{JobKeys, JobName, Record, RestoreRecord};
use edl_proto::master as pb;
use futures::StreamExt;
use tokio::net::TcpListener;
use tokio::sync::RwLock;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

/// The wire's limits, shared with the client: the longest failure reason a report may
/// carry (kept as at most [`MAX_REASON_BYTES`](crate::queue::MAX_REASON_BYTES)), the
/// largest message.
pub use edl_master_client::{MAX_MESSAGE_BYTES, MAX_REASON_WIRE_BYTES};

use crate::core::{Core, CoreHandle, StatusReport};
use crate::dataset::DatasetSpec;
use crate::error::MasterError;
use crate::queue::{QueueConfig, bounded_reason};
use crate::store::Store;

/// Master configuration.
#[derive(Clone, Debug)]
pub struct MasterConfig {
    /// The job name (the etcd prefix `/edl/<job>/`).
    pub job: JobName,
    /// The shared job token every request must carry, if set.
    pub token: Option<String>,
    /// The address trainers reach this master at; defaults to the listener's address.
    pub advertise: Option<String>,
    /// TTL of the master's etcd lease: a dead leader is replaced within about this long
    /// (default [`edl_coord::lease::DEFAULT_TTL`], 10 s).
    pub lease_ttl: Duration,
    /// Task queue settings (failures, timeouts); passes come from the dataset.
    pub queue: QueueConfig,
    /// How often lease holders are checked against a consistent trainer listing, as a
    /// backstop to the registry watch.
    pub reconcile_every: Duration,
    /// Most requests group-committed in one etcd transaction; 1 turns group commit off
    /// (every transition its own etcd round trip: the benchmark's baseline).
    pub max_batch: usize,
    /// Chunks per task for a `SetDataset` that leaves it 0.
    pub default_chunks_per_task: u32,
    /// Serve over TLS (needs a certificate and key); `None`: plain HTTP/2.
    pub tls: Option<edl_proto::tls::Tls>,
}

impl MasterConfig {
    /// Defaults for job `job`.
    pub fn new(job: JobName) -> Self {
        MasterConfig {
            job,
            token: None,
            advertise: None,
            lease_ttl: edl_coord::lease::DEFAULT_TTL,
            queue: QueueConfig::default(),
            reconcile_every: Duration::from_secs(5),
            max_batch: crate::core::DEFAULT_MAX_BATCH,
            default_chunks_per_task: 1,
            tls: None,
        }
    }
}

/// What the gRPC adapter needs: the actor while leading, the leader's address otherwise.
#[derive(Debug, Default)]
struct Shared {
    core: RwLock<Option<CoreHandle>>,
    leader: RwLock<Option<String>>,
}

/// The gRPC adapter over the actor.
#[derive(Debug, Clone)]
pub struct MasterGrpc {
    shared: Arc<Shared>,
    job: String,
    default_chunks_per_task: u32,
}

impl MasterGrpc {
    async fn core(&self) -> Result<CoreHandle, Status> {
        if let Some(h) = self.shared.core.read().await.clone() {
            return Ok(h);
        }
        let leader = self.shared.leader.read().await.clone();
        Err(MasterError::NotLeader { leader }.into())
    }
}

fn status_to_pb(job: &str, leader: String, s: StatusReport) -> pb::StatusResponse {
    let c = s.counters;
    pb::StatusResponse {
        job: job.to_owned(),
        leader,
        dataset_set: s.dataset_set,
        pass: s.pass,
        passes: s.passes,
        finished: s.finished,
        todo: s.counts.todo as u64,
        pending: s.counts.pending as u64,
        done: s.counts.done as u64,
        failed: s.counts.failed as u64,
        trainers: s.holders,
        counters: Some(pb::Counters {
            dispatched: c.dispatched,
            finished: c.finished,
            failures: c.failures,
            requeued: c.requeued,
            timeouts: c.timeouts,
            trainer_lost: c.trainer_lost,
            released: c.released,
            stale_rejected: c.stale_rejected,
            records_trained: c.records_trained,
            duplicate_records: c.duplicate_records,
            cutoff_records: c.cutoff_records,
            failed_tasks: c.failed_tasks,
            lost_records: c.lost_records,
            passes_completed: c.passes_completed,
            failovers: c.restores,
            recomputed: c.recomputed,
            recomputed_records: c.recomputed_records,
        }),
        failed_tasks: s
            .failed
            .into_iter()
            .map(|f| pb::FailedTask {
                pass: f.pass,
                id: f.id,
                records: f.records,
                reason: f.reason,
            })
            .collect(),
        timeout_ms: s.timeout_ms,
        total_records: s.total_records,
    }
}

/// Most pserver shards of a job (`cluster.pservers`), so most shard incarnations in a
/// report.
pub const MAX_SHARDS: usize = 256;
/// Longest task id a report may carry (the master's ids are far shorter).
pub const MAX_TASK_ID_BYTES: usize = 256;

/// The trainer and task id of a report: a member id, and a bounded id.
fn check_report(trainer: &str, task_id: &str) -> Result<(), MasterError> {
    if !edl_job::valid_member_id(trainer) {
        return Err(MasterError::InvalidArgument(format!(
            "trainer id {:?} is not a member id (1 to 200 characters, no '/')",
            bounded_reason(trainer)
        )));
    }
    if task_id.len() > MAX_TASK_ID_BYTES {
        return Err(MasterError::InvalidArgument(format!(
            "a task id of {} bytes; at most {MAX_TASK_ID_BYTES}",
            task_id.len()
        )));
    }
    Ok(())
}

#[tonic::async_trait]
impl pb::master_server::Master for MasterGrpc {
    async fn set_dataset(
        &self,
        req: Request<pb::SetDatasetRequest>,
    ) -> Result<Response<pb::SetDatasetResponse>, Status> {
        let r = req.into_inner();
        let spec = DatasetSpec {
            globs: r.globs,
            chunks_per_task: match r.chunks_per_task {
                0 => self.default_chunks_per_task,
                n => n,
            },
            passes: r.passes.max(1),
        };
        let (ds, created) = self.core().await?.set_dataset(spec).await?;
        Ok(Response::new(pb::SetDatasetResponse {
            files: ds.files.len() as u32,
            tasks: ds.tasks,
            records: ds.records,
            created,
        }))
    }

    async fn get_task(
        &self,
        req: Request<pb::GetTaskRequest>,
    ) -> Result<Response<pb::GetTaskResponse>, Status> {
        let r = req.into_inner();
        // The id is stored in the task record: a member id is bounded.
        if !edl_job::valid_member_id(&r.trainer) {
            return Err(MasterError::InvalidArgument(format!(
                "trainer id {:?} is not a member id (1 to 200 characters, no '/')",
                bounded_reason(&r.trainer)
            ))
            .into());
        }
        let wait = Duration::from_millis(u64::from(r.wait_ms));
        let reply = self
            .core()
            .await?
            .get_task(r.trainer, r.pass, r.request_id, wait)
            .await?;
        Ok(Response::new(reply.into()))
    }

    async fn task_finished(
        &self,
        req: Request<pb::TaskFinishedRequest>,
    ) -> Result<Response<pb::TaskReportResponse>, Status> {
        let r = req.into_inner();
        check_report(&r.trainer, &r.task_id)?;
        // One incarnation per pserver shard; stored with the task.
        if r.shard_incarnations.len() > MAX_SHARDS {
            return Err(MasterError::InvalidArgument(format!(
                "{} shard incarnations; a job has at most {MAX_SHARDS} pserver shards",
                r.shard_incarnations.len()
            ))
            .into());
        }
        let applied = self
            .core()
            .await?
            .finished(r.task_id, r.generation, r.records, r.shard_incarnations)
            .await?;
        Ok(Response::new(pb::TaskReportResponse { applied }))
    }

    async fn task_failed(
        &self,
        req: Request<pb::TaskFailedRequest>,
    ) -> Result<Response<pb::TaskReportResponse>, Status> {
        let r = req.into_inner();
        check_report(&r.trainer, &r.task_id)?;
        if r.reason.len() > MAX_REASON_WIRE_BYTES {
            return Err(MasterError::InvalidArgument(format!(
                "a failure reason of {} bytes; at most {MAX_REASON_WIRE_BYTES} (the client cuts \
                 longer ones: an up-to-date client never sends one)",
                r.reason.len()
            ))
            .into());
        }
        // Only the bounded form goes further (the record, the log).
        let reason = if r.reason.is_empty() {
            format!("failed on trainer {}", r.trainer)
        } else {
            bounded_reason(&r.reason)
        };
        let applied = self
            .core()
            .await?
            .failed(r.task_id, r.generation, reason, r.records_trained)
            .await?;
        Ok(Response::new(pb::TaskReportResponse { applied }))
    }

    async fn release_task(
        &self,
        req: Request<pb::ReleaseTaskRequest>,
    ) -> Result<Response<pb::TaskReportResponse>, Status> {
        let r = req.into_inner();
        check_report(&r.trainer, &r.task_id)?;
        let applied = self
            .core()
            .await?
            .release(r.task_id, r.generation, r.records_trained, r.recompute)
            .await?;
        Ok(Response::new(pb::TaskReportResponse { applied }))
    }

    async fn status(
        &self,
        _req: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        let s = self.core().await?.status().await?;
        let leader = self.shared.leader.read().await.clone().unwrap_or_default();
        Ok(Response::new(status_to_pb(&self.job, leader, s)))
    }
}

/// Runs a master on `listener` until `shutdown` fires.
pub async fn run(
    backend: Arc<dyn Backend>,
    cfg: MasterConfig,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), MasterError> {
    let local: SocketAddr = listener
        .local_addr()
        .map_err(|e| MasterError::Unavailable(format!("listener address: {e}")))?;
    let advertise = cfg.advertise.clone().unwrap_or_else(|| local.to_string());
    let shared = Arc::new(Shared::default());
    let grpc = MasterGrpc {
        shared: shared.clone(),
        job: cfg.job.to_string(),
        default_chunks_per_task: cfg.default_chunks_per_task.max(1),
    };
    let acceptor = cfg
        .tls
        .as_ref()
        .map(|t| t.acceptor())
        .transpose()
        .map_err(|e| MasterError::Unavailable(e.to_string()))?;
    // Job and token are checked from the headers, before a request's body is decoded.
    let credentials =
        edl_proto::headers::Credentials::new("master", cfg.job.as_str(), cfg.token.clone());
    let svc = tonic::service::interceptor::InterceptedService::new(
        pb::master_server::MasterServer::new(grpc)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES),
        credentials.clone(),
    );
    let metrics_shared = shared.clone();
    let metrics_job = cfg.job.to_string();
    let router = tonic::service::Routes::new(svc).into_axum_router().route(
        "/metrics",
        axum::routing::get(move |headers: axum::http::HeaderMap| {
            let shared = metrics_shared.clone();
            let job = metrics_job.clone();
            let allowed = credentials.check_bearer(
                headers
                    .get(axum::http::header::AUTHORIZATION)
                    .map(|v| v.as_bytes()),
            );
            async move {
                use axum::response::IntoResponse as _;
                if !allowed {
                    return (
                        axum::http::StatusCode::UNAUTHORIZED,
                        "the job has a token: scrape with `Authorization: Bearer <token>`\n",
                    )
                        .into_response();
                }
                let core = shared.core.read().await.clone();
                // At most one report a second from the queue's actor, however often
                // it is scraped.
                let report = match core {
                    Some(h) => h.recent_status(Duration::from_secs(1)).await.ok(),
                    None => None,
                };
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    crate::metrics::render(&job, report.as_ref()),
                )
                    .into_response()
            }
        }),
    );
    let server_stop = shutdown.clone();
    let server = tokio::spawn(
        async move {
            tonic::transport::Server::builder()
                .accept_http1(true)
                // Bounds on what one peer may open before any request is authenticated.
                .max_concurrent_streams(edl_proto::headers::MAX_CONCURRENT_STREAMS)
                .http2_max_header_list_size(edl_proto::headers::MAX_HEADER_LIST_BYTES)
                .add_routes(tonic::service::Routes::from(router))
                .serve_with_incoming_shutdown(
                    // Replies go out at once (TCP_NODELAY): otherwise a reply written in
                    // several segments waits for the client's delayed ACK (40 ms) when
                    // two calls share the connection.
                    edl_proto::tls::incoming(listener, acceptor),
                    server_stop.cancelled_owned(),
                )
                .await
        }
        .in_current_span(),
    );
    tracing::info!(job = %cfg.job, addr = %advertise, "master serving");

    let keys = JobKeys::new(&cfg.job);
    let election = Election::new(backend.clone(), keys.master_election());
    // Follow the leader's address for standby redirects.
    let mut leader_rx = election.observe(shutdown.child_token());
    let hint = shared.clone();
    tokio::spawn(
        async move {
            loop {
                let addr = leader_rx
                    .borrow_and_update()
                    .as_ref()
                    .map(|l| String::from_utf8_lossy(&l.value).into_owned());
                *hint.leader.write().await = addr;
                if leader_rx.changed().await.is_err() {
                    break;
                }
            }
        }
        .in_current_span(),
    );

    let result = lead_loop(
        &backend, &cfg, &keys, &election, &advertise, &shared, &shutdown,
    )
    .await;
    shutdown.cancel();
    match server.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "grpc server ended with an error"),
        Err(e) => tracing::warn!(error = %e, "grpc server task failed"),
    }
    result
}

/// Campaigns, leads until the lease is lost, and campaigns again, until shutdown.
async fn lead_loop(
    backend: &Arc<dyn Backend>,
    cfg: &MasterConfig,
    keys: &JobKeys,
    election: &Election,
    advertise: &str,
    shared: &Arc<Shared>,
    shutdown: &CancellationToken,
) -> Result<(), MasterError> {
    let mut backoff = Backoff::new(retry_forever(Duration::from_millis(100)));
    while !shutdown.is_cancelled() {
        let lease = match Lease::grant(backend.clone(), cfg.lease_ttl, shutdown.child_token()).await
        {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "cannot get an etcd lease; retrying");
                backoff.wait(shutdown).await;
                continue;
            }
        };
        let leadership = match election.campaign(&lease, advertise, shutdown).await {
            Ok(l) => l,
            Err(edl_coord::Error::Cancelled) => break,
            Err(e) => {
                tracing::warn!(error = %e, "campaign ended; retrying");
                backoff.wait(shutdown).await;
                continue;
            }
        };
        backoff = Backoff::new(retry_forever(Duration::from_millis(100)));
        tracing::info!(addr = %advertise, revision = leadership.revision(), "leading");
        let term = CancellationToken::new();
        let lost = leadership.lost();
        let stop =
            {
                let term = term.clone();
                let shutdown = shutdown.clone();
                tokio::spawn(async move {
                tokio::select! {
                    _ = lost.cancelled() => tracing::warn!("leadership lost; stepping down"),
                    _ = shutdown.cancelled() => {}
                    _ = term.cancelled() => {}
                }
                term.cancel();
            }
.in_current_span())
            };
        let store = Store::new(backend.clone(), keys.clone(), leadership.fence().clone());
        match lead(backend, cfg, keys, store, shared, &term).await {
            Ok(()) => {}
            Err(e) => tracing::warn!(error = %e, "leader term ended"),
        }
        *shared.core.write().await = None;
        term.cancel();
        let _ = stop.await;
        // Hand over at once: a term can end with the lease still valid (a failed commit
        // that is not a fencing error, a store that could not be loaded), and a stale
        // election key would block every candidate, us included, until its TTL ran out.
        if let Err(e) = leadership.resign().await {
            tracing::debug!(error = %e, "resign failed; the lease will expire");
        }
        if let Err(e) = lease.revoke().await {
            tracing::debug!(error = %e, "lease revoke failed; it will expire");
        }
        if shutdown.is_cancelled() {
            break;
        }
    }
    Ok(())
}

/// One leader term: rebuild the queue, serve it, follow the trainers.
async fn lead(
    backend: &Arc<dyn Backend>,
    cfg: &MasterConfig,
    keys: &JobKeys,
    store: Store,
    shared: &Arc<Shared>,
    term: &CancellationToken,
) -> Result<(), MasterError> {
    let mut backoff = Backoff::new(retry_forever(Duration::from_millis(50)));
    let (core, handle) = loop {
        match Core::start(store.clone(), cfg.queue.clone(), cfg.max_batch).await {
            Ok(x) => break x,
            Err(e @ MasterError::NotLeader { .. }) => return Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "loading the queue failed; retrying");
                backoff.wait(term).await;
                if term.is_cancelled() {
                    return Ok(());
                }
            }
        }
    };
    let registry = Registry::new(backend.clone(), keys.trainers());
    // Holders that are not registered right now lost their trainer during the failover.
    if let Ok((members, _)) = registry.list().await {
        handle
            .reconcile(members.into_iter().map(|m| m.id).collect())
            .await;
    }
    let follower = tokio::spawn(
        follow_trainers(registry, handle.clone(), cfg.reconcile_every, term.clone())
            .in_current_span(),
    );
    let restores = tokio::spawn(
        follow_restores(backend.clone(), keys.clone(), handle.clone(), term.clone())
            .in_current_span(),
    );
    *shared.core.write().await = Some(handle);
    let result = core.run(term.clone()).await;
    term.cancel();
    let _ = follower.await;
    let _ = restores.await;
    result
}

/// Hands the pserver shards' restore records to the queue whenever they change (the
/// queue applies each incarnation's once), for the whole term.
async fn follow_restores(
    backend: Arc<dyn Backend>,
    keys: JobKeys,
    handle: CoreHandle,
    term: CancellationToken,
) {
    let mut view = edl_coord::follow_prefix(backend, keys.restores(), term.child_token());
    loop {
        tokio::select! {
            _ = term.cancelled() => return,
            r = view.changed() => if r.is_err() { return },
        }
        let v = view.borrow_and_update().clone();
        if v.revision == 0 {
            continue;
        }
        let records: Vec<RestoreRecord> = v
            .kvs
            .values()
            .filter_map(|kv| match RestoreRecord::decode(&kv.value) {
                Ok(r) => Some(r),
                Err(e) => {
                    tracing::error!(key = %kv.key, error = %e, "unreadable pserver restore record ignored");
                    None
                }
            })
            .collect();
        handle.restored(records).await;
    }
}

/// Reports trainers that leave, and reconciles lease holders with a consistent listing
/// every `every`, for the whole term (through [`edl_coord::follow_members`], which
/// re-watches after a watch ends and lists after each re-watch).
async fn follow_trainers(
    registry: Registry,
    handle: CoreHandle,
    every: Duration,
    term: CancellationToken,
) {
    let mut follow = edl_coord::follow_members(registry, Some(every), term.child_token());
    while let Some(m) = follow.next().await {
        match m {
            Membership::Event(MemberEvent::Left(m)) => {
                tracing::info!(trainer = %m.id, "trainer left");
                handle.trainers_lost(vec![m.id]).await;
            }
            Membership::Event(MemberEvent::Joined(m)) => {
                tracing::info!(trainer = %m.id, "trainer joined");
            }
            Membership::Event(MemberEvent::Updated(_)) => {}
            Membership::Listing(members, _) => {
                handle
                    .reconcile(members.into_iter().map(|m| m.id).collect())
                    .await;
            }
        }
    }
}

/// Retries until cancelled, from `initial` up to 2 s between attempts.
fn retry_forever(initial: Duration) -> RetryPolicy {
    RetryPolicy::forever().with_delays(initial, Duration::from_secs(2))
}
