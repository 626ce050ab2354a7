//! The pserver's operations, whatever the transport (gRPC or the bulk path): checks of
//! the job, token and target shard, then the shard's logic on blocking threads, with the
//! requests and replies converted by `convert`.
//!
//! Invariant: the [`Gate`] is checked (the lease held by the pserver's own clock, no
//! shutdown asked) before an operation starts, again right before it answers when it
//! worked on a blocking thread or waited, and for a push right before it is applied, so
//! that a pserver that cannot be sure it still holds its shard (etcd unreachable past
//! the TTL, or the process paused: another pserver may have claimed it) answers
//! nothing meanwhile, and a pserver replaced while it was paused never answers again.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, Lease, LeaseState};
use edl_proto::pserver as pb;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::config::MAX_PUSH_WAIT;
use super::convert::{counters, init_blocks, pull_response, raw_push};
use super::membership::Members;
use super::replication::Replication;
use crate::error::PsError;
use crate::replica::Seq;
use crate::shard::{Shard, ShardCore};
use crate::sync::Admit;
use edl_job::{JobKeys, valid_member_id};

/// Serves only while the lease is held and no shutdown was asked.
#[derive(Debug)]
pub(super) struct Gate {
    pub(super) lease: Arc<Lease>,
    pub(super) stop: CancellationToken,
    pub(super) index: u32,
}

impl Gate {
    pub(super) fn check(&self) -> Result<(), PsError> {
        if self.stop.is_cancelled() {
            return Err(PsError::NotServing("shutting down".into()));
        }
        match self.lease.state() {
            LeaseState::Held => Ok(()),
            // Retryable (`Unavailable`): the clients wait and retry, here or at a
            // successor.
            LeaseState::Uncertain => Err(PsError::NotServing(format!(
                "the etcd lease of shard {} is not confirmed (etcd unreachable?); serving \
                 resumes once it is",
                self.index
            ))),
            LeaseState::Lost => Err(PsError::LeaseLost(self.index)),
        }
    }
}

/// The pserver's operations, whatever the transport (gRPC or the bulk path): checks,
/// then the shard's logic on blocking threads.
#[derive(Debug)]
pub(crate) struct Service {
    pub(super) shard: Arc<Shard>,
    pub(super) gate: Arc<Gate>,
    /// The push latencies `/metrics` reports.
    pub(super) metrics: super::metrics::PsMetrics,
    pub(super) job: String,
    pub(super) token: Option<String>,
    pub(super) members: Arc<Members>,
    pub(super) backend: Arc<dyn Backend>,
    pub(super) keys: JobKeys,
    pub(super) permits: Arc<Semaphore>,
    pub(super) max_message_bytes: usize,
    pub(super) io_timeout: Duration,
    /// This process's replica of the shard (a group of one unless the shard is
    /// replicated): trainers are served by the primary only, and answered once every
    /// in-sync replica holds what they changed.
    pub(super) replication: Arc<Replication>,
}

impl Service {
    /// Checks the job and token a request carries, and that we serve.
    pub(crate) fn authorize(&self, job: &str, token: Option<&str>) -> Result<(), PsError> {
        edl_proto::headers::Credentials::new("pserver", self.job.as_str(), self.token.clone())
            .check_values(job, token)
            .map_err(PsError::Unauthenticated)?;
        self.gate.check()
    }

    /// Whether we still serve (the lease is held and no shutdown was asked).
    pub(crate) fn serving(&self) -> Result<(), PsError> {
        self.gate.check()
    }

    /// This process's replica of the shard.
    pub(crate) fn replication(&self) -> Arc<Replication> {
        self.replication.clone()
    }

    /// The shard's index.
    pub(crate) fn shard_index(&self) -> u32 {
        self.shard.index()
    }

    /// Fires when the pserver stops serving.
    pub(crate) fn stopped(&self) -> &CancellationToken {
        &self.gate.stop
    }

    /// Largest request or response accepted.
    pub(crate) fn max_message_bytes(&self) -> usize {
        self.max_message_bytes
    }

