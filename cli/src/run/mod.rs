//! `edl run JOB.toml`: a whole job on one machine.
//!
//! - Coordination: `--etcd` (or `cluster.etcd` in the spec) when given; otherwise a
//!   private etcd (temp data dir, free loopback ports) when an `etcd` binary is on `PATH`;
//!   otherwise every role runs in this process on the in-memory backend (said in one
//!   line). `--coord memory|etcd` forces a choice.
//! - With etcd, masters, pservers and trainers are child processes of this same binary,
//!   supervised: a crashed process is restarted, at once after a healthy run
//!   (`cluster.healthy_after`), else with backoff; the job fails on a crash loop, when
//!   one slot fails fast more than `cluster.max_restarts` times in a row (see
//!   `supervisor`; injected faults and scale events do not count). Logs go to
//!   `<run dir>/logs/<process>.log`.
//! - `edl scale JOB --trainers N` (the `scale/trainers` key) is followed within
//!   `[min_trainers, max_trainers]`: new trainers are started, surplus ones drained
//!   (SIGTERM). `edl kill JOB` stops the job gracefully.
//! - `--autoscale` lets edl's autoscaler grow the job within its bounds while the
//!   machine's cores allow and trainers still speed it up (see `autoscale`).
//! - `--chaos SPEC` injects seeded faults; each recovery, from an injected fault or a
//!   crash, is measured until the role serves again.
//! - At the end: the final parameters (`<run dir>/params.json`), a summary, and with
//!   `--report FILE` the same as JSON. Exit 0 only if the job succeeded.
//!
//! # Layout
//!
//! - [`args`]: [`RunArgs`] and [`CoordChoice`].
//! - `access`: the job token, TLS and etcd credentials of the job's processes, and
//!   `--secure`, which makes them.
//! - [`chaos`]: the `--chaos` spec ([`Chaos`]) and the clock of due faults.
//! - `prepare`: data made from `[data.prepare]` in process, and the data check.
//! - `lifecycle`: the job in the coordination store: claimed at the start, final
//!   parameters pulled and evaluated, the end recorded.
//! - `autoscale`: `--autoscale`, edl's autoscaler over this machine and the job.
//! - `supervisor`: the supervisor as a pure state machine (events in, effects out, time
//!   as an argument).
//! - `procs`: the roles' command lines, child processes, signals.
//! - `faults`: fault injection: victims (the leading master through etcd and the
//!   masters' address files); recovery checks of injected faults and crashes.
//! - `processes`: the etcd mode (every role a child process), the shell that runs the supervisor's effects.
//! - `memory`: the in-memory mode, every role in this process.
//! - `display`: the live progress display.
//! - [`report`]: [`RunReport`], built once from either mode's outcome.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use edl_coord::{Backend, EtcdBackend, LocalEtcd};

use crate::common::{runtime, shutdown_on_signals};

mod access;
pub mod args;
mod autoscale;
pub mod chaos;
mod display;
mod faults;
mod lifecycle;
mod memory;
mod prepare;
mod processes;
mod procs;
pub mod report;
mod supervisor;

pub use args::{CoordChoice, RunArgs};
pub use chaos::Chaos;
pub(crate) use prepare::{check_checkpoint_dir, prepare_data};
pub use report::{
    FailedTaskReport, FinalMetric, RUN_REPORT_VERSION, Recovery, RecoveryKind, RunReport,
    ScaleEvent, recoveries_by_kind,
};

/// `--device` for a built-in model, resolved and checked before anything starts, so
/// that every trainer and the final evaluation get the same device and a bad choice is
/// one error instead of crash-looping trainers: `cuda:N` where it cannot be used is an
/// error naming why; `auto` is `cuda:0` where the probe passes, else the CPU (said in a
/// CUDA build, which could have used a GPU). An entry program's device is its own
/// business (its framework's, `EDL_DEVICE` as given).
fn resolve_device(
    choice: edl_trainer::DeviceChoice,
    entry: bool,
) -> anyhow::Result<edl_trainer::DeviceChoice> {
    use edl_trainer::DeviceChoice;
    let ordinal = match choice {
        _ if entry => return Ok(choice),
        DeviceChoice::Cpu => return Ok(choice),
        DeviceChoice::Auto => 0,
        DeviceChoice::Cuda(n) => n,
    };
    match (edl_trainer::cuda_probe(ordinal), choice) {
        (Ok(()), _) => Ok(DeviceChoice::Cuda(ordinal)),
        (Err(why), DeviceChoice::Cuda(n)) => anyhow::bail!("--device cuda:{n}: {why}"),
        (Err(why), _) => {
            if edl_trainer::CUDA_BUILD {
                tracing::warn!("--device auto: training on the CPU: {why}");
            }
            Ok(DeviceChoice::Cpu)
        }
    }
}

