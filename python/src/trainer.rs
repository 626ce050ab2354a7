//! `Trainer` and `Task`: a Python program as one elastic trainer of a job.
//!
//! A `Trainer` in train mode is a [`Member`] of its job (lease, registration, dataset,
//! pservers, `/metrics`) with its [`Tasks`]; the Python loop asks for the next item
//! (`_next`: a task, a pass end, the job's end, a drain) and says how each task went
//! (`Task.done`, `hand_back`, `fail`), exactly as the built-in loop does. In evaluate
//! mode (`EDL_MODE=evaluate`, the final evaluation `edl run` asks an entry program for)
//! it only reads the job's spec and connects to the pservers.
//!
//! SIGTERM (when asked to handle it, as `from_env` does) starts a drain: the next `_next`
//! says `drained`, a task being trained notices (`Trainer.draining`) and is handed back;
//! a second SIGTERM exits at once. A trainer whose lease etcd ended stops the same way
//! and `close` raises `LeaseLostError`.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::time::{Duration, Instant, SystemTime};

use edl_job::{JobName, JobSpec};
use edl_trainer::app::{self, AppError, RunMode, env};
use edl_trainer::process::{self, JobEval, Joined, Member, TrainerError, TrainerReport};
use edl_trainer::{
    DeviceChoice, MetricKind, Next, Progress, PsStore, RuntimeError, StoreError, Tasks,
};
use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::task::Task;
use crate::{ConnectError, EdlError, LeaseLostError, block_on, runtime, value_error};

/// What the Python loop adds to a trainer's progress: its pushes and evaluations.
#[derive(Debug, Default)]
pub(crate) struct Steps {
    /// This trainer's values initialised the job's parameters.
    pub(crate) initialised: bool,
    pub(crate) steps: u64,
    pub(crate) last_loss: f32,
    pub(crate) first: Option<SystemTime>,
    pub(crate) last: Option<SystemTime>,
    pub(crate) evals: Vec<(u32, MetricKind, f64, f64)>,
}

impl Steps {
    /// One push made.
    pub(crate) fn pushed(&mut self, loss: Option<f32>) {
        let now = SystemTime::now();
        self.steps += 1;
        self.first.get_or_insert(now);
        self.last = Some(now);
        if let Some(l) = loss {
            self.last_loss = l;
        }
    }

    pub(crate) fn merge_into(&self, p: &mut Progress) {
        p.initialised |= self.initialised;
        p.steps = self.steps;
        p.last_loss = self.last_loss;
        p.first_step_at = self.first;
        p.last_step_at = self.last;
        p.evals.clone_from(&self.evals);
    }
}

/// The trainer's state behind the Python objects.
#[derive(Debug)]
pub(crate) struct Loop {
    pub(crate) member: Option<Member>,
    pub(crate) tasks: Option<Tasks>,
    /// Drained before training began: the report to give.
    early: Option<TrainerReport>,
    /// The report line, once closed.
    closed: Option<String>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    id: String,
    /// `cpu` or `cuda:N`.
    device: String,
    job: JobName,
    mode: RunMode,
    report: Option<PathBuf>,
    spec: JobSpec,
    spec_json: String,
    pub(crate) store: Arc<PsStore>,
    shutdown: CancellationToken,
    /// `shutdown`, or the lease lost.
    stop: CancellationToken,
    pub(crate) state: tokio::sync::Mutex<Loop>,
    /// Interrupts a `_next` waiting with `state` held, so that `lock_state` gets it.
    wake: tokio::sync::Notify,
    /// Tasks handed out by `_next` and not yet done, handed back or failed.
    pub(crate) in_hand: AtomicUsize,
    pub(crate) steps: Mutex<Steps>,
    /// Keeps the evaluation mode's pserver client alive.
    _life: Option<DropGuard>,
}

impl Inner {
    pub(crate) fn id(&self) -> &str {
        &self.id
    }

