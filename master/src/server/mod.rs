//! The master process: campaigns for leadership, serves the gRPC API, and while it leads
//! runs the queue actor and follows the trainer registry.
//!
//! Every master serves gRPC from the start; a standby answers `Unavailable` with the
//! leader's address (`x-edl-leader`). When the leader's etcd lease is lost its actor stops
//! at once (it must never write beside its successor; its writes are fenced anyway) and it
//! campaigns again with a new lease.
//!
//! By concern: this module holds the configuration and [`run`], which wires the parts;
//! `grpc` is the gRPC adapter over the actor (and `/metrics`), `lead` the election loop
//! and one leader term, `follow` what a term follows in etcd (the trainers, the pserver
//! shards' restores), `standby` what a master does while another leads (a copy of the
//! queue kept from a watch; the leader's process watched through its address).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, Election};
use edl_job::{JobKeys, JobName};
use tokio::net::TcpListener;
use tokio::sync::RwLock;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

/// The wire's limits, shared with the client: the longest failure reason a report may
/// carry (kept as at most [`MAX_REASON_BYTES`](crate::queue::MAX_REASON_BYTES)), the
/// largest message.
pub use edl_master_api::{MAX_MESSAGE_BYTES, MAX_REASON_WIRE_BYTES};
pub use grpc::{MAX_SHARDS, MAX_TASK_ID_BYTES, MasterGrpc};

use crate::core::CoreHandle;
use crate::error::MasterError;
use crate::queue::QueueConfig;

mod follow;
mod grpc;
mod lead;
mod standby;

/// Master configuration.
#[derive(Clone, Debug)]
pub struct MasterConfig {
    /// The job name (the etcd prefix `/edl/<job>/`).
    pub job: JobName,
    /// The shared job token every request must carry, if set.
    pub token: Option<String>,
    /// The token a `/metrics` scrape must carry instead of the job token, if set: it
    /// grants nothing else.
    pub metrics_token: Option<String>,
    /// Also serve `/metrics` in plain HTTP on this address (it is always on the gRPC
    /// port, behind the gRPC port's TLS).
    pub metrics_addr: Option<SocketAddr>,
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
    /// Snapshots of the job's etcd, taken while leading; `None`: none.
    pub snapshots: Option<crate::snapshots::SnapshotConfig>,
    /// While standing by, keep a copy of the queue's records (about 1 KB of memory a
    /// task, as the leader holds), so that a takeover rebuilds the queue from memory
    /// instead of reading every task record (`standby`); default on.
    pub standby_copy: bool,
}

impl MasterConfig {
    /// Defaults for job `job`.
    pub fn new(job: JobName) -> Self {
        MasterConfig {
            job,
            token: None,
            metrics_token: None,
            metrics_addr: None,
            advertise: None,
            lease_ttl: edl_coord::lease::DEFAULT_TTL,
            queue: QueueConfig::default(),
            reconcile_every: Duration::from_secs(5),
            max_batch: crate::core::DEFAULT_MAX_BATCH,
            default_chunks_per_task: 1,
            tls: None,
            snapshots: None,
            standby_copy: true,
        }
    }

    /// The configuration of a master of job `job` started with `launch` (what `edl master`
    /// runs on its arguments, and `edl run` in process): the lease TTL, which is also how
    /// often lease holders are checked, the queue's bounds and timeouts, and the chunks
    /// per task of a dataset defined without saying.
    pub fn launch(job: JobName, launch: &edl_job::MasterLaunch) -> Self {
        let mut cfg = MasterConfig::new(job);
        cfg.lease_ttl = launch.lease_ttl;
        cfg.reconcile_every = launch.lease_ttl;
        cfg.queue.max_failures = launch.max_failures;
        cfg.queue.max_losses = launch.max_losses;
        cfg.queue.timeout = crate::queue::TimeoutPolicy {
            initial: launch.task_timeout.as_millis() as u64,
            floor: launch.min_task_timeout.as_millis() as u64,
            ..crate::queue::TimeoutPolicy::default()
        };
        cfg.default_chunks_per_task = launch.chunks_per_task;
        cfg
    }
}

/// What the gRPC adapter needs: the actor while leading, the leader's address otherwise.
#[derive(Debug, Default)]
struct Shared {
    core: RwLock<Option<CoreHandle>>,
    leader: RwLock<Option<String>>,
    /// Since when this master, elected, has been loading the queue.
    loading: RwLock<Option<std::time::Instant>>,
    /// What its etcd snapshots did.
    snapshots: crate::snapshots::SnapshotStats,
    /// The latest goodput each trainer sent with a `GetTask` while this master led, by
    /// trainer id (departed trainers too, at most [`MAX_GOODPUT_TRAINERS`]): in memory
    /// only, shown by `Status`.
    goodput: std::sync::Mutex<std::collections::BTreeMap<String, edl_master_api::Goodput>>,
}

/// Most trainers whose goodput a master keeps (a trainer beyond them is not shown).
pub const MAX_GOODPUT_TRAINERS: usize = 10_000;

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
    if let Some(addr) = cfg.metrics_addr {
        let metrics = edl_proto::metrics::bind(addr)
            .map_err(|e| MasterError::Unavailable(format!("bind --metrics-addr {addr}: {e}")))?;
        let local = metrics.local_addr().map_or(addr, |a| a);
        let app = grpc::metrics_router(&cfg, shared.clone());
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let _ = axum::serve(metrics, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await;
        });
        tracing::info!(addr = %local, "serving /metrics");
    }
    let router = grpc::router(grpc, &cfg, shared.clone());
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

    let result = lead::lead_loop(
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
