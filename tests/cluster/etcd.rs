//! etcd outages: roles started while etcd cannot be reached wait for it (and give up
//! after `--etcd-wait` with one clear error).

use std::time::Duration;

use edl_job::{JobKeys, JobName};

use crate::support::{Proc, World, wait_until};

/// A master and a pserver started while the job's etcd is stopped keep retrying instead
/// of exiting, and start once etcd answers: the pserver claims its shard, the master
/// leads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_started_while_etcd_is_stopped_wait_for_it() {
    let w = World::new("late-etcd").await;
    w.etcd.pause(0).expect("stop etcd");
    let etcd = w.etcd_arg();
    let dir = w.dir.path();
    let args = |role: &str, extra: &[String]| -> Vec<String> {
        let mut a: Vec<String> = [
            role,
            "--etcd",
            etcd.as_str(),
            "--etcd-timeout",
            "1s",
            "--job",
            w.job.as_str(),
            "--lease-ttl",
            "2s",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend_from_slice(extra);
        a
    };
    let mut master = Proc::spawn(dir, "master", &args("master", &[]));
    let checkpoints = w.checkpoint_dir().display().to_string();
    let mut pserver = Proc::spawn(
        dir,
        "pserver",
        &args(
            "pserver",
            &[
                "--shards".into(),
                "1".into(),
                "--checkpoint-dir".into(),
                checkpoints,
            ],
        ),
    );
    let retrying = "etcd unavailable; retrying";
    master.wait_log(retrying, Duration::from_secs(20)).await;
    pserver.wait_log(retrying, Duration::from_secs(20)).await;
    assert!(master.running() && pserver.running(), "a role gave up");

    w.etcd.resume(0).expect("resume etcd");
    let key = JobKeys::new(&JobName::new(w.job.as_str()).expect("a valid job name")).ps(0);
    let claimed = wait_until(Duration::from_secs(30), || async {
        w.backend.get(&key).await.is_ok_and(|kv| kv.is_some())
    })
    .await;
    assert!(
        claimed,
        "the pserver never claimed its shard:\n{}",
        pserver.log()
    );
    let leads = wait_until(Duration::from_secs(30), || async {
        w.client().status().await.is_ok()
    })
    .await;
    assert!(leads, "the master never led:\n{}", master.log());
    assert!(master.running() && pserver.running());
}

/// A role that cannot reach etcd within `--etcd-wait` exits with one error line that
/// names the endpoint once and says what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_gives_up_after_its_etcd_wait_with_one_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let endpoint = "http://127.0.0.1:1";
    let mut p = Proc::spawn(
        dir.path(),
        "pserver",
        &[
            "pserver",
            "--etcd",
            endpoint,
            "--etcd-wait",
            "2s",
            "--job",
            "nowhere",
            "--shards",
            "1",
            "--checkpoint-dir",
            &dir.path().display().to_string(),
        ]
        .map(String::from),
    );
    let status = p.wait_exit(Duration::from_secs(30)).await;
    let log = p.log();
    assert!(!status.success(), "{log}");
    assert!(log.contains("etcd unavailable; retrying"), "{log}");
    let errors: Vec<&str> = log.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "one error line:\n{log}");
    assert_eq!(errors[0].matches(endpoint).count(), 1, "{}", errors[0]);
    assert!(
        errors[0].contains("tried for 2s") && errors[0].contains("--etcd-wait"),
        "{}",
        errors[0]
    );
}
