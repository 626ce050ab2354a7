//! Pushes to every shard in parallel: gradients clipped as the optimizer config says,
//! cut into the shards' blocks and rows, sent (over the bulk path when the pserver offers
//! it) and, in sync mode, asked again until the step is applied; and `Leave`.

use std::time::Duration;

use edl_proto::pserver as pb;
use futures::future::join_all;
use tokio::time::Instant;

use crate::error::ErrorKind;
use crate::layout::Mode;
use crate::optim::ClipPlan;
use crate::retry::{Attempt, push_refusal};
use crate::{Origin, PsClient, PsClientError, Result};

use crate::wire;
use edl_job::valid_member_id;

/// Gradients of rows of a sparse table.
#[derive(Debug, Clone, Copy)]
pub struct SparsePush<'a> {
    /// The table.
    pub table: &'a str,
    /// Row ids (repeats are summed).
    pub rows: &'a [u64],
    /// `rows.len() * dim` values, row after row.
    pub values: &'a [f32],
}

/// What a push did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushOutcome {
    /// Sync: the step the gradients were applied in. Async: the step pushed.
    pub step: u64,
    /// False when every shard had already applied it (a retried push).
    pub applied: bool,
    /// Per shard, the incarnation that answered (0: the push did not go to that shard).
    pub incarnations: Vec<u64>,
    /// Async: per shard, the shard's update count once it applied this push (0: the push
    /// did not go to that shard, or the shard had applied it before). Sync: zeros.
    pub updates: Vec<u64>,
}

