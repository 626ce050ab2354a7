//! Test harness, reused by the tests of every crate of the workspace.
//!
//! - [`EtcdCluster`]: real `etcd` processes (1 or 3 members) on free loopback ports
//!   in a temporary directory, with fault injection (`kill`, `restart`, `pause`,
//!   `resume`). Dropping it kills and reaps every member and removes the directory.
//! - [`ChildProcess`]: runs a role of the *current* test binary as a child process
//!   (the binary re-executes itself with [`CHILD_ROLE_ENV`] set), so a test can
//!   SIGKILL or SIGSTOP "a process holding a lease".
//! - [`FaultyBackend`]: wraps a [`Backend`] and injects outages, watch
//!   disconnects and chosen errors (non-retryable ones too), for either backend,
//!   and counts requests (to check that loops back off).
//! - [`wait_until`]: polls a condition until a deadline.
//!
//! The `etcd` binary is found through `EDL_ETCD_BIN`, else on `PATH`.
//!
//! etcd members do not outlive the test process, even one killed with SIGKILL:
//! they are started with a parent-death signal (`PR_SET_PDEATHSIG`, SIGKILL).
//! Linux sends that signal when the *thread* that forked the child ends, not the
//! process, and tokio's threads come and go (blocking-pool threads end when idle,
//! runtimes end with their test); so every member is forked by one dedicated
//! thread that lives as long as the process. (Their temporary directories, on
//! tmpfs where possible, are removed on drop only.)
//!
//! Each cluster has a unique cluster token and member names; after a start or
//! restart the testkit checks that the member answering on each client port is
//! ours (another test's etcd may have taken a port between the port probe and the
//! bind).

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs::OpenOptions;
use std::future::Future;
use std::io;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::backend::{Backend, WatchStream};
use crate::error::{Error, Result};
use crate::etcd::{EtcdBackend, EtcdConfig, probe_channel};
use crate::types::{KeyValue, LeaseGrant, LeaseId, Revision, Txn, TxnResponse};
use edl_proto::etcd::etcdserverpb::{
    self as pb, cluster_client::ClusterClient, maintenance_client::MaintenanceClient,
};

/// Environment variable naming the etcd binary to use.
pub const ETCD_BIN_ENV: &str = "EDL_ETCD_BIN";

/// Environment variable carrying the role of a [`ChildProcess`].
pub const CHILD_ROLE_ENV: &str = "EDL_TESTKIT_CHILD_ROLE";

/// How long [`EtcdCluster::start`] and [`EtcdCluster::restart`] wait for health.
const HEALTH_DEADLINE: Duration = Duration::from_secs(30);

/// Polls `cond` every `every` until it returns true (then `true`) or `within` has
/// passed (then `false`). Works on paused and real clocks alike.
pub async fn wait_until<F, Fut>(within: Duration, every: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if cond().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(every.min(deadline.saturating_duration_since(Instant::now()))).await;
    }
}

/// Finds the etcd binary: `$EDL_ETCD_BIN`, else `etcd` on `PATH`.
pub fn etcd_binary() -> io::Result<PathBuf> {
    let hint = "install etcd: run scripts/test (installs Debian's etcd-server), or apt-get install etcd-server; \
                or point EDL_ETCD_BIN at an etcd binary";
    if let Some(bin) = std::env::var_os(ETCD_BIN_ENV) {
        let path = PathBuf::from(bin);
        return match std::fs::metadata(&path) {
            Ok(m) if m.is_file() => Ok(path),
            _ => Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{ETCD_BIN_ENV}={} is not a file; {hint}", path.display()),
            )),
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        let candidate = dir.join("etcd");
        if std::fs::metadata(&candidate).is_ok_and(|m| m.is_file()) {
            return Ok(candidate);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("etcd binary not found on PATH; {hint}"),
    ))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn signal(pid: u32, sig: Signal) -> io::Result<()> {
    let pid = i32::try_from(pid).map_err(|_| io::Error::other("pid out of range"))?;
    kill(Pid::from_raw(pid), sig).map_err(io::Error::from)
}

