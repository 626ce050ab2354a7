//! The [`Backend`] implementation: each request is checked as etcd would check it,
//! then applied under the store's lock (after due leases are ended) in at most one
//! revision.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use super::lease::lease_ttl_secs;
use super::space::{LEASE_COST, txn_cost};
use super::store::{Writer, check_key, range_prefix};
use super::txn::{
    apply_txn, check_leases, check_request_size, decide_path, txn_size, validate_txn,
};
use super::watches::MemWatch;
use super::{MemBackend, MemLease};
use crate::backend::{Backend, WatchStream};
use crate::error::{Error, Result};
use crate::types::{FreedSpace, KeyValue, LeaseGrant, LeaseId, Revision, Txn, TxnResponse};

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
        st.check_space((key.len() + value.len()) as u64)?;
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
        st.check_space(txn_cost(&txn))?;
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

    async fn free_space(&self) -> Result<FreedSpace> {
        Ok(self.inner.locked_now().free_space())
    }

    async fn lease_grant(&self, ttl: Duration) -> Result<LeaseGrant> {
        let secs = lease_ttl_secs(ttl)?;
        let id_ttl = {
            let mut st = self.inner.locked_now();
            st.check_space(LEASE_COST)?;
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
