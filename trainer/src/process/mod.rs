//! The trainer process: one elastic trainer of a job, from joining to leaving.
//!
//! [`run`] reads the job's spec from etcd, builds the model on the chosen device, joins
//! the job ([`Session`]: a lease, the registration under `trainers/<id>`, a master
//! client), defines the dataset at the master (idempotent), connects to the pservers and
//! trains through the master's `cloud_reader` (exactly one trainer initialises the
//! parameters). `shutdown` drains: no new task, the current one handed back,
//! deregistered, a report returned. Losing the etcd lease (etcd ended it: the trainer
//! was cut off or paused past the TTL) stops it with [`TrainerError::LeaseLost`]: the
//! master has already given its task to someone else. An etcd outage does not: the
//! trainer waits it out. Every etcd step of the startup (the spec, the lease, the
//! registration) retries an unavailable etcd for up to [`TrainerConfig::etcd_wait`].
//! The model comes from a [`ModelSource`]: the spec's built-in `[model]`, or a model of
//! the caller's own. [`evaluate_job`] evaluates a job's parameters with a model (the
//! final evaluation of `edl run`). [`crate::Trainer`] (the public one-call API), `edl
//! trainer` and the in-memory `edl run` are thin callers of these.
//!
//! # Layout
//!
//! - this module: [`TrainerConfig`], [`ModelSource`], [`TrainerError`], [`run`] and
//!   [`evaluate_job`].
//! - `member.rs`: [`Member`], a trainer that joined its job (the session, the dataset,
//!   the pservers, `/metrics`) until it leaves with its report: what [`run`] and the
//!   Python package's trainer train through.
//! - [`session`]: [`Session`], the membership shared with `edl consume`.
//! - [`report`]: [`TrainerReport`], the final totals (docs/json.md).
//! - `metrics.rs`: the `/metrics` endpoint.

mod member;
mod metrics;
pub mod report;
pub mod session;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Device;
use edl_coord::Backend;
use edl_job::{JobName, JobSpec, SpecError};
use edl_master_client::ClientError;
use edl_pserver_client::{PsClient, PsClientConfig, PsClientError};
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};

pub use member::{Joined, Member};
pub use report::{EvalReport, TRAINER_REPORT_VERSION, TrainerReport};
pub use session::{Session, SessionConfig, SessionError};

use crate::runtime::{self, DRAIN_GRACE};
use crate::{DeviceChoice, MetricKind, Model, ParamStore, Progress, PsStore, RuntimeError};

/// What a model is built from: the job's spec and the trainer's device.
#[derive(Debug, Clone, Copy)]
pub struct ModelContext<'a> {
    spec: &'a JobSpec,
    device: &'a Device,
}

impl<'a> ModelContext<'a> {
    /// The job's spec (its `[train]` settings, its data, its `[model]` if any).
    pub fn spec(&self) -> &'a JobSpec {
        self.spec
    }

    /// The device the model computes on (`EDL_DEVICE`, `--device`): build the model's
    /// tensors there.
    pub fn device(&self) -> &'a Device {
        self.device
    }

    /// The job's seed (`train.seed`): the same in every trainer.
    pub fn seed(&self) -> u64 {
        self.spec.train.seed
    }
}

type BuildModel = dyn FnOnce(&ModelContext<'_>) -> crate::Result<Arc<dyn Model>> + Send;

/// Where a trainer's model comes from, once the job's spec and the device are known.
pub struct ModelSource(Box<BuildModel>);

impl std::fmt::Debug for ModelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ModelSource")
    }
}

impl ModelSource {
    /// The spec's built-in `[model]` (what `edl trainer` trains); an error when the
    /// spec has none (its trainers are `entry` programs).
    pub fn builtin() -> ModelSource {
        ModelSource(Box::new(|ctx| {
            let spec = ctx.spec.model.as_ref().ok_or_else(|| {
                crate::Error::Model(format!(
                    "job {} names no built-in [model]: its trainers are the programs of \
                     [trainer] entry, not `edl trainer`",
                    ctx.spec.name
                ))
            })?;
            Ok(Arc::from(crate::build_on(
                spec,
                ctx.device,
                candle_core::DType::F32,
            )?))
        }))
    }

    /// A model of the caller's own, built by `build`.
    pub fn new<M: Model + 'static>(
        build: impl FnOnce(&ModelContext<'_>) -> crate::Result<M> + Send + 'static,
    ) -> ModelSource {
        ModelSource(Box::new(move |ctx| Ok(Arc::new(build(ctx)?))))
    }

    /// Builds the model.
    pub fn build(self, spec: &JobSpec, device: &Device) -> crate::Result<Arc<dyn Model>> {
        (self.0)(&ModelContext { spec, device })
    }
}