/// One spawn request for the spawner thread.
struct SpawnRequest {
    cmd: Command,
    reply: std::sync::mpsc::Sender<io::Result<Child>>,
}

/// Spawns `cmd` so that the child is SIGKILLed when this process dies, however it
/// dies. The fork happens on a dedicated thread that never ends (see the module
/// docs: the parent-death signal follows the forking thread).
///
/// The one `unsafe` block of the crate (the workspace denies `unsafe_code`):
/// `pre_exec` is the only way to run `prctl` in the child before `exec`. Used by the
/// test harness and by `edl run` for its children.
#[allow(unsafe_code)]
pub fn spawn_tied_to_process(mut cmd: Command) -> io::Result<Child> {
    static SPAWNER: OnceLock<Mutex<std::sync::mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let parent = nix::unistd::getpid();
    // SAFETY: the closure runs in the child between fork and exec; it only makes
    // two async-signal-safe system calls (prctl, getppid) and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(io::Error::from)?;
            // The parent may have died before the prctl: then nobody will kill us.
            if nix::unistd::getppid() != parent {
                return Err(io::Error::other("parent exited during spawn"));
            }
            Ok(())
        });
    }
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("edl-testkit-spawner".into())
            .spawn(move || {
                // Lives as long as the process: the sender is in a static.
                for mut req in rx {
                    let _ = req.reply.send(req.cmd.spawn());
                }
            })
            .expect("start the testkit spawner thread");
        Mutex::new(tx)
    });
    let (reply, result) = std::sync::mpsc::channel();
    lock(spawner)
        .send(SpawnRequest { cmd, reply })
        .map_err(|_| io::Error::other("testkit spawner thread is gone"))?;
    result
        .recv()
        .map_err(|_| io::Error::other("testkit spawner thread is gone"))?
}

/// A cluster token unique to this process and cluster.
fn unique_token() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "edl-test-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Whether an error of [`EtcdCluster::wait_healthy`] says that a port of ours is
/// served by someone else's etcd.
fn is_port_stolen(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::AddrInUse
}

/// Free loopback ports: all listeners are held at once so the ports differ; another
/// process may still take one before etcd binds it (start retries then).
fn free_ports(n: usize) -> io::Result<Vec<u16>> {
    let listeners = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<io::Result<Vec<_>>>()?;
    listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect()
}

fn temp_dir() -> io::Result<tempfile::TempDir> {
    // tmpfs makes etcd's fsyncs cheap; fall back to the default temp dir.
    let shm = Path::new("/dev/shm");
    if std::fs::metadata(shm).is_ok_and(|m| m.is_dir())
        && let Ok(dir) = tempfile::Builder::new().prefix("edl-etcd-").tempdir_in(shm)
    {
        return Ok(dir);
    }
    tempfile::Builder::new().prefix("edl-etcd-").tempdir()
}

struct EtcdMember {
    name: String,
    client_port: u16,
    peer_port: u16,
    process: Mutex<Option<Child>>,
}

/// A local etcd cluster of real processes, for tests. Members are numbered from 0;
/// methods taking a member index panic when it is out of range (a test bug).
pub struct EtcdCluster {
    bin: PathBuf,
    dir: tempfile::TempDir,
    token: String,
    members: Vec<EtcdMember>,
}

impl std::fmt::Debug for EtcdCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdCluster")
            .field("dir", &self.dir.path())
            .field("endpoints", &self.endpoints())
            .finish()
    }
}

