//! `edl trainer` processes against real etcd, a real master and real pservers: model
//! quality through the parameter servers (sync and async), the sparse path, and
//! elasticity (a trainer joining mid-pass, one draining on SIGTERM, one SIGKILLed).

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::support::{Proc, World, edl_bin, wait_until};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root")
        .to_path_buf()
}

fn edl(args: &[&str]) {
    let out = Command::new(edl_bin())
        .args(args)
        .output()
        .expect("run edl");
    assert!(
        out.status.success(),
        "edl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Splits text lines into (train, test): every `k`-th line is a test line.
fn split_lines(lines: Vec<String>, k: usize) -> (Vec<String>, Vec<String>) {
    let mut train = Vec::new();
    let mut test = Vec::new();
    for (i, l) in lines.into_iter().enumerate() {
        if i % k == k - 1 {
            test.push(l);
        } else {
            train.push(l);
        }
    }
    (train, test)
}

fn write_lines(path: &Path, lines: &[String]) {
    let mut f = std::fs::File::create(path).expect("create");
    for l in lines {
        writeln!(f, "{l}").expect("write");
    }
}

/// UCI Housing as RecordIO: (train glob, test glob), every 5th row held out.
fn housing(dir: &Path) -> (String, String) {
    let text =
        std::fs::read_to_string(repo().join("examples/data/boston_housing.csv")).expect("csv");
    let lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let (train, test) = split_lines(lines, 5);
    let data = dir.join("data");
    std::fs::create_dir_all(&data).expect("mkdir");
    write_lines(&dir.join("housing-train.csv"), &train);
    write_lines(&dir.join("housing-test.csv"), &test);
    let d = data.display().to_string();
    let a = dir.join("housing-train.csv").display().to_string();
    let b = dir.join("housing-test.csv").display().to_string();
    edl(&[
        "data",
        "convert",
        "--format",
        "csv",
        "--shards",
        "2",
        "--prefix",
        "housing-train",
        "--chunk-size",
        "2KiB",
        "--out",
        &d,
        &a,
    ]);
    edl(&[
        "data",
        "convert",
        "--format",
        "csv",
        "--prefix",
        "housing-test",
        "--out",
        &d,
        &b,
    ]);
    (
        format!("{d}/housing-train-*.recordio"),
        format!("{d}/housing-test-*.recordio"),
    )
}

/// MNIST (5000 digits) as RecordIO: (train glob, test glob), every 5th digit held out.
pub(crate) fn mnist(dir: &Path) -> (String, String) {
    let f = std::fs::File::open(repo().join("examples/data/mnist_5k.csv.gz")).expect("mnist");
    let lines: Vec<String> = std::io::BufReader::new(flate2::read::GzDecoder::new(f))
        .lines()
        .map(|l| l.expect("read mnist"))
        .collect();
    let (train, test) = split_lines(lines, 5);
    let data = dir.join("data");
    std::fs::create_dir_all(&data).expect("mkdir");
    write_lines(&dir.join("mnist-train.csv"), &train);
    write_lines(&dir.join("mnist-test.csv"), &test);
    let d = data.display().to_string();
    let a = dir.join("mnist-train.csv").display().to_string();
    let b = dir.join("mnist-test.csv").display().to_string();
    edl(&[
        "data",
        "convert",
        "--format",
        "mnist-csv",
        "--shards",
        "4",
        "--prefix",
        "mnist-train",
        "--chunk-size",
        "256KiB",
        "--out",
        &d,
        &a,
    ]);
    edl(&[
        "data",
        "convert",
        "--format",
        "mnist-csv",
        "--prefix",
        "mnist-test",
        "--out",
        &d,
        &b,
    ]);
    (
        format!("{d}/mnist-train-*.recordio"),
        format!("{d}/mnist-test-*.recordio"),
    )
}

/// PTB text (the committed 1000-line head) as word ids: (train glob, test glob, vocab size).
fn ptb(dir: &Path) -> (String, String, u64) {
    let text = std::fs::read_to_string(repo().join("trainer/testdata/ptb.valid.head1000.txt"))
        .expect("ptb");
    let lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let (train, test) = split_lines(lines, 10);
    let data = dir.join("data");
    std::fs::create_dir_all(&data).expect("mkdir");
    write_lines(&dir.join("ptb-train.txt"), &train);
    write_lines(&dir.join("ptb-test.txt"), &test);
    let d = data.display().to_string();
    let a = dir.join("ptb-train.txt").display().to_string();
    let b = dir.join("ptb-test.txt").display().to_string();
    edl(&[
        "data",
        "convert",
        "--format",
        "text",
        "--shards",
        "2",
        "--prefix",
        "ptb-train",
        "--chunk-size",
        "8KiB",
        "--out",
        &d,
        &a,
    ]);
    let vocab = std::fs::read_dir(&data)
        .expect("ls")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.extension().is_some_and(|e| e == "vocab") || p.to_string_lossy().contains("vocab")
        })
        .expect("a vocabulary file next to the shards");
    let v = vocab.display().to_string();
    edl(&[
        "data", "convert", "--format", "text", "--prefix", "ptb-test", "--vocab", &v, "--out", &d,
        &b,
    ]);
    let words = std::fs::read_to_string(&vocab)
        .expect("vocab")
        .lines()
        .count() as u64;
    (
        format!("{d}/ptb-train-*.recordio"),
        format!("{d}/ptb-test-*.recordio"),
        words,
    )
}