/// Runs `edl run`.
pub fn run(mut args: RunArgs) -> anyhow::Result<std::process::ExitCode> {
    let mut spec = edl_trainer::job::load(&args.spec)?;
    let chaos: Option<Chaos> = args.chaos.as_deref().map(str::parse).transpose()?;
    let in_spec = |e: anyhow::Error| e.context(format!("job spec {}", args.spec.display()));
    // The trainer program is found and checked before anything is made or started.
    let spec_dir = std::path::absolute(
        args.spec
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new(".")),
    )
    .context("resolve the spec's directory")?;
    let trainer = procs::TrainerProgram::of(&spec, &spec_dir).map_err(in_spec)?;
    args.device = resolve_device(args.device, trainer.entry)?;
    prepare::prepare_data(&spec).map_err(in_spec)?;
    prepare::check_data(&spec).map_err(in_spec)?;
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
    if spec.cluster.checkpoint_dir.is_some() {
        prepare::check_checkpoint_dir(&prepare::checkpoint_location(&spec, &run_dir))
            .map_err(in_spec)?;
    }
    let endpoints = if args.etcd.is_empty() {
        spec.cluster.etcd.clone()
    } else {
        args.etcd.clone()
    };
    let rt = runtime()?;
    let report_path = args.report.clone();
    let outcome = rt.block_on(async move {
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
                !trainer.entry,
                "[trainer] entry programs run as processes, which needs etcd: install etcd \
                 (scripts/test installs it) or pass --etcd"
            );
            anyhow::ensure!(
                chaos.is_none(),
                "--chaos needs etcd (processes are killed); install etcd or pass --etcd"
            );
            anyhow::ensure!(
                !args.secure,
                "--secure needs etcd (its per-job user and the processes' TLS); install etcd \
                 or pass --etcd"
            );
            anyhow::ensure!(
                !args.autoscale,
                "--autoscale needs etcd (trainers are processes it starts and drains); \
                 install etcd or pass --etcd"
            );
            println!(
                "edl run: no etcd given and none installed: running every role in this process on the in-memory backend"
            );
            return memory::run(spec, &args, run_dir, shutdown, started).await;
        }
        let mut private = None;
        let (endpoints, coordination) = if endpoints.is_empty() {
            let etcd = LocalEtcd::start(1).await.map_err(|e| {
                anyhow::anyhow!("start a private etcd: {e} (install etcd, or pass --etcd, or --coord memory)")
            })?;
            let eps = etcd.endpoints();
            println!("edl run: started a private etcd at {}", eps.join(","));
            private = Some(etcd);
            (eps, "private-etcd")
        } else {
            (endpoints, "etcd")
        };
        let given = access::Access {
            etcd_auth: args.etcd_access.auth()?,
            etcd_tls: args.etcd_access.tls(),
            ..Default::default()
        };
        let connect = |access: &access::Access| {
            let mut cfg = access.etcd_config(&endpoints);
            cfg.dial_timeout = Duration::from_secs(3);
            cfg.request_timeout = Duration::from_secs(5);
            let endpoints = endpoints.join(",");
            async move {
                tokio::time::timeout(Duration::from_secs(15), EtcdBackend::connect(cfg))
                    .await
                    .map_err(|_| anyhow::anyhow!("cannot reach etcd at {endpoints} (timed out)"))?
                    .map_err(crate::common::etcd_connect_error)
            }
        };
        let access = if !args.secure {
            given
        } else {
            let admin = if private.is_some() {
                access::lock_private_etcd(&endpoints).await?
            } else {
                Arc::new(connect(&given).await?)
            };
            let secured = access::secure(&admin, &spec.name, &run_dir, &given).await?;
            println!(
                "edl run: secure: TLS with a private CA ({}), a job token, and etcd user {} \
                 limited to the job's keys",
                run_dir.join("tls").display(),
                access::job_user(&spec.name)
            );
            secured
        };
        let backend: Arc<dyn Backend> = Arc::new(connect(&access).await?);
        let job = processes::ProcessRun {
            spec,
            backend,
            endpoints,
            run_dir,
            device: args.device,
            trainer,
            chaos,
            coordination: coordination.to_owned(),
            access,
            autoscale_cores: args.autoscale.then(|| {
                args.autoscale_cores.unwrap_or_else(|| {
                    std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
                })
            }),
        };
        let outcome = processes::run(job, &shutdown, started, args.quiet, args.timeout).await;
        drop(private);
        Ok(outcome)
    })?;
    let report = RunReport::new(outcome);
    report.print_summary();
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
