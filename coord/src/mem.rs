//! [`MemBackend`]: an in-process store with etcd's semantics (revisions, versions,
//! leases on tokio's clock, watches from a revision over a bounded history,
//! transactions with compares and nested transactions).
//!
//! Only for single-process runs and simulation tests: nothing is persisted and
//! nothing is shared across processes. Lease expiry runs on tokio's clock, so tests
//! on a paused runtime (`#[tokio::test(start_paused = true)]`) control it with
//! `tokio::time::advance` or by sleeping.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{self, AtomicBool};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::backend::{Backend, WatchStream};
use crate::error::{Error, Result};
use crate::types::{
    Compare, CompareOp, CompareTarget, EventKind, KeyValue, LeaseGrant, LeaseId, MAX_REQUEST_BYTES,
    MAX_TXN_OPS, Op, OpResponse, Revision, Txn, TxnResponse, WatchEvent,
};

/// Default number of events kept for watches that start in the past.
pub const DEFAULT_HISTORY_LIMIT: usize = 10_000;

/// Longest TTL a lease may have (etcd's `MaxLeaseTTL`).
const MAX_LEASE_TTL_SECS: u64 = 9_000_000_000;

/// An in-memory [`Backend`]. Cheap to clone (clones share the store).
#[derive(Clone)]
pub struct MemBackend {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
    /// The latest committed revision; watch streams wait on it.
    revision_tx: watch::Sender<Revision>,
    /// Woken when a lease is granted, so the expiry task re-computes its deadline.
    lease_granted: Arc<Notify>,
    expiry_task_started: AtomicBool,
    /// Stops the expiry task when the store is dropped.
    shutdown: CancellationToken,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

struct MemLease {
    ttl: Duration,
    deadline: Instant,
    keys: BTreeSet<String>,
}

struct State {
    revision: Revision,
    kvs: BTreeMap<String, KeyValue>,
    leases: HashMap<LeaseId, MemLease>,
    next_lease_id: i64,
    history: VecDeque<WatchEvent>,
    history_limit: usize,
    /// Watches must start at this revision or later.
    compact_revision: Revision,
    /// Granted TTLs are raised to this many seconds (etcd's minimum TTL).
    min_ttl_secs: u64,
}

impl fmt::Debug for MemBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.inner.lock();
        f.debug_struct("MemBackend")
            .field("revision", &st.revision)
            .field("keys", &st.kvs.len())
            .field("leases", &st.leases.len())
            .finish_non_exhaustive()
    }
}

impl Default for MemBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl MemBackend {
    /// An empty store at revision 1 keeping [`DEFAULT_HISTORY_LIMIT`] events.
    pub fn new() -> Self {
        Self::with_history_limit(DEFAULT_HISTORY_LIMIT)
    }

