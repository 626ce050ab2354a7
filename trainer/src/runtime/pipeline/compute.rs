//! The compute thread: it owns the working parameters ([`Working`]) and a local copy of
//! the pservers' update rule, computes the groups the runtime sends it, applies each
//! batch's gradients to its working copy at once, sums them into the pending push, and
//! swaps in pulls as they land, between batches. It waits only when
//! [`super::PUSH_WINDOW`] pushes are waiting to be applied, or for work.
//!
//! When the pending push is handed over:
//! - a fixed group (`adaptive` false): at the group's end, so that every attempt at the
//!   task pushes the same runs of batches;
//! - adaptive: after any batch, as soon as the communication side is idle (every push
//!   handed over before applied, the pull after it landed: [`Shared::comm_idle`]; the
//!   pending push then sums the batches computed during the last one's round trip:
//!   fewer, larger pushes when the traffic is heavy), or when it holds
//!   [`ADAPTIVE_MAX_BATCHES`] batches (the staleness cap); and at the task's end. A
//!   trainer whose last few pushes were each the only update the pservers applied since
//!   their previous answer ([`Shared::sole`]: it trains alone, for now, under an additive
//!   rule) hands a run over only at the cap or the task's end: nobody else reads its
//!   pushes meanwhile, and fewer of them leave the cores to the computation.
//!
//! A batch shorter than the job's batch size weighs its part of a full one
//! ([`StepOutput::weigh_partial`]).
//!
//! A push names the run of batches it sums (see `ledger` in the pserver), so a later
//! attempt at the task, which pushes batch by batch, never double-counts one.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use edl_master_client::task::LeasedTask;

use edl_job::spec::per_push::ADAPTIVE_MAX_BATCHES;

use super::comm::{LeaseKey, Outgoing, Shared};
use super::working::Working;
use crate::goodput::{Bucket, GoodputClock, compute_bucket};
use crate::local_optim::LocalOptimizer;
use crate::model::{Batch, Model, StepOutput};
use crate::runtime::TaskEnd;
use crate::runtime::group::add_gradients;
use crate::tasks::task_ref;

/// What the runtime sends the compute thread.
pub(crate) enum Work {
    /// Consecutive batches of a task, the first of them batch `first` of the task;
    /// `adaptive`: push boundaries are the compute thread's choice, else the group is
    /// one push.
    Group {
        task: Arc<LeasedTask>,
        first: u32,
        batches: Vec<Batch>,
        adaptive: bool,
    },
    /// No more groups of the task: how it ended on the runtime's side.
    End {
        task: Arc<LeasedTask>,
        how: EndHow,
        started: Instant,
    },
}

/// How the runtime ended a task.
pub(crate) enum EndHow {
    /// Every group was sent.
    Whole,
    /// Drained (SIGTERM) before its remaining groups.
    Drained,
    /// A group could not be prepared: the reason.
    BadData(String),
}

/// Why the compute thread stopped a task with an error.
pub(crate) enum Fatal {
    /// The model failed on valid data (or the local update did not fit).
    Model(crate::Error),
    /// A push failed: the store's error.
    Store(String),
}

/// A task the compute thread is done with.
pub(crate) struct Done {
    pub(crate) task: Arc<LeasedTask>,
    pub(crate) started: Instant,
    pub(crate) end: Result<TaskEnd, Fatal>,
    /// The number of the last push handed over when it ended: the task is acknowledged
    /// once that one is applied.
    pub(crate) last_push: u64,
    /// Its pushes, batches skipped, and the loss of its last batch pushed.
    pub(crate) steps: u64,
    pub(crate) skipped: u64,
    pub(crate) last_loss: Option<f32>,
    /// When its first and last pushes were handed over.
    pub(crate) first_push_at: Option<SystemTime>,
    pub(crate) last_push_at: Option<SystemTime>,
}

/// The compute thread's counters, reported when it stops.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct ComputeStats {
    pub(crate) batches: u64,
    pub(crate) pushes: u64,
    pub(crate) rebases: u64,
    /// Time spent computing (forward/backward and the local update).
    pub(crate) busy: Duration,
    /// Time spent waiting for a push slot.
    pub(crate) waited_push: Duration,
    /// Time spent waiting for work.
    pub(crate) waited_work: Duration,
}

/// The batches summed and not handed over yet: `first..first + count` of the task
/// (their sum: `None` while every one was skipped).
struct Pending {
    first: u32,
    count: u32,
    records: u64,
    sum: Option<StepOutput>,
}

/// The task being computed.
struct Current {
    task: Arc<LeasedTask>,
    pending: Option<Pending>,
    /// Whether the pending run may be handed over part-way (adaptive).
    adaptive: bool,
    trained: u64,
    /// The batch after the last run handed over (pushed, or skipped: never pushed),
    /// counted from the task's first; `None` before the first.
    next_batch: Option<u32>,
    stopped: Option<Result<String, Fatal>>,
    steps: u64,
    skipped: u64,
    last_loss: Option<f32>,
    first_push_at: Option<SystemTime>,
    last_push_at: Option<SystemTime>,
}

