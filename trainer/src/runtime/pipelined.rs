//! The runtime's side of the asynchronous pipeline ([`super::pipeline`]): it takes tasks
//! from [`Tasks`], prepares their groups on blocking threads (the next while the one
//! before is sent), sends them to the compute thread, and says how each task went once
//! the compute thread is done with it; a task is acknowledged in the background once
//! its last push is applied.

use std::sync::Arc;
use std::time::Instant;

use edl_master_client::task::LeasedTask;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::group::Groups;
use super::pipeline::{Done, EndHow, Fatal, LeaseKey, Pipeline, Work};
use super::{RuntimeConfig, TaskEnd, evaluate_pass};
use crate::goodput::{Bucket, GoodputClock, compute_bucket};
use crate::local_optim::LocalOptimizer;
use crate::model::{Model, Params};
use crate::progress::{Progress, RuntimeError};
use crate::store::{ParamStore, StoreError};
use crate::tasks::{Next, TaskData, Tasks};
use edl_job::spec::PerPush;

/// What the loop needs besides the tasks.
pub(super) struct Ctx<'a> {
    pub(super) model: &'a Arc<dyn Model>,
    pub(super) store: &'a Arc<dyn ParamStore>,
    pub(super) cfg: &'a RuntimeConfig,
    pub(super) shutdown: &'a CancellationToken,
    pub(super) progress: &'a watch::Sender<Progress>,
}

/// Trains every task of `tasks` through the pipeline until the job ends or a drain;
/// `params` is the evaluation's copy, `optimizer` the pservers' update rule run locally.
pub(super) async fn run(
    ctx: &Ctx<'_>,
    tasks: &mut Tasks,
    params: &mut Params,
    optimizer: LocalOptimizer,
) -> Result<(), RuntimeError> {
    ctx.store.pull_current(params).await?;
    let mut pipe = Pipeline::start(
        ctx.model.clone(),
        ctx.store.clone(),
        &ctx.cfg.trainer,
        params.dense.clone(),
        optimizer,
        (tasks.progress().steps, ctx.cfg.batch_size.max(1)),
        tasks.clock().clone(),
    )?;
    let driven = drive(ctx, tasks, params, &mut pipe).await;
    let closed = pipe.close().await;
    if let Ok(s) = &closed {
        tracing::info!(
            batches = s.batches,
            pushes = s.pushes,
            rebases = s.rebases,
            busy_s = format_args!("{:.3}", s.busy.as_secs_f64()),
            waited_push_s = format_args!("{:.3}", s.waited_push.as_secs_f64()),
            waited_work_s = format_args!("{:.3}", s.waited_work.as_secs_f64()),
            "compute thread"
        );
    }
    driven?;
    closed?;
    Ok(())
}

async fn drive(
    ctx: &Ctx<'_>,
    tasks: &mut Tasks,
    params: &mut Params,
    pipe: &mut Pipeline,
) -> Result<(), RuntimeError> {
    loop {
        while let Some(done) = pipe.try_done() {
            if settle_one(ctx, tasks, pipe, done).await? {
                return finish(ctx, tasks, pipe).await;
            }
        }
        let mut got: Option<Option<Done>> = None;
        let idle = pipe.in_compute == 0;
        let item = {
            let wait_done = async { got = Some(pipe.next_done().await) };
            tasks.next_unless(ctx.shutdown, wait_done, idle).await?
        };
        if let Some(done) = got {
            let Some(done) = done else {
                return Err(pipe.gone().await);
            };
            if settle_one(ctx, tasks, pipe, done).await? {
                return finish(ctx, tasks, pipe).await;
            }
            continue;
        }
        match item {
            Some(Next::Task(data)) => {
                let clock = tasks.clock().clone();
                if !feed(ctx, (pipe, &clock), data).await? {
                    // Drained mid-task: the rest is settled, then the loop ends.
                    return finish(ctx, tasks, pipe).await;
                }
            }
            Some(Next::PassFinished { ended, .. }) => {
                finish(ctx, tasks, pipe).await?;
                evaluate_pass(ctx.model, ctx.store, ctx.cfg, params, tasks, ended).await?;
                ctx.progress.send_replace(tasks.progress().clone());
            }
            Some(Next::JobFinished) => {
                finish(ctx, tasks, pipe).await?;
                let last = tasks.progress().pass;
                if tasks.progress().evals.last().is_none_or(|e| e.0 != last) {
                    evaluate_pass(ctx.model, ctx.store, ctx.cfg, params, tasks, last).await?;
                }
                return Ok(());
            }
            Some(Next::Drained | Next::Closed) | None => return finish(ctx, tasks, pipe).await,
        }
    }
}