    /// An empty store keeping at most `limit` events of history (at least 1). Older
    /// events are dropped whole revisions at a time, which compacts the history.
    pub fn with_history_limit(limit: usize) -> Self {
        let (revision_tx, _) = watch::channel(1);
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    revision: 1,
                    kvs: BTreeMap::new(),
                    leases: HashMap::new(),
                    next_lease_id: 0x6564_6c00_0000_0000,
                    history: VecDeque::new(),
                    history_limit: limit.max(1),
                    compact_revision: 0,
                    min_ttl_secs: 1,
                }),
                revision_tx,
                lease_granted: Arc::new(Notify::new()),
                expiry_task_started: AtomicBool::new(false),
                shutdown: CancellationToken::new(),
            }),
        }
    }

    /// Raises every granted TTL to at least `min` (rounded up to whole seconds), as
    /// etcd does: its minimum is 1.5 election timeouts, 2 s with the default
    /// settings. Without it, a store grants any TTL of one second or more as asked.
    /// Applies to leases granted from now on.
    pub fn with_min_ttl(self, min: Duration) -> Self {
        let secs = min.as_secs() + u64::from(min.subsec_nanos() > 0);
        self.inner.lock().min_ttl_secs = secs.clamp(1, MAX_LEASE_TTL_SECS);
        self
    }

    /// The current store revision.
    pub fn revision(&self) -> Revision {
        self.inner.locked_now().revision
    }

    /// Starts the task that ends expired leases (so watchers see their deletions
    /// even when no other request arrives). Requests also end due leases first.
    fn ensure_expiry_task(&self) {
        if self
            .inner
            .expiry_task_started
            .swap(true, atomic::Ordering::AcqRel)
        {
            return;
        }
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        let granted = self.inner.lease_granted.clone();
        let shutdown = self.inner.shutdown.clone();
        tokio::spawn(
            async move {
                loop {
                    let notified = granted.notified();
                    tokio::pin!(notified);
                    notified.as_mut().enable();
                    let next = {
                        let Some(inner) = weak.upgrade() else { return };
                        let st = inner.locked_now();
                        st.leases.values().map(|l| l.deadline).min()
                    };
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = &mut notified => {}
                        _ = sleep_until_opt(next) => {}
                    }
                }
            }
            .in_current_span(),
        );
    }
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Locks the state after ending every lease that is due by tokio's clock.
    fn locked_now(&self) -> MutexGuard<'_, State> {
        let mut st = self.lock();
        let now = Instant::now();
        let due: Vec<LeaseId> = st
            .leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            tracing::debug!(lease = %id, "mem lease expired");
            self.end_lease(&mut st, id);
        }
        st
    }

    /// Removes a lease and deletes its keys in one revision.
    fn end_lease(&self, st: &mut State, id: LeaseId) {
        let Some(lease) = st.leases.remove(&id) else {
            return;
        };
        let mut w = Writer::new(st);
        for key in &lease.keys {
            w.delete(key);
        }
        self.commit(w);
    }

    fn commit(&self, w: Writer<'_>) -> Revision {
        let Writer { st, rev, events } = w;
        if events.is_empty() {
            return st.revision;
        }
        st.revision = rev;
        st.history.extend(events);
        while st.history.len() > st.history_limit {
            let Some(oldest) = st.history.front().map(WatchEvent::revision) else {
                break;
            };
            // Drop the whole oldest revision so no watch sees half of it.
            while st.history.front().is_some_and(|e| e.revision() == oldest) {
                st.history.pop_front();
            }
            st.compact_revision = st.compact_revision.max(oldest + 1);
        }
        self.revision_tx.send_replace(rev);
        rev
    }
}

/// Applies the writes of one revision.
struct Writer<'a> {
    st: &'a mut State,
    rev: Revision,
    events: Vec<WatchEvent>,
}

impl<'a> Writer<'a> {
    fn new(st: &'a mut State) -> Self {
        let rev = st.revision + 1;
        Self {
            st,
            rev,
            events: Vec::new(),
        }
    }

    fn put(&mut self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) {
        let prev = self.st.kvs.get(key);
        let (create_revision, version, prev_lease) = match prev {
            Some(p) => (p.create_revision, p.version + 1, p.lease),
            None => (self.rev, 1, None),
        };
        if prev_lease != lease
            && let Some(old) = prev_lease.and_then(|id| self.st.leases.get_mut(&id))
        {
            old.keys.remove(key);
        }
        if let Some(new) = lease.and_then(|id| self.st.leases.get_mut(&id)) {
            new.keys.insert(key.to_owned());
        }
        let kv = KeyValue {
            key: key.to_owned(),
            value,
            create_revision,
            mod_revision: self.rev,
            version,
            lease,
        };
        self.st.kvs.insert(key.to_owned(), kv.clone());
        self.events.push(WatchEvent {
            kind: EventKind::Put,
            kv,
        });
    }