/// The compute thread's state.
pub(crate) struct Compute {
    pub(crate) model: Arc<dyn Model>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) working: Working,
    pub(crate) optimizer: LocalOptimizer,
    /// Pushes handed over so far (the last number).
    pub(crate) handed: u64,
    /// This trainer's next step (the push's dedup key in its session).
    pub(crate) step: u64,
    pub(crate) window: u64,
    /// The job's batch size: a shorter batch weighs its part of one
    /// ([`StepOutput::weigh_partial`]).
    batch_size: usize,
    pub(crate) stats: ComputeStats,
    current: Option<Current>,
    /// Its batches are computing (or recomputing), its waits for the push window
    /// communicating.
    clock: GoodputClock,
}

impl Compute {
    pub(crate) fn new(
        model: Arc<dyn Model>,
        shared: Arc<Shared>,
        working: Working,
        optimizer: LocalOptimizer,
        (step, window): (u64, u64),
        batch_size: usize,
        clock: GoodputClock,
    ) -> Self {
        Compute {
            model,
            shared,
            working,
            optimizer,
            handed: 0,
            step,
            window,
            batch_size,
            stats: ComputeStats::default(),
            current: None,
            clock,
        }
    }

    /// Runs until the runtime drops its sender (or the receiver of [`Done`]).
    pub(crate) fn run(
        mut self,
        mut work: tokio::sync::mpsc::Receiver<Work>,
        done: tokio::sync::mpsc::UnboundedSender<Done>,
    ) -> ComputeStats {
        loop {
            let waiting = Instant::now();
            let Some(w) = work.blocking_recv() else {
                break;
            };
            self.stats.waited_work += waiting.elapsed();
            match w {
                Work::Group {
                    task,
                    first,
                    batches,
                    adaptive,
                } => self.group(task, first, &batches, adaptive),
                Work::End { task, how, started } => {
                    if done.send(self.end(task, how, started)).is_err() {
                        break;
                    }
                }
            }
        }
        self.stats.rebases = self.working.rebases;
        self.stats
    }

    /// Swaps in the pull that landed, if any, then takes the newest push the pservers
    /// applied alone as the base (see `comm`).
    fn land(&mut self) {
        if let Some((values, absorbed)) = self.shared.take_landed() {
            self.working.land(values, absorbed);
            self.shared.recycle(self.working.spare());
        }
        if let Some(number) = self.shared.take_sole_through() {
            self.working.advance(number);
        }
    }

    fn current(&mut self, task: &Arc<LeasedTask>) -> &mut Current {
        if self.current.as_ref().is_none_or(|c| c.task.id != task.id) {
            // A new task: the other trainers moved on meanwhile.
            self.shared.want_pull();
            self.current = Some(Current {
                task: task.clone(),
                pending: None,
                adaptive: false,
                trained: 0,
                next_batch: None,
                stopped: None,
                steps: 0,
                skipped: 0,
                last_loss: None,
                first_push_at: None,
                last_push_at: None,
            });
        }
        self.current.as_mut().expect("set above")
    }

    /// Computes a group of `task`'s batches (the first of them batch `first`), summing
    /// them into the pending push, handed over as the module docs say.
    fn group(&mut self, task: Arc<LeasedTask>, first: u32, batches: &[Batch], adaptive: bool) {
        let cur = self.current(&task);
        cur.adaptive = adaptive;
        if cur.stopped.is_some() || self.shared.taken_away(LeaseKey::of(&task)) {
            // Stopped, or another attempt holds the task now: nothing more is computed.
            return;
        }
        let bucket = compute_bucket(&task);
        for (seq, batch) in (first..).zip(batches) {
            self.land();
            let computing = self.clock.span(bucket);
            let start = Instant::now();
            let out = self.model.forward_backward(self.working.params(), batch);
            let skip = match out {
                Ok(o) if !o.loss.is_finite() => Some(format!("a non-finite loss ({})", o.loss)),
                Ok(o) if !o.gradients_finite() => {
                    Some(format!("non-finite gradients (loss {})", o.loss))
                }
                Ok(mut step) => {
                    step.weigh_partial(batch.len(), self.batch_size);
                    let applied = self.optimizer.step(self.working.params(), &step);
                    self.stats.busy += start.elapsed();
                    self.stats.batches += 1;
                    if let Err(e) = applied {
                        self.stop(Err(Fatal::Model(e)));
                        return;
                    }
                    self.add(seq, batch.len(), Some(step));
                    None
                }
                Err(e @ crate::Error::NonFiniteLoss { .. }) => Some(e.to_string()),
                Err(e) => {
                    self.stats.busy += start.elapsed();
                    self.stop(if e.is_bad_data() {
                        Ok(format!("{}: {e}", task.path))
                    } else {
                        Err(Fatal::Model(e))
                    });
                    return;
                }
            };
            drop(computing);
            if let Some(skip) = skip {
                self.stats.busy += start.elapsed();
                tracing::warn!(task = %task.id, "skipping a batch: {skip}");
                self.add(seq, batch.len(), None);
                self.current.as_mut().expect("set by current()").skipped += 1;
            }
            let count = self.pending_count();
            if adaptive
                && (count >= ADAPTIVE_MAX_BATCHES
                    || (!self.shared.sole() && self.shared.comm_idle()))
            {
                self.hand_over();
            }
        }
        if !adaptive {
            self.hand_over();
        }
    }

