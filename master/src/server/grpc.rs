//! The gRPC adapter over the leader's actor: checks each request's bounds, forwards it,
//! and answers a standby's calls with the leader's address; and `/metrics`.

use std::sync::Arc;
use std::time::Duration;

use edl_master_api::{Goodput, Release};
use edl_proto::master as pb;
use tonic::{Request, Response, Status};

use super::{MAX_GOODPUT_TRAINERS, MAX_MESSAGE_BYTES, MAX_REASON_WIRE_BYTES, MasterConfig, Shared};
use crate::core::{CoreHandle, StatusReport};
use crate::dataset::DatasetSpec;
use crate::error::MasterError;
use crate::queue::bounded_reason;

/// The gRPC adapter over the actor.
#[derive(Debug, Clone)]
pub struct MasterGrpc {
    pub(super) shared: Arc<Shared>,
    pub(super) job: String,
    pub(super) default_chunks_per_task: u32,
}

impl MasterGrpc {
    /// Keeps trainer `trainer`'s latest goodput for `Status` (one with a negative or
    /// non-finite value is dropped; a new trainer beyond [`MAX_GOODPUT_TRAINERS`] too).
    fn keep_goodput(&self, trainer: &str, g: Goodput) {
        if !g.is_valid() {
            return;
        }
        let mut kept = self
            .shared
            .goodput
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(old) = kept.get_mut(trainer) {
            *old = g;
        } else if kept.len() < MAX_GOODPUT_TRAINERS {
            kept.insert(trainer.to_owned(), g);
        }
    }

    async fn core(&self) -> Result<CoreHandle, Status> {
        if let Some(h) = self.shared.core.read().await.clone() {
            return Ok(h);
        }
        if let Some(since) = *self.shared.loading.read().await {
            let s = since.elapsed().as_secs();
            return Err(MasterError::Loading(format!("for {s} s so far")).into());
        }
        let leader = self.shared.leader.read().await.clone();
        Err(MasterError::NotLeader { leader }.into())
    }
}

/// Most pserver shards of a job (`cluster.pservers`), so most shard incarnations in a
/// report.
pub const MAX_SHARDS: usize = edl_job::spec::MAX_PSERVERS as usize;
/// Longest task id a report may carry (the master's ids are far shorter).
pub const MAX_TASK_ID_BYTES: usize = 256;

/// The trainer and task id of a report: a member id, and a bounded id.
fn check_report(trainer: &str, task_id: &str) -> Result<(), MasterError> {
    if !edl_job::valid_member_id(trainer) {
        return Err(MasterError::InvalidArgument(format!(
            "trainer id {:?} is not a member id (1 to 200 characters, no '/')",
            bounded_reason(trainer)
        )));
    }
    if task_id.len() > MAX_TASK_ID_BYTES {
        return Err(MasterError::InvalidArgument(format!(
            "a task id of {} bytes; at most {MAX_TASK_ID_BYTES}",
            task_id.len()
        )));
    }
    Ok(())
}

#[tonic::async_trait]
impl pb::master_server::Master for MasterGrpc {
    async fn set_dataset(
        &self,
        req: Request<pb::SetDatasetRequest>,
    ) -> Result<Response<pb::SetDatasetResponse>, Status> {
        let r = req.into_inner();
        let spec = DatasetSpec {
            globs: r.globs,
            chunks_per_task: match r.chunks_per_task {
                0 => self.default_chunks_per_task,
                n => n,
            },
            records_per_task: r.records_per_task,
            min_records_per_task: r.min_records_per_task,
            passes: r.passes.max(1),
        };
        let (ds, created) = self.core().await?.set_dataset(spec).await?;
        Ok(Response::new(pb::SetDatasetResponse {
            files: ds.files.len() as u32,
            tasks: ds.tasks,
            records: ds.records,
            created,
        }))
    }