    fn delete(&mut self, key: &str) -> bool {
        let Some(kv) = self.st.kvs.remove(key) else {
            return false;
        };
        if let Some(lease) = kv.lease.and_then(|id| self.st.leases.get_mut(&id)) {
            lease.keys.remove(key);
        }
        self.events.push(WatchEvent {
            kind: EventKind::Delete,
            kv: KeyValue {
                key: kv.key,
                mod_revision: self.rev,
                ..KeyValue::default()
            },
        });
        true
    }

    fn delete_prefix(&mut self, prefix: &str) -> u64 {
        let keys = keys_with_prefix(&self.st.kvs, prefix);
        let mut n = 0;
        for key in keys {
            if self.delete(&key) {
                n += 1;
            }
        }
        n
    }

    fn get(&self, key: &str) -> Vec<KeyValue> {
        self.st.kvs.get(key).cloned().into_iter().collect()
    }

    fn get_prefix(&self, prefix: &str) -> Vec<KeyValue> {
        range_prefix(&self.st.kvs, prefix)
    }
}

fn range_prefix(kvs: &BTreeMap<String, KeyValue>, prefix: &str) -> Vec<KeyValue> {
    kvs.range(prefix.to_owned()..)
        .take_while(|(k, _)| k.starts_with(prefix))
        .map(|(_, kv)| kv.clone())
        .collect()
}

fn keys_with_prefix(kvs: &BTreeMap<String, KeyValue>, prefix: &str) -> Vec<String> {
    kvs.range(prefix.to_owned()..)
        .take_while(|(k, _)| k.starts_with(prefix))
        .map(|(k, _)| k.clone())
        .collect()
}

fn check_key(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(Error::InvalidArgument("key is not provided".into()));
    }
    Ok(())
}

fn holds(ord: Ordering, op: CompareOp) -> bool {
    match op {
        CompareOp::Equal => ord == Ordering::Equal,
        CompareOp::NotEqual => ord != Ordering::Equal,
        CompareOp::Less => ord == Ordering::Less,
        CompareOp::Greater => ord == Ordering::Greater,
    }
}

/// Evaluates one compare with etcd's rules: a missing key compares as zero, except
/// that a value compare on a missing key is always false.
fn compare_holds(kvs: &BTreeMap<String, KeyValue>, c: &Compare) -> bool {
    let kv = kvs.get(&c.key);
    match &c.target {
        CompareTarget::Value(v) => kv.is_some_and(|kv| holds(kv.value.as_slice().cmp(v), c.op)),
        CompareTarget::CreateRevision(r) => {
            holds(kv.map_or(0, |kv| kv.create_revision).cmp(r), c.op)
        }
        CompareTarget::ModRevision(r) => holds(kv.map_or(0, |kv| kv.mod_revision).cmp(r), c.op),
        CompareTarget::Version(v) => holds(kv.map_or(0, |kv| kv.version).cmp(v), c.op),
        CompareTarget::Lease(l) => {
            let have = kv.and_then(|kv| kv.lease).map_or(0, |l| l.0);
            holds(have.cmp(&l.map_or(0, |l| l.0)), c.op)
        }
    }
}

/// The size etcd measures against `--max-request-bytes`, approximately: keys, values
/// and compare operands, plus a few bytes of framing each.
fn op_size(op: &Op) -> usize {
    const FRAMING: usize = 16;
    FRAMING
        + match op {
            Op::Put { key, value, .. } => key.len() + value.len(),
            Op::Get { key } | Op::Delete { key } => key.len(),
            // The key and the range end.
            Op::GetPrefix { prefix } | Op::DeletePrefix { prefix } => 2 * prefix.len(),
            Op::Txn(inner) => txn_size(inner),
        }
}

fn txn_size(txn: &Txn) -> usize {
    let compares: usize = txn
        .compares
        .iter()
        .map(|c| {
            16 + c.key.len()
                + match &c.target {
                    CompareTarget::Value(v) => v.len(),
                    _ => 8,
                }
        })
        .sum();
    compares
        + txn
            .success
            .iter()
            .chain(&txn.failure)
            .map(op_size)
            .sum::<usize>()
}

