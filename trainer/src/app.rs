//! [`Trainer`]: the one call that makes a program an elastic edl trainer of a job, with
//! the program's own model; [`main`] is that call for a `main` function.
//!
//! ```no_run
//! use edl_trainer::{ModelSpec, build_on};
//!
//! fn main() -> std::process::ExitCode {
//!     // Any `Model` works; here a built-in one, built on the trainer's device.
//!     edl_trainer::main(|ctx| {
//!         let spec = ModelSpec::Mlp { inputs: 13, hidden: vec![32], classes: 3,
//!                                     standardize: false, stats: None,
//!                                     init: Default::default() };
//!         build_on(&spec, ctx.device(), candle_core::DType::F32)
//!     })
//! }
//! ```
//!
//! The configuration comes from the environment `edl run` sets for a `[trainer] entry`
//! program ([`Trainer::from_env`], the contract in docs/trainer-api.md) or from the
//! builder ([`Trainer::new`] and its setters). [`Trainer::run`] then does what `edl
//! trainer` does, for it is what `edl trainer` runs: it connects to etcd (waiting out an
//! outage at startup), reads the job's spec, builds the model on the chosen device,
//! registers under its lease, trains the tasks of the master's `cloud_reader` through
//! the pservers (see [`crate::process::run`]), drains on SIGTERM or Ctrl-C (the current
//! task handed back), serves `/metrics`, and prints its JSON report (and writes it to
//! `EDL_REPORT`). With `EDL_MODE=evaluate` the program evaluates the job's current
//! parameters instead (`edl run` asks for this once the job finished, for the final
//! metric of a model only the program knows) and reports a [`JobEval`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, EtcdAuth, EtcdConfig, EtcdTls, retry_startup};
use edl_job::{InvalidJobName, JobName, JobSpec, SpecError};
use tokio_util::sync::CancellationToken;

use crate::process::{
    self, EvalError, JobEval, ModelContext, ModelSource, TrainerConfig, TrainerError, TrainerReport,
};
use crate::{DeviceChoice, Model};

/// The environment variables of the contract (docs/trainer-api.md): `edl_job::env`, where
/// every writer (`edl run`, the operator) and reader finds them.
pub use edl_job::env;

/// What the program does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunMode {
    /// Train as one of the job's trainers.
    Train,
    /// Evaluate the job's current parameters once, and report.
    Evaluate,
}

/// A setting that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum SettingError {
    /// A required variable is not set.
    #[error(
        "{var} is not set: this program is an edl trainer; run it with `edl run JOB.toml` \
         (`[trainer] entry`), or set {var} (see docs/trainer-api.md)"
    )]
    Missing {
        /// The variable.
        var: &'static str,
    },
    /// A variable's value is not valid.
    #[error("{var}={value:?}: {reason}")]
    Invalid {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        reason: String,
    },
}

/// Why [`Trainer::run`] failed.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The configuration is not usable.
    #[error("{0}")]
    Config(#[from] SettingError),
    /// The async runtime or the signal handlers could not be set up.
    #[error("start: {0}")]
    Start(std::io::Error),
    /// etcd could not be reached or refused.
    #[error("{0}")]
    Etcd(String),
    /// The job spec given to store could not be stored, or the stored one read.
    #[error("{0}")]
    Spec(SpecError),
    /// Training failed.
    #[error("{0}")]
    Trainer(Box<TrainerError>),
    /// The evaluation failed.
    #[error("{0}")]
    Eval(Box<EvalError>),
    /// The model could not be built.
    #[error("build the model: {0}")]
    Model(crate::Error),
    /// The report could not be written.
    #[error("write the report {}: {error}", path.display())]
    Report {
        /// The file.
        path: PathBuf,
        /// Why.
        error: std::io::Error,
    },
}

impl From<TrainerError> for AppError {
    fn from(e: TrainerError) -> Self {
        AppError::Trainer(Box::new(e))
    }
}

impl From<EvalError> for AppError {
    fn from(e: EvalError) -> Self {
        AppError::Eval(Box::new(e))
    }
}

