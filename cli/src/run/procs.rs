//! Process handling: the command line of each role, spawning children of this same
//! binary (tied to this process, in their own process group, logging to
//! `<run dir>/logs/<name>.log`), signals through `kill(2)`, and reaping.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use anyhow::Context;
use edl_trainer::DeviceChoice;
use nix::sys::signal::Signal;
use nix::unistd::Pid;

use super::supervisor::{ProcId, Role, Sig};
use edl_job::JobSpec;

/// What every child's command line is made of.
#[derive(Debug, Clone)]
pub(crate) struct Launch {
    pub job: String,
    /// etcd client URLs, comma-separated.
    pub etcd: String,
    pub lease_ttl: Duration,
    pub pservers: u32,
    pub checkpoint_every: Duration,
    pub checkpoint_keep: usize,
    pub run_dir: PathBuf,
    pub device: DeviceChoice,
}

impl Launch {
    /// For the job of `spec`.
    pub(crate) fn new(
        spec: &JobSpec,
        etcd: &[String],
        run_dir: &Path,
        device: DeviceChoice,
    ) -> Launch {
        Launch {
            job: spec.name.to_string(),
            etcd: etcd.join(","),
            lease_ttl: spec.cluster.lease_ttl,
            pservers: spec.cluster.pservers,
            checkpoint_every: spec.cluster.checkpoint_every,
            checkpoint_keep: spec.cluster.checkpoint_keep,
            run_dir: run_dir.to_path_buf(),
            device,
        }
    }

    /// The log of process `name`.
    pub(crate) fn log_path(&self, name: &str) -> PathBuf {
        self.run_dir.join("logs").join(format!("{name}.log"))
    }

    /// The file where master `name` writes its bound address (which is also its value
    /// under the election key while it leads).
    pub(crate) fn addr_file(&self, name: &str) -> PathBuf {
        self.run_dir.join("logs").join(format!("{name}.addr"))
    }

    /// The arguments of `edl ROLE ...` for process `name` in `slot`.
    pub(crate) fn args(&self, role: Role, slot: u32, name: &str) -> Vec<String> {
        let mut args: Vec<String> = vec![
            role.name().into(),
            "--etcd".into(),
            self.etcd.clone(),
            "--job".into(),
            self.job.clone(),
            "--lease-ttl".into(),
            humantime::format_duration(self.lease_ttl).to_string(),
        ];
        match role {
            Role::Master => {
                args.extend([
                    "--chunks-per-task".into(),
                    "1".into(),
                    "--addr-file".into(),
                    self.addr_file(name).display().to_string(),
                ]);
            }
            Role::Pserver => {
                args.extend([
                    "--index".into(),
                    slot.to_string(),
                    "--shards".into(),
                    self.pservers.to_string(),
                    "--checkpoint-dir".into(),
                    self.run_dir.join("checkpoints").display().to_string(),
                    "--checkpoint-every".into(),
                    humantime::format_duration(self.checkpoint_every).to_string(),
                    "--keep-checkpoints".into(),
                    self.checkpoint_keep.to_string(),
                ]);
            }
            Role::Trainer => {
                args.extend([
                    "--id".into(),
                    name.to_owned(),
                    "--device".into(),
                    self.device.to_string(),
                    "--report".into(),
                    self.run_dir
                        .join(format!("{name}.json"))
                        .display()
                        .to_string(),
                ]);
            }
        }
        args
    }
}

/// The running children, by supervisor id. Every child is SIGKILLed and reaped on drop.
#[derive(Debug, Default)]
pub(crate) struct Children {
    children: BTreeMap<ProcId, Child>,
}