impl EtcdCluster {
    /// Starts `members` etcd members (1 or 3 in practice) and waits until each
    /// reports healthy. Retries with new ports when a port was taken meanwhile.
    pub async fn start(members: usize) -> io::Result<EtcdCluster> {
        if members == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "an etcd cluster needs a member",
            ));
        }
        let bin = etcd_binary()?;
        let mut last_err = None;
        for attempt in 0..5 {
            let ports = free_ports(2 * members)?;
            let token = unique_token();
            let cluster = EtcdCluster {
                bin: bin.clone(),
                dir: temp_dir()?,
                members: (0..members)
                    .map(|i| EtcdMember {
                        name: format!("{token}-m{i}"),
                        client_port: ports[2 * i],
                        peer_port: ports[2 * i + 1],
                        process: Mutex::new(None),
                    })
                    .collect(),
                token,
            };
            for i in 0..members {
                cluster.spawn(i, "new")?;
            }
            match cluster.wait_healthy(None, HEALTH_DEADLINE).await {
                Ok(()) => {
                    tracing::info!(endpoints = ?cluster.endpoints(), "etcd cluster started");
                    return Ok(cluster);
                }
                Err(e) => {
                    let exited = (0..members).any(|i| !cluster.is_running(i));
                    tracing::warn!(attempt, error = %e, "etcd cluster did not start");
                    if !exited && !is_port_stolen(&e) {
                        return Err(e);
                    }
                    // Most likely a port race: try again with new ports.
                    last_err = Some(e);
                }
            }
        }
        Err(last_err.unwrap_or_else(|| io::Error::other("etcd cluster did not start")))
    }

    fn log_path(&self, i: usize) -> PathBuf {
        self.dir
            .path()
            .join(format!("{}.log", self.members[i].name))
    }

    fn spawn(&self, i: usize, state: &str) -> io::Result<()> {
        let m = &self.members[i];
        let client = format!("http://127.0.0.1:{}", m.client_port);
        let peer = format!("http://127.0.0.1:{}", m.peer_port);
        let initial_cluster = self
            .members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(i))?;
        let mut cmd = Command::new(&self.bin);
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("ETCD") {
                cmd.env_remove(&k);
            }
        }
        let args: Vec<OsString> = vec![
            "--name".into(),
            m.name.clone().into(),
            "--data-dir".into(),
            self.dir.path().join(format!("{}.etcd", m.name)).into(),
            "--listen-client-urls".into(),
            client.clone().into(),
            "--advertise-client-urls".into(),
            client.into(),
            "--listen-peer-urls".into(),
            peer.clone().into(),
            "--initial-advertise-peer-urls".into(),
            peer.into(),
            "--initial-cluster".into(),
            initial_cluster.into(),
            "--initial-cluster-state".into(),
            state.into(),
            "--initial-cluster-token".into(),
            self.token.clone().into(),
            "--heartbeat-interval".into(),
            "100".into(),
            "--election-timeout".into(),
            "1000".into(),
            "--logger".into(),
            "zap".into(),
        ];
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = spawn_tied_to_process(cmd)?;
        tracing::debug!(member = i, pid = child.id(), "etcd member spawned");
        *lock(&m.process) = Some(child);
        Ok(())
    }

    /// The temporary directory holding the members' data and logs (removed on drop).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Client URLs of every member.
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.members.len()).map(|i| self.endpoint(i)).collect()
    }

    /// Client URL of member `i`.
    pub fn endpoint(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}", self.members[i].client_port)
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the cluster has no member (never true once started).
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// A client configuration for every member, with timeouts fit for tests
    /// (dial 2 s, request 2 s, keep-alive 5 s / 2 s).
    pub fn config(&self) -> EtcdConfig {
        let mut cfg = EtcdConfig::new(self.endpoints())
            .with_dial_timeout(Duration::from_secs(2))
            .with_request_timeout(Duration::from_secs(2));
        cfg.keep_alive = Some((Duration::from_secs(5), Duration::from_secs(2)));
        cfg
    }

    /// Connects a backend to every member with [`config`](Self::config).
    pub async fn connect(&self) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(EtcdBackend::connect(self.config()).await?))
    }

    /// The pid of member `i`, while it runs.
    pub fn pid(&self, i: usize) -> Option<u32> {
        lock(&self.members[i].process).as_ref().map(Child::id)
    }

    fn is_running(&self, i: usize) -> bool {
        let mut p = lock(&self.members[i].process);
        match p.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// SIGKILLs member `i` and reaps it (also when the kill fails, for instance
    /// because it already exited). A no-op when it is not running.
    pub fn kill(&self, i: usize) -> io::Result<()> {
        let mut p = lock(&self.members[i].process);
        if let Some(mut child) = p.take() {
            tracing::debug!(member = i, pid = child.id(), "killing etcd member");
            let killed = child.kill();
            let reaped = child.wait();
            if let Err(e) = &killed {
                tracing::debug!(member = i, error = %e, "kill failed; reaped anyway");
            }
            // Reaped: the member is gone, whatever the kill said.
            reaped?;
        }
        Ok(())
    }

    /// Starts member `i` again on its ports and data (after [`kill`](Self::kill))
    /// and waits until it is healthy.
    pub async fn restart(&self, i: usize) -> io::Result<()> {
        self.kill(i)?;
        self.spawn(i, "existing")?;
        self.wait_healthy(Some(i), HEALTH_DEADLINE).await
    }

    /// SIGSTOPs member `i`: it keeps its sockets but answers nothing.
    pub fn pause(&self, i: usize) -> io::Result<()> {
        self.signal_member(i, Signal::SIGSTOP)
    }

    /// SIGCONTs member `i`.
    pub fn resume(&self, i: usize) -> io::Result<()> {
        self.signal_member(i, Signal::SIGCONT)
    }

    fn signal_member(&self, i: usize, sig: Signal) -> io::Result<()> {
        let mut p = lock(&self.members[i].process);
        let Some(child) = p.as_mut() else {
            return Err(io::Error::other(format!("etcd member {i} is not running")));
        };
        if child.try_wait()?.is_some() {
            return Err(io::Error::other(format!("etcd member {i} has exited")));
        }
        signal(child.id(), sig)
    }

    /// The last `lines` lines of member `i`'s log.
    pub fn log_tail(&self, i: usize, lines: usize) -> String {
        let text = std::fs::read_to_string(self.log_path(i)).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// The name of the etcd member answering on member `i`'s client port (from its
    /// member list and the id in the response header), or `None` when it does not
    /// answer.
    async fn identity(&self, i: usize) -> Option<String> {
        let ask = async {
            let channel = probe_channel(&self.endpoint(i), Duration::from_secs(1)).await?;
            let resp = ClusterClient::new(channel)
                .member_list(pb::MemberListRequest::default())
                .await
                .ok()?
                .into_inner();
            let me = resp.header?.member_id;
            resp.members
                .into_iter()
                .find(|m| m.id == me)
                .map(|m| m.name)
        };
        tokio::time::timeout(Duration::from_secs(2), ask)
            .await
            .ok()
            .flatten()
    }

    /// Whether our member `i` answers on its client port: `Ok(false)` when nothing
    /// answers (yet), an `AddrInUse` error when another etcd does.
    async fn check_identity(&self, i: usize) -> io::Result<bool> {
        match self.identity(i).await {
            Some(name) if name == self.members[i].name => Ok(true),
            Some(name) => Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!(
                    "port {} of etcd member {i} is served by another etcd (member {name:?}, not {:?})",
                    self.members[i].client_port, self.members[i].name
                ),
            )),
            None => Ok(false),
        }
    }

    /// Waits until member `i` (or every member) answers `/health` with true and is
    /// the member of this cluster (an `AddrInUse` error when another etcd answers
    /// on its port).
    pub async fn wait_healthy(&self, member: Option<usize>, within: Duration) -> io::Result<()> {
        let deadline = Instant::now() + within;
        let targets: Vec<usize> = match member {
            Some(i) => vec![i],
            None => (0..self.members.len()).collect(),
        };
        let mut pending = targets;
        loop {
            let mut still = Vec::new();
            for &i in &pending {
                if !self.is_running(i) {
                    return Err(io::Error::other(format!(
                        "etcd member {i} exited during start; log tail:\n{}",
                        self.log_tail(i, 20)
                    )));
                }
                if !health(self.members[i].client_port).await {
                    still.push(i);
                    continue;
                }
                if !self.check_identity(i).await? {
                    still.push(i);
                }
            }
            if still.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let i = still[0];
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "etcd members {still:?} not healthy within {within:?}; log tail of member {i}:\n{}",
                        self.log_tail(i, 20)
                    ),
                ));
            }
            pending = still;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The index of the member that is the raft leader, as reported by the running
    /// members.
    pub async fn leader(&self) -> Option<usize> {
        let mut ids = Vec::new();
        let mut leader_id = None;
        for i in 0..self.members.len() {
            if !self.is_running(i) {
                ids.push(None);
                continue;
            }
            let status = async {
                let channel = probe_channel(&self.endpoint(i), Duration::from_secs(1)).await?;
                MaintenanceClient::new(channel)
                    .status(pb::StatusRequest {})
                    .await
                    .ok()
                    .map(tonic::Response::into_inner)
            };
            match tokio::time::timeout(Duration::from_secs(2), status).await {
                Ok(Some(s)) => {
                    ids.push(s.header.map(|h| h.member_id));
                    if s.leader != 0 {
                        leader_id = Some(s.leader);
                    }
                }
                _ => ids.push(None),
            }
        }
        let leader_id = leader_id?;
        ids.iter().position(|id| *id == Some(leader_id))
    }
}

