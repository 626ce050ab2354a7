//! [`Member`]: a trainer that joined its job — its [`Session`] (lease, registration,
//! master client), the dataset defined at the master, its client of the pservers as a
//! [`PsStore`], its progress and `/metrics` — until it leaves with its report.
//!
//! [`super::run`] trains the built-in loop through a `Member`; the Python package's
//! trainer drives its own loop through one ([`Member::tasks`], [`Member::store`]). Either
//! way: joining is interrupted by `shutdown` (nothing done, or a drain before the first
//! task), and leaving takes the trainer out of the sync steps, deregisters it and
//! revokes its lease. A trainer whose lease etcd ended leaves with
//! [`TrainerError::LeaseLost`] (the master has given its tasks to others).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::tasks::CloudReader;
use edl_coord::Backend;
use edl_job::{JobSpec, RECORD_VERSION, TrainerRecord};
use edl_master_client::TaskSize;
use edl_pserver_client::{PsClient, PsClientConfig};
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::{Session, SessionConfig, TrainerConfig, TrainerError, TrainerReport, metrics, report};
use crate::goodput::GoodputClock;
use crate::{ParamStore, Progress, PsStore, PsStoreStats, Tasks};

/// How [`Member::join`] ended.
// Made once per trainer: the member stays inline rather than boxed.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Joined {
    /// The trainer is a member of its job.
    Member(Member),
    /// `shutdown` fired after it registered and before it trained: it left, and this is
    /// its report (drained, nothing trained).
    Drained(TrainerReport),
}

/// A trainer that joined its job (see the module docs).
#[derive(Debug)]
pub struct Member {
    spec: JobSpec,
    id: String,
    device: String,
    ttl: Duration,
    session: Session,
    store: Arc<PsStore>,
    stats: Arc<PsStoreStats>,
    progress: watch::Sender<Progress>,
    started: Instant,
    /// Where its time goes, from its start: measured, reported and sent to the master
    /// once the built-in loop runs ([`Member::reader`]); a loop of the caller's own
    /// ([`Member::tasks`]) is not measured.
    clock: GoodputClock,
    /// The session and the clients live until the member leaves (or is dropped): a
    /// shutdown only starts the drain.
    life: CancellationToken,
    _life: DropGuard,
}

impl Member {
    /// Joins the job of `spec` as trainer `cfg.id` computing on device `device` (its
    /// name: `cpu`, `cuda:0`; [`crate::device_name`]): takes a lease and registers under
    /// it, defines the dataset at the master (idempotent), connects to the pservers and
    /// serves `/metrics` when `cfg.metrics_addr` is set. `started`: when the process
    /// started (the report's wall time).
    pub async fn join(
        backend: Arc<dyn Backend>,
        cfg: &TrainerConfig,
        spec: JobSpec,
        device: &str,
        started: Instant,
        shutdown: &CancellationToken,
    ) -> Result<Joined, TrainerError> {
        let id = cfg.id.clone();
        let clock = GoodputClock::starting_at(started);
        let ttl = cfg.lease_ttl.unwrap_or(spec.cluster.lease_ttl);
        let dev_name = device.to_owned();
        let life = CancellationToken::new();
        let guard = life.clone().drop_guard();
        let joining = Session::join(
            backend.clone(),
            SessionConfig {
                job: cfg.job.clone(),
                id: id.clone(),
                lease_ttl: ttl,
                token: cfg.token.clone(),
                tls: cfg.tls.clone(),
                record: TrainerRecord {
                    version: RECORD_VERSION,
                    pid: std::process::id(),
                    device: Some(dev_name.clone()),
                    started_ms: edl_job::records::now_ms(),
                    metrics: cfg.metrics_addr.map(|a| a.to_string()),
                },
                etcd_wait: cfg.etcd_wait,
            },
            life.clone(),
        );
        // SIGTERM while joining (etcd unreachable, say): nothing was done. A registration
        // made meanwhile ends with its lease, which is no longer kept alive.
        let session = tokio::select! {
            r = joining => r.map_err(TrainerError::Join)?,
            _ = shutdown.cancelled() => return Err(TrainerError::StoppedBeforeStart),
        };

        // SIGTERM while starting up: leave without having done anything.
        let drained_early = |session: Session| {
            let (id, dev, clock) = (id.clone(), dev_name.clone(), clock.clone());
            async move {
                session.leave().await;
                tracing::info!(trainer = %id, "drained while starting");
                let p = Progress {
                    drained: true,
                    ..Progress::default()
                };
                Ok(Joined::Drained(report::report(
                    (&id, &dev),
                    &p,
                    &PsStoreStats::default(),
                    started,
                    Some(clock.snapshot()),
                )))
            }
        };
        let ds = tokio::select! {
            r = session.master().set_dataset_sized(
                spec.data.train.patterns(),
                match spec.data.chunks_per_task {
                    0 => TaskSize::Records {
                        records: spec.data.records_per_task,
                        floor: spec.train.batch_size as u64,
                    },
                    n => TaskSize::Chunks(n),
                },
                spec.train.passes,
            ) => match r {
                Ok(ds) => ds,
                Err(e) => {
                    session.leave().await;
                    return Err(TrainerError::Dataset(e));
                }
            },
            _ = shutdown.cancelled() => return drained_early(session).await,
        };
        tracing::info!(
            trainer = %id,
            device = %dev_name,
            files = ds.files,
            tasks = ds.tasks,
            records = ds.records,
            "trainer registered"
        );

        let mut pcfg = PsClientConfig::new(cfg.job.clone());
        pcfg.token = cfg.token.clone();
        pcfg.tls = cfg.tls.clone();
        // Retried pserver calls are recovering.
        pcfg.observer = Some(Arc::new(clock.clone()));
        let ps = tokio::select! {
            r = PsClient::connect(backend.clone(), pcfg, life.child_token()) => match r {
                Ok(ps) => ps,
                Err(e) => {
                    session.leave().await;
                    return Err(TrainerError::Pservers(e));
                }
            },
            _ = shutdown.cancelled() => return drained_early(session).await,
        };
        let store = Arc::new(PsStore::new(
            ps,
            crate::job::param_config(&spec),
            spec.train.seed,
        ));
        let stats = store.stats();

        let (progress, rx) = watch::channel(Progress::default());
        if let Some(addr) = cfg.metrics_addr {
            let served = metrics::serve(
                addr,
                edl_proto::headers::Credentials::new(
                    "trainer",
                    cfg.job.as_str(),
                    cfg.token.clone(),
                )
                .with_metrics_token(cfg.metrics_token.clone()),
                metrics::Labels {
                    job: cfg.job.to_string(),
                    id: id.clone(),
                    device: dev_name.clone(),
                },
                rx.clone(),
                stats.clone(),
                clock.clone(),
                life.clone(),
            )
            .await;
            match served {
                Ok(local) => tracing::info!(addr = %local, "serving /metrics"),
                Err(error) => {
                    session.leave().await;
                    return Err(TrainerError::Metrics { addr, error });
                }
            }
        }
        super::log_progress(rx, id.clone());
        Ok(Joined::Member(Member {
            spec,
            id,
            device: dev_name,
            ttl,
            session,
            store,
            stats,
            progress,
            started,
            clock,
            life,
            _life: guard,
        }))
    }