    pub(crate) fn evaluating(&self) -> bool {
        self.mode == RunMode::Evaluate
    }

    pub(crate) fn steps(&self) -> std::sync::MutexGuard<'_, Steps> {
        self.steps.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The trainer's state, taken from a `_next` that waits for a task with it held
    /// (another thread feeds the tasks it takes to a training loop, which says here how
    /// they went): the lock is fair, so this call queues first and then interrupts
    /// the wait, which gives the lock up and queues behind it.
    pub(crate) async fn lock_state(&self) -> tokio::sync::MutexGuard<'_, Loop> {
        if let Ok(guard) = self.state.try_lock() {
            return guard;
        }
        let lock = self.state.lock();
        tokio::pin!(lock);
        let first = std::future::poll_fn(|cx| Poll::Ready(lock.as_mut().poll(cx))).await;
        if let Poll::Ready(guard) = first {
            return guard;
        }
        self.wake.notify_one();
        lock.await
    }
}

/// A trainer error as a Python exception.
pub(crate) fn trainer_error(e: TrainerError) -> PyErr {
    match e {
        TrainerError::LeaseLost { .. } => LeaseLostError::new_err(e.to_string()),
        TrainerError::Join(_) | TrainerError::Pservers(_) | TrainerError::Dataset(_) => {
            ConnectError::new_err(e.to_string())
        }
        TrainerError::Runtime { error, .. } => runtime_error(error),
        other => EdlError::new_err(other.to_string()),
    }
}

/// A runtime error (the master, the store) as a Python exception.
pub(crate) fn runtime_error(e: RuntimeError) -> PyErr {
    match e {
        RuntimeError::Store(s) => store_error(s),
        RuntimeError::Master(c) => ConnectError::new_err(format!("master: {c}")),
        RuntimeError::Model(m) => EdlError::new_err(m.to_string()),
    }
}

/// A parameter store error as a Python exception: a refusal is the caller's input
/// (`ValueError`), an unavailable store `ConnectError`.
pub(crate) fn store_error(e: StoreError) -> PyErr {
    match e {
        StoreError::Refused(m) => value_error(format!("the pservers refused: {m}")),
        StoreError::Unavailable(m) => ConnectError::new_err(m),
        other => EdlError::new_err(other.to_string()),
    }
}

fn app_error(e: AppError) -> PyErr {
    match e {
        AppError::Config(c) => value_error(c.to_string()),
        AppError::Etcd(m) => ConnectError::new_err(m),
        AppError::Trainer(t) => trainer_error(*t),
        other => EdlError::new_err(other.to_string()),
    }
}

/// How a keyword's value becomes its variable's text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The value's `str()`.
    Text,
    /// A number of seconds, as a duration.
    Seconds,
}

/// The keyword arguments of `Trainer(...)`: each is a variable of the environment
/// contract (docs/trainer-api.md), parsed by the trainer API as `from_env` parses the
/// environment. Times are seconds.
const SETTINGS: &[(&str, &str, Kind)] = &[
    ("id", env::TRAINER_ID, Kind::Text),
    ("device", env::DEVICE, Kind::Text),
    ("token", env::TOKEN, Kind::Text),
    ("metrics_token", env::METRICS_TOKEN, Kind::Text),
    ("lease_ttl", env::LEASE_TTL, Kind::Seconds),
    ("etcd_wait", env::ETCD_WAIT, Kind::Seconds),
    ("spec_wait", env::SPEC_WAIT, Kind::Seconds),
    ("metrics_addr", env::METRICS_ADDR, Kind::Text),
    ("report", env::REPORT, Kind::Text),
    ("etcd_user", env::ETCD_USER, Kind::Text),
    ("etcd_password", env::ETCD_PASSWORD, Kind::Text),
    ("etcd_ca", env::ETCD_CA, Kind::Text),
    ("etcd_cert", env::ETCD_CERT, Kind::Text),
    ("etcd_key", env::ETCD_KEY, Kind::Text),
    ("etcd_domain", env::ETCD_DOMAIN, Kind::Text),
    ("tls_ca", env::TLS_CA, Kind::Text),
    ("tls_cert", env::TLS_CERT, Kind::Text),
    ("tls_key", env::TLS_KEY, Kind::Text),
    ("tls_domain", env::TLS_DOMAIN, Kind::Text),
];

