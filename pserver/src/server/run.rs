//! A pserver's life, one path for one replica and many (a group of one is a group): the
//! shard count, a lease, the shard index (the lowest free one is claimed with `auto`),
//! then the process registers as a member of the shard's replica group
//! (`ps-member/<id>`, under its lease) and serves gRPC and the bulk path on one port,
//! follows the trainer registry, and carries out the duties its role in the group gives
//! it (`duties`: restore the shard when no replica that may hold an acknowledged op
//! lives; while primary, hold `ps/<index>`, checkpoint and settle the tasks failed for
//! good). It runs until shutdown, the lease is lost or its copy broke; then it stops
//! serving, waits for its tasks, writes a final checkpoint (when asked to stop, as
//! primary) and revokes its lease, which frees its member key and any claim at once.
//!
//! With one replica (the default) the group never recruits, and the op stream keeps no
//! copy of an op (no backup will ask for one).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, Fence, IndexClaim, Lease, Registry, claim_index_wait, retry_startup};
use edl_job::{JobKeys, MemberRecord, PserverRecord, Record};
use edl_proto::pserver as pb;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use super::claim::resolve_desired;
use super::config::{CONNECTION_WINDOW, IndexChoice, MAX_FRAME, PsConfig, STREAM_WINDOW};
use super::grpc::PsGrpc;
use super::membership::{Members, follow_trainers};
use super::replication::duties::{Ctx, duties};
use super::replication::{GroupStore, Links, Replication, Upstream};
use super::service::{Gate, Service};
use crate::checkpoint::protocol;
use crate::checkpoint::{CheckpointDir, CheckpointEvery};
use crate::error::PsError;
use crate::replica::ReplicaConfig;
use crate::shard::{CheckpointHooks, Shard, ShardCore};