    async fn get_task(
        &self,
        req: Request<pb::GetTaskRequest>,
    ) -> Result<Response<pb::GetTaskResponse>, Status> {
        let r = req.into_inner();
        // The id is stored in the task record: a member id is bounded.
        if !edl_job::valid_member_id(&r.trainer) {
            return Err(MasterError::InvalidArgument(format!(
                "trainer id {:?} is not a member id (1 to 200 characters, no '/')",
                bounded_reason(&r.trainer)
            ))
            .into());
        }
        let wait = Duration::from_millis(u64::from(r.wait_ms));
        let core = self.core().await?;
        if let Some(g) = &r.goodput {
            self.keep_goodput(&r.trainer, Goodput::from(g));
        }
        let reply = core.get_task(r.trainer, r.pass, r.request_id, wait).await?;
        Ok(Response::new(reply.into()))
    }

    async fn task_finished(
        &self,
        req: Request<pb::TaskFinishedRequest>,
    ) -> Result<Response<pb::TaskReportResponse>, Status> {
        let r = req.into_inner();
        check_report(&r.trainer, &r.task_id)?;
        // One incarnation per pserver shard; stored with the task.
        if r.shard_incarnations.len() > MAX_SHARDS {
            return Err(MasterError::InvalidArgument(format!(
                "{} shard incarnations; a job has at most {MAX_SHARDS} pserver shards",
                r.shard_incarnations.len()
            ))
            .into());
        }
        let applied = self
            .core()
            .await?
            .finished(r.task_id, r.generation, r.records, r.shard_incarnations)
            .await?;
        Ok(Response::new(pb::TaskReportResponse { applied }))
    }

    async fn task_failed(
        &self,
        req: Request<pb::TaskFailedRequest>,
    ) -> Result<Response<pb::TaskReportResponse>, Status> {
        let r = req.into_inner();
        check_report(&r.trainer, &r.task_id)?;
        if r.reason.len() > MAX_REASON_WIRE_BYTES {
            return Err(MasterError::InvalidArgument(format!(
                "a failure reason of {} bytes; at most {MAX_REASON_WIRE_BYTES} (the client cuts \
                 longer ones: an up-to-date client never sends one)",
                r.reason.len()
            ))
            .into());
        }
        // Only the bounded form goes further (the record, the log).
        let reason = if r.reason.is_empty() {
            format!("failed on trainer {}", r.trainer)
        } else {
            bounded_reason(&r.reason)
        };
        let applied = self
            .core()
            .await?
            .failed(r.task_id, r.generation, reason, r.records_trained)
            .await?;
        Ok(Response::new(pb::TaskReportResponse { applied }))
    }

    async fn release_task(
        &self,
        req: Request<pb::ReleaseTaskRequest>,
    ) -> Result<Response<pb::TaskReportResponse>, Status> {
        let r = req.into_inner();
        check_report(&r.trainer, &r.task_id)?;
        let applied = self
            .core()
            .await?
            .release(r.task_id.clone(), r.generation, Release::from(&r))
            .await?;
        Ok(Response::new(pb::TaskReportResponse { applied }))
    }

    async fn keep_tasks(
        &self,
        req: Request<pb::KeepTasksRequest>,
    ) -> Result<Response<pb::KeepTasksResponse>, Status> {
        let r = req.into_inner();
        check_report(&r.trainer, "")?;
        let kept = self.core().await?.keep(r.trainer).await?;
        Ok(Response::new(pb::KeepTasksResponse { kept }))
    }

    async fn status(
        &self,
        _req: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        let s = self.core().await?.status().await?;
        let leader = self.shared.leader.read().await.clone().unwrap_or_default();
        let mut resp = status_to_pb(&self.job, leader, s);
        resp.goodput = self
            .shared
            .goodput
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|(trainer, g)| pb::TrainerGoodput {
                trainer: trainer.clone(),
                goodput: Some(pb::Goodput::from(g)),
            })
            .collect();
        Ok(Response::new(resp))
    }
}