/// etcd's answer to a request over [`MAX_REQUEST_BYTES`].
fn check_request_size(size: usize) -> Result<()> {
    if size > MAX_REQUEST_BYTES {
        return Err(Error::InvalidArgument(format!(
            "etcdserver: request is too large ({size} bytes, the limit is {MAX_REQUEST_BYTES})"
        )));
    }
    Ok(())
}

/// Size limits and etcd's "duplicate key" rule: within a branch (nested
/// transactions included) a key is put at most once and never both put and deleted.
fn validate_txn(txn: &Txn) -> Result<()> {
    if txn.compares.len() > MAX_TXN_OPS
        || txn.success.len() > MAX_TXN_OPS
        || txn.failure.len() > MAX_TXN_OPS
    {
        return Err(Error::InvalidArgument(
            "etcdserver: too many operations in txn request".into(),
        ));
    }
    for op in txn.success.iter().chain(&txn.failure) {
        match op {
            Op::Put { key, .. } | Op::Delete { key } | Op::Get { key } => check_key(key)?,
            Op::Txn(inner) => validate_txn(inner)?,
            Op::GetPrefix { .. } | Op::DeletePrefix { .. } => {}
        }
    }
    check_intervals(&txn.success)?;
    check_intervals(&txn.failure)?;
    Ok(())
}

/// Deletes of one branch level, as exact keys or prefixes.
#[derive(Default)]
struct Dels {
    keys: BTreeSet<String>,
    prefixes: Vec<String>,
}

impl Dels {
    fn covers(&self, key: &str) -> bool {
        self.keys.contains(key) || self.prefixes.iter().any(|p| key.starts_with(p.as_str()))
    }

    fn union(&mut self, other: Dels) {
        self.keys.extend(other.keys);
        self.prefixes.extend(other.prefixes);
    }
}

/// Mirrors etcd's `checkIntervals`: returns the keys put and the ranges deleted by
/// `ops` (recursively), failing on an overlap.
fn check_intervals(ops: &[Op]) -> Result<(BTreeSet<String>, Dels)> {
    let dup = || Error::InvalidArgument("duplicate key given in txn request".into());
    let mut dels = Dels::default();
    for op in ops {
        match op {
            Op::Delete { key } => {
                dels.keys.insert(key.clone());
            }
            Op::DeletePrefix { prefix } => dels.prefixes.push(prefix.clone()),
            _ => {}
        }
    }
    let mut puts = BTreeSet::new();
    for op in ops {
        let Op::Txn(inner) = op else { continue };
        let (puts_then, dels_then) = check_intervals(&inner.success)?;
        let (puts_else, dels_else) = check_intervals(&inner.failure)?;
        for k in &puts_then {
            if puts.contains(k) || dels.covers(k) {
                return Err(dup());
            }
            puts.insert(k.clone());
        }
        for k in puts_else {
            // A key put in both branches of one nested txn is fine: they exclude each other.
            if (puts.contains(&k) && !puts_then.contains(&k)) || dels.covers(&k) {
                return Err(dup());
            }
            puts.insert(k);
        }
        dels.union(dels_then);
        dels.union(dels_else);
    }
    for op in ops {
        let Op::Put { key, .. } = op else { continue };
        if puts.contains(key) || dels.covers(key) {
            return Err(dup());
        }
        puts.insert(key.clone());
    }
    Ok((puts, dels))
}

/// Decides every branch up front, against the state before the transaction (as etcd
/// does): one bool per transaction, nested ones included, in pre-order.
fn decide_path(kvs: &BTreeMap<String, KeyValue>, txn: &Txn, path: &mut Vec<bool>) {
    let ok = txn.compares.iter().all(|c| compare_holds(kvs, c));
    path.push(ok);
    let branch = if ok { &txn.success } else { &txn.failure };
    for op in branch {
        if let Op::Txn(inner) = op {
            decide_path(kvs, inner, path);
        }
    }
}