/// How [`Trainer::run`] ended.
// Returned once per trainer: the report stays inline rather than boxed.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Finished {
    /// Trained until the job finished, or drained.
    Trained(TrainerReport),
    /// Evaluated the job's parameters ([`RunMode::Evaluate`]).
    Evaluated(JobEval),
    /// Stopped (SIGTERM) before it joined the job: nothing was done.
    StoppedBeforeStart,
}

/// An elastic trainer of a job, configured; [`Trainer::run`] runs it.
#[derive(Debug, Clone)]
pub struct Trainer {
    etcd: EtcdConfig,
    cfg: TrainerConfig,
    mode: RunMode,
    report: Option<PathBuf>,
    publish: Option<JobSpec>,
}

impl Trainer {
    /// A trainer of `job` on the etcd of `etcd`, with [`TrainerConfig::new`]'s defaults.
    pub fn new(job: JobName, etcd: EtcdConfig) -> Trainer {
        Trainer {
            etcd,
            cfg: TrainerConfig::new(job),
            mode: RunMode::Train,
            report: None,
            publish: None,
        }
    }

    /// The configuration `edl run` passes to a `[trainer] entry` program (the [`env`](mod@env)
    /// variables; docs/trainer-api.md). `EDL_ETCD` and `EDL_JOB` are required (or
    /// PaddlePaddle's `PADDLE_ETCD_ENDPOINTS` and `PADDLE_JOB_ID`).
    pub fn from_env() -> Result<Trainer, SettingError> {
        Trainer::from_vars(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }

    /// [`Trainer::from_env`] over any source of variables.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Trainer, SettingError> {
        let either = |a: &'static str, b: &'static str| {
            var(a)
                .map(|v| (a, v))
                .or_else(|| var(b).map(|v| (b, v)))
                .ok_or(SettingError::Missing { var: a })
        };
        let invalid = |var: &'static str, value: &str, reason: String| SettingError::Invalid {
            var,
            value: value.to_owned(),
            reason,
        };
        let duration = |name: &'static str| -> Result<Option<Duration>, SettingError> {
            var(name)
                .map(|v| {
                    humantime::parse_duration(&v).map_err(|e| invalid(name, &v, e.to_string()))
                })
                .transpose()
        };
        let (etcd_var, endpoints) = either(env::ETCD, env::PADDLE_ETCD)?;
        let endpoints: Vec<String> = endpoints
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        if endpoints.is_empty() {
            return Err(invalid(etcd_var, "", "no endpoint".into()));
        }
        let mut etcd = EtcdConfig::new(endpoints);
        match (var(env::ETCD_USER), var(env::ETCD_PASSWORD)) {
            (Some(user), Some(password)) => etcd.auth = Some(EtcdAuth { user, password }),
            (None, None) => {}
            (Some(_), None) => {
                return Err(SettingError::Missing {
                    var: env::ETCD_PASSWORD,
                });
            }
            (None, Some(_)) => {
                return Err(SettingError::Missing {
                    var: env::ETCD_USER,
                });
            }
        }
        let (ca, cert, key) = (var(env::ETCD_CA), var(env::ETCD_CERT), var(env::ETCD_KEY));
        let domain = var(env::ETCD_DOMAIN);
        if ca.is_some() || cert.is_some() || key.is_some() || domain.is_some() {
            etcd.tls = Some(EtcdTls {
                ca_file: ca.map(PathBuf::from),
                cert_file: cert.map(PathBuf::from),
                key_file: key.map(PathBuf::from),
                domain,
            });
        }
        let tls = edl_proto::tls::TlsFiles::from_vars(&var)
            .and_then(|files| files.map(|f| f.load()).transpose())
            .map_err(|e| {
                invalid(
                    env::TLS_CA,
                    &var(env::TLS_CA).unwrap_or_default(),
                    e.to_string(),
                )
            })?;
        let (job_var, job) = either(env::JOB, env::PADDLE_JOB)?;
        let job: JobName = job
            .parse()
            .map_err(|e: InvalidJobName| invalid(job_var, &job, e.to_string()))?;
        let mut t = Trainer::new(job, etcd);
        if let Some(id) = var(env::TRAINER_ID) {
            t.cfg.id = id;
        }
        if let Some(d) = var(env::DEVICE) {
            t.cfg.device = d.parse().map_err(|e: String| invalid(env::DEVICE, &d, e))?;
        }
        t.cfg.lease_ttl = duration(env::LEASE_TTL)?;
        if let Some(a) = var(env::METRICS_ADDR) {
            t.cfg.metrics_addr = Some(a.parse().map_err(|e: std::net::AddrParseError| {
                invalid(env::METRICS_ADDR, &a, e.to_string())
            })?);
        }
        t.cfg.token = var(env::TOKEN);
        t.cfg.metrics_token = var(env::METRICS_TOKEN);
        t.cfg.tls = tls;
        if let Some(w) = duration(env::ETCD_WAIT)? {
            t.cfg.etcd_wait = w;
        }
        if let Some(w) = duration(env::SPEC_WAIT)? {
            t.cfg.spec_wait = w;
        }
        t.report = var(env::REPORT).map(PathBuf::from);
        t.mode = match var(env::MODE).as_deref() {
            None | Some("train") => RunMode::Train,
            Some("evaluate") => RunMode::Evaluate,
            Some(other) => {
                return Err(invalid(
                    env::MODE,
                    other,
                    "expected train or evaluate".into(),
                ));
            }
        };
        Ok(t)
    }

    /// This trainer's id (unique in the job).
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.cfg.id = id.into();
        self
    }

    /// The compute device.
    pub fn device(mut self, device: DeviceChoice) -> Self {
        self.cfg.device = device;
        self
    }

    /// The TTL of the registration lease (default: the spec's).
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.cfg.lease_ttl = Some(ttl);
        self
    }

    /// Serve `/metrics` on `addr`.
    pub fn metrics_addr(mut self, addr: SocketAddr) -> Self {
        self.cfg.metrics_addr = Some(addr);
        self
    }

    /// The job token every RPC carries.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.cfg.token = Some(token.into());
        self
    }

    /// The token a `/metrics` scrape must carry instead of the job token.
    pub fn metrics_token(mut self, token: impl Into<String>) -> Self {
        self.cfg.metrics_token = Some(token.into());
        self
    }

    /// TLS to the job's masters and pservers (their CA; this process's certificate for
    /// mutual TLS).
    pub fn tls(mut self, tls: edl_proto::tls::Tls) -> Self {
        self.cfg.tls = Some(tls);
        self
    }

    /// How long to wait for the job's spec to appear in etcd (default 60s).
    pub fn spec_wait(mut self, wait: Duration) -> Self {
        self.cfg.spec_wait = wait;
        self
    }

    /// How long each startup step retries an unreachable etcd (default 2 minutes).
    pub fn etcd_wait(mut self, wait: Duration) -> Self {
        self.cfg.etcd_wait = wait;
        self
    }

    /// Also write the JSON report to `path`.
    pub fn report(mut self, path: impl Into<PathBuf>) -> Self {
        self.report = Some(path.into());
        self
    }

    /// Train, or evaluate the job's parameters once.
    pub fn mode(mut self, mode: RunMode) -> Self {
        self.mode = mode;
        self
    }

    /// Store `spec` as the job's spec first, when the job has none (a job run without
    /// `edl run`). An error when the job has a different one.
    pub fn publish_spec(mut self, spec: JobSpec) -> Self {
        self.publish = Some(spec);
        self
    }

    /// The trainer's settings.
    pub fn config(&self) -> &TrainerConfig {
        &self.cfg
    }

    /// The etcd to connect to.
    pub fn etcd_config(&self) -> &EtcdConfig {
        &self.etcd
    }

    /// What the program is to do (`EDL_MODE`).
    pub fn run_mode(&self) -> RunMode {
        self.mode
    }

    /// The spec to store in etcd before joining ([`Trainer::publish_spec`]), if any.
    pub fn spec_to_publish(&self) -> Option<&JobSpec> {
        self.publish.as_ref()
    }

    /// Where the JSON report is written (`EDL_REPORT`), if anywhere.
    pub fn report_path(&self) -> Option<&std::path::Path> {
        self.report.as_deref()
    }

    /// The first step of every trainer, whatever runs its loop ([`Trainer::run`], the
    /// Python package): connects to etcd, waiting out an outage for up to `etcd_wait`,
    /// and stores the spec given to [`Trainer::publish_spec`], retried the same way.
    /// `None` when `shutdown` fired first.
    pub async fn connect_job(
        &self,
        shutdown: &CancellationToken,
    ) -> Result<Option<Arc<dyn Backend>>, AppError> {
        let wait = self.cfg.etcd_wait;
        let connected = edl_role::connect(&self.etcd, wait, shutdown).await;
        let Some(backend) = connected.map_err(|e| AppError::Etcd(e.to_string()))? else {
            return Ok(None);
        };
        let Some(spec) = &self.publish else {
            return Ok(Some(backend));
        };
        let published = retry_startup("store the job spec", wait, shutdown, || async {
            match spec.publish(&backend).await {
                Err(SpecError::Etcd { error, .. }) if error.is_retryable() => Err(error),
                other => Ok(other),
            }
        })
        .await;
        match published {
            Ok(r) => r.map(|_| Some(backend)).map_err(AppError::Spec),
            Err(edl_coord::Error::Cancelled) => Ok(None),
            Err(e) => Err(AppError::Etcd(format!("store the job spec in etcd: {e}"))),
        }
    }

    /// Runs the trainer with the model `build` makes (once the job's spec and the
    /// device are known), on a runtime of its own, until the job finishes or a signal
    /// drains it. Prints the report as one JSON line on stdout.
    pub fn run<M: Model + 'static>(
        self,
        build: impl FnOnce(&ModelContext<'_>) -> crate::Result<M> + Send + 'static,
    ) -> Result<Finished, AppError> {
        self.run_source(ModelSource::new(build))
    }

    /// [`Trainer::run`] with a [`ModelSource`] (`ModelSource::builtin()` is what `edl
    /// trainer` trains).
    pub fn run_source(self, model: ModelSource) -> Result<Finished, AppError> {
        edl_role::init_logging();
        let rt = edl_role::runtime().map_err(AppError::Start)?;
        rt.block_on(async move {
            let shutdown = edl_role::shutdown_on_signals().map_err(AppError::Start)?;
            self.run_async(model, shutdown).await
        })
    }

    /// [`Trainer::run_source`] on the caller's tokio runtime; `shutdown` drains.
    pub async fn run_async(
        self,
        model: ModelSource,
        shutdown: CancellationToken,
    ) -> Result<Finished, AppError> {
        let Some(backend) = self.connect_job(&shutdown).await? else {
            return Ok(Finished::StoppedBeforeStart);
        };
        let finished = match self.mode {
            RunMode::Train => {
                match process::run(backend, self.cfg.clone(), model, shutdown).await {
                    Ok(rep) => Finished::Trained(rep),
                    Err(TrainerError::StoppedBeforeStart) => Finished::StoppedBeforeStart,
                    Err(e) => return Err(e.into()),
                }
            }
            RunMode::Evaluate => {
                let spec = match process::fetch_spec(&backend, &self.cfg, &shutdown).await {
                    Ok(spec) => spec,
                    Err(TrainerError::StoppedBeforeStart) => {
                        return Ok(Finished::StoppedBeforeStart);
                    }
                    Err(e) => return Err(e.into()),
                };
                let device = crate::select_device(self.cfg.device).map_err(AppError::Model)?;
                let model = model.build(&spec, &device).map_err(AppError::Model)?;
                let pcfg = self.cfg.pserver_client();
                Finished::Evaluated(process::evaluate_job(backend, &spec, model, pcfg).await?)
            }
        };
        let line = match &finished {
            Finished::Trained(rep) => serde_json::to_string(rep),
            Finished::Evaluated(eval) => serde_json::to_string(eval),
            Finished::StoppedBeforeStart => {
                tracing::info!("stopped while starting");
                return Ok(finished);
            }
        }
        .unwrap_or_default();
        emit_report(&line, self.report.as_deref())?;
        Ok(finished)
    }
}