    /// Adds batch `seq` of `records` (its gradients, `None` when it was skipped) to the
    /// pending run.
    fn add(&mut self, seq: u32, records: usize, step: Option<StepOutput>) {
        let cur = self.current.as_mut().expect("set by current()");
        if let Some(s) = &step {
            cur.last_loss = Some(s.loss);
        }
        let p = cur.pending.get_or_insert(Pending {
            first: seq,
            count: 0,
            records: 0,
            sum: None,
        });
        debug_assert_eq!(p.first + p.count, seq, "a run is consecutive batches");
        p.count += 1;
        p.records += records as u64;
        match (&mut p.sum, step) {
            (None, step) => p.sum = step,
            (Some(sum), Some(step)) => add_gradients(sum, &step),
            (Some(_), None) => {}
        }
    }

    fn pending_count(&self) -> u32 {
        self.current
            .as_ref()
            .and_then(|c| c.pending.as_ref())
            .map_or(0, |p| p.count)
    }

    /// Stops the current task (`Ok`: its data is bad, why). An adaptive run's batches
    /// computed so far are pushed (a later attempt pushes batch by batch); a fixed
    /// group's are not (a later attempt pushes the whole group).
    fn stop(&mut self, why: Result<String, Fatal>) {
        if self.current.as_ref().is_some_and(|c| c.adaptive) {
            self.hand_over();
        }
        let cur = self.current.as_mut().expect("set by current()");
        cur.pending = None;
        cur.stopped.get_or_insert(why);
    }

    /// Hands the pending run over as a push (waiting for a slot), if it has gradients;
    /// its records count as trained (a skipped batch was seen).
    fn hand_over(&mut self) {
        let cur = self.current.as_mut().expect("set by current()");
        let Some(Pending {
            first,
            count,
            records,
            sum,
        }) = cur.pending.take()
        else {
            return;
        };
        cur.trained += records;
        cur.next_batch = Some(first + count);
        let Some(grads) = sum else {
            return;
        };
        let number = self.handed + 1;
        let out = Outgoing {
            number,
            step: self.step,
            origin: task_ref(&cur.task).run(first, count),
            lease: LeaseKey::of(&cur.task),
            grads,
        };
        // A task trained again is recomputing throughout, its waits for pushes too.
        let waiting = self.clock.span(match compute_bucket(&cur.task) {
            Bucket::Recomputing => Bucket::Recomputing,
            _ => Bucket::Communicating,
        });
        let handed = self.shared.hand_over(out, self.window);
        drop(waiting);
        match handed {
            Ok(waited) => self.stats.waited_push += waited,
            Err(e) => {
                cur.stopped.get_or_insert(Err(Fatal::Store(e)));
                return;
            }
        }
        self.working.mark(number);
        self.handed = number;
        self.step += 1;
        self.stats.pushes += 1;
        let now = SystemTime::now();
        cur.steps += 1;
        cur.first_push_at.get_or_insert(now);
        cur.last_push_at = Some(now);
    }

    /// The runtime ended `task`: how it went.
    fn end(&mut self, task: Arc<LeasedTask>, how: EndHow, started: Instant) -> Done {
        let taken_away = self.shared.taken_away(LeaseKey::of(&task));
        if !taken_away
            && self
                .current
                .as_ref()
                .is_some_and(|c| c.task.id == task.id && c.stopped.is_none())
        {
            // An adaptive run's last batches (a fixed group was handed over whole).
            self.hand_over();
        }
        let cur = match self.current.take() {
            Some(c) if c.task.id == task.id => c,
            // No group of it was computed (a task of no records, or drained at once).
            other => {
                self.current = other;
                let _ = self.current(&task);
                self.current.take().expect("just set")
            }
        };
        let trained = cur.trained;
        let end = match (cur.stopped, how) {
            (Some(Err(fatal)), _) => Err(fatal),
            (Some(Ok(reason)), _) | (None, EndHow::BadData(reason)) => {
                Ok(TaskEnd::BadData(reason, trained))
            }
            (None, EndHow::Drained) => Ok(TaskEnd::Drained {
                records: trained,
                next_batch: cur.next_batch,
            }),
            (None, EndHow::Whole) => Ok(TaskEnd::Trained(trained)),
        };
        Done {
            task,
            started,
            end,
            last_push: self.handed,
            steps: cur.steps,
            skipped: cur.skipped,
            last_loss: cur.last_loss,
            first_push_at: cur.first_push_at,
            last_push_at: cur.last_push_at,
        }
    }
}
