//! [`EtcdCluster`]: a [`LocalEtcd`] with fault injection for tests (`kill`,
//! `restart`, `pause`, `resume`, and finding the raft leader); [`TlsEtcd`]: one member
//! that serves clients over mutual TLS only.

use std::io;
use std::ops::Deref;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use edl_coord::local_etcd::{
    HEALTH_DEADLINE, LocalEtcd, Options, etcd_binary, spawn_tied_to_process,
};
use edl_coord::{EtcdBackend, EtcdConfig, EtcdTls};
use edl_proto::etcd::etcdserverpb::{self as pb, maintenance_client::MaintenanceClient};
use edl_proto::tls::{LocalCa, TlsFiles};
use nix::sys::signal::Signal;
use tonic::transport::{Channel, Endpoint};

use crate::child::signal;

/// A local etcd cluster of real processes, for tests: everything of [`LocalEtcd`]
/// (through `Deref`: endpoints, `connect`, `kill`, ...) plus fault injection.
/// Members are numbered from 0; methods taking a member index panic when it is out
/// of range (a test bug). Dropping it kills and reaps every member.
#[derive(Debug)]
pub struct EtcdCluster {
    local: LocalEtcd,
}

impl Deref for EtcdCluster {
    type Target = LocalEtcd;

    fn deref(&self) -> &LocalEtcd {
        &self.local
    }
}

impl EtcdCluster {
    /// Starts `members` etcd members (1 or 3 in practice) and waits until each
    /// reports healthy (see [`LocalEtcd::start`]).
    pub async fn start(members: usize) -> io::Result<EtcdCluster> {
        Ok(EtcdCluster {
            local: LocalEtcd::start(members).await?,
        })
    }

    /// [`start`](Self::start) with other options (see [`Options`]: a compaction window,
    /// a space quota).
    pub async fn start_with(members: usize, options: Options) -> io::Result<EtcdCluster> {
        Ok(EtcdCluster {
            local: LocalEtcd::start_with(members, options).await?,
        })
    }

    /// Starts `members` members on the data of an etcd snapshot, restored by etcd's own
    /// tool (see [`LocalEtcd::start_restored`]).
    pub async fn start_restored(
        members: usize,
        snapshot: &std::path::Path,
    ) -> io::Result<EtcdCluster> {
        Ok(EtcdCluster {
            local: LocalEtcd::start_restored(members, snapshot).await?,
        })
    }

    /// Starts one member with authentication on (user `root` with `root_password`, as
    /// `etcdctl user add root && etcdctl auth enable` would do); the cluster and a
    /// backend connected as root.
    pub async fn start_with_auth(
        root_password: &str,
    ) -> io::Result<(EtcdCluster, std::sync::Arc<edl_coord::EtcdBackend>)> {
        use edl_coord::{EtcdBackend, EtcdConfig};
        let cluster = EtcdCluster::start(1).await?;
        let root =
            EtcdBackend::connect_as_root(EtcdConfig::new(cluster.endpoints()), None, root_password)
                .await
                .map_err(io::Error::other)?;
        Ok((cluster, std::sync::Arc::new(root)))
    }

    /// Starts member `i` again on its ports and data (after
    /// [`kill`](LocalEtcd::kill)) and waits until it is healthy.
    pub async fn restart(&self, i: usize) -> io::Result<()> {
        self.local.kill(i)?;
        self.local.respawn(i)?;
        self.local.wait_healthy(Some(i), HEALTH_DEADLINE).await
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
        let Some(pid) = self.local.pid(i) else {
            return Err(io::Error::other(format!("etcd member {i} is not running")));
        };
        if !self.local.is_running(i) {
            return Err(io::Error::other(format!("etcd member {i} has exited")));
        }
        signal(pid, sig)
    }

    /// The index of the member that is the raft leader, as reported by the running
    /// members.
    pub async fn leader(&self) -> Option<usize> {
        let mut ids = Vec::new();
        let mut leader_id = None;
        for i in 0..self.local.len() {
            if !self.local.is_running(i) {
                ids.push(None);
                continue;
            }
            let status = async {
                let channel = channel(&self.local.endpoint(i)).await?;
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

/// A plain channel to one member (for the status query the `Backend` does not offer).
async fn channel(endpoint: &str) -> Option<Channel> {
    Endpoint::from_shared(endpoint.to_owned())
        .ok()?
        .connect_timeout(Duration::from_secs(1))
        .connect()
        .await
        .ok()
}

/// One etcd member serving clients over mutual TLS (`--client-cert-auth`), with
/// certificates from a private CA ([`LocalCa`]), on `https://127.0.0.1:<port>`;
/// killed and reaped on drop.
#[derive(Debug)]
pub struct TlsEtcd {
    child: Child,
    /// Its client URL, `https://127.0.0.1:<port>`.
    pub endpoint: String,
    /// Its CA, and the certificate and key it serves with (also a client's: one name,
    /// both usages).
    pub files: TlsFiles,
    _dir: tempfile::TempDir,
}

impl Drop for TlsEtcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl TlsEtcd {
    /// Starts the member and waits until a client with the job's certificate is
    /// served.
    pub async fn start() -> TlsEtcd {
        let dir = tempfile::tempdir().expect("temp dir");
        let files = LocalCa::generate("tls-test")
            .expect("a private CA")
            .write(&dir.path().join("tls"))
            .expect("write the certificates");
        let (client_port, peer_port) = (crate::free_port(), crate::free_port());
        let client = format!("https://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let path = |p: &std::path::Path| p.as_os_str().to_owned();
        let log = std::fs::File::create(dir.path().join("etcd.log")).expect("log file");
        let mut cmd = Command::new(etcd_binary().expect("etcd binary"));
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("ETCD") {
                cmd.env_remove(&k);
            }
        }
        cmd.arg("--name")
            .arg("tls0")
            .arg("--data-dir")
            .arg(dir.path().join("tls0.etcd"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .arg("--initial-cluster")
            .arg(format!("tls0={peer}"))
            .arg("--cert-file")
            .arg(path(files.cert.as_deref().expect("a certificate")))
            .arg("--key-file")
            .arg(path(files.key.as_deref().expect("a key")))
            .arg("--trusted-ca-file")
            .arg(path(&files.ca))
            .arg("--client-cert-auth")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log);
        let child = spawn_tied_to_process(cmd).expect("spawn etcd");
        let etcd = TlsEtcd {
            child,
            endpoint: client,
            files,
            _dir: dir,
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            match EtcdBackend::connect(etcd.config(etcd.mutual())).await {
                Ok(_) => return etcd,
                Err(e) if tokio::time::Instant::now() < deadline => {
                    tracing::debug!(error = %e, "etcd over TLS not ready yet");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("etcd over TLS never served a client: {e}"),
            }
        }
    }

    /// The CA, the job's certificate and its key.
    pub fn mutual(&self) -> EtcdTls {
        EtcdTls {
            ca_file: Some(self.files.ca.clone()),
            cert_file: self.files.cert.clone(),
            key_file: self.files.key.clone(),
            domain: None,
        }
    }

    /// A client configuration of its endpoint with `tls`.
    pub fn config(&self, tls: EtcdTls) -> EtcdConfig {
        EtcdConfig::new([self.endpoint.clone()])
            .with_dial_timeout(Duration::from_secs(2))
            .with_tls(tls)
    }
}
