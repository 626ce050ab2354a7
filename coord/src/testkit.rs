//! Test harness, reused by the tests of every crate of the workspace.
//!
//! - [`EtcdCluster`]: real `etcd` processes (1 or 3 members) on free loopback ports
//!   in a temporary directory, with fault injection (`kill`, `restart`, `pause`,
//!   `resume`). Dropping it kills and reaps every member and removes the directory.
//! - [`ChildProcess`]: runs a role of the *current* test binary as a child process
//!   (the binary re-executes itself with [`CHILD_ROLE_ENV`] set), so a test can
//!   SIGKILL or SIGSTOP "a process holding a lease".
//! - [`FaultyBackend`]: wraps a [`Backend`] and injects outages and watch
//!   disconnects, for either backend.
//! - [`wait_until`]: polls a condition until a deadline.
//!
//! The `etcd` binary is found through `EDL_ETCD_BIN`, else on `PATH`.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs::OpenOptions;
use std::future::Future;
use std::io;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
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
use crate::etcd::{EtcdBackend, EtcdConfig};
use crate::types::{KeyValue, LeaseGrant, LeaseId, Revision, Txn, TxnResponse};

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
            let cluster = EtcdCluster {
                bin: bin.clone(),
                dir: temp_dir()?,
                token: format!("edl-test-{}-{attempt}", std::process::id()),
                members: (0..members)
                    .map(|i| EtcdMember {
                        name: format!("m{i}"),
                        client_port: ports[2 * i],
                        peer_port: ports[2 * i + 1],
                        process: Mutex::new(None),
                    })
                    .collect(),
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
                    if !exited {
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
        let child = cmd
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        tracing::debug!(member = i, pid = child.id(), "etcd member spawned");
        *lock(&m.process) = Some(child);
        Ok(())
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

    /// SIGKILLs member `i` and reaps it. A no-op when it is not running.
    pub fn kill(&self, i: usize) -> io::Result<()> {
        let mut p = lock(&self.members[i].process);
        if let Some(mut child) = p.take() {
            tracing::debug!(member = i, pid = child.id(), "killing etcd member");
            child.kill()?;
            child.wait()?;
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

    /// Waits until member `i` (or every member) answers `/health` with true.
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
                let opts =
                    etcd_client::ConnectOptions::new().with_connect_timeout(Duration::from_secs(1));
                let mut c = etcd_client::Client::connect([self.endpoint(i)], Some(opts))
                    .await
                    .ok()?;
                c.status().await.ok()
            };
            match tokio::time::timeout(Duration::from_secs(2), status).await {
                Ok(Some(s)) => {
                    ids.push(s.header().map(|h| h.member_id()));
                    if s.leader() != 0 {
                        leader_id = Some(s.leader());
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

    /// SIGKILLs the child and reaps it.
    pub async fn kill(&mut self) -> io::Result<()> {
        self.child.kill().await
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

/// A [`Backend`] wrapper that injects faults: an outage (every request fails with
/// [`Error::Unavailable`]) and watch disconnects.
#[derive(Debug)]
pub struct FaultyBackend {
    inner: Arc<dyn Backend>,
    down: AtomicBool,
    breaks: watch::Sender<u64>,
}

impl FaultyBackend {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Backend>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            down: AtomicBool::new(false),
            breaks: watch::channel(0).0,
        })
    }

    /// Starts or ends an outage. Starting one also breaks every open watch.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
        if down {
            self.break_watches();
        }
    }

    /// Ends every open watch stream with an `Unavailable` error.
    pub fn break_watches(&self) {
        self.breaks.send_modify(|n| *n += 1);
    }

    fn check(&self) -> Result<()> {
        if self.down.load(Ordering::SeqCst) {
            return Err(Error::unavailable("faulty-backend", "injected outage"));
        }
        Ok(())
    }
}

#[async_trait]
impl Backend for FaultyBackend {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        self.check()?;
        self.inner.get(key).await
    }

    async fn range(&self, prefix: &str) -> Result<(Vec<KeyValue>, Revision)> {
        self.check()?;
        self.inner.range(prefix).await
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision> {
        self.check()?;
        self.inner.put(key, value, lease).await
    }

    async fn delete(&self, key: &str) -> Result<bool> {
        self.check()?;
        self.inner.delete(key).await
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<u64> {
        self.check()?;
        self.inner.delete_prefix(prefix).await
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResponse> {
        self.check()?;
        self.inner.txn(txn).await
    }

    async fn compact(&self, revision: Revision) -> Result<()> {
        self.check()?;
        self.inner.compact(revision).await
    }

    async fn lease_grant(&self, ttl: Duration) -> Result<LeaseGrant> {
        self.check()?;
        self.inner.lease_grant(ttl).await
    }

    async fn lease_keep_alive_once(&self, id: LeaseId) -> Result<Option<Duration>> {
        self.check()?;
        self.inner.lease_keep_alive_once(id).await
    }

    async fn lease_revoke(&self, id: LeaseId) -> Result<()> {
        self.check()?;
        self.inner.lease_revoke(id).await
    }

    async fn lease_ttl(&self, id: LeaseId) -> Result<Option<Duration>> {
        self.check()?;
        self.inner.lease_ttl(id).await
    }

    async fn watch_prefix(
        &self,
        prefix: &str,
        start_revision: Option<Revision>,
    ) -> Result<WatchStream> {
        self.check()?;
        let mut breaks = self.breaks.subscribe();
        breaks.borrow_and_update();
        let inner = self.inner.watch_prefix(prefix, start_revision).await?;
        let stream = futures::stream::unfold(
            (inner, breaks, false),
            |(mut inner, mut breaks, done)| async move {
                if done {
                    return None;
                }
                tokio::select! {
                    biased;
                    _ = breaks.changed() => Some((
                        Err(Error::unavailable("faulty-backend", "injected watch disconnect")),
                        (inner, breaks, true),
                    )),
                    item = inner.next() => item.map(|i| (i, (inner, breaks, false))),
                }
            },
        );
        Ok(Box::pin(stream))
    }
}