/// Where the first NaN or infinite value of a push is, if any.
fn non_finite(dense: &[(&str, &[f32])], sparse: &[SparsePush<'_>]) -> Option<String> {
    // The common case (all finite) in one vectorised pass per array; the position only
    // when there is one to report.
    let first = |v: &[f32]| {
        if crate::wire::floats_finite(v) {
            None
        } else {
            v.iter().position(|x| !x.is_finite())
        }
    };
    dense
        .iter()
        .find_map(|(name, g)| first(g).map(|i| format!("parameter {name:?} (value {i}: {})", g[i])))
        .or_else(|| {
            sparse.iter().find_map(|s| {
                first(s.values).map(|i| format!("table {:?} (value {i}: {})", s.table, s.values[i]))
            })
        })
}

impl PsClient {
    /// Pushes the gradients of one step of `trainer` to every shard in parallel.
    ///
    /// The gradients are clipped first as the optimizer config says (by value, then by
    /// the global norm of everything pushed here). A parameter left out contributes
    /// nothing (in sync mode it still counts this trainer in the step's divisor).
    ///
    /// - Async mode: `step` is this trainer's own counter, a different value for each
    ///   push of this client (a retry reuses it); returns once every shard applied it.
    ///   A push more than the pserver's `DEDUP_WINDOW` steps behind this client's newest
    ///   is refused ([`ErrorKind::TooOld`]): whether it was applied can no longer be told.
    /// - Sync mode: `step` is the global step (from [`PullStats::next_step`], or the
    ///   previous outcome's step plus one); returns once every shard applied the step, or
    ///   [`PsClientError::StaleStep`] when the step was closed without this trainer (pull,
    ///   then push `next`). The trainer must be registered under `trainers/`. A shard that
    ///   keeps its step open longer than `retry_for` plus twice the step timeout (it
    ///   should have closed it by then) fails the push with
    ///   [`PsClientError::Unavailable`].
    ///
    /// Retrying a push (same client, trainer and step) never applies it twice.
    ///
    /// Gradients with a NaN or infinite value are refused whole before anything is sent
    /// ([`PsClientError::NonFinite`]): no shard applies any part of them.
    ///
    /// [`ErrorKind::TooOld`]: crate::error::ErrorKind::TooOld
    /// [`PullStats::next_step`]: super::PullStats::next_step
    pub async fn push(
        &self,
        trainer: &str,
        step: u64,
        dense: &[(&str, &[f32])],
        sparse: &[SparsePush<'_>],
    ) -> Result<PushOutcome> {
        self.push_from(trainer, step, None, dense, sparse).await
    }

    /// [`push`](Self::push) of the gradients of one batch of a task: `origin` names the
    /// batch (pass, task index, batch number within the task). Every shard's ledger
    /// applies a batch at most once, whichever trainer sends it and however often (a
    /// retry, a sync step it missed, a task trained again after its trainer was lost or a
    /// shard restored), so the push goes to every shard, with empty gradients where
    /// the batch has none for it. After a task's last push, call
    /// [`task_done`](Self::task_done) with the incarnations the pushes reported.
    pub async fn push_from(
        &self,
        trainer: &str,
        step: u64,
        origin: Option<Origin>,
        dense: &[(&str, &[f32])],
        sparse: &[SparsePush<'_>],
    ) -> Result<PushOutcome> {
        if !valid_member_id(trainer) {
            return Err(PsClientError::InvalidArgument(format!(
                "trainer id {trainer:?} must be non-empty and contain no '/'"
            )));
        }
        let layout = self.layout().await?;
        let spec = layout.spec();
        let sync = spec.config.mode.is_sync();
        let plan: ClipPlan = spec.config.optimizer.clip.plan(
            dense
                .iter()
                .map(|(_, g)| *g)
                .chain(sparse.iter().map(|s| s.values)),
        );
        let n = self.inner.shards as usize;
        let mut reqs: Vec<pb::PushRequest> = (0..n)
            .map(|s| pb::PushRequest {
                shard: s as u32,
                shards: self.inner.shards,
                trainer: trainer.to_owned(),
                session: self.inner.session,
                step,
                dense: Vec::new(),
                sparse: Vec::new(),
                wait_ms: self
                    .inner
                    .cfg
                    .sync_wait
                    .as_millis()
                    .min(u128::from(u32::MAX)) as u32,
                origin: origin.map(|o| pb::TaskOrigin {
                    pass: o.pass,
                    task: o.task,
                    seq: o.seq,
                    count: o.count,
                }),
            })
            .collect();
        let mut finite = true;
        for (name, grad) in dense {
            let Some(p) = layout.param_index(name) else {
                return Err(PsClientError::InvalidArgument(format!(
                    "unknown parameter {name:?}"
                )));
            };
            let want = spec.dense[p].numel().unwrap_or(0);
            if grad.len() != want {
                return Err(PsClientError::InvalidArgument(format!(
                    "gradient of {name:?} has {} values, the parameter has {want}",
                    grad.len()
                )));
            }
            for b in layout.param_blocks(p) {
                let (values, ok) = wire::encode_clipped(&grad[b.offset..b.offset + b.len], &plan);
                finite &= ok;
                reqs[b.shard as usize].dense.push(pb::DenseBlock {
                    id: b.id,
                    version: 0,
                    values,
                });
            }
        }
        for g in sparse {
            let Some(t) = layout.table_index(g.table) else {
                return Err(PsClientError::InvalidArgument(format!(
                    "unknown table {:?}",
                    g.table
                )));
            };
            let dim = spec.sparse[t].dim;
            if Some(g.values.len()) != g.rows.len().checked_mul(dim) {
                return Err(PsClientError::InvalidArgument(format!(
                    "table {:?}: {} values for {} rows of {dim}",
                    g.table,
                    g.values.len(),
                    g.rows.len()
                )));
            }
            let mut rows: Vec<Vec<u64>> = vec![Vec::new(); n];
            let mut vals: Vec<Vec<f32>> = vec![Vec::new(); n];
            for (i, &r) in g.rows.iter().enumerate() {
                let s = layout.row_shard(r) as usize;
                rows[s].push(r);
                vals[s].extend_from_slice(&g.values[i * dim..(i + 1) * dim]);
            }
            for (s, (rows, vals)) in rows.into_iter().zip(vals).enumerate() {
                if !rows.is_empty() {
                    let (values, ok) = wire::encode_clipped(&vals, &plan);
                    finite &= ok;
                    reqs[s].sparse.push(pb::SparseRows {
                        table: t as u32,
                        rows,
                        values,
                    });
                }
            }
        }
        // A shard refuses a non-finite gradient whole, but another shard would apply its
        // part: refuse the push here, before any shard is sent anything. The encoding
        // checked every value on its way; where one is not finite is found only then.
        if !finite {
            let what = non_finite(dense, sparse).unwrap_or_default();
            return Err(PsClientError::NonFinite(what));
        }
        let timeout = self.inner.cfg.call_timeout + self.inner.cfg.sync_wait;
        let give_up = self.sync_push_budget(&spec.config.mode);
        let sends = reqs
            .into_iter()
            .filter(|r| sync || origin.is_some() || !r.dense.is_empty() || !r.sparse.is_empty())
            .map(|req| async move {
                let shard = req.shard;
                let mut applied = false;
                let start = Instant::now();
                let give_up = start.checked_add(give_up);
                loop {
                    let resp = self
                        .call(
                            shard,
                            req.clone(),
                            timeout,
                            |t, r| async move {
                                match &t.bulk {
                                    Some(b) => b
                                        .push(r.into_inner(), timeout)
                                        .await
                                        .map(tonic::Response::new),
                                    None => t.grpc.clone().push(r).await,
                                }
                            },
                            |st| push_refusal(st, shard, step, sync),
                        )
                        .await?;
                    applied |= resp.applied;
                    if resp.done {
                        return Ok::<_, PsClientError>((
                            shard,
                            resp.step,
                            applied,
                            resp.incarnation,
                        ));
                    }
                    // Sync: the step is still open; ask again (an idempotent wait; the
                    // gradients travel again, since a replacement pserver may not have
                    // them), unless the pserver should long have closed it.
                    let now = Instant::now();
                    if give_up.is_some_and(|g| now >= g) {
                        return Err(PsClientError::Unavailable {
                            job: self.inner.cfg.job.to_string(),
                            shard,
                            waited: now - start,
                            last: format!(
                                "sync step {} still not applied (the pserver keeps answering \
                                 that it is open; its step timeout should have closed it)",
                                resp.step.max(step)
                            ),
                        });
                    }
                }
            });
        let mut outcome = PushOutcome {
            step,
            applied: false,
            incarnations: vec![0; n],
            updates: vec![0; n],
        };
        let mut first_err = None;
        for r in join_all(sends).await {
            match r {
                Ok((shard, s, applied, incarnation)) => {
                    if sync {
                        outcome.step = s;
                    }
                    outcome.applied |= applied;
                    if let Some(slot) = outcome.incarnations.get_mut(shard as usize) {
                        *slot = incarnation;
                    }
                    if !sync
                        && applied
                        && let Some(slot) = outcome.updates.get_mut(shard as usize)
                    {
                        *slot = s;
                    }
                }
                Err(e) => {
                    if first_err.is_none() {
                        first_err = Some(e);
                    }
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(outcome),
        }
    }

    /// Sync mode: how long one push waits for its step before it gives up: `retry_for`,
    /// plus what a live pserver may take to close the step (twice the step timeout: the
    /// step before it may still be open, then its own; and one server-side wait).
    fn sync_push_budget(&self, mode: &Mode) -> Duration {
        let step_timeout = match mode {
            Mode::Sync { step_timeout_ms } => Duration::from_millis(*step_timeout_ms),
            Mode::Async => Duration::ZERO,
        };
        self.inner
            .cfg
            .retry_for
            .saturating_add(step_timeout.saturating_mul(2))
            .saturating_add(self.inner.cfg.sync_wait)
    }

    /// Every push of task `task` of pass `pass` (of a dataset of `tasks` tasks) was
    /// applied: each shard records the task as contained. `incarnations` holds, per
    /// shard, the oldest incarnation that answered a push of the task (see
    /// [`PushOutcome::incarnations`]). Returns each shard's incarnation, for the
    /// master's acknowledgement; [`PsClientError::Rewound`] when a shard was restored
    /// since it answered (the task must be trained again).
    pub async fn task_done(
        &self,
        trainer: &str,
        pass: u32,
        task: u32,
        tasks: u32,
        incarnations: &[u64],
    ) -> Result<Vec<u64>> {
        if incarnations.len() != self.inner.shards as usize {
            return Err(PsClientError::InvalidArgument(format!(
                "{} incarnations for {} shards",
                incarnations.len(),
                self.inner.shards
            )));
        }
        let calls = (0..self.inner.shards).map(|s| {
            let msg = pb::TaskDoneRequest {
                shard: s,
                shards: self.inner.shards,
                trainer: trainer.to_owned(),
                pass,
                task,
                tasks,
                incarnation: incarnations[s as usize],
            };
            self.call(
                s,
                msg,
                self.inner.cfg.call_timeout,
                |t, r| async move { t.grpc.clone().task_done(r).await },
                // A shard restored with nothing since (it holds no parameters) lacks
                // the task's pushes as a rewound one does.
                move |st| {
                    matches!(
                        ErrorKind::of(st),
                        Some(ErrorKind::Rewound | ErrorKind::Uninitialised)
                    )
                    .then(|| {
                        Attempt::Fail(PsClientError::Rewound {
                            shard: s,
                            msg: st.message().to_owned(),
                        })
                    })
                },
            )
        });
        let mut out = Vec::with_capacity(incarnations.len());
        let mut first_err = None;
        for r in join_all(calls).await {
            match r {
                Ok(resp) => out.push(resp.incarnation),
                Err(e) => {
                    out.push(0);
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// Sync mode: `trainer` stops taking part in steps (until its next push), so the
    /// steps of the others do not wait for it (call it when a trainer runs out of work).
    pub async fn leave(&self, trainer: &str) -> Result<()> {
        let calls = (0..self.inner.shards).map(|s| {
            let msg = pb::LeaveRequest {
                shard: s,
                shards: self.inner.shards,
                trainer: trainer.to_owned(),
            };
            self.call(
                s,
                msg,
                self.inner.cfg.call_timeout,
                |t, r| async move { t.grpc.clone().leave(r).await },
                // A shard with no parameters has no steps to leave.
                |st| {
                    (ErrorKind::of(st) == Some(ErrorKind::Uninitialised))
                        .then(|| Attempt::Done(pb::LeaveResponse::default()))
                },
            )
        });
        for r in join_all(calls).await {
            r?;
        }
        Ok(())
    }
}
