//! The load's trainers: lightweight, many in one process, each through the real path a
//! trainer takes. Each joins with its own etcd lease and registration, leases tasks
//! through the `cloud_reader` (its own master connection, long polls, read-ahead),
//! reads the task's records from the RecordIO files, pushes one gradient per task to
//! every pserver shard with the task as its origin (so every ledger records it), asks
//! the shards to record the task done, and acknowledges it with their incarnations.
//! Nothing is trained: the gradient is 1 for every weight and the learning rate 1, so
//! after the job each weight is minus the number of tasks applied.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use edl_coord::Backend;
use edl_job::{JobName, TrainerRecord};
use edl_pserver_client::{
    DenseInit, Mode, OptimizerConfig, Origin, ParamConfig, PsClient, PsClientConfig,
};
use edl_trainer::process::{Session, SessionConfig};
use edl_trainer::tasks::Next;
use tokio_util::sync::CancellationToken;

/// Weights of the one dense parameter (spread over the shards).
pub const DIM: usize = 256;
/// Floats per block: `DIM / BLOCK` blocks, so each of up to 8 shards holds one.
const BLOCK: usize = 32;

/// How often each record of each pass was read and acknowledged.
pub struct Seen {
    counts: Vec<AtomicU8>,
    records: u64,
}

impl Seen {
    /// For `records` records per pass and `passes` passes.
    pub fn new(records: u64, passes: u32) -> Seen {
        let n = records as usize * passes as usize;
        Seen {
            counts: (0..n).map(|_| AtomicU8::new(0)).collect(),
            records,
        }
    }

    fn mark(&self, pass: u32, record: u64) -> anyhow::Result<()> {
        anyhow::ensure!(
            record < self.records,
            "record {record} is not in the dataset"
        );
        let i = pass as usize * self.records as usize + record as usize;
        let c = self
            .counts
            .get(i)
            .context("a record of a pass past the last")?;
        let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_add(1));
        Ok(())
    }

    /// Records read other than once: `(missing, repeated)` and the first few of them.
    pub fn check(&self) -> (u64, u64, Vec<String>) {
        let (mut missing, mut repeated, mut first) = (0, 0, Vec::new());
        for (i, c) in self.counts.iter().enumerate() {
            let n = c.load(Ordering::Relaxed);
            if n == 1 {
                continue;
            }
            if n == 0 {
                missing += 1;
            } else {
                repeated += 1;
            }
            if first.len() < 5 {
                let (pass, rec) = (i as u64 / self.records, i as u64 % self.records);
                first.push(format!("pass {pass} record {rec}: read {n} times"));
            }
        }
        (missing, repeated, first)
    }
}

/// Counts of all trainers.
#[derive(Default)]
pub struct Counts {
    /// Trainers that joined.
    pub joined: AtomicU64,
    /// Tasks acknowledged, the master applying the acknowledgement.
    pub tasks: AtomicU64,
    /// Acknowledgements answered as already applied (a retry whose first answer was
    /// lost, in a failover say).
    pub repeated: AtomicU64,
    /// Acknowledgements refused as stale (the task was taken away meanwhile).
    pub stale: AtomicU64,
}

/// What every trainer shares.
#[derive(Clone)]
pub struct Shared {
    /// etcd.
    pub backend: Arc<dyn Backend>,
    /// The job.
    pub job: JobName,
    /// Records seen.
    pub seen: Arc<Seen>,
    /// Counts.
    pub counts: Arc<Counts>,
    /// Fires when every trainer joined and the dataset is defined: the trainers then
    /// start reading, so the job runs with all of them.
    pub go: CancellationToken,
}

/// The parameters every trainer initialises (the first one wins, the others find
/// them).
pub fn param_config() -> ParamConfig {
    ParamConfig {
        block_size: BLOCK,
        ..ParamConfig::new(Mode::Async, OptimizerConfig::sgd(1.0))
    }
}

/// One trainer, until the job ends (or `stop`).
pub async fn run(n: usize, s: Shared, stop: CancellationToken) -> anyhow::Result<()> {
    let id = format!("load-{n:05}");
    let life = stop.child_token();
    let _guard = life.clone().drop_guard();
    let session = Session::join(
        s.backend.clone(),
        SessionConfig {
            job: s.job.clone(),
            id: id.clone(),
            lease_ttl: Duration::from_secs(10),
            token: None,
            tls: None,
            record: TrainerRecord::model_less(),
            etcd_wait: Duration::from_secs(120),
        },
        life.clone(),
    )
    .await
    .with_context(|| format!("{id} joins"))?;
    let ps = PsClient::connect(
        s.backend.clone(),
        PsClientConfig::new(s.job.clone()),
        life.child_token(),
    )
    .await
    .with_context(|| format!("{id} connects to the pservers"))?;
    let zeros = [0.0f32; DIM];
    let dense = [DenseInit {
        name: "w",
        shape: &[DIM],
        values: &zeros,
    }];
    ps.init(&id, &dense, &[], param_config())
        .await
        .with_context(|| format!("{id} initialises the parameters"))?;
    s.counts.joined.fetch_add(1, Ordering::Relaxed);
    tokio::select! {
        _ = s.go.cancelled() => {}
        _ = stop.cancelled() => return Ok(()),
    }
    let mut reader = session.reader(Some(1), None);
    let acks = reader.acks();
    let grad = [1.0f32; DIM];
    let mut step = 0u64;
    let result = loop {
        let item = tokio::select! {
            _ = stop.cancelled() => break Ok(()),
            item = reader.next() => item,
        };
        let t = match item {
            None | Some(Ok(Next::JobFinished)) => break Ok(()),
            Some(Err(e)) => break Err(anyhow::Error::from(e).context(format!("{id} reads"))),
            Some(Ok(Next::Task(t))) => t,
            Some(Ok(_)) => continue,
        };
        for r in &t.records {
            let n: [u8; 8] = r.as_slice().try_into().context("a record of 8 bytes")?;
            s.seen.mark(t.task.pass, u64::from_le_bytes(n))?;
        }
        step += 1;
        let origin = Origin {
            pass: t.task.pass,
            task: t.task.index,
            seq: 0,
            count: 1,
        };
        let pushed = ps
            .push_from(&id, step, Some(origin), &[("w", &grad)], &[])
            .await
            .with_context(|| format!("{id} pushes task {}", t.task.id))?;
        let answered = ps
            .task_done(
                &id,
                t.task.pass,
                t.task.index,
                t.task.tasks,
                &pushed.incarnations,
            )
            .await
            .with_context(|| format!("{id} reports task {} done", t.task.id))?;
        match acks
            .finished(&t.task, t.records.len() as u64, &answered)
            .await
        {
            Ok(true) => s.counts.tasks.fetch_add(1, Ordering::Relaxed),
            Ok(false) => s.counts.repeated.fetch_add(1, Ordering::Relaxed),
            Err(e) if e.is_stale() => s.counts.stale.fetch_add(1, Ordering::Relaxed),
            Err(e) => break Err(anyhow::Error::from(e).context(format!("{id} acknowledges"))),
        };
    };
    reader.drain().await;
    session.leave().await;
    result
}
