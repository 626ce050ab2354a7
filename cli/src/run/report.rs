//! The run report: what `edl run` prints at the end and writes with `--report`. Built
//! once, by `RunReport::new`, from the `Outcome` of either mode.

use edl_master_client::overview::{JobGoodput, goodput_line};
use edl_proto::master::StatusResponse;
use serde::Serialize;

/// One recovery from a fault.
#[derive(Debug, Clone, Serialize)]
pub struct Recovery {
    /// What happened: `sigkill`, `sigstop`, `notice`, `crash`.
    pub fault: String,
    /// The role hit.
    pub role: String,
    /// The process.
    pub process: String,
    /// Seconds from the fault (for a crash: from its exit seen) until the role served
    /// again (see the README).
    pub seconds: f64,
    /// A trainer's fault: seconds from the fault until none of the tasks it held was
    /// leased to it any more (back in the queue, leased to another trainer, or done).
    /// `None` when it held none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub task_back_s: Option<f64>,
    /// A trainer's fault: seconds from the fault until every task it held was leased to
    /// another trainer (or done): its work training again elsewhere. `None` when it held
    /// none, or the job ended first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub task_again_s: Option<f64>,
}

/// How long: of `count` times, the median, the 95th percentile (nearest rank) and the
/// longest, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Times {
    /// How many.
    pub count: usize,
    /// The median.
    pub median_s: f64,
    /// The 95th percentile (nearest rank: the smallest time at or above 95% of them).
    pub p95_s: f64,
    /// The longest.
    pub max_s: f64,
}

impl Times {
    /// `xs` summed up; `None` when empty.
    pub fn of(mut xs: Vec<f64>) -> Option<Times> {
        if xs.is_empty() {
            return None;
        }
        xs.sort_by(f64::total_cmp);
        let n = xs.len();
        let rank = |q: f64| xs[((q * n as f64).ceil() as usize).clamp(1, n) - 1];
        let median_s = match n % 2 {
            1 => xs[n / 2],
            _ => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
        };
        Some(Times {
            count: n,
            median_s,
            p95_s: rank(0.95),
            max_s: xs[n - 1],
        })
    }
}

/// The recoveries of one kind of fault (`fault` of `role`): how many, and their times.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RecoveryKind {
    /// `sigkill`, `sigstop`, `notice`, `crash`.
    pub fault: String,
    /// The role hit.
    pub role: String,
    /// Recoveries seen.
    pub count: usize,
    /// Seconds: the median, the 95th percentile (nearest rank) and the longest.
    pub median_s: f64,
    /// See `median_s`.
    pub p95_s: f64,
    /// See `median_s`.
    pub max_s: f64,
    /// A trainer's faults: until the tasks it held were no longer leased to it
    /// ([`Recovery::task_back_s`]), over those that held any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub task_back: Option<Times>,
    /// A trainer's faults: until the tasks it held were leased to another trainer
    /// ([`Recovery::task_again_s`]), over those that held any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub task_again: Option<Times>,
}

