//! The communication side of the pipeline: one task on the trainer's runtime that sends
//! the pushes the compute thread hands over (in order, each waited for until applied)
//! and pulls the dense parameters when a push was applied or a task starts, into a
//! buffer the compute thread swaps in between batches.
//!
//! Pushes and pulls take turns, never overlap: a pull then holds exactly the pushes
//! applied before it was sent, the number it records (`absorbed`). (When a push was
//! applied while a pull was in flight, the pull might hold it or not; a working copy
//! rebased on such a pull counted that push twice until the next landing, nearly
//! always when the trainer was faster than the network, and the MNIST example's
//! asynchronous Adam lost about a point of accuracy.) After an applied push the pull
//! goes first, unless the last one landed has not been swapped in yet.
//!
//! The compute thread and the task share one [`Shared`]: a lock over [`State`], a
//! condition variable the compute thread waits on (a push slot), and a [`Notify`] for
//! the task. Pushes are numbered from 1 in the order they are handed over.
//!
//! A lone trainer skips the pull after its push (`sole`): when the pservers say the push
//! was applied exactly one update after their previous answer to this trainer (a push's
//! or a pull's, every shard of the same incarnation: [`Position::follows`]), and the
//! update rule is additive ([`OptimizerConfig::is_additive`]: one update with the sum of
//! the run's gradients is the run's local updates, up to rounding), the pservers hold
//! what the working copy held when the push was handed over (its mark): the compute
//! thread takes that mark as its new base without a pull ([`Shared::take_sole_through`]).
//! A push that does not follow (another trainer's update between, a restored shard, a
//! repeat) asks for a pull as before. After [`SOLE_STREAK`] such pushes in a row the
//! compute thread also hands its runs over less often ([`Shared::sole`]; one push that
//! does not follow ends that): a lone trainer's pushes are read by nobody, while with
//! other trainers, larger runs would make every trainer's view staler. A pull that raced another trainer's push may say
//! one update more than its values hold (a shard counts a push before applying it): the
//! working copy then misses that update until its next pull, at the latest at the next
//! task's start, which rebases on the pservers' values whatever the marks claimed.
//!
//! [`OptimizerConfig::is_additive`]: edl_pserver_client::OptimizerConfig::is_additive
//!
//! A push a shard refuses because another attempt at its task applied part of its
//! batches ([`StoreError::Superseded`]) is not a failure: the task was taken away from
//! this trainer. Its lease is recorded as taken away (the compute thread computes no
//! more of it, its pushes not sent yet are dropped, and it is not acknowledged), and
//! the push counts as settled: the next pull, which does not hold it, takes its local
//! updates out of the working copy.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use edl_pserver_client::Origin;
use tokio::sync::{Notify, watch};
use tracing::Instrument as _;

use super::working::Values;
use crate::model::{Params, StepOutput};
use crate::store::{ParamStore, Position, StoreError};

/// Pushes in a row, each the only update since the pservers' answer before it, after
/// which a trainer counts as training alone ([`Shared::sole`]).
pub(crate) const SOLE_STREAK: u32 = 4;

/// A task's lease: (pass, index, generation), unique per dispatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct LeaseKey(u32, u32, u64);

impl LeaseKey {
    pub(crate) fn of(t: &edl_master_client::task::LeasedTask) -> Self {
        LeaseKey(t.pass, t.index, t.generation)
    }
}

