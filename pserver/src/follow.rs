//! A live view of every key under an etcd prefix, kept up to date by a watch that
//! resumes after disconnects (and re-lists after a compaction).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, Backoff, EventKind, KeyValue, RetryPolicy, Revision};
use futures::StreamExt;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

/// The keys under a prefix as of `revision` (0: not listed yet).
#[derive(Debug, Clone, Default)]
pub struct PrefixView {
    /// Every key under the prefix.
    pub kvs: BTreeMap<String, KeyValue>,
    /// The store revision the view reflects.
    pub revision: Revision,
}

/// Follows every key under `prefix` until `cancel` fires. The receiver first holds an
/// empty view with revision 0, then the listing, then a new view after every change.
pub fn follow_prefix(
    backend: Arc<dyn Backend>,
    prefix: String,
    cancel: CancellationToken,
) -> watch::Receiver<Arc<PrefixView>> {
    let (tx, rx) = watch::channel(Arc::new(PrefixView::default()));
    tokio::spawn(
        async move {
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = run(backend, prefix, tx) => {}
            }
        }
        .in_current_span(),
    );
    rx
}

async fn run(backend: Arc<dyn Backend>, prefix: String, tx: watch::Sender<Arc<PrefixView>>) {
    let policy =
        RetryPolicy::forever().with_delays(Duration::from_millis(50), Duration::from_secs(2));
    let mut backoff = Backoff::new(policy.clone());
    loop {
        let (kvs, rev) = match backend.range(&prefix).await {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(prefix = %prefix, error = %e, "listing failed; retrying");
                tokio::time::sleep(backoff.next_delay().unwrap_or(Duration::from_secs(1))).await;
                continue;
            }
        };
        let mut view = PrefixView {
            kvs: kvs.into_iter().map(|kv| (kv.key.clone(), kv)).collect(),
            revision: rev,
        };
        if tx.send(Arc::new(view.clone())).is_err() {
            return;
        }
        let mut from = rev + 1;
        // Watch and resume from the last revision seen until the history is gone.
        'watch: loop {
            let mut stream = match backend.watch_prefix(&prefix, Some(from)).await {
                Ok(s) => s,
                Err(edl_coord::Error::Compacted { .. }) => break 'watch,
                Err(e) => {
                    tracing::debug!(prefix = %prefix, error = %e, "watch failed; retrying");
                    tokio::time::sleep(backoff.next_delay().unwrap_or(Duration::from_secs(1)))
                        .await;
                    continue;
                }
            };
            while let Some(item) = stream.next().await {
                match item {
                    Ok(ev) => {
                        backoff = Backoff::new(policy.clone());
                        let rev = ev.revision();
                        match ev.kind {
                            EventKind::Put => {
                                view.kvs.insert(ev.kv.key.clone(), ev.kv);
                            }
                            EventKind::Delete => {
                                view.kvs.remove(&ev.kv.key);
                            }
                        }
                        view.revision = view.revision.max(rev);
                        from = rev + 1;
                        if tx.send(Arc::new(view.clone())).is_err() {
                            return;
                        }
                    }
                    Err(edl_coord::Error::Compacted { .. }) => break 'watch,
                    Err(e) => {
                        tracing::debug!(prefix = %prefix, error = %e, "watch lost; resuming");
                        break;
                    }
                }
            }
            tokio::time::sleep(backoff.next_delay().unwrap_or(Duration::from_secs(1))).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_coord::MemBackend;

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
}
