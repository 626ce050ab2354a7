//! [`Registry`]: members registered under their leases, and a watch of joins and
//! leaves that never misses one.

use std::collections::{BTreeMap, BTreeSet};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::backend::Backend;
use crate::election::dir_prefix;
use crate::error::{Error, Result};
use crate::lease::Lease;
use crate::retry::{Backoff, RetryPolicy};
use crate::types::{
    Compare, CompareOp, EventKind, KeyValue, LeaseId, Op, Revision, Txn, WatchEvent,
};

/// One registered member.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// The member id (the key below the registry prefix).
    pub id: String,
    /// Its value (address, start time, ...).
    pub value: Vec<u8>,
    /// The lease it is registered under.
    pub lease: Option<LeaseId>,
    /// Revision of its registration (changes when it registers anew).
    pub create_revision: Revision,
    /// Revision of its last update.
    pub mod_revision: Revision,
    /// Writes of its key since it was created (etcd's key version).
    pub version: i64,
}

/// A change of membership.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemberEvent {
    /// A member registered.
    Joined(Member),
    /// A member's value changed.
    Updated(Member),
    /// A member deregistered or its lease ended (the last known value).
    Left(Member),
}

impl MemberEvent {
    /// The member concerned.
    pub fn member(&self) -> &Member {
        match self {
            MemberEvent::Joined(m) | MemberEvent::Updated(m) | MemberEvent::Left(m) => m,
        }
    }
}

/// Members under a key prefix, each key attached to its member's lease.
#[derive(Clone, Debug)]
pub struct Registry {
    backend: Arc<dyn Backend>,
    prefix: String,
}

fn check_id(id: &str) -> Result<()> {
    if id.is_empty() || id.contains('/') {
        return Err(Error::InvalidArgument(format!(
            "member id {id:?} must be non-empty and contain no '/'"
        )));
    }
    Ok(())
}

