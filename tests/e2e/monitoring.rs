//! The monitoring in `deploy/monitoring.yaml` names only metrics edl serves: every
//! `edl_*` metric its Grafana dashboard and alert rules name is scraped from a real
//! master, pserver and trainer of a training job (or, for the operator's, rendered by the
//! operator's registry); and the pserver's and trainer's `/metrics` refuse a scrape
//! without the job token.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::support::{Proc, World, wait_until};
use crate::trainer::mnist_spec;

const TOKEN: &str = "monitoring-token";

/// `GET /metrics` from `addr` over HTTP/1.1, with `token` as the bearer token: the
/// status line and the body.
pub(crate) async fn scrape(addr: &str, token: Option<&str>) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let req = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("send");
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out))
        .await
        .expect("metrics answered in time")
        .expect("read");
    out
}

/// The address a process logged it serves `/metrics` on.
async fn metrics_addr(p: &Proc) -> String {
    p.wait_log("serving /metrics", Duration::from_secs(60))
        .await;
    let log = p.log();
    let line = log
        .lines()
        .find(|l| l.contains("serving /metrics"))
        .expect("the line");
    line.split("addr=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .map(|a| a.trim_matches('"').to_owned())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
}

/// The metric families of OpenMetrics `text` (histograms and counters by their family
/// name).
fn families(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// The sum of the samples of metric `name` in OpenMetrics `text`.
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Every `edl_*` metric named in `deploy/monitoring.yaml`, as a family name (the
/// `_total`, `_bucket`, `_sum` and `_count` of samples taken off).
fn named_in_monitoring() -> BTreeSet<String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/monitoring.yaml");
    let text = std::fs::read_to_string(path).expect("deploy/monitoring.yaml");
    let mut out = BTreeSet::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find("edl_") {
        let name: String = rest[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[i + name.len()..];
        let family = ["_total", "_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(&name);
        out.insert(family.to_owned());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_and_the_alerts_name_is_served() {
    let named = named_in_monitoring();
    for role in ["master", "pserver", "trainer", "operator"] {
        assert!(
            named.iter().any(|n| n.starts_with(&format!("edl_{role}_"))),
            "nothing of the {role} in {named:?}"
        );
    }
    let w = World::new("monitored").await;
    let spec = mnist_spec(&w, 50);
    // The master snapshots its etcd (authentication off here), so its snapshot
    // metrics are served too.
    let snapshots = w.dir.path().join("etcd-snapshots");
    let snapshots = snapshots.display().to_string();
    let token = ["--token", TOKEN, "--etcd-snapshots", &snapshots];
    let (_master, master_addr) = w.master("master", &token).await;
    let (ps, _) = w
        .pserver(
            "ps0",
            &[
                "--shards",
                "1",
                "--token",
                TOKEN,
                "--metrics-addr",
                "127.0.0.1:0",
            ],
        )
        .await;
    let trainer = w.trainer_with(
        "t0",
        &spec,
        &["--token", TOKEN, "--metrics-addr", "127.0.0.1:0"],
    );
    let ps_addr = metrics_addr(&ps).await;
    let trainer_addr = metrics_addr(&trainer).await;

    // Without the token: refused, saying how.
    for addr in [&ps_addr, &trainer_addr, &master_addr] {
        let denied = scrape(addr, None).await;
        assert!(
            denied.starts_with("HTTP/1.1 401") && denied.contains("Bearer"),
            "{addr}: {denied}"
        );
    }
    // With it, once the trainer pushed and the pserver measured the pushes.
    let trained = wait_until(Duration::from_secs(120), || async {
        let t = scrape(&trainer_addr, Some(TOKEN)).await;
        let p = scrape(&ps_addr, Some(TOKEN)).await;
        sample(&t, "edl_trainer_pushes_total") > 0.0
            && sample(&p, "edl_pserver_push_seconds_count") > 0.0
    })
    .await;
    assert!(
        trained,
        "no push measured:\n{}\n{}",
        trainer.log(),
        ps.log()
    );
    let mut served = BTreeSet::new();
    for addr in [&master_addr, &ps_addr, &trainer_addr] {
        let text = scrape(addr, Some(TOKEN)).await;
        assert!(text.starts_with("HTTP/1.1 200"), "{addr}: {text}");
        served.extend(families(&text));
    }
    #[cfg(feature = "kubernetes")]
    served.extend(families(
        &edl_operator::metrics::Metrics::default().render(),
    ));
    // (Without the operator in the build, its metrics are not checked.)
    #[cfg(not(feature = "kubernetes"))]
    let named: BTreeSet<String> = named
        .into_iter()
        .filter(|n| !n.starts_with("edl_operator_"))
        .collect();
    let missing: Vec<&String> = named.difference(&served).collect();
    assert!(
        missing.is_empty(),
        "deploy/monitoring.yaml names metrics no role serves: {missing:?}\nserved: {served:?}"
    );
}
