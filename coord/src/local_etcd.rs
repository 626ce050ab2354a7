//! A local etcd of real processes: `edl run` starts one for a job when no etcd is
//! given, and the test kit (`edl-testkit`) builds its fault-injecting clusters on it.
//!
//! - [`etcd_binary`]: finds the `etcd` binary (`EDL_ETCD_BIN`, else `PATH`);
//!   [`snapshot_tool`] the tool that restores a snapshot (`etcdutl`, `etcdctl`).
//! - [`LocalEtcd`]: 1 or more members on free loopback ports in a temporary
//!   directory. Dropping it kills and reaps every member and removes the directory.
//! - [`spawn_tied_to_process`]: spawns a child that dies with this process.
//!
//! etcd members do not outlive this process, even one killed with SIGKILL: they are
//! started with a parent-death signal (`PR_SET_PDEATHSIG`, SIGKILL). Linux sends that
//! signal when the *thread* that forked the child ends, not the process, and tokio's
//! threads come and go (blocking-pool threads end when idle, runtimes end with their
//! test); so every child is forked by one dedicated thread that lives as long as the
//! process. (The temporary directories, on tmpfs where possible, are removed on drop
//! only.)
//!
//! Each cluster has a unique cluster token and member names; after a start or restart
//! the member answering on each client port is checked to be ours (another process's
//! etcd may have taken a port between the port probe and the bind).

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

use crate::backend::Backend;

/// How long a local etcd keeps history (`--auto-compaction-mode periodic`): it compacts
/// every this long to the revision it had this long ago, so it keeps between one and
/// two of these of writes. An external etcd should be run with compaction too (see
/// `docs/design.md`, section 3).
pub const AUTO_COMPACTION_RETENTION: Duration = Duration::from_secs(300);

/// How a local etcd compacts its history: periodically, keeping `retention` of it (see
/// [`AUTO_COMPACTION_RETENTION`], the default). Periodic rather than revision mode: etcd
/// runs its revision-mode compactor only every 5 minutes whatever the retention, and
/// one revision of a group-committing master holds up to 120 records, so a revision
/// count bounds the history's size only loosely; a time window bounds it by the write
/// rate, and tests can shrink it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Compaction {
    /// The history kept (whole seconds; at least one).
    pub retention: Duration,
}

impl Default for Compaction {
    fn default() -> Self {
        Compaction {
            retention: AUTO_COMPACTION_RETENTION,
        }
    }
}

impl Compaction {
    /// etcd's flags for it.
    fn flags(&self) -> [OsString; 4] {
        [
            "--auto-compaction-mode".into(),
            "periodic".into(),
            "--auto-compaction-retention".into(),
            format!("{}s", self.retention.as_secs().max(1)).into(),
        ]
    }
}

/// How a local etcd is started: its compaction and, for tests of a full etcd, a
/// space quota (`--quota-backend-bytes`; etcd's default is 2 GiB).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// How it compacts its history.
    pub compaction: Compaction,
    /// Its space quota in bytes, if not etcd's default.
    pub quota_bytes: Option<u64>,
}

impl Options {
    /// etcd's flags for them.
    fn flags(&self) -> Vec<OsString> {
        let mut flags = self.compaction.flags().to_vec();
        if let Some(q) = self.quota_bytes {
            flags.extend(["--quota-backend-bytes".into(), q.to_string().into()]);
        }
        flags
    }
}

/// What a member says of its database (etcd's `Status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DbStatus {
    /// The store revision.
    pub revision: i64,
    /// The database file's size in bytes (it never shrinks without a defragmentation).
    pub db_size: i64,
    /// The bytes of it in use (space freed by compaction is not, and is reused).
    pub db_size_in_use: i64,
}
use crate::error::Result;
use crate::etcd::{EtcdBackend, EtcdConfig, probe_channel};
use edl_proto::etcd::etcdserverpb::{
    self as pb, cluster_client::ClusterClient, maintenance_client::MaintenanceClient,
};

/// Environment variable naming the etcd binary to use.
pub const ETCD_BIN_ENV: &str = "EDL_ETCD_BIN";

/// How long [`LocalEtcd::start`] waits for health.
pub const HEALTH_DEADLINE: Duration = Duration::from_secs(30);

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

/// etcd's tool that restores a snapshot: `etcdutl` (etcd >= 3.5), else `etcdctl`
/// (etcd 3.4, with `ETCDCTL_API=3`), beside the etcd binary or on `PATH`.
pub fn snapshot_tool() -> io::Result<PathBuf> {
    let beside = etcd_binary()
        .ok()
        .and_then(|b| b.parent().map(Path::to_path_buf));
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs: Vec<PathBuf> = beside
        .into_iter()
        .chain(std::env::split_paths(&path))
        .collect();
    for tool in ["etcdutl", "etcdctl"] {
        if let Some(found) = dirs
            .iter()
            .map(|d| d.join(tool))
            .find(|c| std::fs::metadata(c).is_ok_and(|m| m.is_file()))
        {
            return Ok(found);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        "neither etcdutl nor etcdctl found beside etcd or on PATH: install etcd's tools \
         (scripts/setup installs Debian's etcd-client)",
    ))
}