/// Settles every task the compute thread has, then waits for its pushes to be applied.
async fn finish(ctx: &Ctx<'_>, tasks: &mut Tasks, pipe: &mut Pipeline) -> Result<(), RuntimeError> {
    while pipe.in_compute > 0 {
        let Some(done) = pipe.next_done().await else {
            return Err(pipe.gone().await);
        };
        settle_one(ctx, tasks, pipe, done).await?;
    }
    let _pushing = tasks.clock().span(Bucket::Communicating);
    pipe.flush().await?;
    Ok(())
}

/// Says how a task the compute thread is done with went; `true` when it was drained
/// (the loop stops taking tasks).
async fn settle_one(
    ctx: &Ctx<'_>,
    tasks: &mut Tasks,
    pipe: &mut Pipeline,
    done: Done,
) -> Result<bool, RuntimeError> {
    let state = tasks.progress_mut();
    state.steps += done.steps;
    state.skipped_batches += done.skipped;
    if let Some(loss) = done.last_loss {
        state.last_loss = loss;
    }
    if let Some(at) = done.first_push_at {
        state.first_step_at.get_or_insert(at);
    }
    if done.last_push_at.is_some() {
        state.last_step_at = done.last_push_at;
    }
    let task = Arc::unwrap_or_clone(done.task);
    let drained = match done.end {
        Err(Fatal::Model(e)) => return Err(e.into()),
        Err(Fatal::Store(e)) => return Err(StoreError::Unavailable(e).into()),
        Ok(TaskEnd::Trained(n)) => {
            let applied = pipe.applied_through(done.last_push, LeaseKey::of(&task));
            tasks.computed(task, n, done.started, applied).await?;
            false
        }
        Ok(TaskEnd::Drained {
            records,
            next_batch,
        }) => {
            pipe.flush().await?;
            let at = super::resume_at(next_batch, ctx.cfg.batch_size);
            tasks.hand_back(&task, records, at).await?;
            true
        }
        Ok(TaskEnd::BadData(reason, n)) => {
            pipe.flush().await?;
            tasks.fail(&task, &reason, n).await?;
            false
        }
    };
    ctx.progress.send_replace(tasks.progress().clone());
    Ok(drained)
}

/// Batches prepared per group when the compute thread cuts the pushes (adaptive): a
/// few, so that preparing them costs one hand-off to a blocking thread per few batches.
const PREPARED_PER_GROUP: usize = 4;

/// How `task`'s batches are grouped: batches per group sent to the compute thread, and
/// whether it may cut pushes anywhere (adaptive: only on a task's first attempt in its
/// pass; a later one pushes batch by batch, so that no push of it partly overlaps a
/// push of an earlier attempt, which shards refuse).
fn grouping(per_push: PerPush, task: &LeasedTask) -> (usize, bool) {
    match per_push {
        PerPush::Fixed(n) => ((n as usize).max(1), false),
        PerPush::Adaptive if task.first_attempt() => (PREPARED_PER_GROUP, true),
        PerPush::Adaptive => (1, false),
    }
}

/// Prepares a task's groups and sends them to the compute thread; `false` when the
/// trainer was drained before its last group (the task ends there).
async fn feed(
    ctx: &Ctx<'_>,
    (pipe, clock): (&mut Pipeline, &GoodputClock),
    TaskData { task, records }: TaskData,
) -> Result<bool, RuntimeError> {
    let started = Instant::now();
    let task: Arc<LeasedTask> = Arc::new(task);
    let records = Arc::new(records);
    let (per_push, adaptive) = grouping(ctx.cfg.batches_per_push, &task);
    let mut groups = Groups::new(ctx.model, records, &task, ctx.cfg, per_push);
    let mut how = EndHow::Whole;
    let computing = compute_bucket(&task);
    loop {
        // Preparing batches is computing (it counts while the compute thread waits).
        let preparing = clock.span(computing);
        let Some((first, prepared)) = groups.next().await? else {
            break;
        };
        drop(preparing);
        if ctx.shutdown.is_cancelled() {
            // A group not sent yet is dropped with the task (handed back).
            how = EndHow::Drained;
            break;
        }
        match prepared {
            Ok(batches) => {
                let task = task.clone();
                pipe.send(Work::Group {
                    task,
                    first,
                    batches,
                    adaptive,
                })
                .await?;
            }
            Err(bad) => {
                how = EndHow::BadData(bad.reason(&task)?);
                break;
            }
        }
    }
    let drained = matches!(how, EndHow::Drained);
    pipe.send(Work::End { task, how, started }).await?;
    Ok(!drained)
}