impl Registry {
    /// A registry under `prefix` (a `/` is appended when missing).
    pub fn new(backend: Arc<dyn Backend>, prefix: impl Into<String>) -> Self {
        Self {
            backend,
            prefix: dir_prefix(prefix),
        }
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The key of a member.
    pub fn key(&self, id: &str) -> String {
        format!("{}{}", self.prefix, id)
    }

    fn member(&self, kv: KeyValue) -> Option<Member> {
        let id = kv.key.strip_prefix(self.prefix.as_str())?.to_owned();
        Some(Member {
            id,
            value: kv.value,
            lease: kv.lease,
            create_revision: kv.create_revision,
            mod_revision: kv.mod_revision,
            version: kv.version,
        })
    }

    /// Registers (or updates) member `id` under `lease`. Fails with
    /// [`Error::AlreadyRegistered`] when another lease holds the id. Returns the
    /// revision of the write.
    pub async fn register(
        &self,
        id: &str,
        value: impl Into<Vec<u8>>,
        lease: &Lease,
    ) -> Result<Revision> {
        check_id(id)?;
        let key = self.key(id);
        let value = value.into();
        let txn = Txn::new()
            .when([Compare::absent(key.clone())])
            .and_then([Op::put_with_lease(key.clone(), value.clone(), lease.id())])
            .or_else([Op::get(key.clone())]);
        let resp = self.backend.txn(txn).await?;
        if resp.succeeded {
            tracing::debug!(key = %key, lease = %lease.id(), "member registered");
            return Ok(resp.revision);
        }
        let update = Txn::new()
            .when([Compare::lease(
                key.clone(),
                CompareOp::Equal,
                Some(lease.id()),
            )])
            .and_then([Op::put_with_lease(key.clone(), value, lease.id())]);
        let resp = self.backend.txn(update).await?;
        if resp.succeeded {
            Ok(resp.revision)
        } else {
            Err(Error::AlreadyRegistered { id: id.to_owned() })
        }
    }

    /// Deregisters member `id` if `lease` holds it; returns whether it was deleted.
    pub async fn deregister(&self, id: &str, lease: &Lease) -> Result<bool> {
        check_id(id)?;
        let key = self.key(id);
        let txn = Txn::new()
            .when([Compare::lease(
                key.clone(),
                CompareOp::Equal,
                Some(lease.id()),
            )])
            .and_then([Op::delete(key)]);
        Ok(self.backend.txn(txn).await?.succeeded)
    }

    /// The current members, sorted by id, and the revision of the listing.
    pub async fn list(&self) -> Result<(Vec<Member>, Revision)> {
        let (kvs, rev) = self.backend.range(&self.prefix).await?;
        Ok((
            kvs.into_iter().filter_map(|kv| self.member(kv)).collect(),
            rev,
        ))
    }

    /// Follows membership: first a `Joined` for every current member, then every
    /// change. Disconnects are absorbed: the watch resumes from the revision after
    /// the last event seen, so no join or leave is missed; if that history was
    /// compacted, the registry is listed again and the difference with the known
    /// set is reported (a member that re-registered in between shows as `Left`
    /// then `Joined`). Transient errors are retried with backoff.
    ///
    /// The stream ends when `cancel` fires, when it is dropped, or on an error that
    /// retrying cannot cure (permission denied, a malformed key, ...): then
    /// [`MemberWatch::take_error`] tells which. Dropping the stream stops its task
    /// without cancelling `cancel` (the task follows a child token).
    ///
    /// Runs a task on the current tokio runtime (call it from within one). Events
    /// are buffered (256); a consumer that stops reading holds the task back, it
    /// does not lose events.
    pub fn watch_members(&self, cancel: CancellationToken) -> MemberWatch {
        let (tx, rx) = mpsc::channel(256);
        let error = Arc::new(Mutex::new(None));
        let follower = Follower {
            registry: self.clone(),
            known: BTreeMap::new(),
            tx,
        };
        let stop = cancel.child_token();
        let task_stop = stop.clone();
        let task_error = error.clone();
        tokio::spawn(
            async move {
                tokio::select! {
                    _ = task_stop.cancelled() => {}
                    end = follower.run() => {
                        if let Err(e) = end {
                            *task_error.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
                        }
                    }
                }
            }
            .in_current_span(),
        );
        MemberWatch {
            rx,
            error,
            _stop: stop.drop_guard(),
        }
    }
}

/// Stream of [`MemberEvent`]s from [`Registry::watch_members`].
#[derive(Debug)]
pub struct MemberWatch {
    rx: mpsc::Receiver<MemberEvent>,
    error: Arc<Mutex<Option<Error>>>,
    _stop: tokio_util::sync::DropGuard,
}

impl MemberWatch {
    /// Takes the error that ended the stream, if one did (not cancellation): an
    /// error that retrying cannot cure, such as [`Error::PermissionDenied`]. Check
    /// it once the stream returned `None`.
    pub fn take_error(&self) -> Option<Error> {
        self.error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

impl Stream for MemberWatch {
    type Item = MemberEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}

struct Follower {
    registry: Registry,
    known: BTreeMap<String, Member>,
    tx: mpsc::Sender<MemberEvent>,
}

/// Where to resume the watch: the revision of the last event applied, and the keys
/// already applied at that revision (a revision's events may be split by a
/// disconnect).
struct Resume {
    revision: Revision,
    seen: BTreeSet<String>,
}

impl Follower {
    async fn emit(&self, ev: MemberEvent) -> std::result::Result<(), ()> {
        self.tx.send(ev).await.map_err(|_| ())
    }

    /// Lists and reports the difference with the known set.
    async fn resync(&mut self, members: Vec<Member>) -> std::result::Result<(), ()> {
        let mut fresh: BTreeMap<String, Member> =
            members.into_iter().map(|m| (m.id.clone(), m)).collect();
        let gone: Vec<String> = self
            .known
            .keys()
            .filter(|id| !fresh.contains_key(*id))
            .cloned()
            .collect();
        for id in gone {
            if let Some(m) = self.known.remove(&id) {
                self.emit(MemberEvent::Left(m)).await?;
            }
        }
        for (id, m) in std::mem::take(&mut fresh) {
            match self.known.get(&id) {
                None => {
                    self.known.insert(id, m.clone());
                    self.emit(MemberEvent::Joined(m)).await?;
                }
                Some(old) if old.create_revision != m.create_revision => {
                    let old = old.clone();
                    self.known.insert(id, m.clone());
                    self.emit(MemberEvent::Left(old)).await?;
                    self.emit(MemberEvent::Joined(m)).await?;
                }
                Some(old) if old.mod_revision != m.mod_revision => {
                    self.known.insert(id, m.clone());
                    self.emit(MemberEvent::Updated(m)).await?;
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    async fn apply(&mut self, ev: WatchEvent) -> std::result::Result<(), ()> {
        let key = ev.kv.key.clone();
        let Some(id) = key
            .strip_prefix(self.registry.prefix.as_str())
            .map(str::to_owned)
        else {
            return Ok(());
        };
        match ev.kind {
            EventKind::Put => {
                let Some(m) = self.registry.member(ev.kv) else {
                    return Ok(());
                };
                match self.known.insert(id, m.clone()) {
                    None => self.emit(MemberEvent::Joined(m)).await,
                    Some(old) if old.create_revision != m.create_revision => {
                        self.emit(MemberEvent::Left(old)).await?;
                        self.emit(MemberEvent::Joined(m)).await
                    }
                    Some(_) => self.emit(MemberEvent::Updated(m)).await,
                }
            }
            EventKind::Delete => match self.known.remove(&id) {
                Some(old) => self.emit(MemberEvent::Left(old)).await,
                None => Ok(()),
            },
        }
    }

    /// Follows until the consumer goes away (`Ok`) or an error that retrying cannot
    /// cure (`Err`). Transient errors are retried with backoff.
    async fn run(mut self) -> Result<()> {
        let backend = self.registry.backend.clone();
        let prefix = self.registry.prefix.clone();
        let new_backoff = || {
            Backoff::new(
                RetryPolicy::forever()
                    .with_delays(Duration::from_millis(50), Duration::from_secs(2)),
            )
        };
        let mut backoff = new_backoff();
        let mut resume: Option<Resume> = None;
        loop {
            let from = match &resume {
                Some(r) => r.revision,
                None => match self.registry.list().await {
                    Ok((members, rev)) => {
                        if self.resync(members).await.is_err() {
                            return Ok(());
                        }
                        resume = Some(Resume {
                            revision: rev + 1,
                            seen: BTreeSet::new(),
                        });
                        rev + 1
                    }
                    Err(e) if e.is_retryable() => {
                        tracing::warn!(prefix = %prefix, error = %e, "registry listing failed; retrying");
                        pause(&mut backoff).await;
                        continue;
                    }
                    Err(e) => {
                        tracing::error!(prefix = %prefix, error = %e, "registry listing failed; member watch ends");
                        return Err(e);
                    }
                },
            };
            let mut watch = match backend.watch_prefix(&prefix, Some(from)).await {
                Ok(w) => w,
                Err(Error::Compacted { compact_revision }) => {
                    tracing::warn!(prefix = %prefix, compact_revision, "registry watch history compacted; re-listing");
                    resume = None;
                    pause(&mut backoff).await;
                    continue;
                }
                Err(e) if e.is_retryable() => {
                    tracing::warn!(prefix = %prefix, error = %e, "registry watch failed; retrying");
                    pause(&mut backoff).await;
                    continue;
                }
                Err(e) => {
                    tracing::error!(prefix = %prefix, error = %e, "registry watch failed; member watch ends");
                    return Err(e);
                }
            };
            loop {
                match watch.next().await {
                    Some(Ok(ev)) => {
                        let rev = ev.revision();
                        let r = resume.get_or_insert_with(|| Resume {
                            revision: rev,
                            seen: BTreeSet::new(),
                        });
                        if rev < r.revision || (rev == r.revision && r.seen.contains(&ev.kv.key)) {
                            continue; // already applied before the reconnect
                        }
                        if rev > r.revision {
                            r.revision = rev;
                            r.seen.clear();
                        }
                        r.seen.insert(ev.kv.key.clone());
                        if self.apply(ev).await.is_err() {
                            return Ok(());
                        }
                        backoff = new_backoff();
                    }
                    Some(Err(Error::Compacted { compact_revision })) => {
                        tracing::warn!(prefix = %prefix, compact_revision, "registry watch history compacted; re-listing");
                        resume = None;
                        break;
                    }
                    Some(Err(e)) if e.is_retryable() => {
                        tracing::info!(prefix = %prefix, error = %e, "registry watch lost; resuming");
                        pause(&mut backoff).await;
                        break;
                    }
                    Some(Err(e)) => {
                        tracing::error!(prefix = %prefix, error = %e, "registry watch failed; member watch ends");
                        return Err(e);
                    }
                    None => {
                        pause(&mut backoff).await;
                        break;
                    }
                }
            }
        }
    }
}

async fn pause(backoff: &mut Backoff) {
    tokio::time::sleep(backoff.next_delay().unwrap_or(Duration::from_secs(1))).await;
}
