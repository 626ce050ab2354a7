//! An etcd cluster's own membership, for a tool that runs the cluster (the operator's
//! managed etcd of a job): list it, and replace a member that lost its data.
//!
//! A member whose data is gone (its volume lost with its node) must not come back under
//! its old identity: it would have forgotten the entries it acknowledged and the votes it
//! cast, and raft's guarantees rest on both. It is taken out of the membership and a new
//! member added at the same peer URL; the process that then starts there with an empty
//! data directory and `--initial-cluster-state=existing` joins as that new member and
//! receives the data from the leader ([`EtcdBackend::replace_member`]).

use edl_proto::etcd::etcdserverpb::{self as pb, cluster_client::ClusterClient};

use super::EtcdBackend;
use super::failure::{Failure, Resend};
use crate::error::Result;

/// A member of an etcd cluster, as its membership lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdMember {
    /// Its id.
    pub id: u64,
    /// Its name (`--name`); empty for a member added and not yet started.
    pub name: String,
    /// The URLs its peers reach it at.
    pub peer_urls: Vec<String>,
}

impl EtcdMember {
    /// Whether it has started (an added member has no name until it first runs).
    pub fn started(&self) -> bool {
        !self.name.is_empty()
    }
}

impl EtcdBackend {
    /// The cluster's members.
    pub async fn members(&self) -> Result<Vec<EtcdMember>> {
        self.call("list the members", Resend::Always, |c| async move {
            let mut cluster = ClusterClient::with_interceptor(c.channel.clone(), c.meta.clone());
            let r = cluster
                .member_list(pb::MemberListRequest { linearizable: true })
                .await?
                .into_inner();
            Ok(r.members
                .into_iter()
                .map(|m| EtcdMember {
                    id: m.id,
                    name: m.name,
                    peer_urls: m.peer_ur_ls,
                })
                .collect())
        })
        .await
    }

    /// Makes the member at `peer_url` a new one: a started member there (which held data
    /// it has lost) is removed, and a member is added at `peer_url` unless one not yet
    /// started is there already. Safe to repeat after a failure at any step. Needs a
    /// user that may change the membership (`root`). etcd refuses a change (`unhealthy
    /// cluster`, `--strict-reconfig-check`) that would leave it without a quorum of
    /// started members, or before the members that stay have been connected for its
    /// health interval (5 s): the caller tries again later.
    pub async fn replace_member(&self, peer_url: &str) -> Result<()> {
        let at = |m: &EtcdMember| m.peer_urls.iter().any(|u| u == peer_url);
        let members = self.members().await?;
        if let Some(old) = members.iter().find(|m| at(m) && m.started()) {
            let id = old.id;
            self.call("remove a member", Resend::IfNotSent, move |c| async move {
                let mut cluster =
                    ClusterClient::with_interceptor(c.channel.clone(), c.meta.clone());
                match cluster.member_remove(pb::MemberRemoveRequest { id }).await {
                    Ok(_) => Ok(()),
                    // Removed already (an earlier attempt whose answer was lost).
                    Err(s) if s.message().contains("member not found") => Ok(()),
                    Err(s) => Err(Failure::from(s)),
                }
            })
            .await?;
        } else if members.iter().any(at) {
            // Added, not yet started: what a new process there joins as.
            return Ok(());
        }
        let url = peer_url.to_owned();
        self.call("add a member", Resend::IfNotSent, move |c| {
            let url = url.clone();
            async move {
                let mut cluster =
                    ClusterClient::with_interceptor(c.channel.clone(), c.meta.clone());
                match cluster
                    .member_add(pb::MemberAddRequest {
                        peer_ur_ls: vec![url],
                        is_learner: false,
                    })
                    .await
                {
                    Ok(_) => Ok(()),
                    // Added already (an earlier attempt whose answer was lost).
                    Err(s) if s.message().contains("peerURL exists") => Ok(()),
                    Err(s) => Err(Failure::from(s)),
                }
            }
        })
        .await
    }
}
