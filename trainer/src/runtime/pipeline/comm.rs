//! The communication side of the pipeline: two tasks on the trainer's runtime, one
//! sending the pushes the compute thread hands over (in order, each waited for until
//! applied), one pulling the dense parameters whenever a push was applied or a task
//! starts, into a buffer the compute thread swaps in between batches.
//!
//! The compute thread and these tasks share one [`Shared`]: a lock over [`State`], a
//! condition variable the compute thread waits on (a push slot, a landing), and a
//! [`Notify`] per task. Pushes are numbered from 1 in the order they are handed over; a
//! pull records the number of the last push applied when it was issued (`absorbed`).

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use edl_pserver_client::Origin;
use tokio::sync::{Notify, watch};
use tracing::Instrument as _;

use super::working::Values;
use crate::model::{Params, StepOutput};
use crate::store::{ParamStore, StoreError};

/// A push handed over by the compute thread.
pub(super) struct Outgoing {
    /// Its number (1, 2, ...).
    pub(super) number: u64,
    /// This trainer's step (its session's dedup key).
    pub(super) step: u64,
    /// The task batch group it sums.
    pub(super) origin: Origin,
    pub(super) grads: StepOutput,
}

/// What the compute thread and the communication tasks share (behind [`Shared::state`]).
#[derive(Default)]
pub(super) struct State {
    /// Pushes handed over and not sent yet, in order.
    queue: VecDeque<Outgoing>,
    /// Pushes handed over (the last number).
    pub(super) handed: u64,
    /// Pushes applied (in order: the last number).
    pub(super) applied: u64,
    /// A pull is due (a push was applied, or a task started).
    want_pull: bool,
    /// A pull that landed and was not swapped in yet: (values, pushes it absorbed).
    landed: Option<(Values, u64)>,
    /// A buffer to pull into, given back by the compute thread.
    spare: Option<Values>,
    /// The error that broke the store (nothing is sent after it).
    pub(super) failed: Option<String>,
    /// The pipeline is closing: the tasks stop once the queue is empty.
    closing: bool,
}

/// The pipeline's shared state.
pub(super) struct Shared {
    state: Mutex<State>,
    /// Wakes the compute thread: a push applied, a pull landed, a failure.
    changed: Condvar,
    push_ready: Notify,
    pull_ready: Notify,
    /// (pushes applied, failure) for the acknowledgements on the runtime.
    applied: watch::Sender<(u64, Option<String>)>,
}

impl Shared {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            push_ready: Notify::new(),
            pull_ready: Notify::new(),
            applied: watch::Sender::new((0, None)),
        })
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Compute thread: hands push `out` over once fewer than `cap` pushes are waiting to
    /// be applied. Returns how long it waited, or the store's failure.
    pub(super) fn hand_over(&self, out: Outgoing, cap: u64) -> Result<Duration, String> {
        let start = Instant::now();
        let mut s = self.lock();
        while s.handed - s.applied >= cap && s.failed.is_none() {
            s = self.changed.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
        if let Some(e) = &s.failed {
            return Err(e.clone());
        }
        s.handed = out.number;
        s.queue.push_back(out);
        drop(s);
        self.push_ready.notify_one();
        Ok(start.elapsed())
    }

    /// Compute thread: asks for a pull (a task starts: other trainers moved on).
    pub(super) fn want_pull(&self) {
        self.lock().want_pull = true;
        self.pull_ready.notify_one();
    }

    /// Compute thread: the pull that landed, if any (the caller gives its buffer back
    /// with [`Shared::recycle`]).
    pub(super) fn take_landed(&self) -> Option<(Values, u64)> {
        self.lock().landed.take()
    }

    /// Compute thread: a buffer for the next pull.
    pub(super) fn recycle(&self, buf: Values) {
        let mut s = self.lock();
        if s.spare.is_none() {
            s.spare = Some(buf);
        }
        drop(s);
        self.pull_ready.notify_one();
    }

    /// Runtime: waits until push `number` is applied, or the store failed.
    pub(super) async fn applied_through(&self, number: u64) -> Result<(), StoreError> {
        let mut rx = self.applied.subscribe();
        let seen = rx
            .wait_for(|(applied, failed)| *applied >= number || failed.is_some())
            .await
            .map_err(|_| StoreError::Unavailable("the pipeline was dropped".into()))?;
        match &seen.1 {
            Some(e) if seen.0 < number => {
                Err(StoreError::Unavailable(format!("a push failed: {e}")))
            }
            _ => Ok(()),
        }
    }

    /// Stops the tasks once the queue is empty.
    pub(super) fn close(&self) {
        self.lock().closing = true;
        self.push_ready.notify_one();
        self.pull_ready.notify_one();
    }

    fn fail(&self, e: &StoreError) {
        let msg = e.to_string();
        self.lock().failed.get_or_insert(msg.clone());
        self.applied.send_modify(|a| {
            a.1.get_or_insert(msg);
        });
        self.changed.notify_all();
        self.pull_ready.notify_one();
    }
}

/// Starts the pushing and pulling tasks of trainer `trainer` over `store`.
pub(super) fn spawn(
    shared: &Arc<Shared>,
    store: Arc<dyn ParamStore>,
    trainer: String,
) -> [tokio::task::JoinHandle<()>; 2] {
    let push = tokio::spawn(pusher(shared.clone(), store.clone(), trainer).in_current_span());
    let pull = tokio::spawn(puller(shared.clone(), store).in_current_span());
    [push, pull]
}

/// Sends the pushes in order, each waited for until applied.
async fn pusher(shared: Arc<Shared>, store: Arc<dyn ParamStore>, trainer: String) {
    loop {
        let next = {
            let mut s = shared.lock();
            if s.failed.is_some() {
                return;
            }
            match s.queue.pop_front() {
                Some(out) => Some(out),
                None if s.closing => return,
                None => None,
            }
        };
        let Some(out) = next else {
            shared.push_ready.notified().await;
            continue;
        };
        let pushed = store
            .push_applied(&trainer, out.step, Some(out.origin), out.grads)
            .await;
        if let Err(e) = pushed {
            shared.fail(&e);
            return;
        }
        let mut s = shared.lock();
        s.applied = out.number;
        s.want_pull = true;
        drop(s);
        shared.applied.send_modify(|a| a.0 = out.number);
        shared.changed.notify_all();
        shared.pull_ready.notify_one();
    }
}

/// Pulls whenever one is due and the last landing was swapped in.
async fn puller(shared: Arc<Shared>, store: Arc<dyn ParamStore>) {
    loop {
        let due = {
            let mut s = shared.lock();
            if s.failed.is_some() || (s.closing && s.queue.is_empty()) {
                return;
            }
            if s.want_pull && s.landed.is_none() {
                s.want_pull = false;
                Some((s.spare.take().unwrap_or_default(), s.applied))
            } else {
                None
            }
        };
        let Some((buf, absorbed)) = due else {
            shared.pull_ready.notified().await;
            continue;
        };
        let mut params = Params {
            dense: buf,
            sparse: Default::default(),
        };
        if let Err(e) = store.pull_current(&mut params).await {
            shared.fail(&e);
            return;
        }
        shared.lock().landed = Some((params.dense, absorbed));
        shared.changed.notify_all();
    }
}
