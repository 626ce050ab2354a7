//! The job's life in the coordination store, the same in both modes: claimed at the
//! start ([`prepare_job`]), its final parameters pulled and evaluated at the end
//! ([`final_params`]), its end recorded ([`record_end`]).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use edl_coord::Backend;
use edl_job::{FinalState, JobKeys, JobSpec, JobStateRecord, RECORD_VERSION, Record, RunRecord};
use edl_pserver_client::{DenseCache, PsClient};
use edl_trainer::{DeviceChoice, ModelSource};
use tokio_util::sync::CancellationToken;

use super::access::Access;
use super::procs::Launch;
use super::report::FinalMetric;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Stores the spec and the run's whereabouts; refuses a job name that is running or ran.
/// Only then clears the logs and checkpoints of an earlier run in the same directory.
pub(crate) async fn prepare_job(
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

/// How the final parameters are evaluated.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Evaluator<'a> {
    /// In this process, with the spec's built-in model, on the job's device.
    Builtin(DeviceChoice),
    /// By the job's `[trainer] entry` program, run once with `EDL_MODE=evaluate`.
    Entry(&'a Launch),
}

/// Pulls the final parameters, writes `params.json` and evaluates them on the test split
/// (else the training split).
pub(crate) async fn final_params(
    backend: &Arc<dyn Backend>,
    spec: &JobSpec,
    run_dir: &Path,
    evaluator: Evaluator<'_>,
    access: &Access,
) -> anyhow::Result<(Option<FinalMetric>, Option<String>)> {
    let cancel = CancellationToken::new();
    let _guard = cancel.clone().drop_guard();
    let mut cfg = access.ps_client(&spec.name);
    cfg.retry_for = Duration::from_secs(20);
    let client = PsClient::connect(backend.clone(), cfg.clone(), cancel.child_token()).await?;
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
        "entry": spec.trainer.entry,
        "dense": dense,
    }))?;
    std::fs::write(&path, text).with_context(|| format!("write {}", path.display()))?;
    let params_file = Some(path.display().to_string());
    let eval = match evaluator {
        Evaluator::Builtin(device) => {
            let device = edl_trainer::select_device(device)?;
            let model = ModelSource::builtin().build(spec, &device)?;
            edl_trainer::process::evaluate_job(backend.clone(), spec, model, cfg).await?
        }
        Evaluator::Entry(launch) => launch.evaluate().await?,
    };
    Ok((
        Some(FinalMetric {
            name: eval.metric.name().into(),
            value: eval.value,
            loss: eval.loss,
            split: eval.split,
        }),
        params_file,
    ))
}

/// Records how the job ended under `job/state` (best effort): `succeeded`, `stopped`
/// (by `edl kill`) or `failed`, with the reason.
pub(crate) async fn record_end(backend: &Arc<dyn Backend>, keys: &JobKeys, error: Option<&str>) {
    let _ = backend
        .put(
            &keys.state(),
            JobStateRecord {
                version: RECORD_VERSION,
                state: match error {
                    None => FinalState::Succeeded,
                    Some(e) if e.contains("edl kill") => FinalState::Stopped,
                    Some(_) => FinalState::Failed,
                },
                reason: error.map(str::to_owned),
                at_ms: now_ms(),
            }
            .encode(),
            None,
        )
        .await;
}
