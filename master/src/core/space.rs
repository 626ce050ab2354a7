//! A full etcd pauses the job (etcd raised its `NOSPACE` alarm: it refuses every write
//! that adds data, and still serves reads, deletes and lease renewals).
//!
//! The actor stops serving the queue: every request but `Status` is refused with
//! [`MasterError::EtcdFull`] (trainers retry, and keep their leases, which etcd still
//! renews), and the status says the job is paused and what to do. It says so once in
//! its log. It frees etcd's space itself where its user may (compaction to the current
//! revision, defragmentation, ending the alarm: [`Backend::free_space`]), at once and
//! then every [`FREE_EVERY`] (at most that often across pauses); every [`PROBE_EVERY`] it writes a few bytes
//! ([`Store::probe_space`]), and once one fits it rebuilds the queue from etcd (the
//! batch that did not fit was never applied) and serves again. Nothing acknowledged is
//! lost: an acknowledgement that was refused is sent again by its trainer.
//!
//! [`Backend::free_space`]: edl_coord::Backend::free_space
//! [`Store::probe_space`]: crate::store::Store::probe_space

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Core;
use super::handle::Cmd;
use crate::error::MasterError;

/// How often a paused master tries a write.
pub(super) const PROBE_EVERY: Duration = Duration::from_secs(1);

/// How often a paused master frees etcd's space (each time compacts and defragments:
/// every member blocks while it defragments).
pub(super) const FREE_EVERY: Duration = Duration::from_secs(60);

impl Core {
    /// Pauses until a write fits in etcd again and the queue is rebuilt (then `full`
    /// is `None`); returns early, still full, when `cancel` fires or the handles are
    /// gone; fails when the fence broke.
    pub(super) async fn wait_for_space(
        &mut self,
        why: String,
        cancel: &CancellationToken,
    ) -> Result<(), MasterError> {
        let since = Instant::now();
        tracing::error!(
            "{why}; the job is paused until etcd has space again (this master compacts and \
             defragments etcd every {FREE_EVERY:?} where its etcd user may)"
        );
        let refuse = || MasterError::EtcdFull(why.clone());
        for p in self.parked.drain(..) {
            let _ = p.reply.send(Err(refuse()));
        }
        // The status shows the queue as etcd holds it (without the batch that did not
        // fit), when it can be read.
        if let Ok(loaded) = self.load_queue(None).await {
            (self.dataset, self.queue) = loaded.unzip();
        }
        // At most one freeing per FREE_EVERY, across pauses: a job that fills etcd again
        // right after does not make it defragment over and over.
        let mut next_free = self
            .freed_at
            .map_or_else(Instant::now, |at| at + FREE_EVERY);
        let mut said_cannot_free = false;
        let mut probe = tokio::time::interval(PROBE_EVERY);
        probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return Ok(()),
                cmd = self.rx.recv() => match cmd {
                    None => return Ok(()),
                    Some(Cmd::Status { reply }) => {
                        let _ = reply.send(Ok(self.status()));
                    }
                    Some(other) => other.refuse(refuse),
                },
                _ = probe.tick() => {
                    if Instant::now() >= next_free {
                        next_free = Instant::now() + FREE_EVERY;
                        self.freed_at = Some(Instant::now());
                        self.free_space(&mut said_cannot_free).await;
                    }
                    match self.try_resume().await {
                        Ok(true) => break,
                        Ok(false) => {}
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        self.full = None;
        tracing::warn!(
            paused = ?since.elapsed(),
            "etcd has space again; the job goes on"
        );
        Ok(())
    }

    /// Frees etcd's space if this master's etcd user may; says once when it may not.
    async fn free_space(&self, said_cannot_free: &mut bool) {
        match self.store.free_space().await {
            Ok(freed) => tracing::warn!(
                size_before = freed.size_before,
                size_after = freed.size_after,
                alarm_ended = freed.disarmed,
                "compacted and defragmented etcd"
            ),
            Err(e) if !*said_cannot_free => {
                *said_cannot_free = true;
                tracing::warn!(
                    error = %e,
                    "this master cannot free etcd's space: its operator must (compact, \
                     defragment every member, `etcdctl alarm disarm`)"
                );
            }
            Err(e) => tracing::debug!(error = %e, "freeing etcd's space failed"),
        }
    }

    /// Writes the space probe and, when it fits, rebuilds the queue: `Ok(true)` once
    /// the queue can be served again.
    async fn try_resume(&mut self) -> Result<bool, MasterError> {
        let attempt = match self.store.probe_space().await {
            Ok(()) => self.reload(None).await,
            Err(e) => Err(e),
        };
        match attempt {
            Ok(()) => Ok(true),
            Err(e @ MasterError::NotLeader { .. }) => Err(e),
            Err(e) => {
                tracing::debug!(error = %e, "etcd has no space yet");
                Ok(false)
            }
        }
    }
}
