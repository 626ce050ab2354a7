//! The edl master's client ([`MasterClient`]): finds the leading master through etcd,
//! follows failovers, and retries idempotently. The trainer, the Python binding, the
//! Kubernetes operator and `edl` use it. Neither it nor the master (`edl_master`) depends
//! on the other: what both sides of the wire share, the task types ([`task`]) and the
//! wire's limits ([`MAX_MESSAGE_BYTES`], [`MAX_REASON_WIRE_BYTES`]), is the contract crate
//! `edl_master_api`, re-exported here.
//!
//! Every call is safe to retry: `GetTask` carries a per-trainer request number (a retry
//! gets the task already leased for it), and task reports name the task's generation (a
//! report applied twice is answered `applied: false`).
//!
//! Layout:
//! - this file: [`MasterClient`], its settings and errors, [`observe_leader`].
//! - [`task`] (the contract's): [`task::LeasedTask`] and [`task::Answer`], the task as
//!   it travels to a trainer and back, converted to protobuf there and only there.
//! - [`overview`]: a job as seen from outside (`edl status`, the operator), from etcd and
//!   the leading master's status.
//!
//! The trainer's stream of tasks (the `cloud_reader` and the acknowledgements) is
//! `edl_trainer::tasks`, built on this client.

use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Attempt, Backend, CallError, Election, LeaderInfo, call_until};
use edl_job::{JobKeys, JobName};
use edl_proto::headers;
use edl_proto::master as pb;
use pb::master_client::MasterClient as GrpcClient;
use tokio::sync::{Mutex, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::Channel;

pub mod overview;

pub use edl_master_api::{
    Answer, Bucket, Goodput, LeasedTask, MAX_MESSAGE_BYTES, MAX_REASON_WIRE_BYTES, Release, Resume,
    goodput, task,
};

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No leading master answered within the call's retry budget.
    #[error("no master reachable for job {job} within {waited:?}: {last}")]
    Unavailable {
        /// The job.
        job: String,
        /// How long the call tried.
        waited: Duration,
        /// The last error seen.
        last: String,
    },
    /// The master answered with an error that retrying will not fix.
    #[error("master refused: {0}")]
    Refused(tonic::Status),
    /// The client was cancelled.
    #[error("cancelled")]
    Cancelled,
}

impl ClientError {
    /// The report named an old generation: the task was taken away (re-dispatched after
    /// a timeout, a lost registration or a failover). Drop it.
    pub fn is_stale(&self) -> bool {
        matches!(self, ClientError::Refused(s) if s.code() == Code::Aborted)
    }

    /// The gRPC code of a refusal.
    pub fn code(&self) -> Option<Code> {
        match self {
            ClientError::Refused(s) => Some(s.code()),
            _ => None,
        }
    }
}

/// How a dataset is cut into tasks (the unit of work a trainer leases).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskSize {
    /// Consecutive chunks of a file per task (0: the master's default).
    Chunks(u32),
    /// Sized by samples: the fewest consecutive chunks of a file holding `records`
    /// records, lowered so that a pass has at least 32 tasks, but never below `floor`
    /// (the job's batch size).
    Records {
        /// The records asked for per task.
        records: u64,
        /// The fewest records a task is lowered to (0: 1).
        floor: u64,
    },
}

/// Client settings.
#[derive(Clone, Debug)]
pub struct MasterClientConfig {
    /// The job.
    pub job: JobName,
    /// The job token, if the job has one.
    pub token: Option<String>,
    /// How long one call keeps retrying across failovers before giving up.
    pub retry_for: Duration,
    /// Connect timeout to a master.
    pub connect_timeout: Duration,
    /// Per-attempt deadline of short calls.
    pub call_timeout: Duration,
    /// Dial masters over TLS; `None`: plain HTTP/2.
    pub tls: Option<edl_proto::tls::Tls>,
}

impl MasterClientConfig {
    /// Defaults for job `job`: retry for 60 s, connect 3 s, calls 10 s.
    pub fn new(job: JobName) -> Self {
        MasterClientConfig {
            job,
            token: None,
            retry_for: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(3),
            call_timeout: Duration::from_secs(10),
            tls: None,
        }
    }
}

/// The cached connection: the leader's address and a client on it.
type Conn = Arc<Mutex<Option<(String, GrpcClient<Channel>)>>>;

/// A client of the job's leading master.
#[derive(Clone, Debug)]
pub struct MasterClient {
    cfg: Arc<MasterClientConfig>,
    leader: watch::Receiver<Option<LeaderInfo>>,
    conn: Conn,
    cancel: CancellationToken,
}

