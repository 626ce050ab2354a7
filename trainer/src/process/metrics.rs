//! The trainer's `/metrics` endpoint: counters and gauges of its progress and its
//! parameter-server traffic, in the OpenMetrics text format.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry as PromRegistry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::goodput::{Goodput, GoodputClock};
use crate::{Progress, PsStoreStats};

/// The trainer's Prometheus metrics (OpenMetrics text).
pub(crate) fn render_metrics(
    (job, id, device): (&str, &str, &str),
    p: &Progress,
    s: &PsStoreStats,
    goodput: Option<Goodput>,
) -> String {
    let mut reg = PromRegistry::with_prefix_and_labels(
        "edl_trainer",
        [
            ("job".into(), job.to_owned().into()),
            ("trainer".into(), id.to_owned().into()),
            ("device".into(), device.to_owned().into()),
        ]
        .into_iter(),
    );
    let counter = |reg: &mut PromRegistry, name: &str, help: &str, v: u64| {
        let c: Counter = Counter::default();
        c.inc_by(v);
        reg.register(name, help, c);
    };
    counter(&mut reg, "tasks", "Tasks acknowledged", p.tasks);
    counter(
        &mut reg,
        "records",
        "Records trained in acknowledged tasks",
        p.records,
    );
    counter(&mut reg, "steps", "Gradient steps pushed", p.steps);
    counter(
        &mut reg,
        "failed_tasks",
        "Tasks failed for bad data",
        p.failed_tasks,
    );
    counter(
        &mut reg,
        "skipped_batches",
        "Batches skipped for a non-finite loss",
        p.skipped_batches,
    );
    counter(
        &mut reg,
        "pulls",
        "Dense pulls",
        s.pulls.load(Ordering::Relaxed),
    );
    counter(
        &mut reg,
        "pull_bytes",
        "Bytes of dense values pulled",
        s.pull_bytes.load(Ordering::Relaxed),
    );
    counter(
        &mut reg,
        "sparse_rows",
        "Sparse rows pulled",
        s.sparse_rows.load(Ordering::Relaxed),
    );
    counter(
        &mut reg,
        "pushes",
        "Pushes applied",
        s.pushes.load(Ordering::Relaxed),
    );
    let g: Gauge<f64, std::sync::atomic::AtomicU64> = Gauge::default();
    g.set(p.samples_per_sec);
    reg.register(
        "samples_per_second",
        "Samples per second over the last task",
        g,
    );
    let g: Gauge<f64, std::sync::atomic::AtomicU64> = Gauge::default();
    g.set(f64::from(p.last_loss));
    reg.register("loss", "Loss of the last step", g);
    let g: Gauge = Gauge::default();
    g.set(i64::from(p.pass));
    reg.register("pass", "Pass of the current task", g);
    if let Some(goodput) = goodput {
        let family = Family::<Vec<(String, String)>, Counter<f64, AtomicU64>>::default();
        for (bucket, secs) in goodput.named() {
            family
                .get_or_create(&vec![("bucket".to_owned(), bucket.to_owned())])
                .inc_by(secs);
        }
        reg.register(
            "goodput_seconds",
            "Seconds of the trainer's wall time per bucket (docs/design.md, Goodput)",
            family,
        );
    }
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, &reg).is_err() {
        out.clear();
    }
    out
}

/// The labels of every metric of a trainer.
pub(crate) struct Labels {
    /// The job.
    pub(crate) job: String,
    /// The trainer's id.
    pub(crate) id: String,
    /// The device it trains on.
    pub(crate) device: String,
}

/// Serves `GET /metrics` on `addr` until `stop`, behind the job's token
/// ([`edl_proto::metrics`]); returns the bound address.
pub(crate) async fn serve(
    addr: SocketAddr,
    credentials: edl_proto::headers::Credentials,
    labels: Labels,
    progress: watch::Receiver<Progress>,
    stats: Arc<PsStoreStats>,
    clock: GoodputClock,
    stop: CancellationToken,
) -> std::io::Result<SocketAddr> {
    let render = move || {
        render_metrics(
            (&labels.job, &labels.id, &labels.device),
            &progress.borrow(),
            &stats,
            clock.measured(),
        )
    };
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    edl_proto::metrics::serve(listener, credentials, Arc::new(render), stop);
    Ok(local)
}