/// GET /health on a loopback port; true when etcd reports itself healthy.
async fn health(port: u16) -> bool {
    let probe = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut body = Vec::new();
        s.take(64 * 1024).read_to_end(&mut body).await.ok()?;
        Some(String::from_utf8_lossy(&body).contains("\"health\":\"true\""))
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), probe).await,
        Ok(Some(true))
    )
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            if let Err(e) = self.kill(i) {
                tracing::warn!(member = i, error = %e, "could not kill etcd member");
            }
        }
    }
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

/// Makes an injected error (a plain `fn`, so it can be called again and again).
pub type ErrorFn = fn() -> Error;

/// A [`Backend`] wrapper that injects faults: an outage (every request fails with
/// [`Error::Unavailable`]), watch disconnects, and errors of a chosen kind for
/// chosen requests (for instance a non-retryable [`Error::PermissionDenied`]). It
/// counts the requests it sees, so a test can check that a loop backs off.
#[derive(Debug)]
pub struct FaultyBackend {
    inner: Arc<dyn Backend>,
    down: AtomicBool,
    breaks: watch::Sender<u64>,
    failures: Arc<Mutex<Vec<(String, ErrorFn)>>>,
    requests: AtomicU64,
}

/// The pseudo-request name under which [`FaultyBackend::fail`] makes open and new
/// watch streams fail (their next item is the error).
pub const WATCH_STREAM: &str = "watch_stream";

