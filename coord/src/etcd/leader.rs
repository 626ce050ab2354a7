//! A write in flight when its member's leader changes.
//!
//! A member forwards a write to its raft leader. When that leader dies (or hangs) with
//! the proposal, the member never answers: the proposal is gone, and a new leader, elected
//! about an election timeout later, never hears of it. The write then waited out the
//! whole request timeout (5 s by default: an etcd leader's SIGKILL cost a job 5 s of
//! training, docs/benchmarks.md). [`EtcdBackend::leader_moved`] watches the member's raft
//! state while a write waits: once the member has no leader or a newer raft term than
//! when the write was sent, the write ends as a timeout does (it may have been applied:
//! the caller's retry is fenced, as after any timeout), about an election after the
//! leader's loss instead of the request timeout.

use std::time::Duration;

use edl_proto::etcd::etcdserverpb::{self as pb, maintenance_client::MaintenanceClient};

use super::EtcdBackend;

/// A write that has not been answered after this long starts watching its member's
/// raft state (a healthy etcd answers writes in milliseconds: the probes cost nothing
/// then).
pub(super) const LEADER_PROBE_AFTER: Duration = Duration::from_millis(50);

/// How often a waiting write asks its member for its raft state.
const LEADER_PROBE_EVERY: Duration = Duration::from_millis(200);

/// Bound on one probe (a hung member: the write's own timeout deals with it).
const LEADER_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// A member's raft state, as its `Status` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Raft {
    term: u64,
    /// Its leader's member id; 0 while it has none.
    leader: u64,
}

impl EtcdBackend {
    /// Completes once member `i` has no leader, or a raft term newer than the first
    /// one seen from [`LEADER_PROBE_AFTER`] on; never while its state cannot be read.
    pub(super) async fn leader_moved(&self, i: usize) {
        tokio::time::sleep(LEADER_PROBE_AFTER).await;
        let mut first = None;
        loop {
            if let Some(now) = self.raft(i).await {
                let first = *first.get_or_insert(now);
                if now.leader == 0 || now.term > first.term {
                    return;
                }
            }
            tokio::time::sleep(LEADER_PROBE_EVERY).await;
        }
    }

    /// Member `i`'s raft state; `None` when it cannot be read in time. A member that
    /// refuses for want of a leader (the connections require one) has none.
    async fn raft(&self, i: usize) -> Option<Raft> {
        let conn = self.conn(i).await.ok()?;
        let mut m = MaintenanceClient::with_interceptor(conn.channel, conn.meta);
        let asked = tokio::time::timeout(LEADER_PROBE_TIMEOUT, m.status(pb::StatusRequest {}));
        match asked.await {
            Ok(Ok(r)) => {
                let r = r.into_inner();
                Some(Raft {
                    term: r.raft_term,
                    leader: r.leader,
                })
            }
            Ok(Err(s)) if s.message().contains("no leader") => Some(Raft { term: 0, leader: 0 }),
            _ => None,
        }
    }
}
