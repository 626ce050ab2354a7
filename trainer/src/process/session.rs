//! [`Session`]: a trainer's membership in a job — its etcd lease, its registration under
//! `trainers/<id>`, and its client of the leading master — shared by the trainer process
//! and `edl consume`.
//!
//! Invariant: while a session exists its registration is held under its own lease; the
//! master treats the trainer as alive exactly that long. [`Session::leave`] deregisters
//! and revokes (a drain); dropping it without leaving lets the lease expire (a crash).

use std::sync::Arc;
use std::time::Duration;

use crate::goodput::GoodputClock;
use crate::tasks::{CloudReader, ReaderConfig};
use edl_coord::{Backend, Lease, Registry, retry_startup};
use edl_job::{JobKeys, JobName, Record, TrainerRecord};
use edl_master_client::{MasterClient, MasterClientConfig};
use tokio_util::sync::CancellationToken;

/// What joining a job needs.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// The job.
    pub job: JobName,
    /// This trainer's id (its key under `trainers/`).
    pub id: String,
    /// TTL of the registration lease: the master notices a dead trainer within it.
    pub lease_ttl: Duration,
    /// The job token every RPC carries.
    pub token: Option<String>,
    /// Dial the master over TLS.
    pub tls: Option<edl_proto::tls::Tls>,
    /// The value registered.
    pub record: TrainerRecord,
    /// How long joining keeps retrying an unreachable etcd (the lease, the registration).
    pub etcd_wait: Duration,
}

/// Joining a job failed.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// No lease could be granted.
    #[error("get an etcd lease: {0}")]
    Lease(edl_coord::Error),
    /// The registration could not be written.
    #[error("register the trainer: {0}")]
    Register(edl_coord::Error),
}

/// A trainer's membership in a job.
#[derive(Debug)]
pub struct Session {
    id: String,
    lease: Lease,
    registry: Registry,
    master: MasterClient,
}

impl Session {
    /// Takes a lease, registers under it and starts a master client, retrying an
    /// unavailable etcd for up to `cfg.etcd_wait` at each step. The lease is kept alive,
    /// and the master client runs, until `life` is cancelled (after
    /// [`Session::leave`]: a drain needs both).
    pub async fn join(
        backend: Arc<dyn Backend>,
        cfg: SessionConfig,
        life: CancellationToken,
    ) -> Result<Session, SessionError> {
        let lease = retry_startup("grant the trainer's lease", cfg.etcd_wait, &life, || {
            Lease::grant(backend.clone(), cfg.lease_ttl, life.child_token())
        })
        .await
        .map_err(SessionError::Lease)?;
        let registry = Registry::new(backend.clone(), JobKeys::new(&cfg.job).trainers());
        let record = cfg.record.encode();
        // Create-if-absent or update under the same lease: a retry after a timeout that
        // was applied finds its own registration.
        let registered = retry_startup("register the trainer", cfg.etcd_wait, &life, || {
            registry.register(&cfg.id, record.clone(), &lease)
        })
        .await;
        if let Err(e) = registered {
            lease.revoke().await.ok();
            return Err(SessionError::Register(e));
        }
        let mut mcfg = MasterClientConfig::new(cfg.job.clone());
        mcfg.token = cfg.token;
        mcfg.tls = cfg.tls;
        let master = MasterClient::new(backend, mcfg, life.child_token());
        Ok(Session {
            id: cfg.id,
            lease,
            registry,
            master,
        })
    }

    /// This trainer's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The client of the job's leading master.
    pub fn master(&self) -> &MasterClient {
        &self.master
    }

    /// Cancelled when the lease is lost (etcd ended it: this trainer was cut off from
    /// etcd, or paused, for longer than its TTL): the master has then given this
    /// trainer's tasks to others. An etcd outage alone does not lose it.
    pub fn lost(&self) -> CancellationToken {
        self.lease.lost()
    }

    /// The lease's TTL.
    pub fn lease_ttl(&self) -> Duration {
        self.lease.ttl()
    }

    /// A `cloud_reader` of the job's tasks with `read_ahead` tasks buffered (the
    /// reader's default when `None`). It asks for no new task while the lease is
    /// uncertain (etcd may have ended it, and the master would take the task back).
    /// With `goodput`, the trainer's clock, its totals go with each `GetTask`.
    pub fn reader(&self, read_ahead: Option<usize>, goodput: Option<GoodputClock>) -> CloudReader {
        let mut cfg = ReaderConfig::new(&self.id);
        cfg.lease = Some(self.lease.watch_state());
        cfg.goodput = goodput;
        if let Some(n) = read_ahead {
            cfg.read_ahead = n;
        }
        CloudReader::start(self.master.clone(), cfg)
    }

    /// Deregisters and revokes the lease (best effort: an unreachable etcd lets the lease
    /// expire instead).
    pub async fn leave(self) {
        if let Err(e) = self.registry.deregister(&self.id, &self.lease).await {
            tracing::debug!(error = %e, "deregister");
        }
        if let Err(e) = self.lease.revoke().await {
            tracing::debug!(error = %e, "revoke the lease");
        }
    }
}

#[cfg(test)]
mod tests {
    use edl_coord::MemBackend;
    use edl_job::RECORD_VERSION;
    use edl_testkit::FaultyBackend;

    use super::*;

    fn config(id: &str, etcd_wait: Duration) -> SessionConfig {
        SessionConfig {
            job: JobName::new("join").unwrap(),
            id: id.to_owned(),
            lease_ttl: Duration::from_secs(10),
            token: None,
            tls: None,
            record: TrainerRecord {
                version: RECORD_VERSION,
                pid: 1,
                device: None,
                started_ms: 0,
                metrics: None,
            },
            etcd_wait,
        }
    }

    /// Joining while etcd is unavailable waits for it (within `etcd_wait`), then takes a
    /// lease and registers; past `etcd_wait` it fails with etcd's error.
    #[tokio::test(start_paused = true)]
    async fn joining_waits_out_an_unavailable_etcd_for_its_wait() {
        let mem = MemBackend::new();
        let faulty = FaultyBackend::new(Arc::new(mem.clone()));
        let life = CancellationToken::new();
        faulty.set_down(true);
        let join = tokio::spawn(Session::join(
            faulty.clone(),
            config("t0", Duration::from_secs(60)),
            life.clone(),
        ));
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert!(!join.is_finished(), "joining gave up during the outage");
        faulty.set_down(false);
        let session = tokio::time::timeout(Duration::from_secs(5), join)
            .await
            .expect("joined once etcd answered")
            .unwrap()
            .unwrap();
        let key = format!(
            "{}t0",
            JobKeys::new(&JobName::new("join").unwrap()).trainers()
        );
        let kv = mem.get(&key).await.unwrap().expect("registered");
        assert_eq!(kv.lease, Some(session.lease.id()));

        faulty.set_down(true);
        let started = tokio::time::Instant::now();
        let r = Session::join(faulty, config("t1", Duration::from_secs(20)), life).await;
        assert!(
            matches!(&r, Err(SessionError::Lease(e)) if e.is_retryable()),
            "{r:?}"
        );
        assert!(started.elapsed() <= Duration::from_secs(21));
    }
}
