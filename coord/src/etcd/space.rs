//! Freeing a full etcd ([`Backend::free_space`](crate::Backend::free_space) on etcd): the
//! steps of etcd's own recovery from its `NOSPACE` alarm ("etcdctl compact; etcdctl
//! defrag; etcdctl alarm disarm"), through the Maintenance API:
//!
//! 1. the database size of every member (`Status`), and the current revision;
//! 2. compact the history to that revision (physically: the call returns once every
//!    member has applied it);
//! 3. defragment every member, one at a time: the freed pages return to the file
//!    system, the database file shrinks (etcd's quota counts the file's size, which
//!    only a defragmentation reduces);
//! 4. end every `NOSPACE` alarm (`Alarm` DEACTIVATE, per member). A write that still
//!    does not fit raises it again: ending it early loses nothing.
//!
//! Compaction is allowed while the alarm is raised; so are deletes and lease renewals.
//! With authentication on, defragmenting and ending alarms need `root`.

use std::time::Duration;

use edl_proto::etcd::etcdserverpb::{self as pb, maintenance_client::MaintenanceClient};

use super::EtcdBackend;
use super::failure::Failure;
use crate::error::{Error, Result};
use crate::types::FreedSpace;

/// Shortest time one member gets to defragment (it rewrites the whole database).
const MIN_DEFRAG_TIMEOUT: Duration = Duration::from_secs(30);

impl EtcdBackend {
    pub(super) async fn free_space_now(&self) -> Result<FreedSpace> {
        let before = self.member_status().await?;
        let size_before = before.iter().map(|s| s.db_size).max().unwrap_or(0);
        let revision = before
            .iter()
            .filter_map(|s| s.header.as_ref().map(|h| h.revision))
            .max()
            .unwrap_or(0);
        if revision > 1 {
            match crate::Backend::compact(self, revision).await {
                Ok(()) => {}
                // Someone (etcd's auto-compaction) got there first.
                Err(Error::InvalidArgument(m)) if m.contains("compacted") => {}
                Err(e) => return Err(e),
            }
        }
        let timeout = self.inner.cfg.request_timeout.max(MIN_DEFRAG_TIMEOUT);
        for i in 0..self.inner.slots.len() {
            self.maintenance(i, timeout, |mut m| async move {
                m.defragment(pb::DefragmentRequest {}).await?;
                Ok(())
            })
            .await?;
        }
        let alarms = self
            .maintenance(0, self.inner.cfg.request_timeout, |mut m| async move {
                Ok(m.alarm(pb::AlarmRequest {
                    action: pb::alarm_request::AlarmAction::Get as i32,
                    member_id: 0,
                    alarm: pb::AlarmType::None as i32,
                })
                .await?
                .into_inner()
                .alarms)
            })
            .await?;
        let mut disarmed = false;
        for a in alarms
            .into_iter()
            .filter(|a| a.alarm == pb::AlarmType::Nospace as i32)
        {
            self.maintenance(0, self.inner.cfg.request_timeout, |mut m| async move {
                m.alarm(pb::AlarmRequest {
                    action: pb::alarm_request::AlarmAction::Deactivate as i32,
                    member_id: a.member_id,
                    alarm: pb::AlarmType::Nospace as i32,
                })
                .await?;
                Ok(())
            })
            .await?;
            disarmed = true;
        }
        let after = self.member_status().await?;
        let freed = FreedSpace {
            size_before: u64::try_from(size_before).unwrap_or(0),
            size_after: u64::try_from(after.iter().map(|s| s.db_size).max().unwrap_or(0))
                .unwrap_or(0),
            disarmed,
        };
        tracing::info!(?freed, revision, "etcd space freed");
        Ok(freed)
    }

    /// `Status` of every member that answers (at least one must).
    async fn member_status(&self) -> Result<Vec<pb::StatusResponse>> {
        let mut out = Vec::new();
        let mut last = None;
        for i in 0..self.inner.slots.len() {
            let r = self
                .maintenance(i, self.inner.cfg.request_timeout, |mut m| async move {
                    Ok(m.status(pb::StatusRequest {}).await?.into_inner())
                })
                .await;
            match r {
                Ok(s) => out.push(s),
                Err(e) => last = Some(e),
            }
        }
        match (out.is_empty(), last) {
            (true, Some(e)) => Err(e),
            _ => Ok(out),
        }
    }

    /// One Maintenance request to member `i` (not re-sent to another: each member has
    /// its own database), within `timeout`.
    async fn maintenance<T, F, Fut>(&self, i: usize, timeout: Duration, f: F) -> Result<T>
    where
        F: FnOnce(MaintenanceClient<super::conn::Svc>) -> Fut,
        Fut: std::future::Future<Output = Result<T, Failure>>,
    {
        let endpoint = self.inner.slots[i].endpoint.clone();
        let attempt = async {
            let conn = self.conn(i).await?;
            f(MaintenanceClient::with_interceptor(conn.channel, conn.meta)).await
        };
        match tokio::time::timeout(timeout, attempt).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(f)) => Err(super::failure::with_endpoint(f.error, &endpoint)),
            Err(_) => Err(Error::Timeout(timeout)),
        }
    }
}
