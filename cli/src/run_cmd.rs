//! `edl run JOB.toml`: a whole job on one machine.
//!
//! - Coordination: `--etcd` (or `cluster.etcd` in the spec) when given; otherwise a
//!   private etcd (temp data dir, free loopback ports) when an `etcd` binary is on `PATH`;
//!   otherwise every role runs in this process on the in-memory backend (said in one
//!   line). `--coord memory|etcd` forces a choice.
//! - With etcd, masters, pservers and trainers are child processes of this same binary,
//!   supervised: a crashed process is restarted with backoff within a restart budget
//!   (`cluster.max_restarts`, counting crashes only: injected faults and scale events do
//!   not count). Logs go to `<run dir>/logs/<process>.log`.
//! - `edl scale JOB --trainers N` (the `scale/trainers` key) is followed within
//!   `[min_trainers, max_trainers]`: new trainers are started, surplus ones drained
//!   (SIGTERM). `edl kill JOB` stops the job gracefully.
//! - `--chaos SPEC` injects seeded faults and measures each recovery.
//! - At the end: the final parameters (`<run dir>/params.json`), a summary, and with
//!   `--report FILE` the same as JSON. Exit 0 only if the job succeeded.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::{Args, ValueEnum};
use edl_coord::LocalEtcd;
use edl_coord::{Backend, EtcdBackend, EtcdConfig, MemBackend};
use edl_master::client::{MasterClient, MasterClientConfig};
use edl_proto::master::StatusResponse;
use edl_pserver::{DenseCache, PsClient};
use edl_trainer::{DeviceChoice, Model, ParamStore, PsStore};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::common::{runtime, shutdown_on_signals};
use edl_job::{
    ControlRecord, FinalState, JobKeys, JobSpec, JobStateRecord, RECORD_VERSION, Record, RunRecord,
    ScaleRecord,
};
use edl_pserver::server::PsRecord;
use edl_trainer::process::{TrainerConfig, TrainerReport};

/// Where the coordination state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CoordChoice {
    /// `--etcd`/the spec's etcd, else a private etcd if one is installed, else memory.
    Auto,
    /// etcd (the given one, or a private one).
    Etcd,
    /// Every role in this process on the in-memory backend.
    Memory,
}

/// Arguments of `edl run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The job spec (TOML).
    pub spec: PathBuf,
    /// etcd client URLs, comma-separated (default: the spec's `cluster.etcd`).
    #[arg(long, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Coordination backend.
    #[arg(long, value_enum, default_value = "auto")]
    pub coord: CoordChoice,
    /// Seeded fault injection, e.g. `kill-trainer=10s,kill-pserver=30s,kill-master=60s,stop-trainer=20s,seed=7`.
    #[arg(long)]
    pub chaos: Option<String>,
    /// Write the report (JSON) here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Run directory for logs, checkpoints and the final parameters (default:
    /// `edl-runs/<job>` next to the spec).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Compute device of the trainers: auto, cpu or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    /// No live progress display (log lines only).
    #[arg(long)]
    pub quiet: bool,
    /// Give up when the job has not finished after this long.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2h")]
    pub timeout: Duration,
}

/// Seeded fault injection: an interval per fault kind.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Chaos {
    /// SIGKILL a random trainer this often.
    pub kill_trainer: Option<Duration>,
    /// SIGKILL a random pserver this often.
    pub kill_pserver: Option<Duration>,
    /// SIGKILL the leading master this often.
    pub kill_master: Option<Duration>,
    /// SIGSTOP a random trainer for twice the lease TTL this often.
    pub stop_trainer: Option<Duration>,
    /// Seed of the victims' choice.
    pub seed: u64,
}

impl std::str::FromStr for Chaos {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Chaos> {
        let mut c = Chaos::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .with_context(|| format!("--chaos: {part:?} is not KEY=VALUE"))?;
            let dur = || {
                humantime::parse_duration(v)
                    .with_context(|| format!("--chaos: {k}: invalid duration {v:?}"))
                    .and_then(|d| {
                        anyhow::ensure!(d >= Duration::from_secs(1), "--chaos: {k}: at least 1s");
                        Ok(d)
                    })
            };
            match k {
                "kill-trainer" => c.kill_trainer = Some(dur()?),
                "kill-pserver" => c.kill_pserver = Some(dur()?),
                "kill-master" => c.kill_master = Some(dur()?),
                "stop-trainer" => c.stop_trainer = Some(dur()?),
                "seed" => c.seed = v.parse().with_context(|| format!("--chaos: seed {v:?}"))?,
                other => anyhow::bail!(
                    "--chaos: unknown fault {other:?} (kill-trainer, kill-pserver, kill-master, stop-trainer, seed)"
                ),
            }
        }
        Ok(c)
    }
}

/// One recovery from a fault.
#[derive(Debug, Clone, Serialize)]
pub struct Recovery {
    /// What happened: `sigkill`, `sigstop`, `crash`.
    pub fault: String,
    /// The role hit.
    pub role: String,
    /// The process.
    pub process: String,
    /// Seconds from the fault until the system had recovered (see the README).
    pub seconds: f64,
}

/// A scale event.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleEvent {
    /// Seconds into the run.
    pub at_s: f64,
    /// Trainers before.
    pub from: u32,
    /// Trainers asked for.
    pub to: u32,
}

/// The final metric.
#[derive(Debug, Clone, Serialize)]
pub struct FinalMetric {
    /// `accuracy`, `cost` or `loss`.
    pub name: String,
    /// Its value.
    pub value: f64,
    /// `test` or `train`.
    pub split: String,
}

/// A failed task.
#[derive(Debug, Clone, Serialize)]
pub struct FailedTaskReport {
    /// Task id.
    pub task: String,
    /// Pass.
    pub pass: u32,
    /// Records not trained.
    pub records: u64,
    /// Why.
    pub reason: String,
}

/// The version of the `edl run --report` JSON (docs/json.md). Bumped when a field
/// changes meaning or goes away; new fields may appear within a version.
pub const RUN_REPORT_VERSION: u32 = 1;

