//! A pserver's life: resolve the shard count, claim an index under a lease, restore the
//! latest checkpoint (with the tasks failed for good settled), list the registered
//! trainers, then serve gRPC and the bulk path on one port, follow the registry and the
//! failed tasks and checkpoint in the background until shutdown or the lease is lost;
//! then stop serving, wait for the tasks, write a final checkpoint (when asked to
//! stop), and free the index.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use edl_coord::{
    Backend, Fence, Lease, Op, Registry, Txn, claim_index_wait, fenced_txn, retry_startup,
};
use edl_proto::pserver as pb;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use super::checkpointer::Checkpointer;
use super::claim::{claim_fixed, resolve_desired};
use super::config::{CONNECTION_WINDOW, IndexChoice, MAX_FRAME, PsConfig, STREAM_WINDOW};
use super::failed::follow_failed;
use super::grpc::PsGrpc;
use super::membership::{Members, follow_trainers};
use super::service::{Gate, Service};
use crate::checkpoint::protocol;
use crate::checkpoint::{CheckpointDir, CheckpointEvery};
use crate::error::PsError;
use crate::shard::{CheckpointHooks, Shard, ShardCore};
use edl_job::{JobKeys, PserverRecord, Record, RestoreRecord};

/// How long a pserver asked to stop may take for its final checkpoint.
const FINAL_CHECKPOINT_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs a pserver on `listener` until `shutdown` fires. Returns
/// [`PsError::LeaseLost`] if the lease was lost (the pserver stopped serving at once;
/// the caller should exit and let a fresh process restore from the checkpoint).
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
    let lease = Arc::new(
        retry_startup("grant the pserver's lease", wait, &shutdown, || {
            Lease::grant(backend.clone(), cfg.lease_ttl, lease_cancel.clone())
        })
        .await?,
    );
    if cfg.replicas > 1 {
        let IndexChoice::Fixed(index) = cfg.index else {
            return Err(PsError::Config(
                "a replicated shard needs its index (--index) with --replicas".into(),
            ));
        };
        return super::replicated::run_replicated(
            backend,
            cfg,
            listener,
            shutdown,
            lease,
            (index, shards),
            advertise,
        )
        .await;
    }
    let mut record = PserverRecord {
        bulk: crate::bulk::VERSION,
        pid: std::process::id(),
        started_ms: protocol::now_ms(),
        ..PserverRecord::at(advertise.clone())
    };
    let value = record.encode();
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
    let value = record.encode();
    retry_startup("publish the claim", wait, &shutdown, || {
        fenced_txn(
            &*backend,
            &claim.fence,
            Txn::new().and_then([Op::put_with_lease(claim.key(), value.clone(), lease.id())]),
        )
    })
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
        .map(|c| CheckpointDir::open(&c.location, &cfg.job, index))
        .transpose()?;
    restore_into(Restore {
        backend: &backend,
        keys: &keys,
        dir: dir.as_ref(),
        shard: &shard,
        checkpoints: &checkpoints,
        fence: &claim.fence,
        shards,
        wait,
        shutdown: &shutdown,
    })
    .await?;

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

    let stop = shutdown.child_token();
    let serving = start_serving(
        Serving {
            backend: backend.clone(),
            cfg: &cfg,
            keys: keys.clone(),
            lease: lease.clone(),
            shard: shard.clone(),
            members: members.clone(),
            claim_revision: claim.fence.revision,
            replication: None,
        },
        listener,
        stop.clone(),
    )?;
    let Started {
        acceptor,
        mut server,
    } = serving;
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
        tokio::spawn(
            follow_failed(backend.clone(), keys.clone(), shard.clone(), stop.clone())
                .in_current_span(),
        ),
    ];
    if let (Some(c), Some(dir)) = (cfg.checkpoint.clone(), dir.clone()) {
        tasks.push(tokio::spawn(
            Checkpointer {
                backend: backend.clone(),
                keys: keys.clone(),
                fence: claim.fence.clone(),
                shard: shard.clone(),
                dir,
                cfg: c,
                said_full: Default::default(),
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
    wind_down(&stop, server, tasks).await;
    if result.is_ok()
        && cfg.checkpoint.as_ref().is_some_and(|c| c.final_on_stop)
        && let Some(dir) = &dir
        && let Ok(core) = shard.core()
    {
        // Asked to stop: nothing is served any more, so the shard is written once more,
        // with every update it acknowledged.
        final_checkpoint(&*backend, &keys, &claim.fence, dir, core).await;
    }
    if result.is_ok() {
        // Free the index at once for a successor (the service still holds the lease:
        // before, only an unshared lease was revoked, so a successor always waited out
        // the TTL).
        stopped(&lease, index).await;
    }
    result
}

/// Stops serving: `stop` fires, then the gRPC server and `tasks` get 5 s each to end
/// (the server is aborted after that).
pub(super) async fn wind_down(
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
pub(super) async fn stopped(lease: &Lease, index: u32) {
    if let Err(e) = lease.revoke_shared().await {
        tracing::warn!(error = %e, "lease revoke failed; its keys go when it expires");
    }
    tracing::info!(shard = index, "pserver stopped");
}

/// What a restore needs.
pub(super) struct Restore<'a> {
    pub(super) backend: &'a Arc<dyn Backend>,
    pub(super) keys: &'a JobKeys,
    pub(super) dir: Option<&'a CheckpointDir>,
    pub(super) shard: &'a Arc<Shard>,
    pub(super) checkpoints: &'a Arc<CheckpointHooks>,
    /// The claim the shard is restored under: its revision is the new incarnation.
    pub(super) fence: &'a Fence,
    pub(super) shards: u32,
    pub(super) wait: std::time::Duration,
    pub(super) shutdown: &'a CancellationToken,
}

/// Restores the shard's latest checkpoint into `shard` (or leaves it for a trainer to
/// initialise), settles the tasks failed for good in it, and publishes what it holds
/// (`restores/<index>`) for the master, fenced by the claim.
pub(super) async fn restore_into(r: Restore<'_>) -> Result<(), PsError> {
    let Restore {
        backend,
        keys,
        dir,
        shard,
        checkpoints,
        fence,
        shards,
        wait,
        shutdown,
    } = r;
    let index = shard.index();
    if let Some(dir) = dir {
        let d = dir.clone();
        let _ = tokio::task::spawn_blocking(move || d.remove_temporaries()).await;
        let incarnation = fence.revision as u64;
        let build = |snap| ShardCore::restore(snap, incarnation, (*checkpoints).clone());
        let restored = retry_startup("restore the checkpoint", wait, shutdown, || async {
            match protocol::restore_latest(&**backend, keys, dir, index, shards, build).await {
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
    // The tasks failed for good are settled in what it holds (the checkpoint may predate
    // some of their records).
    let failed_prefix = keys.failed();
    let (failed, _) = retry_startup("read the failed tasks", wait, shutdown, || {
        backend.range(&failed_prefix)
    })
    .await?;
    shard.settle(edl_job::records::decode_readable(&failed));
    // What this incarnation holds, for the master: the restored ledger, or nothing (a
    // trainer initialises the shard from the initial values). On a job's first start
    // nothing was trained, and the record changes nothing.
    let restored = shard.core().ok();
    let record = RestoreRecord {
        version: edl_job::RECORD_VERSION,
        shard: index,
        incarnation: fence.revision as u64,
        step: restored.as_ref().map_or(0, |c| c.restored_from()),
        contains: restored.map(|c| c.contains()).unwrap_or_default(),
        at_ms: protocol::now_ms(),
    };
    retry_startup("publish the restore", wait, shutdown, || async {
        match protocol::publish_restore(&**backend, keys, fence, &record).await {
            Ok(()) => Ok(Ok(())),
            Err(PsError::Coord(e)) => Err(e),
            Err(e) => Ok(Err(e)),
        }
    })
    .await??;

    Ok(())
}

/// What serving a shard needs, however the shard came to this process.
pub(super) struct Serving<'a> {
    pub(super) backend: Arc<dyn Backend>,
    pub(super) cfg: &'a PsConfig,
    pub(super) keys: JobKeys,
    pub(super) lease: Arc<Lease>,
    pub(super) shard: Arc<Shard>,
    pub(super) members: Arc<Members>,
    pub(super) claim_revision: i64,
    pub(super) replication: Option<Arc<super::replication::Replication>>,
}

/// The tasks serving the port: the acceptor (bulk path, replication connections) and
/// the gRPC server.
pub(super) struct Started {
    pub(super) acceptor: tokio::task::JoinHandle<()>,
    pub(super) server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

/// Serves gRPC and the bulk path on `listener` until `stop` fires.
pub(super) fn start_serving(
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
            edl_proto::headers::Credentials::new("pserver", cfg.job.as_str(), cfg.token.clone()),
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
        claim_revision: s.claim_revision,
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
pub(super) async fn final_checkpoint(
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