/// The settings of `Trainer(job, etcd, **settings)` as the environment contract's
/// variables: strings as they are, seconds as a duration, `evaluate` as the mode.
fn contract_vars(
    job: &str,
    etcd: &[String],
    settings: Option<&Bound<'_, PyDict>>,
) -> PyResult<HashMap<&'static str, String>> {
    let mut vars = HashMap::from([(env::JOB, job.to_owned()), (env::ETCD, etcd.join(","))]);
    let Some(settings) = settings else {
        return Ok(vars);
    };
    for (key, value) in settings.iter() {
        let key: String = key.extract()?;
        if value.is_none() {
            continue;
        }
        if key == "evaluate" {
            if value.extract::<bool>()? {
                vars.insert(env::MODE, "evaluate".into());
            }
            continue;
        }
        let Some(&(_, var, kind)) = SETTINGS.iter().find(|(k, ..)| *k == key) else {
            return Err(PyTypeError::new_err(format!(
                "Trainer() got an unexpected keyword argument {key:?}"
            )));
        };
        let text = if kind == Kind::Seconds {
            let secs: f64 = value.extract()?;
            let d = Duration::try_from_secs_f64(secs).map_err(|_| {
                value_error(format!(
                    "{key} must be a non-negative number of seconds, not {secs}"
                ))
            })?;
            format!("{}ns", d.as_nanos())
        } else {
            value.str()?.to_string()
        };
        vars.insert(var, text);
    }
    Ok(vars)
}

/// A Python program as one elastic trainer of an edl job.
#[pyclass(module = "edl._edl", frozen)]
#[derive(Debug)]
pub struct Trainer {
    pub(crate) inner: Arc<Inner>,
}

#[pymethods]
impl Trainer {
    /// Joins `job` on the etcd at `etcd` (client URLs); `settings` are those of the
    /// environment contract by their keyword names (see `SETTINGS`), and `spec` a TOML
    /// job spec to store when the job has none.
    #[new]
    #[pyo3(signature = (job, etcd, *, spec=None, handle_sigterm=false, **settings))]
    fn new(
        py: Python<'_>,
        job: &str,
        etcd: Vec<String>,
        spec: Option<PathBuf>,
        handle_sigterm: bool,
        settings: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Trainer> {
        if etcd.is_empty() {
            return Err(value_error("etcd: give at least one client URL"));
        }
        let vars = contract_vars(job, &etcd, settings)?;
        let mut t = app::Trainer::from_vars(|k| vars.get(k).cloned())
            .map_err(|e| value_error(e.to_string()))?;
        if let Some(path) = spec {
            let spec = edl_trainer::job::load(&path).map_err(|e| value_error(e.to_string()))?;
            if spec.name != t.config().job {
                return Err(value_error(format!(
                    "{} is the spec of job {}, not of {}",
                    path.display(),
                    spec.name,
                    t.config().job
                )));
            }
            t = t.publish_spec(spec);
        }
        start(py, t, handle_sigterm)
    }

    /// The trainer `edl run` starts for `[trainer] entry`: configured by the environment
    /// (EDL_ETCD, EDL_JOB, EDL_TRAINER_ID, ...; docs/trainer-api.md). SIGTERM drains it.
    /// `device` (`cpu`, `cuda:N`), when given, stands for EDL_DEVICE's `auto`: what the
    /// program's framework resolved it to (`edl.Trainer.from_env` asks PyTorch).
    #[staticmethod]
    #[pyo3(signature = (*, handle_sigterm=true, device=None))]
    fn from_env(py: Python<'_>, handle_sigterm: bool, device: Option<&str>) -> PyResult<Trainer> {
        let mut t = app::Trainer::from_env().map_err(|e| value_error(e.to_string()))?;
        if let Some(d) = device
            && t.config().device == DeviceChoice::Auto
        {
            t = t.device(d.parse().map_err(value_error)?);
        }
        start(py, t, handle_sigterm)
    }

    /// This trainer's id.
    #[getter]
    fn id(&self) -> &str {
        &self.inner.id
    }

    /// The device the model computes on, as the trainer registered it: `cpu` or
    /// `cuda:N` (`auto` that nothing resolved reads as `cpu`).
    #[getter]
    fn device(&self) -> &str {
        &self.inner.device
    }

    /// The job's name.
    #[getter]
    fn job(&self) -> &str {
        self.inner.job.as_str()
    }

    /// `train`, or `evaluate` (evaluate the job's parameters once and report).
    #[getter]
    fn mode(&self) -> &'static str {
        match self.inner.mode {
            RunMode::Train => "train",
            RunMode::Evaluate => "evaluate",
        }
    }