    /// The job's spec.
    pub fn spec(&self) -> &JobSpec {
        &self.spec
    }

    /// This trainer's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The device's name (`cpu`, `cuda:0`).
    pub fn device_name(&self) -> &str {
        &self.device
    }

    /// The pservers, as this trainer's parameter store.
    pub fn store(&self) -> Arc<PsStore> {
        self.store.clone()
    }

    /// A reader of the master's tasks for the built-in loop (start one at a time): the
    /// trainer's goodput is measured from now on (the loop marks its spans on the
    /// reader's clock), sent with each `GetTask`, served on `/metrics` and reported.
    pub fn reader(&self) -> CloudReader {
        self.clock.use_it();
        self.session.reader(None, Some(self.clock.clone()))
    }

    /// This trainer's tasks, acknowledged through its store ([`Tasks`]), for a loop of
    /// the caller's own (its time is not measured).
    pub fn tasks(&self) -> Tasks {
        Tasks::new(
            self.session.reader(None, None),
            self.store.clone() as _,
            self.id.clone(),
        )
    }

    /// Where the trainer's progress goes (`/metrics`, the log).
    pub fn progress(&self) -> watch::Sender<Progress> {
        self.progress.clone()
    }

    /// A token cancelled when `shutdown` fires or etcd ends this trainer's lease: stop
    /// training (drain) then.
    pub fn stop_on(&self, shutdown: &CancellationToken) -> CancellationToken {
        let stop = CancellationToken::new();
        let (s, shutdown, lost, life) = (
            stop.clone(),
            shutdown.clone(),
            self.session.lost(),
            self.life.clone(),
        );
        tokio::spawn(async move {
            tokio::select! {
                _ = shutdown.cancelled() => s.cancel(),
                _ = lost.cancelled() => s.cancel(),
                _ = life.cancelled() => {}
            }
        });
        stop
    }

    /// Leaves the job after training (`progress`: its final counts): out of the sync
    /// steps, deregistered, the lease revoked; the report. A lease that etcd ended
    /// (unless `shutdown` fired: a drain) is [`TrainerError::LeaseLost`].
    pub async fn leave(
        self,
        progress: &Progress,
        shutdown: &CancellationToken,
    ) -> Result<TrainerReport, TrainerError> {
        // Let the others' sync steps go on without this trainer.
        if let Err(e) = self.store.idle(&self.id).await {
            tracing::debug!(error = %e, "leave the sync steps");
        }
        let lease_lost = self.session.lost().is_cancelled() && !shutdown.is_cancelled();
        self.session.leave().await;
        let rep = report::report(
            (&self.id, &self.device),
            progress,
            &self.stats,
            self.started,
            self.clock.measured(),
        );
        if lease_lost {
            return Err(TrainerError::LeaseLost { ttl: self.ttl });
        }
        tracing::info!(trainer = %self.id, drained = progress.drained, "trainer done");
        Ok(rep)
    }

    /// Leaves the job after an error: deregistered, the lease revoked (its tasks go back
    /// to the queue at once).
    pub async fn abandon(self) {
        self.session.leave().await;
    }
}
