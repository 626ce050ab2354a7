//! [`EtcdCluster`]: a [`LocalEtcd`] with fault injection for tests (`kill`,
//! `restart`, `pause`, `resume`, and finding the raft leader).

use std::io;
use std::ops::Deref;
use std::time::Duration;

use edl_coord::local_etcd::{HEALTH_DEADLINE, LocalEtcd, Options};
use edl_proto::etcd::etcdserverpb::{self as pb, maintenance_client::MaintenanceClient};
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
