//! The load's servers: a local etcd, and `edl master` and `edl pserver` processes of
//! this binary (children that die with this process), with their addresses.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use edl_coord::local_etcd::{Compaction, LocalEtcd, Options, spawn_tied_to_process};
use edl_coord::{Backend, Election};
use edl_job::{JobKeys, JobName};

/// One `edl` child.
pub struct Proc {
    /// `master-0`, `pserver-3`, ...
    pub name: String,
    child: Child,
    addr_file: PathBuf,
}

impl Proc {
    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The address it listens at, once it wrote it.
    pub fn addr(&self) -> Option<String> {
        std::fs::read_to_string(&self.addr_file)
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
    }

    /// Its resident memory now and at its peak, in bytes (`/proc/<pid>/status`).
    pub fn memory(&self) -> Option<(u64, u64)> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        let kib = |field: &str| {
            status
                .lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
                .map(|k| k * 1024)
        };
        Some((kib("VmRSS:")?, kib("VmHWM:")?))
    }

    /// The seconds of each leader term's load of the queue, from its log ("serving the
    /// queue seconds=...").
    pub fn loads(&self, dir: &Path) -> Vec<f64> {
        let log =
            std::fs::read_to_string(dir.join(format!("{}.log", self.name))).unwrap_or_default();
        log.lines()
            .filter(|l| l.contains("serving the queue"))
            .filter_map(|l| l.split("seconds=").nth(1))
            .filter_map(|v| v.split_whitespace().next()?.parse().ok())
            .collect()
    }

    /// Whether it has exited (and with what).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// SIGKILLs it and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// etcd and the job's servers.
pub struct Cluster {
    /// The etcd.
    pub etcd: LocalEtcd,
    /// A client of it.
    pub backend: Arc<dyn Backend>,
    /// The masters, then the pservers.
    pub masters: Vec<Proc>,
    /// The pservers (shard `i` is held by `pservers[i]`, and with replicas by every
    /// `pservers[i + k * shards]`).
    pub pservers: Vec<Proc>,
    keys: JobKeys,
}

/// What the cluster is started with.
pub struct Setup<'a> {
    /// The job.
    pub job: &'a JobName,
    /// Where logs, addresses and checkpoints go.
    pub dir: &'a Path,
    /// Masters.
    pub masters: usize,
    /// Shards (one pserver process each, times `replicas`).
    pub pservers: u32,
    /// Replicas of each shard (`edl pserver --replicas`; 1: none).
    pub replicas: u32,
    /// etcd's history kept (periodic compaction).
    pub compaction: Duration,
    /// Extra arguments of every `edl master`.
    pub master_args: Vec<String>,
}

impl Cluster {
    /// Starts etcd, then the masters and pservers, and waits until every one listens.
    pub async fn start(s: Setup<'_>) -> anyhow::Result<Cluster> {
        let etcd = LocalEtcd::start_with(
            1,
            Options {
                compaction: Compaction {
                    retention: s.compaction,
                },
                quota_bytes: None,
            },
        )
        .await
        .context("start etcd")?;
        let backend = etcd.connect().await.context("connect to etcd")?;
        let endpoints = etcd.endpoints().join(",");
        let spawn = |name: String, args: Vec<String>| -> anyhow::Result<Proc> {
            let addr_file = s.dir.join(format!("{name}.addr"));
            let log = std::fs::File::create(s.dir.join(format!("{name}.log")))?;
            let exe = std::env::current_exe().context("this program's path")?;
            let mut cmd = Command::new(exe);
            cmd.args(&args)
                .args(["--etcd", &endpoints, "--job", s.job.as_str()])
                .arg("--addr-file")
                .arg(&addr_file)
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log);
            let child = spawn_tied_to_process(cmd).with_context(|| format!("start {name}"))?;
            Ok(Proc {
                name,
                child,
                addr_file,
            })
        };
        let mut masters = Vec::new();
        for i in 0..s.masters {
            let args = std::iter::once("master".to_owned()).chain(s.master_args.iter().cloned());
            masters.push(spawn(format!("master-{i}"), args.collect())?);
        }
        let mut pservers = Vec::new();
        for slot in 0..s.pservers * s.replicas.max(1) {
            let i = slot % s.pservers;
            let ckpt = s.dir.join(format!("checkpoints-{i}"));
            let mut args: Vec<String> = vec![
                "pserver".into(),
                "--index".into(),
                i.to_string(),
                "--shards".into(),
                s.pservers.to_string(),
                "--checkpoint-dir".into(),
                ckpt.display().to_string(),
                "--checkpoint-every".into(),
                "30s".into(),
            ];
            if s.replicas > 1 {
                args.extend(["--replicas".into(), s.replicas.to_string()]);
            }
            pservers.push(spawn(format!("pserver-{slot}"), args)?);
        }
        let mut c = Cluster {
            etcd,
            backend,
            masters,
            pservers,
            keys: JobKeys::new(s.job),
        };
        c.wait_listening(Duration::from_secs(60)).await?;
        Ok(c)
    }

    async fn wait_listening(&mut self, within: Duration) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let mut waiting = Vec::new();
            for p in self.masters.iter_mut().chain(self.pservers.iter_mut()) {
                if let Some(status) = p.exited() {
                    anyhow::bail!("{} exited at start ({status}); see its log", p.name);
                }
                if p.addr().is_none() {
                    waiting.push(p.name.clone());
                }
            }
            if waiting.is_empty() {
                return Ok(());
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "{waiting:?} did not listen within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The index in `masters` of the leading master (the oldest election key's
    /// address), if one leads.
    pub async fn leader(&self) -> Option<usize> {
        let lead = Election::new(self.backend.clone(), self.keys.master_election())
            .leader()
            .await
            .ok()??;
        let addr = String::from_utf8_lossy(&lead.value).into_owned();
        self.masters
            .iter()
            .position(|m| m.addr().as_deref() == Some(addr.as_str()))
    }

    /// A master that died (a crash would hide in the figures).
    pub fn check_alive(&mut self, killed: Option<usize>) -> anyhow::Result<()> {
        for (i, p) in self.masters.iter_mut().enumerate() {
            if Some(i) != killed
                && let Some(s) = p.exited()
            {
                anyhow::bail!("{} exited ({s}); see its log", p.name);
            }
        }
        for p in &mut self.pservers {
            if let Some(s) = p.exited() {
                anyhow::bail!("{} exited ({s}); see its log", p.name);
            }
        }
        Ok(())
    }
}
