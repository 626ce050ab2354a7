//! The key space and its revisions: `Writer` applies the writes of one revision
//! (versions, create and mod revisions, the keys each lease holds), and
//! `Inner::commit` makes them the current revision: the events enter the history
//! together, and the oldest revisions are dropped whole past the history limit (which
//! raises the compact revision). A revision with no events is not committed.

use std::collections::BTreeMap;

use super::{Inner, State};
use crate::error::{Error, Result};
use crate::types::{EventKind, KeyValue, LeaseId, Revision, WatchEvent};

impl Inner {
    pub(super) fn commit(&self, w: Writer<'_>) -> Revision {
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
pub(super) struct Writer<'a> {
    st: &'a mut State,
    rev: Revision,
    events: Vec<WatchEvent>,
}

impl<'a> Writer<'a> {
    pub(super) fn new(st: &'a mut State) -> Self {
        let rev = st.revision + 1;
        Self {
            st,
            rev,
            events: Vec::new(),
        }
    }

    pub(super) fn put(&mut self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) {
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

    pub(super) fn delete(&mut self, key: &str) -> bool {
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

    pub(super) fn delete_prefix(&mut self, prefix: &str) -> u64 {
        let keys = keys_with_prefix(&self.st.kvs, prefix);
        let mut n = 0;
        for key in keys {
            if self.delete(&key) {
                n += 1;
            }
        }
        n
    }

    pub(super) fn get(&self, key: &str) -> Vec<KeyValue> {
        self.st.kvs.get(key).cloned().into_iter().collect()
    }

    pub(super) fn get_prefix(&self, prefix: &str) -> Vec<KeyValue> {
        range_prefix(&self.st.kvs, prefix)
    }
}

pub(super) fn range_prefix(kvs: &BTreeMap<String, KeyValue>, prefix: &str) -> Vec<KeyValue> {
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

pub(super) fn check_key(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(Error::InvalidArgument("key is not provided".into()));
    }
    Ok(())
}
