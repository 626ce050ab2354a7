//! The queue's durable state in etcd: every write is a transaction fenced by the master's
//! election key, so a deposed master cannot write.
//!
//! **A batch of changes lands whole or not at all.** When its puts fit one transaction
//! (at most [`MAX_OPS_PER_TXN`] operations and [`MAX_BYTES_PER_TXN`] bytes) it is one
//! transaction. Otherwise (a lost trainer holding many tasks, a rebuilt queue re-arming
//! many leases) it is journaled, in two phases:
//!
//! 1. its puts are packed into journal entries `job/journal/<id>/<n>` (as many
//!    transactions as needed), then the header `job/journal` naming `<id>` and the entry
//!    count is written: the header's transaction is the commit point;
//! 2. the puts are applied to their keys (as many transactions as needed), then the
//!    journal is deleted.
//!
//! [`Store::load`] first settles a journal left by a commit that stopped part-way: a
//! header present means the batch committed, and its puts are applied again (they are
//! idempotent); entries without a header are discarded. So a loader reads the state
//! before a batch or after it, never a part of one: no pass `p + 1` task records under a
//! pass `p` queue record, no transitions without their counters.
//!
//! **Sizes.** Every record must fit one transaction. The queue bounds its records by
//! construction (failure reasons are truncated, trainer ids are member ids, the list of
//! failed tasks is capped); a record over the bound is refused with
//! [`MasterError::TooLarge`] before anything is written.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use edl_coord::{Backend, Fence, Op, Txn, fenced_txn};
use serde::{Deserialize, Serialize};

use crate::dataset::{Dataset, DatasetFile};
use crate::error::MasterError;
use crate::queue::{Changes, Meta, Task};
use edl_job::{FailedRecord, JobKeys, Record, RestoreRecord};

/// etcd refuses transactions of more than `--max-txn-ops` (128 by default) operations;
/// stay below it, keeping room for the fence compare.
pub const MAX_OPS_PER_TXN: usize = 120;

/// etcd refuses requests over `--max-request-bytes` (1.5 MiB by default); stay well
/// below it. Counted as the keys and values of a transaction's operations plus
/// [`OP_OVERHEAD`] bytes each.
pub const MAX_BYTES_PER_TXN: usize = 1 << 20;

/// Bytes counted per operation on top of its key and value (framing, the fence).
pub const OP_OVERHEAD: usize = 64;

/// Target size of one journal entry (several puts packed together).
const JOURNAL_ENTRY_BYTES: usize = MAX_BYTES_PER_TXN / 4;

/// Bytes of file entries per part of the dataset's file list (`job/files/<n>`): a
/// quarter of a transaction, so a part always fits one.
const FILES_PART_BYTES: usize = MAX_BYTES_PER_TXN / 4;

/// The record `job/dataset`: the dataset without its file list, which is in
/// `file_parts` records `job/files/<n>` (written before it). Records written before the
/// parts existed hold the list in `files`.
#[derive(Debug, Serialize, Deserialize)]
struct DatasetHeader {
    spec: crate::dataset::DatasetSpec,
    tasks: u64,
    records: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    files: Vec<DatasetFile>,
    #[serde(default)]
    file_parts: u32,
}

/// Cuts a file list into parts of about [`FILES_PART_BYTES`] (encoded).
fn file_parts(files: &[DatasetFile]) -> Result<Vec<Vec<u8>>, MasterError> {
    let mut parts = Vec::new();
    let mut cur: Vec<&DatasetFile> = Vec::new();
    let mut bytes = 0;
    for f in files {
        // An entry's JSON: its path and a few numbers.
        let n = f.path.len() + 96;
        if !cur.is_empty() && bytes + n > FILES_PART_BYTES {
            parts.push(encode(&cur)?);
            cur.clear();
            bytes = 0;
        }
        bytes += n;
        cur.push(f);
    }
    if !cur.is_empty() {
        parts.push(encode(&cur)?);
    }
    Ok(parts)
}

/// What a new leader loads.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The dataset, once defined.
    pub dataset: Dataset,
    /// The queue record.
    pub meta: Meta,
    /// Every task record.
    pub tasks: Vec<Task>,
    /// The failed-task records (`job/failed/<pass>`).
    pub failed: Vec<FailedRecord>,
}

/// The queue's etcd store, fenced by one leadership.
#[derive(Debug, Clone)]
pub struct Store {
    backend: Arc<dyn Backend>,
    keys: JobKeys,
    fence: Fence,
    txns: Arc<AtomicU64>,
    journals: Arc<AtomicU64>,
}

