//! [`follow_prefix`]: a live view of every key under a prefix (the pservers' claims, the
//! checkpoint keys), kept up to date by [`follow_members`] — the same watch, resume,
//! re-list and re-watch machinery as the member registries, so there is one.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::StreamExt;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::backend::Backend;
use crate::membership::{Membership, follow_members};
use crate::registry::{Member, MemberEvent, Registry};
use crate::types::{KeyValue, Revision};

/// The keys under a prefix as of `revision` (0: not listed yet).
#[derive(Debug, Clone, Default)]
pub struct PrefixView {
    /// Every key under the prefix.
    pub kvs: BTreeMap<String, KeyValue>,
    /// The store revision the view reflects (at least).
    pub revision: Revision,
}

fn kv(prefix: &str, m: Member) -> KeyValue {
    KeyValue {
        key: format!("{prefix}{}", m.id),
        value: m.value,
        create_revision: m.create_revision,
        mod_revision: m.mod_revision,
        version: m.version,
        lease: m.lease,
    }
}

/// Follows every key under `prefix` until `cancel` fires. The receiver first holds an
/// empty view with revision 0, then the listing, then a new view after every change.
pub fn follow_prefix(
    backend: Arc<dyn Backend>,
    prefix: String,
    cancel: CancellationToken,
) -> watch::Receiver<Arc<PrefixView>> {
    let (tx, rx) = watch::channel(Arc::new(PrefixView::default()));
    let mut follow = follow_members(Registry::new(backend, prefix.clone()), None, cancel);
    tokio::spawn(
        async move {
            let mut view = PrefixView::default();
            while let Some(m) = follow.next().await {
                match m {
                    Membership::Listing(members, revision) => {
                        view.kvs = members
                            .into_iter()
                            .map(|m| {
                                let kv = kv(&prefix, m);
                                (kv.key.clone(), kv)
                            })
                            .collect();
                        view.revision = view.revision.max(revision);
                    }
                    Membership::Event(MemberEvent::Joined(m) | MemberEvent::Updated(m)) => {
                        let kv = kv(&prefix, m);
                        view.revision = view.revision.max(kv.mod_revision);
                        view.kvs.insert(kv.key.clone(), kv);
                    }
                    Membership::Event(MemberEvent::Left(m)) => {
                        view.kvs.remove(&format!("{prefix}{}", m.id));
                    }
                }
                // Views only count once listed (revision > 0).
                if view.revision > 0 && tx.send(Arc::new(view.clone())).is_err() {
                    return;
                }
            }
        }
        .in_current_span(),
    );
    rx
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemBackend;

    #[tokio::test]
    async fn follows_puts_and_deletes() {
        let b: Arc<dyn Backend> = Arc::new(MemBackend::new());
        b.put("/p/a", b"1".to_vec(), None).await.unwrap();
        let cancel = CancellationToken::new();
        let mut rx = follow_prefix(b.clone(), "/p/".into(), cancel.clone());
        let v = rx.wait_for(|v| v.revision > 0).await.unwrap().clone();
        assert_eq!(v.kvs.len(), 1);
        b.put("/p/b", b"2".to_vec(), None).await.unwrap();
        b.delete("/p/a").await.unwrap();
        let v = rx
            .wait_for(|v| v.kvs.len() == 1 && v.kvs.contains_key("/p/b"))
            .await
            .unwrap()
            .clone();
        assert_eq!(v.kvs["/p/b"].value, b"2");
        cancel.cancel();
    }

    #[tokio::test]
    async fn an_empty_prefix_is_listed_too() {
        let b: Arc<dyn Backend> = Arc::new(MemBackend::new());
        b.put("/other", b"x".to_vec(), None).await.unwrap();
        let cancel = CancellationToken::new();
        let mut rx = follow_prefix(b.clone(), "/p/".into(), cancel.clone());
        let v = rx.wait_for(|v| v.revision > 0).await.unwrap().clone();
        assert!(v.kvs.is_empty());
        b.put("/p/nested/key", b"1".to_vec(), None).await.unwrap();
        rx.wait_for(|v| v.kvs.contains_key("/p/nested/key"))
            .await
            .unwrap();
        cancel.cancel();
    }
}