/// How long a pserver asked to stop may take for its final checkpoint.
const FINAL_CHECKPOINT_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs a pserver on `listener` until `shutdown` fires. Returns
/// [`PsError::LeaseLost`] if the lease was lost (the pserver stopped serving at once;
/// the caller should exit and let a fresh process restore from the checkpoint, or a
/// backup take over).
pub async fn run(
    backend: Arc<dyn Backend>,
    cfg: PsConfig,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), PsError> {
    let local: SocketAddr = listener
        .local_addr()
        .map_err(|e| PsError::Config(format!("listener address: {e}")))?;
    let advertise = cfg.advertise.clone().unwrap_or_else(|| local.to_string());
    let keys = JobKeys::new(&cfg.job);
    // Every etcd step of the startup rides out an unavailable etcd for `etcd_wait`.
    let wait = cfg.etcd_wait;
    let shards = retry_startup("read the shard count", wait, &shutdown, || {
        resolve_desired(&*backend, &keys, cfg.shards)
    })
    .await??;
    match cfg.index {
        IndexChoice::Fixed(i) if i >= shards => {
            return Err(PsError::Config(format!(
                "index {i} is out of range: the job has {shards} shards"
            )));
        }
        IndexChoice::Auto if cfg.replicas > 1 => {
            return Err(PsError::Config(
                "a replicated shard needs its index (--index) with --replicas".into(),
            ));
        }
        _ => {}
    }
    // The lease is revoked explicitly at the end, after serving stopped; its own token
    // makes sure it ends on every path.
    let lease_cancel = CancellationToken::new();
    let _lease_guard = lease_cancel.clone().drop_guard();
    let lease = Arc::new(
        retry_startup("grant the pserver's lease", wait, &shutdown, || {
            Lease::grant(backend.clone(), cfg.lease_ttl, lease_cancel.clone())
        })
        .await?,
    );
    // `auto`: the lowest free index, claimed; the claim is the first restore's.
    let (index, first_claim) = match cfg.index {
        IndexChoice::Fixed(i) => (i, None),
        IndexChoice::Auto => {
            let record = PserverRecord::of_this_process(advertise.clone(), crate::bulk::VERSION);
            let claim = claim_index_wait(
                &*backend,
                &keys.ps_prefix(),
                shards,
                record.encode(),
                &lease,
                &shutdown,
            )
            .await
            .map_err(|e| match e {
                edl_coord::Error::Cancelled => PsError::Cancelled,
                other => other.into(),
            })?;
            (claim.index, Some(claim))
        }
    };
    let me = super::replication::member_id(index);
    let store = Arc::new(GroupStore::new(backend.clone(), keys.clone(), index));
    let member = MemberRecord::of_this_process(advertise.clone());
    retry_startup("register the replica", wait, &shutdown, || {
        store.register(&me, &member, &lease)
    })
    .await?;
    let sync_every = match cfg.checkpoint.as_ref().map(|c| c.every) {
        Some(CheckpointEvery::Steps(n)) => Some(n),
        _ => None,
    };
    let checkpoints = Arc::new(CheckpointHooks {
        every_steps: sync_every,
        ..Default::default()
    });
    let shard = Arc::new(Shard::new(index, shards, 0, checkpoints.clone()));
    let stop = shutdown.child_token();
    let rep = Replication::start(
        me.clone(),
        shard.clone(),
        store.clone(),
        lease.clone(),
        Links {
            replica: ReplicaConfig {
                replicas: cfg.replicas.max(1),
                ..ReplicaConfig::default()
            },
            upstream: Upstream {
                job: cfg.job.to_string(),
                token: cfg.token.clone(),
                tls: cfg.peer_tls.clone(),
            },
            stall: cfg.io_timeout,
        },
        stop.clone(),
    );
    tracing::info!(job = %cfg.job, shard = index, shards, member = %me, replicas = cfg.replicas, "replica started");

    // The registered trainers, before any sync step can open.
    let members = Arc::new(Members::default());
    let registry = Registry::new(backend.clone(), keys.trainers());
    let (listed, _) =
        retry_startup("list the trainers", wait, &shutdown, || registry.list()).await?;
    members
        .set
        .write()
        .await
        .extend(listed.into_iter().map(|m| m.id));
    let Started {
        acceptor,
        mut server,
    } = start_serving(
        Serving {
            backend: backend.clone(),
            cfg: &cfg,
            keys: keys.clone(),
            lease: lease.clone(),
            shard: shard.clone(),
            members: members.clone(),
            replication: rep.clone(),
        },
        listener,
        stop.clone(),
    )?;
    tracing::info!(job = %cfg.job, shard = index, addr = %advertise, "pserver serving");
    let dir = cfg
        .checkpoint
        .as_ref()
        .map(|c| CheckpointDir::open(&c.location, &cfg.job, index))
        .transpose()?;
    let ctx = Arc::new(Ctx {
        backend: backend.clone(),
        cfg: cfg.clone(),
        keys: keys.clone(),
        index,
        shards,
        lease: lease.clone(),
        shard: shard.clone(),
        checkpoints,
        dir,
        rep,
        store,
        advertise,
        first_claim: std::sync::Mutex::new(first_claim),
    });
    let claim = Arc::new(std::sync::Mutex::new(None::<IndexClaim>));
    let tasks = vec![
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
        tokio::spawn(duties(ctx.clone(), claim.clone(), stop.clone()).in_current_span()),
    ];
    let lost = lease.lost();
    let broken = ctx.rep.failed().clone();
    let result = tokio::select! {
        biased;
        _ = shutdown.cancelled() => Ok(()),
        _ = broken.cancelled() => Err(PsError::Internal(format!(
            "shard {index}: this replica's copy broke (see the log); restart the process: \
             it joins again as a new member"
        ))),
        _ = lost.cancelled() => {
            tracing::error!(job = %cfg.job, shard = index, "etcd lease lost; stopped serving (a replacement or another replica may hold this shard now)");
            Err(PsError::LeaseLost(index))
        }
        r = &mut server => Err(PsError::Config(format!("grpc server ended: {r:?}"))),
    };
    wind_down(&stop, server, tasks).await;
    let held = crate::shard::lock(&claim).take();
    if result.is_ok()
        && let Some(held) = held
        && ctx.cfg.checkpoint.as_ref().is_some_and(|c| c.final_on_stop)
        && let Some(dir) = &ctx.dir
        && let Ok(core) = ctx.shard.core()
    {
        // Asked to stop, as primary: nothing is served any more, so the shard is written
        // once more, with every update it acknowledged.
        final_checkpoint(&*backend, &keys, &held.fence, dir, core).await;
    }
    if result.is_ok() {
        // The member key and any claim go at once: a successor (a backup, or a fresh
        // process restoring) need not wait out the TTL.
        stopped(&lease, index).await;
    }
    result
}

/// Stops serving: `stop` fires, then the gRPC server and `tasks` get 5 s each to end
/// (the server is aborted after that).
async fn wind_down(
    stop: &CancellationToken,
    mut server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
) {
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
}

/// A clean stop's end: the lease is revoked, so that whatever it holds (the claim, a
/// replica's member key) goes at once and a successor need not wait out the TTL.
async fn stopped(lease: &Lease, index: u32) {
    if let Err(e) = lease.revoke_shared().await {
        tracing::warn!(error = %e, "lease revoke failed; its keys go when it expires");
    }
    tracing::info!(shard = index, "pserver stopped");
}

/// What serving a shard needs, however the shard came to this process.
struct Serving<'a> {
    backend: Arc<dyn Backend>,
    cfg: &'a PsConfig,
    keys: JobKeys,
    lease: Arc<Lease>,
    shard: Arc<Shard>,
    members: Arc<Members>,
    replication: Arc<Replication>,
}