/// What `edl run --report` writes.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    /// [`RUN_REPORT_VERSION`].
    pub version: u32,
    /// Job name.
    pub job: String,
    /// Whether it succeeded.
    pub succeeded: bool,
    /// Why not, if it did not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// `etcd`, `private-etcd` or `memory`.
    pub coordination: String,
    /// Passes completed.
    pub passes: u64,
    /// Records trained (over all passes).
    pub records_trained: u64,
    /// Records trained twice, as reported by trainers that handed back or failed tasks.
    pub duplicate_records: u64,
    /// Records of tasks cut off by a lost trainer and dispatched again: an upper bound of
    /// what may have been trained twice (so never more than `records_trained`).
    pub cutoff_records: u64,
    /// Records never trained in their pass (tasks failed for good).
    pub lost_records: u64,
    /// Tasks failed for good, with reasons.
    pub failed_tasks: Vec<FailedTaskReport>,
    /// The final evaluation.
    pub final_metric: Option<FinalMetric>,
    /// Recoveries, one per fault.
    pub recoveries: Vec<Recovery>,
    /// Faults injected whose recovery was not seen before the job ended.
    pub unrecovered: Vec<String>,
    /// Crash restarts (counted against the budget).
    pub restarts: u32,
    /// Scale events.
    pub scale_events: Vec<ScaleEvent>,
    /// The final parameters.
    pub params_file: Option<String>,
    /// The run directory (logs, checkpoints).
    pub run_dir: String,
    /// Wall time.
    pub wall_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Role {
    Master,
    Pserver,
    Trainer,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Master => "master",
            Role::Pserver => "pserver",
            Role::Trainer => "trainer",
        }
    }
}

struct Proc {
    role: Role,
    /// Slot: master/pserver index, trainer number.
    slot: u32,
    name: String,
    child: Child,
    /// Asked to stop (drain or shutdown): its exit is expected.
    stopping: bool,
    /// Hit by an injected fault: its death is not a crash.
    injected: bool,
    /// SIGSTOPped until then.
    stopped_until: Option<Instant>,
}

impl Proc {
    fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// What recovery from a fault means, checked against etcd.
enum Check {
    /// The trainer's registration is gone (its tasks are back in the queue) and the job
    /// has as many trainers registered as before.
    Trainer { key: String, want: usize },
    /// The stopped trainer's registration is gone (its tasks are back in the queue).
    TrainerGone { key: String },
    /// The pserver shard is claimed again (a new claim) and the new pserver answers (it
    /// restored its checkpoint before serving).
    Pserver { key: String, old_create: i64 },
    /// A master leads again (a new leader key) and answers.
    Master { old_leader: Option<Vec<u8>> },
}

struct Pending {
    fault: &'static str,
    role: Role,
    process: String,
    at: Instant,
    check: Check,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Runs `edl run`.
pub fn run(args: RunArgs) -> anyhow::Result<std::process::ExitCode> {
    let mut spec = edl_trainer::job::load(&args.spec)?;
    let chaos: Option<Chaos> = args.chaos.as_deref().map(str::parse).transpose()?;
    let in_spec = |e: anyhow::Error| e.context(format!("job spec {}", args.spec.display()));
    prepare_data(&spec).map_err(in_spec)?;
    check_data(&spec).map_err(in_spec)?;
    edl_trainer::job::fit_stats(&mut spec).map_err(|e| in_spec(e.into()))?;
    edl_trainer::job::check_data_fits_model(&spec).map_err(|e| in_spec(e.into()))?;
    let run_dir = match &args.run_dir {
        Some(d) => d.clone(),
        None => args
            .spec
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .join("edl-runs")
            .join(spec.name.as_str()),
    };
    std::fs::create_dir_all(&run_dir)
        .with_context(|| format!("create run directory {}", run_dir.display()))?;
    let run_dir = std::path::absolute(&run_dir).unwrap_or(run_dir);
    let endpoints = if args.etcd.is_empty() {
        spec.cluster.etcd.clone()
    } else {
        args.etcd.clone()
    };
    let rt = runtime()?;
    let report_path = args.report.clone();
    let report = rt.block_on(async move {
        let shutdown = shutdown_on_signals()?;
        let started = Instant::now();
        let etcd_found = edl_coord::local_etcd::etcd_binary().is_ok();
        let use_memory = match args.coord {
            CoordChoice::Memory => true,
            CoordChoice::Etcd => false,
            CoordChoice::Auto => endpoints.is_empty() && !etcd_found,
        };
        if use_memory {
            anyhow::ensure!(
                chaos.is_none(),
                "--chaos needs etcd (processes are killed); install etcd or pass --etcd"
            );
            println!(
                "edl run: no etcd given and none installed: running every role in this process on the in-memory backend"
            );
            return run_in_memory(spec, &args, run_dir, shutdown, started).await;
        }
        let mut private = None;
        let (endpoints, coordination) = if endpoints.is_empty() {
            let cluster = LocalEtcd::start(1).await.map_err(|e| {
                anyhow::anyhow!("start a private etcd: {e} (install etcd, or pass --etcd, or --coord memory)")
            })?;
            let eps = cluster.endpoints();
            println!("edl run: started a private etcd at {}", eps.join(","));
            private = Some(cluster);
            (eps, "private-etcd")
        } else {
            (endpoints, "etcd")
        };
        let mut cfg = EtcdConfig::new(endpoints.iter().cloned());
        cfg.dial_timeout = Duration::from_secs(3);
        cfg.request_timeout = Duration::from_secs(5);
        let backend: Arc<dyn Backend> = Arc::new(
            tokio::time::timeout(Duration::from_secs(15), EtcdBackend::connect(cfg))
                .await
                .map_err(|_| anyhow::anyhow!("cannot reach etcd at {} (timed out)", endpoints.join(",")))?
                .map_err(crate::common::etcd_connect_error)?,
        );
        let mut sup = Supervisor::new(spec, backend, endpoints, run_dir, args.device, chaos)?;
        sup.coordination = coordination.to_owned();
        let report = sup.run(&shutdown, started, args.quiet, args.timeout).await;
        drop(private);
        report
    })?;
    print_summary(&report);
    if let Some(path) = &report_path {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("write {}", path.display()))?;
    }
    Ok(if report.succeeded {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    })
}

/// `DIR/PREFIX-*.recordio` -> (DIR, PREFIX).
fn glob_target(glob: &str, key: &str) -> anyhow::Result<(PathBuf, String)> {
    let path = Path::new(glob);
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    let prefix = name.strip_suffix("-*.recordio").with_context(|| {
        format!(
            "data.{key}: with [data.prepare] it must look like DIR/PREFIX-*.recordio, not {glob}"
        )
    })?;
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    Ok((dir, prefix.to_owned()))
}

fn matches_nothing(globs: &[String]) -> bool {
    edl_recordio::expand_globs(globs).map_or(true, |f| f.is_empty())
}

/// Creates the spec's RecordIO files from `[data.prepare]` when they are missing.
fn prepare_data(spec: &JobSpec) -> anyhow::Result<()> {
    let Some(prep) = &spec.data.prepare else {
        return Ok(());
    };
    let train = spec.data.train.patterns();
    let test = spec.data.test.as_ref().map(|t| t.patterns());
    let missing = matches_nothing(&train) || test.as_deref().is_some_and(matches_nothing);
    if !missing {
        return Ok(());
    }
    anyhow::ensure!(
        train.len() == 1 && test.as_ref().is_none_or(|t| t.len() == 1),
        "data: with [data.prepare], train and test are one glob each"
    );
    let (train_dir, train_prefix) = glob_target(&train[0], "train")?;
    let test_target = match &test {
        Some(t) => Some(glob_target(&t[0], "test")?),
        None => None,
    };
    anyhow::ensure!(
        test_target.is_none() || prep.test_every >= 2,
        "data.prepare.test_every: must be at least 2 when data.test is set"
    );
    let raw = std::fs::read(&prep.from)
        .with_context(|| format!("data.prepare.from: read {}", prep.from))?;
    let text = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut flate2::read::MultiGzDecoder::new(&raw[..]), &mut s)
            .with_context(|| format!("data.prepare.from: decompress {}", prep.from))?;
        s
    } else {
        String::from_utf8(raw)
            .with_context(|| format!("data.prepare.from: {} is not UTF-8", prep.from))?
    };
    let mut lines: Vec<&str> = text.lines().collect();
    let header = if prep.header && !lines.is_empty() {
        Some(lines.remove(0))
    } else {
        None
    };
    let (mut tr, mut te) = (Vec::new(), Vec::new());
    for (i, l) in lines.into_iter().enumerate() {
        if test_target.is_some() && i % prep.test_every == prep.test_every - 1 {
            te.push(l);
        } else {
            tr.push(l);
        }
    }
    println!(
        "edl run: preparing {} training and {} test lines from {}",
        tr.len(),
        te.len(),
        prep.from
    );
    std::fs::create_dir_all(&train_dir)
        .with_context(|| format!("create {}", train_dir.display()))?;
    let exe = std::env::current_exe().context("find the edl binary")?;
    let convert = |lines: &[&str],
                   dir: &Path,
                   prefix: &str,
                   shards: u32,
                   vocab: Option<PathBuf>|
     -> anyhow::Result<()> {
        let input = dir.join(format!(".{prefix}.prepare.txt"));
        let mut body = String::new();
        if let Some(h) = header {
            body.push_str(h);
            body.push('\n');
        }
        for l in lines {
            body.push_str(l);
            body.push('\n');
        }
        std::fs::write(&input, body).with_context(|| format!("write {}", input.display()))?;
        let mut cmd = Command::new(&exe);
        cmd.args([
            "data",
            "convert",
            "--format",
            &prep.format,
            "--prefix",
            prefix,
        ])
        .arg("--shards")
        .arg(shards.to_string())
        .arg("--out")
        .arg(dir);
        if let Some(c) = &prep.chunk_size {
            cmd.args(["--chunk-size", c]);
        }
        if let Some(l) = &prep.label {
            cmd.args(["--label", l]);
        }
        if prep.header {
            cmd.arg("--header");
        }
        if let Some(v) = vocab {
            cmd.arg("--vocab").arg(v);
        }
        let out = cmd.arg(&input).output().context("run edl data convert")?;
        let _ = std::fs::remove_file(&input);
        anyhow::ensure!(
            out.status.success(),
            "data.prepare: converting {} failed: {}",
            prep.from,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(())
    };
    convert(&tr, &train_dir, &train_prefix, prep.shards.max(1), None)?;
    if let Some((dir, prefix)) = &test_target {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        let vocab =
            (prep.format == "text").then(|| train_dir.join(format!("{train_prefix}.vocab")));
        convert(&te, dir, prefix, 1, vocab)?;
    }
    Ok(())
}

