//! The asynchronous trainer's pipeline: a compute thread that never waits on the
//! network (see `docs/design.md`, "The trainer's pipeline").
//!
//! - The runtime prepares each task's groups of batches (a group: the batches summed
//!   into one push) and sends them to the compute thread ([`Work`]), a few ahead.
//! - The compute thread ([`compute`]) owns the working parameters: it computes a
//!   batch, applies its gradients to its own copy at once (the pservers' update rule,
//!   run locally), and at a group's end hands the group's sum over as a push. It waits
//!   only when [`PUSH_WINDOW`] pushes are waiting to be applied (the staleness cap), or
//!   for work.
//! - The communication side ([`comm`]) sends the pushes in order, each waited for until
//!   applied, and pulls after each applied push and at each task's start (pushes and
//!   pulls take turns, so a pull holds exactly the pushes applied before it); a pull lands
//!   in a spare buffer that the compute thread swaps in between batches, rebasing its
//!   own batches not yet absorbed on it ([`working`]). A trainer training alone under an
//!   additive rule skips the pull after its pushes, and pushes less often (see [`comm`]
//!   and [`compute`]).
//! - When the compute thread is done with a task it says so ([`Done`]) with the number
//!   of its last push: the task is acknowledged once that push is applied, in the
//!   background. Nothing waits at a task's boundary.
//!
//! Exactly-once: a push names the run of the task's batches it sums; a shard applies a
//! run whole or not at all, and refuses one partly applied by another attempt at the
//! task (which pushes batch by batch: only a task's first attempt in a pass groups
//! adaptively); this trainer's task was then taken away from it (see [`comm`]).

use std::sync::Arc;

use tokio::sync::mpsc;

mod comm;
mod compute;
mod working;

pub(crate) use comm::LeaseKey;
#[cfg(test)]
pub(crate) use comm::SOLE_STREAK;
pub(crate) use compute::{Done, EndHow, Fatal, Work};

use crate::goodput::GoodputClock;
use crate::local_optim::LocalOptimizer;
use crate::model::Model;
use crate::progress::RuntimeError;
use crate::store::{ParamStore, StoreError};
use crate::tasks::Pushes;
use compute::{Compute, ComputeStats};
use working::Working;

/// Pushes waiting to be applied (in flight or queued) before the compute thread waits:
/// the parameters a batch computes on miss at most this many of this trainer's own
/// pushes on the pservers' side, and none of its batches (applied locally).
pub const PUSH_WINDOW: u64 = 2;

/// Groups (and task ends) sent to the compute thread ahead of it (the next group is
/// being prepared meanwhile): enough to keep it busy across a task's boundary, where the
/// runtime takes the next task and prepares its first group while the compute thread
/// finishes the last one (with one ahead, a lone trainer's compute thread waited for
/// work about 1 ms at each boundary; with two, half as long in all, docs/benchmarks.md);
/// few, since a killed trainer's groups in the pipeline are trained again.
const WORK_AHEAD: usize = 2;

/// The running pipeline (see the module docs).
pub(crate) struct Pipeline {
    work: Option<mpsc::Sender<Work>>,
    done: mpsc::UnboundedReceiver<Done>,
    shared: Arc<comm::Shared>,
    thread: Option<std::thread::JoinHandle<ComputeStats>>,
    comm: Option<tokio::task::JoinHandle<()>>,
    /// Tasks ended on the runtime's side and not done on the compute thread's.
    pub(crate) in_compute: usize,
}