    /// The job's spec as JSON (`edl.Trainer.spec` parses it).
    #[getter]
    fn spec_json(&self) -> &str {
        &self.inner.spec_json
    }

    /// Whether the trainer is draining (SIGTERM, `stop()`, or its lease lost): finish
    /// the step at hand and hand the task back.
    #[getter]
    fn draining(&self) -> bool {
        self.inner.shutdown.is_cancelled() || self.inner.stop.is_cancelled()
    }

    /// Starts a drain, as SIGTERM does (at once: `draining` holds on return).
    fn stop(&self) {
        self.inner.shutdown.cancel();
        self.inner.stop.cancel();
    }

    /// The next item of the task stream: `("task", Task)`, `("pass", ended, next)`,
    /// `("job",)` (every pass done), `("drained",)` or `("closed",)`.
    fn _next(&self, py: Python<'_>) -> PyResult<Py<PyTuple>> {
        let inner = self.inner.clone();
        let next = block_on(py, async move {
            loop {
                let mut st = inner.state.lock().await;
                if st.closed.is_some() {
                    return Ok(None);
                }
                let Some(tasks) = st.tasks.as_mut() else {
                    return Ok(Some(Next::Closed));
                };
                // Idle (sync mode: out of the steps) only while no task of this trainer
                // is being trained; interrupted by `lock_state` (then the loop waits on).
                let idle = inner.in_hand.load(Ordering::SeqCst) == 0;
                if let Some(next) = tasks
                    .next_unless(&inner.stop, inner.wake.notified(), idle)
                    .await?
                {
                    return Ok(Some(next));
                }
            }
        })?
        .map_err(runtime_error)?;
        let item = match next {
            None | Some(Next::Closed) => PyTuple::new(py, ["closed"])?,
            Some(Next::Drained) => PyTuple::new(py, ["drained"])?,
            Some(Next::JobFinished) => PyTuple::new(py, ["job"])?,
            Some(Next::PassFinished { ended, next }) => ("pass", ended, next).into_pyobject(py)?,
            Some(Next::Task(t)) => {
                let task = Task::new(self.inner.clone(), t.task, t.records);
                ("task", Py::new(py, task)?).into_pyobject(py)?
            }
        };
        Ok(item.unbind())
    }

    /// Declares the model's parameters and makes sure the job's pservers hold them (the
    /// one-trainer initialisation; see `Params`).
    #[pyo3(signature = (dense, sparse=None))]
    fn _params(
        &self,
        py: Python<'_>,
        dense: Bound<'_, pyo3::types::PyDict>,
        sparse: Option<Bound<'_, pyo3::types::PyDict>>,
    ) -> PyResult<crate::params::Params> {
        crate::params::declare(self, py, dense, sparse)
    }

