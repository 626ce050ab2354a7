//! Leases on tokio's clock: every request first ends the leases that are due
//! (`Inner::locked_now`), and a background task ends them when no request arrives, so
//! watchers see the deletions on time. Ending a lease deletes its keys in one revision.
//! TTLs are whole seconds (rounded up), at most etcd's `MaxLeaseTTL`.

use std::sync::atomic;
use std::sync::{Arc, MutexGuard, Weak};
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument as _;

use super::store::Writer;
use super::{Inner, MemBackend, State};
use crate::error::{Error, Result};
use crate::types::LeaseId;

/// Longest TTL a lease may have (etcd's `MaxLeaseTTL`).
pub(super) const MAX_LEASE_TTL_SECS: u64 = 9_000_000_000;

impl MemBackend {
    /// Starts the task that ends expired leases (so watchers see their deletions
    /// even when no other request arrives). Requests also end due leases first.
    pub(super) fn ensure_expiry_task(&self) {
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
    /// Locks the state after ending every lease that is due by tokio's clock.
    pub(super) fn locked_now(&self) -> MutexGuard<'_, State> {
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
    pub(super) fn end_lease(&self, st: &mut State, id: LeaseId) {
        let Some(lease) = st.leases.remove(&id) else {
            return;
        };
        let mut w = Writer::new(st);
        for key in &lease.keys {
            w.delete(key);
        }
        self.commit(w);
    }
}

pub(super) fn lease_ttl_secs(ttl: Duration) -> Result<u64> {
    if ttl.is_zero() {
        return Err(Error::InvalidArgument("lease ttl must be positive".into()));
    }
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    if secs > MAX_LEASE_TTL_SECS {
        return Err(Error::InvalidArgument("too large lease TTL".into()));
    }
    Ok(secs)
}