/// A push handed over by the compute thread.
pub(super) struct Outgoing {
    /// Its number (1, 2, ...).
    pub(super) number: u64,
    /// This trainer's step (its session's dedup key).
    pub(super) step: u64,
    /// The run of task batches it sums.
    pub(super) origin: Origin,
    /// The lease of its task.
    pub(super) lease: LeaseKey,
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
    /// A pull is on its way.
    pulling: bool,
    /// A pull that landed and was not swapped in yet: (values, pushes it absorbed).
    landed: Option<(Values, u64)>,
    /// Where the pservers' parameters stood at their last answer (a push's or a pull's).
    at: Position,
    /// The pushes applied in a row as the only update since the answer before each
    /// (and not behind): see the module docs.
    sole: u32,
    /// A push did not follow the answer before it, and no pull was sent since: the
    /// pservers hold updates the working copy has not seen (a later push that follows
    /// does not make it whole).
    behind: bool,
    /// The newest such push not yet taken by the compute thread (0: none).
    sole_through: u64,
    /// A buffer to pull into, given back by the compute thread.
    spare: Option<Values>,
    /// The error that broke the store (nothing is sent after it).
    pub(super) failed: Option<String>,
    /// Leases whose task was taken away (a push of it refused): why.
    taken_away: HashMap<LeaseKey, String>,
    /// The pipeline is closing: the tasks stop once the queue is empty.
    closing: bool,
}

/// The pipeline's shared state.
pub(super) struct Shared {
    state: Mutex<State>,
    /// Whether the update rule is additive (a push may then be `sole`).
    additive: bool,
    /// Wakes the compute thread: a push applied, a failure.
    changed: Condvar,
    /// Wakes the communication task: a push handed over, a pull wanted, a buffer
    /// given back, closing.
    ready: Notify,
    /// (pushes applied, failure) for the acknowledgements on the runtime.
    applied: watch::Sender<(u64, Option<String>)>,
}

