//! Watch streams: a watch reads its prefix's events from the shared history from its
//! start revision on, in revision order, and waits on the latest committed revision
//! for more. A start below the compact revision ends the stream with
//! `Error::Compacted`; the stream ends when the store is dropped.

use std::collections::VecDeque;
use std::sync::Weak;

use tokio::sync::watch;

use super::Inner;
use crate::error::{Error, Result};
use crate::types::{Revision, WatchEvent};

/// State of one in-memory watch: events are read from the shared history, so a
/// watch costs no memory of its own beyond one revision's batch.
pub(super) struct MemWatch {
    pub(super) inner: Weak<Inner>,
    pub(super) rx: watch::Receiver<Revision>,
    pub(super) prefix: String,
    pub(super) next: Revision,
    pub(super) buf: VecDeque<WatchEvent>,
    pub(super) done: bool,
}

impl MemWatch {
    pub(super) async fn next_item(mut self) -> Option<(Result<WatchEvent>, Self)> {
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