/// `recoveries` by kind (fault, then role), each kind's times summed up.
pub fn recoveries_by_kind(recoveries: &[Recovery]) -> Vec<RecoveryKind> {
    type Three = (Vec<f64>, Vec<f64>, Vec<f64>);
    let mut kinds: std::collections::BTreeMap<(&str, &str), Three> = Default::default();
    for r in recoveries {
        let (served, back, again) = kinds
            .entry((r.fault.as_str(), r.role.as_str()))
            .or_default();
        served.push(r.seconds);
        back.extend(r.task_back_s);
        again.extend(r.task_again_s);
    }
    kinds
        .into_iter()
        .filter_map(|((fault, role), (served, back, again))| {
            let t = Times::of(served)?;
            Some(RecoveryKind {
                fault: fault.to_owned(),
                role: role.to_owned(),
                count: t.count,
                median_s: t.median_s,
                p95_s: t.p95_s,
                max_s: t.max_s,
                task_back: Times::of(back),
                task_again: Times::of(again),
            })
        })
        .collect()
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
    /// The model's mean loss on the split.
    pub loss: f64,
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
    /// Tasks trained again because a restored parameter server lacked their updates
    /// (their records are in `records_trained` twice; never lost).
    pub recomputed_tasks: u64,
    /// Their records.
    pub recomputed_records: u64,
    /// Tasks handed back by draining trainers (a notice, a scale-down) after some of
    /// their batches were applied, and resumed after those by the next attempt.
    pub resumed_tasks: u64,
    /// Records of those batches: trained once (in `records_trained`), not again.
    pub resumed_records: u64,
    /// Renewals of the task leases of trainers that waited on a pserver or the master
    /// (a pull, a push or a report in flight) and so were not named stuck, counted by
    /// the master leading at the end since it leads.
    pub leases_kept: u64,
    /// Tasks failed for good, with reasons.
    pub failed_tasks: Vec<FailedTaskReport>,
    /// The final evaluation.
    pub final_metric: Option<FinalMetric>,
    /// Recoveries, one per injected fault or crash.
    pub recoveries: Vec<Recovery>,
    /// The recoveries by kind of fault and role: count, median, p95, max.
    pub recoveries_by_kind: Vec<RecoveryKind>,
    /// Faults injected and crashes whose recovery was not seen before the job ended.
    pub unrecovered: Vec<String>,
    /// Crash restarts: restarts after an unexpected exit (injected faults not counted),
    /// `preemptions` included.
    pub restarts: u32,
    /// Of the `restarts`, those of a process that had been healthy (run
    /// `cluster.healthy_after`): not counted against `cluster.max_restarts`.
    pub preemptions: u32,
    /// Notices (`--chaos notice-*`) whose process still ran at the notice's deadline,
    /// and was SIGKILLed then.
    pub notices_past_deadline: u32,
    /// Scale events.
    pub scale_events: Vec<ScaleEvent>,
    /// The final parameters.
    pub params_file: Option<String>,
    /// The run directory (logs, checkpoints).
    pub run_dir: String,
    /// Wall time.
    pub wall_s: f64,
    /// Where the trainers' time went, per bucket and per trainer, as the leading master
    /// last heard it (docs/design.md, "Goodput"); absent when no trainer measured it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub goodput: Option<JobGoodput>,
}

/// How a run ended, as either mode (processes on etcd, or in memory) knows it.
#[derive(Debug)]
pub(crate) struct Outcome {
    pub job: String,
    /// `etcd`, `private-etcd` or `memory`.
    pub coordination: String,
    /// Why the run failed, if it did.
    pub error: Option<String>,
    /// The master's last status (counters, failed tasks).
    pub status: Option<StatusResponse>,
    pub final_metric: Option<FinalMetric>,
    pub params_file: Option<String>,
    pub recoveries: Vec<Recovery>,
    pub unrecovered: Vec<String>,
    pub restarts: u32,
    pub preemptions: u32,
    pub notices_past_deadline: u32,
    pub scale_events: Vec<ScaleEvent>,
    pub run_dir: String,
    pub wall_s: f64,
}

impl Outcome {
    /// The error of the run: its own, else "no final evaluation" when there is none.
    /// (A run succeeds with no error and a final evaluation.)
    pub(crate) fn settle_error(&mut self) {
        if self.error.is_none() && self.final_metric.is_none() {
            self.error = Some("no final evaluation".to_owned());
        }
    }
}