/// The tasks serving the port: the acceptor (bulk path, replication connections) and
/// the gRPC server.
struct Started {
    acceptor: tokio::task::JoinHandle<()>,
    server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

/// Serves gRPC and the bulk path on `listener` until `stop` fires.
fn start_serving(
    s: Serving<'_>,
    listener: TcpListener,
    stop: CancellationToken,
) -> Result<Started, PsError> {
    let cfg = s.cfg;
    let gate = Arc::new(Gate {
        lease: s.lease.clone(),
        stop: stop.clone(),
        index: s.shard.index(),
    });
    let metrics = super::metrics::PsMetrics::new();
    if let Some(addr) = cfg.metrics_addr {
        let listener = edl_proto::metrics::bind(addr)
            .map_err(|e| PsError::Config(format!("bind --metrics-addr {addr}: {e}")))?;
        let local = listener.local_addr().map_or(addr, |a| a);
        super::metrics::serve(
            listener,
            edl_proto::headers::Credentials::new("pserver", cfg.job.as_str(), cfg.token.clone())
                .with_metrics_token(cfg.metrics_token.clone()),
            cfg.job.to_string(),
            s.shard.clone(),
            gate.clone(),
            metrics.clone(),
            stop.clone(),
        );
        tracing::info!(addr = %local, "serving /metrics");
    }
    let svc = Arc::new(Service {
        shard: s.shard.clone(),
        gate,
        metrics,
        job: cfg.job.to_string(),
        token: cfg.token.clone(),
        members: s.members.clone(),
        backend: s.backend.clone(),
        keys: s.keys.clone(),
        permits: Arc::new(Semaphore::new(cfg.workers.max(1))),
        max_message_bytes: cfg.max_message_bytes,
        io_timeout: cfg.io_timeout,
        replication: s.replication,
    });
    // Job and token are checked from the headers, before a request's body is read.
    let grpc = tonic::service::interceptor::InterceptedService::new(
        pb::parameter_server_server::ParameterServerServer::new(PsGrpc { svc: svc.clone() })
            .max_decoding_message_size(cfg.max_message_bytes)
            .max_encoding_message_size(cfg.max_message_bytes),
        edl_proto::headers::Credentials::new("pserver", cfg.job.as_str(), cfg.token.clone()),
    );
    let acceptor = cfg
        .tls
        .as_ref()
        .map(|t| t.acceptor())
        .transpose()
        .map_err(|e| PsError::Config(e.to_string()))?;
    // One port: bulk connections are told apart from HTTP/2 by their first byte, or
    // under TLS by the handshake's ALPN.
    let (conns_tx, conns_rx) = tokio::sync::mpsc::channel(64);
    let acceptor = tokio::spawn(
        crate::bulk::accept(
            listener,
            svc.clone(),
            conns_tx,
            crate::bulk::BulkSlots::new(cfg.max_bulk_connections),
            acceptor,
            stop.clone(),
        )
        .in_current_span(),
    );
    let server = tokio::spawn(
        async move {
            tonic::transport::Server::builder()
                .initial_stream_window_size(Some(STREAM_WINDOW))
                .initial_connection_window_size(Some(CONNECTION_WINDOW))
                .max_frame_size(Some(MAX_FRAME))
                // Bounds on what one peer may open before any request is authenticated.
                .max_concurrent_streams(edl_proto::headers::MAX_CONCURRENT_STREAMS)
                .http2_max_header_list_size(edl_proto::headers::MAX_HEADER_LIST_BYTES)
                .tcp_nodelay(true)
                .add_service(grpc)
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::ReceiverStream::new(conns_rx),
                    stop.cancelled_owned(),
                )
                .await
        }
        .in_current_span(),
    );
    Ok(Started { acceptor, server })
}

/// Writes the shard's final checkpoint and commits it alone (bounded in time: a pserver
/// asked to stop must stop). A failure is logged: the previous checkpoint stays, and the
/// master trains again what it lacks when the shard is restored.
async fn final_checkpoint(
    backend: &dyn Backend,
    keys: &JobKeys,
    fence: &Fence,
    dir: &CheckpointDir,
    core: Arc<ShardCore>,
) {
    let index = core.index();
    let shards = core.layout().shards();
    let mode = core.spec().config.mode.name();
    let work = async {
        let step = protocol::next_label(backend, keys).await?;
        let snap = tokio::task::spawn_blocking(move || {
            let mut snap = core.snapshot(step);
            snap.final_of = core.incarnation();
            snap
        })
        .await
        .map_err(|e| PsError::Internal(format!("snapshot failed: {e}")))?;
        let entry = protocol::write_snapshot(dir, Arc::new(snap)).await?;
        protocol::commit_solo(backend, keys, fence, &entry, shards, mode).await
    };
    match tokio::time::timeout(FINAL_CHECKPOINT_TIMEOUT, work).await {
        Ok(Ok(Some(step))) => tracing::info!(shard = index, step, "final checkpoint written"),
        Ok(Ok(None)) => tracing::warn!(
            shard = index,
            "final checkpoint not committed: other commits kept racing it"
        ),
        Ok(Err(e)) => {
            tracing::error!(shard = index, error = %e, "final checkpoint failed; the previous one stays")
        }
        Err(_) => {
            tracing::error!(shard = index, timeout = ?FINAL_CHECKPOINT_TIMEOUT, "final checkpoint took too long; the previous one stays")
        }
    }
}