/// Settings of one trainer process.
#[derive(Debug, Clone)]
pub struct TrainerConfig {
    /// The job.
    pub job: JobName,
    /// The trainer id (default `trainer-<pid>-<random>`).
    pub id: String,
    /// Compute device.
    pub device: DeviceChoice,
    /// TTL of the registration lease (default: the spec's `cluster.lease_ttl`).
    pub lease_ttl: Option<Duration>,
    /// Where to serve `/metrics`.
    pub metrics_addr: Option<SocketAddr>,
    /// The job token.
    pub token: Option<String>,
    /// The token a `/metrics` scrape must carry instead of the job token.
    pub metrics_token: Option<String>,
    /// Dial masters and pservers over TLS; `None`: plain.
    pub tls: Option<edl_proto::tls::Tls>,
    /// How long to wait for the job spec to appear in etcd.
    pub spec_wait: Duration,
    /// How long each startup step keeps retrying an unreachable etcd.
    pub etcd_wait: Duration,
}

impl TrainerConfig {
    /// Defaults for a trainer of `job`: a fresh id, the `auto` device, the spec's lease
    /// TTL, no metrics, no token, 60 s for the spec to appear, 2 minutes of etcd retries.
    pub fn new(job: JobName) -> Self {
        TrainerConfig {
            job,
            id: format!(
                "trainer-{}-{:04x}",
                std::process::id(),
                rand::random::<u16>()
            ),
            device: DeviceChoice::Auto,
            lease_ttl: None,
            metrics_addr: None,
            token: None,
            metrics_token: None,
            tls: None,
            spec_wait: Duration::from_secs(60),
            etcd_wait: edl_coord::DEFAULT_STARTUP_WAIT,
        }
    }

    /// How this trainer reaches its job's pservers outside its training loop (to
    /// evaluate the job's parameters): its token and TLS, retrying for 20 s.
    pub fn pserver_client(&self) -> PsClientConfig {
        let mut cfg = PsClientConfig::new(self.job.clone());
        cfg.retry_for = Duration::from_secs(20);
        cfg.token = self.token.clone();
        cfg.tls = self.tls.clone();
        cfg
    }
}

/// Why a trainer stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    /// Stopped (`shutdown`) before it joined the job: nothing was done.
    #[error("stopped while starting")]
    StoppedBeforeStart,
    /// The job spec could not be read.
    #[error("{0}")]
    Spec(SpecError),
    /// The model could not be built on the device.
    #[error("build the model: {0}")]
    Model(crate::Error),
    /// The held-out split could not be read.
    #[error("read the test split: {0}")]
    TestSplit(crate::Error),
    /// Joining the job failed.
    #[error("{0}")]
    Join(SessionError),
    /// The master refused or could not be reached to define the dataset.
    #[error("define the dataset at the master: {0}")]
    Dataset(ClientError),
    /// No pservers were found.
    #[error("find the pservers: {0}")]
    Pservers(PsClientError),
    /// The metrics address could not be bound.
    #[error("bind --metrics-addr {addr}: {error}")]
    Metrics {
        /// The address.
        addr: SocketAddr,
        /// Why.
        error: std::io::Error,
    },
    /// Training failed.
    #[error("trainer {id} failed: {error}")]
    Runtime {
        /// The trainer.
        id: String,
        /// Why.
        error: RuntimeError,
    },
    /// A drain took longer than [`DRAIN_GRACE`].
    #[error("the trainer did not drain within {DRAIN_GRACE:?}; exiting")]
    DrainTimeout,
    /// The etcd lease was lost.
    #[error(
        "lost the etcd lease (etcd ended it: this trainer was cut off from etcd or paused for longer than its ttl, {ttl:?}); stopped"
    )]
    LeaseLost {
        /// The lease's TTL.
        ttl: Duration,
    },
}

