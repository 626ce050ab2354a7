//! Child processes: a role of the *current* test binary run as a child process, so a
//! test can SIGKILL or SIGSTOP "a process holding a lease"; and [`signal`] for any
//! process.

use std::collections::VecDeque;
use std::io;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::lock;

/// Environment variable carrying the role of a [`ChildProcess`].
pub const CHILD_ROLE_ENV: &str = "EDL_TESTKIT_CHILD_ROLE";

/// Sends `sig` to process `pid`.
pub fn signal(pid: u32, sig: Signal) -> io::Result<()> {
    let pid = i32::try_from(pid).map_err(|_| io::Error::other("pid out of range"))?;
    kill(Pid::from_raw(pid), sig).map_err(io::Error::from)
}

/// The role this process was started with by [`ChildProcess`], if any.
pub fn child_role() -> Option<String> {
    std::env::var(CHILD_ROLE_ENV).ok()
}

/// The current executable running a role as a child process: stdout lines are
/// collected for [`expect_line`](Self::expect_line); stderr is kept (last lines)
/// for diagnostics. Killed on drop.
#[derive(Debug)]
pub struct ChildProcess {
    child: tokio::process::Child,
    pid: u32,
    lines: mpsc::UnboundedReceiver<String>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
}

impl ChildProcess {
    /// Runs the current executable with `args`, `role` in [`CHILD_ROLE_ENV`] and
    /// the extra `envs`.
    pub fn spawn_self(args: &[&str], role: &str, envs: &[(&str, &str)]) -> io::Result<Self> {
        let exe = std::env::current_exe()?;
        let mut cmd = tokio::process::Command::new(exe);
        cmd.args(args)
            .env(CHILD_ROLE_ENV, role)
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn()?;
        let pid = child
            .id()
            .ok_or_else(|| io::Error::other("child exited before it could be observed"))?;
        let (tx, lines) = mpsc::unbounded_channel();
        if let Some(out) = child.stdout.take() {
            tokio::spawn(async move {
                let mut rd = BufReader::new(out).lines();
                while let Ok(Some(line)) = rd.next_line().await {
                    if tx.send(line).is_err() {
                        return;
                    }
                }
            });
        }
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        if let Some(err) = child.stderr.take() {
            let tail = stderr_tail.clone();
            tokio::spawn(async move {
                let mut rd = BufReader::new(err).lines();
                while let Ok(Some(line)) = rd.next_line().await {
                    let mut t = lock(&tail);
                    if t.len() >= 200 {
                        t.pop_front();
                    }
                    t.push_back(line);
                }
            });
        }
        Ok(Self {
            child,
            pid,
            lines,
            stderr_tail,
        })
    }

    /// Runs one test of the current test binary (`test_name`, exact match) as a
    /// child with `role`. The test should start with
    /// `let Some(role) = child_role() else { return };` and dispatch on `role`.
    pub fn spawn_test(test_name: &str, role: &str, envs: &[(&str, &str)]) -> io::Result<Self> {
        Self::spawn_self(
            &[test_name, "--exact", "--nocapture", "--test-threads=1"],
            role,
            envs,
        )
    }

    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Waits for a stdout line containing `prefix` and returns what follows it on
    /// that line (trimmed). Other lines are skipped. (A test binary's first line
    /// may start with libtest's `test name ... `.)
    pub async fn expect_line(&mut self, prefix: &str, within: Duration) -> io::Result<String> {
        let deadline = Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                Ok(Some(line)) => {
                    // libtest may have printed "test name ... " on the same line.
                    if let Some(at) = line.find(prefix) {
                        return Ok(line[at + prefix.len()..].trim().to_owned());
                    }
                }
                Ok(None) => {
                    return Err(io::Error::other(format!(
                        "child exited before printing {prefix:?}; stderr tail:\n{}",
                        self.stderr_tail()
                    )));
                }
                Err(_) => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "child did not print {prefix:?} within {within:?}; stderr tail:\n{}",
                            self.stderr_tail()
                        ),
                    ));
                }
            }
        }
    }

    /// The last lines the child wrote to stderr.
    pub fn stderr_tail(&self) -> String {
        lock(&self.stderr_tail)
            .iter()
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn running(&mut self) -> io::Result<()> {
        match self.child.try_wait()? {
            None => Ok(()),
            Some(status) => Err(io::Error::other(format!("child already exited: {status}"))),
        }
    }

    /// SIGKILLs the child and reaps it (also when the kill fails, for instance
    /// because it already exited).
    pub async fn kill(&mut self) -> io::Result<()> {
        let killed = self.child.start_kill();
        let reaped = self.child.wait().await;
        if let Err(e) = &killed {
            tracing::debug!(pid = self.pid, error = %e, "kill failed; reaped anyway");
        }
        reaped.map(|_| ())
    }

    /// SIGSTOPs the child.
    pub fn pause(&mut self) -> io::Result<()> {
        self.running()?;
        signal(self.pid, Signal::SIGSTOP)
    }

    /// SIGCONTs the child.
    pub fn resume(&mut self) -> io::Result<()> {
        self.running()?;
        signal(self.pid, Signal::SIGCONT)
    }

    /// Waits for the child to exit.
    pub async fn wait(&mut self, within: Duration) -> io::Result<ExitStatus> {
        tokio::time::timeout(within, self.child.wait())
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "child did not exit in time"))?
    }
}