    /// Records an evaluation of pass `pass_` in the report: `metric` is `accuracy`,
    /// `cost` or `loss`.
    fn record_evaluation(&self, pass_: u32, metric: &str, value: f64, loss: f64) -> PyResult<()> {
        let metric = parse_metric(metric)?;
        self.inner.steps().evals.push((pass_, metric, value, loss));
        Ok(())
    }

    /// The records of the split the evaluation mode evaluates: `(split, records)`, the
    /// held-out split when the job has one, else the training split.
    fn evaluation_records<'py>(&self, py: Python<'py>) -> PyResult<(String, Bound<'py, PyList>)> {
        let (split, globs) = match &self.inner.spec.data.test {
            Some(t) => ("test", t.patterns()),
            None => ("train", self.inner.spec.data.train.patterns()),
        };
        let records = py
            .detach(|| edl_trainer::load_records(&globs))
            .map_err(|e| EdlError::new_err(format!("read the {split} split: {e}")))?;
        let list = PyList::new(py, records.iter().map(|r| PyBytes::new(py, r)))?;
        Ok((split.into(), list))
    }

    /// Reports the evaluation (evaluate mode): prints it as one JSON line and writes it
    /// to EDL_REPORT, where `edl run` reads it. Returns the line.
    fn report_evaluation(
        &self,
        metric: &str,
        value: f64,
        loss: f64,
        split: String,
        records: u64,
    ) -> PyResult<String> {
        let eval = JobEval {
            metric: parse_metric(metric)?,
            value,
            loss,
            split,
            records,
        };
        let line = serde_json::to_string(&eval).map_err(|e| EdlError::new_err(e.to_string()))?;
        app::emit_report(&line, self.inner.report.as_deref()).map_err(app_error)?;
        Ok(line)
    }

    /// Leaves the job: the acknowledgement in flight settled, out of the sync steps,
    /// deregistered, the lease revoked; prints the report as one JSON line, writes it to
    /// EDL_REPORT, and returns it. Idempotent. `LeaseLostError` if etcd ended the lease.
    fn close(&self, py: Python<'_>) -> PyResult<String> {
        let inner = self.inner.clone();
        block_on(py, async move {
            let mut st = inner.lock_state().await;
            if let Some(line) = &st.closed {
                return Ok(line.clone());
            }
            let report = match (st.early.take(), st.member.take()) {
                (Some(report), _) => Some(report),
                (None, Some(member)) => {
                    let mut progress = match st.tasks.take() {
                        Some(tasks) => tasks.close().await.map_err(runtime_error)?,
                        None => Progress::default(),
                    };
                    inner.steps().merge_into(&mut progress);
                    member.progress().send_replace(progress.clone());
                    match member.leave(&progress, &inner.shutdown).await {
                        Ok(r) => Some(r),
                        Err(e) => {
                            st.closed = Some(String::new());
                            return Err(trainer_error(e));
                        }
                    }
                }
                (None, None) => None,
            };
            let line = match report {
                Some(r) => serde_json::to_string(&r).unwrap_or_default(),
                None => String::new(),
            };
            st.closed = Some(line.clone());
            if !line.is_empty() {
                app::emit_report(&line, inner.report.as_deref()).map_err(app_error)?;
            }
            Ok(line)
        })?
    }

    /// Leaves the job after an error, without a report: deregistered, the lease revoked
    /// (its task goes back to the queue at once).
    fn abandon(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.inner.clone();
        block_on(py, async move {
            let mut st = inner.lock_state().await;
            st.tasks = None;
            if let Some(m) = st.member.take() {
                m.abandon().await;
            }
            st.closed.get_or_insert_with(String::new);
        })
    }
}

