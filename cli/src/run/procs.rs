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
use edl_job::spec::ClusterSpec;
use edl_job::{JobSpec, MasterLaunch, PserverLaunch, TrainerLaunch};

/// The program that runs as each trainer: `edl trainer` of this binary, or the spec's
/// `[trainer] entry`, resolved and checked before any process starts.
#[derive(Debug, Clone)]
pub(crate) struct TrainerProgram {
    /// The executable.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Where it starts (the spec file's directory for an entry program).
    pub cwd: Option<PathBuf>,
    /// Whether it is the user's `entry` program.
    pub entry: bool,
}

impl TrainerProgram {
    /// `edl trainer` of this binary.
    pub(crate) fn builtin() -> anyhow::Result<TrainerProgram> {
        Ok(TrainerProgram {
            program: std::env::current_exe().context("find the edl binary")?,
            args: vec!["trainer".into()],
            cwd: None,
            entry: false,
        })
    }

    /// The trainers of `spec` (whose file is in `spec_dir`): its `entry` program, found
    /// and checked (it exists, is a file, is executable), or `edl trainer`.
    pub(crate) fn of(spec: &JobSpec, spec_dir: &Path) -> anyhow::Result<TrainerProgram> {
        let Some((program, args)) = spec.trainer.entry.split_first() else {
            return Self::builtin();
        };
        let path = find_program(program, spec_dir)?;
        Ok(TrainerProgram {
            program: path,
            args: args.to_vec(),
            cwd: Some(spec_dir.to_path_buf()),
            entry: true,
        })
    }
}

/// The executable a `[trainer] entry` names: a path (relative ones were resolved
/// against the spec file) or a name looked up on `PATH`; an error that names it and says
/// what is wrong.
pub(crate) fn find_program(program: &str, spec_dir: &Path) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let check = |path: &Path| -> anyhow::Result<()> {
        let meta = std::fs::metadata(path).map_err(|e| {
            anyhow::anyhow!(
                "trainer.entry: cannot start {}: {e} (build it first, or fix the path; a \
                 relative path is relative to the spec's directory {})",
                path.display(),
                spec_dir.display()
            )
        })?;
        anyhow::ensure!(
            meta.is_file(),
            "trainer.entry: {} is not a file",
            path.display()
        );
        anyhow::ensure!(
            meta.permissions().mode() & 0o111 != 0,
            "trainer.entry: {} is not executable (chmod +x it, or name its interpreter first: \
             entry = [\"python3\", \"{}\"])",
            path.display(),
            path.display()
        );
        Ok(())
    };
    if program.contains('/') {
        let path = PathBuf::from(program);
        check(&path)?;
        return Ok(path);
    }
    let dirs = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&dirs) {
        let path = dir.join(program);
        if path.is_file() {
            check(&path)?;
            return Ok(path);
        }
    }
    anyhow::bail!(
        "trainer.entry: program {program:?} is not on PATH (give its path, e.g. \"./{program}\", \
         relative to the spec's directory {})",
        spec_dir.display()
    )
}

/// What every child's command line is made of: the job's settings of each role
/// (`edl_job::launch`, translated from the spec once), where etcd is, and this run's own
/// (the run directory, the device, the trainer program, the secrets).
#[derive(Debug, Clone)]
pub(crate) struct Launch {
    pub job: String,
    /// etcd client URLs, comma-separated.
    pub etcd: String,
    /// The job's cluster: its pserver slots' settings come from it.
    pub cluster: ClusterSpec,
    /// Every master's settings.
    pub master: MasterLaunch,
    /// Every trainer's settings.
    pub trainers: TrainerLaunch,
    /// `--checkpoint-dir` of the pservers: a directory or an object URL.
    pub checkpoint_dir: String,
    pub run_dir: PathBuf,
    pub device: DeviceChoice,
    pub trainer: TrainerProgram,
    /// The token, TLS and etcd credentials every child gets in its environment.
    pub access: super::access::Access,
}

impl Launch {
    /// For the job of `spec`, its trainers run by `trainer`.
    pub(crate) fn new(
        spec: &JobSpec,
        etcd: &[String],
        run_dir: &Path,
        device: DeviceChoice,
        trainer: TrainerProgram,
        access: super::access::Access,
    ) -> Launch {
        Launch {
            job: spec.name.to_string(),
            etcd: etcd.join(","),
            cluster: spec.cluster.clone(),
            master: MasterLaunch::of(&spec.data, &spec.cluster),
            trainers: TrainerLaunch::of(&spec.trainer, &spec.cluster),
            checkpoint_dir: super::prepare::checkpoint_location(spec, run_dir),
            run_dir: run_dir.to_path_buf(),
            device,
            trainer,
            access,
        }
    }