/// Checks that every lease used by a put on the chosen path exists.
fn check_leases(
    leases: &HashMap<LeaseId, MemLease>,
    txn: &Txn,
    path: &[bool],
    at: &mut usize,
) -> Result<()> {
    let ok = path.get(*at).copied().unwrap_or(false);
    *at += 1;
    for op in if ok { &txn.success } else { &txn.failure } {
        match op {
            Op::Put {
                lease: Some(id), ..
            } if !leases.contains_key(id) => return Err(Error::LeaseLost),
            Op::Txn(inner) => check_leases(leases, inner, path, at)?,
            _ => {}
        }
    }
    Ok(())
}

fn apply_txn(w: &mut Writer<'_>, txn: &Txn, path: &[bool], at: &mut usize) -> TxnResponse {
    let ok = path.get(*at).copied().unwrap_or(false);
    *at += 1;
    let mut responses = Vec::new();
    for op in if ok { &txn.success } else { &txn.failure } {
        let resp = match op {
            Op::Put { key, value, lease } => {
                w.put(key, value.clone(), *lease);
                OpResponse::Put
            }
            Op::Get { key } => OpResponse::Get(w.get(key)),
            Op::GetPrefix { prefix } => OpResponse::Get(w.get_prefix(prefix)),
            Op::Delete { key } => OpResponse::Delete {
                deleted: u64::from(w.delete(key)),
            },
            Op::DeletePrefix { prefix } => OpResponse::Delete {
                deleted: w.delete_prefix(prefix),
            },
            Op::Txn(inner) => OpResponse::Txn(apply_txn(w, inner, path, at)),
        };
        responses.push(resp);
    }
    TxnResponse {
        succeeded: ok,
        revision: 0,
        responses,
    }
}

fn lease_ttl_secs(ttl: Duration) -> Result<u64> {
    if ttl.is_zero() {
        return Err(Error::InvalidArgument("lease ttl must be positive".into()));
    }
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    if secs > MAX_LEASE_TTL_SECS {
        return Err(Error::InvalidArgument("too large lease TTL".into()));
    }
    Ok(secs)
}

