//! [`TrainerReport`]: a trainer's final totals, printed as one JSON line by `edl trainer`
//! and collected by `edl run` (schema: docs/json.md).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Instant;

use serde::Serialize;

use crate::goodput::Goodput;
use crate::{Progress, PsStoreStats};

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
    /// When its first gradient step was pushed: seconds since the Unix epoch (wall
    /// clock, comparable across the processes of one machine), if it took one.
    pub first_step_unix_s: Option<f64>,
    /// When its last gradient step was pushed (as `first_step_unix_s`).
    pub last_step_unix_s: Option<f64>,
    /// Seconds it ran.
    pub wall_s: f64,
    /// Where those seconds went, per bucket (docs/design.md, "Goodput"; they sum to
    /// `wall_s`), when measured (the built-in loop; not a Python trainer's own).
    pub goodput: Option<BTreeMap<&'static str, f64>>,
}

fn unix_s(t: Option<std::time::SystemTime>) -> Option<f64> {
    t.and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_secs_f64())
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

pub(crate) fn report(
    (id, device): (&str, &str),
    p: &Progress,
    s: &PsStoreStats,
    started: Instant,
    goodput: Option<Goodput>,
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
        first_step_unix_s: unix_s(p.first_step_at),
        last_step_unix_s: unix_s(p.last_step_at),
        // Read after the goodput (its buckets sum to its own reading of the time since
        // the start, a moment before).
        wall_s: started.elapsed().as_secs_f64(),
        goodput: goodput.map(|g| g.named().collect()),
    }
}
