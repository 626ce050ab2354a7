//! A standby master's copy of the queue's records, kept current from an etcd watch, so
//! that a standby elected leader rebuilds the queue from memory instead of reading and
//! decoding every task record (7.9 s at a million tasks, docs/benchmarks.md "Scale").
//!
//! The mirror is seeded from reads of the queue's key ranges, each at its own revision,
//! and then applies the watch's changes from the oldest of those revisions on, in
//! revision order. Invariants:
//!
//! - **Once every change up to revision `r` is applied, the mirror holds exactly the
//!   records etcd held at `r`**, provided every seeding read was made at a revision of
//!   at least `from - 1`, where `from` is the first change applied: a key with no change
//!   since is as its read saw it, and a key changed since ends as its last change left it.
//! - **No record goes back in time**: every kept record carries the revision that wrote
//!   it, and a change applies only to a record older than itself (a change a seeding read
//!   already saw is skipped).
//! - [`Mirror::revision`] is the newest revision applied or read. The changes of one
//!   transaction share a revision, so the mirror holds a transaction whole only once a
//!   later revision's change is applied: a new leader writes a marker of its own and waits
//!   for it (`server::standby`).
//!
//! Which keys are kept: the task records and the queue's own records under `job/` (the
//! dataset and its file list, the queue and failure records, the failed-task records, the
//! journal). A standby that reaches a journal hands over to [`Store::load`](crate::store::Store::load),
//! which settles it ([`Mirror::records`] says so). Pure: no I/O, no clock; the
//! follower in `server::standby` feeds it.

use std::collections::BTreeMap;

use edl_coord::{EventKind, KeyValue, Revision, WatchEvent};
use edl_job::JobKeys;

use crate::error::MasterError;
use crate::queue::Task;
use crate::store::{Records, decode_task};

/// A record and the revision that wrote it.
#[derive(Debug, Clone)]
struct Stored<T> {
    revision: Revision,
    value: T,
}

/// What [`Mirror::records`] found.
#[derive(Debug)]
pub(crate) enum Mirrored {
    /// No dataset is defined yet.
    NoDataset,
    /// A queue journal is present: a commit stopped part-way, which only the leader's
    /// full load settles.
    Journal,
    /// The records to rebuild the queue from.
    Records(Box<Records>),
}

/// The queue's records as of [`Mirror::revision`].
#[derive(Debug)]
pub(crate) struct Mirror {
    keys: JobKeys,
    records: BTreeMap<String, Stored<Vec<u8>>>,
    tasks: BTreeMap<String, Stored<Task>>,
    revision: Revision,
}

/// What a key is to the mirror.
enum Kind {
    Task,
    Record,
    Other,
}

impl Mirror {
    /// An empty mirror of the job under `keys`.
    pub(crate) fn new(keys: JobKeys) -> Mirror {
        Mirror {
            keys,
            records: BTreeMap::new(),
            tasks: BTreeMap::new(),
            revision: 0,
        }
    }

    fn kind(&self, key: &str) -> Kind {
        let k = &self.keys;
        if key.starts_with(&k.tasks()) {
            Kind::Task
        } else if key == k.dataset()
            || key == k.queue()
            || key == k.failures()
            || key == k.journal()
            || key.starts_with(&k.dataset_files())
            || key.starts_with(&k.failed())
            || key.starts_with(&k.journal_entries())
        {
            Kind::Record
        } else {
            Kind::Other
        }
    }

    /// The newest revision applied.
    pub(crate) fn revision(&self) -> Revision {
        self.revision
    }

    /// Task records held.
    pub(crate) fn tasks(&self) -> usize {
        self.tasks.len()
    }

    /// Takes in the keys of a seeding read made at revision `read_at`.
    pub(crate) fn seed(&mut self, kvs: &[KeyValue], read_at: Revision) -> Result<(), MasterError> {
        for kv in kvs {
            self.put(kv)?;
        }
        self.revision = self.revision.max(read_at);
        Ok(())
    }

    /// Applies one change seen by the watch.
    pub(crate) fn apply(&mut self, ev: &WatchEvent) -> Result<(), MasterError> {
        let at = ev.revision();
        match ev.kind {
            EventKind::Put => self.put(&ev.kv)?,
            EventKind::Delete => match self.kind(&ev.kv.key) {
                Kind::Task => {
                    if self.tasks.get(&ev.kv.key).is_some_and(|s| s.revision < at) {
                        self.tasks.remove(&ev.kv.key);
                    }
                }
                Kind::Record => {
                    if self
                        .records
                        .get(&ev.kv.key)
                        .is_some_and(|s| s.revision < at)
                    {
                        self.records.remove(&ev.kv.key);
                    }
                }
                Kind::Other => {}
            },
        }
        self.revision = self.revision.max(at);
        Ok(())
    }

    fn put(&mut self, kv: &KeyValue) -> Result<(), MasterError> {
        let at = kv.mod_revision;
        match self.kind(&kv.key) {
            Kind::Task => {
                if self.tasks.get(&kv.key).is_none_or(|s| s.revision < at) {
                    let value = decode_task(&kv.key, &kv.value)?;
                    let stored = Stored {
                        revision: at,
                        value,
                    };
                    self.tasks.insert(kv.key.clone(), stored);
                }
            }
            Kind::Record => {
                if self.records.get(&kv.key).is_none_or(|s| s.revision < at) {
                    let stored = Stored {
                        revision: at,
                        value: kv.value.clone(),
                    };
                    self.records.insert(kv.key.clone(), stored);
                }
            }
            Kind::Other => {}
        }
        Ok(())
    }

    /// The records to rebuild the queue from, as of [`Mirror::revision`] (the mirror
    /// is consumed: its task records move into the queue).
    pub(crate) fn records(mut self) -> Mirrored {
        let k = &self.keys;
        let journaled = self.records.contains_key(&k.journal())
            || self
                .records
                .range(k.journal_entries()..)
                .next()
                .is_some_and(|(key, _)| key.starts_with(&k.journal_entries()));
        if journaled {
            return Mirrored::Journal;
        }
        let Some(dataset) = self.records.remove(&k.dataset()) else {
            return Mirrored::NoDataset;
        };
        let take = |records: &mut BTreeMap<String, Stored<Vec<u8>>>, key: String| {
            records.remove(&key).map(|s| (key, s.value))
        };
        let queue = take(&mut self.records, k.queue());
        let failures = take(&mut self.records, k.failures());
        let under = |records: &BTreeMap<String, Stored<Vec<u8>>>, prefix: String| {
            records
                .range(prefix.clone()..)
                .take_while(|(key, _)| key.starts_with(&prefix))
                .map(|(key, s)| (key.clone(), s.value.clone()))
                .collect::<Vec<_>>()
        };
        Mirrored::Records(Box::new(Records {
            dataset: (k.dataset(), dataset.value),
            files: under(&self.records, k.dataset_files()),
            queue,
            failures,
            tasks: std::mem::take(&mut self.tasks)
                .into_values()
                .map(|s| s.value)
                .collect(),
            failed: under(&self.records, k.failed()),
        }))
    }
}

#[cfg(test)]
mod tests;
