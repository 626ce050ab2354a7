//! The compute thread: it owns the working parameters ([`Working`]) and a local copy of
//! the pservers' update rule, computes the groups the runtime sends it, applies each
//! batch's gradients to its working copy at once, hands each group's sum over as a push,
//! and swaps in pulls as they land, between batches. It waits only when
//! [`super::PUSH_WINDOW`] pushes are waiting to be applied, or for work.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use edl_master_client::task::LeasedTask;

use super::comm::{Outgoing, Shared};
use super::working::Working;
use crate::local_optim::LocalOptimizer;
use crate::model::{Batch, Model, StepOutput};
use crate::runtime::TaskEnd;
use crate::runtime::group::add_gradients;
use crate::tasks::task_ref;

/// What the runtime sends the compute thread.
pub(crate) enum Work {
    /// Group `g` of a task's batches (its number is the push's origin).
    Group {
        task: Arc<LeasedTask>,
        g: u32,
        batches: Vec<Batch>,
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

/// The task being computed.
struct Current {
    task: Arc<LeasedTask>,
    trained: u64,
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
    pub(crate) stats: ComputeStats,
    current: Option<Current>,
}

impl Compute {
    pub(crate) fn new(
        model: Arc<dyn Model>,
        shared: Arc<Shared>,
        working: Working,
        optimizer: LocalOptimizer,
        step: u64,
        window: u64,
    ) -> Self {
        Compute {
            model,
            shared,
            working,
            optimizer,
            handed: 0,
            step,
            window,
            stats: ComputeStats::default(),
            current: None,
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
                Work::Group { task, g, batches } => self.group(task, g, &batches),
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

    /// Swaps in the pull that landed, if any.
    fn land(&mut self) {
        if let Some((values, absorbed)) = self.shared.take_landed() {
            self.working.land(values, absorbed);
            self.shared.recycle(self.working.spare());
        }
    }

    fn current(&mut self, task: &Arc<LeasedTask>) -> &mut Current {
        if self.current.as_ref().is_none_or(|c| c.task.id != task.id) {
            // A new task: the other trainers moved on meanwhile.
            self.shared.want_pull();
            self.current = Some(Current {
                task: task.clone(),
                trained: 0,
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

    /// Computes group `g` of `task` and hands its sum over.
    fn group(&mut self, task: Arc<LeasedTask>, g: u32, batches: &[Batch]) {
        if self.current(&task).stopped.is_some() {
            return;
        }
        let mut sum: Option<StepOutput> = None;
        let mut records = 0u64;
        for batch in batches {
            self.land();
            records += batch.len() as u64;
            let start = Instant::now();
            let out = self.model.forward_backward(self.working.params(), batch);
            let skip = match out {
                Ok(o) if !o.loss.is_finite() => format!("a non-finite loss ({})", o.loss),
                Ok(o) if !o.gradients_finite() => {
                    format!("non-finite gradients (loss {})", o.loss)
                }
                Ok(step) => {
                    let applied = self.optimizer.step(self.working.params(), &step);
                    self.stats.busy += start.elapsed();
                    self.stats.batches += 1;
                    let cur = self.current.as_mut().expect("set by current()");
                    if let Err(e) = applied {
                        cur.stopped = Some(Err(Fatal::Model(e)));
                        return;
                    }
                    cur.last_loss = Some(step.loss);
                    match &mut sum {
                        None => sum = Some(step),
                        Some(s) => add_gradients(s, &step),
                    }
                    continue;
                }
                Err(e @ crate::Error::NonFiniteLoss { .. }) => e.to_string(),
                Err(e) => {
                    let cur = self.current.as_mut().expect("set by current()");
                    cur.stopped = Some(if e.is_bad_data() {
                        Ok(format!("{}: {e}", task.path))
                    } else {
                        Err(Fatal::Model(e))
                    });
                    return;
                }
            };
            self.stats.busy += start.elapsed();
            tracing::warn!(task = %task.id, "skipping a batch: {skip}");
            self.current.as_mut().expect("set by current()").skipped += 1;
        }
        if let Some(grads) = sum {
            let number = self.handed + 1;
            let out = Outgoing {
                number,
                step: self.step,
                // The group's number is its origin: the same groups in every attempt.
                origin: task_ref(&task).batch(g),
                grads,
            };
            match self.shared.hand_over(out, self.window) {
                Ok(waited) => self.stats.waited_push += waited,
                Err(e) => {
                    self.current.as_mut().expect("set by current()").stopped =
                        Some(Err(Fatal::Store(e)));
                    return;
                }
            }
            self.working.mark(number);
            self.handed = number;
            self.step += 1;
            self.stats.pushes += 1;
            let now = SystemTime::now();
            let cur = self.current.as_mut().expect("set by current()");
            cur.steps += 1;
            cur.first_push_at.get_or_insert(now);
            cur.last_push_at = Some(now);
        }
        self.current.as_mut().expect("set by current()").trained += records;
    }

    /// The runtime ended `task`: how it went.
    fn end(&mut self, task: Arc<LeasedTask>, how: EndHow, started: Instant) -> Done {
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
            (None, EndHow::Drained) => Ok(TaskEnd::Drained(trained)),
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