/// The master's routes: the gRPC API, behind the job's credentials (job and token are
/// checked from the headers, before a request's body is decoded), and `/metrics`.
pub(super) fn router(grpc: MasterGrpc, cfg: &MasterConfig, shared: Arc<Shared>) -> axum::Router {
    let credentials = credentials(cfg);
    let svc = tonic::service::interceptor::InterceptedService::new(
        pb::master_server::MasterServer::new(grpc)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES),
        credentials,
    );
    tonic::service::Routes::new(svc)
        .into_axum_router()
        .merge(metrics_router(cfg, shared))
}

/// What the master's requests and scrapes must carry.
fn credentials(cfg: &MasterConfig) -> edl_proto::headers::Credentials {
    edl_proto::headers::Credentials::new("master", cfg.job.as_str(), cfg.token.clone())
        .with_metrics_token(cfg.metrics_token.clone())
}

/// `GET /metrics` of the master: on its gRPC port, and on `cfg.metrics_addr` when set.
pub(super) fn metrics_router(cfg: &MasterConfig, shared: Arc<Shared>) -> axum::Router {
    let credentials = credentials(cfg);
    let job = cfg.job.to_string();
    let snapshots = cfg.snapshots.is_some();
    axum::Router::new().route(
        "/metrics",
        axum::routing::get(move |headers: axum::http::HeaderMap| {
            let shared = shared.clone();
            let job = job.clone();
            let allowed = edl_proto::metrics::authorized(&credentials, &headers);
            async move {
                if !allowed {
                    return edl_proto::metrics::denied();
                }
                let core = shared.core.read().await.clone();
                // At most one report a second from the queue's actor, however often
                // it is scraped.
                let report = match core {
                    Some(h) => h.recent_status(Duration::from_secs(1)).await.ok(),
                    None => None,
                };
                let snapshots = snapshots.then_some(&shared.snapshots);
                edl_proto::metrics::answer(crate::metrics::render(&job, report.as_ref(), snapshots))
            }
        }),
    )
}

fn status_to_pb(job: &str, leader: String, s: StatusReport) -> pb::StatusResponse {
    let c = s.counters;
    pb::StatusResponse {
        job: job.to_owned(),
        leader,
        dataset_set: s.dataset_set,
        pass: s.pass,
        passes: s.passes,
        finished: s.finished,
        todo: s.counts.todo as u64,
        pending: s.counts.pending as u64,
        done: s.counts.done as u64,
        failed: s.counts.failed as u64,
        trainers: s.holders,
        counters: Some(pb::Counters {
            dispatched: c.dispatched,
            finished: c.finished,
            failures: c.failures,
            requeued: c.requeued,
            timeouts: c.timeouts,
            trainer_lost: c.trainer_lost,
            released: c.released,
            stale_rejected: c.stale_rejected,
            records_trained: c.records_trained,
            duplicate_records: c.duplicate_records,
            cutoff_records: c.cutoff_records,
            failed_tasks: c.failed_tasks,
            lost_records: c.lost_records,
            passes_completed: c.passes_completed,
            failovers: c.restores,
            recomputed: c.recomputed,
            recomputed_records: c.recomputed_records,
            resumed: c.resumed,
            resumed_records: c.resumed_records,
        }),
        failed_tasks: s
            .failed
            .into_iter()
            .map(|f| pb::FailedTask {
                pass: f.pass,
                id: f.id,
                records: f.records,
                reason: f.reason,
            })
            .collect(),
        timeout_ms: s.timeout_ms,
        total_records: s.total_records,
        paused: s.paused.unwrap_or_default(),
        stuck: s
            .stuck
            .into_iter()
            .map(|t| pb::StuckTrainer {
                trainer: t.trainer,
                task: t.task,
                held_ms: t.held_ms,
                ago_ms: t.ago_ms,
            })
            .collect(),
        // Kept beside the queue, not in it: filled by the caller.
        goodput: Vec::new(),
        leases_kept: s.leases_kept,
    }
}
