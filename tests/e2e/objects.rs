//! Object storage, against a real S3 server (`edl-s3-server` on loopback): `edl data
//! put` uploads a dataset and `edl data ls` lists it (sizes and URLs, globs too);
//! missing credentials and a bad URL are one clear error each; `edl run` trains MNIST
//! from `s3://` data alone.

use std::process::{Command, Output};
use std::time::Duration;

use edl_testkit::s3::S3Server;

use crate::run::{metric, read_report};
use crate::support::{Proc, World, edl_bin};
use crate::trainer::mnist;

/// `edl ARGS` with `vars` only (no AWS variables of this machine's environment).
fn edl(args: &[&str], vars: &[(String, String)]) -> Output {
    let mut cmd = Command::new(edl_bin());
    for (k, _) in std::env::vars() {
        if k.starts_with("AWS_") || k.starts_with("GOOGLE_") || k.starts_with("AZURE_") {
            cmd.env_remove(k);
        }
    }
    cmd.args(args)
        .envs(vars.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .expect("run edl")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn edl_data_put_and_ls_move_a_dataset_to_s3_and_bad_input_is_one_error() {
    let dir = tempfile::tempdir().expect("temp dir");
    let server = S3Server::start(&dir.path().join("s3")).expect("the S3 server");
    server.create_bucket("datasets").expect("bucket");
    let local = dir.path().join("mnist");
    std::fs::create_dir_all(&local).expect("mkdir");
    for (name, len) in [
        ("train-00000-of-00002.recordio", 1000usize),
        ("train-00001-of-00002.recordio", 2500),
        ("test-00000-of-00001.recordio", 300),
    ] {
        std::fs::write(local.join(name), vec![7u8; len]).expect("write");
    }
    let vars = server.env();
    let out = edl(
        &[
            "data",
            "put",
            &local.display().to_string(),
            "s3://datasets/mnist/",
        ],
        &vars,
    );
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).lines().count(),
        3,
        "one line per file: {}",
        text(&out)
    );
    // On the server's disk: the S3 server stored them.
    assert_eq!(
        std::fs::read(
            dir.path()
                .join("s3/datasets/mnist/train-00001-of-00002.recordio")
        )
        .expect("the object on the server's disk")
        .len(),
        2500
    );
    let out = edl(&["data", "ls", "s3://datasets/mnist/"], &vars);
    assert!(out.status.success(), "{}", text(&out));
    let listing = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(listing.lines().count(), 3, "{listing}");
    assert!(
        listing.contains("2500  s3://datasets/mnist/train-00001-of-00002.recordio"),
        "{listing}"
    );
    let out = edl(
        &["data", "ls", "s3://datasets/mnist/train-*.recordio"],
        &vars,
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).lines().count(),
        2,
        "{}",
        text(&out)
    );

    // No credentials: one error naming what to set, and a failure.
    let endpoint_only: Vec<(String, String)> = vars
        .iter()
        .filter(|(k, _)| !k.starts_with("AWS_ACCESS") && !k.starts_with("AWS_SECRET"))
        .cloned()
        .collect();
    let out = edl(&["data", "ls", "s3://datasets/mnist/"], &endpoint_only);
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        said.contains("no credentials for S3") && said.contains("AWS_ACCESS_KEY_ID"),
        "{said}"
    );
    assert_eq!(
        said.matches("no credentials").count(),
        1,
        "said once: {said}"
    );
    // A URL edl cannot use.
    let out = edl(&["data", "ls", "ftp://host/x"], &vars);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unsupported scheme \"ftp\""),
        "{}",
        text(&out)
    );
}