/// Every glob of the spec matches at least one file (one clear error otherwise).
fn check_data(spec: &JobSpec) -> anyhow::Result<()> {
    let mut globs = spec.data.train.patterns();
    if let Some(t) = &spec.data.test {
        globs.extend(t.patterns());
    }
    for g in globs {
        match edl_recordio::expand_globs(std::slice::from_ref(&g)) {
            Ok(files) if !files.is_empty() => {}
            Ok(_) => anyhow::bail!("data: no files match {g}"),
            Err(e) => anyhow::bail!("data: {e}"),
        }
    }
    Ok(())
}

/// The records of tasks cut off by a lost trainer, as a bound of what was trained
/// twice: a record trained twice was trained once in a task that was acknowledged, so
/// the bound never exceeds the records trained (a job that trained nothing reports 0).
fn twice_trained_bound(c: &edl_proto::master::Counters) -> u64 {
    c.cutoff_records.min(c.records_trained)
}

fn print_summary(r: &RunReport) {
    println!();
    println!(
        "== job {} {} in {:.1}s ({})",
        r.job,
        if r.succeeded { "succeeded" } else { "FAILED" },
        r.wall_s,
        r.coordination
    );
    if let Some(e) = &r.error {
        println!("   error: {e}");
    }
    println!(
        "   passes {}  records trained {}  duplicates {} (+{} cut off)  lost {}",
        r.passes, r.records_trained, r.duplicate_records, r.cutoff_records, r.lost_records
    );
    if let Some(m) = &r.final_metric {
        println!(
            "   final {} on the {} split: {:.4}",
            m.name, m.split, m.value
        );
    }
    for f in &r.failed_tasks {
        println!(
            "   failed task {} (pass {}, {} records): {}",
            f.task, f.pass, f.records, f.reason
        );
    }
    for rec in &r.recoveries {
        println!(
            "   recovered from {} of {} {} in {:.2}s",
            rec.fault, rec.role, rec.process, rec.seconds
        );
    }
    if r.restarts > 0 {
        println!("   crash restarts: {}", r.restarts);
    }
    for s in &r.scale_events {
        println!(
            "   scaled trainers {} -> {} at {:.1}s",
            s.from, s.to, s.at_s
        );
    }
    if let Some(p) = &r.params_file {
        println!("   final parameters: {p}");
    }
    println!("   logs: {}/logs", r.run_dir);
}

struct Supervisor {
    spec: JobSpec,
    backend: Arc<dyn Backend>,
    endpoints: Vec<String>,
    run_dir: PathBuf,
    device: DeviceChoice,
    chaos: Option<Chaos>,
    coordination: String,
    keys: JobKeys,
    procs: Vec<Proc>,
    next_trainer: u32,
    desired_trainers: u32,
    restarts: u32,
    /// Restart due times of crashed processes: (role, slot, when).
    restart_queue: Vec<(Role, u32, Instant)>,
    recoveries: Vec<Recovery>,
    pending: Vec<Pending>,
    scale_events: Vec<ScaleEvent>,
    rng: rand::rngs::StdRng,
    restart_counts: BTreeMap<(Role, u32), u32>,
}