impl Pipeline {
    /// Starts the compute thread on `initial` (dense values just pulled) and the
    /// communication tasks of trainer `trainer` over `store`; `step` is the trainer's
    /// next step, `optimizer` the pservers' update rule. The compute thread marks its
    /// batches and its waits for the push window on `clock`.
    pub(crate) fn start(
        model: Arc<dyn Model>,
        store: Arc<dyn ParamStore>,
        trainer: &str,
        initial: Vec<Vec<f32>>,
        optimizer: LocalOptimizer,
        (step, batch_size): (u64, usize),
        clock: GoodputClock,
    ) -> Result<Pipeline, RuntimeError> {
        let shared = comm::Shared::new(optimizer.is_additive());
        let compute = Compute::new(
            model,
            shared.clone(),
            Working::new(initial),
            optimizer,
            (step, PUSH_WINDOW),
            batch_size,
            clock,
        );
        let (work_tx, work_rx) = mpsc::channel(WORK_AHEAD);
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        let span = tracing::Span::current();
        let thread = std::thread::Builder::new()
            .name("edl-compute".into())
            .spawn(move || span.in_scope(|| compute.run(work_rx, done_tx)))
            .map_err(|e| {
                StoreError::Unavailable(format!("could not start the compute thread: {e}"))
            })?;
        let comm = comm::spawn(&shared, store, trainer.to_owned());
        Ok(Pipeline {
            work: Some(work_tx),
            done: done_rx,
            shared,
            thread: Some(thread),
            comm: Some(comm),
            in_compute: 0,
        })
    }

    /// Sends work to the compute thread (waits while it is [`WORK_AHEAD`] behind).
    pub(crate) async fn send(&mut self, w: Work) -> Result<(), RuntimeError> {
        if matches!(w, Work::End { .. }) {
            self.in_compute += 1;
        }
        let sent = match &self.work {
            Some(tx) => tx.send(w).await.is_ok(),
            None => false,
        };
        if sent { Ok(()) } else { Err(self.gone().await) }
    }

    /// The error of a compute thread that stopped (its channels closed: it ended or is
    /// unwinding), joined: with its panic's message, if it panicked.
    pub(crate) async fn gone(&mut self) -> RuntimeError {
        let joined = match self.thread.take() {
            Some(t) => tokio::task::spawn_blocking(move || t.join()).await.ok(),
            None => None,
        };
        StoreError::Unavailable(match joined {
            Some(Err(panic)) => {
                format!(
                    "the compute thread panicked: {}",
                    panic_message(panic.as_ref())
                )
            }
            _ => "the compute thread stopped".into(),
        })
        .into()
    }

    /// A task the compute thread is done with, if one is ready.
    pub(crate) fn try_done(&mut self) -> Option<Done> {
        let d = self.done.try_recv().ok()?;
        self.in_compute -= 1;
        Some(d)
    }

    /// The next task the compute thread is done with (`None`: it stopped).
    pub(crate) async fn next_done(&mut self) -> Option<Done> {
        let d = self.done.recv().await?;
        self.in_compute -= 1;
        Some(d)
    }

    /// Waits until push `number` (the last of the task leased as `lease`) is settled,
    /// then says whether the task's pushes were applied or it was taken away (for its
    /// acknowledgement).
    pub(crate) fn applied_through(
        &self,
        number: u64,
        lease: LeaseKey,
    ) -> impl std::future::Future<Output = Result<Pushes, StoreError>> + Send + 'static {
        let shared = self.shared.clone();
        async move {
            shared.applied_through(number).await?;
            Ok(match shared.take_taken_away(lease) {
                Some(why) => Pushes::TakenAway(why),
                None => Pushes::Applied,
            })
        }
    }

    /// Waits until every push handed over is applied.
    pub(crate) async fn flush(&self) -> Result<(), StoreError> {
        let handed = self.shared.lock().handed;
        self.shared.applied_through(handed).await
    }

    /// Stops the compute thread and the communication tasks, after the pushes handed
    /// over are applied; its counters.
    pub(crate) async fn close(mut self) -> Result<ComputeStats, StoreError> {
        let flushed = self.flush().await;
        self.work = None;
        self.done.close();
        let joined = match self.thread.take() {
            Some(t) => tokio::task::spawn_blocking(move || t.join()).await.ok(),
            None => None,
        };
        let stats = match joined {
            Some(Ok(stats)) => stats,
            // Its message is the trainer's error ([`Pipeline::gone`]).
            Some(Err(_)) => ComputeStats::default(),
            None => ComputeStats::default(),
        };
        self.shared.close();
        if let Some(h) = self.comm.take() {
            let _ = h.await;
        }
        flushed.map(|()| stats)
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        // On an early return: the tasks stop (the compute thread stops with its sender).
        self.shared.close();
    }
}

/// A panic's message (`panic!`'s text), or that it had none.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("a panic without a message")
}