impl Shared {
    /// `additive`: whether the update rule is ([`Position`]'s pulls may be skipped).
    pub(super) fn new(additive: bool) -> Arc<Self> {
        Arc::new(Shared {
            state: Mutex::new(State::default()),
            additive,
            changed: Condvar::new(),
            ready: Notify::new(),
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
        while s.handed - s.applied >= cap && s.failed.is_none() && !s.closing {
            s = self.changed.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
        if let Some(e) = &s.failed {
            return Err(e.clone());
        }
        if s.closing {
            // The pipeline was dropped (the runtime stopped early): nothing more is sent.
            return Err("the pipeline was closed".into());
        }
        s.handed = out.number;
        s.queue.push_back(out);
        drop(s);
        self.ready.notify_one();
        Ok(start.elapsed())
    }

    /// Compute thread: whether the communication side is idle: every push handed over
    /// was applied, and no pull is due or on its way. An adaptive run is handed over
    /// then, so that a run sums the batches computed during the last push's round trip
    /// (its push and the pull after it): where the parameter traffic is heavy, the
    /// pushes are fewer and larger, and the cores the traffic takes go to the
    /// computation meanwhile.
    pub(super) fn comm_idle(&self) -> bool {
        let s = self.lock();
        s.queue.is_empty() && s.handed == s.applied && !s.want_pull && !s.pulling
    }

    /// Compute thread: whether the last [`SOLE_STREAK`] pushes applied were each the
    /// only update since the pservers' answer before it: this trainer trains alone, for
    /// now. (One such push proves little: another trainer's pushes may just have
    /// fallen outside its round trip.)
    pub(super) fn sole(&self) -> bool {
        self.lock().sole >= SOLE_STREAK
    }

    /// Compute thread: the newest push the pservers applied as the only update since
    /// their previous answer, not taken before: the pservers hold its mark.
    pub(super) fn take_sole_through(&self) -> Option<u64> {
        let mut s = self.lock();
        let n = std::mem::take(&mut s.sole_through);
        (n > 0).then_some(n)
    }

    /// Whether `lease`'s task was taken away.
    pub(super) fn taken_away(&self, lease: LeaseKey) -> bool {
        self.lock().taken_away.contains_key(&lease)
    }

    /// Runtime: why `lease`'s task was taken away, if it was (forgotten then).
    pub(super) fn take_taken_away(&self, lease: LeaseKey) -> Option<String> {
        self.lock().taken_away.remove(&lease)
    }

    /// Compute thread: asks for a pull (a task starts: other trainers moved on).
    pub(super) fn want_pull(&self) {
        self.lock().want_pull = true;
        self.ready.notify_one();
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
        self.ready.notify_one();
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

    /// Stops the tasks once the queue is empty (and a compute thread waiting for a push
    /// slot, at once).
    pub(super) fn close(&self) {
        self.lock().closing = true;
        self.ready.notify_one();
        self.changed.notify_all();
    }

    /// Push `number` was applied at `at` (or refused, or dropped: nowhere): the next
    /// may go, and a pull is due unless the push was the only update since the
    /// pservers' previous answer (see the module docs).
    fn settled(&self, number: u64, at: Position) {
        let mut s = self.lock();
        s.applied = number;
        let sole = self.additive && !s.behind && at.follows(&s.at);
        s.at = at;
        if sole {
            s.sole += 1;
            s.sole_through = number;
        } else {
            s.sole = 0;
            s.behind = true;
            s.want_pull = true;
        }
        drop(s);
        self.applied.send_modify(|a| a.0 = number);
        self.changed.notify_all();
    }

    fn fail(&self, e: &StoreError) {
        let msg = e.to_string();
        self.lock().failed.get_or_insert(msg.clone());
        self.applied.send_modify(|a| {
            a.1.get_or_insert(msg);
        });
        self.changed.notify_all();
        self.ready.notify_one();
    }
}

/// Starts the communication task of trainer `trainer` over `store`.
pub(super) fn spawn(
    shared: &Arc<Shared>,
    store: Arc<dyn ParamStore>,
    trainer: String,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(run(shared.clone(), store, trainer).in_current_span())
}

/// What the communication task does next.
enum CommStep {
    Push(Outgoing),
    /// A push of a task taken away, dropped: settled without being sent.
    Dropped(u64),
    /// A pull into this buffer, absorbing the pushes through this number.
    Pull(Values, u64),
}

/// Pushes and pulls, taking turns, until closed (with nothing left to send) or failed.
async fn run(shared: Arc<Shared>, store: Arc<dyn ParamStore>, trainer: String) {
    loop {
        let next = {
            let mut s = shared.lock();
            if s.failed.is_some() {
                return;
            }
            if s.want_pull && s.landed.is_none() && !s.closing {
                s.want_pull = false;
                s.behind = false;
                s.pulling = true;
                Some(CommStep::Pull(
                    s.spare.take().unwrap_or_default(),
                    s.applied,
                ))
            } else if let Some(out) = s.queue.pop_front() {
                if s.taken_away.contains_key(&out.lease) {
                    Some(CommStep::Dropped(out.number))
                } else {
                    Some(CommStep::Push(out))
                }
            } else if s.closing {
                return;
            } else {
                None
            }
        };
        match next {
            None => shared.ready.notified().await,
            Some(CommStep::Push(out)) => {
                let number = out.number;
                let pushed = store
                    .push_applied(&trainer, out.step, Some(out.origin), out.grads)
                    .await;
                let at = match pushed {
                    Ok(at) => at,
                    Err(StoreError::Superseded(why)) => {
                        tracing::warn!(
                            pass = out.origin.pass,
                            task = out.origin.task,
                            "the task was taken away from this trainer: {why}"
                        );
                        shared.lock().taken_away.insert(out.lease, why);
                        Position::default()
                    }
                    Err(e) => {
                        shared.fail(&e);
                        return;
                    }
                };
                shared.settled(number, at);
            }
            Some(CommStep::Dropped(number)) => shared.settled(number, Position::default()),
            Some(CommStep::Pull(buf, absorbed)) => {
                let mut params = Params {
                    dense: buf,
                    sparse: Default::default(),
                };
                let at = match store.pull_current(&mut params).await {
                    Ok(at) => at,
                    Err(e) => {
                        shared.fail(&e);
                        return;
                    }
                };
                let mut s = shared.lock();
                s.landed = Some((params.dense, absorbed));
                s.at = at;
                s.pulling = false;
            }
        }
    }
}