/// The header of a journaled commit (`job/journal`): written after every entry.
#[derive(Debug, Serialize, Deserialize)]
struct JournalHeader {
    /// The commit's id: its entries are `job/journal/<id>/<n>`.
    id: String,
    /// How many entries it has.
    entries: usize,
}

fn encode<T: serde::Serialize>(v: &T) -> Result<Vec<u8>, MasterError> {
    serde_json::to_vec(v).map_err(|e| MasterError::Unavailable(format!("encode state: {e}")))
}

/// Largest number a queue record may hold: counters, generations and times stay far
/// below it in any real job, and arithmetic on numbers under it cannot overflow.
const MAX_STORED_NUMBER: u64 = 1 << 53;

fn decode<T: serde::de::DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T, MasterError> {
    let corrupt = |e: String| MasterError::Unavailable(format!("corrupt record at {key}: {e}"));
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))?;
    if let Some(n) = oversized_number(&value) {
        return Err(corrupt(format!(
            "the number {n} is out of range (over {MAX_STORED_NUMBER}): another process wrote it"
        )));
    }
    serde_json::from_value(value).map_err(|e| corrupt(e.to_string()))
}

/// A number in `v` that no queue record holds: over [`MAX_STORED_NUMBER`].
fn oversized_number(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::Number(n) => {
            let ok = n.as_u64().is_some_and(|x| x <= MAX_STORED_NUMBER)
                || n.as_i64()
                    .is_some_and(|x| x.unsigned_abs() <= MAX_STORED_NUMBER)
                || n.as_f64()
                    .is_some_and(|x| x.abs() <= MAX_STORED_NUMBER as f64);
            (!ok).then(|| n.to_string())
        }
        serde_json::Value::Array(a) => a.iter().find_map(oversized_number),
        serde_json::Value::Object(m) => m.values().find_map(oversized_number),
        _ => None,
    }
}

/// The loaded records agree with each other as the queue writes them: its pass within
/// the dataset's passes, no task ahead of it, counts that cannot overflow. Anything else
/// was written by another process (or a bug) and is refused with the key to look at.
fn check_loaded(dataset: &Dataset, meta: &Meta, tasks: &[Task]) -> Result<(), MasterError> {
    let corrupt = |what: String| MasterError::Unavailable(format!("corrupt queue state: {what}"));
    if meta.pass > dataset.spec.passes {
        return Err(corrupt(format!(
            "the queue is at pass {} of a dataset of {} passes",
            meta.pass, dataset.spec.passes
        )));
    }
    for t in tasks {
        if t.pass > meta.pass {
            return Err(corrupt(format!(
                "task {} is at pass {}, ahead of the queue's {}",
                t.spec.id, t.pass, meta.pass
            )));
        }
        if t.failures > u32::MAX / 2 || t.losses > u32::MAX / 2 {
            return Err(corrupt(format!(
                "task {} counts absurd failures",
                t.spec.id
            )));
        }
        if t.answered.len() > crate::server::MAX_SHARDS {
            return Err(corrupt(format!(
                "task {} names {} shards",
                t.spec.id,
                t.answered.len()
            )));
        }
    }
    Ok(())
}

/// The queue's records as read from etcd (by [`Store::load`], or kept by a standby's
/// [`Mirror`](crate::mirror::Mirror)), each as its key and value, task records decoded.
#[derive(Debug)]
pub(crate) struct Records {
    /// `job/dataset`.
    pub dataset: (String, Vec<u8>),
    /// `job/files/<n>`, in key order.
    pub files: Vec<(String, Vec<u8>)>,
    /// `job/queue`, once written.
    pub queue: Option<(String, Vec<u8>)>,
    /// `job/failures`, once written.
    pub failures: Option<(String, Vec<u8>)>,
    /// Every task record, in key order.
    pub tasks: Vec<Task>,
    /// `job/failed/<pass>`, in key order.
    pub failed: Vec<(String, Vec<u8>)>,
}

/// A task record decoded (and its numbers checked).
pub(crate) fn decode_task(key: &str, value: &[u8]) -> Result<Task, MasterError> {
    decode(key, value)
}

