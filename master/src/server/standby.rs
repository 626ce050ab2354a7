//! What a master does while it is not leading, so that it takes over in about a second:
//!
//! - it keeps a [`Mirror`] of the queue's records current from a watch of the job's keys,
//!   so that, elected, it rebuilds the queue from memory instead of reading and decoding
//!   every task record ([`Standby::take`]);
//! - it holds a TCP connection to the leader's address: when the connection closes and
//!   the address then refuses connections, the leader's process is gone (its port is
//!   closed, on a machine that answers), and the leader's election lease is revoked at
//!   once instead of a lease TTL later. Anything else (a silent address: a lost machine,
//!   a partition) is left to the lease, and a live leader whose lease is revoked by
//!   mistake only loses its term: every write of the queue is fenced by the election.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use edl_coord::{Backend, Backoff, Election, LeaderInfo, RetryPolicy, Revision};
use edl_job::JobKeys;
use futures::StreamExt;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::error::MasterError;
use crate::mirror::{Mirror, Mirrored};

/// A standby's background work, until [`Standby::take`] or drop.
pub(super) struct Standby {
    /// Whether it keeps a copy of the queue.
    copy: bool,
    cancel: CancellationToken,
    mirror: Arc<Mutex<Option<Mirror>>>,
    applied: watch::Receiver<Revision>,
    follower: JoinHandle<()>,
}

impl Drop for Standby {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl Standby {
    /// Starts following the queue (with `copy`) and watching the leader (`me`: this
    /// master's address, never watched).
    pub(super) fn start(
        backend: Arc<dyn Backend>,
        keys: JobKeys,
        election: Election,
        me: String,
        copy: bool,
        parent: &CancellationToken,
    ) -> Standby {
        let cancel = parent.child_token();
        let mirror = Arc::new(Mutex::new(None));
        let (applied_tx, applied) = watch::channel(0);
        let (backend2, mirror2, cancel2) = (backend.clone(), mirror.clone(), cancel.clone());
        let follower = tokio::spawn(
            async move {
                if copy {
                    follow(backend2, keys, mirror2, applied_tx, cancel2).await;
                }
            }
            .in_current_span(),
        );
        tokio::spawn(watch_leader(backend, election, me, cancel.clone()).in_current_span());
        Standby {
            copy,
            cancel,
            mirror,
            applied,
            follower,
        }
    }

    /// Stops, and returns the queue's records as etcd holds them now, once the mirror has
    /// seen a write made now (`keys.master_takeover()`, written by this new leader: every
    /// write of the leaders before comes first); `None` when it has not within `within`,
    /// or had no copy yet (still reading it: the caller reads the records from etcd).
    pub(super) async fn take(
        mut self,
        backend: &Arc<dyn Backend>,
        keys: &JobKeys,
        me: &str,
        within: Duration,
    ) -> Option<Mirrored> {
        // Not seeded yet: reading the records is what the seeding is doing anyway.
        if !self.copy || *self.applied.borrow() == 0 {
            return None;
        }
        let marker = backend
            .put(&keys.master_takeover(), me.as_bytes().to_vec(), None)
            .await;
        let caught_up = match marker {
            Ok(at) => tokio::time::timeout(within, self.applied.wait_for(|r| *r >= at))
                .await
                .is_ok_and(|r| r.is_ok()),
            Err(e) => {
                tracing::debug!(error = %e, "takeover marker not written");
                false
            }
        };
        self.cancel.cancel();
        let _ = (&mut self.follower).await;
        let mirror = self.mirror.lock().map_or(None, |mut m| m.take());
        match (caught_up, mirror) {
            (true, Some(m)) => Some(m.records()),
            (_, m) => {
                tracing::info!(
                    following = m.is_some(),
                    "the standby's copy of the queue is not current: reading it from etcd"
                );
                None
            }
        }
    }
}

/// Keeps `slot` current (`None` while seeding or after an error, then seeded again) and
/// `applied` at the newest revision applied (0: no copy), until `cancel` fires.
async fn follow(
    backend: Arc<dyn Backend>,
    keys: JobKeys,
    slot: Arc<Mutex<Option<Mirror>>>,
    applied: watch::Sender<Revision>,
    cancel: CancellationToken,
) {
    let mut backoff = Backoff::new(
        RetryPolicy::forever().with_delays(Duration::from_millis(500), Duration::from_secs(30)),
    );
    while !cancel.is_cancelled() {
        let r = tokio::select! {
            _ = cancel.cancelled() => return,
            r = follow_once(&backend, &keys, &slot, &applied) => r,
        };
        if let Ok(mut m) = slot.lock() {
            *m = None;
        }
        applied.send_replace(0);
        if let Err(e) = r {
            tracing::info!(error = %e, "the standby's copy of the queue is seeded again");
        }
        backoff.wait(&cancel).await;
    }
}

/// Seeds a mirror and applies the watch's changes until the watch fails.
async fn follow_once(
    backend: &Arc<dyn Backend>,
    keys: &JobKeys,
    slot: &Mutex<Option<Mirror>>,
    applied: &watch::Sender<Revision>,
) -> Result<(), MasterError> {
    let started = std::time::Instant::now();
    let mut m = Mirror::new(keys.clone());
    let (tasks, at_tasks) = backend.range(&keys.tasks()).await?;
    m.seed(&tasks, at_tasks)?;
    drop(tasks);
    let (records, at_records) = backend.range(&keys.job_records()).await?;
    m.seed(&records, at_records)?;
    let mut watch = backend
        .watch_prefix(keys.root(), Some(at_tasks.min(at_records) + 1))
        .await?;
    tracing::info!(
        tasks = m.tasks(),
        revision = m.revision(),
        seconds = started.elapsed().as_secs_f64(),
        "following the queue as a standby"
    );
    let mut revision = m.revision();
    *lock(slot)? = Some(m);
    applied.send_replace(revision);
    loop {
        let ev = match watch.next().await {
            Some(ev) => ev?,
            None => return Err(MasterError::Unavailable("the watch ended".into())),
        };
        if let Some(m) = lock(slot)?.as_mut() {
            m.apply(&ev)?;
            revision = m.revision();
        }
        applied.send_replace(revision);
    }
}

fn lock(
    slot: &Mutex<Option<Mirror>>,
) -> Result<std::sync::MutexGuard<'_, Option<Mirror>>, MasterError> {
    slot.lock()
        .map_err(|_| MasterError::Unavailable("the standby's copy was poisoned".into()))
}