impl RunReport {
    /// The report of a run.
    pub(crate) fn new(mut o: Outcome) -> RunReport {
        o.settle_error();
        let goodput = o.status.as_ref().and_then(JobGoodput::of);
        let c = o
            .status
            .as_ref()
            .and_then(|s| s.counters)
            .unwrap_or_default();
        RunReport {
            version: RUN_REPORT_VERSION,
            job: o.job,
            succeeded: o.error.is_none(),
            error: o.error,
            coordination: o.coordination,
            passes: c.passes_completed,
            records_trained: c.records_trained,
            duplicate_records: c.duplicate_records,
            cutoff_records: twice_trained_bound(&c),
            lost_records: c.lost_records,
            recomputed_tasks: c.recomputed,
            recomputed_records: c.recomputed_records,
            resumed_tasks: c.resumed,
            resumed_records: c.resumed_records,
            leases_kept: o.status.as_ref().map_or(0, |s| s.leases_kept),
            failed_tasks: o
                .status
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
            final_metric: o.final_metric,
            recoveries_by_kind: recoveries_by_kind(&o.recoveries),
            recoveries: o.recoveries,
            unrecovered: o.unrecovered,
            restarts: o.restarts,
            preemptions: o.preemptions,
            notices_past_deadline: o.notices_past_deadline,
            scale_events: o.scale_events,
            params_file: o.params_file,
            run_dir: o.run_dir,
            wall_s: o.wall_s,
            goodput,
        }
    }

