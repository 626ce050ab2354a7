//! `edl run` end to end: the examples on real etcd (private and given) and on the
//! in-memory backend, `edl scale`/`status`/`logs`/`kill`, and bad input (chaos: its
//! own module).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde_json::Value;

use crate::support::{Proc, World, edl_bin, wait_until};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root")
        .to_path_buf()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read_dir") {
        let e = e.expect("entry");
        let p = e.path();
        if p.is_dir() {
            continue; // data/ and edl-runs/ of earlier runs are not copied
        }
        std::fs::copy(&p, to.join(e.file_name())).expect("copy");
    }
}

/// Copies `examples/data` and `examples/<dir>` under `root`; returns the spec path,
/// with `edit` applied to its text.
pub(crate) fn example(
    root: &Path,
    dir: &str,
    file: &str,
    edit: impl Fn(String) -> String,
) -> PathBuf {
    copy_dir(&repo().join("examples/data"), &root.join("examples/data"));
    copy_dir(
        &repo().join("examples").join(dir),
        &root.join("examples").join(dir),
    );
    let spec = root.join("examples").join(dir).join(file);
    let text = std::fs::read_to_string(&spec).expect("spec");
    std::fs::write(&spec, edit(text)).expect("write spec");
    spec
}

pub(crate) fn read_report(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("no report {}: {e}", path.display()));
    let report: Value = serde_json::from_str(&text).expect("report json");
    assert_eq!(
        report["version"], 1,
        "the report says its schema version: {report}"
    );
    report
}

/// Runs `edl run` to the end; returns (exit success, report, log).
pub(crate) async fn edl_run(
    dir: &Path,
    name: &str,
    args: &[&str],
    within: Duration,
) -> (bool, Value, String) {
    let report = dir.join(format!("{name}.report.json"));
    let mut all: Vec<String> = vec!["run".into()];
    all.extend(args.iter().map(|s| s.to_string()));
    all.extend([
        "--report".into(),
        report.display().to_string(),
        "--quiet".into(),
    ]);
    let mut p = Proc::spawn(dir, name, &all);
    let status = p.wait_exit(within).await;
    let log = p.log();
    (status.success(), read_report(&report), log)
}

pub(crate) fn metric(report: &Value) -> (String, f64) {
    let m = &report["final_metric"];
    (
        m["name"].as_str().unwrap_or_default().to_owned(),
        m["value"].as_f64().unwrap_or(f64::NAN),
    )
}

