//! The in-memory mode: every role in this process on the in-memory backend (no
//! chaos, no processes).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use edl_coord::{Backend, MemBackend};
use edl_job::{JobSpec, MasterLaunch, PserverLaunch, TrainerLaunch};
use edl_master_client::{MasterClient, MasterClientConfig};
use edl_trainer::process::{TrainerConfig, TrainerReport};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::RunArgs;
use super::access::Access;
use super::display::Display;
use super::lifecycle::{Evaluator, final_params, prepare_job};
use super::report::Outcome;

/// Runs the job in this process.
pub(crate) async fn run(
    spec: JobSpec,
    args: &RunArgs,
    run_dir: PathBuf,
    shutdown: CancellationToken,
    started: Instant,
) -> anyhow::Result<Outcome> {
    let backend: Arc<dyn Backend> = Arc::new(MemBackend::new());
    prepare_job(&backend, &spec, &run_dir).await?;
    // The roles' logs go to RUN_DIR/logs/<role>.log, as the child processes' do.
    crate::logging::set_role_log_dir(run_dir.join("logs"));
    let roles = CancellationToken::new();
    let _stop_roles = roles.clone().drop_guard();
    // The roles' settings, translated from the spec as for child processes.
    let master = MasterLaunch::of(&spec.data, &spec.cluster);
    for i in 0..spec.cluster.masters {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let cfg = edl_master::MasterConfig::launch(spec.name.clone(), &master);
        let (b, t) = (backend.clone(), roles.clone());
        let role = crate::logging::role_span(&format!("master-{i}"));
        tokio::spawn(async move {
            if let Err(e) = edl_master::run(b, cfg, listener, t).instrument(role).await {
                tracing::error!(master = i, error = %e, "master failed");
            }
        });
    }
    // Every replica of every shard (slot `i` holds shard `i % pservers`).
    let checkpoints = super::prepare::checkpoint_location(&spec, &run_dir);
    for i in 0..spec.cluster.pservers * spec.cluster.pserver_replicas {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let launch = PserverLaunch::of(&spec.cluster, i, checkpoints.clone());
        let cfg = edl_pserver::PsConfig::launch(spec.name.clone(), &launch);
        let (b, t) = (backend.clone(), roles.clone());
        let role = crate::logging::role_span(&format!("pserver-{i}"));
        tokio::spawn(async move {
            if let Err(e) = edl_pserver::run(b, cfg, listener, t).instrument(role).await {
                tracing::error!(pserver = i, error = %e, "pserver failed");
            }
        });
    }
    let trainer = TrainerLaunch::of(&spec.trainer, &spec.cluster);
    let mut trainers = Vec::new();
    for k in 0..spec.cluster.trainers {
        let role = crate::logging::role_span(&format!("trainer-{k}"));
        let mut cfg = TrainerConfig::new(spec.name.clone());
        cfg.id = format!("trainer-{k}");
        cfg.device = args.device;
        cfg.lease_ttl = Some(trainer.lease_ttl);
        trainers.push(tokio::spawn(
            edl_trainer::process::run(
                backend.clone(),
                cfg,
                edl_trainer::ModelSource::builtin(),
                shutdown.child_token(),
            )
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
        match final_params(
            &backend,
            &spec,
            &run_dir,
            Evaluator::Builtin(args.device),
            &Access::default(),
        )
        .await
        {
            Ok(x) => x,
            Err(e) => {
                error = Some(format!("final evaluation: {e:#}"));
                (None, None)
            }
        }
    } else {
        (None, None)
    };
    Ok(Outcome {
        job: spec.name.to_string(),
        coordination: "memory".into(),
        error,
        status,
        final_metric: metric,
        params_file,
        recoveries: Vec::new(),
        unrecovered: Vec::new(),
        restarts: 0,
        preemptions: 0,
        notices_past_deadline: 0,
        scale_events: Vec::new(),
        run_dir: run_dir.display().to_string(),
        wall_s: started.elapsed().as_secs_f64(),
    })
}