/// Runs one trainer of `cfg.job`, training the model of `model`, until the job finishes
/// (or `shutdown` drains it).
pub async fn run(
    backend: Arc<dyn Backend>,
    cfg: TrainerConfig,
    model: ModelSource,
    shutdown: CancellationToken,
) -> Result<TrainerReport, TrainerError> {
    let started = Instant::now();
    let spec = fetch_spec(&backend, &cfg, &shutdown).await?;
    let device = crate::select_device(cfg.device).map_err(TrainerError::Model)?;
    let model = model.build(&spec, &device).map_err(TrainerError::Model)?;
    let test = match &spec.data.test {
        Some(g) => Some(Arc::new(
            crate::load_records(&g.patterns()).map_err(TrainerError::TestSplit)?,
        )),
        None => None,
    };
    let dev_name = crate::device_name(&device);
    let member = match Member::join(backend, &cfg, spec, &dev_name, started, &shutdown).await? {
        Joined::Member(m) => m,
        Joined::Drained(report) => return Ok(report),
    };
    let rcfg = crate::job::runtime_config(member.spec(), member.id(), test);
    let stop = member.stop_on(&shutdown);
    let run = runtime::run(
        member.reader(),
        model,
        member.store() as _,
        rcfg,
        stop.clone(),
        member.progress(),
    );
    tokio::pin!(run);
    let result = tokio::select! {
        r = &mut run => r,
        _ = async {
            stop.cancelled().await;
            tokio::time::sleep(DRAIN_GRACE).await;
        } => {
            return Err(TrainerError::DrainTimeout);
        }
    };
    match result {
        Ok(progress) => member.leave(&progress, &shutdown).await,
        Err(error) => {
            let id = member.id().to_owned();
            member.abandon().await;
            Err(TrainerError::Runtime { id, error })
        }
    }
}

/// Reads the job's spec from etcd (waiting up to `cfg.spec_wait` for it to appear).
pub async fn fetch_spec(
    backend: &Arc<dyn Backend>,
    cfg: &TrainerConfig,
    shutdown: &CancellationToken,
) -> Result<JobSpec, TrainerError> {
    match JobSpec::fetch(backend, &cfg.job, cfg.spec_wait, cfg.etcd_wait, shutdown).await {
        Ok(spec) => Ok(spec),
        Err(SpecError::Cancelled) => Err(TrainerError::StoppedBeforeStart),
        Err(e) => Err(TrainerError::Spec(e)),
    }
}

/// An evaluation of a job's parameters ([`evaluate_job`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct JobEval {
    /// The metric (the model's).
    pub metric: MetricKind,
    /// Its value.
    pub value: f64,
    /// The mean loss.
    pub loss: f64,
    /// The split evaluated: `test`, or `train` when the job has no held-out split.
    pub split: String,
    /// Records evaluated.
    pub records: u64,
}

/// Why [`evaluate_job`] failed.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// The split could not be read.
    #[error("read the {split} split: {error}")]
    Data {
        /// `test` or `train`.
        split: &'static str,
        /// Why.
        error: crate::Error,
    },
    /// The pservers could not be reached.
    #[error("connect to the pservers: {0}")]
    Pservers(PsClientError),
    /// Pulling or evaluating failed.
    #[error("evaluate: {0}")]
    Evaluate(RuntimeError),
}

/// Evaluates the job's parameters as the pservers hold them now (the final ones once the
/// job finished) with `model`, on the held-out split, else the training split. The
/// pservers are reached with `cfg` (token, TLS, how long to retry).
pub async fn evaluate_job(
    backend: Arc<dyn Backend>,
    spec: &JobSpec,
    model: Arc<dyn Model>,
    cfg: PsClientConfig,
) -> Result<JobEval, EvalError> {
    let (split, globs) = match &spec.data.test {
        Some(t) => ("test", t.patterns()),
        None => ("train", spec.data.train.patterns()),
    };
    let records =
        Arc::new(crate::load_records(&globs).map_err(|error| EvalError::Data { split, error })?);
    let (store, _life) = connect_store(backend, spec, cfg)
        .await
        .map_err(EvalError::Pservers)?;
    let store: Arc<dyn ParamStore> = store;
    let mut params = crate::Params::default();
    let eval = async {
        store.pull_dense(&mut params).await?;
        runtime::evaluate(
            &model,
            &store,
            &mut params,
            &records,
            spec.train.eval_batch_size,
        )
        .await
    }
    .await
    .map_err(EvalError::Evaluate)?;
    let metric = model.metric();
    Ok(JobEval {
        metric,
        value: metric.value(&eval),
        loss: eval.mean_loss(),
        split: split.into(),
        records: eval.count,
    })
}

/// The job's parameters as its pservers hold them, for evaluating them: a store over a
/// pserver client of its own, alive as long as the guard.
pub async fn connect_store(
    backend: Arc<dyn Backend>,
    spec: &JobSpec,
    cfg: PsClientConfig,
) -> Result<(Arc<PsStore>, DropGuard), PsClientError> {
    let life = CancellationToken::new();
    let client = PsClient::connect(backend, cfg, life.child_token()).await?;
    let store = PsStore::new(client, crate::job::param_config(spec), spec.train.seed);
    Ok((Arc::new(store), life.drop_guard()))
}

/// Progress in the log, at most every 5 s.
fn log_progress(mut rx: watch::Receiver<Progress>, id: String) {
    tokio::spawn(tracing::Instrument::in_current_span(async move {
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
    }));
}