    /// Replicas of each shard.
    pub(crate) fn replicas(&self) -> u32 {
        self.cluster.pserver_replicas.max(1)
    }

    /// The shard pserver slot `slot` holds.
    pub(crate) fn shard_of(&self, slot: u32) -> u32 {
        slot % self.cluster.pservers.max(1)
    }

    /// The settings of pserver slot `slot`.
    pub(crate) fn pserver(&self, slot: u32) -> PserverLaunch {
        PserverLaunch::of(&self.cluster, slot, self.checkpoint_dir.clone())
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

    /// The arguments of `edl ROLE ...` for master or pserver `name` in `slot`.
    pub(crate) fn args(&self, role: Role, slot: u32, name: &str) -> Vec<String> {
        let mut args: Vec<String> = vec![
            role.name().into(),
            "--etcd".into(),
            self.etcd.clone(),
            "--job".into(),
            self.job.clone(),
        ];
        match role {
            Role::Master => {
                args.extend(self.master.args());
                args.extend([
                    "--addr-file".into(),
                    self.addr_file(name).display().to_string(),
                ]);
            }
            Role::Pserver => args.extend(self.pserver(slot).args()),
            Role::Trainer => {}
        }
        args
    }

    /// The environment of trainer `name` in `slot`, one of `trainers` wanted: the
    /// contract of docs/trainer-api.md (`EDL_*`, and PaddlePaddle's names where they
    /// mean the same), then `[trainer] env`.
    pub(crate) fn trainer_env(
        &self,
        slot: u32,
        name: &str,
        trainers: u32,
    ) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = [
            (edl_job::env::ETCD, self.etcd.clone()),
            (edl_job::env::JOB, self.job.clone()),
            (edl_job::env::TRAINER_ID, name.to_owned()),
            (edl_job::env::DEVICE, self.device.to_string()),
            (
                edl_job::env::REPORT,
                self.run_dir
                    .join(format!("{name}.json"))
                    .display()
                    .to_string(),
            ),
            (edl_job::env::RUN_DIR, self.run_dir.display().to_string()),
            ("PADDLE_TRAINING_ROLE", "TRAINER".to_owned()),
            ("PADDLE_JOB_ID", self.job.clone()),
            ("PADDLE_ETCD_ENDPOINTS", self.etcd.clone()),
            ("PADDLE_TRAINER_ID", slot.to_string()),
            ("PADDLE_TRAINERS_NUM", trainers.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        env.extend(self.trainers.vars());
        env
    }

    /// The command of process `name` (its log, group and tie to this process are set by
    /// [`Children::spawn`]).
    fn command(&self, role: Role, slot: u32, name: &str, trainers: u32) -> anyhow::Result<Command> {
        if role != Role::Trainer {
            let mut cmd = Command::new(std::env::current_exe().context("find the edl binary")?);
            cmd.args(self.args(role, slot, name))
                .envs(self.access.env());
            return Ok(cmd);
        }
        let t = &self.trainer;
        let mut cmd = Command::new(&t.program);
        cmd.args(&t.args)
            .envs(self.trainer_env(slot, name, trainers))
            // Secrets go in the environment (readable by this user only), never in
            // arguments (readable by every local user).
            .envs(self.access.env());
        if let Some(dir) = &t.cwd {
            cmd.current_dir(dir);
        }
        if std::env::var_os("RAYON_NUM_THREADS").is_none() {
            // Share the cores between the trainers instead of oversubscribing them.
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let per = (cores / trainers.max(1) as usize).max(1);
            cmd.env("RAYON_NUM_THREADS", per.to_string());
        }
        Ok(cmd)
    }

    /// Runs the trainer program once with `EDL_MODE=evaluate` (the final evaluation of
    /// a model only the entry program knows), for at most 5 minutes; its report.
    pub(crate) async fn evaluate(&self) -> anyhow::Result<edl_trainer::process::JobEval> {
        const WITHIN: Duration = Duration::from_secs(300);
        let name = "evaluate";
        let report = self.run_dir.join(format!("{name}.json"));
        let _ = std::fs::remove_file(&report);
        let log_path = self.log_path(name);
        let log =
            File::create(&log_path).with_context(|| format!("open {}", log_path.display()))?;
        let mut cmd = self.command(Role::Trainer, 0, name, 1)?;
        cmd.env(edl_job::env::MODE, "evaluate")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .env("NO_COLOR", "1");
        let mut child = edl_coord::local_etcd::spawn_tied_to_process(cmd)
            .with_context(|| format!("start {} to evaluate", self.trainer.program.display()))?;
        let deadline = std::time::Instant::now() + WITHIN;
        let status = loop {
            if let Some(status) = child.try_wait().context("wait for the evaluation")? {
                break status;
            }
            if std::time::Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                anyhow::bail!(
                    "the evaluation by {} did not finish within {WITHIN:?}; see {}",
                    self.trainer.program.display(),
                    log_path.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        anyhow::ensure!(
            status.success(),
            "the evaluation by {} failed ({status}):\n{}",
            self.trainer.program.display(),
            log_tail(&log_path)
        );
        let text = std::fs::read_to_string(&report)
            .with_context(|| format!("read the evaluation's report {}", report.display()))?;
        serde_json::from_str(text.trim())
            .with_context(|| format!("parse the evaluation's report {}", report.display()))
    }
}

/// The last lines of a log (at most 20 lines and 4 KiB), indented, for an error message.
pub(crate) fn log_tail(path: &Path) -> String {
    const LINES: usize = 20;
    const BYTES: u64 = 4096;
    let text = (|| -> std::io::Result<String> {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = File::open(path)?;
        let len = f.metadata()?.len();
        f.seek(SeekFrom::Start(len.saturating_sub(BYTES)))?;
        let mut buf = Vec::new();
        f.read_to_end(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    })();
    match text {
        Ok(t) if t.trim().is_empty() => format!("  ({} is empty)", path.display()),
        Ok(t) => {
            let lines: Vec<&str> = t.lines().collect();
            let tail = &lines[lines.len().saturating_sub(LINES)..];
            let mut out = format!("  last lines of {}:", path.display());
            for l in tail {
                out.push_str("\n  | ");
                out.push_str(l);
            }
            out
        }
        Err(e) => format!("  (cannot read {}: {e})", path.display()),
    }
}

/// The running children, by supervisor id. Every child is SIGKILLed and reaped on drop.
#[derive(Debug, Default)]
pub(crate) struct Children {
    children: BTreeMap<ProcId, Child>,
}

impl Children {
    /// Starts process `id`: `edl ROLE ...` of this binary, or the trainer program with
    /// its environment. `trainers` is the number of trainers wanted (they share the
    /// cores).
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
        let mut cmd = launch.command(role, slot, name, trainers)?;
        cmd.stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .env("NO_COLOR", "1");
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

    /// The process id of child `id`, while it is one.
    pub(crate) fn pid(&self, id: ProcId) -> Option<u32> {
        self.children.get(&id).map(std::process::Child::id)
    }

    /// SIGKILLs process `id` (not reaped: [`exited`](Self::exited) sees it).
    pub(crate) fn kill(&mut self, id: ProcId) {
        if let Some(child) = self.children.get_mut(&id) {
            let _ = child.kill();
        }
    }

    /// The children that have exited, with their status and process id, reaped and
    /// forgotten (in id order).
    pub(crate) fn exited(&mut self) -> anyhow::Result<Vec<(ProcId, ExitStatus, u32)>> {
        let mut done = Vec::new();
        for (&id, child) in &mut self.children {
            if let Some(status) = child.try_wait().context("wait for a child")? {
                done.push((id, status, child.id()));
            }
        }
        for (id, _, _) in &done {
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
    use clap::Parser;

    use super::*;
    use crate::{Cli, Command};

    /// A job of two shards with three chunks per task, its trainers an entry program.
    fn launch(replicas: u32) -> Launch {
        let spec = JobSpec::parse_toml(&format!(
            r#"
name = "j"
[data]
train = "/d/train-*.recordio"
chunks_per_task = 3
[model]
kind = "fit_a_line"
[trainer]
entry = ["python3", "train.py"]
env = {{ FROM_SPEC = "1" }}
[cluster]
pservers = 2
pserver_replicas = {replicas}
lease_ttl = "3s"
checkpoint_every = "30s"
checkpoint_dir = "/r/checkpoints"
"#
        ))
        .expect("a valid spec");
        let trainer = TrainerProgram {
            program: PathBuf::from("/bin/true"),
            args: vec![],
            cwd: None,
            entry: true,
        };
        Launch::new(
            &spec,
            &["http://a:1".to_owned(), "http://b:2".to_owned()],
            Path::new("/r"),
            DeviceChoice::Cpu,
            trainer,
            Default::default(),
        )
    }

    fn parse(args: Vec<String>) -> Command {
        let cli = Cli::try_parse_from(std::iter::once("edl".to_owned()).chain(args))
            .expect("edl parses the command line it was given");
        cli.command.expect("a subcommand")
    }

    #[test]
    fn an_entry_program_that_cannot_start_is_named_before_anything_starts() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        let e = find_program(&missing.display().to_string(), dir.path()).unwrap_err();
        assert!(
            e.to_string().contains("cannot start") && e.to_string().contains("nope"),
            "{e}"
        );
        let plain = dir.path().join("train.py");
        std::fs::write(&plain, "print(1)").unwrap();
        std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = find_program(&plain.display().to_string(), dir.path()).unwrap_err();
        assert!(e.to_string().contains("is not executable"), "{e}");
        let e = find_program(&dir.path().display().to_string(), dir.path()).unwrap_err();
        assert!(e.to_string().contains("is not a file"), "{e}");
        let e = find_program("no-such-program-edl-test", dir.path()).unwrap_err();
        assert!(e.to_string().contains("is not on PATH"), "{e}");
        // A program on PATH is found.
        assert!(find_program("sh", dir.path()).unwrap().is_absolute());
        std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(
            find_program(&plain.display().to_string(), dir.path()).unwrap(),
            plain
        );
    }

    /// What a child is started with is what the spec says, read back by the child's own
    /// argument parser: one translation of the spec (`edl_job::launch`), one rendering.
    #[test]
    fn each_child_parses_back_the_settings_the_spec_gave_its_role() {
        let l = launch(1);
        let Command::Master(m) = parse(l.args(Role::Master, 0, "master-0")) else {
            panic!("not a master");
        };
        assert_eq!(m.launch(), l.master);
        // The spec's chunks per task, which the run once replaced with 1.
        assert_eq!(m.launch().chunks_per_task, 3);
        assert_eq!(m.launch().lease_ttl, Duration::from_secs(3));
        assert_eq!(
            m.listen.addr_file.as_deref(),
            Some(Path::new("/r/logs/master-0.addr"))
        );
        assert_eq!(m.role.etcd.etcd, vec!["http://a:1", "http://b:2"]);
        assert_eq!(m.role.job.job.as_str(), "j");
        for slot in 0..2 {
            let Command::Pserver(p) = parse(l.args(Role::Pserver, slot, "pserver")) else {
                panic!("not a pserver");
            };
            assert_eq!(p.launch(), l.pserver(slot));
        }
        let p = l.pserver(1);
        assert_eq!(p.index, edl_job::launch::IndexChoice::Fixed(1));
        assert_eq!((p.shards, p.replicas, p.keep_checkpoints), (Some(2), 1, 3));
        assert_eq!(p.checkpoint_dir, "/r/checkpoints");
        // With replicas, slot s holds shard s % pservers.
        let r = launch(2);
        let Command::Pserver(p) = parse(r.args(Role::Pserver, 3, "pserver-3")) else {
            panic!("not a pserver");
        };
        assert_eq!(p.launch(), r.pserver(3));
        assert_eq!(
            (p.index, p.replicas),
            (edl_job::launch::IndexChoice::Fixed(1), 2)
        );
    }

    #[test]
    fn a_trainer_is_told_the_contract_then_the_jobs_own_variables() {
        let l = launch(1);
        let vars = l.trainer_env(2, "trainer-2.1", 3);
        let env: BTreeMap<String, String> = vars.iter().cloned().collect();
        for (k, v) in [
            ("EDL_ETCD", "http://a:1,http://b:2"),
            ("EDL_JOB", "j"),
            ("EDL_TRAINER_ID", "trainer-2.1"),
            ("EDL_LEASE_TTL", "3s"),
            ("EDL_DEVICE", "cpu"),
            ("EDL_REPORT", "/r/trainer-2.1.json"),
            ("EDL_MODE", "train"),
            ("PADDLE_TRAINING_ROLE", "TRAINER"),
            ("PADDLE_JOB_ID", "j"),
            ("PADDLE_ETCD_ENDPOINTS", "http://a:1,http://b:2"),
            ("PADDLE_TRAINER_ID", "2"),
            ("PADDLE_TRAINERS_NUM", "3"),
            ("FROM_SPEC", "1"),
        ] {
            assert_eq!(env.get(k).map(String::as_str), Some(v), "{k}");
        }
        // The trainer API reads the same settings back.
        let t = edl_trainer::Trainer::from_vars(|k| env.get(k).cloned()).expect("valid");
        assert_eq!(t.config().lease_ttl, Some(l.trainers.lease_ttl));
        assert_eq!(t.config().id, "trainer-2.1");
        // The job's own variables come last.
        let last = vars.iter().position(|(k, _)| k == "FROM_SPEC");
        assert_eq!(last, Some(vars.len() - 1));
    }
}