/// How many connection attempts, how far apart, must be refused before the leader's
/// process counts as gone.
const REFUSALS: u32 = 3;
const REFUSAL_GAP: Duration = Duration::from_millis(100);

/// Watches the leader's process through a connection to its address (module docs),
/// until `cancel` fires.
async fn watch_leader(
    backend: Arc<dyn Backend>,
    election: Election,
    me: String,
    cancel: CancellationToken,
) {
    let mut leader = election.observe(cancel.child_token());
    loop {
        let current = leader.borrow_and_update().clone();
        let watched = match current {
            Some(info) if info.value != me.as_bytes() => Some(info),
            _ => None,
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            r = leader.changed() => if r.is_err() { return },
            _ = async {
                match watched {
                    Some(info) => watch_one(&backend, &info).await,
                    None => std::future::pending().await,
                }
            } => {
                // Revoked, or not watchable: wait for the next leader (the lease ends it).
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    r = leader.changed() => if r.is_err() { return },
                }
            }
        }
    }
}

/// Returns once `info`'s lease was revoked (its process gone) or its address cannot be
/// watched; while the leader lives, never.
async fn watch_one(backend: &Arc<dyn Backend>, info: &LeaderInfo) {
    let addr = String::from_utf8_lossy(&info.value).into_owned();
    loop {
        match TcpStream::connect(&addr).await {
            Ok(mut stream) => {
                // Whatever the server sends is read and dropped, until it closes.
                let mut buf = [0u8; 1024];
                while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
            }
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
            Err(e) => {
                tracing::debug!(%addr, error = %e, "the leader's address cannot be watched; its lease decides");
                return;
            }
        }
        if refuses(&addr).await {
            let Some(lease) = info.lease else { return };
            // Said first: the revocation elects this standby, which stops this watch.
            tracing::warn!(
                leader = %addr,
                "the leading master's process is gone (its address refuses connections): revoking its election lease"
            );
            if let Err(e) = backend.lease_revoke(lease).await
                && !matches!(e, edl_coord::Error::LeaseLost)
            {
                tracing::warn!(leader = %addr, error = %e, "cannot revoke the gone leader's lease; it will expire");
            }
            return;
        }
        // The server closed an idle connection (a TLS handshake never made): watch again.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Whether `addr` refuses [`REFUSALS`] connection attempts in a row.
async fn refuses(addr: &str) -> bool {
    for i in 0..REFUSALS {
        if i > 0 {
            tokio::time::sleep(REFUSAL_GAP).await;
        }
        match tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(addr)).await {
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
            _ => return false,
        }
    }
    true
}
