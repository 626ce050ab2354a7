//! `edl bench scale`, short: the load command's own checks (every record read once per
//! pass, every pserver ledger holding every pass, every weight minus the tasks applied)
//! through 2 masters and 4 pserver processes on a real etcd, with the leading master
//! SIGKILLed a quarter of the way in. The full run (a million tasks, a thousand
//! trainers) is documented in docs/benchmarks.md.

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