impl MasterClient {
    /// A client that follows the master election of `cfg.job` through `backend`.
    pub fn new(
        backend: Arc<dyn Backend>,
        cfg: MasterClientConfig,
        cancel: CancellationToken,
    ) -> Self {
        let leader = observe_leader(backend, &cfg.job, cancel.child_token());
        MasterClient {
            cfg: Arc::new(cfg),
            leader,
            conn: Arc::new(Mutex::new(None)),
            cancel,
        }
    }

    /// The leader's address, waiting (bounded by `until`) for one to be elected.
    async fn leader_addr(&self, until: Instant) -> Option<String> {
        let mut rx = self.leader.clone();
        loop {
            if let Some(l) = rx.borrow_and_update().as_ref() {
                return Some(String::from_utf8_lossy(&l.value).into_owned());
            }
            tokio::select! {
                _ = self.cancel.cancelled() => return None,
                _ = tokio::time::sleep_until(until) => return None,
                r = rx.changed() => if r.is_err() { return None },
            }
        }
    }

    async fn client(&self, until: Instant) -> Result<GrpcClient<Channel>, String> {
        let Some(addr) = self.leader_addr(until).await else {
            return Err("no master is leading".into());
        };
        let mut conn = self.conn.lock().await;
        if let Some((a, c)) = conn.as_ref()
            && *a == addr
        {
            return Ok(c.clone());
        }
        let endpoint = edl_proto::tls::endpoint(&addr, self.cfg.tls.as_ref())
            .map_err(|e| format!("master at {addr:?}: {e}"))?
            .connect_timeout(self.cfg.connect_timeout)
            .tcp_nodelay(true);
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| format!("connect to master {addr}: {e}"))?;
        let client = GrpcClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        *conn = Some((addr, client.clone()));
        Ok(client)
    }

    fn request<T>(&self, msg: T, timeout: Duration) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        req.set_timeout(timeout);
        headers::set_credentials(
            req.metadata_mut(),
            self.cfg.job.as_str(),
            self.cfg.token.as_deref(),
        );
        req
    }

    /// Runs `op` against the leader, retrying across failovers until `retry_for` ends.
    async fn call<T, R, F, Fut>(&self, msg: T, timeout: Duration, op: F) -> Result<R, ClientError>
    where
        T: Clone,
        F: Fn(GrpcClient<Channel>, tonic::Request<T>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<R>, tonic::Status>>,
    {
        let r = call_until(self.cfg.retry_for, &self.cancel, |until| {
            let (op, msg) = (&op, &msg);
            async move {
                match self.client(until).await {
                    Ok(c) => match op(c, self.request(msg.clone(), timeout)).await {
                        Ok(resp) => Attempt::Done(resp.into_inner()),
                        // Paused (etcd full) or loading the queue: a master leads and
                        // says so; wait for as long as it lasts.
                        Err(s)
                            if matches!(
                                headers::detail(&s, headers::ERROR_KIND),
                                Some(headers::KIND_PAUSED | headers::KIND_LOADING)
                            ) =>
                        {
                            Attempt::Paused(s.message().to_owned())
                        }
                        Err(s) if headers::transient(&s) => {
                            // Reconnect: the leader may have moved.
                            *self.conn.lock().await = None;
                            Attempt::Retry(format!("{}: {}", s.code(), s.message()))
                        }
                        Err(s) => Attempt::Fail(ClientError::Refused(s)),
                    },
                    Err(e) => Attempt::Retry(e),
                }
            }
        })
        .await;
        r.map_err(|e| match e {
            CallError::Failed(e) => e,
            CallError::Cancelled => ClientError::Cancelled,
            CallError::GaveUp { waited, last } => ClientError::Unavailable {
                job: self.cfg.job.to_string(),
                waited,
                last,
            },
        })
    }

    /// Defines the dataset with tasks of `chunks_per_task` chunks (0: the master's
    /// default), or checks it is the same.
    pub async fn set_dataset(
        &self,
        globs: Vec<String>,
        chunks_per_task: u32,
        passes: u32,
    ) -> Result<pb::SetDatasetResponse, ClientError> {
        self.set_dataset_sized(globs, TaskSize::Chunks(chunks_per_task), passes)
            .await
    }

    /// Defines the dataset with tasks of `size`, or checks it is the same.
    pub async fn set_dataset_sized(
        &self,
        globs: Vec<String>,
        size: TaskSize,
        passes: u32,
    ) -> Result<pb::SetDatasetResponse, ClientError> {
        let (chunks_per_task, records_per_task, min_records_per_task) = match size {
            TaskSize::Chunks(n) => (n, 0, 0),
            TaskSize::Records { records, floor } => (0, records, floor),
        };
        let msg = pb::SetDatasetRequest {
            globs,
            chunks_per_task,
            passes,
            records_per_task,
            min_records_per_task,
        };
        // Indexing a large dataset takes a while.
        let timeout = self.cfg.call_timeout.max(Duration::from_secs(120));
        self.call(
            msg,
            timeout,
            |mut c, r| async move { c.set_dataset(r).await },
        )
        .await
    }

    /// Asks for a task of `pass`, long-polling up to `wait`; `goodput`: where the
    /// trainer's time went so far, if it measures it.
    pub async fn get_task(
        &self,
        trainer: &str,
        pass: u32,
        request_id: u64,
        wait: Duration,
        goodput: Option<&Goodput>,
    ) -> Result<Answer, ClientError> {
        let msg = pb::GetTaskRequest {
            trainer: trainer.to_owned(),
            pass,
            request_id,
            wait_ms: wait.as_millis().min(u128::from(u32::MAX)) as u32,
            goodput: goodput.map(pb::Goodput::from),
        };
        let timeout = self.cfg.call_timeout + wait;
        let resp = self
            .call(msg, timeout, |mut c, r| async move { c.get_task(r).await })
            .await?;
        Ok(resp.into())
    }

    /// Reports a task's records trained, recorded as done by `incarnations` of the
    /// pserver shards (empty: no pservers); `Ok(false)` if it was already reported.
    pub async fn task_finished(
        &self,
        trainer: &str,
        task: &LeasedTask,
        records: u64,
        incarnations: &[u64],
    ) -> Result<bool, ClientError> {
        let msg = pb::TaskFinishedRequest {
            trainer: trainer.to_owned(),
            task_id: task.id.clone(),
            generation: task.generation,
            records,
            shard_incarnations: incarnations.to_vec(),
        };
        let r = self
            .call(msg, self.cfg.call_timeout, |mut c, r| async move {
                c.task_finished(r).await
            })
            .await?;
        Ok(r.applied)
    }

    /// Reports a task that could not be processed.
    pub async fn task_failed(
        &self,
        trainer: &str,
        task: &LeasedTask,
        reason: &str,
        records_trained: u64,
    ) -> Result<bool, ClientError> {
        // The master refuses a longer reason (and keeps only its start).
        let mut end = reason.len().min(MAX_REASON_WIRE_BYTES);
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        let msg = pb::TaskFailedRequest {
            trainer: trainer.to_owned(),
            task_id: task.id.clone(),
            generation: task.generation,
            reason: reason[..end].to_owned(),
            records_trained,
        };
        let r = self
            .call(msg, self.cfg.call_timeout, |mut c, r| async move {
                c.task_failed(r).await
            })
            .await?;
        Ok(r.applied)
    }

    /// Hands a task back: not a failure (draining, or trained but lacking in a pserver
    /// shard restored meanwhile: see [`Release`]).
    pub async fn release_task(
        &self,
        trainer: &str,
        task: &LeasedTask,
        how: &Release,
    ) -> Result<bool, ClientError> {
        let msg = how.request(trainer, task);
        let r = self
            .call(msg, self.cfg.call_timeout, |mut c, r| async move {
                c.release_task(r).await
            })
            .await?;
        Ok(r.applied)
    }

    /// Says that trainer `trainer` is alive and waiting on a pserver or the master, not
    /// stuck: the master renews the leases of the tasks it holds; how many it holds.
    pub async fn keep_tasks(&self, trainer: &str) -> Result<u32, ClientError> {
        let msg = pb::KeepTasksRequest {
            trainer: trainer.to_owned(),
        };
        let r = self
            .call(msg, self.cfg.call_timeout, |mut c, r| async move {
                c.keep_tasks(r).await
            })
            .await?;
        Ok(r.kept)
    }

    /// The queue's state.
    pub async fn status(&self) -> Result<pb::StatusResponse, ClientError> {
        self.call(
            pb::StatusRequest {},
            self.cfg.call_timeout,
            |mut c, r| async move { c.status(r).await },
        )
        .await
    }
}

/// A watch of the leading master's address (for clients).
pub fn observe_leader(
    backend: Arc<dyn Backend>,
    job: &JobName,
    cancel: CancellationToken,
) -> watch::Receiver<Option<edl_coord::LeaderInfo>> {
    Election::new(backend, JobKeys::new(job).master_election()).observe(cancel)
}