impl Children {
    /// Starts process `id`: `edl ROLE ...` of this binary. `trainers` is the number of
    /// trainers wanted (they share the cores).
    pub(crate) fn spawn(
        &mut self,
        launch: &Launch,
        id: ProcId,
        role: Role,
        slot: u32,
        name: &str,
        trainers: u32,
    ) -> anyhow::Result<()> {
        let log_path = launch.log_path(name);
        let log = File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("open {}", log_path.display()))?;
        let err = log.try_clone()?;
        let exe = std::env::current_exe().context("find the edl binary")?;
        let mut cmd = Command::new(exe);
        cmd.args(launch.args(role, slot, name))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .env("NO_COLOR", "1");
        if role == Role::Trainer && std::env::var_os("RAYON_NUM_THREADS").is_none() {
            // Share the cores between the trainers instead of oversubscribing them.
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let per = (cores / trainers.max(1) as usize).max(1);
            cmd.env("RAYON_NUM_THREADS", per.to_string());
        }
        // Its own process group: a terminal's Ctrl-C reaches only `edl run`, which stops
        // the children in order (trainers drain first). Tied to this process: if `edl run`
        // dies, however it dies, its children are SIGKILLed.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = edl_coord::local_etcd::spawn_tied_to_process(cmd)
            .with_context(|| format!("start {name}"))?;
        tracing::info!(process = %name, pid = child.id(), "started");
        self.children.insert(id, child);
        Ok(())
    }

    /// Sends `sig` to process `id` (best effort: it may have exited).
    pub(crate) fn signal(&self, id: ProcId, sig: Sig) {
        let Some(child) = self.children.get(&id) else {
            return;
        };
        let sig = match sig {
            Sig::Stop => Signal::SIGSTOP,
            Sig::Cont => Signal::SIGCONT,
            Sig::Term => Signal::SIGTERM,
        };
        if let Ok(pid) = i32::try_from(child.id()) {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid), sig);
        }
    }

    /// SIGKILLs process `id` (not reaped: [`exited`](Self::exited) sees it).
    pub(crate) fn kill(&mut self, id: ProcId) {
        if let Some(child) = self.children.get_mut(&id) {
            let _ = child.kill();
        }
    }

    /// The children that have exited, with their status, reaped and forgotten (in id
    /// order).
    pub(crate) fn exited(&mut self) -> anyhow::Result<Vec<(ProcId, ExitStatus)>> {
        let mut done = Vec::new();
        for (&id, child) in &mut self.children {
            if let Some(status) = child.try_wait().context("wait for a child")? {
                done.push((id, status));
            }
        }
        for (id, _) in &done {
            self.children.remove(id);
        }
        Ok(done)
    }

    /// How many of `ids` still run.
    pub(crate) fn running(&mut self, ids: &[ProcId]) -> usize {
        let mut running = 0;
        for id in ids {
            if let Some(child) = self.children.get_mut(id)
                && matches!(child.try_wait(), Ok(None))
            {
                running += 1;
            }
        }
        running
    }

    /// SIGKILLs and reaps `ids`.
    pub(crate) fn kill_and_reap(&mut self, ids: &[ProcId]) {
        for id in ids {
            if let Some(mut child) = self.children.remove(id) {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for child in self.children.values_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch() -> Launch {
        Launch {
            job: "j".into(),
            etcd: "http://a:1,http://b:2".into(),
            lease_ttl: Duration::from_secs(3),
            pservers: 2,
            checkpoint_every: Duration::from_secs(30),
            checkpoint_keep: 3,
            run_dir: PathBuf::from("/r"),
            device: DeviceChoice::Cpu,
        }
    }

    #[test]
    fn role_command_lines() {
        let l = launch();
        assert_eq!(
            l.args(Role::Master, 0, "master-0").join(" "),
            "master --etcd http://a:1,http://b:2 --job j --lease-ttl 3s --chunks-per-task 1 \
             --addr-file /r/logs/master-0.addr"
        );
        assert_eq!(
            l.args(Role::Pserver, 1, "pserver-1").join(" "),
            "pserver --etcd http://a:1,http://b:2 --job j --lease-ttl 3s --index 1 --shards 2 \
             --checkpoint-dir /r/checkpoints --checkpoint-every 30s --keep-checkpoints 3"
        );
        assert_eq!(
            l.args(Role::Trainer, 2, "trainer-2.1").join(" "),
            "trainer --etcd http://a:1,http://b:2 --job j --lease-ttl 3s --id trainer-2.1 \
             --device cpu --report /r/trainer-2.1.json"
        );
    }
}
