//! `edl trainer`: an elastic trainer of a job.
//!
//! It reads the job spec from etcd (or stores it with `--spec`), builds the model on the
//! chosen device, registers under `trainers/<id>` with its own lease, defines the dataset
//! at the master (idempotent), and trains: tasks from the master's `cloud_reader`,
//! parameters from the pservers (exactly one trainer initialises them). SIGTERM drains:
//! no new task, the current one handed back, deregistered, exit 0. Losing the etcd lease
//! (cut off from etcd past the TTL) stops it with an error: the master has already given
//! its task to someone else.
//!
//! Compute threads follow candle's `RAYON_NUM_THREADS` (all cores by default).
//!
//! At the end it prints one JSON line with its totals (`--report FILE` writes the same).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::Args;
use edl_coord::{Lease, Registry};
use edl_master::client::{ClientConfig, MasterClient};
use edl_master::keys::Keys;
use edl_master::reader::{CloudReader, ReaderConfig};
use edl_pserver::{ClientConfig as PsClientConfig, PsClient};
use edl_trainer::runtime::{self, DRAIN_GRACE};
use edl_trainer::{
    DeviceChoice, Model, Progress, PsStore, PsStoreStats, RuntimeConfig, device_name, select_device,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry as PromRegistry;
use serde::Serialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::common::{EtcdArgs, JobArgs, runtime, shutdown_on_signals};
use crate::job::JobSpec;

/// Arguments of `edl trainer`.
#[derive(Debug, Args)]
pub struct TrainerArgs {
    /// etcd connection.
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// The job.
    #[command(flatten)]
    pub job: JobArgs,
    /// This trainer's id (default: `trainer-<pid>-<random>`).
    #[arg(long)]
    pub id: Option<String>,
    /// Compute device: auto (a GPU when one is usable), cpu, or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    /// Store this TOML job spec in etcd (if the job has none) instead of waiting for one.
    #[arg(long)]
    pub spec: Option<PathBuf>,
    /// How long to wait for the job spec to appear in etcd.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "60s")]
    pub spec_wait: Duration,
    /// TTL of the registration lease (default: the spec's `cluster.lease_ttl`).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub lease_ttl: Option<Duration>,
    /// Serve Prometheus metrics on this address (`GET /metrics`), e.g. 127.0.0.1:0.
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// Write the final totals (JSON) to this file.
    #[arg(long)]
    pub report: Option<PathBuf>,
}

/// The version of the trainer report JSON (docs/json.md). Bumped when a field changes
/// meaning or goes away; new fields may appear within a version.
pub const TRAINER_REPORT_VERSION: u32 = 1;

/// The trainer's final totals (printed as one JSON line).
#[derive(Debug, Serialize)]
pub struct TrainerReport {
    /// [`TRAINER_REPORT_VERSION`].
    pub version: u32,
    /// The trainer id.
    pub trainer: String,
    /// The device it computed on.
    pub device: String,
    /// Whether it initialised the parameters.
    pub initialised: bool,
    /// Tasks acknowledged.
    pub tasks: u64,
    /// Records trained in acknowledged tasks.
    pub records: u64,
    /// Gradient steps pushed.
    pub steps: u64,
    /// Tasks failed for bad data.
    pub failed_tasks: u64,
    /// Batches skipped for a non-finite loss.
    pub skipped_batches: u64,
    /// Drained by a signal instead of reaching the end of the job.
    pub drained: bool,
    /// Evaluation before this trainer's first step.
    pub initial_eval: Option<EvalReport>,
    /// Evaluations: one per pass this trainer saw end.
    pub evals: Vec<EvalReport>,
    /// Records of a task handed back on drain that had been trained (trained again
    /// elsewhere: counted as duplicates by the master).
    pub handed_back_trained: u64,
    /// Dense pulls and their bytes, sparse rows pulled, pushes.
    pub pulls: u64,
    /// Bytes of dense values pulled.
    pub pull_bytes: u64,
    /// Sparse pulls (one per table and batch).
    pub sparse_pulls: u64,
    /// Sparse rows pulled.
    pub sparse_rows: u64,
    /// The most rows one sparse pull asked for (never a whole table).
    pub max_sparse_rows: u64,
    /// Pushes applied.
    pub pushes: u64,
    /// Sync pushes moved to a later step.
    pub stale_pushes: u64,
    /// Sync pushes given up (the trainer then stops with an error).
    pub dropped_pushes: u64,
    /// Seconds it ran.
    pub wall_s: f64,
}

/// One evaluation.
#[derive(Debug, Serialize)]
pub struct EvalReport {
    /// The pass that ended.
    pub pass: u32,
    /// `accuracy`, `cost` or `loss`.
    pub metric: String,
    /// Its value on the test split.
    pub value: f64,
    /// Mean loss on the test split.
    pub loss: f64,
}

fn report(
    id: &str,
    device: &str,
    p: &Progress,
    s: &PsStoreStats,
    started: Instant,
) -> TrainerReport {
    TrainerReport {
        version: TRAINER_REPORT_VERSION,
        trainer: id.to_owned(),
        device: device.to_owned(),
        initialised: p.initialised,
        tasks: p.tasks,
        records: p.records,
        steps: p.steps,
        failed_tasks: p.failed_tasks,
        skipped_batches: p.skipped_batches,
        drained: p.drained,
        initial_eval: p.initial_eval.map(|(m, v, l)| EvalReport {
            pass: 0,
            metric: m.name().to_owned(),
            value: v,
            loss: l,
        }),
        handed_back_trained: p.handed_back_trained,
        evals: p
            .evals
            .iter()
            .map(|(pass, m, v, l)| EvalReport {
                pass: *pass,
                metric: m.name().to_owned(),
                value: *v,
                loss: *l,
            })
            .collect(),
        pulls: s.pulls.load(Ordering::Relaxed),
        pull_bytes: s.pull_bytes.load(Ordering::Relaxed),
        sparse_pulls: s.sparse_pulls.load(Ordering::Relaxed),
        sparse_rows: s.sparse_rows.load(Ordering::Relaxed),
        max_sparse_rows: s.max_sparse_rows.load(Ordering::Relaxed),
        pushes: s.pushes.load(Ordering::Relaxed),
        stale_pushes: s.stale_pushes.load(Ordering::Relaxed),
        dropped_pushes: s.dropped_pushes.load(Ordering::Relaxed),
        wall_s: started.elapsed().as_secs_f64(),
    }
}

fn render_metrics(job: &str, id: &str, device: &str, p: &Progress, s: &PsStoreStats) -> String {
    let mut reg = PromRegistry::with_prefix_and_labels(
        "edl_trainer",
        [
            ("job".into(), job.to_owned().into()),
            ("trainer".into(), id.to_owned().into()),
            ("device".into(), device.to_owned().into()),
        ]
        .into_iter(),
    );
    let counter = |reg: &mut PromRegistry, name: &str, help: &str, v: u64| {
        let c: Counter = Counter::default();
        c.inc_by(v);
        reg.register(name, help, c);
    };
    counter(&mut reg, "tasks", "Tasks acknowledged", p.tasks);
    counter(
        &mut reg,
        "records",
        "Records trained in acknowledged tasks",
        p.records,
    );
    counter(&mut reg, "steps", "Gradient steps pushed", p.steps);
    counter(
        &mut reg,
        "failed_tasks",
        "Tasks failed for bad data",
        p.failed_tasks,
    );
    counter(
        &mut reg,
        "skipped_batches",
        "Batches skipped for a non-finite loss",
        p.skipped_batches,
    );
    counter(
        &mut reg,
        "pulls",
        "Dense pulls",
        s.pulls.load(Ordering::Relaxed),
    );
    counter(
        &mut reg,
        "pull_bytes",
        "Bytes of dense values pulled",
        s.pull_bytes.load(Ordering::Relaxed),
    );
    counter(
        &mut reg,
        "sparse_rows",
        "Sparse rows pulled",
        s.sparse_rows.load(Ordering::Relaxed),
    );
    counter(
        &mut reg,
        "pushes",
        "Pushes applied",
        s.pushes.load(Ordering::Relaxed),
    );
    let g: Gauge<f64, std::sync::atomic::AtomicU64> = Gauge::default();
    g.set(p.samples_per_sec);
    reg.register(
        "samples_per_second",
        "Samples per second over the last task",
        g,
    );
    let g: Gauge<f64, std::sync::atomic::AtomicU64> = Gauge::default();
    g.set(f64::from(p.last_loss));
    reg.register("loss", "Loss of the last step", g);
    let g: Gauge = Gauge::default();
    g.set(i64::from(p.pass));
    reg.register("pass", "Pass of the current task", g);
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, &reg).is_err() {
        out.clear();
    }
    out
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Settings of one trainer (`edl trainer`, or a trainer inside `edl run`).
#[derive(Debug, Clone)]
pub struct TrainerOpts {
    /// The trainer id.
    pub id: String,
    /// Compute device.
    pub device: DeviceChoice,
    /// TTL of the registration lease.
    pub lease_ttl: Duration,
    /// Where to serve `/metrics`.
    pub metrics_addr: Option<SocketAddr>,
    /// The job token.
    pub token: Option<String>,
}

/// Runs `edl trainer`.
pub fn run(args: TrainerArgs) -> anyhow::Result<()> {
    args.job.validate()?;
    runtime()?.block_on(async move {
        let shutdown = shutdown_on_signals()?;
        let backend = args.etcd.connect().await?;
        let job = args.job.job.clone();
        let spec = match &args.spec {
            Some(path) => {
                let mut spec = JobSpec::load(path)?;
                anyhow::ensure!(
                    spec.name == job,
                    "--job {job} but the spec {} names job {}",
                    path.display(),
                    spec.name
                );
                spec.fit_stats()?;
                spec.check_data_fits_model()?;
                spec.publish(&backend).await?
            }
            None => match JobSpec::fetch(&backend, &job, args.spec_wait, &shutdown).await {
                Ok(spec) => spec,
                Err(_) if shutdown.is_cancelled() => {
                    tracing::info!("stopped while waiting for the job spec");
                    return Ok(());
                }
                Err(e) => return Err(e),
            },
        };
        let opts = TrainerOpts {
            id: args.id.clone().unwrap_or_else(|| {
                format!(
                    "trainer-{}-{:04x}",
                    std::process::id(),
                    rand::random::<u16>()
                )
            }),
            device: args.device,
            lease_ttl: args.lease_ttl.unwrap_or(spec.cluster.lease_ttl),
            metrics_addr: args.metrics_addr,
            token: args.job.token.clone(),
        };
        let rep = train(backend, spec, opts, shutdown).await?;
        let line = serde_json::to_string(&rep)?;
        println!("{line}");
        if let Some(path) = &args.report {
            std::fs::write(path, format!("{line}\n"))
                .with_context(|| format!("write {}", path.display()))?;
        }
        Ok(())
    })
}

/// Trains as one trainer of `spec`'s job until the job finishes (or `shutdown` drains it).
pub async fn train(
    backend: Arc<dyn edl_coord::Backend>,
    spec: JobSpec,
    opts: TrainerOpts,
    shutdown: CancellationToken,
) -> anyhow::Result<TrainerReport> {
    let started = Instant::now();
    let job = spec.name.clone();
    let id = opts.id.clone();
    let ttl = opts.lease_ttl;
    {
        let device = select_device(opts.device)?;
        let dev_name = device_name(&device);
        let model: Arc<dyn Model> = Arc::from(
            edl_trainer::build_on(&spec.model, &device, candle_core::DType::F32)
                .context("build the model")?,
        );
        let test = match &spec.data.test {
            Some(g) => Some(Arc::new(
                edl_trainer::load_samples(&g.patterns()).context("read the test split")?,
            )),
            None => None,
        };

        // Clients and the lease live until the drain is over: `shutdown` only starts it.
        let life = CancellationToken::new();
        let _life_guard = life.clone().drop_guard();
        let lease = Lease::grant(backend.clone(), ttl, life.child_token())
            .await
            .context("get an etcd lease")?;
        let registry = Registry::new(backend.clone(), Keys::new(&job).trainers());
        let info = serde_json::json!({
            "pid": std::process::id(),
            "device": dev_name,
            "started_ms": now_ms(),
            "metrics": opts.metrics_addr.map(|a| a.to_string()),
        });
        registry
            .register(&id, info.to_string().into_bytes(), &lease)
            .await
            .context("register the trainer")?;

        let mut mcfg = ClientConfig::new(&job);
        mcfg.token = opts.token.clone();
        let master = MasterClient::new(backend.clone(), mcfg, life.child_token());
        // SIGTERM while starting up: leave without having done anything.
        let drained_early = |registry: Registry, lease: Lease| {
            let (id, dev) = (id.clone(), dev_name.clone());
            async move {
                registry.deregister(&id, &lease).await.ok();
                lease.revoke().await.ok();
                tracing::info!(trainer = %id, "drained while starting");
                let p = Progress {
                    drained: true,
                    ..Progress::default()
                };
                Ok(report(&id, &dev, &p, &PsStoreStats::default(), started))
            }
        };
        let ds = tokio::select! {
            r = master.set_dataset(
                spec.data.train.patterns(),
                spec.data.chunks_per_task,
                spec.train.passes,
            ) => r.context("define the dataset at the master")?,
            _ = shutdown.cancelled() => return drained_early(registry, lease).await,
        };
        tracing::info!(
            trainer = %id,
            device = %dev_name,
            files = ds.files,
            tasks = ds.tasks,
            records = ds.records,
            "trainer registered"
        );

        let mut pcfg = PsClientConfig::new(&job);
        pcfg.token = opts.token.clone();
        let ps = tokio::select! {
            r = PsClient::connect(backend.clone(), pcfg, life.child_token()) => {
                r.context("find the pservers")?
            }
            _ = shutdown.cancelled() => return drained_early(registry, lease).await,
        };
        let store = Arc::new(PsStore::new(ps, spec.param_config(), spec.train.seed));
        let stats = store.stats();

        let (tx, rx) = watch::channel(Progress::default());
        if let Some(addr) = opts.metrics_addr {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("bind --metrics-addr {addr}"))?;
            let local = listener.local_addr()?;
            tracing::info!(addr = %local, "serving /metrics");
            let (rx, stats, job, id, dev) = (
                rx.clone(),
                stats.clone(),
                job.clone(),
                id.clone(),
                dev_name.clone(),
            );
            let app = axum::Router::new().route(
                "/metrics",
                axum::routing::get(move || {
                    let body = render_metrics(&job, &id, &dev, &rx.borrow(), &stats);
                    async move {
                        (
                            [(
                                axum::http::header::CONTENT_TYPE,
                                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                            )],
                            body,
                        )
                    }
                }),
            );
            let stop = life.clone();
            tokio::spawn(async move {
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async move { stop.cancelled().await })
                    .await;
            });
        }
        // Progress in the log, at most every 5 s.
        {
            let mut rx = rx.clone();
            let id = id.clone();
            tokio::spawn(async move {
                let mut last = Instant::now() - Duration::from_secs(60);
                while rx.changed().await.is_ok() {
                    if last.elapsed() < Duration::from_secs(5) {
                        continue;
                    }
                    last = Instant::now();
                    let p = rx.borrow().clone();
                    tracing::info!(
                        trainer = %id,
                        pass = p.pass,
                        tasks = p.tasks,
                        records = p.records,
                        steps = p.steps,
                        loss = p.last_loss,
                        samples_per_s = format!("{:.0}", p.samples_per_sec),
                        "progress"
                    );
                }
            });
        }

        let mut rcfg = RuntimeConfig::new(&id);
        rcfg.batch_size = spec.train.batch_size;
        rcfg.seed = spec.train.seed;
        rcfg.test = test;
        rcfg.eval_batch_size = spec.train.eval_batch_size;
        let reader = CloudReader::start(master, ReaderConfig::new(&id));
        let stop = CancellationToken::new();
        let lost = lease.lost();
        let watcher = {
            let (stop, shutdown, lost) = (stop.clone(), shutdown.clone(), lost.clone());
            tokio::spawn(async move {
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = lost.cancelled() => {}
                }
                stop.cancel();
            })
        };
        let run = runtime::run(reader, model, store.clone() as _, rcfg, stop.clone(), tx);
        tokio::pin!(run);
        let result = tokio::select! {
            r = &mut run => r,
            _ = async {
                stop.cancelled().await;
                tokio::time::sleep(DRAIN_GRACE).await;
            } => {
                anyhow::bail!("the trainer did not drain within {DRAIN_GRACE:?}; exiting")
            }
        };
        watcher.abort();
        let progress = match result {
            Ok(p) => p,
            Err(e) => {
                registry.deregister(&id, &lease).await.ok();
                lease.revoke().await.ok();
                return Err(e).with_context(|| format!("trainer {id} failed"));
            }
        };
        // Let the others' sync steps go on without this trainer.
        use edl_trainer::ParamStore;
        if let Err(e) = store.idle(&id).await {
            tracing::debug!(error = %e, "leave the sync steps");
        }
        let lease_lost = lost.is_cancelled() && !shutdown.is_cancelled();
        registry.deregister(&id, &lease).await.ok();
        lease.revoke().await.ok();
        let rep = report(&id, &dev_name, &progress, &stats, started);
        anyhow::ensure!(
            !lease_lost,
            "lost the etcd lease (cut off from etcd for longer than {ttl:?}); stopped"
        );
        tracing::info!(trainer = %id, drained = progress.drained, "trainer done");
        Ok(rep)
    }
}
