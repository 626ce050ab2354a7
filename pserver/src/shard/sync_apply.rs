//! Sync mode: pushes summed into steps, and the mean of a step's gradients applied
//! once when the step closes. Which trainers a step waits for, and when it closes, is
//! the pure state machine of [`crate::sync`]; this part holds the gradients and applies
//! them.
//!
//! Invariants: a block's and a stripe's `acc` hold the gradients of the open step only;
//! a push whose batches were all applied, or joined the open step, does not join (the
//! trainer sits the step out), and one with some of them so is refused (`Overlap`), unless it is the trainer's own retry of a step it took part in
//! (answered "in progress" while the step is open, "already applied" once it closed,
//! and the trainer stays in the steps); the origins of a step enter the ledger when it is applied, under
//! the step lock, so a snapshot's ledger matches its values;
//! closing a step holds the step lock for writing while it applies the mean (sum divided
//! by the contributors) or, when the sum is not finite, drops the step whole; pulls and
//! snapshots hold the step lock for reading, so they see one step whole. Waiting pushes
//! learn of a closed step through `closed_tx`, after the step lock is released.

use std::sync::atomic::Ordering;
use std::sync::{Mutex, PoisonError, RwLockReadGuard};

use bytes::Bytes;
use tokio::sync::watch;
use tokio::time::Instant;

use super::ledger::{Ledger, LedgerMark, Origin};
use super::push::{Push, SparseUpdate};
use super::storage::stripe_of;
use super::{ShardCore, bump, lock};
use crate::error::PsError;
use crate::sync::{Admit, CloseJob, SyncState};
use crate::wire;

/// Why a sync push's step is refused.
pub(crate) fn out_of_range(step: u64, next: u64) -> String {
    format!(
        "step {step} is out of range: this shard's next step is {next}, and a push may be \
         at most {} steps past it (and at most step {})",
        crate::sync::MAX_STEP_AHEAD,
        crate::sync::MAX_STEP
    )
}

/// What the ledger and the open step together say of `o`'s batches (see
/// [`Ledger::peek`]).
fn open_mark(open: &[(u64, Origin)], ledger: &Ledger, o: Origin) -> LedgerMark {
    if ledger.contains(o.pass, o.task) {
        return LedgerMark::Repeat;
    }
    let in_open = |b: u32| {
        open.iter().any(|(_, x)| {
            x.pass == o.pass
                && x.task == o.task
                && (x.seq..x.seq.saturating_add(x.count)).contains(&b)
        })
    };
    let batches = o.seq..o.seq.saturating_add(o.count);
    let taken = batches
        .clone()
        .filter(|&b| {
            in_open(b) || ledger.peek(Origin::batch(o.pass, o.task, b)) == LedgerMark::Repeat
        })
        .count();
    match taken {
        0 => LedgerMark::Fresh,
        n if n == batches.len() => LedgerMark::Repeat,
        _ => LedgerMark::Overlap,
    }
}

impl ShardCore {
    /// Sync: the step to push next; async: 0.
    pub fn next_step(&self) -> u64 {
        self.sync.as_ref().map_or(0, |s| lock(s).next_step())
    }

    /// Sync: the last step applied.
    pub fn last_closed(&self) -> u64 {
        self.sync.as_ref().map_or(0, |s| lock(s).last_closed())
    }