#[async_trait]
impl Backend for MemBackend {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        check_key(key)?;
        Ok(self.inner.locked_now().kvs.get(key).cloned())
    }

    async fn range(&self, prefix: &str) -> Result<(Vec<KeyValue>, Revision)> {
        let st = self.inner.locked_now();
        Ok((range_prefix(&st.kvs, prefix), st.revision))
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision> {
        check_key(key)?;
        check_request_size(16 + key.len() + value.len())?;
        let mut st = self.inner.locked_now();
        if let Some(id) = lease
            && !st.leases.contains_key(&id)
        {
            return Err(Error::LeaseLost);
        }
        let mut w = Writer::new(&mut st);
        w.put(key, value, lease);
        Ok(self.inner.commit(w))
    }

    async fn delete(&self, key: &str) -> Result<bool> {
        check_key(key)?;
        let mut st = self.inner.locked_now();
        let mut w = Writer::new(&mut st);
        let existed = w.delete(key);
        self.inner.commit(w);
        Ok(existed)
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<u64> {
        let mut st = self.inner.locked_now();
        let mut w = Writer::new(&mut st);
        let n = w.delete_prefix(prefix);
        self.inner.commit(w);
        Ok(n)
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResponse> {
        validate_txn(&txn)?;
        check_request_size(txn_size(&txn))?;
        let mut st = self.inner.locked_now();
        let mut path = Vec::new();
        decide_path(&st.kvs, &txn, &mut path);
        check_leases(&st.leases, &txn, &path, &mut 0)?;
        let mut w = Writer::new(&mut st);
        let mut resp = apply_txn(&mut w, &txn, &path, &mut 0);
        let rev = self.inner.commit(w);
        resp.set_revision(rev);
        Ok(resp)
    }

    async fn compact(&self, revision: Revision) -> Result<()> {
        let mut st = self.inner.locked_now();
        if revision <= st.compact_revision {
            return Err(Error::InvalidArgument(
                "mvcc: required revision has been compacted".into(),
            ));
        }
        if revision > st.revision {
            return Err(Error::InvalidArgument(
                "mvcc: required revision is a future revision".into(),
            ));
        }
        while st.history.front().is_some_and(|e| e.revision() < revision) {
            st.history.pop_front();
        }
        st.compact_revision = revision;
        Ok(())
    }

    async fn lease_grant(&self, ttl: Duration) -> Result<LeaseGrant> {
        let secs = lease_ttl_secs(ttl)?;
        let id_ttl = {
            let mut st = self.inner.locked_now();
            let ttl = Duration::from_secs(secs.max(st.min_ttl_secs));
            st.next_lease_id += 1;
            let id = LeaseId(st.next_lease_id);
            st.leases.insert(
                id,
                MemLease {
                    ttl,
                    deadline: Instant::now() + ttl,
                    keys: BTreeSet::new(),
                },
            );
            (id, ttl)
        };
        let (id, ttl) = id_ttl;
        self.ensure_expiry_task();
        self.inner.lease_granted.notify_one();
        Ok(LeaseGrant { id, ttl })
    }

    async fn lease_keep_alive_once(&self, id: LeaseId) -> Result<Option<Duration>> {
        let mut st = self.inner.locked_now();
        Ok(st.leases.get_mut(&id).map(|l| {
            l.deadline = Instant::now() + l.ttl;
            l.ttl
        }))
    }

    async fn lease_revoke(&self, id: LeaseId) -> Result<()> {
        let mut st = self.inner.locked_now();
        self.inner.end_lease(&mut st, id);
        Ok(())
    }

    async fn lease_ttl(&self, id: LeaseId) -> Result<Option<Duration>> {
        let st = self.inner.locked_now();
        let now = Instant::now();
        Ok(st
            .leases
            .get(&id)
            .map(|l| l.deadline.saturating_duration_since(now)))
    }

    async fn watch_prefix(
        &self,
        prefix: &str,
        start_revision: Option<Revision>,
    ) -> Result<WatchStream> {
        let next = {
            let st = self.inner.locked_now();
            match start_revision {
                Some(r) if r > 0 => r,
                _ => st.revision + 1,
            }
        };
        let state = MemWatch {
            inner: Arc::downgrade(&self.inner),
            rx: self.inner.revision_tx.subscribe(),
            prefix: prefix.to_owned(),
            next,
            buf: VecDeque::new(),
            done: false,
        };
        Ok(Box::pin(futures::stream::unfold(
            state,
            MemWatch::next_item,
        )))
    }
}

/// State of one in-memory watch: events are read from the shared history, so a
/// watch costs no memory of its own beyond one revision's batch.
struct MemWatch {
    inner: Weak<Inner>,
    rx: watch::Receiver<Revision>,
    prefix: String,
    next: Revision,
    buf: VecDeque<WatchEvent>,
    done: bool,
}

impl MemWatch {
    async fn next_item(mut self) -> Option<(Result<WatchEvent>, Self)> {
        loop {
            if let Some(ev) = self.buf.pop_front() {
                return Some((Ok(ev), self));
            }
            if self.done {
                return None;
            }
            // Mark the current revision seen before reading, so a commit racing with
            // the read wakes the wait below.
            self.rx.borrow_and_update();
            {
                let inner = self.inner.upgrade()?;
                let st = inner.locked_now();
                if self.next < st.compact_revision {
                    self.done = true;
                    let compact_revision = st.compact_revision;
                    return Some((Err(Error::Compacted { compact_revision }), self));
                }
                let start = st.history.partition_point(|e| e.revision() < self.next);
                self.buf.extend(
                    st.history
                        .iter()
                        .skip(start)
                        .filter(|e| e.kv.key.starts_with(self.prefix.as_str()))
                        .cloned(),
                );
                self.next = self.next.max(st.revision + 1);
            }
            if self.buf.is_empty() && self.rx.changed().await.is_err() {
                // The store was dropped.
                return None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::{FutureExt, StreamExt};

    #[tokio::test(start_paused = true)]
    async fn history_limit_compacts_whole_revisions() {
        let b = MemBackend::with_history_limit(3);
        b.put("a", b"1".to_vec(), None).await.unwrap(); // rev 2
        let t = Txn::new().and_then([Op::put("b", "1"), Op::put("c", "1")]);
        b.txn(t).await.unwrap(); // rev 3 (two events)
        b.put("d", b"1".to_vec(), None).await.unwrap(); // rev 4 -> evicts rev 2
        let mut w = b.watch_prefix("", Some(2)).await.unwrap();
        match w.next().await {
            Some(Err(Error::Compacted { compact_revision })) => assert_eq!(compact_revision, 3),
            other => panic!("unexpected {other:?}"),
        }
        let w = b.watch_prefix("", Some(3)).await.unwrap();
        let evs: Vec<_> = w.take(3).map(|e| e.unwrap().kv.key).collect().await;
        assert_eq!(evs, vec!["b", "c", "d"]);
    }

    #[tokio::test(start_paused = true)]
    async fn expiry_task_deletes_without_other_requests() {
        let b = MemBackend::new();
        let g = b.lease_grant(Duration::from_secs(2)).await.unwrap();
        b.put("k", b"v".to_vec(), Some(g.id)).await.unwrap();
        let mut w = b.watch_prefix("k", None).await.unwrap();
        let ev = tokio::time::timeout(Duration::from_secs(3), w.next())
            .await
            .expect("expiry within ttl")
            .unwrap()
            .unwrap();
        assert_eq!(ev.kind, EventKind::Delete);
        assert_eq!(ev.kv.key, "k");
    }

    #[test]
    fn duplicate_key_rules() {
        let ok = Txn::new().and_then([Op::put("a", "1"), Op::put("b", "1")]);
        assert!(validate_txn(&ok).is_ok());
        let dup = Txn::new().and_then([Op::put("a", "1"), Op::put("a", "2")]);
        assert!(validate_txn(&dup).is_err());
        let put_del = Txn::new().and_then([Op::delete_prefix("a"), Op::put("ab", "1")]);
        assert!(validate_txn(&put_del).is_err());
        let nested_both_branches = Txn::new().and_then([Op::txn(
            Txn::new()
                .and_then([Op::put("a", "1")])
                .or_else([Op::put("a", "2")]),
        )]);
        assert!(validate_txn(&nested_both_branches).is_ok());
        let nested_dup = Txn::new().and_then([
            Op::put("a", "0"),
            Op::txn(Txn::new().and_then([Op::put("a", "1")])),
        ]);
        assert!(validate_txn(&nested_dup).is_err());
        let too_many = Txn::new().and_then((0..=MAX_TXN_OPS).map(|i| Op::put(format!("k{i}"), "")));
        assert!(validate_txn(&too_many).is_err());
    }

    #[derive(Clone, Debug)]
    enum Step {
        Put(u8, u8),
        Delete(u8),
        DeletePrefix,
        Txn(u8, u8, u8),
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            (0u8..4, any::<u8>()).prop_map(|(k, v)| Step::Put(k, v)),
            (0u8..4).prop_map(Step::Delete),
            Just(Step::DeletePrefix),
            (0u8..4, 0u8..4, any::<u8>()).prop_map(|(c, k, v)| Step::Txn(c, k, v)),
        ]
    }

    proptest::proptest! {
        /// Every effective write bumps the revision by one; replaying the watch
        /// history from revision 1 rebuilds exactly the final store.
        #[test]
        fn history_replays_to_the_store(steps in proptest::collection::vec(step(), 1..40)) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                let b = MemBackend::new();
                let key = |k: u8| format!("p/{k}");
                for s in &steps {
                    let before = b.revision();
                    let changed = match s {
                        Step::Put(k, v) => {
                            b.put(&key(*k), vec![*v], None).await.unwrap();
                            true
                        }
                        Step::Delete(k) => b.delete(&key(*k)).await.unwrap(),
                        Step::DeletePrefix => b.delete_prefix("p/").await.unwrap() > 0,
                        Step::Txn(c, k, v) => {
                            let t = Txn::new()
                                .when([Compare::exists(key(*c))])
                                .and_then([Op::put(key(*k), vec![*v])])
                                .or_else([Op::delete(key(*k))]);
                            let existed = b.get(&key(*k)).await.unwrap().is_some();
                            let r = b.txn(t).await.unwrap();
                            r.succeeded || existed
                        }
                    };
                    assert_eq!(b.revision(), before + i64::from(changed), "{s:?}");
                }
                let mut w = b.watch_prefix("p/", Some(1)).await.unwrap();
                let mut replay: BTreeMap<String, KeyValue> = BTreeMap::new();
                let mut last = 0;
                // Every event is already in the history: drain without waiting.
                while let Some(Some(ev)) = w.next().now_or_never() {
                    let ev = ev.unwrap();
                    assert!(ev.revision() >= last);
                    last = ev.revision();
                    match ev.kind {
                        EventKind::Put => {
                            replay.insert(ev.kv.key.clone(), ev.kv);
                        }
                        EventKind::Delete => {
                            replay.remove(&ev.kv.key);
                        }
                    }
                }
                assert_eq!(last.max(1), b.revision());
                let (kvs, _) = b.range("p/").await.unwrap();
                let replayed: Vec<KeyValue> = replay.into_values().collect();
                assert_eq!(kvs, replayed);
            });
        }
    }

    #[tokio::test(start_paused = true)]
    async fn min_ttl_raises_granted_ttls() {
        let b = MemBackend::new().with_min_ttl(Duration::from_millis(1500));
        let g = b.lease_grant(Duration::from_secs(1)).await.unwrap();
        assert_eq!(g.ttl, Duration::from_secs(2));
        assert_eq!(b.lease_keep_alive_once(g.id).await.unwrap(), Some(g.ttl));
        let g = b.lease_grant(Duration::from_secs(5)).await.unwrap();
        assert_eq!(g.ttl, Duration::from_secs(5));
        // Without it, a TTL is granted as asked.
        let g = MemBackend::new()
            .lease_grant(Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(g.ttl, Duration::from_secs(1));
    }

    #[test]
    fn request_size_counts_keys_values_and_compares() {
        let big = Txn::new()
            .when([Compare::value(
                "k",
                CompareOp::Equal,
                vec![0; MAX_REQUEST_BYTES],
            )])
            .and_then([Op::put("k", "v")]);
        assert!(check_request_size(txn_size(&big)).is_err());
        let nested = Txn::new().and_then([Op::txn(
            Txn::new().and_then([Op::put("k", vec![0; MAX_REQUEST_BYTES])]),
        )]);
        assert!(check_request_size(txn_size(&nested)).is_err());
        let small = Txn::new().and_then([Op::put("k", vec![0; MAX_REQUEST_BYTES / 2])]);
        assert!(check_request_size(txn_size(&small)).is_ok());
    }

    #[test]
    fn ttl_rounds_up_to_seconds() {
        assert_eq!(lease_ttl_secs(Duration::from_millis(1500)).unwrap(), 2);
        assert_eq!(lease_ttl_secs(Duration::from_secs(2)).unwrap(), 2);
        assert!(lease_ttl_secs(Duration::ZERO).is_err());
    }
}