/// Starts as every trainer does ([`app::Trainer::connect_job`]: etcd, waiting out an
/// outage, and the spec stored when given), reads the job's spec, and joins (train mode)
/// or connects to the pservers (evaluate mode). The model runs in Python: the device is
/// only its name in the registry and the report (`auto` reads as `cpu`; the Python
/// layer resolves `auto` with PyTorch first, when the program imported it).
fn start(py: Python<'_>, t: app::Trainer, handle_sigterm: bool) -> PyResult<Trainer> {
    edl_role::init_logging();
    let rt = runtime()?;
    let shutdown = CancellationToken::new();
    if handle_sigterm {
        let _enter = rt.enter();
        drain_on_sigterm(shutdown.clone())
            .map_err(|e| PyRuntimeError::new_err(format!("handle SIGTERM: {e}")))?;
    }
    let cfg = t.config().clone();
    let device = match cfg.device {
        DeviceChoice::Auto => DeviceChoice::Cpu.to_string(),
        d => d.to_string(),
    };
    let device_name = device.clone();
    let (id, job) = (cfg.id.clone(), cfg.job.clone());
    let mode = t.run_mode();
    let report = t.report_path().map(PathBuf::from);
    let sd = shutdown.clone();
    let joined = block_on(py, async move {
        let started = Instant::now();
        let stopped = || EdlError::new_err("stopped (SIGTERM) while starting");
        let backend = t
            .connect_job(&sd)
            .await
            .map_err(app_error)?
            .ok_or_else(stopped)?;
        let spec = match process::fetch_spec(&backend, &cfg, &sd).await {
            Ok(s) => s,
            Err(TrainerError::StoppedBeforeStart) => return Err(stopped()),
            Err(e) => return Err(trainer_error(e)),
        };
        let idle = Loop {
            member: None,
            tasks: None,
            early: None,
            closed: None,
        };
        if mode == RunMode::Evaluate {
            let (store, life) = process::connect_store(backend, &spec, cfg.pserver_client())
                .await
                .map_err(|e| ConnectError::new_err(format!("connect to the pservers: {e}")))?;
            return Ok((spec, store, idle, sd.clone(), Some(life)));
        }
        match Member::join(backend, &cfg, spec.clone(), &device, started, &sd).await {
            Ok(Joined::Member(m)) => {
                let (store, stop, tasks) = (m.store(), m.stop_on(&sd), m.tasks());
                let state = Loop {
                    member: Some(m),
                    tasks: Some(tasks),
                    ..idle
                };
                Ok((spec, store, state, stop, None))
            }
            Ok(Joined::Drained(_)) | Err(TrainerError::StoppedBeforeStart) => Err(stopped()),
            Err(e) => Err(trainer_error(e)),
        }
    })??;
    let (spec, store, state, stop, life) = joined;
    let device = device_name;
    let spec_json = serde_json::to_string(&spec).map_err(|e| EdlError::new_err(e.to_string()))?;
    Ok(Trainer {
        inner: Arc::new(Inner {
            id,
            device,
            job,
            mode,
            report,
            spec,
            spec_json,
            store,
            shutdown,
            stop,
            state: tokio::sync::Mutex::new(state),
            wake: tokio::sync::Notify::new(),
            in_hand: AtomicUsize::new(0),
            steps: Mutex::new(Steps::default()),
            _life: life,
        }),
    })
}

/// Cancels `shutdown` on SIGTERM; a second SIGTERM exits at once (status 143).
fn drain_on_sigterm(shutdown: CancellationToken) -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    tokio::spawn(async move {
        if term.recv().await.is_none() {
            return;
        }
        tracing::info!("SIGTERM: draining");
        shutdown.cancel();
        if term.recv().await.is_some() {
            tracing::warn!("second SIGTERM: exiting now");
            std::process::exit(143);
        }
    });
    Ok(())
}

fn parse_metric(metric: &str) -> PyResult<MetricKind> {
    match metric {
        "accuracy" => Ok(MetricKind::Accuracy),
        "cost" => Ok(MetricKind::Cost),
        "loss" => Ok(MetricKind::Loss),
        other => Err(value_error(format!(
            "metric {other:?}: expected accuracy, cost or loss"
        ))),
    }
}
