//! `edl bench scale`, short: the load command's own checks (every record read once per
//! pass, every pserver ledger holding every pass, every weight minus the tasks applied)
//! through 2 masters and 4 pserver processes on a real etcd, with the leading master
//! SIGKILLed a quarter of the way in. The full run (a million tasks, a thousand
//! trainers) is documented in docs/benchmarks.md. And `edl bench local`, edl's own
//! single-process loop of a job's model (docs/gpu.md).

use std::process::Command;

use crate::support::edl_bin;

#[test]
fn a_short_scale_run_reads_every_record_once_through_a_master_failover() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("out.json");
    let out = Command::new(edl_bin())
        .args([
            "bench",
            "scale",
            "--tasks",
            "3000",
            "--files",
            "300",
            "--trainers",
            "100",
            "--passes",
            "2",
            "--failover",
            "--timeout",
            "5m",
        ])
        .arg("--dir")
        .arg(dir.path().join("work"))
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run edl bench scale");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "edl bench scale failed:\n{text}");
    assert!(
        text.contains("checked: every record read once per pass"),
        "{text}"
    );
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("the JSON result")).unwrap();
    // What the master committed, from its durable counters (they survive the failover).
    let total = 3000 * 2;
    let n = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v}"));
    // Each task finished exactly once per pass, through the failover.
    assert_eq!(n("finished"), total, "{v}");
    // Leased at least once per pass; again only what was taken back (at most what the
    // 100 trainers held: one task each in training and one read ahead).
    let dispatched = n("dispatched");
    assert!(
        (total..=total + 100 * 2).contains(&dispatched),
        "{dispatched} leases for {total} tasks: {v}"
    );
    assert_eq!(
        n("recomputed"),
        0,
        "no pserver fault, nothing trained again: {v}"
    );
    assert!(
        n("failovers") >= 1,
        "the master's counters saw no failover: {v}"
    );
    // The trainers were told each task was applied once: at most once each, and every
    // other acknowledgement a retry whose first answer the failover lost.
    let (applied, repeated) = (n("acks_applied"), n("acks_repeated"));
    assert!(
        applied <= total && applied + repeated >= total,
        "{applied} acknowledgements applied and {repeated} repeated for {total} tasks: {v}"
    );
    assert!(
        v["failover_secs"].as_f64().is_some(),
        "no failover measured: {v}"
    );
    let records = v["records"].as_array().expect("record sizes");
    for kind in ["tasks/*", "job/queue", "job/files/*", "restores/*"] {
        let r = records
            .iter()
            .find(|r| r["kind"] == kind)
            .unwrap_or_else(|| panic!("no {kind} in {records:?}"));
        assert!(r["margin"].as_f64().unwrap() > 10.0, "{r}");
    }
}

/// `edl bench local`: the job's own model, data and optimizer in one process, per batch
/// size asked; it trains (the held-out cost falls), takes one step per batch of each
/// pass, and a device this build cannot use, or a spec without a built-in model, is one
/// clear error before any work.
#[test]
fn bench_local_trains_the_jobs_model_in_one_process_per_batch_size() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = crate::run::example(dir.path(), "fit_a_line", "job.toml", |s| s);
    let json = dir.path().join("local.json");
    let out = Command::new(edl_bin())
        .args(["bench", "local"])
        .arg(&spec)
        .args([
            "--batch", "20,101", "--passes", "2", "--device", "cpu", "--json",
        ])
        .arg(&json)
        .output()
        .expect("run edl bench local");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "edl bench local failed:\n{text}");
    let rows: Vec<serde_json::Value> =
        serde_json::from_slice(&std::fs::read(&json).expect("the JSON result")).unwrap();
    // 506 rows, every fifth held out: 405 to train on.
    let expected = [
        (20u64, 2 * 405u64.div_ceil(20)),
        (101, 2 * 405u64.div_ceil(101)),
    ];
    assert_eq!(rows.len(), expected.len(), "{rows:?}");
    for (row, (batch, steps)) in rows.iter().zip(expected) {
        assert_eq!(row["batch"], batch, "{row}");
        assert_eq!(row["steps"], steps, "{row}");
        assert_eq!(row["device"], "cpu", "{row}");
        assert_eq!(row["metric_name"], "cost", "{row}");
        let f = |k: &str| row[k].as_f64().unwrap_or_else(|| panic!("no {k} in {row}"));
        assert!(
            f("metric") < f("initial_metric"),
            "training lowered the held-out cost: {row}"
        );
        for k in ["samples_per_s", "forward_backward_us", "forward_only_us"] {
            assert!(f(k) > 0.0, "{k} measured: {row}");
        }
    }
    assert!(
        text.contains("| 101 |"),
        "the table has a row per batch size:\n{text}"
    );

    let refused = |extra: &[&str], spec: &std::path::Path| {
        let out = Command::new(edl_bin())
            .args(["bench", "local"])
            .arg(spec)
            .args(extra)
            .output()
            .expect("run edl bench local");
        assert!(!out.status.success(), "{extra:?} was refused");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    if !cfg!(feature = "cuda") {
        let err = refused(&["--device", "cuda:0"], &spec);
        assert!(err.contains("--features cuda"), "the fix is named: {err}");
    }
    let entry = crate::run::example(dir.path(), "pytorch_mnist", "job.toml", |s| s);
    let err = refused(&[], &entry);
    assert!(err.contains("no built-in [model]"), "{err}");
}