/// A member of a cluster made from a snapshot: the flags of `etcdutl snapshot restore`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoredMember {
    /// `--name`: the member's name, as its etcd's `--name`.
    pub name: String,
    /// `--data-dir`: made by the tool; it must not exist.
    pub data_dir: PathBuf,
    /// `--initial-cluster`: every member's `name=peer URL`, as the members' etcd has it.
    pub initial_cluster: String,
    /// `--initial-advertise-peer-urls`: this member's peer URL.
    pub peer_url: String,
    /// `--initial-cluster-token`: the new cluster's token.
    pub token: String,
}

/// Makes `member`'s data directory from `snapshot` with etcd's own tool
/// ([`snapshot_tool`]: `etcdutl snapshot restore`, or `etcdctl snapshot restore` of etcd
/// 3.4). The tool checks the snapshot's hash and refuses a damaged one; its words are in
/// the error.
pub fn restore_snapshot(snapshot: &Path, member: &RestoredMember) -> io::Result<()> {
    let tool = snapshot_tool()?;
    let mut cmd = Command::new(&tool);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("ETCD") {
            cmd.env_remove(&k);
        }
    }
    let out = cmd
        .env("ETCDCTL_API", "3")
        .arg("snapshot")
        .arg("restore")
        .arg(snapshot)
        .arg("--name")
        .arg(&member.name)
        .arg("--data-dir")
        .arg(&member.data_dir)
        .arg("--initial-cluster")
        .arg(&member.initial_cluster)
        .arg("--initial-cluster-token")
        .arg(&member.token)
        .arg("--initial-advertise-peer-urls")
        .arg(&member.peer_url)
        .stdin(Stdio::null())
        .output()?;
    if !out.status.success() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} snapshot restore {} failed ({}): {}",
                tool.display(),
                snapshot.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        ));
    }
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
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
/// `pre_exec` is the only way to run `prctl` in the child before `exec`. Used by
/// `edl run` for its children and by the test kit.
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
            .name("edl-tied-spawner".into())
            .spawn(move || {
                // Lives as long as the process: the sender is in a static.
                for mut req in rx {
                    let _ = req.reply.send(req.cmd.spawn());
                }
            })
            .expect("start the spawner thread");
        Mutex::new(tx)
    });
    let (reply, result) = std::sync::mpsc::channel();
    lock(spawner)
        .send(SpawnRequest { cmd, reply })
        .map_err(|_| io::Error::other("spawner thread is gone"))?;
    result
        .recv()
        .map_err(|_| io::Error::other("spawner thread is gone"))?
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

/// Whether an error of [`LocalEtcd::wait_healthy`] says that a port of ours is
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

/// A local etcd cluster of real processes. Members are numbered from 0; methods
/// taking a member index panic when it is out of range (a caller's bug).
pub struct LocalEtcd {
    bin: PathBuf,
    dir: tempfile::TempDir,
    token: String,
    members: Vec<EtcdMember>,
    options: Options,
}

impl std::fmt::Debug for LocalEtcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalEtcd")
            .field("dir", &self.dir.path())
            .field("endpoints", &self.endpoints())
            .finish()
    }
}

impl LocalEtcd {
    /// Starts `members` etcd members (1 or 3 in practice) and waits until each
    /// reports healthy. Retries with new ports when a port was taken meanwhile. They
    /// compact their history as [`Compaction::default`] says.
    pub async fn start(members: usize) -> io::Result<LocalEtcd> {
        LocalEtcd::start_with(members, Options::default()).await
    }

    /// [`start`](Self::start) with other options (a test's shorter compaction window,
    /// a small space quota).
    pub async fn start_with(members: usize, options: Options) -> io::Result<LocalEtcd> {
        LocalEtcd::start_from(members, options, None).await
    }

    /// Starts `members` members on the data of an etcd snapshot (what `etcdctl snapshot
    /// save` writes, or [`EtcdBackend::snapshot`](crate::EtcdBackend::snapshot)), as an
    /// etcd is restored: each member's data directory made by etcd's own tool
    /// ([`snapshot_tool`]: `etcdutl snapshot restore`, or `etcdctl snapshot restore`
    /// with etcd 3.4), a new cluster token, then the members started on them. Fails,
    /// with the tool's words, when it refuses the snapshot (one whose hash does not
    /// match its data).
    pub async fn start_restored(members: usize, snapshot: &Path) -> io::Result<LocalEtcd> {
        LocalEtcd::start_from(members, Options::default(), Some(snapshot)).await
    }

