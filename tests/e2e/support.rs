//! Helpers for cross-process tests.

#![allow(dead_code)]

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use edl_coord::Backend;
use edl_job::{JobKeys, JobName};
use edl_master_client::{MasterClient, MasterClientConfig};
use edl_pserver::checkpoint::{CheckpointDir, Manifest};
use edl_recordio::{FileWriter, WriterOptions};
use edl_testkit::EtcdCluster;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The `edl` binary under test.
pub fn edl_bin() -> &'static str {
    env!("CARGO_BIN_EXE_edl")
}

/// A running `edl` process whose output goes to a log file; killed on drop.
pub struct Proc {
    pub name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    /// Starts `edl ARGS...`, logging to `dir/<name>.log`.
    pub fn spawn(dir: &Path, name: &str, args: &[String]) -> Proc {
        Self::spawn_with_env(dir, name, args, &[])
    }

    /// [`Proc::spawn`] with these variables added to the environment.
    pub fn spawn_with_env(
        dir: &Path,
        name: &str,
        args: &[String],
        vars: &[(String, String)],
    ) -> Proc {
        let log = dir.join(format!("{name}.log"));
        let out = File::create(&log).expect("create log");
        let err = out.try_clone().expect("clone log");
        let child = Command::new(edl_bin())
            .args(args)
            .envs(vars.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("EDL_LOG", "info,edl_coord=warn")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("spawn edl");
        Proc {
            name: name.to_owned(),
            child,
            log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends a signal by name (TERM, STOP, CONT) to this process only.
    pub fn signal(&self, sig: &str) {
        let signal: edl_testkit::Signal = format!("SIG{sig}").parse().expect("a signal name");
        edl_testkit::signal(self.child.id(), signal)
            .unwrap_or_else(|e| panic!("kill -{sig} {} failed: {e}", self.child.id()));
    }

    /// The log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The log so far, then the last `lines` lines of every role's log that an `edl run`
    /// started under this process's directory keeps (`**/edl-runs/*/logs/*.log`): what a
    /// failed wait on a whole run shows.
    pub fn log_with_roles(&self, lines: usize) -> String {
        let mut out = self.log();
        let mut logs = Vec::new();
        let mut dirs: Vec<PathBuf> = self
            .log
            .parent()
            .map(Path::to_path_buf)
            .into_iter()
            .collect();
        while let Some(d) = dirs.pop() {
            let Ok(entries) = std::fs::read_dir(&d) else {
                continue;
            };
            for e in entries.flatten() {
                let p = e.path();
                if p.is_dir() {
                    dirs.push(p);
                } else if p.extension().is_some_and(|x| x == "log")
                    && p.parent().is_some_and(|l| l.ends_with("logs"))
                {
                    logs.push(p);
                }
            }
        }
        logs.sort();
        for p in logs {
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            let all: Vec<&str> = text.lines().collect();
            let tail = &all[all.len().saturating_sub(lines)..];
            out.push_str(&format!(
                "\n--- {} (last {} lines)\n{}\n",
                p.display(),
                tail.len(),
                tail.join("\n")
            ));
        }
        out
    }

    /// Whether the process is still running (not exited).
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits for the process to exit within `within`; panics with its log otherwise.
    pub async fn wait_exit(&mut self, within: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            if Instant::now() >= deadline {
                panic!(
                    "{} did not exit within {within:?}; log:\n{}",
                    self.name,
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the log contains `needle`.
    pub async fn wait_log(&self, needle: &str, within: Duration) {
        let ok = wait_until(within, || async { self.log().contains(needle) }).await;
        assert!(
            ok,
            "{} never logged {needle:?}; log:\n{}",
            self.name,
            self.log()
        );
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The number in environment variable `name` (a test's size knob), or `default`.
pub fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

/// The median, 95th percentile (nearest rank) and maximum of `xs` (not empty).
pub fn median_p95_max(mut xs: Vec<f64>) -> (f64, f64, f64) {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    let p95 = xs[((0.95 * n as f64).ceil() as usize).clamp(1, n) - 1];
    (xs[n / 2], p95, xs[n - 1])
}

/// Polls `cond` every 20 ms until true or `within` passes.
pub async fn wait_until<F, Fut>(within: Duration, cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    edl_testkit::wait_until(within, Duration::from_millis(20), cond).await
}

/// A test's world: a temp dir, an etcd, a job name.
pub struct World {
    pub dir: tempfile::TempDir,
    pub etcd: EtcdCluster,
    pub backend: Arc<dyn Backend>,
    pub job: String,
    pub cancel: CancellationToken,
}

impl World {
    pub async fn new(job: &str) -> World {
        let etcd = EtcdCluster::start(1)
            .await
            .expect("start etcd (run scripts/test to install it)");
        let backend = etcd.connect().await.expect("connect to etcd");
        World {
            dir: tempfile::tempdir().expect("tempdir"),
            etcd,
            backend,
            job: job.to_owned(),
            cancel: CancellationToken::new(),
        }
    }

    pub fn etcd_arg(&self) -> String {
        self.etcd.endpoints().join(",")
    }

    /// `edl master` for this job (with a 2 s lease unless `extra` sets one); returns the
    /// process and its bound address.
    pub async fn master(&self, name: &str, extra: &[&str]) -> (Proc, String) {
        let addr_file = self.dir.path().join(format!("{name}.addr"));
        let mut args: Vec<String> = vec![
            "master".into(),
            "--etcd".into(),
            self.etcd_arg(),
            "--job".into(),
            self.job.clone(),
            "--addr-file".into(),
            addr_file.display().to_string(),
        ];
        if !extra.contains(&"--lease-ttl") {
            args.extend(["--lease-ttl".into(), "2s".into()]);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let p = Proc::spawn(self.dir.path(), name, &args);
        let ok = wait_until(Duration::from_secs(20), || async {
            std::fs::read_to_string(&addr_file).is_ok_and(|s| !s.is_empty())
        })
        .await;
        assert!(ok, "master {name} did not start; log:\n{}", p.log());
        let addr = std::fs::read_to_string(&addr_file).expect("addr file");
        (p, addr)
    }

    /// `edl consume` for this job, writing the records it consumed to `<name>.out`.
    pub fn consumer(&self, name: &str, extra: &[&str]) -> Proc {
        let mut args: Vec<String> = vec![
            "consume".into(),
            "--etcd".into(),
            self.etcd_arg(),
            "--job".into(),
            self.job.clone(),
            "--id".into(),
            name.into(),
            "--lease-ttl".into(),
            "2s".into(),
            "--out".into(),
            self.out(name).display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        Proc::spawn(self.dir.path(), name, &args)
    }

    pub fn out(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.out"))
    }

    /// The records a consumer wrote, as (task, generation, record).
    pub fn consumed(&self, name: &str) -> Vec<(String, u64, String)> {
        std::fs::read_to_string(self.out(name))
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let mut it = l.splitn(3, ' ');
                let task = it.next().unwrap_or_default().to_owned();
                let generation = it.next().and_then(|g| g.parse().ok()).unwrap_or(0);
                (task, generation, it.next().unwrap_or_default().to_owned())
            })
            .collect()
    }

    pub fn client(&self) -> MasterClient {
        let mut cfg = MasterClientConfig::new(
            edl_job::JobName::new(self.job.as_str()).expect("a valid job name"),
        );
        cfg.retry_for = Duration::from_secs(30);
        MasterClient::new(self.backend.clone(), cfg, self.cancel.child_token())
    }

    /// Writes `files` RecordIO files of `per_file` records named `f<i>-r<j>`, 5 records a
    /// chunk; returns the glob and every record.
    pub fn dataset(&self, files: usize, per_file: usize) -> (String, Vec<String>) {
        let dir = self.dir.path().join("data");
        std::fs::create_dir_all(&dir).expect("mkdir data");
        let mut all = Vec::new();
        for f in 0..files {
            let mut w = FileWriter::create(
                dir.join(format!("part-{f:03}.recordio")),
                WriterOptions {
                    max_chunk_bytes: 5 * 16,
                    ..WriterOptions::default()
                },
            )
            .expect("create");
            for r in 0..per_file {
                let rec = format!("f{f:03}-r{r:05}");
                w.write(rec.as_bytes()).expect("write");
                all.push(rec);
            }
            w.finish().expect("finish");
        }
        (format!("{}/part-*.recordio", dir.display()), all)
    }
}

impl Drop for World {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// `edl pserver` helpers.
impl World {
    /// The checkpoint root of this world's pservers.
    pub fn checkpoint_dir(&self) -> PathBuf {
        self.dir.path().join("checkpoints")
    }

    /// Starts `edl pserver` for this job (lease TTL 2 s, checkpoints under
    /// [`checkpoint_dir`](Self::checkpoint_dir)) and waits until it holds a shard;
    /// returns the process and its address.
    pub async fn pserver(&self, name: &str, extra: &[&str]) -> (Proc, String) {
        self.pserver_via(name, &self.etcd_arg(), extra).await
    }

    /// [`pserver`](Self::pserver) reaching etcd at `etcd` (a proxy, say).
    pub async fn pserver_via(&self, name: &str, etcd: &str, extra: &[&str]) -> (Proc, String) {
        let addr_file = self.dir.path().join(format!("{name}.addr"));
        let _ = std::fs::remove_file(&addr_file);
        let mut args: Vec<String> = vec![
            "pserver".into(),
            "--etcd".into(),
            etcd.to_owned(),
            "--job".into(),
            self.job.clone(),
            "--lease-ttl".into(),
            "2s".into(),
            "--checkpoint-dir".into(),
            self.checkpoint_dir().display().to_string(),
            "--addr-file".into(),
            addr_file.display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let p = Proc::spawn(self.dir.path(), name, &args);
        let ok = wait_until(Duration::from_secs(20), || async {
            std::fs::read_to_string(&addr_file).is_ok_and(|s| !s.is_empty())
        })
        .await;
        assert!(ok, "pserver {name} did not start; log:\n{}", p.log());
        let addr = std::fs::read_to_string(&addr_file).expect("addr file");
        // A replica that joins an existing group claims nothing: it registers.
        let prefix = if extra.contains(&"--replicas") {
            format!("/edl/{}/ps-member/", self.job)
        } else {
            format!("/edl/{}/ps/", self.job)
        };
        let backend = self.backend.clone();
        let claimed = wait_until(Duration::from_secs(30), || async {
            backend.range(&prefix).await.is_ok_and(|(kvs, _)| {
                kvs.iter()
                    .any(|kv| String::from_utf8_lossy(&kv.value).contains(&addr))
            })
        })
        .await;
        assert!(
            claimed,
            "pserver {name} never claimed a shard; log:\n{}",
            p.log()
        );
        (p, addr)
    }

    /// A pserver client of this job.
    pub async fn ps_client(&self) -> edl_pserver_client::PsClient {
        let mut cfg = edl_pserver_client::PsClientConfig::new(
            edl_job::JobName::new(self.job.as_str()).expect("a valid job name"),
        );
        cfg.retry_for = Duration::from_secs(30);
        cfg.sync_wait = Duration::from_millis(500);
        edl_pserver_client::PsClient::connect(self.backend.clone(), cfg, self.cancel.child_token())
            .await
            .expect("pserver client")
    }

    /// Registers trainer `id` under `trainers/` with a 2 s lease.
    pub async fn register_trainer(&self, id: &str) -> edl_coord::Lease {
        edl_testkit::register_trainer(
            &self.backend,
            format!("/edl/{}/trainers/", self.job),
            id,
            Duration::from_secs(2),
            self.cancel.child_token(),
        )
        .await
    }
}

/// The passes every shard's newest checkpoint holds whole, from the files themselves
/// (local files: read as that shard's pserver does).
pub async fn checkpointed_passes(
    backend: &Arc<dyn Backend>,
    keys: &JobKeys,
    shards: u32,
) -> Vec<u32> {
    checkpointed_passes_in(backend, keys, shards, |path, shard| {
        // The file is <root>/<job>/ps-<shard>/<name>.
        let path = Path::new(path);
        let job_dir = path
            .parent()
            .and_then(Path::parent)
            .expect("<root>/<job>/ps-<shard>/<file>");
        let job = job_dir
            .file_name()
            .and_then(|n| n.to_str())
            .expect("job dir");
        CheckpointDir::new(
            job_dir.parent().expect("root"),
            &JobName::new(job).expect("job name"),
            shard,
        )
    })
    .await
}

/// The job's committed checkpoint manifests, as etcd holds them.
pub async fn manifests(backend: &Arc<dyn Backend>, keys: &JobKeys) -> Vec<Manifest> {
    let (kvs, _) = backend
        .range(&keys.checkpoints())
        .await
        .expect("read the manifests");
    kvs.iter()
        .filter(|kv| keys.manifest_step(&kv.key).is_some())
        .map(|kv| serde_json::from_slice(&kv.value).expect("a manifest"))
        .collect()
}

/// [`checkpointed_passes`], each shard's file read from the directory `dir_of` gives
/// for the file's path (or URL) and the shard.
pub async fn checkpointed_passes_in(
    backend: &Arc<dyn Backend>,
    keys: &JobKeys,
    shards: u32,
    dir_of: impl Fn(&str, u32) -> CheckpointDir,
) -> Vec<u32> {
    let manifests = manifests(backend, keys).await;
    (0..shards)
        .map(|shard| {
            let newest = manifests
                .iter()
                .filter_map(|m| m.entry(shard).map(|e| (m.step, e)))
                .max_by_key(|(step, _)| *step)
                .unwrap_or_else(|| panic!("no checkpoint of shard {shard}"));
            let snap = dir_of(&newest.1.path, shard)
                .read(newest.1, shard, shards)
                .expect("read the checkpoint");
            snap.ledger.summary().sealed
        })
        .collect()
}