    /// Prints the summary.
    pub(crate) fn print_summary(&self) {
        let r = self;
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
            "   passes {}  records trained {}  duplicates {} (+{} cut off)  recomputed {}  lost {}",
            r.passes,
            r.records_trained,
            r.duplicate_records,
            r.cutoff_records,
            r.recomputed_records,
            r.lost_records
        );
        if let Some(m) = &r.final_metric {
            println!(
                "   final {} on the {} split: {:.4}",
                m.name, m.split, m.value
            );
        }
        if let Some(g) = &r.goodput {
            println!(
                "   goodput of {} trainers: {}",
                g.trainers.len(),
                goodput_line(&g.seconds)
            );
        }
        for f in &r.failed_tasks {
            println!(
                "   failed task {} (pass {}, {} records): {}",
                f.task, f.pass, f.records, f.reason
            );
        }
        // Each recovery while they are few; by kind always.
        if r.recoveries.len() <= 10 {
            for rec in &r.recoveries {
                println!(
                    "   recovered from {} of {} {} in {:.2}s",
                    rec.fault, rec.role, rec.process, rec.seconds
                );
            }
        }
        for k in &r.recoveries_by_kind {
            println!(
                "   recoveries from {} of a {}: {}, median {:.2}s, p95 {:.2}s, max {:.2}s",
                k.fault, k.role, k.count, k.median_s, k.p95_s, k.max_s
            );
            if let Some(t) = &k.task_back {
                println!(
                    "     its tasks back in the queue: {}, median {:.2}s, p95 {:.2}s, max {:.2}s",
                    t.count, t.median_s, t.p95_s, t.max_s
                );
            }
            if let Some(t) = &k.task_again {
                println!(
                    "     its tasks leased again: {}, median {:.2}s, p95 {:.2}s, max {:.2}s",
                    t.count, t.median_s, t.p95_s, t.max_s
                );
            }
        }
        if r.restarts > 0 {
            println!(
                "   crash restarts: {} ({} after a healthy run)",
                r.restarts, r.preemptions
            );
        }
        if r.notices_past_deadline > 0 {
            println!(
                "   notices whose process still ran at the deadline (SIGKILLed): {}",
                r.notices_past_deadline
            );
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
}

/// The records of tasks cut off by a lost trainer, as a bound of what was trained
/// twice: a record trained twice was trained once in a task that was acknowledged, so
/// the bound never exceeds the records trained (a job that trained nothing reports 0).
fn twice_trained_bound(c: &edl_proto::master::Counters) -> u64 {
    c.cutoff_records.min(c.records_trained)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome() -> Outcome {
        Outcome {
            job: "j".into(),
            coordination: "memory".into(),
            error: None,
            status: Some(StatusResponse {
                counters: Some(edl_proto::master::Counters {
                    records_trained: 10,
                    cutoff_records: 25,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            final_metric: Some(FinalMetric {
                name: "cost".into(),
                value: 1.5,
                loss: 1.5,
                split: "test".into(),
            }),
            params_file: None,
            recoveries: Vec::new(),
            unrecovered: Vec::new(),
            restarts: 0,
            preemptions: 0,
            notices_past_deadline: 0,
            scale_events: Vec::new(),
            run_dir: "/r".into(),
            wall_s: 1.0,
        }
    }

    #[test]
    fn recoveries_are_summed_up_by_kind() {
        let rec = |fault: &str, role: &str, seconds: f64| Recovery {
            fault: fault.into(),
            role: role.into(),
            process: "p".into(),
            seconds,
            task_back_s: (role == "trainer").then_some(seconds / 2.0),
            task_again_s: (role == "trainer").then_some(seconds + 1.0),
        };
        let mut all: Vec<Recovery> = (1..=20)
            .map(|i| rec("sigkill", "trainer", f64::from(i) / 10.0))
            .collect();
        all.push(rec("sigkill", "master", 3.0));
        all.push(rec("sigkill", "master", 1.0));
        all.push(rec("sigstop", "trainer", 2.5));
        let kinds = recoveries_by_kind(&all);
        let k = |fault: &str, role: &str| {
            kinds
                .iter()
                .find(|k| k.fault == fault && k.role == role)
                .cloned()
                .unwrap_or_else(|| panic!("no {fault} of {role}: {kinds:?}"))
        };
        assert_eq!(kinds.len(), 3, "{kinds:?}");
        // 0.1 ..= 2.0: the median of 20 is between the 10th and 11th, the p95 the 19th.
        let t = k("sigkill", "trainer");
        assert_eq!(t.count, 20);
        assert!((t.median_s - 1.05).abs() < 1e-9, "{t:?}");
        assert!((t.p95_s - 1.9).abs() < 1e-9, "{t:?}");
        assert!((t.max_s - 2.0).abs() < 1e-9, "{t:?}");
        // Their tasks leased again a second after each: 1.1 ..= 3.0.
        let again = t.task_again.expect("the trainers' tasks");
        assert_eq!(again.count, 20);
        assert!((again.median_s - 2.05).abs() < 1e-9, "{again:?}");
        assert!((again.p95_s - 2.9).abs() < 1e-9, "{again:?}");
        assert_eq!(k("sigkill", "master").task_again, None);
        // Back in the queue at half of each: 0.05 ..= 1.0.
        let back = t.task_back.expect("the trainers' tasks");
        assert_eq!(back.count, 20);
        assert!((back.median_s - 0.525).abs() < 1e-9, "{back:?}");
        assert_eq!(k("sigkill", "master").task_back, None);
        let m = k("sigkill", "master");
        assert_eq!((m.count, m.median_s, m.p95_s, m.max_s), (2, 2.0, 3.0, 3.0));
        let s = k("sigstop", "trainer");
        assert_eq!((s.count, s.median_s, s.p95_s, s.max_s), (1, 2.5, 2.5, 2.5));
        assert!(recoveries_by_kind(&[]).is_empty());
    }

    #[test]
    fn a_run_succeeds_with_no_error_and_a_final_evaluation() {
        let r = RunReport::new(outcome());
        assert!(r.succeeded);
        assert_eq!(r.error, None);
        assert_eq!(r.version, RUN_REPORT_VERSION);
        assert_eq!(r.records_trained, 10);
        assert_eq!(r.cutoff_records, 10, "bounded by the records trained");

        let r = RunReport::new(Outcome {
            final_metric: None,
            ..outcome()
        });
        assert!(!r.succeeded);
        assert_eq!(r.error.as_deref(), Some("no final evaluation"));

        let r = RunReport::new(Outcome {
            error: Some("interrupted".into()),
            ..outcome()
        });
        assert!(!r.succeeded);
        assert_eq!(r.error.as_deref(), Some("interrupted"));
    }
}