    /// Sync: a receiver of the last applied step.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.closed_tx.subscribe()
    }

    /// Sync: the participants and who pushed the open step.
    pub fn sync_members(&self) -> (Vec<String>, Vec<String>) {
        match &self.sync {
            Some(s) => {
                let s = lock(s);
                (
                    s.participants().map(str::to_owned).collect(),
                    s.contributed().map(str::to_owned).collect(),
                )
            }
            None => (Vec::new(), Vec::new()),
        }
    }

    fn sync_state(&self) -> &Mutex<SyncState> {
        // Callers check `is_sync` first; an async shard never reaches the sync path.
        self.sync
            .as_ref()
            .unwrap_or_else(|| unreachable!("sync call on an async shard"))
    }

    /// Sync mode: admits `push` into a step and, when admitted, accumulates it and
    /// applies the step if it is complete. Call from a blocking thread; runs to
    /// completion even if the caller stops waiting.
    pub fn sync_push(&self, push: &Push, now: Instant) -> Result<Admit, PsError> {
        if !self.is_sync() {
            return Err(PsError::InvalidArgument(
                "the shard is in async mode".into(),
            ));
        }
        let (admit, close) = {
            // The origin is checked and, when the push joins a step, recorded in one go, so
            // that two pushes of one batch (a trainer that lost its task, and the one that
            // took it over) never both join.
            let mut open = lock(&self.open_origins);
            // A trainer asking again about a step it took part in (its wait ran out while
            // the step was open, or the answer was lost) is answered by the step state
            // machine: in progress, or applied. Any other push of a batch already in a
            // step is a repeat.
            let own_retry = lock(self.sync_state()).took_part(&push.trainer, push.step);
            let mark = match push.origin {
                Some(o) if !own_retry => open_mark(&open, &lock(&self.ledger), o),
                _ => LedgerMark::Fresh,
            };
            if let (LedgerMark::Overlap, Some(o)) = (mark, push.origin) {
                return Err(self.overlap(o));
            }
            let repeat = mark == LedgerMark::Repeat;
            if repeat {
                // Already applied (its stale step resent, a task trained again): this
                // trainer takes no part in the step; its next push brings it back.
                let (_, close) = lock(self.sync_state()).leave(&push.trainer);
                drop(open);
                if let Some(job) = close {
                    self.sync_close(job);
                }
                bump(&self.counters.duplicate_pushes);
                return Ok(Admit::AlreadyApplied { step: push.step });
            }
            let (admit, close) = lock(self.sync_state()).admit(&push.trainer, push.step, now);
            if let (Admit::Join { step }, Some(o)) = (&admit, push.origin) {
                open.push((*step, o));
            }
            (admit, close)
        };
        if let Some(job) = close {
            self.sync_close(job);
        }
        match admit {
            Admit::Join { step } => {
                self.accumulate(push);
                bump(&self.counters.pushes_applied);
                let close = lock(self.sync_state()).accumulated(&push.trainer);
                if let Some(job) = close {
                    self.sync_close(job);
                }
                Ok(Admit::Join { step })
            }
            Admit::AlreadyApplied { .. } | Admit::InProgress { .. } => {
                bump(&self.counters.duplicate_pushes);
                Ok(admit)
            }
            Admit::Stale { .. } => {
                bump(&self.counters.stale_pushes);
                Ok(admit)
            }
            Admit::Wait => Ok(admit),
            Admit::OutOfRange { next } => Err(self.invalid(out_of_range(push.step, next))),
        }
    }

    fn accumulate(&self, push: &Push) {
        for (local, bytes) in &push.dense {
            let mut b = lock(&self.blocks[*local]);
            let n = b.values.len();
            if b.acc.len() != n {
                b.acc = vec![0.0; n];
            }
            wire::add_into(bytes, &mut b.acc);
            b.has_acc = true;
        }
        for s in &push.sparse {
            let t = &self.tables[s.table];
            let dim = t.dim;
            for (i, &r) in s.rows.iter().enumerate() {
                let mut st = lock(&t.stripes[stripe_of(r)]);
                let acc = st.acc.entry(r).or_insert_with(|| vec![0.0; dim]);
                wire::add_into(&s.values[i * dim * 4..(i + 1) * dim * 4], acc);
            }
        }
    }

    /// Sync mode: a pull's view of one step (no step is applied while it is held).
    /// Async mode: nothing.
    pub(super) fn step_view(&self) -> Option<RwLockReadGuard<'_, ()>> {
        self.is_sync().then(|| {
            self.step_lock
                .read()
                .unwrap_or_else(PoisonError::into_inner)
        })
    }

    /// Sync mode: applies the mean of the accumulated gradients of `job`'s step,
    /// snapshots it when a checkpoint is due, and wakes the waiting pushes. Pulls wait
    /// while the step is applied.
    pub fn sync_close(&self, job: CloseJob) {
        let applying = self
            .step_lock
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let finite = self.accumulated_finite();
        if let Some(stream) = self.stream.get() {
            let op = self.step_op(job, finite);
            if let Err(e) = (stream.0)(&op) {
                // No longer primary: the step is not applied here; its trainers' pushes
                // time out and go to the new primary, where the step opens again.
                tracing::warn!(shard = self.index, step = job.step, error = %e, "step not closed: the replication stream refused it");
                self.clear_accumulated();
                return;
            }
        }
        if finite {
            self.apply_accumulated(job);
        } else {
            // Finite gradients may sum past f32's range: such a step changes nothing.
            self.clear_accumulated();
            bump(&self.counters.nonfinite_rejected);
            tracing::error!(
                shard = self.index,
                step = job.step,
                trainers = job.contributors,
                "the step's summed gradients overflow to infinity; step dropped"
            );
        }
        // The step's batches are in the parameters now (or dropped for good with it).
        {
            let mut open = lock(&self.open_origins);
            let mut ledger = lock(&self.ledger);
            open.retain(|&(step, o)| {
                if step <= job.step {
                    // Checked when the push was admitted.
                    let _ = ledger.mark(o);
                    false
                } else {
                    true
                }
            });
        }
        bump(&self.counters.steps_closed);
        if job.timed_out > 0 {
            bump(&self.counters.step_timeouts);
            self.counters
                .trainers_dropped
                .fetch_add(u64::from(job.timed_out), Ordering::Relaxed);
        }
        let cp = &self.checkpoints;
        let target = cp.target.load(Ordering::Acquire);
        let due_every = cp
            .every_steps
            .is_some_and(|n| n > 0 && job.step.is_multiple_of(n));
        let due_target = target > 0 && job.step >= target;
        if due_target {
            if job.step != target {
                tracing::warn!(
                    shard = self.index,
                    step = job.step,
                    target,
                    "requested checkpoint step skipped; checkpointing this step instead"
                );
            }
            let _ = cp
                .target
                .compare_exchange(target, 0, Ordering::AcqRel, Ordering::Acquire);
        }
        if due_every || due_target {
            let snap = self.snapshot_at(job.step, job.step);
            cp.slot.put(snap);
        }
        lock(self.sync_state()).closed(job);
        drop(applying);
        self.closed_tx.send_replace(job.step);
        tracing::debug!(
            shard = self.index,
            step = job.step,
            trainers = job.contributors,
            "step applied"
        );
    }

    /// Whether every accumulated gradient (dense and sparse) is finite.
    fn accumulated_finite(&self) -> bool {
        let finite = |v: &[f32]| v.iter().all(|x| x.is_finite());
        self.blocks.iter().all(|b| {
            let b = lock(b);
            !b.has_acc || finite(&b.acc)
        }) && self.tables.iter().all(|t| {
            t.stripes
                .iter()
                .all(|s| lock(s).acc.values().all(|a| finite(a)))
        })
    }

    /// Forgets the accumulated gradients.
    pub(super) fn clear_accumulated(&self) {
        for b in &self.blocks {
            let mut b = lock(b);
            if b.has_acc {
                b.acc.fill(0.0);
                b.has_acc = false;
            }
        }
        for t in &self.tables {
            for stripe in &t.stripes {
                lock(stripe).acc.clear();
            }
        }
    }

    /// Applies the mean of the accumulated gradients of `job`'s step.
    pub(super) fn apply_accumulated(&self, job: CloseJob) {
        let scale = 1.0 / job.contributors.max(1) as f32;
        let u = self.updates.fetch_add(1, Ordering::AcqRel);
        let lr = self.optimizer.lr(u);
        for b in &self.blocks {
            let mut b = lock(b);
            if !b.has_acc {
                continue;
            }
            let b = &mut *b;
            self.optimizer
                .step(lr, &mut b.values, &b.acc, scale, &mut b.state);
            b.acc.fill(0.0);
            b.has_acc = false;
            b.version += 1;
        }
        for (ti, t) in self.tables.iter().enumerate() {
            for stripe in &t.stripes {
                let acc = std::mem::take(&mut lock(stripe).acc);
                if acc.is_empty() {
                    continue;
                }
                let rows: Vec<u64> = acc.keys().copied().collect();
                let mut values = Vec::with_capacity(rows.len() * t.dim * 4);
                for r in &rows {
                    for v in &acc[r] {
                        values.extend_from_slice(&v.to_le_bytes());
                    }
                }
                self.apply_rows(
                    &SparseUpdate {
                        table: ti,
                        rows,
                        values: Bytes::from(values),
                    },
                    lr,
                    scale,
                );
            }
        }
    }

    fn sync_apply(&self, f: impl FnOnce(&mut SyncState) -> Option<CloseJob>) {
        let Some(s) = &self.sync else { return };
        let close = f(&mut lock(s));
        if let Some(job) = close {
            self.sync_close(job);
        }
    }

    /// Sync mode: `trainer` stops taking part until its next push (`Leave`); returns
    /// whether it was taking part.
    pub fn sync_leave(&self, trainer: &str) -> bool {
        let mut was = false;
        self.sync_apply(|s| {
            let (w, close) = s.leave(trainer);
            was = w;
            close
        });
        if was {
            bump(&self.counters.trainers_dropped);
        }
        was
    }

    /// Sync mode: `trainer`'s registration ended; returns whether the open step was
    /// waiting for it.
    pub fn sync_member_left(&self, trainer: &str) -> bool {
        let mut was = false;
        self.sync_apply(|s| {
            let (w, close) = s.member_left(trainer);
            was = w;
            close
        });
        if was {
            bump(&self.counters.trainers_dropped);
        }
        was
    }

    /// Sync mode: `trainer` registered.
    pub fn sync_member_joined(&self, trainer: &str) {
        if let Some(s) = &self.sync {
            lock(s).member_joined(trainer);
        }
    }

    /// Sync mode: reconciles the registry members with a listing.
    pub fn sync_set_members(&self, members: std::collections::BTreeSet<String>) {
        self.sync_apply(|s| s.set_members(members));
        self.members_seeded.store(true, Ordering::Release);
    }

    /// Sync mode: whether the registry members were given at least once (a step must
    /// not open before: it would expect nobody).
    pub fn sync_members_seeded(&self) -> bool {
        self.members_seeded.load(Ordering::Acquire)
    }

    /// Sync mode: enforces the step timeout.
    pub fn sync_tick(&self, now: Instant) {
        let Some(s) = &self.sync else { return };
        let close = {
            let mut s = lock(s);
            let missing = s.missing();
            let job = s.tick(now);
            if job.is_some() {
                tracing::warn!(
                    shard = self.index,
                    ?missing,
                    "step timed out; dropping silent trainers from it"
                );
            }
            job
        };
        if let Some(job) = close {
            self.sync_close(job);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Mode;
    use crate::shard::testutil::{all, core, push};

    #[test]
    fn sync_steps_apply_the_mean_of_the_contributors() {
        let c = core(Mode::sync(), 0, 1);
        let now = Instant::now();
        c.sync_set_members(["a".to_string()].into());
        let a = c.validate_push(push(&c, "a", 1, 1, 2.0, &[3])).unwrap();
        assert_eq!(c.sync_push(&a, now).unwrap(), Admit::Join { step: 1 });
        // a alone was registered at step 1: applied at once.
        assert_eq!(c.last_closed(), 1);
        assert!(all(&c).iter().all(|&v| v == -2.0));
        c.sync_member_joined("b");
        let a2 = c.validate_push(push(&c, "a", 1, 2, 2.0, &[3])).unwrap();
        let b2 = c.validate_push(push(&c, "b", 1, 2, 4.0, &[])).unwrap();
        assert_eq!(c.sync_push(&b2, now).unwrap(), Admit::Join { step: 2 });
        assert_eq!(c.last_closed(), 1, "waits for a");
        assert_eq!(
            c.sync_push(&b2, now).unwrap(),
            Admit::InProgress { step: 2 }
        );
        assert_eq!(c.sync_push(&a2, now).unwrap(), Admit::Join { step: 2 });
        assert_eq!(c.last_closed(), 2);
        // mean(2, 4) = 3
        assert!(all(&c).iter().all(|&v| v == -5.0), "{:?}", all(&c));
        // Row 3: step 1: -2; step 2: only a pushed it (2), divided by 2 trainers: -1.
        assert_eq!(
            wire::decode(&c.pull_sparse(0, &[3], 1 << 20).unwrap()),
            vec![-3.0, -3.0]
        );
        assert_eq!(
            c.sync_push(&a2, now).unwrap(),
            Admit::AlreadyApplied { step: 2 }
        );
        // b dies before step 3: a's push waits, b leaves, the step closes with a alone.
        let a3 = c.validate_push(push(&c, "a", 1, 3, 1.0, &[])).unwrap();
        assert_eq!(c.sync_push(&a3, now).unwrap(), Admit::Join { step: 3 });
        assert_eq!(c.last_closed(), 2);
        assert!(c.sync_member_left("b"));
        assert_eq!(c.last_closed(), 3);
        assert!(all(&c).iter().all(|&v| v == -6.0));
        // A runaway step is refused, not admitted into the step counter.
        let runaway = c
            .validate_push(push(&c, "a", 1, u64::MAX, 1.0, &[]))
            .unwrap();
        assert!(matches!(
            c.sync_push(&runaway, now),
            Err(PsError::InvalidArgument(_))
        ));
        assert_eq!(c.next_step(), 4);
    }

    /// A push of task batch `seq` (pass 0, task 0) by `trainer` at `step`, gradient `g`.
    fn from(c: &ShardCore, trainer: &str, step: u64, g: f32, seq: u32) -> Push {
        let mut p = push(c, trainer, 1, step, g, &[]);
        p.origin = Some(crate::shard::Origin {
            pass: 0,
            task: 0,
            seq,
            count: 1,
        });
        c.validate_push(p).unwrap()
    }

    /// A run of batches partly in the open step, or partly applied, is refused whole.
    #[test]
    fn a_run_partly_taken_by_another_attempt_does_not_join() {
        let c = core(Mode::sync(), 0, 1);
        let now = Instant::now();
        c.sync_set_members(["a".to_string(), "b".to_string()].into());
        let run = |trainer: &str, step: u64, seq: u32, count: u32| {
            let mut p = from(&c, trainer, step, 1.0, seq);
            p.origin = p.origin.map(|o| crate::shard::Origin { count, ..o });
            p
        };
        assert_eq!(
            c.sync_push(&run("a", 1, 0, 2), now).unwrap(),
            Admit::Join { step: 1 }
        );
        // Batches 1..3: batch 1 is in the open step.
        assert!(matches!(
            c.sync_push(&run("b", 1, 1, 2), now),
            Err(PsError::Overlap {
                first: 1,
                count: 2,
                ..
            })
        ));
        assert_eq!(c.last_closed(), 0, "b's refused push closed nothing");
        assert_eq!(
            c.sync_push(&run("b", 1, 2, 1), now).unwrap(),
            Admit::Join { step: 1 }
        );
        assert_eq!(c.last_closed(), 1);
        // Applied now: batches 1..3 still overlap, 0..3 too; 0..2 is a repeat.
        assert!(matches!(
            c.sync_push(&run("a", 2, 0, 4), now),
            Err(PsError::Overlap { .. })
        ));
        assert_eq!(
            c.sync_push(&run("b", 2, 0, 2), now).unwrap(),
            Admit::AlreadyApplied { step: 2 }
        );
        assert!(
            all(&c).iter().all(|&v| v == -1.0),
            "one step of two pushes, its mean"
        );
    }

    #[test]
    fn a_batch_joins_one_step_once_whoever_resends_it_and_however_late() {
        let c = core(Mode::sync(), 0, 1);
        let now = Instant::now();
        c.sync_set_members(["a".to_string(), "b".to_string()].into());
        // a's batch 0 joins step 1, which waits for b.
        let a1 = from(&c, "a", 1, 1.0, 0);
        assert_eq!(c.sync_push(&a1, now).unwrap(), Admit::Join { step: 1 });
        // a asks again while the step is open (its wait on the server ran out): still
        // in progress, not "already applied" (the step is not), and a stays expected.
        assert_eq!(
            c.sync_push(&a1, now).unwrap(),
            Admit::InProgress { step: 1 }
        );
        assert_eq!(c.sync_members().0, vec!["a", "b"], "a takes part still");
        // The same batch sent by b (it took a's task over) does not join a second time.
        let b1 = from(&c, "b", 1, 1.0, 0);
        assert_eq!(
            c.sync_push(&b1, now).unwrap(),
            Admit::AlreadyApplied { step: 1 }
        );
        assert_eq!(c.last_closed(), 1, "b sat the step out: it closed with a");
        assert!(all(&c).iter().all(|&v| v == -1.0), "{:?}", all(&c));
        // 20 more steps of a alone (b left): step 1 is far outside the 16 remembered ones.
        for step in 2..=21 {
            let p = from(&c, "a", step, 0.0, step as u32);
            assert_eq!(c.sync_push(&p, now).unwrap(), Admit::Join { step });
        }
        assert_eq!(c.last_closed(), 21);
        // A retry of step 1, older than the window of remembered steps, and the same
        // batch resent at the next step (as after `StaleStep`): the ledger knows it.
        assert_eq!(
            c.sync_push(&a1, now).unwrap(),
            Admit::AlreadyApplied { step: 1 }
        );
        let resent = from(&c, "a", 22, 1.0, 0);
        assert_eq!(
            c.sync_push(&resent, now).unwrap(),
            Admit::AlreadyApplied { step: 22 }
        );
        assert_eq!(c.last_closed(), 21, "nothing joined step 22");
        assert!(all(&c).iter().all(|&v| v == -1.0), "{:?}", all(&c));
        // Without an origin, the window is all there is: an old retry is stale.
        let mut old = push(&c, "a", 1, 1, 1.0, &[]);
        old.origin = None;
        let old = c.validate_push(old).unwrap();
        assert_eq!(c.sync_push(&old, now).unwrap(), Admit::Stale { next: 22 });
        assert_eq!(c.counters.duplicate_pushes.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn a_sync_step_whose_sum_overflows_is_dropped() {
        let c = core(Mode::sync(), 0, 1);
        let now = Instant::now();
        c.sync_set_members(["a".to_string(), "b".to_string()].into());
        // Each gradient is finite; their sum is not.
        for t in ["a", "b"] {
            let p = c.validate_push(push(&c, t, 1, 1, 3e38, &[3])).unwrap();
            assert_eq!(c.sync_push(&p, now).unwrap(), Admit::Join { step: 1 });
        }
        assert_eq!(c.last_closed(), 1, "the step is over");
        assert!(all(&c).iter().all(|&v| v == 0.0), "{:?}", all(&c));
        assert_eq!(
            wire::decode(&c.pull_sparse(0, &[3], 1 << 20).unwrap()),
            vec![0.0, 0.0]
        );
        assert_eq!(c.counters.nonfinite_rejected.load(Ordering::Relaxed), 1);
        // The next step applies as usual.
        for t in ["a", "b"] {
            let p = c.validate_push(push(&c, t, 1, 2, 1.0, &[3])).unwrap();
            c.sync_push(&p, now).unwrap();
        }
        assert_eq!(c.last_closed(), 2);
        assert!(all(&c).iter().all(|&v| v == -1.0), "{:?}", all(&c));
        // Async: a row repeated within one push may sum past the range too.
        let c = core(Mode::Async, 0, 1);
        let p = c
            .validate_push(push(&c, "t", 1, 1, 3e38, &[5, 5, 7]))
            .unwrap();
        assert!(c.apply_async(&p).unwrap().applied);
        let rows = wire::decode(&c.pull_sparse(0, &[5, 7], 1 << 20).unwrap());
        assert_eq!(&rows[..2], &[0.0, 0.0], "row 5 left as it was");
        assert_eq!(&rows[2..], &[-3e38, -3e38]);
        assert_eq!(c.counters.nonfinite_rejected.load(Ordering::Relaxed), 1);
    }
}
