//! [`Election`]: leader election with fencing, after etcd's concurrency recipe.
//!
//! A candidate creates `<prefix><lease id in hex>` under its lease
//! (create-if-absent); the candidate whose key has the lowest create revision
//! leads. A waiting candidate watches only the key created just before its own
//! (no thundering herd) and re-checks when that key goes. The leader's key and its
//! create revision form a [`Fence`]: every write of the leader is a transaction
//! guarded on it, so a deposed leader cannot write.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::lease::Lease;
use crate::retry::{Backoff, RetryPolicy};
use crate::types::{
    Compare, CompareOp, EventKind, Fence, KeyValue, LeaseId, Op, OpResponse, Revision, Txn,
    TxnResponse,
};

/// The current leader of an election.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaderInfo {
    /// The leader's election key.
    pub key: String,
    /// The value it campaigned with (for a master: its address).
    pub value: Vec<u8>,
    /// The create revision of its key (its generation number).
    pub revision: Revision,
    /// Its lease.
    pub lease: Option<LeaseId>,
}

impl LeaderInfo {
    fn from_kv(kv: &KeyValue) -> Self {
        Self {
            key: kv.key.clone(),
            value: kv.value.clone(),
            revision: kv.create_revision,
            lease: kv.lease,
        }
    }
}

/// An election under a key prefix.
#[derive(Clone, Debug)]
pub struct Election {
    backend: Arc<dyn Backend>,
    prefix: String,
}

pub(crate) fn dir_prefix(prefix: impl Into<String>) -> String {
    let mut p = prefix.into();
    if !p.ends_with('/') {
        p.push('/');
    }
    p
}

/// Largest pause between retries of the election's loops.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

fn backoff() -> Backoff {
    Backoff::new(RetryPolicy::forever().with_delays(Duration::from_millis(50), MAX_BACKOFF))
}

/// Waits for the next backoff delay; `Err` when the lease is lost or `cancel` fires.
async fn pause(
    backoff: &mut Backoff,
    lease_lost: &CancellationToken,
    cancel: &CancellationToken,
) -> Result<()> {
    let delay = backoff.next_delay().unwrap_or(Duration::from_secs(1));
    tokio::select! {
        _ = lease_lost.cancelled() => Err(Error::LeaseLost),
        _ = cancel.cancelled() => Err(Error::Cancelled),
        _ = tokio::time::sleep(delay) => Ok(()),
    }
}

enum Wait {
    Leader,
    KeyGone,
}

impl Election {
    /// An election under `prefix` (a `/` is appended when missing).
    pub fn new(backend: Arc<dyn Backend>, prefix: impl Into<String>) -> Self {
        Self {
            backend,
            prefix: dir_prefix(prefix),
        }
    }

    /// The key prefix of the candidates.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Campaigns with `value` under `lease` until elected. Transient errors are
    /// retried. Fails with [`Error::LeaseLost`] when the lease is lost and with
    /// [`Error::Cancelled`] when `cancel` fires (the candidate key is then deleted).
    ///
    /// Campaigning again with the same lease resumes the same candidacy (same key,
    /// same place in line), with the new value.
    pub async fn campaign(
        &self,
        lease: &Lease,
        value: impl Into<Vec<u8>>,
        cancel: &CancellationToken,
    ) -> Result<Leadership> {
        let value = value.into();
        let key = format!("{}{}", self.prefix, lease.id());
        let lease_lost = lease.lost();
        let result = async {
            loop {
                let rev = self.ensure_candidate(&key, &value, lease, cancel).await?;
                tracing::debug!(key = %key, revision = rev, "campaigning");
                match self.wait_turn(&key, rev, &lease_lost, cancel).await? {
                    Wait::Leader => return Ok(rev),
                    Wait::KeyGone => {
                        tracing::warn!(key = %key, "candidate key vanished; campaigning again");
                        continue;
                    }
                }
            }
        }
        .await;
        match result {
            Ok(rev) => {
                tracing::info!(key = %key, revision = rev, "elected leader");
                Ok(Leadership::start(
                    self.backend.clone(),
                    Fence { key, revision: rev },
                    value,
                    lease,
                ))
            }
            Err(e) => {
                if matches!(e, Error::Cancelled) {
                    // Leave the line; the key would otherwise block others until the
                    // lease ends.
                    let guard = Compare::lease(key.clone(), CompareOp::Equal, Some(lease.id()));
                    let txn = Txn::new().when([guard]).and_then([Op::delete(key.clone())]);
                    if let Err(e) = self.backend.txn(txn).await {
                        tracing::warn!(key = %key, error = %e, "could not withdraw candidacy");
                    }
                }
                Err(e)
            }
        }
    }