impl FaultyBackend {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Backend>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            down: AtomicBool::new(false),
            breaks: watch::channel(0).0,
            failures: Arc::new(Mutex::new(Vec::new())),
            requests: AtomicU64::new(0),
        })
    }

    /// Starts or ends an outage. Starting one also breaks every open watch.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
        if down {
            self.break_watches();
        }
    }

    /// Makes the requests named in `requests` (the [`Backend`] method names, such
    /// as `"range"` or `"watch_prefix"`, and [`WATCH_STREAM`] for the items of watch
    /// streams) fail with `error()` until [`clear_failures`](Self::clear_failures).
    /// Open watch streams are broken when [`WATCH_STREAM`] is among them.
    pub fn fail(&self, requests: &[&str], error: ErrorFn) {
        lock(&self.failures).extend(requests.iter().map(|r| ((*r).to_owned(), error)));
        if requests.contains(&WATCH_STREAM) {
            self.break_watches();
        }
    }

    /// Ends the failures injected with [`fail`](Self::fail).
    pub fn clear_failures(&self) {
        lock(&self.failures).clear();
    }

    /// How many requests reached this wrapper (failed ones included; each watch
    /// stream item counts as none).
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }

    /// Ends every open watch stream with an `Unavailable` error (or the error
    /// injected for [`WATCH_STREAM`]).
    pub fn break_watches(&self) {
        self.breaks.send_modify(|n| *n += 1);
    }

    fn injected(failures: &Mutex<Vec<(String, ErrorFn)>>, request: &str) -> Option<Error> {
        lock(failures)
            .iter()
            .find(|(r, _)| r == request)
            .map(|(_, make)| make())
    }

    fn check(&self, request: &str) -> Result<()> {
        self.requests.fetch_add(1, Ordering::SeqCst);
        if self.down.load(Ordering::SeqCst) {
            return Err(Error::unavailable("faulty-backend", "injected outage"));
        }
        match Self::injected(&self.failures, request) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

#[async_trait]
impl Backend for FaultyBackend {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        self.check("get")?;
        self.inner.get(key).await
    }

    async fn range(&self, prefix: &str) -> Result<(Vec<KeyValue>, Revision)> {
        self.check("range")?;
        self.inner.range(prefix).await
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision> {
        self.check("put")?;
        self.inner.put(key, value, lease).await
    }

    async fn delete(&self, key: &str) -> Result<bool> {
        self.check("delete")?;
        self.inner.delete(key).await
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<u64> {
        self.check("delete_prefix")?;
        self.inner.delete_prefix(prefix).await
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResponse> {
        self.check("txn")?;
        self.inner.txn(txn).await
    }

    async fn compact(&self, revision: Revision) -> Result<()> {
        self.check("compact")?;
        self.inner.compact(revision).await
    }

    async fn lease_grant(&self, ttl: Duration) -> Result<LeaseGrant> {
        self.check("lease_grant")?;
        self.inner.lease_grant(ttl).await
    }

    async fn lease_keep_alive_once(&self, id: LeaseId) -> Result<Option<Duration>> {
        self.check("lease_keep_alive_once")?;
        self.inner.lease_keep_alive_once(id).await
    }

    async fn lease_revoke(&self, id: LeaseId) -> Result<()> {
        self.check("lease_revoke")?;
        self.inner.lease_revoke(id).await
    }

    async fn lease_ttl(&self, id: LeaseId) -> Result<Option<Duration>> {
        self.check("lease_ttl")?;
        self.inner.lease_ttl(id).await
    }

    async fn watch_prefix(
        &self,
        prefix: &str,
        start_revision: Option<Revision>,
    ) -> Result<WatchStream> {
        self.check("watch_prefix")?;
        let mut breaks = self.breaks.subscribe();
        breaks.borrow_and_update();
        let inner = self.inner.watch_prefix(prefix, start_revision).await?;
        let failures = self.failures.clone();
        let stream = futures::stream::unfold(
            (inner, breaks, failures, false),
            |(mut inner, mut breaks, failures, done)| async move {
                if done {
                    return None;
                }
                if let Some(e) = Self::injected(&failures, WATCH_STREAM) {
                    return Some((Err(e), (inner, breaks, failures, true)));
                }
                tokio::select! {
                    biased;
                    _ = breaks.changed() => {
                        let e = Self::injected(&failures, WATCH_STREAM).unwrap_or_else(|| {
                            Error::unavailable("faulty-backend", "injected watch disconnect")
                        });
                        Some((Err(e), (inner, breaks, failures, true)))
                    }
                    item = inner.next() => item.map(|i| (i, (inner, breaks, failures, false))),
                }
            },
        );
        Ok(Box::pin(stream))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cluster whose client port is served by another cluster's etcd (a port
    /// race) is told so, instead of being taken for healthy.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_clusters_etcd_on_our_port_is_detected() {
        let a = EtcdCluster::start(1).await.unwrap();
        assert!(a.check_identity(0).await.unwrap());
        let b = EtcdCluster {
            bin: a.bin.clone(),
            dir: temp_dir().unwrap(),
            token: unique_token(),
            members: vec![EtcdMember {
                name: "not-a-member-of-a".into(),
                client_port: a.members[0].client_port,
                peer_port: a.members[0].peer_port,
                process: Mutex::new(None),
            }],
        };
        let err = b.check_identity(0).await.unwrap_err();
        assert!(is_port_stolen(&err), "{err}");
        assert!(err.to_string().contains(&a.members[0].name), "{err}");
    }
}
