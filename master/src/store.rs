//! The queue's durable state in etcd: every write is a transaction fenced by the master's
//! election key, so a deposed master cannot write.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use edl_coord::{Backend, Fence, Op, Txn, fenced_txn};

use crate::dataset::Dataset;
use crate::error::MasterError;
use crate::queue::{Changes, Meta, Task};
use edl_job::JobKeys;

/// etcd refuses transactions of more than `--max-txn-ops` (128 by default) operations;
/// stay below it, keeping room for the fence compare.
pub const MAX_OPS_PER_TXN: usize = 120;

/// etcd refuses requests over `--max-request-bytes` (1.5 MiB by default); stay well
/// below it.
pub const MAX_BYTES_PER_TXN: usize = 1 << 20;

/// What a new leader loads.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The dataset, once defined.
    pub dataset: Dataset,
    /// The queue record.
    pub meta: Meta,
    /// Every task record.
    pub tasks: Vec<Task>,
}

/// The queue's etcd store, fenced by one leadership.
#[derive(Debug, Clone)]
pub struct Store {
    backend: Arc<dyn Backend>,
    keys: JobKeys,
    fence: Fence,
    txns: Arc<AtomicU64>,
}

fn encode<T: serde::Serialize>(v: &T) -> Result<Vec<u8>, MasterError> {
    serde_json::to_vec(v).map_err(|e| MasterError::Unavailable(format!("encode state: {e}")))
}

fn decode<T: serde::de::DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T, MasterError> {
    serde_json::from_slice(bytes)
        .map_err(|e| MasterError::Unavailable(format!("corrupt record at {key}: {e}")))
}

impl Store {
    /// A store writing under `keys`, fenced by `fence`.
    pub fn new(backend: Arc<dyn Backend>, keys: JobKeys, fence: Fence) -> Store {
        Store {
            backend,
            keys,
            fence,
            txns: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Transactions committed so far (for the benchmark's etcd writes per task).
    pub fn txns(&self) -> u64 {
        self.txns.load(Ordering::Relaxed)
    }

    /// Loads the durable state; `None` until a dataset was defined.
    pub async fn load(&self) -> Result<Option<Loaded>, MasterError> {
        let Some(ds) = self.backend.get(&self.keys.dataset()).await? else {
            return Ok(None);
        };
        let dataset: Dataset = decode(&ds.key, &ds.value)?;
        let meta = match self.backend.get(&self.keys.queue()).await? {
            Some(kv) => decode(&kv.key, &kv.value)?,
            None => Meta::default(),
        };
        let (kvs, _) = self.backend.range(&self.keys.tasks()).await?;
        let tasks = kvs
            .iter()
            .map(|kv| decode(&kv.key, &kv.value))
            .collect::<Result<Vec<Task>, _>>()?;
        Ok(Some(Loaded {
            dataset,
            meta,
            tasks,
        }))
    }

    /// Writes a new dataset: its tasks first (in as many transactions as needed), then
    /// the dataset and queue records, which make it visible. A crash part-way leaves no
    /// dataset record, and the next `SetDataset` rewrites the same deterministic tasks.
    pub async fn create_dataset(
        &self,
        dataset: &Dataset,
        changes: &Changes,
    ) -> Result<(), MasterError> {
        let mut ops = Vec::with_capacity(changes.tasks.len());
        for t in &changes.tasks {
            ops.push(Op::put(self.keys.task(&t.spec.id), encode(t)?));
        }
        self.commit_ops(ops).await?;
        let mut last = vec![Op::put(self.keys.dataset(), encode(dataset)?)];
        if let Some(meta) = &changes.meta {
            last.push(Op::put(self.keys.queue(), encode(meta)?));
        }
        self.commit_ops(last).await
    }

    /// Makes a batch of queue changes durable: one fenced transaction when it fits, a
    /// few otherwise (the replies wait for all of them). If a later one fails after an
    /// earlier one committed, etcd holds part of the batch: every task record is
    /// self-contained and no reply was sent, so the rebuilt queue is valid and callers
    /// retry idempotently (a retried `GetTask` gets the lease already recorded for it).
    pub async fn commit(&self, changes: &Changes) -> Result<(), MasterError> {
        let mut ops = Vec::with_capacity(changes.tasks.len() + 1);
        for t in &changes.tasks {
            ops.push(Op::put(self.keys.task(&t.spec.id), encode(t)?));
        }
        if let Some(meta) = &changes.meta {
            ops.push(Op::put(self.keys.queue(), encode(meta)?));
        }
        self.commit_ops(ops).await
    }

    async fn commit_ops(&self, ops: Vec<Op>) -> Result<(), MasterError> {
        let mut ops = ops.into_iter().peekable();
        while ops.peek().is_some() {
            let batch: Vec<Op> = ops.by_ref().take(MAX_OPS_PER_TXN).collect();
            fenced_txn(
                self.backend.as_ref(),
                &self.fence,
                Txn::new().and_then(batch),
            )
            .await?;
            self.txns.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}