/// Least-squares optimum of the example's split is 23.5 (every 5th row held out; see the
/// trainer tests): the job must get within 10% of it.
pub(crate) const HOUSING_COST_BOUND: f64 = 23.53 * 1.10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fit_a_line_example_runs_on_a_private_etcd_and_in_memory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = example(dir.path(), "fit_a_line", "job.toml", |s| s);
    let spec_arg = spec.display().to_string();
    let (ok, r, log) = edl_run(
        dir.path(),
        "private",
        &[&spec_arg],
        Duration::from_secs(300),
    )
    .await;
    assert!(ok, "edl run failed: {r}\n{log}");
    assert_eq!(r["coordination"], "private-etcd");
    assert_eq!(r["succeeded"], true);
    assert_eq!(r["passes"], 30);
    assert_eq!(r["lost_records"], 0);
    let (name, cost) = metric(&r);
    assert_eq!(name, "cost");
    assert!(cost < HOUSING_COST_BOUND, "held-out cost {cost}");
    let params: Value = serde_json::from_str(
        &std::fs::read_to_string(r["params_file"].as_str().expect("params file")).expect("params"),
    )
    .expect("params json");
    let w = &params["dense"][0];
    assert_eq!(w["shape"], serde_json::json!([13, 1]), "{w}");
    assert!(log.contains("final cost on the test split"), "{log}");

    let run_dir = dir.path().join("memory-run");
    let (ok, r, log) = edl_run(
        dir.path(),
        "memory",
        &[
            &spec_arg,
            "--coord",
            "memory",
            "--run-dir",
            &run_dir.display().to_string(),
        ],
        Duration::from_secs(300),
    )
    .await;
    assert!(ok, "edl run --coord memory failed: {r}\n{log}");
    assert_eq!(r["coordination"], "memory");
    assert!(
        log.contains("in-memory backend"),
        "says so in one line: {log}"
    );
    let (_, cost) = metric(&r);
    assert!(cost < HOUSING_COST_BOUND, "in-memory held-out cost {cost}");
    assert_eq!(r["records_trained"], 30 * 405);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mnist_and_word2vec_examples_reach_their_metrics_on_etcd_and_in_memory() {
    let w = World::new("unused").await;
    let etcd = w.etcd_arg();
    let dir = w.dir.path();
    let mlp = example(dir, "mnist", "mlp.toml", |s| s)
        .display()
        .to_string();
    let cnn = example(dir, "mnist", "cnn.toml", |s| s)
        .display()
        .to_string();
    let w2v = example(dir, "word2vec", "job.toml", |s| s)
        .display()
        .to_string();
    // (spec, job name, check)
    type Case<'a> = (&'a str, &'a str, fn(&Value));
    let cases: [Case<'_>; 3] = [
        (&mlp, "mnist-mlp", |r| {
            let (name, acc) = metric(r);
            assert_eq!(name, "accuracy");
            assert!(acc >= 0.90, "mnist_mlp held-out accuracy {acc}");
        }),
        (&cnn, "mnist-cnn", |r| {
            let (name, acc) = metric(r);
            assert_eq!(name, "accuracy");
            assert!(acc >= 0.90, "mnist_cnn held-out accuracy {acc}");
        }),
        (&w2v, "word2vec", |r| {
            // The initial loss of skip-gram with 5 negatives and zero output vectors is
            // 6 ln 2 = 4.159; it must fall by at least 30%.
            let (name, loss) = metric(r);
            assert_eq!(name, "loss");
            assert!(
                loss <= 0.7 * 6.0 * std::f64::consts::LN_2,
                "word2vec held-out loss {loss}"
            );
        }),
    ];
    for (spec, job, check) in cases {
        let (ok, r, log) =
            edl_run(dir, job, &[spec, "--etcd", &etcd], Duration::from_secs(600)).await;
        assert!(ok, "edl run {job} failed: {r}\n{log}");
        assert_eq!(r["coordination"], "etcd");
        assert_eq!(r["lost_records"], 0);
        check(&r);
        eprintln!("{job} on etcd: {}", r["final_metric"]);
    }
    for (spec, job, check) in cases {
        if job == "mnist-cnn" {
            continue; // the slowest model runs once
        }
        let run_dir = dir.join(format!("{job}-memory"));
        let (ok, r, log) = edl_run(
            dir,
            &format!("{job}-memory"),
            &[
                spec,
                "--coord",
                "memory",
                "--run-dir",
                &run_dir.display().to_string(),
            ],
            Duration::from_secs(600),
        )
        .await;
        assert!(ok, "edl run {job} in memory failed: {r}\n{log}");
        assert_eq!(r["coordination"], "memory");
        check(&r);
        eprintln!("{job} in memory: {}", r["final_metric"]);
    }
}

