//! `/metrics` in Prometheus text format: the queue's counters and task counts, served on
//! the master's gRPC port (HTTP/1.1 `GET /metrics`).
//!
//! The counters are the durable ones of the queue record, so they continue across
//! failovers; a standby reports `edl_master_leader 0` and nothing else.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use std::sync::atomic::Ordering;

use crate::core::StatusReport;
use crate::snapshots::SnapshotStats;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

fn counter(reg: &mut Registry, name: &str, help: &str, v: u64) {
    let c: Counter = Counter::default();
    c.inc_by(v);
    reg.register(name, help, c);
}

fn gauge(reg: &mut Registry, name: &str, help: &str, v: i64) {
    let g: Gauge = Gauge::default();
    g.set(v);
    reg.register(name, help, g);
}

/// Renders the metrics of a master: `report` is `None` on a standby; `snapshots` what
/// its etcd snapshots did, when it takes them.
pub fn render(
    job: &str,
    report: Option<&StatusReport>,
    snapshots: Option<&SnapshotStats>,
) -> String {
    let mut reg = Registry::with_prefix_and_labels(
        "edl_master",
        [("job".into(), job.to_owned().into())].into_iter(),
    );
    gauge(
        &mut reg,
        "leader",
        "1 on the leading master, 0 on a standby",
        i64::from(report.is_some()),
    );
    if let Some(s) = report {
        gauge(
            &mut reg,
            "pass",
            "Current pass (0-based)",
            i64::from(s.pass),
        );
        gauge(&mut reg, "passes", "Passes of the job", i64::from(s.passes));
        gauge(
            &mut reg,
            "paused",
            "1 while the job is paused because etcd is full (see `edl status`)",
            i64::from(s.paused.is_some()),
        );
        gauge(
            &mut reg,
            "finished",
            "1 when every pass is done",
            i64::from(s.finished),
        );
        gauge(
            &mut reg,
            "task_timeout_seconds",
            "Current (adaptive) task lease timeout",
            (s.timeout_ms / 1000) as i64,
        );
        let tasks = Family::<StateLabel, Gauge>::default();
        for (state, n) in [
            ("todo", s.counts.todo),
            ("pending", s.counts.pending),
            ("done", s.counts.done),
            ("failed", s.counts.failed),
        ] {
            tasks.get_or_create(&StateLabel { state }).set(n as i64);
        }
        reg.register("tasks", "Tasks of the current pass by state", tasks);
        let c = &s.counters;
        for (name, help, v) in [
            ("tasks_dispatched", "Tasks leased to trainers", c.dispatched),
            (
                "tasks_finished",
                "Tasks whose records were trained",
                c.finished,
            ),
            (
                "task_failures",
                "Failure events (explicit, lost trainer, timeout)",
                c.failures,
            ),
            (
                "tasks_requeued",
                "Tasks put back to todo after a failure",
                c.requeued,
            ),
            ("task_timeouts", "Task leases that timed out", c.timeouts),
            (
                "leases_kept",
                "Task lease renewals of trainers waiting on a pserver or the master (since this master leads)",
                s.leases_kept,
            ),
            (
                "trainer_lost",
                "Leases revoked because their trainer's registration vanished",
                c.trainer_lost,
            ),
            (
                "tasks_released",
                "Tasks handed back by draining trainers",
                c.released,
            ),
            (
                "stale_reports",
                "Reports naming an old generation, rejected",
                c.stale_rejected,
            ),
            (
                "records_trained",
                "Records trained by finished tasks",
                c.records_trained,
            ),
            (
                "duplicate_records",
                "Records reported trained twice (hand-backs, failures)",
                c.duplicate_records,
            ),
            (
                "resumed_records",
                "Records trained before a drain's hand-back and not again (the next attempt resumed after them)",
                c.resumed_records,
            ),
            (
                "cutoff_records",
                "Records of tasks cut off by a lost or hung trainer (upper bound of retraining)",
                c.cutoff_records,
            ),
            ("failed_tasks", "Tasks failed for good", c.failed_tasks),
            (
                "lost_records",
                "Records of tasks failed for good",
                c.lost_records,
            ),
            ("passes_completed", "Passes completed", c.passes_completed),
            (
                "failovers",
                "Times a master rebuilt the queue from etcd",
                c.restores,
            ),
        ] {
            counter(&mut reg, name, help, v);
        }
    }
    if let Some(s) = snapshots {
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        counter(
            &mut reg,
            "etcd_snapshots",
            "Snapshots of the job's etcd this master wrote whole",
            get(&s.taken),
        );
        counter(
            &mut reg,
            "etcd_snapshot_failures",
            "Snapshots of the job's etcd that failed (nothing written)",
            get(&s.failed),
        );
        gauge(
            &mut reg,
            "etcd_snapshot_last_timestamp_seconds",
            "When the newest snapshot this master wrote was taken (unix time; 0: none)",
            get(&s.last_unix_seconds) as i64,
        );
        gauge(
            &mut reg,
            "etcd_snapshot_last_bytes",
            "Size of the newest snapshot this master wrote",
            get(&s.last_bytes) as i64,
        );
    }
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, &reg).is_err() {
        out.clear();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_states() {
        let mut s = StatusReport {
            dataset_set: true,
            passes: 2,
            ..StatusReport::default()
        };
        s.counts.todo = 3;
        s.counters.dispatched = 7;
        s.counters.restores = 1;
        s.leases_kept = 4;
        let text = render("mnist", Some(&s), None);
        assert!(
            text.contains("edl_master_leader{job=\"mnist\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("edl_master_tasks_dispatched_total{job=\"mnist\"} 7"),
            "{text}"
        );
        assert!(
            text.contains("edl_master_leases_kept_total{job=\"mnist\"} 4"),
            "{text}"
        );
        assert!(
            text.contains("edl_master_tasks{job=\"mnist\",state=\"todo\"} 3")
                || text.contains("edl_master_tasks{state=\"todo\",job=\"mnist\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("edl_master_failovers_total{job=\"mnist\"} 1"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
        let standby = render("mnist", None, None);
        assert!(standby.contains("edl_master_leader{job=\"mnist\"} 0"));
        assert!(!standby.contains("tasks_dispatched"));
    }
}