    /// Creates the candidate key if absent (else updates its value); returns its
    /// create revision.
    async fn ensure_candidate(
        &self,
        key: &str,
        value: &[u8],
        lease: &Lease,
        cancel: &CancellationToken,
    ) -> Result<Revision> {
        let lease_lost = lease.lost();
        let mut backoff = backoff();
        loop {
            let txn = Txn::new()
                .when([Compare::absent(key)])
                .and_then([Op::put_with_lease(key, value, lease.id())])
                .or_else([Op::get(key)]);
            let attempt = async {
                let resp = self.backend.txn(txn).await?;
                if resp.succeeded {
                    return Ok(resp.revision);
                }
                // Already a candidate with this lease (a retried or repeated campaign).
                let Some(kv) = resp.get(0).and_then(|kvs| kvs.first()).cloned() else {
                    return Err(Error::unavailable(
                        "",
                        "candidate key vanished during campaign",
                    ));
                };
                if kv.lease != Some(lease.id()) {
                    return Err(Error::LeaseLost);
                }
                if kv.value != value {
                    let update = Txn::new()
                        .when([Compare::create_revision(
                            key,
                            CompareOp::Equal,
                            kv.create_revision,
                        )])
                        .and_then([Op::put_with_lease(key, value, lease.id())]);
                    if !self.backend.txn(update).await?.succeeded {
                        return Err(Error::unavailable(
                            "",
                            "candidate key changed during campaign",
                        ));
                    }
                }
                Ok(kv.create_revision)
            };
            let result = tokio::select! {
                _ = lease_lost.cancelled() => return Err(Error::LeaseLost),
                _ = cancel.cancelled() => return Err(Error::Cancelled),
                r = attempt => r,
            };
            match result {
                Ok(rev) => return Ok(rev),
                Err(e) if e.is_retryable() => {
                    tracing::debug!(key = %key, error = %e, "campaign write failed; retrying");
                    pause(&mut backoff, &lease_lost, cancel).await?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Waits until no candidate created before `my_rev` is left.
    async fn wait_turn(
        &self,
        key: &str,
        my_rev: Revision,
        lease_lost: &CancellationToken,
        cancel: &CancellationToken,
    ) -> Result<Wait> {
        let mut backoff = backoff();
        loop {
            let listing = tokio::select! {
                _ = lease_lost.cancelled() => return Err(Error::LeaseLost),
                _ = cancel.cancelled() => return Err(Error::Cancelled),
                r = self.backend.range(&self.prefix) => r,
            };
            let (kvs, rev) = match listing {
                Ok(l) => l,
                Err(e) if e.is_retryable() => {
                    tracing::debug!(error = %e, "election listing failed; retrying");
                    pause(&mut backoff, lease_lost, cancel).await?;
                    continue;
                }
                Err(e) => return Err(e),
            };
            if !kvs
                .iter()
                .any(|kv| kv.key == key && kv.create_revision == my_rev)
            {
                return Ok(Wait::KeyGone);
            }
            let Some(pred) = kvs
                .iter()
                .filter(|kv| kv.create_revision < my_rev)
                .max_by_key(|kv| kv.create_revision)
            else {
                return Ok(Wait::Leader);
            };
            tracing::debug!(key = %key, waiting_for = %pred.key, "waiting for the previous candidate");
            let watch = tokio::select! {
                _ = lease_lost.cancelled() => return Err(Error::LeaseLost),
                _ = cancel.cancelled() => return Err(Error::Cancelled),
                w = self.backend.watch_prefix(&pred.key, Some(rev + 1)) => w,
            };
            let mut watch = match watch {
                Ok(w) => w,
                Err(e) if e.is_retryable() => {
                    pause(&mut backoff, lease_lost, cancel).await?;
                    continue;
                }
                Err(e) => return Err(e),
            };
            loop {
                let item = tokio::select! {
                    _ = lease_lost.cancelled() => return Err(Error::LeaseLost),
                    _ = cancel.cancelled() => return Err(Error::Cancelled),
                    item = watch.next() => item,
                };
                match item {
                    Some(Ok(ev)) if ev.kind == EventKind::Delete && ev.kv.key == pred.key => break,
                    Some(Ok(_)) => {}
                    Some(Err(e)) => {
                        tracing::debug!(error = %e, "election watch failed; re-checking");
                        pause(&mut backoff, lease_lost, cancel).await?;
                        break;
                    }
                    None => {
                        pause(&mut backoff, lease_lost, cancel).await?;
                        break;
                    }
                }
            }
        }
    }

    /// The current leader, if any.
    pub async fn leader(&self) -> Result<Option<LeaderInfo>> {
        let (kvs, _) = self.backend.range(&self.prefix).await?;
        Ok(kvs
            .iter()
            .min_by_key(|kv| kv.create_revision)
            .map(LeaderInfo::from_kv))
    }

    /// Follows the leader: the receiver holds the current leader (or `None`) and is
    /// updated on every change, across reconnects (transient errors are retried
    /// with backoff). The background task (on the current tokio runtime) stops when
    /// `cancel` fires, when every receiver is dropped, or on an error that retrying
    /// cannot cure (permission denied, ...; logged): the receivers' `changed()` then
    /// fails.
    pub fn observe(&self, cancel: CancellationToken) -> watch::Receiver<Option<LeaderInfo>> {
        let (tx, rx) = watch::channel(None);
        let backend = self.backend.clone();
        let prefix = self.prefix.clone();
        tokio::spawn(
            async move {
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    _ = tx.closed() => {}
                    _ = observe_loop(backend, prefix, &tx) => {}
                }
            }
            .in_current_span(),
        );
        rx
    }
}

/// Follows the election until an error that retrying cannot cure (then the task
/// ends and the receivers' `changed()` fails). Transient errors are retried with
/// backoff, reset once the watch makes progress.
async fn observe_loop(
    backend: Arc<dyn Backend>,
    prefix: String,
    tx: &watch::Sender<Option<LeaderInfo>>,
) {
    let never = CancellationToken::new();
    let mut backoff = backoff();
    loop {
        let (kvs, rev) = match backend.range(&prefix).await {
            Ok(l) => l,
            Err(e) if e.is_retryable() => {
                tracing::debug!(error = %e, "leader observe listing failed; retrying");
                let _ = pause(&mut backoff, &never, &never).await;
                continue;
            }
            Err(e) => {
                tracing::error!(prefix = %prefix, error = %e, "leader observe listing failed; observer ends");
                return;
            }
        };
        let mut candidates: BTreeMap<String, KeyValue> =
            kvs.into_iter().map(|kv| (kv.key.clone(), kv)).collect();
        let publish = |c: &BTreeMap<String, KeyValue>| {
            let leader = c
                .values()
                .min_by_key(|kv| kv.create_revision)
                .map(LeaderInfo::from_kv);
            tx.send_if_modified(|cur| {
                if *cur != leader {
                    *cur = leader;
                    true
                } else {
                    false
                }
            });
        };
        publish(&candidates);
        let mut watch = match backend.watch_prefix(&prefix, Some(rev + 1)).await {
            Ok(w) => w,
            Err(e) if e.is_retryable() || matches!(e, Error::Compacted { .. }) => {
                tracing::debug!(error = %e, "leader observe watch failed; retrying");
                let _ = pause(&mut backoff, &never, &never).await;
                continue;
            }
            Err(e) => {
                tracing::error!(prefix = %prefix, error = %e, "leader observe watch failed; observer ends");
                return;
            }
        };
        let watching = tokio::time::Instant::now();
        while let Some(item) = watch.next().await {
            match item {
                Ok(ev) => {
                    match ev.kind {
                        EventKind::Put => {
                            candidates.insert(ev.kv.key.clone(), ev.kv);
                        }
                        EventKind::Delete => {
                            candidates.remove(&ev.kv.key);
                        }
                    }
                    publish(&candidates);
                    backoff = self::backoff();
                }
                Err(e) if e.is_retryable() || matches!(e, Error::Compacted { .. }) => {
                    tracing::debug!(error = %e, "leader observe watch ended; re-listing");
                    break;
                }
                Err(e) => {
                    tracing::error!(prefix = %prefix, error = %e, "leader observe watch failed; observer ends");
                    return;
                }
            }
        }
        if watching.elapsed() >= MAX_BACKOFF {
            // The watch served a while: this is a fresh disconnect.
            backoff = self::backoff();
        }
        let _ = pause(&mut backoff, &never, &never).await;
    }
}

/// Being the leader. Holds the [`Fence`] (election key and its create revision);
/// every write made as leader goes through [`fenced_txn`](Leadership::fenced_txn)
/// (or carries [`guard`](Leadership::guard) among its compares).
///
/// [`lost`](Leadership::lost) fires when the lease is lost or the election key is
/// deleted; dropping the `Leadership` stops watching and fires it too. Call
/// [`resign`](Leadership::resign) for a prompt hand-over; otherwise the key stays
/// until the lease ends.
#[derive(Debug)]
pub struct Leadership {
    backend: Arc<dyn Backend>,
    fence: Fence,
    value: Vec<u8>,
    lease: LeaseId,
    lost: CancellationToken,
    monitor: JoinHandle<()>,
}

impl Leadership {
    fn start(backend: Arc<dyn Backend>, fence: Fence, value: Vec<u8>, lease: &Lease) -> Self {
        let lost = lease.lost().child_token();
        let monitor = tokio::spawn(
            monitor_key(backend.clone(), fence.clone(), lost.clone()).in_current_span(),
        );
        Self {
            backend,
            fence,
            value,
            lease: lease.id(),
            lost,
            monitor,
        }
    }

    /// The election key.
    pub fn key(&self) -> &str {
        &self.fence.key
    }

    /// The create revision of the election key: this leadership's generation.
    pub fn revision(&self) -> Revision {
        self.fence.revision
    }

    /// The value campaigned with.
    pub fn value(&self) -> &[u8] {
        &self.value
    }

    /// The fencing token.
    pub fn fence(&self) -> &Fence {
        &self.fence
    }

    /// The fencing compare, for callers building their own transactions.
    pub fn guard(&self) -> Compare {
        self.fence.compare()
    }

    /// A token that fires when the leadership is lost.
    pub fn lost(&self) -> CancellationToken {
        self.lost.clone()
    }

    /// Whether `lost` fired.
    pub fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
    }

    /// Runs `ops` atomically if and only if this process still leads; fails with
    /// [`Error::NotLeader`] otherwise.
    pub async fn fenced_txn(&self, ops: Vec<Op>) -> Result<TxnResponse> {
        fenced_txn(self.backend.as_ref(), &self.fence, Txn::new().and_then(ops)).await
    }

    /// Runs `txn` only if this process still leads (see [`fenced_txn`]).
    pub async fn fenced(&self, txn: Txn) -> Result<TxnResponse> {
        fenced_txn(self.backend.as_ref(), &self.fence, txn).await
    }

    /// Checks with the store that the election key is still ours.
    pub async fn is_leader(&self) -> Result<bool> {
        Ok(self
            .backend
            .get(&self.fence.key)
            .await?
            .is_some_and(|kv| kv.create_revision == self.fence.revision))
    }

    /// Publishes a new value for observers (fenced).
    pub async fn proclaim(&mut self, value: impl Into<Vec<u8>>) -> Result<()> {
        let value = value.into();
        self.fenced_txn(vec![Op::put_with_lease(
            self.fence.key.clone(),
            value.clone(),
            self.lease,
        )])
        .await?;
        self.value = value;
        Ok(())
    }

    /// Steps down: deletes the election key (fenced) so the next candidate takes
    /// over at once, and fires `lost`.
    pub async fn resign(self) -> Result<()> {
        self.lost.cancel();
        let result = self
            .fenced_txn(vec![Op::delete(self.fence.key.clone())])
            .await
            .map(|_| ());
        match &result {
            Ok(()) => tracing::info!(key = %self.fence.key, "resigned leadership"),
            Err(e) => tracing::warn!(key = %self.fence.key, error = %e, "resign failed"),
        }
        result
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.monitor.abort();
        self.lost.cancel();
    }
}

/// Fires `lost` once the fenced key is deleted or re-created, or when the key can
/// no longer be watched at all (an error that retrying cannot cure, such as
/// permission denied: a leader that cannot see its key must not go on).
/// Transient errors are retried with backoff.
async fn monitor_key(backend: Arc<dyn Backend>, fence: Fence, lost: CancellationToken) {
    let mut backoff = backoff();
    let never = CancellationToken::new();
    let mut from = fence.revision + 1;
    let give_up = |e: &Error| {
        tracing::error!(key = %fence.key, error = %e, "leadership lost: cannot watch the election key");
        lost.cancel();
    };
    loop {
        let watch = tokio::select! {
            _ = lost.cancelled() => return,
            w = backend.watch_prefix(&fence.key, Some(from)) => w,
        };
        let mut watch = match watch {
            Ok(w) => w,
            Err(e) if e.is_retryable() || matches!(e, Error::Compacted { .. }) => {
                tracing::debug!(key = %fence.key, error = %e, "leadership watch failed; retrying");
                let _ = pause(&mut backoff, &lost, &never).await;
                continue;
            }
            Err(e) => return give_up(&e),
        };
        loop {
            let item = tokio::select! {
                _ = lost.cancelled() => return,
                item = watch.next() => item,
            };
            match item {
                Some(Ok(ev)) if ev.kv.key == fence.key => {
                    from = ev.revision() + 1;
                    if ev.kind == EventKind::Delete || ev.kv.create_revision != fence.revision {
                        tracing::warn!(key = %fence.key, "leadership lost: election key deleted");
                        lost.cancel();
                        return;
                    }
                    backoff = self::backoff();
                }
                Some(Ok(ev)) => from = ev.revision() + 1,
                Some(Err(Error::Compacted { .. })) => {
                    // History is gone: check the key itself.
                    let check = tokio::select! {
                        _ = lost.cancelled() => return,
                        r = backend.range(&fence.key) => r,
                    };
                    match check {
                        Ok((kvs, rev)) => {
                            if !kvs.iter().any(|kv| {
                                kv.key == fence.key && kv.create_revision == fence.revision
                            }) {
                                tracing::warn!(key = %fence.key, "leadership lost: election key gone");
                                lost.cancel();
                                return;
                            }
                            from = rev + 1;
                        }
                        Err(e) if e.is_retryable() => {
                            tracing::debug!(key = %fence.key, error = %e, "leadership check failed; retrying");
                            let _ = pause(&mut backoff, &lost, &never).await;
                        }
                        Err(e) => return give_up(&e),
                    }
                    break;
                }
                Some(Err(e)) if e.is_retryable() => {
                    tracing::debug!(key = %fence.key, error = %e, "leadership watch ended; resuming");
                    let _ = pause(&mut backoff, &lost, &never).await;
                    break;
                }
                Some(Err(e)) => return give_up(&e),
                None => {
                    let _ = pause(&mut backoff, &lost, &never).await;
                    break;
                }
            }
        }
    }
}

/// Runs `txn` only while `fence` holds; fails with [`Error::NotLeader`] otherwise.
///
/// The caller's transaction is nested under the fencing compare, so neither of its
/// branches runs once the fence is broken. A transaction without compares and
/// without failure ops is sent flat.
pub async fn fenced_txn(backend: &dyn Backend, fence: &Fence, txn: Txn) -> Result<TxnResponse> {
    if txn.compares.is_empty() && txn.failure.is_empty() {
        let flat = Txn::new().when([fence.compare()]).and_then(txn.success);
        let resp = backend.txn(flat).await?;
        if !resp.succeeded {
            return Err(Error::NotLeader);
        }
        return Ok(resp);
    }
    let outer = Txn::new().when([fence.compare()]).and_then([Op::txn(txn)]);
    let resp = backend.txn(outer).await?;
    if !resp.succeeded {
        return Err(Error::NotLeader);
    }
    match resp.responses.into_iter().next() {
        Some(OpResponse::Txn(mut inner)) => {
            inner.revision = resp.revision;
            Ok(inner)
        }
        _ => Err(Error::Malformed(
            "fenced txn response without the nested response".into(),
        )),
    }
}