/// Runs `edl ARGS` to its end: (exit success, stdout, stderr).
pub(crate) fn edl_cmd(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(edl_bin())
        .args(args)
        .output()
        .expect("run edl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The report's scale events as (from, to).
fn scale_moves(report: &Value) -> Vec<(u64, u64)> {
    report["scale_events"]
        .as_array()
        .expect("scale events")
        .iter()
        .map(|e| {
            (
                e["from"].as_u64().unwrap_or(0),
                e["to"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

fn trainers_in_status(etcd: &str, job: &str) -> Option<usize> {
    let (ok, out, _) = edl_cmd(&["status", job, "--json", "--etcd", etcd]);
    if !ok {
        return None;
    }
    let v: Value = serde_json::from_str(&out).ok()?;
    v["jobs"][0]["trainers"].as_array().map(Vec::len)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_up_and_down_then_kill_show_in_status_logs_and_the_report() {
    let w = World::new("unused").await;
    let etcd = w.etcd_arg();
    let spec = example(w.dir.path(), "fit_a_line", "job.toml", |s| {
        s.replace("passes = 30", "passes = 100000")
    });
    let report = w.dir.path().join("scale.report.json");
    let mut run = Proc::spawn(
        w.dir.path(),
        "run",
        &[
            "run".into(),
            spec.display().to_string(),
            "--etcd".into(),
            etcd.clone(),
            "--report".into(),
            report.display().to_string(),
            "--quiet".into(),
        ],
    );
    let job = "fit-a-line";
    let at = |n: usize| {
        let etcd = etcd.clone();
        move || {
            let etcd = etcd.clone();
            async move { trainers_in_status(&etcd, job) == Some(n) }
        }
    };
    assert!(
        wait_until(Duration::from_secs(60), at(2)).await,
        "2 trainers never registered:\n{}",
        run.log()
    );
    let (ok, out, err) = edl_cmd(&["scale", job, "--trainers", "3", "--etcd", &etcd]);
    assert!(ok && err.is_empty(), "scale: ok {ok}, {out}, stderr: {err}");
    assert!(
        wait_until(Duration::from_secs(60), at(3)).await,
        "never scaled to 3:\n{}",
        run.log()
    );
    let (ok, out, err) = edl_cmd(&["scale", job, "--trainers", "1", "--etcd", &etcd]);
    assert!(ok, "{out}{err}");
    assert!(
        wait_until(Duration::from_secs(60), at(1)).await,
        "never scaled to 1:\n{}",
        run.log()
    );
    // Machine-readable status: named fields and a version, nothing on stderr.
    let (ok, out, err) = edl_cmd(&["status", job, "--json", "--etcd", &etcd]);
    assert!(
        ok && err.is_empty(),
        "status --json: ok {ok}, stderr: {err}"
    );
    let v: Value = serde_json::from_str(&out).expect("status json");
    assert_eq!(v["version"], 1, "{v}");
    let j = &v["jobs"][0];
    assert_eq!(j["state"], "running", "{v}");
    let pass = &j["pass"];
    assert!(
        pass["current"].as_u64() >= Some(1) && pass["total"] == 100000,
        "{v}"
    );
    let tasks = &j["tasks"];
    for field in ["todo", "pending", "done", "failed"] {
        assert!(tasks[field].is_u64(), "tasks.{field}: {v}");
    }
    assert_eq!(j["masters"][0]["leader"], true, "{v}");
    assert!(j["masters"][0]["address"].is_string(), "{v}");
    assert_eq!(j["pservers"][0]["index"], 0, "{v}");
    assert!(j["pservers"][0]["address"].is_string(), "{v}");
    // Where the trainers' time went: each of the three that ran told the master, and
    // the job's buckets are their sums.
    let goodput = &j["goodput"];
    let per_trainer = goodput["trainers"]
        .as_object()
        .expect("goodput per trainer");
    assert!(per_trainer.len() >= 3, "{v}");
    let computing: f64 = per_trainer
        .values()
        .map(|t| t["computing"].as_f64().expect("computing"))
        .sum();
    assert!(computing > 0.0, "{v}");
    assert!(
        (goodput["seconds"]["computing"].as_f64().expect("computing") - computing).abs() < 1e-6,
        "{v}"
    );
    // The human view names the job, its pass, its processes and its goodput.
    let (ok, out, err) = edl_cmd(&["status", "--etcd", &etcd]);
    assert!(ok && err.is_empty(), "status: ok {ok}, stderr: {err}");
    assert!(
        out.contains(job)
            && out.contains("(leader)")
            && out.contains("pserver 0")
            && out.contains("goodput of ")
            && out.contains("computing "),
        "{out}"
    );
    // Logs of the trainers, by process.
    let (ok, out, err) = edl_cmd(&["logs", job, "--role", "trainer", "--etcd", &etcd]);
    assert!(ok && err.is_empty(), "logs: ok {ok}, stderr: {err}");
    assert!(
        out.contains("[trainer-0]") && out.contains("trainer registered"),
        "{out}"
    );
    assert!(!out.contains("[master-0]"), "--role filters");
    // A graceful stop.
    let (ok, out, err) = edl_cmd(&["kill", job, "--etcd", &etcd]);
    assert!(ok && err.is_empty(), "kill: ok {ok}, {out}, stderr: {err}");
    let status = run.wait_exit(Duration::from_secs(120)).await;
    assert!(!status.success(), "a killed job is not a success");
    let r = read_report(&report);
    assert!(
        r["error"].as_str().is_some_and(|e| e.contains("edl kill")),
        "{r}"
    );
    assert_eq!(scale_moves(&r), vec![(2, 3), (3, 1)], "{r}");
    assert_eq!(r["restarts"], 0, "drained trainers are not crashes: {r}");
    assert!(
        r["goodput"]["seconds"]["computing"].as_f64() > Some(0.0),
        "{r}"
    );
    let (_, out, _) = edl_cmd(&["status", job, "--json", "--etcd", &etcd]);
    let v: Value = serde_json::from_str(&out).expect("status json");
    assert_eq!(v["jobs"][0]["state"], "stopped", "{v}");
}

/// `edl run --autoscale`: the autoscaler grows the job into the cores it was given (6:
/// the pserver and 3 trainers fit within 97%, and 3 is the job's max) once a speed was
/// observed, through `scale/trainers` (`edl status` shows the count it asked for).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn autoscale_grows_a_run_into_its_cores_up_to_its_max() {
    let w = World::new("unused").await;
    let etcd = w.etcd_arg();
    let spec = example(w.dir.path(), "fit_a_line", "job.toml", |s| {
        s.replace("passes = 30", "passes = 100000")
            .replace("trainers = 2", "trainers = 1")
            .replace("max_trainers = 4", "max_trainers = 3")
    });
    let report = w.dir.path().join("autoscale.report.json");
    let mut run = Proc::spawn(
        w.dir.path(),
        "run",
        &[
            "run".into(),
            spec.display().to_string(),
            "--etcd".into(),
            etcd.clone(),
            "--autoscale".into(),
            "--autoscale-cores".into(),
            "6".into(),
            "--report".into(),
            report.display().to_string(),
            "--quiet".into(),
        ],
    );
    let job = "fit-a-line";
    let three = || {
        let etcd = etcd.clone();
        async move { trainers_in_status(&etcd, job) == Some(3) }
    };
    assert!(
        wait_until(Duration::from_secs(90), three).await,
        "never grown to 3 trainers:\n{}",
        run.log()
    );
    let (ok, out, err) = edl_cmd(&["status", job, "--json", "--etcd", &etcd]);
    assert!(ok, "{out}{err}");
    let v: Value = serde_json::from_str(&out).expect("status json");
    assert_eq!(v["jobs"][0]["desired_trainers"], 3, "{v}");
    let (ok, out, err) = edl_cmd(&["kill", job, "--etcd", &etcd]);
    assert!(ok, "kill: {out}{err}");
    let status = run.wait_exit(Duration::from_secs(120)).await;
    assert!(!status.success(), "a killed job is not a success");
    let r = read_report(&report);
    assert_eq!(scale_moves(&r), vec![(1, 3)], "one step to the max: {r}");
    assert_eq!(r["restarts"], 0, "{r}");
    assert!(run.log().contains("autoscaler: trainers"), "{}", run.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_that_fails_at_every_start_fails_the_run_as_a_crash_loop() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A trainer program that exits with an error right after every start. (It was an
    // unusable `--device cuda:99`, which `edl run` now refuses before starting anything.)
    let spec = example(dir.path(), "fit_a_line", "job.toml", |s| {
        s.replace("trainers = 2", "trainers = 1").replace(
            "[train]\n",
            "[trainer]\nentry = [\"sh\", \"-c\", \"echo 'error: no weights for layer 99' >&2; exit 3\"]\n\n[train]\n",
        ) + "max_restarts = 1\n"
    });
    let (ok, r, log) = edl_run(
        dir.path(),
        "crash-loop",
        &[&spec.display().to_string(), "--coord", "etcd"],
        Duration::from_secs(120),
    )
    .await;
    assert!(!ok, "a crash loop fails the run: {r}\n{log}");
    let error = r["error"].as_str().unwrap_or_default();
    assert!(
        error.starts_with("trainer-0.1 is in a crash loop")
            && error.contains("failed 2 times in a row within cluster.healthy_after (30s)")
            && error.contains("cluster.max_restarts (1)"),
        "{r}"
    );
    let trainer_log = error
        .rsplit_once("the cause is in ")
        .and_then(|(_, rest)| rest.lines().next())
        .map(PathBuf::from)
        .expect("the error names the log");
    let cause = std::fs::read_to_string(&trainer_log)
        .unwrap_or_else(|e| panic!("{}: {e}", trainer_log.display()));
    assert!(cause.contains("no weights for layer 99"), "{cause}");
    // The error carries the log's last lines too.
    assert!(
        error.contains("| error: no weights for layer 99"),
        "{error}"
    );
    assert_eq!(r["restarts"], 1, "the first fast failure is restarted: {r}");
    assert_eq!(r["preemptions"], 0, "{r}");
    // The trainer role never served again.
    assert_eq!(
        r["unrecovered"],
        serde_json::json!(["crash of trainer trainer-0"]),
        "{r}"
    );
    assert!(
        r["wall_s"].as_f64().is_some_and(|s| s < 60.0),
        "fails fast: {r}"
    );
    assert_eq!(
        log.matches("is in a crash loop").count(),
        1,
        "said once: {log}"
    );
}

/// The registered trainers of `job` whose id starts with `prefix`: (id, pid, ms since
/// it started).
async fn trainers_of(
    backend: &dyn edl_coord::Backend,
    job: &str,
    prefix: &str,
) -> Vec<(String, u32, u64)> {
    use edl_job::Record;
    let keys = edl_job::JobKeys::new(&edl_job::JobName::new(job).expect("job name"));
    let now_ms = edl_job::records::now_ms();
    let (kvs, _) = backend.range(&keys.trainers()).await.unwrap_or_default();
    kvs.into_iter()
        .filter_map(|kv| {
            let id = kv.key.rsplit('/').next()?.to_owned();
            let record = edl_job::TrainerRecord::decode(&kv.value).ok()?;
            id.starts_with(prefix)
                .then(|| (id, record.pid, now_ms.saturating_sub(record.started_ms)))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preempted_healthy_trainers_are_restarted_without_spending_the_budget() {
    let w = World::new("preempted").await;
    let etcd = w.etcd_arg();
    let spec = example(w.dir.path(), "fit_a_line", "job.toml", |s| {
        s.replace("name = \"fit-a-line\"", "name = \"preempted\"")
            .replace("passes = 30", "passes = 100000")
            + "max_restarts = 1\nhealthy_after = \"2s\"\n"
    });
    let report = w.dir.path().join("preempted.report.json");
    let mut run = Proc::spawn(
        w.dir.path(),
        "run",
        &[
            "run".into(),
            spec.display().to_string(),
            "--etcd".into(),
            etcd.clone(),
            "--report".into(),
            report.display().to_string(),
        ],
    );
    // Three preemptions of trainer-0, each after a healthy run: more than the budget
    // (1) if they counted.
    for round in 0..3 {
        let name = match round {
            0 => "trainer-0".to_owned(),
            n => format!("trainer-0.{n}"),
        };
        let victim = Arc::new(AtomicU32::new(0));
        let healthy = wait_until(Duration::from_secs(60), || {
            let (backend, name, victim) = (w.backend.clone(), name.clone(), victim.clone());
            async move {
                let found = trainers_of(backend.as_ref(), "preempted", &name).await;
                match found
                    .iter()
                    .find(|(id, _, age_ms)| *id == name && *age_ms >= 3000)
                {
                    Some(&(_, pid, _)) => {
                        victim.store(pid, Ordering::SeqCst);
                        true
                    }
                    None => false,
                }
            }
        })
        .await;
        assert!(healthy, "{name} never ran 3s registered:\n{}", run.log());
        let pid = victim.load(Ordering::SeqCst);
        edl_testkit::signal(pid, edl_testkit::Signal::SIGKILL).expect("kill the trainer");
    }
    // Each recovery is seen (the replacement registered, the dead trainer's lease gone).
    run.wait_log("recoveries 3  restarts 3", Duration::from_secs(60))
        .await;
    let (ok, out, err) = edl_cmd(&["kill", "preempted", "--etcd", &etcd]);
    assert!(ok && err.is_empty(), "kill: ok {ok}, {out}, stderr: {err}");
    run.wait_exit(Duration::from_secs(120)).await;
    let r = read_report(&report);
    assert!(
        r["error"].as_str().is_some_and(|e| e.contains("edl kill")),
        "stopped by edl kill, not a crash loop: {r}"
    );
    assert_eq!(r["restarts"], 3, "{r}");
    assert_eq!(r["preemptions"], 3, "{r}");
    let crashes: Vec<&str> = r["recoveries"]
        .as_array()
        .expect("recoveries")
        .iter()
        .filter(|x| x["fault"] == "crash" && x["role"] == "trainer")
        .filter_map(|x| x["process"].as_str())
        .collect();
    assert_eq!(crashes, ["trainer-0", "trainer-0.1", "trainer-0.2"], "{r}");
    assert!(
        r["recoveries"]
            .as_array()
            .expect("recoveries")
            .iter()
            .all(|x| x["seconds"].as_f64().is_some_and(|s| s < 30.0)),
        "{r}"
    );
    eprintln!("preempted: recoveries {}", r["recoveries"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_specs_missing_data_and_unreachable_etcd_are_one_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    type Edit = Box<dyn Fn(String) -> String>;
    let cases: [(&str, Edit, Vec<&str>, &str); 6] = [
        (
            "unknown key",
            Box::new(|s: String| s.replace("batch_size = 20", "batch_size = 20\nbatch_sise = 3")),
            vec![],
            "batch_sise",
        ),
        (
            "missing key",
            Box::new(|s: String| s.replace("kind = \"fit_a_line\"", "")),
            vec![],
            "kind",
        ),
        (
            "missing data",
            Box::new(|s: String| {
                let cut = s.find("[data.prepare]").unwrap_or(s.len());
                let rest = &s[cut..];
                let model = rest.find("[model]").unwrap_or(0);
                format!("{}{}", &s[..cut], &rest[model..])
            }),
            vec![],
            "no files match",
        ),
        (
            // A classifier on real-valued labels: said once, naming the data file, with
            // the fix.
            "labels of the wrong kind",
            Box::new(|s: String| {
                s.replace(
                    "kind = \"fit_a_line\"",
                    "kind = \"mlp\"\ninputs = 13\nhidden = [4]\nclasses = 3",
                )
            }),
            vec![],
            "edl data convert --label class",
        ),
        (
            "unreachable etcd",
            Box::new(|s: String| s),
            vec!["--etcd", "http://127.0.0.1:1"],
            "cannot reach etcd",
        ),
        (
            // This build has no CUDA (or this machine no GPU, docs/gpu.md): refused
            // before any process starts, instead of trainers crash-looping on it.
            "no usable GPU",
            Box::new(|s: String| s),
            vec!["--device", "cuda:0"],
            "--device cuda:0: ",
        ),
    ];
    for (i, (what, edit, extra, needle)) in cases.into_iter().enumerate() {
        let root = dir.path().join(format!("case{i}"));
        let spec = example(&root, "fit_a_line", "job.toml", &*edit);
        let mut args = vec!["run".to_owned(), spec.display().to_string()];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut p = Proc::spawn(&root, "run", &args);
        let status = p.wait_exit(Duration::from_secs(60)).await;
        let log = p.log();
        assert!(!status.success(), "{what}: exit 0\n{log}");
        let errors: Vec<&str> = log.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(errors.len(), 1, "{what}: one error line\n{log}");
        assert!(
            errors[0].contains(needle),
            "{what}: {:?} lacks {needle:?}",
            errors[0]
        );
        if what == "labels of the wrong kind" {
            assert!(
                errors[0].contains("housing-train-")
                    && errors[0].matches("real-valued").count() == 1,
                "{what}: names the data file, says it once: {}",
                errors[0]
            );
        }
        if what == "no usable GPU" {
            assert!(
                std::fs::metadata(root.join("examples/fit_a_line/edl-runs"))
                    .is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound),
                "{what}: refused before the run directory was made"
            );
        } else if what != "unreachable etcd" {
            assert!(
                errors[0].contains("job.toml"),
                "{what}: names the file: {}",
                errors[0]
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paddle_environment_variables_run_the_pserver_and_trainer_roles() {
    let w = World::new("paddle").await;
    let spec = example(w.dir.path(), "fit_a_line", "job.toml", |s| {
        s.replace("name = \"fit-a-line\"", "name = \"paddle\"")
            .replace("passes = 30", "passes = 3")
    });
    // Make the example's data once (what `edl run` would do).
    let (ok, out, err) = edl_cmd(&["run", &spec.display().to_string(), "--coord", "memory"]);
    assert!(ok, "{out}{err}");
    let (_m, _) = w.master("master", &[]).await;
    let port = edl_testkit::free_port();
    let ep = format!("127.0.0.1:{port}");
    let spawn = |name: &str, vars: &[(&str, &str)]| {
        let log = std::fs::File::create(w.dir.path().join(format!("{name}.log"))).expect("log");
        let mut cmd = Command::new(edl_bin());
        cmd.env("EDL_ETCD", w.etcd_arg())
            .env("EDL_JOB", "paddle")
            .env("EDL_CHECKPOINT_DIR", w.checkpoint_dir())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        for (k, v) in vars {
            cmd.env(k, v);
        }
        cmd.spawn().expect("spawn edl")
    };
    let mut ps = spawn(
        "ps",
        &[
            ("PADDLE_TRAINING_ROLE", "PSERVER"),
            ("PADDLE_PSERVER_EPS", &ep),
            ("PADDLE_CURRENT_ENDPOINT", &ep),
        ],
    );
    let spec_s = spec.display().to_string();
    let mut trainer = spawn(
        "trainer",
        &[
            ("PADDLE_TRAINING_ROLE", "TRAINER"),
            ("PADDLE_TRAINER_ID", "0"),
            ("PADDLE_TRAINERS", "1"),
            ("EDL_SPEC", &spec_s),
        ],
    );
    let done = wait_until(Duration::from_secs(120), || {
        let exited = matches!(trainer.try_wait(), Ok(Some(_)));
        async move { exited }
    })
    .await;
    let log = |n: &str| {
        std::fs::read_to_string(w.dir.path().join(format!("{n}.log"))).unwrap_or_default()
    };
    assert!(
        done,
        "the trainer did not finish:\n{}\n{}",
        log("trainer"),
        log("ps")
    );
    let status = trainer.wait().expect("wait");
    assert!(status.success(), "trainer: {status}\n{}", log("trainer"));
    assert!(
        log("ps").contains(&format!("pserver listening on {ep}")),
        "{}",
        log("ps")
    );
    assert!(
        log("trainer").contains("\"trainer\":\"trainer-0\""),
        "{}",
        log("trainer")
    );
    let s = w.client().status().await.expect("status");
    assert!(s.finished);
    assert_eq!(s.counters.map(|c| c.records_trained), Some(3 * 405));
    let _ = ps.kill();
    let _ = ps.wait();
}