impl Supervisor {
    fn new(
        spec: JobSpec,
        backend: Arc<dyn Backend>,
        endpoints: Vec<String>,
        run_dir: PathBuf,
        device: DeviceChoice,
        chaos: Option<Chaos>,
    ) -> anyhow::Result<Supervisor> {
        let keys = JobKeys::new(&spec.name);
        let seed = chaos.as_ref().map_or(0, |c| c.seed);
        Ok(Supervisor {
            desired_trainers: spec.cluster.trainers,
            spec,
            backend,
            endpoints,
            run_dir,
            device,
            chaos,
            coordination: String::new(),
            keys,
            procs: Vec::new(),
            next_trainer: 0,
            restarts: 0,
            restart_queue: Vec::new(),
            recoveries: Vec::new(),
            pending: Vec::new(),
            scale_events: Vec::new(),
            rng: rand::rngs::StdRng::seed_from_u64(seed),
            restart_counts: BTreeMap::new(),
        })
    }

    fn etcd_arg(&self) -> String {
        self.endpoints.join(",")
    }

    fn spawn(&mut self, role: Role, slot: u32) -> anyhow::Result<()> {
        let job = self.spec.name.to_string();
        let ttl = humantime::format_duration(self.spec.cluster.lease_ttl).to_string();
        let gen_ = self.restart_counts.get(&(role, slot)).copied().unwrap_or(0);
        let name = match role {
            Role::Master => format!("master-{slot}"),
            Role::Pserver => format!("pserver-{slot}"),
            Role::Trainer if gen_ == 0 => format!("trainer-{slot}"),
            Role::Trainer => format!("trainer-{slot}.{gen_}"),
        };
        let mut args: Vec<String> = vec![
            role.name().into(),
            "--etcd".into(),
            self.etcd_arg(),
            "--job".into(),
            job,
            "--lease-ttl".into(),
            ttl,
        ];
        match role {
            Role::Master => {
                args.extend(["--chunks-per-task".into(), "1".into()]);
            }
            Role::Pserver => {
                args.extend([
                    "--index".into(),
                    slot.to_string(),
                    "--shards".into(),
                    self.spec.cluster.pservers.to_string(),
                    "--checkpoint-dir".into(),
                    self.run_dir.join("checkpoints").display().to_string(),
                    "--checkpoint-every".into(),
                    humantime::format_duration(self.spec.cluster.checkpoint_every).to_string(),
                    "--keep-checkpoints".into(),
                    self.spec.cluster.checkpoint_keep.to_string(),
                ]);
            }
            Role::Trainer => {
                args.extend([
                    "--id".into(),
                    name.clone(),
                    "--device".into(),
                    self.device.to_string(),
                    "--report".into(),
                    self.run_dir
                        .join(format!("{name}.json"))
                        .display()
                        .to_string(),
                ]);
            }
        }
        let log_path = self.run_dir.join("logs").join(format!("{name}.log"));
        let log = File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("open {}", log_path.display()))?;
        let err = log.try_clone()?;
        let exe = std::env::current_exe().context("find the edl binary")?;
        let mut cmd = Command::new(exe);
        cmd.args(&args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .env("NO_COLOR", "1");
        if role == Role::Trainer && std::env::var_os("RAYON_NUM_THREADS").is_none() {
            // Share the cores between the trainers instead of oversubscribing them.
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let per = (cores / self.desired_trainers.max(1) as usize).max(1);
            cmd.env("RAYON_NUM_THREADS", per.to_string());
        }
        // Its own process group: a terminal's Ctrl-C reaches only `edl run`, which stops
        // the children in order (trainers drain first). Tied to this process: if `edl run`
        // dies, however it dies, its children are SIGKILLed.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = edl_coord::local_etcd::spawn_tied_to_process(cmd)
            .with_context(|| format!("start {name}"))?;
        tracing::info!(process = %name, pid = child.id(), "started");
        self.procs.push(Proc {
            role,
            slot,
            name,
            child,
            stopping: false,
            injected: false,
            stopped_until: None,
        });
        Ok(())
    }

    fn live(&self, role: Role) -> impl Iterator<Item = &Proc> {
        self.procs
            .iter()
            .filter(move |p| p.role == role && !p.stopping)
    }

    async fn registered_trainers(&self) -> usize {
        self.backend
            .range(&self.keys.trainers())
            .await
            .map_or(0, |(kvs, _)| kvs.len())
    }

    async fn leader(&self) -> Option<(String, Vec<u8>)> {
        let (kvs, _) = self
            .backend
            .range(&self.keys.master_election())
            .await
            .ok()?;
        kvs.into_iter()
            .min_by_key(|kv| kv.create_revision)
            .map(|kv| (kv.key, kv.value))
    }