impl World {
    /// Writes a job spec for this world's job; `body` is everything after `name`.
    pub(crate) fn spec(&self, file: &str, body: &str) -> PathBuf {
        let p = self.dir.path().join(file);
        std::fs::write(&p, format!("name = \"{}\"\n{body}", self.job)).expect("write spec");
        p
    }

    /// `edl trainer --spec SPEC` writing its report to `<name>.json`.
    pub(crate) fn trainer(&self, name: &str, spec: &Path) -> Proc {
        self.trainer_with(name, spec, &[])
    }

    /// [`trainer`](Self::trainer) with `extra` arguments.
    pub(crate) fn trainer_with(&self, name: &str, spec: &Path, extra: &[&str]) -> Proc {
        let mut args: Vec<String> = vec![
            "trainer".into(),
            "--etcd".into(),
            self.etcd_arg(),
            "--job".into(),
            self.job.clone(),
            "--id".into(),
            name.into(),
            "--device".into(),
            "auto".into(),
            "--spec".into(),
            spec.display().to_string(),
            "--report".into(),
            self.report_path(name).display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        Proc::spawn(self.dir.path(), name, &args)
    }

    fn report_path(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.json"))
    }

    fn report(&self, name: &str) -> Value {
        let text = std::fs::read_to_string(self.report_path(name))
            .unwrap_or_else(|e| panic!("no report of {name}: {e}"));
        let report: Value = serde_json::from_str(&text).expect("report json");
        assert_eq!(
            report["version"], 1,
            "the report says its schema version: {report}"
        );
        report
    }
}

/// Waits for every trainer to exit 0; returns their reports.
pub(crate) async fn finish(w: &World, trainers: &mut [Proc], within: Duration) -> Vec<Value> {
    let mut out = Vec::new();
    for t in trainers.iter_mut() {
        let status = t.wait_exit(within).await;
        assert!(
            status.success(),
            "{} exited with {status}; log:\n{}",
            t.name,
            t.log()
        );
        out.push(w.report(&t.name));
    }
    out
}

/// A trainer report's goodput buckets (seconds by name), checked to sum to its wall time
/// within 1%.
pub(crate) fn goodput_of(report: &Value) -> std::collections::BTreeMap<String, f64> {
    let buckets: std::collections::BTreeMap<String, f64> = report["goodput"]
        .as_object()
        .unwrap_or_else(|| panic!("no goodput in {report}"))
        .iter()
        .map(|(k, v)| (k.clone(), v.as_f64().expect("seconds")))
        .collect();
    let wall = report["wall_s"].as_f64().expect("wall_s");
    let sum: f64 = buckets.values().sum();
    assert!(
        buckets.len() == 8 && (sum - wall).abs() <= 0.01 * wall,
        "goodput buckets sum to {sum} s, not the trainer's {wall} s: {report}"
    );
    buckets
}

pub(crate) fn final_metric(reports: &[Value]) -> (String, f64) {
    let last = reports
        .iter()
        .filter_map(|r| r["evals"].as_array().and_then(|e| e.last()).cloned())
        .max_by_key(|e| e["pass"].as_u64().unwrap_or(0))
        .expect("some trainer evaluated the last pass");
    (
        last["metric"].as_str().unwrap_or_default().to_owned(),
        last["value"].as_f64().expect("value"),
    )
}

#[allow(clippy::needless_range_loop)] // Gauss-Jordan elimination reads best with indices.
fn least_squares_cost(train_csv: &Path, test_csv: &Path) -> f64 {
    // Normal equations in f64 on the raw features (standardisation does not change the
    // optimum of a linear model with a bias).
    let read = |p: &Path| -> Vec<Vec<f64>> {
        std::fs::read_to_string(p)
            .expect("csv")
            .lines()
            .map(|l| {
                l.split(',')
                    .map(|x| x.trim().parse::<f64>().expect("num"))
                    .collect()
            })
            .collect()
    };
    let train = read(train_csv);
    let test = read(test_csv);
    let k = train[0].len(); // 13 features + bias (the label column's slot)
    let mut a = vec![vec![0f64; k + 1]; k];
    for r in &train {
        let x: Vec<f64> = r[..k - 1].iter().copied().chain([1.0]).collect();
        let y = r[k - 1];
        for i in 0..k {
            for j in 0..k {
                a[i][j] += x[i] * x[j];
            }
            a[i][k] += x[i] * y;
        }
    }
    for c in 0..k {
        let p = (c..k)
            .max_by(|&i, &j| a[i][c].abs().total_cmp(&a[j][c].abs()))
            .expect("pivot");
        a.swap(c, p);
        for r in 0..k {
            if r != c {
                let f = a[r][c] / a[c][c];
                for j in c..=k {
                    a[r][j] -= f * a[c][j];
                }
            }
        }
    }
    let w: Vec<f64> = (0..k).map(|i| a[i][k] / a[i][i]).collect();
    let mut sum = 0.0;
    for r in &test {
        let pred: f64 = r[..k - 1].iter().zip(&w).map(|(x, w)| x * w).sum::<f64>() + w[k - 1];
        sum += (pred - r[k - 1]).powi(2);
    }
    sum / test.len() as f64
}

/// The fit_a_line job of this world (its data written by [`housing`]): `passes` passes
/// in `mode`, batches of 20, SGD, a 2 s lease.
pub(crate) fn fit_a_line_spec(w: &World, mode: &str, passes: u64) -> PathBuf {
    let (train, test) = housing(w.dir.path());
    w.spec(
        "job.toml",
        &format!(
            r#"
[data]
train = "{train}"
test = "{test}"
[model]
kind = "fit_a_line"
[train]
mode = "{mode}"
passes = {passes}
batch_size = 20
optimizer = "sgd"
learning_rate = 0.01
step_timeout = "10s"
[cluster]
lease_ttl = "2s"
"#
        ),
    )
}

async fn fit_a_line(mode: &str) {
    let w = World::new(&format!("housing-{mode}")).await;
    let spec = fit_a_line_spec(&w, mode, 60);
    let (_m, _) = w.master("master", &[]).await;
    let (_p, _) = w.pserver("ps0", &["--shards", "1"]).await;
    let mut trainers = vec![w.trainer("t0", &spec), w.trainer("t1", &spec)];
    let reports = finish(&w, &mut trainers, Duration::from_secs(240)).await;
    let (metric, cost) = final_metric(&reports);
    let optimum = least_squares_cost(
        &w.dir.path().join("housing-train.csv"),
        &w.dir.path().join("housing-test.csv"),
    );
    eprintln!("fit_a_line {mode}: held-out cost {cost:.3}, least-squares optimum {optimum:.3}");
    assert_eq!(metric, "cost");
    // The initialising trainer evaluated the initial parameters; another one may have
    // evaluated after some training already.
    let initial = reports
        .iter()
        .filter(|r| r["initialised"] == true)
        .map(|r| r["initial_eval"]["value"].as_f64().expect("initial eval"))
        .next()
        .expect("the initialising trainer's report");
    assert!(
        cost < initial / 8.0,
        "cost {cost} did not fall from {initial}"
    );
    assert!(
        cost < optimum * 1.10,
        "{mode}: held-out cost {cost} is not within 10% of the least-squares optimum {optimum}"
    );
    // Both trainers worked and exactly one initialised.
    assert!(
        reports.iter().all(|r| r["tasks"].as_u64() > Some(0)),
        "{reports:?}"
    );
    assert_eq!(
        reports.iter().filter(|r| r["initialised"] == true).count(),
        1,
        "{reports:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fit_a_line_sync_two_trainers_one_pserver() {
    fit_a_line("sync").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fit_a_line_async_two_trainers_one_pserver() {
    fit_a_line("async").await;
}

/// A batch larger than a chunk and than a 32nd of the data: the master cuts no task
/// smaller than the batch, so every step but a task's last trains a whole batch (tasks
/// of one chunk, 34 records, made every step a third of the batch before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_task_is_cut_smaller_than_the_jobs_batch() {
    const BATCH: u64 = 100;
    const PASSES: u64 = 2;
    let w = World::new("housing-batch").await;
    let spec = fit_a_line_spec(&w, "async", PASSES);
    let text = std::fs::read_to_string(&spec).expect("the spec");
    assert!(text.contains("batch_size = 20\n"), "the spec's batch moved");
    let text = text.replace(
        "batch_size = 20\n",
        &format!("batch_size = {BATCH}\nbatches_per_push = 1\n"),
    );
    std::fs::write(&spec, text).expect("write the spec");
    let train = format!("{}/data/housing-train-*.recordio", w.dir.path().display());
    let (_m, _) = w.master("master", &[]).await;
    let (_p, _) = w.pserver("ps0", &["--shards", "1"]).await;
    let mut trainers = vec![w.trainer("t0", &spec)];
    let reports = finish(&w, &mut trainers, Duration::from_secs(120)).await;
    let (_, tasks) = edl_master::dataset::index(&edl_master::dataset::DatasetSpec {
        globs: vec![train],
        chunks_per_task: 1,
        records_per_task: edl_job::JobSpec::load(&spec)
            .expect("the spec")
            .data
            .records_per_task,
        min_records_per_task: BATCH,
        passes: 1,
    })
    .expect("index the data");
    let chunks: u32 = tasks.iter().map(|t| t.chunk_end - t.chunk_begin).sum();
    assert!(
        tasks.len() < chunks as usize && tasks.len() < 32,
        "the state where the floor matters: {} tasks of {chunks} chunks",
        tasks.len()
    );
    // Each file's tasks but its last hold a batch or more.
    for w in tasks.windows(2).filter(|w| w[0].file == w[1].file) {
        assert!(w[0].records >= BATCH, "{:?}", w[0]);
    }
    let steps: u64 = tasks.iter().map(|t| t.records.div_ceil(BATCH)).sum();
    let r = &reports[0];
    assert_eq!(r["records"], PASSES * 405, "{r}");
    assert_eq!(r["steps"], PASSES * steps, "{r}");
}

pub(crate) fn mnist_spec(w: &World, passes: u32) -> PathBuf {
    let (train, test) = mnist(w.dir.path());
    w.spec(
        "job.toml",
        &format!(
            r#"
[data]
train = "{train}"
test = "{test}"
[model]
kind = "mnist_mlp"
[train]
mode = "async"
passes = {passes}
batch_size = 64
optimizer = "adam"
learning_rate = 0.001
seed = 7
[cluster]
lease_ttl = "2s"
"#
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mnist_mlp_two_trainers_two_pservers_reach_90_percent() {
    let w = World::new("mnist").await;
    let spec = mnist_spec(&w, 3);
    let (_m, _) = w.master("master", &[]).await;
    let (_p0, _) = w.pserver("ps0", &["--shards", "2"]).await;
    let (_p1, _) = w.pserver("ps1", &["--shards", "2"]).await;
    let mut trainers = vec![w.trainer("t0", &spec), w.trainer("t1", &spec)];
    let reports = finish(&w, &mut trainers, Duration::from_secs(300)).await;
    let (metric, acc) = final_metric(&reports);
    eprintln!("mnist_mlp: held-out accuracy {acc:.4}");
    assert_eq!(metric, "accuracy");
    assert!(acc >= 0.90, "held-out accuracy {acc} < 0.90");
    let status = w.client().status().await.expect("status");
    let c = status.counters.expect("counters");
    assert!(status.finished);
    assert_eq!(c.records_trained, 3 * status.total_records);
    assert_eq!(c.lost_records, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn word2vec_loss_falls_and_only_touched_rows_move() {
    let w = World::new("w2v").await;
    let (train, test, vocab) = ptb(w.dir.path());
    let spec = w.spec(
        "job.toml",
        &format!(
            r#"
[data]
train = "{train}"
test = "{test}"
[model]
kind = "word2vec"
vocab_size = {vocab}
dim = 32
window = 2
negatives = 5
[train]
mode = "async"
passes = 2
batch_size = 4
eval_batch_size = 8
optimizer = "adagrad"
learning_rate = 0.2
[cluster]
lease_ttl = "2s"
"#
        ),
    );
    let (_m, _) = w.master("master", &[]).await;
    let (_p0, _) = w.pserver("ps0", &["--shards", "2"]).await;
    let (_p1, _) = w.pserver("ps1", &["--shards", "2"]).await;
    let mut trainers = vec![w.trainer("t0", &spec), w.trainer("t1", &spec)];
    let reports = finish(&w, &mut trainers, Duration::from_secs(300)).await;
    let initial = reports
        .iter()
        .find(|r| r["initialised"] == true)
        .and_then(|r| r["initial_eval"]["value"].as_f64())
        .expect("the initialiser's initial evaluation");
    let (metric, loss) = final_metric(&reports);
    eprintln!("word2vec: held-out loss {initial:.4} -> {loss:.4} (vocab {vocab})");
    assert_eq!(metric, "loss");
    assert!(
        loss <= initial * 0.7,
        "loss fell only from {initial} to {loss} (< 30%)"
    );
    for r in &reports {
        // Only the rows a batch touches move: never a whole table, and on average a
        // small part of it.
        let most = r["max_sparse_rows"].as_u64().expect("max_sparse_rows");
        let pulls = r["sparse_pulls"].as_u64().expect("sparse_pulls");
        let rows = r["sparse_rows"].as_u64().expect("sparse_rows");
        assert!(most > 0 && pulls > 0, "{r}");
        assert!(
            most < vocab,
            "a sparse pull asked for {most} of {vocab} rows: {r}"
        );
        assert!(
            rows / pulls < vocab / 2,
            "sparse pulls moved {} rows on average of {vocab}: {r}",
            rows / pulls
        );
        assert_eq!(
            r["pull_bytes"].as_u64(),
            Some(0),
            "word2vec has no dense parameters"
        );
    }
}

/// Polls the master until `cond` holds for its status.
pub(crate) async fn wait_status(
    w: &World,
    within: Duration,
    what: &str,
    cond: impl Fn(&edl_proto::master::StatusResponse) -> bool,
) {
    let client = w.client();
    let ok = wait_until(within, || async {
        client.status().await.is_ok_and(|s| cond(&s))
    })
    .await;
    assert!(ok, "master status never showed {what}");
}

/// A first pass with: a trainer joining mid-pass, one drained with SIGTERM, one SIGKILLed.
/// The pass completes, every record is trained, duplicates come only from the killed
/// trainer's in-flight tasks and the drained trainer's handed-back partial task (none when
/// the next holder resumes after its applied batches), and the
/// final accuracy is within 5% of a fault-free run with the same seed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elastic_pass_with_join_drain_and_kill_matches_a_fault_free_run() {
    // Fault-free baseline.
    let base = World::new("elastic-base").await;
    let spec = mnist_spec(&base, 2);
    let (_m, _) = base.master("master", &["--chunks-per-task", "1"]).await;
    let (_p, _) = base.pserver("ps0", &["--shards", "1"]).await;
    let mut trainers = vec![base.trainer("t0", &spec), base.trainer("t1", &spec)];
    let base_reports = finish(&base, &mut trainers, Duration::from_secs(300)).await;
    let (_, base_acc) = final_metric(&base_reports);
    let base_counters = base
        .client()
        .status()
        .await
        .expect("status")
        .counters
        .expect("counters");

    let w = World::new("elastic").await;
    let spec = mnist_spec(&w, 2);
    let (_m, _) = w.master("master", &["--chunks-per-task", "1"]).await;
    let (_p, _) = w.pserver("ps0", &["--shards", "1"]).await;
    let mut stay = w.trainer("stay", &spec);
    let mut drained = w.trainer("drained", &spec);
    let mut killed = w.trainer("killed", &spec);
    // Everyone is training: some tasks are done.
    wait_status(&w, Duration::from_secs(120), "3 tasks done", |s| {
        s.done >= 3
    })
    .await;
    let before = w.client().status().await.expect("status");
    assert_eq!(before.pass, 0, "the faults must land in the first pass");
    let joined_at = w.client().status().await.expect("status").done;
    let mut joiner = w.trainer("joiner", &spec);
    // Kill one while it holds a task.
    let cl = w.client();
    let holds = wait_until(Duration::from_secs(60), || async {
        cl.status().await.is_ok_and(|s| s.pending > 0)
    })
    .await;
    assert!(holds);
    killed.kill();
    // Drain another.
    drained.signal("TERM");
    let status = drained.wait_exit(Duration::from_secs(60)).await;
    assert!(
        status.success(),
        "a drained trainer exits 0; log:\n{}",
        drained.log()
    );
    let mut rest = vec![stay, joiner];
    let reports = finish(&w, &mut rest, Duration::from_secs(300)).await;
    stay = rest.remove(0);
    joiner = rest.remove(0);
    drop((stay, joiner));
    let drained_report = w.report("drained");
    assert_eq!(drained_report["drained"], true);
    assert!(
        reports[1]["tasks"].as_u64() > Some(0),
        "the joiner trained: {reports:?}"
    );

    let s = w.client().status().await.expect("status");
    let c = s.counters.expect("counters");
    assert!(s.finished, "{s:?}");
    assert_eq!(c.failed_tasks, 0, "{c:?}");
    assert_eq!(c.lost_records, 0, "{c:?}");
    assert_eq!(
        c.records_trained,
        2 * s.total_records,
        "every record trained in each pass (once per finished task): {c:?}"
    );
    let after = reports[1]["evals"].as_array().map(Vec::len);
    assert!(after >= Some(1), "the joiner saw a pass end: {reports:?}");
    assert!(
        c.trainer_lost >= 1,
        "the killed trainer's tasks were revoked: {c:?}"
    );
    // Duplicates: the drained trainer's reported partial task, and at most what the killed
    // trainer held: the task being acknowledged (while the next one trains), the task it
    // was training, its read-ahead (2) and one GetTask in flight (the master cannot tell
    // trained from unread records of a dead trainer, so it counts all of them as cut
    // off). Tasks are sized by records: the 4,096 asked for are lowered to a 32nd of the
    // pass, and a task holds that plus at most a chunk (a 256 KiB chunk holds at most 100
    // samples).
    let task_max = s.total_records / 32 + 100;
    // The drained trainer's hand-back either carries a resume point (its records are not
    // trained again: `resumed_records`) or does not (they are: `duplicate_records`).
    assert_eq!(
        c.duplicate_records + c.resumed_records,
        drained_report["handed_back_trained"].as_u64().unwrap_or(0),
        "{c:?}"
    );
    assert!(c.trainer_lost <= 5, "{c:?}");
    assert!(
        c.cutoff_records <= c.trainer_lost * task_max,
        "cut-off records {} exceed the killed trainer's tasks: {c:?}",
        c.cutoff_records
    );
    // Where the trainers' time went: each report's buckets sum to its wall time; each
    // trainer started, waited for tasks, computed and evaluated (the spec has a test
    // split); the killed trainer's revoked tasks were trained again by the others
    // (recomputing), which the fault-free run never did.
    let (mut recomputing, mut computing) = (0.0, 0.0);
    for r in &reports {
        let g = goodput_of(r);
        for b in [
            "starting",
            "waiting_for_task",
            "computing",
            "communicating",
            "evaluating",
        ] {
            assert!(g[b] > 0.0, "{b}: {r}");
        }
        recomputing += g["recomputing"];
        computing += g["computing"];
    }
    recomputing += goodput_of(&drained_report)["recomputing"];
    assert!(
        recomputing > 0.0 && recomputing < computing,
        "recomputing {recomputing} s, computing {computing} s: {reports:?}"
    );
    // Without a task dispatched twice, nothing is recomputing.
    assert!(
        base_counters.requeued > 0
            || base_counters.timeouts > 0
            || base_reports
                .iter()
                .all(|r| goodput_of(r)["recomputing"] == 0.0),
        "{base_reports:?}"
    );
    let (_, acc) = final_metric(&reports);
    eprintln!(
        "elastic: accuracy {acc:.4} vs fault-free {base_acc:.4}; joined after {joined_at} tasks; \
         duplicates {} reported + {} cut off",
        c.duplicate_records, c.cutoff_records
    );
    assert!(
        (acc - base_acc).abs() <= 0.05 * base_acc,
        "accuracy {acc} not within 5% of the fault-free {base_acc}"
    );
}
