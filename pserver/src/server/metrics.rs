//! The pserver's `/metrics` (`--metrics-addr`), behind the job's token
//! ([`edl_proto::metrics`]): its shard's counters, incarnation and whether it serves,
//! and the latency of pushes from arrival to reply.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::shard::Shard;

/// What the pserver measures itself (beyond the shard's counters).
#[derive(Debug, Clone)]
pub(crate) struct PsMetrics {
    /// Seconds from a push's arrival to its reply: async, validated, applied and held by
    /// every in-sync replica; sync, until its step closed.
    push_seconds: Histogram,
}

impl PsMetrics {
    pub(crate) fn new() -> Self {
        PsMetrics {
            // 50 us .. about 13 s.
            push_seconds: Histogram::new(exponential_buckets(5e-5, 4.0, 10)),
        }
    }

    /// A push answered after `took`.
    pub(crate) fn push_answered(&self, took: Duration) {
        self.push_seconds.observe(took.as_secs_f64());
    }
}

/// The metrics of `shard` in job `job`, OpenMetrics text.
pub(crate) fn render(job: &str, shard: &Shard, serving: bool, m: &PsMetrics) -> String {
    let mut reg = Registry::with_prefix_and_labels(
        "edl_pserver",
        [
            ("job".into(), job.to_owned().into()),
            ("shard".into(), shard.index().to_string().into()),
        ]
        .into_iter(),
    );
    let gauge = |reg: &mut Registry, name: &str, help: &str, v: i64| {
        let g: Gauge = Gauge::default();
        g.set(v);
        reg.register(name, help, g);
    };
    gauge(
        &mut reg,
        "serving",
        "1 while this process serves its shard (holds the claim, or is the primary of a replicated shard)",
        i64::from(serving),
    );
    gauge(
        &mut reg,
        "incarnation",
        "The claim revision the shard lives under: it changes on every restore",
        i64::try_from(shard.incarnation()).unwrap_or(i64::MAX),
    );
    reg.register(
        "push_seconds",
        "Seconds from a push's arrival to its reply (async: applied and replicated; sync: its step closed)",
        m.push_seconds.clone(),
    );
    if let Ok(core) = shard.core() {
        let c = &core.counters;
        for (name, help, v) in [
            (
                "pushes_applied",
                "Pushes applied (async) or accumulated (sync)",
                &c.pushes_applied,
            ),
            (
                "duplicate_pushes",
                "Retried pushes recognised and not applied again",
                &c.duplicate_pushes,
            ),
            (
                "nonfinite_rejected",
                "Pushes refused for NaN or infinite values",
                &c.nonfinite_rejected,
            ),
            (
                "invalid_rejected",
                "Pushes refused as malformed",
                &c.invalid_rejected,
            ),
            ("pulls", "Pulls served", &c.pulls),
            (
                "sparse_rows_pulled",
                "Sparse rows served",
                &c.sparse_rows_pulled,
            ),
            ("steps_closed", "Sync steps applied", &c.steps_closed),
            (
                "step_timeouts",
                "Sync steps closed by the timeout",
                &c.step_timeouts,
            ),
            ("tasks_done", "Tasks recorded as complete", &c.tasks_done),
            (
                "checkpoints_written",
                "Checkpoint files written",
                &c.checkpoints_written,
            ),
            (
                "checkpoints_failed",
                "Checkpoint writes that failed",
                &c.checkpoints_failed,
            ),
        ] {
            let counter: Counter = Counter::default();
            counter.inc_by(load(v));
            reg.register(name, help, counter);
        }
    }
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, &reg).is_err() {
        out.clear();
    }
    out
}

fn load(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

/// Serves `/metrics` for `shard` on `listener` until `stop`.
pub(crate) fn serve(
    listener: tokio::net::TcpListener,
    credentials: edl_proto::headers::Credentials,
    job: String,
    shard: Arc<Shard>,
    gate: Arc<super::service::Gate>,
    m: PsMetrics,
    stop: tokio_util::sync::CancellationToken,
) {
    let render = move || render(&job, &shard, gate.check().is_ok(), &m);
    edl_proto::metrics::serve(listener, credentials, Arc::new(render), stop);
}