    /// Longest a bulk-path peer may stall within a frame.
    pub(crate) fn io_timeout(&self) -> Duration {
        self.io_timeout
    }

    /// Runs CPU-bound work on a blocking thread, at most `workers` at once. The work runs
    /// to completion even if the caller stops waiting.
    async fn blocking<T, F>(&self, f: F) -> Result<T, PsError>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| PsError::NotServing("shutting down".into()))?;
        tokio::task::spawn_blocking(move || {
            let r = f();
            drop(permit);
            r
        })
        .await
        .map_err(|e| PsError::Internal(format!("worker thread failed: {e}")))
    }

    fn core(&self, shard: u32, shards: u32) -> Result<Arc<ShardCore>, PsError> {
        self.shard.check_target(shard, shards)?;
        // Not primary (yet: still restoring, say) before uninitialised: only the primary
        // knows whether the shard lacks its parameters.
        self.primary_only()?;
        let core = self.shard.core()?;
        if !core.has_stream() {
            // Every change of a primary goes to the stream, from the first.
            return Err(PsError::NotServing(format!(
                "shard {} is becoming primary here",
                self.shard.index()
            )));
        }
        Ok(core)
    }

    /// Waits until every in-sync replica holds op `seq` (or, with no op, everything
    /// applied so far: a retry found applied may wait on its op). A group of one holds
    /// an op once it applied it.
    async fn replicated(&self, seq: Option<Seq>) -> Result<(), PsError> {
        let rep = &self.replication;
        let seq = seq.unwrap_or_else(|| rep.last_assigned());
        rep.wait_acked(seq, MAX_PUSH_WAIT).await
    }

    /// Runs `f` (a change of the shard) on a blocking thread and returns its result with
    /// the seq the replication stream gave its op, if it made one.
    async fn changing<T, F>(&self, f: F) -> Result<(T, Option<Seq>), PsError>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        let rep = self.replication.clone();
        self.blocking(move || {
            Replication::take_last_seq();
            let t = f();
            let seq = Replication::take_last_seq();
            if let Some(seq) = seq {
                rep.local_applied(seq);
            }
            (t, seq)
        })
        .await
    }

    async fn is_registered(&self, trainer: &str) -> Result<bool, PsError> {
        if self.members.set.read().await.contains(trainer) {
            return Ok(true);
        }
        // The watch may lag a trainer that registered just now.
        if self
            .backend
            .get(&self.keys.trainer(trainer))
            .await?
            .is_some()
        {
            self.members.set.write().await.insert(trainer.to_owned());
            return Ok(true);
        }
        Ok(false)
    }

    /// Only the primary takes changes (`Init` included), once its duties started.
    fn primary_only(&self) -> Result<(), PsError> {
        if !self.replication.serving() {
            return Err(PsError::NotServing(format!(
                "this pserver does not hold shard {}'s primary",
                self.shard.index()
            )));
        }
        Ok(())
    }

    pub(crate) async fn init(&self, r: pb::InitRequest) -> Result<pb::InitResponse, PsError> {
        self.primary_only()?;
        if !valid_member_id(&r.trainer) {
            return Err(PsError::InvalidArgument(format!(
                "bad trainer id {:?}",
                r.trainer
            )));
        }
        let shard = self.shard.clone();
        let trainer = r.trainer.clone();
        let (already, missing) = self
            .blocking(move || {
                // The target before the spec, so that a request for another shard is told
                // so whatever its spec.
                shard.check_target(r.shard, r.shards)?;
                shard.init(init_blocks(r)?)
            })
            .await??;
        tracing::debug!(shard = self.shard.index(), trainer = %trainer, already, missing, "init blocks received");
        self.gate.check()?;
        Ok(pb::InitResponse {
            already_initialised: already,
            missing_blocks: missing,
        })
    }

    pub(crate) async fn finish_init(
        &self,
        r: pb::FinishInitRequest,
    ) -> Result<pb::FinishInitResponse, PsError> {
        self.shard.check_target(r.shard, r.shards)?;
        self.primary_only()?;
        let shard = self.shard.clone();
        let already = self.blocking(move || shard.finish_init()).await??;
        if !already {
            tracing::info!(shard = self.shard.index(), trainer = %r.trainer, "shard initialised");
        }
        self.gate.check()?;
        Ok(pb::FinishInitResponse {
            already_initialised: already,
        })
    }

    pub(crate) async fn push(&self, r: pb::PushRequest) -> Result<pb::PushResponse, PsError> {
        let arrived = Instant::now();
        let reply = self.push_now(r).await;
        if reply.is_ok() {
            self.metrics.push_answered(arrived.elapsed());
        }
        reply
    }

    async fn push_now(&self, r: pb::PushRequest) -> Result<pb::PushResponse, PsError> {
        // The request may have taken long to arrive (a large bulk push): check again that
        // we serve, and once more right before applying it.
        self.gate.check()?;
        let core = self.core(r.shard, r.shards)?;
        if core.is_sync() {
            return self.sync_push(core, r).await;
        }
        let gate = self.gate.clone();
        let raw = raw_push(r);
        let c = core.clone();
        let (reply, seq) = self
            .changing(move || {
                let push = c.validate_push(raw)?;
                gate.check()?;
                c.apply_async(&push)
            })
            .await?;
        let reply = reply?;
        self.replicated(seq).await?;
        self.gate.check()?;
        Ok(pb::PushResponse {
            applied: reply.applied,
            step: reply.step,
            done: true,
            next_step: 0,
            incarnation: core.incarnation(),
        })
    }

    async fn sync_push(
        &self,
        core: Arc<ShardCore>,
        req: pb::PushRequest,
    ) -> Result<pb::PushResponse, PsError> {
        let wait = Duration::from_millis(u64::from(req.wait_ms)).min(MAX_PUSH_WAIT);
        let deadline = Instant::now() + wait;
        let c = core.clone();
        let raw = raw_push(req);
        let push = Arc::new(self.blocking(move || c.validate_push(raw)).await??);
        if !self.is_registered(&push.trainer).await? {
            return Err(PsError::NotRegistered(push.trainer.clone()));
        }
        if !core.sync_members_seeded() {
            let set: BTreeSet<String> = self.members.set.read().await.iter().cloned().collect();
            let c = core.clone();
            self.blocking(move || c.sync_set_members(set)).await?;
        }
        core.sync_member_joined(&push.trainer);
        let mut closed = core.subscribe();
        loop {
            let (c, p, gate) = (core.clone(), push.clone(), self.gate.clone());
            let admit = self
                .blocking(move || {
                    gate.check()?;
                    c.sync_push(&p, Instant::now())
                })
                .await??;
            let (step, applied) = match admit {
                Admit::Join { step } => (step, true),
                Admit::InProgress { step } => (step, false),
                Admit::AlreadyApplied { step } => {
                    self.gate.check()?;
                    return Ok(pb::PushResponse {
                        applied: false,
                        step,
                        done: true,
                        next_step: core.next_step(),
                        incarnation: core.incarnation(),
                    });
                }
                Admit::Stale { next } => {
                    return Err(PsError::StaleStep {
                        step: push.step,
                        next,
                    });
                }
                Admit::OutOfRange { next } => {
                    return Err(PsError::InvalidArgument(crate::shard::out_of_range(
                        push.step, next,
                    )));
                }
                Admit::Wait => {
                    let changed = tokio::select! {
                        _ = self.gate.stop.cancelled() => return Err(PsError::NotServing("shutting down".into())),
                        _ = tokio::time::sleep_until(deadline) => false,
                        r = closed.changed() => r.is_ok(),
                    };
                    self.gate.check()?;
                    if !changed {
                        return Ok(pb::PushResponse {
                            applied: false,
                            step: push.step,
                            done: false,
                            next_step: core.next_step(),
                            incarnation: core.incarnation(),
                        });
                    }
                    continue;
                }
            };
            let reached = tokio::select! {
                _ = self.gate.stop.cancelled() => return Err(PsError::NotServing("shutting down".into())),
                _ = tokio::time::sleep_until(deadline) => None,
                r = closed.wait_for(|c| *c >= step) => Some(r.is_ok()),
            };
            let done = reached.unwrap_or_else(|| *closed.borrow() >= step);
            if done {
                let rep = &self.replication;
                // The step's op, or (closed before this primary's epoch) all applied.
                rep.wait_acked(
                    rep.step_seq(step).unwrap_or_else(|| rep.last_assigned()),
                    MAX_PUSH_WAIT,
                )
                .await?;
            }
            self.gate.check()?;
            return Ok(pb::PushResponse {
                applied,
                step,
                done,
                next_step: core.next_step(),
                incarnation: core.incarnation(),
            });
        }
    }

    pub(crate) async fn pull(&self, r: pb::PullRequest) -> Result<pb::PullResponse, PsError> {
        let core = self.core(r.shard, r.shards)?;
        let resp = self
            .blocking(move || core.pull(&r.known_versions, r.incarnation))
            .await?;
        self.gate.check()?;
        Ok(pull_response(resp))
    }

    pub(crate) async fn pull_sparse(
        &self,
        r: pb::PullSparseRequest,
    ) -> Result<pb::PullSparseResponse, PsError> {
        let core = self.core(r.shard, r.shards)?;
        // Room for the protobuf framing of the values.
        let max = self.max_message_bytes.saturating_sub(64);
        let values = self
            .blocking(move || core.pull_sparse(r.table, &r.rows, max))
            .await??;
        self.gate.check()?;
        Ok(pb::PullSparseResponse { values })
    }

    pub(crate) async fn leave(&self, r: pb::LeaveRequest) -> Result<pb::LeaveResponse, PsError> {
        let core = self.core(r.shard, r.shards)?;
        let trainer = r.trainer;
        let was = self.blocking(move || core.sync_leave(&trainer)).await?;
        self.gate.check()?;
        Ok(pb::LeaveResponse {
            was_participant: was,
        })
    }

    pub(crate) async fn task_done(
        &self,
        r: pb::TaskDoneRequest,
    ) -> Result<pb::TaskDoneResponse, PsError> {
        self.gate.check()?;
        if !valid_member_id(&r.trainer) {
            return Err(PsError::InvalidArgument(format!(
                "trainer id {:?} must be non-empty and contain no '/'",
                r.trainer
            )));
        }
        let core = self.core(r.shard, r.shards)?;
        let c = core.clone();
        let (done, seq) = self
            .changing(move || c.task_done(r.pass, r.task, r.tasks, r.incarnation))
            .await?;
        done?;
        self.replicated(seq).await?;
        self.gate.check()?;
        Ok(pb::TaskDoneResponse {
            incarnation: core.incarnation(),
        })
    }

    /// The shard's status, as its primary holds it (a replica that is not the primary
    /// yet, such as one still restoring the shard, refuses as not serving).
    pub(crate) fn status(&self) -> Result<pb::StatusResponse, PsError> {
        self.primary_only()?;
        let mut resp = pb::StatusResponse {
            job: self.job.clone(),
            shard: self.shard.index(),
            shards: self.shard.shards(),
            incarnation: self.shard.core().map_or(0, |c| c.incarnation() as i64),
            ..Default::default()
        };
        if let Ok(core) = self.shard.core() {
            let (blocks, rows) = core.sizes();
            let (participants, contributed) = core.sync_members();
            resp.initialised = true;
            resp.mode = core.spec().config.mode.name().into();
            resp.next_step = core.next_step();
            resp.updates = core.updates();
            resp.blocks = blocks as u32;
            resp.sparse_rows = rows;
            resp.participants = participants;
            resp.contributed = contributed;
            resp.restored_from = core.restored_from();
            let contains = core.contains();
            resp.passes_contained = contains.sealed;
            resp.tasks_contained_after = contains.complete.values().map(|b| b.count()).sum();
            resp.counters = Some(counters(&core.counters));
        }
        resp.last_checkpoint = self
            .shard
            .checkpoints()
            .last_written
            .load(std::sync::atomic::Ordering::Relaxed);
        Ok(resp)
    }
}