/// Prints a report (one JSON line) on stdout and writes it to `path` when given: what
/// every trainer program does when it ends (`edl run` reads the file).
pub fn emit_report(line: &str, path: Option<&std::path::Path>) -> Result<(), AppError> {
    println!("{line}");
    if let Some(path) = path {
        std::fs::write(path, format!("{line}\n")).map_err(|error| AppError::Report {
            path: path.to_path_buf(),
            error,
        })?;
    }
    Ok(())
}

/// The whole `main` of a trainer program: [`Trainer::from_env`], then [`Trainer::run`]
/// with the model `build` makes. An error is printed once, on stderr, and the exit
/// status is 1; a drained or finished trainer exits 0.
pub fn main<M: Model + 'static>(
    build: impl FnOnce(&ModelContext<'_>) -> crate::Result<M> + Send + 'static,
) -> ExitCode {
    match Trainer::from_env()
        .map_err(AppError::from)
        .and_then(|t| t.run(build))
    {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn the_environment_contract_configures_a_trainer() {
        let t = Trainer::from_vars(vars(&[
            ("EDL_ETCD", "http://127.0.0.1:1, http://127.0.0.1:2"),
            ("EDL_JOB", "mnist"),
            ("EDL_TRAINER_ID", "trainer-3"),
            ("EDL_DEVICE", "cpu"),
            ("EDL_LEASE_TTL", "7s"),
            ("EDL_METRICS_ADDR", "127.0.0.1:0"),
            ("EDL_REPORT", "/tmp/r.json"),
            ("EDL_MODE", "evaluate"),
            ("EDL_ETCD_WAIT", "5s"),
        ]))
        .expect("valid");
        assert_eq!(
            t.etcd.endpoints,
            vec![
                "http://127.0.0.1:1".to_owned(),
                "http://127.0.0.1:2".to_owned()
            ]
        );
        assert_eq!(t.cfg.job.as_str(), "mnist");
        assert_eq!(t.cfg.id, "trainer-3");
        assert_eq!(t.cfg.device, DeviceChoice::Cpu);
        assert_eq!(t.cfg.lease_ttl, Some(Duration::from_secs(7)));
        assert_eq!(t.cfg.etcd_wait, Duration::from_secs(5));
        assert!(t.cfg.metrics_addr.is_some());
        assert_eq!(t.report, Some(PathBuf::from("/tmp/r.json")));
        assert_eq!(t.mode, RunMode::Evaluate);

        // PaddlePaddle's names stand in for ours.
        let t = Trainer::from_vars(vars(&[
            ("PADDLE_ETCD_ENDPOINTS", "http://127.0.0.1:9"),
            ("PADDLE_JOB_ID", "paddle-job"),
        ]))
        .expect("valid");
        assert_eq!(t.cfg.job.as_str(), "paddle-job");
        assert_eq!(t.mode, RunMode::Train);
        assert!(t.cfg.id.starts_with("trainer-"));
    }

    #[test]
    fn a_missing_or_bad_variable_is_named_with_the_fix() {
        let e = Trainer::from_vars(vars(&[("EDL_JOB", "j")])).expect_err("no etcd");
        assert!(e.to_string().starts_with("EDL_ETCD is not set"), "{e}");
        assert!(e.to_string().contains("edl run"), "{e}");
        let e = Trainer::from_vars(vars(&[("EDL_ETCD", "http://h:1")])).expect_err("no job");
        assert!(e.to_string().starts_with("EDL_JOB is not set"), "{e}");
        for (var, value) in [
            ("EDL_JOB", "../x"),
            ("EDL_LEASE_TTL", "ten"),
            ("EDL_DEVICE", "tpu"),
            ("EDL_METRICS_ADDR", "nowhere"),
            ("EDL_MODE", "serve"),
        ] {
            let mut all = vec![("EDL_ETCD", "http://h:1"), ("EDL_JOB", "j")];
            all.retain(|(k, _)| *k != var);
            all.push((var, value));
            let e = Trainer::from_vars(vars(&all)).expect_err(var);
            assert!(
                e.to_string().starts_with(&format!("{var}={value:?}: ")),
                "{var}: {e}"
            );
        }
        let e = Trainer::from_vars(vars(&[
            ("EDL_ETCD", "http://h:1"),
            ("EDL_JOB", "j"),
            ("EDL_ETCD_USER", "u"),
        ]))
        .expect_err("no password");
        assert!(
            e.to_string().starts_with("EDL_ETCD_PASSWORD is not set"),
            "{e}"
        );
    }
}