/// MNIST converted locally, put on a new S3 server under `s3://datasets/mnist/`, and
/// the local copies deleted; a spec of job `name` (`passes` of batch 32, a pserver, two
/// trainers) reading only from there. The server, the variables that reach it (with
/// `extra`), and the `edl run` arguments (with a report at the returned path).
fn mnist_job_on_s3(
    w: &World,
    name: &str,
    passes: u32,
    extra: &[(&str, &str)],
) -> (
    S3Server,
    Vec<(String, String)>,
    Vec<String>,
    std::path::PathBuf,
) {
    let dir = w.dir.path();
    let server = S3Server::start(&dir.join("s3")).expect("the S3 server");
    server.create_bucket("datasets").expect("bucket");
    let mut vars = server.env();
    vars.extend(
        extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    let (train, _test) = mnist(dir);
    let local = std::path::Path::new(&train)
        .parent()
        .expect("the data folder")
        .to_path_buf();
    let out = edl(
        &[
            "data",
            "put",
            &local.display().to_string(),
            "s3://datasets/mnist/",
        ],
        &vars,
    );
    assert!(out.status.success(), "{}", text(&out));
    std::fs::remove_dir_all(&local).expect("delete the local copies");
    let spec = dir.join("job.toml");
    std::fs::write(
        &spec,
        format!(
            "name = \"{name}\"\n[data]\ntrain = \"s3://datasets/mnist/mnist-train-*.recordio\"\n\
             test = \"s3://datasets/mnist/mnist-test-*.recordio\"\n[model]\nkind = \"mnist_mlp\"\n\
             [train]\nmode = \"async\"\npasses = {passes}\nbatch_size = 32\noptimizer = \"adam\"\n\
             learning_rate = 0.001\nseed = 7\n[cluster]\npservers = 1\ntrainers = 2\n"
        ),
    )
    .expect("write the spec");
    let report = dir.join(format!("{name}.report.json"));
    let args: Vec<String> = [
        "run",
        &spec.display().to_string(),
        "--etcd",
        &w.etcd_arg(),
        "--report",
        &report.display().to_string(),
        "--quiet",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    (server, vars, args, report)
}

/// MNIST converted locally, put on the S3 server, and the local copies deleted: `edl
/// run` (two trainers, a pserver) indexes the objects from their chunk headers, reads
/// each task with a ranged read, evaluates on the `s3://` test split, and reaches the
/// accuracy it reaches from local files, with no record lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edl_run_trains_mnist_from_s3_data() {
    let w = World::new("unused").await;
    let dir = w.dir.path();
    let (_server, vars, args, report) = mnist_job_on_s3(&w, "mnist-s3", 4, &[]);
    let mut p = Proc::spawn_with_env(dir, "mnist-s3", &args, &vars);
    let status = p.wait_exit(Duration::from_secs(600)).await;
    let log = p.log_with_roles(30);
    assert!(status.success(), "edl run from s3:// failed:\n{log}");
    let r = read_report(&report);
    assert_eq!(r["lost_records"], 0, "{r}");
    let (name, accuracy) = metric(&r);
    assert_eq!(name, "accuracy");
    assert!(
        accuracy >= 0.90,
        "held-out accuracy {accuracy} from s3:// data: {r}"
    );
}

/// The S3 server killed while the job trains from it (after the master indexed the
/// data) and started again on its data a few seconds later: trainers that cannot reach
/// it hand their tasks back unfailed (requests retried for 1 s here,
/// `EDL_STORAGE_RETRY_TIMEOUT`) and take them again once it is back; the job ends with
/// no task failed and no record lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_pauses_the_job_and_loses_nothing() {
    use edl_job::{JobKeys, JobName};
    let w = World::new("unused").await;
    let dir = w.dir.path();
    let (mut server, vars, args, report) = mnist_job_on_s3(
        &w,
        "mnist-outage",
        6,
        &[("EDL_STORAGE_RETRY_TIMEOUT", "1s")],
    );
    let mut p = Proc::spawn_with_env(dir, "mnist-outage", &args, &vars);
    // The master indexed the objects: the dataset is in etcd.
    let keys = JobKeys::new(&JobName::new("mnist-outage").expect("a job name"));
    let indexed = crate::support::wait_until(Duration::from_secs(120), || async {
        w.backend
            .get(&keys.dataset())
            .await
            .ok()
            .flatten()
            .is_some()
    })
    .await;
    assert!(
        indexed,
        "the master never indexed the data:\n{}",
        p.log_with_roles(30)
    );
    server.kill();
    // Out for a few seconds (longer than the 1 s of retries): trainers hit it.
    let hit = crate::support::wait_until(Duration::from_secs(60), || async {
        p.log_with_roles(200)
            .contains("cannot reach the task's data; handing it back")
    })
    .await;
    assert!(hit, "no trainer met the outage:\n{}", p.log_with_roles(30));
    server.restart().expect("the S3 server back on its data");
    let status = p.wait_exit(Duration::from_secs(600)).await;
    let log = p.log_with_roles(30);
    assert!(
        status.success(),
        "the job did not survive the outage:\n{log}"
    );
    let r = read_report(&report);
    assert_eq!(r["lost_records"], 0, "{r}");
    assert_eq!(r["failed_tasks"], serde_json::json!([]), "{r}");
    let (_, accuracy) = metric(&r);
    assert!(accuracy >= 0.90, "held-out accuracy {accuracy}: {r}");
}