    async fn start_from(
        members: usize,
        options: Options,
        snapshot: Option<&Path>,
    ) -> io::Result<LocalEtcd> {
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
            let cluster = LocalEtcd {
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
                options,
            };
            if let Some(file) = snapshot {
                for i in 0..members {
                    cluster.restore(i, file)?;
                }
            }
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

    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn data_dir(&self, i: usize) -> PathBuf {
        self.dir
            .path()
            .join(format!("{}.etcd", self.members[i].name))
    }

    /// Makes member `i`'s data directory from `snapshot` with etcd's own tool.
    fn restore(&self, i: usize, snapshot: &Path) -> io::Result<()> {
        let m = &self.members[i];
        restore_snapshot(
            snapshot,
            &RestoredMember {
                name: m.name.clone(),
                data_dir: self.data_dir(i),
                initial_cluster: self.initial_cluster(),
                peer_url: format!("http://127.0.0.1:{}", m.peer_port),
                token: self.token.clone(),
            },
        )
    }

    fn spawn(&self, i: usize, state: &str) -> io::Result<()> {
        let m = &self.members[i];
        let client = format!("http://127.0.0.1:{}", m.client_port);
        let peer = format!("http://127.0.0.1:{}", m.peer_port);
        let initial_cluster = self.initial_cluster();
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
            self.data_dir(i).into(),
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
        // A long job writes millions of revisions (task transitions, checkpoints): keep
        // the history bounded (followers that fall behind a compaction re-list).
        let args = args.into_iter().chain(self.options.flags());
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

    /// A client configuration for every member, with short timeouts for a local
    /// etcd (dial 2 s, request 2 s, keep-alive 5 s / 2 s).
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

    /// Whether member `i` runs (was started and has not exited).
    pub fn is_running(&self, i: usize) -> bool {
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

    /// Starts member `i` again on its ports and data (after [`kill`](Self::kill));
    /// [`wait_healthy`](Self::wait_healthy) tells when it serves.
    pub fn respawn(&self, i: usize) -> io::Result<()> {
        self.spawn(i, "existing")
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
    /// Member `i`'s revision and database sizes.
    pub async fn db_status(&self, i: usize) -> io::Result<DbStatus> {
        let ask = async {
            let channel = probe_channel(&self.endpoint(i), Duration::from_secs(1))
                .await
                .ok_or_else(|| io::Error::other(format!("etcd member {i} unreachable")))?;
            let s = MaintenanceClient::new(channel)
                .status(pb::StatusRequest {})
                .await
                .map_err(|e| io::Error::other(format!("etcd member {i} status: {e}")))?
                .into_inner();
            Ok(DbStatus {
                revision: s.header.map(|h| h.revision).unwrap_or_default(),
                db_size: s.db_size,
                db_size_in_use: s.db_size_in_use,
            })
        };
        tokio::time::timeout(Duration::from_secs(5), ask)
            .await
            .map_err(|_| io::Error::other(format!("etcd member {i} status timed out")))?
    }

    /// The revision member `i` compacted its history to (etcd's `HashKV`: it reads the
    /// whole key space, so ask it rarely).
    pub async fn compact_revision(&self, i: usize) -> io::Result<i64> {
        let ask = async {
            let channel = probe_channel(&self.endpoint(i), Duration::from_secs(1))
                .await
                .ok_or_else(|| io::Error::other(format!("etcd member {i} unreachable")))?;
            let r = MaintenanceClient::new(channel)
                .hash_kv(pb::HashKvRequest { revision: 0 })
                .await
                .map_err(|e| io::Error::other(format!("etcd member {i} hash: {e}")))?
                .into_inner();
            Ok(r.compact_revision)
        };
        tokio::time::timeout(Duration::from_secs(30), ask)
            .await
            .map_err(|_| io::Error::other(format!("etcd member {i} hash timed out")))?
    }

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

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            if let Err(e) = self.kill(i) {
                tracing::warn!(member = i, error = %e, "could not kill etcd member");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cluster whose client port is served by another cluster's etcd (a port
    /// race) is told so, instead of being taken for healthy.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_clusters_etcd_on_our_port_is_detected() {
        let a = LocalEtcd::start(1).await.unwrap();
        assert!(a.check_identity(0).await.unwrap());
        let b = LocalEtcd {
            bin: a.bin.clone(),
            dir: temp_dir().unwrap(),
            token: unique_token(),
            members: vec![EtcdMember {
                name: "not-a-member-of-a".into(),
                client_port: a.members[0].client_port,
                peer_port: a.members[0].peer_port,
                process: Mutex::new(None),
            }],
            options: Options::default(),
        };
        let err = b.check_identity(0).await.unwrap_err();
        assert!(is_port_stolen(&err), "{err}");
        assert!(err.to_string().contains(&a.members[0].name), "{err}");
    }
}
