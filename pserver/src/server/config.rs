//! Pserver configuration, and the limits of its transports (those the client shares are
//! the contract's, `edl_pserver_api`, re-exported here).

use edl_job::JobName;
use std::time::Duration;

use crate::checkpoint::CheckpointConfig;

/// The transport's limits, shared with the client.
pub use edl_pserver_api::{CONNECTION_WINDOW, DEFAULT_MAX_MESSAGE_BYTES, MAX_FRAME, STREAM_WINDOW};

/// Longest a sync push waits for its step in one call.
pub const MAX_PUSH_WAIT: Duration = Duration::from_secs(30);
pub use edl_job::launch::{DEFAULT_MAX_BULK_CONNECTIONS, IndexChoice};
/// Default longest stall of a peer in the middle of a bulk request or response.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(30);

/// Pserver configuration.
#[derive(Debug, Clone)]
pub struct PsConfig {
    /// The job (the etcd prefix `/edl/<job>/`).
    pub job: JobName,
    /// The shared job token every request must carry, if set.
    pub token: Option<String>,
    /// The token a `/metrics` scrape must carry instead of the job token, if set.
    pub metrics_token: Option<String>,
    /// The address clients reach this pserver at; defaults to the listener's address.
    pub advertise: Option<String>,
    /// TTL of the pserver's lease: a dead pserver's index frees within about this long
    /// (default [`edl_coord::lease::DEFAULT_TTL`], 10 s).
    pub lease_ttl: Duration,
    /// How long startup keeps retrying an unreachable etcd (the shard count, the lease,
    /// the claim's record, the checkpoint restore, the trainer listing) before it fails.
    pub etcd_wait: Duration,
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
    /// Bulk-path connections served at once; a new one beyond takes the slot of the
    /// connection idle longest, and is closed at once (its client retries) only while
    /// every slot is in the middle of a request.
    pub max_bulk_connections: usize,
    /// Longest a bulk-path peer may stall in the middle of a request (between the bytes
    /// of one frame) or of reading a response, before its connection is closed.
    pub io_timeout: Duration,
    /// Serve gRPC and the bulk path over TLS (needs a certificate and key); `None`:
    /// plain.
    pub tls: Option<edl_proto::tls::Tls>,
    /// Replicas per shard, the primary included (docs/replication.md). 1: a shard lives
    /// in one process and a lost process is restored from its checkpoint.
    pub replicas: usize,
    /// TLS for the replication stream's client side (a backup connecting to its
    /// primary), when the pservers serve TLS.
    pub peer_tls: Option<edl_proto::tls::Tls>,
    /// Where to serve `/metrics` (behind the job's token); `None`: nowhere.
    pub metrics_addr: Option<std::net::SocketAddr>,
}

impl PsConfig {
    /// Defaults for job `job`: auto index, 10 s lease, two minutes of etcd retries at
    /// startup, no checkpoints.
    pub fn new(job: JobName) -> Self {
        PsConfig {
            job,
            token: None,
            metrics_token: None,
            advertise: None,
            lease_ttl: edl_coord::lease::DEFAULT_TTL,
            etcd_wait: edl_coord::DEFAULT_STARTUP_WAIT,
            index: IndexChoice::Auto,
            shards: None,
            checkpoint: None,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            workers: std::thread::available_parallelism().map_or(4, |n| n.get()),
            max_bulk_connections: DEFAULT_MAX_BULK_CONNECTIONS,
            io_timeout: DEFAULT_IO_TIMEOUT,
            tls: None,
            replicas: 1,
            peer_tls: None,
            metrics_addr: None,
        }
    }

    /// The configuration of a pserver of job `job` started with `launch` (what `edl
    /// pserver` runs on its arguments, and `edl run` in process): its index, the shard
    /// count, its replicas, its checkpoints and its limits.
    pub fn launch(job: JobName, launch: &edl_job::PserverLaunch) -> Self {
        let mut cfg = PsConfig::new(job);
        cfg.lease_ttl = launch.lease_ttl;
        cfg.index = launch.index;
        cfg.shards = launch.shards;
        cfg.replicas = launch.replicas as usize;
        cfg.max_message_bytes = launch.max_message_mib.saturating_mul(1 << 20);
        cfg.max_bulk_connections = launch.max_bulk_connections;
        cfg.checkpoint = Some(CheckpointConfig {
            keep: launch.keep_checkpoints,
            ..CheckpointConfig::new(&launch.checkpoint_dir, launch.checkpoint_every)
        });
        cfg
    }
}
