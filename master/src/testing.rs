//! An in-process master for the tests of the master and of its clients (the trainer's
//! `cloud_reader`): real gRPC on loopback (port 0), the in-memory coordination backend
//! unless a test passes its own (a fault-injecting wrapper, say). Built for this crate's
//! tests and, with the `testing` feature, for other crates' tests. The tests reach the
//! masters through their client (`edl_master_client`, a dev-dependency: the master never
//! depends on its client).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, Lease, MemBackend};
use edl_job::{JobKeys, JobName};
use edl_recordio::{FileWriter, WriterOptions};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::queue::QueueConfig;
use crate::server::{MasterConfig, run};

/// Writes `files` RecordIO files of `per_file` records (`f<i>-r<j>`), 5 records a chunk,
/// into `dir`; returns their glob.
pub fn dataset(dir: &Path, files: usize, per_file: usize) -> String {
    for f in 0..files {
        let mut w = FileWriter::create(
            dir.join(format!("part-{f:03}.recordio")),
            WriterOptions {
                max_chunk_bytes: 5 * 16,
                ..WriterOptions::default()
            },
        )
        .expect("create a dataset file");
        for r in 0..per_file {
            w.write(format!("f{f:03}-r{r:05}").as_bytes())
                .expect("write a record");
        }
        w.finish().expect("finish a dataset file");
    }
    format!("{}/part-*.recordio", dir.display())
}

/// Masters of one job on one coordination backend; dropping it stops them.
#[derive(Debug)]
pub struct Harness {
    /// The job's coordination backend.
    pub backend: Arc<dyn Backend>,
    /// Cancelled on drop: stops every master and client started here.
    pub stop: CancellationToken,
    /// Each master's own stop token and task, in start order.
    pub masters: Vec<(CancellationToken, tokio::task::JoinHandle<()>)>,
    /// The job.
    pub job: JobName,
}

impl Harness {
    /// No master yet, an in-memory backend.
    pub fn new(job: &str) -> Harness {
        Harness::on(job, Arc::new(MemBackend::new()))
    }

    /// No master yet, on `backend` (a real etcd's, say).
    pub fn on(job: &str, backend: Arc<dyn Backend>) -> Harness {
        Harness {
            backend,
            stop: CancellationToken::new(),
            masters: Vec::new(),
            job: JobName::new(job).expect("a valid job name"),
        }
    }

    /// A master on the harness's backend reconciling every 200 ms.
    pub async fn start_master(&mut self) {
        self.start_master_on(self.backend.clone(), Duration::from_millis(200))
            .await;
    }

    /// A master on `backend` (a fault-injecting wrapper, say) reconciling every `every`.
    pub async fn start_master_on(&mut self, backend: Arc<dyn Backend>, every: Duration) {
        self.start_master_with(backend, every, QueueConfig::default())
            .await;
    }

    /// A master with queue settings `queue` and a 1 s lease.
    pub async fn start_master_with(
        &mut self,
        backend: Arc<dyn Backend>,
        every: Duration,
        queue: QueueConfig,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let mut cfg = MasterConfig::new(self.job.clone());
        cfg.lease_ttl = Duration::from_secs(1);
        cfg.reconcile_every = every;
        cfg.queue = queue;
        let stop = self.stop.child_token();
        let s = stop.clone();
        let h = tokio::spawn(async move {
            run(backend, cfg, listener, s)
                .await
                .expect("the master ran");
        });
        self.masters.push((stop, h));
    }

    /// Registers trainer `trainer` under a 1 s lease.
    pub async fn register(&self, trainer: &str) -> Lease {
        edl_testkit::register_trainer(
            &self.backend,
            JobKeys::new(&self.job).trainers(),
            trainer,
            Duration::from_secs(1),
            self.stop.child_token(),
        )
        .await
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