    async fn run(
        &mut self,
        shutdown: &CancellationToken,
        started: Instant,
        quiet: bool,
        timeout: Duration,
    ) -> anyhow::Result<RunReport> {
        let outcome = self.supervise(shutdown, started, quiet, timeout).await;
        let (succeeded, error) = match &outcome {
            Ok(()) => (true, None),
            Err(e) => (false, Some(format!("{e:#}"))),
        };
        // Final parameters and evaluation, while the pservers still run.
        let (metric, params_file) = if succeeded {
            match self.finish_params().await {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "final evaluation");
                    (None, None)
                }
            }
        } else {
            (None, None)
        };
        let status = self.status().await;
        self.stop_all().await;
        let succeeded = succeeded && metric.is_some();
        let error = error.or_else(|| (!succeeded).then(|| "no final evaluation".to_owned()));
        let unrecovered: Vec<String> = self
            .pending
            .iter()
            .map(|p| format!("{} of {} {}", p.fault, p.role.name(), p.process))
            .collect();
        let _ = self
            .backend
            .put(
                &self.keys.state(),
                JobStateRecord {
                    version: RECORD_VERSION,
                    state: match &error {
                        None => FinalState::Succeeded,
                        Some(e) if e.contains("edl kill") => FinalState::Stopped,
                        Some(_) => FinalState::Failed,
                    },
                    reason: error.clone(),
                    at_ms: now_ms(),
                }
                .encode(),
                None,
            )
            .await;
        let c = status.as_ref().and_then(|s| s.counters).unwrap_or_default();
        Ok(RunReport {
            version: RUN_REPORT_VERSION,
            job: self.spec.name.to_string(),
            succeeded,
            error,
            coordination: self.coordination.clone(),
            passes: c.passes_completed,
            records_trained: c.records_trained,
            duplicate_records: c.duplicate_records,
            cutoff_records: twice_trained_bound(&c),
            lost_records: c.lost_records,
            failed_tasks: status
                .map(|s| {
                    s.failed_tasks
                        .into_iter()
                        .map(|f| FailedTaskReport {
                            task: f.id,
                            pass: f.pass,
                            records: f.records,
                            reason: f.reason,
                        })
                        .collect()
                })
                .unwrap_or_default(),
            final_metric: metric,
            recoveries: self.recoveries.clone(),
            unrecovered,
            restarts: self.restarts,
            scale_events: self.scale_events.clone(),
            params_file,
            run_dir: self.run_dir.display().to_string(),
            wall_s: started.elapsed().as_secs_f64(),
        })
    }

    fn master_client(&self) -> MasterClient {
        let mut cfg = MasterClientConfig::new(self.spec.name.clone());
        cfg.retry_for = Duration::from_secs(2);
        cfg.call_timeout = Duration::from_secs(2);
        MasterClient::new(self.backend.clone(), cfg, CancellationToken::new())
    }

    async fn status(&self) -> Option<StatusResponse> {
        self.master_client().status().await.ok()
    }

    /// One short attempt (recovery checks must not stall the supervisor).
    async fn quick_status(&self) -> Option<StatusResponse> {
        let mut cfg = MasterClientConfig::new(self.spec.name.clone());
        cfg.retry_for = Duration::from_millis(300);
        cfg.call_timeout = Duration::from_millis(300);
        MasterClient::new(self.backend.clone(), cfg, CancellationToken::new())
            .status()
            .await
            .ok()
    }

    async fn supervise(
        &mut self,
        shutdown: &CancellationToken,
        started: Instant,
        quiet: bool,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        prepare_job(&self.backend, &self.spec, &self.run_dir).await?;
        for i in 0..self.spec.cluster.masters {
            self.spawn(Role::Master, i)?;
        }
        for i in 0..self.spec.cluster.pservers {
            self.spawn(Role::Pserver, i)?;
        }
        for _ in 0..self.spec.cluster.trainers {
            let n = self.next_trainer;
            self.next_trainer += 1;
            self.spawn(Role::Trainer, n)?;
        }
        let mut display = Display::new(quiet);
        let mut next_chaos = ChaosClock::new(self.chaos.as_ref(), started);
        let mut last_poll = Instant::now() - Duration::from_secs(10);
        let control_key = self.keys.control();
        let scale_key = self.keys.scale_trainers();
        loop {
            if shutdown.is_cancelled() {
                anyhow::bail!("interrupted");
            }
            anyhow::ensure!(
                started.elapsed() < timeout,
                "the job did not finish within {timeout:?}"
            );
            self.reap().await?;
            self.resume_stopped();
            self.restart_due(false)?;
            self.check_recoveries().await;
            if let Some(fault) = next_chaos.due() {
                self.inject(fault).await;
            }
            if last_poll.elapsed() >= Duration::from_millis(500) {
                last_poll = Instant::now();
                if let Ok(Some(kv)) = self.backend.get(&control_key).await
                    && ControlRecord::decode(&kv.value)
                        .is_ok_and(|c| c.command == edl_job::Control::Stop)
                {
                    anyhow::bail!("stopped by `edl kill`");
                }
                if let Ok(Some(kv)) = self.backend.get(&scale_key).await
                    && let Ok(ScaleRecord { trainers: n, .. }) = ScaleRecord::decode(&kv.value)
                {
                    self.scale(n, started)?;
                }
                let status = self.status().await;
                let alive = self.registered_trainers().await;
                display.update(status.as_ref(), alive, self.restarts, &self.recoveries);
                if let Some(s) = &status
                    && s.finished
                {
                    display.finish();
                    // Trainers stop on their own at the end of the job; pservers killed
                    // near the end come back (the final parameters are pulled from them).
                    let deadline = Instant::now() + Duration::from_secs(60);
                    loop {
                        self.reap().await?;
                        self.resume_stopped();
                        self.restart_due(true)?;
                        self.check_recoveries().await;
                        let waiting = self.live(Role::Trainer).count() > 0
                            || self
                                .restart_queue
                                .iter()
                                .any(|(r, _, _)| *r != Role::Trainer);
                        if !waiting || Instant::now() >= deadline {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    return Ok(());
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Starts the processes whose restart is due (trainers too unless `skip_trainers`).
    fn restart_due(&mut self, skip_trainers: bool) -> anyhow::Result<()> {
        let now = Instant::now();
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.restart_queue)
            .into_iter()
            .partition(|(r, _, at)| now >= *at && !(skip_trainers && *r == Role::Trainer));
        self.restart_queue = later;
        for (role, slot, _) in due {
            self.spawn(role, slot)?;
        }
        Ok(())
    }

    /// Collects exited processes; restarts crashed ones.
    async fn reap(&mut self) -> anyhow::Result<()> {
        let mut i = 0;
        while i < self.procs.len() {
            let status = self.procs[i].child.try_wait().context("wait for a child")?;
            let Some(status) = status else {
                i += 1;
                continue;
            };
            let p = self.procs.remove(i);
            if p.role == Role::Trainer && status.success() {
                tracing::info!(process = %p.name, "exited");
                continue;
            }
            if p.stopping {
                continue;
            }
            if p.role == Role::Trainer && self.status().await.is_some_and(|s| s.finished) {
                continue;
            }
            let count = self.restart_counts.entry((p.role, p.slot)).or_insert(0);
            *count += 1;
            if p.injected {
                tracing::info!(process = %p.name, %status, "restarting after an injected fault");
                self.restart_queue.push((p.role, p.slot, Instant::now()));
                continue;
            }
            self.restarts += 1;
            anyhow::ensure!(
                self.restarts <= self.spec.cluster.max_restarts,
                "{} exited with {status} and the restart budget ({}) is spent; see {}",
                p.name,
                self.spec.cluster.max_restarts,
                self.run_dir
                    .join("logs")
                    .join(format!("{}.log", p.name))
                    .display()
            );
            let backoff = Duration::from_millis(500)
                .saturating_mul(1 << (*count).min(5))
                .min(Duration::from_secs(10));
            tracing::warn!(process = %p.name, %status, ?backoff, "crashed; restarting");
            self.recoveries.push(Recovery {
                fault: "crash".into(),
                role: p.role.name().into(),
                process: p.name.clone(),
                seconds: backoff.as_secs_f64(),
            });
            self.restart_queue
                .push((p.role, p.slot, Instant::now() + backoff));
        }
        Ok(())
    }

    fn resume_stopped(&mut self) {
        for p in &mut self.procs {
            if let Some(until) = p.stopped_until
                && Instant::now() >= until
            {
                p.signal("CONT");
                p.stopped_until = None;
            }
        }
    }

    fn scale(&mut self, asked: u32, started: Instant) -> anyhow::Result<()> {
        let c = &self.spec.cluster;
        let want = asked.clamp(c.min_trainers, c.max_trainers());
        if want == self.desired_trainers {
            return Ok(());
        }
        tracing::info!(from = self.desired_trainers, to = want, "scaling trainers");
        self.scale_events.push(ScaleEvent {
            at_s: started.elapsed().as_secs_f64(),
            from: self.desired_trainers,
            to: want,
        });
        self.desired_trainers = want;
        let live = self.live(Role::Trainer).count() as u32
            + self
                .restart_queue
                .iter()
                .filter(|(r, _, _)| *r == Role::Trainer)
                .count() as u32;
        if want > live {
            for _ in live..want {
                let n = self.next_trainer;
                self.next_trainer += 1;
                self.spawn(Role::Trainer, n)?;
            }
        } else {
            let mut surplus = live - want;
            for p in self.procs.iter_mut().rev() {
                if surplus == 0 {
                    break;
                }
                if p.role == Role::Trainer && !p.stopping {
                    p.signal("TERM");
                    p.stopping = true;
                    surplus -= 1;
                }
            }
        }
        Ok(())
    }

    async fn inject(&mut self, fault: Fault) {
        let role = match fault {
            Fault::KillTrainer | Fault::StopTrainer => Role::Trainer,
            Fault::KillPserver => Role::Pserver,
            Fault::KillMaster => Role::Master,
        };
        let registered: Vec<String> = if role == Role::Trainer {
            self.backend
                .range(&self.keys.trainers())
                .await
                .map(|(kvs, _)| kvs.into_iter().map(|kv| kv.key).collect())
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        let trainers_prefix = self.keys.trainers();
        let mut candidates: Vec<usize> = self
            .procs
            .iter()
            .enumerate()
            .filter(|(_, p)| {
                p.role == role && !p.stopping && !p.injected && p.stopped_until.is_none()
            })
            // A trainer is a victim once registered (else its "recovery" is instant).
            .filter(|(_, p)| {
                role != Role::Trainer
                    || registered.contains(&format!("{trainers_prefix}{}", p.name))
            })
            .map(|(i, _)| i)
            .collect();
        if role == Role::Master {
            // The leading master: the election value is its address, which each master
            // prints when it starts.
            let leader = self
                .leader()
                .await
                .map(|(_, v)| String::from_utf8_lossy(&v).into_owned());
            let log_addr = |p: &Proc| -> Option<String> {
                let log = std::fs::read_to_string(
                    self.run_dir.join("logs").join(format!("{}.log", p.name)),
                )
                .ok()?;
                log.lines()
                    .rev()
                    .find_map(|l| l.strip_prefix("master listening on ").map(str::to_owned))
            };
            if let Some(leader) = leader {
                candidates.sort_by_key(|&i| log_addr(&self.procs[i]).is_none_or(|a| a != leader));
            }
        }
        if candidates.is_empty() {
            return;
        }
        let pick = if role == Role::Master {
            candidates[0]
        } else {
            candidates[self.rng.random_range(0..candidates.len())]
        };
        let check = match role {
            Role::Trainer if fault == Fault::StopTrainer => Check::TrainerGone {
                key: self.keys.trainer(&self.procs[pick].name),
            },
            Role::Trainer => Check::Trainer {
                key: self.keys.trainer(&self.procs[pick].name),
                want: self.registered_trainers().await,
            },
            Role::Pserver => {
                let key = self.keys.ps(self.procs[pick].slot);
                let old_create = self
                    .backend
                    .get(&key)
                    .await
                    .ok()
                    .flatten()
                    .map_or(0, |kv| kv.create_revision);
                Check::Pserver { key, old_create }
            }
            Role::Master => Check::Master {
                old_leader: self.leader().await.map(|(k, _)| k.into_bytes()),
            },
        };
        let p = &mut self.procs[pick];
        let fault_name = match fault {
            Fault::StopTrainer => {
                p.signal("STOP");
                p.stopped_until = Some(Instant::now() + 2 * self.spec.cluster.lease_ttl);
                p.injected = true;
                "sigstop"
            }
            _ => {
                p.injected = true;
                let _ = p.child.kill();
                "sigkill"
            }
        };
        tracing::warn!(process = %p.name, fault = fault_name, "chaos: injected");
        self.pending.push(Pending {
            fault: fault_name,
            role,
            process: p.name.clone(),
            at: Instant::now(),
            check,
        });
    }

    async fn check_recoveries(&mut self) {
        let mut i = 0;
        while i < self.pending.len() {
            let done = match &self.pending[i].check {
                Check::Trainer { key, want } => {
                    let gone = self.backend.get(key).await.is_ok_and(|kv| kv.is_none());
                    gone && self.registered_trainers().await >= *want
                }
                Check::TrainerGone { key } => {
                    self.backend.get(key).await.is_ok_and(|kv| kv.is_none())
                }
                Check::Pserver { key, old_create } => {
                    let claim = self.backend.get(key).await.ok().flatten();
                    match claim.filter(|kv| kv.create_revision != *old_create) {
                        Some(kv) => match serde_json::from_slice::<PsRecord>(&kv.value) {
                            Ok(r) => edl_pserver::client::probe(
                                &r.addr,
                                self.spec.name.as_str(),
                                None,
                                Duration::from_millis(500),
                            )
                            .await
                            .is_ok(),
                            Err(_) => true,
                        },
                        None => false,
                    }
                }
                Check::Master { old_leader } => {
                    let now = self.leader().await.map(|(k, _)| k.into_bytes());
                    now.is_some() && now != *old_leader && self.quick_status().await.is_some()
                }
            };
            if done {
                let p = self.pending.remove(i);
                let secs = p.at.elapsed().as_secs_f64();
                tracing::info!(process = %p.process, fault = p.fault, seconds = secs, "recovered");
                self.recoveries.push(Recovery {
                    fault: p.fault.into(),
                    role: p.role.name().into(),
                    process: p.process,
                    seconds: secs,
                });
            } else {
                i += 1;
            }
        }
    }

    /// Pulls the final parameters, writes them, and evaluates them.
    async fn finish_params(&self) -> anyhow::Result<(Option<FinalMetric>, Option<String>)> {
        final_params(&self.backend, &self.spec, &self.run_dir).await
    }

    async fn stop_all(&mut self) {
        // Trainers first (drain), then pservers and masters.
        for role in [Role::Trainer, Role::Pserver, Role::Master] {
            for p in self.procs.iter_mut().filter(|p| p.role == role) {
                if p.stopped_until.is_some() {
                    p.signal("CONT");
                }
                p.signal("TERM");
                p.stopping = true;
            }
            let deadline = Instant::now() + Duration::from_secs(40);
            loop {
                let mut left = 0;
                for p in self.procs.iter_mut().filter(|p| p.role == role) {
                    if matches!(p.child.try_wait(), Ok(None)) {
                        left += 1;
                    }
                }
                if left == 0 || Instant::now() >= deadline {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            for p in self.procs.iter_mut().filter(|p| p.role == role) {
                let _ = p.child.kill();
                let _ = p.child.wait();
            }
        }
        self.procs.clear();
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        for p in &mut self.procs {
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
    }
}

/// Stores the spec and the run's whereabouts; refuses a job name that is running or ran.
/// Only then clears the logs and checkpoints of an earlier run in the same directory.
async fn prepare_job(
    backend: &Arc<dyn Backend>,
    spec: &JobSpec,
    run_dir: &Path,
) -> anyhow::Result<()> {
    let keys = JobKeys::new(&spec.name);
    if let Some(kv) = backend
        .get(&keys.state())
        .await
        .context("read the job state")?
    {
        anyhow::bail!(
            "job {} already ran in this etcd ({}); use another name, or delete its keys (etcdctl del --prefix {})",
            spec.name,
            String::from_utf8_lossy(&kv.value),
            keys.root()
        );
    }
    let run = RunRecord {
        version: RECORD_VERSION,
        pid: std::process::id(),
        dir: run_dir.display().to_string(),
        host: std::env::var("HOSTNAME").unwrap_or_default(),
        started_ms: now_ms(),
    };
    let run_key = keys.run();
    let claimed = backend
        .txn(
            edl_coord::Txn::new()
                .when([
                    edl_coord::Compare::absent(&run_key),
                    edl_coord::Compare::absent(keys.state()),
                ])
                .and_then([edl_coord::Op::put(&run_key, run.encode())]),
        )
        .await
        .context("record the run in etcd")?;
    anyhow::ensure!(
        claimed.succeeded,
        "job {} is already running or ran in this etcd (see `edl status {}`); use another name",
        spec.name,
        spec.name
    );
    spec.publish(backend).await?;
    // A run starts a new job: the logs and checkpoints of an earlier run in the same
    // directory go (checkpoints are only ever restored through this job's manifests).
    for stale in ["logs", "checkpoints"] {
        let p = run_dir.join(stale);
        if std::fs::symlink_metadata(&p).is_ok() {
            std::fs::remove_dir_all(&p).with_context(|| format!("remove {}", p.display()))?;
        }
    }
    std::fs::create_dir_all(run_dir.join("logs"))
        .with_context(|| format!("create {}", run_dir.join("logs").display()))?;
    Ok(())
}

/// Pulls the final parameters, writes `params.json` and evaluates them on the test split
/// (else the training split).
async fn final_params(
    backend: &Arc<dyn Backend>,
    spec: &JobSpec,
    run_dir: &Path,
) -> anyhow::Result<(Option<FinalMetric>, Option<String>)> {
    let cancel = CancellationToken::new();
    let _guard = cancel.clone().drop_guard();
    let mut cfg = edl_pserver::PsClientConfig::new(spec.name.clone());
    cfg.retry_for = Duration::from_secs(20);
    let client = PsClient::connect(backend.clone(), cfg, cancel.child_token()).await?;
    let mut cache = DenseCache::new();
    client.pull_dense(&mut cache).await?;
    let dense: Vec<serde_json::Value> = cache
        .params()
        .iter()
        .map(|p| serde_json::json!({"name": p.name, "shape": p.shape, "values": p.values}))
        .collect();
    let path = run_dir.join("params.json");
    let text = serde_json::to_string(&serde_json::json!({
        "job": spec.name,
        "model": spec.model,
        "dense": dense,
    }))?;
    std::fs::write(&path, text).with_context(|| format!("write {}", path.display()))?;
    let model: Arc<dyn Model> = Arc::from(edl_trainer::build(&spec.model)?);
    let (split, globs) = match &spec.data.test {
        Some(t) => ("test", t.patterns()),
        None => ("train", spec.data.train.patterns()),
    };
    let samples = Arc::new(edl_trainer::load_samples(&globs)?);
    let store: Arc<dyn ParamStore> = Arc::new(PsStore::new(
        client,
        edl_trainer::job::param_config(spec),
        spec.train.seed,
    ));
    let mut params = edl_trainer::Params::default();
    store.pull_dense(&mut params).await?;
    let eval = edl_trainer::runtime::evaluate(
        &model,
        &store,
        &mut params,
        &samples,
        spec.train.eval_batch_size,
    )
    .await?;
    let metric = model.metric();
    Ok((
        Some(FinalMetric {
            name: metric.name().into(),
            value: metric.value(&eval),
            split: split.into(),
        }),
        Some(path.display().to_string()),
    ))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    KillTrainer,
    KillPserver,
    KillMaster,
    StopTrainer,
}

struct ChaosClock {
    next: Vec<(Fault, Duration, Instant)>,
}

impl ChaosClock {
    fn new(chaos: Option<&Chaos>, started: Instant) -> ChaosClock {
        let mut next = Vec::new();
        if let Some(c) = chaos {
            for (f, every) in [
                (Fault::KillTrainer, c.kill_trainer),
                (Fault::KillPserver, c.kill_pserver),
                (Fault::KillMaster, c.kill_master),
                (Fault::StopTrainer, c.stop_trainer),
            ] {
                if let Some(d) = every {
                    next.push((f, d, started + d));
                }
            }
        }
        ChaosClock { next }
    }

    fn due(&mut self) -> Option<Fault> {
        let now = Instant::now();
        for (f, every, at) in &mut self.next {
            if now >= *at {
                *at = now + *every;
                return Some(*f);
            }
        }
        None
    }
}

/// The live progress line (a spinner with a message on a terminal; a log line every few
/// seconds otherwise).
struct Display {
    bar: Option<indicatif::ProgressBar>,
    last_line: Instant,
    last_records: (Instant, u64),
    rate: f64,
}

impl Display {
    fn new(quiet: bool) -> Display {
        let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
            let b = indicatif::ProgressBar::new(0);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} tasks  {msg}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            b.enable_steady_tick(Duration::from_millis(200));
            b
        });
        Display {
            bar,
            last_line: Instant::now() - Duration::from_secs(60),
            last_records: (Instant::now(), 0),
            rate: 0.0,
        }
    }

    fn update(
        &mut self,
        status: Option<&StatusResponse>,
        trainers: usize,
        restarts: u32,
        recoveries: &[Recovery],
    ) {
        let Some(s) = status else {
            if let Some(b) = &self.bar {
                b.set_message("waiting for the master");
            }
            return;
        };
        let records = s.counters.map_or(0, |c| c.records_trained);
        let dt = self.last_records.0.elapsed().as_secs_f64();
        if dt >= 1.0 {
            self.rate = (records.saturating_sub(self.last_records.1)) as f64 / dt;
            self.last_records = (Instant::now(), records);
        }
        let total = s.todo + s.pending + s.done + s.failed;
        let msg = format!(
            "pass {}/{}  {:.0} samples/s  trainers {}  recoveries {}  restarts {}",
            s.pass + 1,
            s.passes.max(1),
            self.rate,
            trainers,
            recoveries.len(),
            restarts
        );
        match &self.bar {
            Some(b) => {
                b.set_length(total);
                b.set_position(s.done);
                b.set_message(msg);
            }
            None => {
                if self.last_line.elapsed() >= Duration::from_secs(2) {
                    self.last_line = Instant::now();
                    println!("[edl run] tasks {}/{}  {msg}", s.done, total);
                }
            }
        }
    }

    fn finish(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}

/// Every role in this process, on the in-memory backend (no chaos, no processes).
async fn run_in_memory(
    spec: JobSpec,
    args: &RunArgs,
    run_dir: PathBuf,
    shutdown: CancellationToken,
    started: Instant,
) -> anyhow::Result<RunReport> {
    let backend: Arc<dyn Backend> = Arc::new(MemBackend::new());
    prepare_job(&backend, &spec, &run_dir).await?;
    // The roles' logs go to RUN_DIR/logs/<role>.log, as the child processes' do.
    crate::logging::set_role_log_dir(run_dir.join("logs"));
    let roles = CancellationToken::new();
    let _stop_roles = roles.clone().drop_guard();
    let ttl = spec.cluster.lease_ttl;
    for i in 0..spec.cluster.masters {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let mut cfg = edl_master::MasterConfig::new(spec.name.clone());
        cfg.lease_ttl = ttl;
        cfg.reconcile_every = ttl;
        cfg.default_chunks_per_task = 1;
        let (b, t) = (backend.clone(), roles.clone());
        let role = crate::logging::role_span(&format!("master-{i}"));
        tokio::spawn(async move {
            if let Err(e) = edl_master::run(b, cfg, listener, t).instrument(role).await {
                tracing::error!(master = i, error = %e, "master failed");
            }
        });
    }
    for i in 0..spec.cluster.pservers {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let mut cfg = edl_pserver::PsConfig::new(spec.name.clone());
        cfg.lease_ttl = ttl;
        cfg.index = edl_pserver::IndexChoice::Fixed(i);
        cfg.shards = Some(spec.cluster.pservers);
        let ckpt = run_dir.join("checkpoints");
        std::fs::create_dir_all(&ckpt)?;
        cfg.checkpoint = Some(edl_pserver::CheckpointConfig {
            keep: spec.cluster.checkpoint_keep,
            ..edl_pserver::CheckpointConfig::new(
                &ckpt,
                edl_pserver::CheckpointEvery::Interval(spec.cluster.checkpoint_every),
            )
        });
        let (b, t) = (backend.clone(), roles.clone());
        let role = crate::logging::role_span(&format!("pserver-{i}"));
        tokio::spawn(async move {
            if let Err(e) = edl_pserver::run(b, cfg, listener, t).instrument(role).await {
                tracing::error!(pserver = i, error = %e, "pserver failed");
            }
        });
    }
    let mut trainers = Vec::new();
    for k in 0..spec.cluster.trainers {
        let role = crate::logging::role_span(&format!("trainer-{k}"));
        let mut cfg = TrainerConfig::new(spec.name.clone());
        cfg.id = format!("trainer-{k}");
        cfg.device = args.device;
        cfg.lease_ttl = Some(ttl);
        trainers.push(tokio::spawn(
            edl_trainer::process::run(backend.clone(), cfg, shutdown.child_token())
                .instrument(role),
        ));
    }
    let mut display = Display::new(args.quiet);
    let mut client_cfg = MasterClientConfig::new(spec.name.clone());
    client_cfg.retry_for = Duration::from_secs(2);
    let master = MasterClient::new(backend.clone(), client_cfg, roles.child_token());
    let mut error = None;
    let mut reports: Vec<TrainerReport> = Vec::new();
    loop {
        if shutdown.is_cancelled() {
            error = Some("interrupted".to_owned());
            break;
        }
        if started.elapsed() >= args.timeout {
            error = Some(format!("the job did not finish within {:?}", args.timeout));
            break;
        }
        let status = master.status().await.ok();
        display.update(
            status.as_ref(),
            trainers.iter().filter(|t| !t.is_finished()).count(),
            0,
            &[],
        );
        if trainers.iter().all(|t| t.is_finished()) {
            for t in trainers.drain(..) {
                match t.await {
                    Ok(Ok(r)) => reports.push(r),
                    Ok(Err(e)) => error = Some(format!("{e:#}")),
                    Err(e) => error = Some(format!("a trainer panicked: {e}")),
                }
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    display.finish();
    let status = master.status().await.ok();
    let finished = status.as_ref().is_some_and(|s| s.finished);
    if error.is_none() && !finished {
        error = Some("the trainers stopped before the job finished".into());
    }
    let (metric, params_file) = if error.is_none() {
        match final_params(&backend, &spec, &run_dir).await {
            Ok(x) => x,
            Err(e) => {
                error = Some(format!("final evaluation: {e:#}"));
                (None, None)
            }
        }
    } else {
        (None, None)
    };
    let c = status.as_ref().and_then(|s| s.counters).unwrap_or_default();
    Ok(RunReport {
        version: RUN_REPORT_VERSION,
        job: spec.name.to_string(),
        succeeded: error.is_none() && metric.is_some(),
        error,
        coordination: "memory".into(),
        passes: c.passes_completed,
        records_trained: c.records_trained,
        duplicate_records: c.duplicate_records,
        cutoff_records: twice_trained_bound(&c),
        lost_records: c.lost_records,
        failed_tasks: status
            .map(|s| {
                s.failed_tasks
                    .into_iter()
                    .map(|f| FailedTaskReport {
                        task: f.id,
                        pass: f.pass,
                        records: f.records,
                        reason: f.reason,
                    })
                    .collect()
            })
            .unwrap_or_default(),
        final_metric: metric,
        recoveries: Vec::new(),
        unrecovered: Vec::new(),
        restarts: 0,
        scale_events: Vec::new(),
        params_file,
        run_dir: run_dir.display().to_string(),
        wall_s: started.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chaos_specs_parse() {
        let c: Chaos = "kill-trainer=10s, kill-pserver=30s,kill-master=1m,stop-trainer=20s,seed=7"
            .parse()
            .expect("valid");
        assert_eq!(c.kill_trainer, Some(Duration::from_secs(10)));
        assert_eq!(c.kill_master, Some(Duration::from_secs(60)));
        assert_eq!(c.seed, 7);
        for bad in [
            "kill-trainer",
            "kill-everyone=1s",
            "kill-trainer=soon",
            "kill-trainer=10ms",
        ] {
            assert!(bad.parse::<Chaos>().is_err(), "{bad}");
        }
    }
}