/// The dataset, queue and failure records decoded and checked against each other: what a
/// leader rebuilds its queue from.
pub(crate) fn assemble(keys: &JobKeys, r: Records) -> Result<Loaded, MasterError> {
    let dataset = decode_dataset(keys, &r.dataset, &r.files)?;
    let mut meta: Meta = match &r.queue {
        Some((k, v)) => decode(k, v)?,
        None => Meta::default(),
    };
    if let Some((k, v)) = &r.failures {
        meta.failed = decode(k, v)?;
    }
    check_loaded(&dataset, &meta, &r.tasks)?;
    let failed = r
        .failed
        .iter()
        .map(|(k, v)| {
            FailedRecord::decode(v)
                .map_err(|e| MasterError::Unavailable(format!("corrupt record at {k}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Loaded {
        dataset,
        meta,
        tasks: r.tasks,
        failed,
    })
}

/// The dataset from its header and its file list's parts.
fn decode_dataset(
    keys: &JobKeys,
    (key, value): &(String, Vec<u8>),
    parts: &[(String, Vec<u8>)],
) -> Result<Dataset, MasterError> {
    let h: DatasetHeader = decode(key, value)?;
    let mut files = h.files;
    if h.file_parts > 0 {
        if parts.len() != h.file_parts as usize {
            return Err(MasterError::Unavailable(format!(
                "corrupt dataset: {} of its {} file lists are under {}",
                parts.len(),
                h.file_parts,
                keys.dataset_files()
            )));
        }
        for (k, v) in parts {
            files.extend(decode::<Vec<DatasetFile>>(k, v)?);
        }
    }
    Ok(Dataset {
        spec: h.spec,
        files,
        tasks: h.tasks,
        records: h.records,
    })
}

/// The bytes an operation counts for against [`MAX_BYTES_PER_TXN`].
fn op_bytes(op: &Op) -> usize {
    OP_OVERHEAD
        + match op {
            Op::Put { key, value, .. } => key.len() + value.len(),
            Op::Get { key } | Op::Delete { key } => key.len(),
            Op::GetPrefix { prefix } | Op::DeletePrefix { prefix } => prefix.len(),
            Op::Txn(t) => t.success.iter().chain(&t.failure).map(op_bytes).sum(),
        }
}

fn op_key(op: &Op) -> &str {
    match op {
        Op::Put { key, .. } | Op::Get { key } | Op::Delete { key } => key,
        Op::GetPrefix { prefix } | Op::DeletePrefix { prefix } => prefix,
        Op::Txn(_) => "(nested transaction)",
    }
}

/// Splits `ops`, in order, into transactions within etcd's limits. An operation that
/// cannot fit any transaction is refused before anything is written.
pub fn split(ops: Vec<Op>) -> Result<Vec<Vec<Op>>, MasterError> {
    let mut txns = Vec::new();
    let mut cur: Vec<Op> = Vec::new();
    let mut bytes = 0;
    for op in ops {
        let n = op_bytes(&op);
        if n > MAX_BYTES_PER_TXN {
            return Err(MasterError::TooLarge(format!(
                "the write of {} is {n} bytes, over the {MAX_BYTES_PER_TXN}-byte limit of one etcd transaction",
                op_key(&op)
            )));
        }
        if !cur.is_empty() && (cur.len() == MAX_OPS_PER_TXN || bytes + n > MAX_BYTES_PER_TXN) {
            txns.push(std::mem::take(&mut cur));
            bytes = 0;
        }
        bytes += n;
        cur.push(op);
    }
    if !cur.is_empty() {
        txns.push(cur);
    }
    Ok(txns)
}

/// Packs puts into journal entries of about [`JOURNAL_ENTRY_BYTES`]: each put is its
/// key's and its value's length (u32, little-endian) followed by their bytes.
fn pack(puts: &[(String, Vec<u8>)]) -> Vec<Vec<u8>> {
    let mut entries = Vec::new();
    let mut cur = Vec::new();
    for (k, v) in puts {
        if !cur.is_empty() && cur.len() + 8 + k.len() + v.len() > JOURNAL_ENTRY_BYTES {
            entries.push(std::mem::take(&mut cur));
        }
        cur.extend_from_slice(&(k.len() as u32).to_le_bytes());
        cur.extend_from_slice(k.as_bytes());
        cur.extend_from_slice(&(v.len() as u32).to_le_bytes());
        cur.extend_from_slice(v);
    }
    if !cur.is_empty() {
        entries.push(cur);
    }
    entries
}

/// The puts of a journal entry (see [`pack`]).
fn unpack(key: &str, mut bytes: &[u8]) -> Result<Vec<(String, Vec<u8>)>, MasterError> {
    let corrupt = || MasterError::Unavailable(format!("corrupt journal entry at {key}"));
    let take = |bytes: &mut &[u8]| -> Result<Vec<u8>, MasterError> {
        let (len, rest) = bytes.split_first_chunk::<4>().ok_or_else(corrupt)?;
        let len = u32::from_le_bytes(*len) as usize;
        if rest.len() < len {
            return Err(corrupt());
        }
        let (v, rest) = rest.split_at(len);
        *bytes = rest;
        Ok(v.to_vec())
    };
    let mut puts = Vec::new();
    while !bytes.is_empty() {
        let k = String::from_utf8(take(&mut bytes)?).map_err(|_| corrupt())?;
        let v = take(&mut bytes)?;
        puts.push((k, v));
    }
    Ok(puts)
}

impl Store {
    /// A store writing under `keys`, fenced by `fence`.
    pub fn new(backend: Arc<dyn Backend>, keys: JobKeys, fence: Fence) -> Store {
        Store {
            backend,
            keys,
            fence,
            txns: Arc::new(AtomicU64::new(0)),
            journals: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Transactions committed so far (for the benchmark's etcd writes per task).
    pub fn txns(&self) -> u64 {
        self.txns.load(Ordering::Relaxed)
    }

    /// Commits that needed the journal so far.
    pub fn journaled(&self) -> u64 {
        self.journals.load(Ordering::Relaxed)
    }

    /// Loads the durable state; `None` until a dataset was defined. A journaled commit
    /// that stopped part-way is settled first (rolled forward if it committed).
    pub async fn load(&self) -> Result<Option<Loaded>, MasterError> {
        self.settle_journal().await?;
        let Some(ds) = self.backend.get(&self.keys.dataset()).await? else {
            return Ok(None);
        };
        let queue = self.backend.get(&self.keys.queue()).await?;
        let failures = self.backend.get(&self.keys.failures()).await?;
        let (files, _) = self.backend.range(&self.keys.dataset_files()).await?;
        let (kvs, _) = self.backend.range(&self.keys.tasks()).await?;
        let tasks = kvs
            .iter()
            .map(|kv| decode_task(&kv.key, &kv.value))
            .collect::<Result<Vec<Task>, _>>()?;
        let (failed, _) = self.backend.range(&self.keys.failed()).await?;
        let raw = |kv: &edl_coord::KeyValue| (kv.key.clone(), kv.value.clone());
        assemble(
            &self.keys,
            Records {
                dataset: raw(&ds),
                files: files.iter().map(raw).collect(),
                queue: queue.as_ref().map(raw),
                failures: failures.as_ref().map(raw),
                tasks,
                failed: failed.iter().map(raw).collect(),
            },
        )
        .map(Some)
    }

    /// The pserver shards' restore records (`restores/`) as etcd holds them now.
    pub async fn restores(&self) -> Result<Vec<RestoreRecord>, MasterError> {
        let (kvs, _) = self.backend.range(&self.keys.restores()).await?;
        Ok(edl_job::records::decode_readable(&kvs))
    }

    /// Writes a new dataset: its tasks and its file list's parts first (in as many
    /// transactions as needed), then the dataset and queue records, which make it
    /// visible. A crash part-way leaves no dataset record, and the next `SetDataset`
    /// rewrites the same deterministic tasks and parts.
    pub async fn create_dataset(
        &self,
        dataset: &Dataset,
        changes: &Changes,
    ) -> Result<(), MasterError> {
        let mut ops = Vec::with_capacity(changes.tasks.len());
        for t in &changes.tasks {
            ops.push(Op::put(self.keys.task(&t.spec.id), encode(t)?));
        }
        let parts = file_parts(&dataset.files)?;
        let header = DatasetHeader {
            spec: dataset.spec.clone(),
            tasks: dataset.tasks,
            records: dataset.records,
            files: Vec::new(),
            file_parts: u32::try_from(parts.len())
                .map_err(|_| MasterError::TooLarge("more than 2^32 file lists".into()))?,
        };
        let mut files = Vec::with_capacity(parts.len());
        for (n, part) in parts.into_iter().enumerate() {
            files.push(Op::put(self.keys.dataset_files_part(n as u32), part));
        }
        let mut last = vec![Op::put(self.keys.dataset(), encode(&header)?)];
        if let Some(meta) = &changes.meta {
            last.push(Op::put(self.keys.queue(), encode(meta)?));
        }
        let (tasks, files, last) = (split(ops)?, split(files)?, split(last)?);
        self.run(tasks).await?;
        // The parts of an attempt that stopped before its header go first (etcd takes
        // no transaction that deletes a prefix and puts under it).
        self.run(vec![vec![Op::delete_prefix(self.keys.dataset_files())]])
            .await?;
        self.run(files).await?;
        self.run(last).await
    }

    /// Makes a batch of queue changes durable, atomically: one fenced transaction when
    /// it fits, a journaled commit otherwise (see the module header). The replies wait
    /// for it. On an error etcd holds the state before the batch or after it, and a
    /// rebuild from [`load`](Self::load) reads one of the two.
    pub async fn commit(&self, changes: &Changes) -> Result<(), MasterError> {
        let mut puts = Vec::with_capacity(changes.tasks.len() + 1);
        for t in &changes.tasks {
            puts.push((self.keys.task(&t.spec.id), encode(t)?));
        }
        for f in &changes.failed {
            puts.push((self.keys.failed_in(f.pass), f.encode()));
        }
        if let Some(meta) = &changes.meta {
            puts.push((self.keys.queue(), encode(meta)?));
        }
        if let Some(f) = &changes.failures {
            puts.push((self.keys.failures(), encode(f)?));
        }
        let ops = puts
            .iter()
            .map(|(k, v)| Op::put(k.clone(), v.clone()))
            .collect();
        let txns = split(ops)?;
        if txns.len() <= 1 {
            return self.run(txns).await;
        }
        self.commit_journaled(&puts, txns).await
    }

    async fn commit_journaled(
        &self,
        puts: &[(String, Vec<u8>)],
        apply: Vec<Vec<Op>>,
    ) -> Result<(), MasterError> {
        let seq = self.journals.fetch_add(1, Ordering::Relaxed);
        let id = format!("{:016x}-{seq:08x}", self.fence.revision);
        let prefix = format!("{}{id}/", self.keys.journal_entries());
        let mut ops: Vec<Op> = pack(puts)
            .into_iter()
            .enumerate()
            .map(|(n, e)| Op::put(format!("{prefix}{n:06}"), e))
            .collect();
        let header = JournalHeader {
            id,
            entries: ops.len(),
        };
        ops.push(Op::put(self.keys.journal(), encode(&header)?));
        tracing::debug!(
            puts = puts.len(),
            entries = header.entries,
            "journaled queue commit"
        );
        // Phase 1: the header goes last; its transaction commits the batch.
        self.run(split(ops)?).await?;
        // Phase 2: apply, then drop the journal.
        self.run(apply).await?;
        self.drop_journal().await
    }

    /// Rolls a committed journal forward, or discards the entries of one that never
    /// committed.
    async fn settle_journal(&self) -> Result<(), MasterError> {
        let entries = self.keys.journal_entries();
        let Some(h) = self.backend.get(&self.keys.journal()).await? else {
            let (kvs, _) = self.backend.range(&entries).await?;
            if !kvs.is_empty() {
                tracing::info!(
                    entries = kvs.len(),
                    "discarding an uncommitted queue journal"
                );
                self.drop_journal().await?;
            }
            return Ok(());
        };
        let header: JournalHeader = decode(&h.key, &h.value)?;
        let (kvs, _) = self
            .backend
            .range(&format!("{entries}{}/", header.id))
            .await?;
        if kvs.len() != header.entries {
            return Err(MasterError::Unavailable(format!(
                "the queue journal {} has {} of its {} entries",
                header.id,
                kvs.len(),
                header.entries
            )));
        }
        let mut ops = Vec::new();
        for kv in &kvs {
            for (k, v) in unpack(&kv.key, &kv.value)? {
                if !k.starts_with(self.keys.root()) {
                    return Err(MasterError::Unavailable(format!(
                        "the queue journal {} writes {k}, outside the job",
                        header.id
                    )));
                }
                ops.push(Op::put(k, v));
            }
        }
        tracing::info!(
            journal = %header.id,
            puts = ops.len(),
            "rolling a committed queue journal forward"
        );
        self.run(split(ops)?).await?;
        self.drop_journal().await
    }

    async fn drop_journal(&self) -> Result<(), MasterError> {
        self.run(vec![vec![
            Op::delete(self.keys.journal()),
            Op::delete_prefix(self.keys.journal_entries()),
        ]])
        .await
    }

    /// Whether etcd takes a write again: writes the space probe (fenced). The error of a
    /// full etcd is [`MasterError::EtcdFull`].
    pub async fn probe_space(&self) -> Result<(), MasterError> {
        let stamp = format!("{:?}", std::time::SystemTime::now());
        self.run(vec![vec![Op::put(
            self.keys.space_probe(),
            stamp.into_bytes(),
        )]])
        .await
    }

    /// Frees a full etcd's space where this master may (see
    /// [`Backend::free_space`]).
    pub async fn free_space(&self) -> Result<edl_coord::FreedSpace, edl_coord::Error> {
        self.backend.free_space().await
    }

    /// Runs each transaction in order, fenced.
    async fn run(&self, txns: Vec<Vec<Op>>) -> Result<(), MasterError> {
        for ops in txns {
            fenced_txn(self.backend.as_ref(), &self.fence, Txn::new().and_then(ops)).await?;
            self.txns.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
