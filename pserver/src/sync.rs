//! The sync-mode step protocol of one shard, as a pure state machine (no I/O, time is an
//! argument).
//!
//! - The trainers alive are the members of the trainer registry (`trainers/<id>`, each
//!   under its own lease), minus those marked *absent*: a trainer that called `Leave` or
//!   stayed silent past the step timeout. An absent trainer is back with its next push.
//! - A step opens with its first admitted push. It *expects* the trainers alive at that
//!   moment; a trainer that registers later enters at the next step (a push it sends for
//!   the open step is still added, since it was computed on the same parameters, but the
//!   step does not wait for it).
//! - The step closes once every expected trainer pushed it and every admitted push
//!   finished accumulating. A trainer whose lease expires (it left the registry) is no
//!   longer expected, nor is one that pushes a later step without this one. The update
//!   is the sum of the gradients of the trainers that pushed the step divided by their
//!   number.
//! - A push for a step already closed is stale (the trainer pulls and pushes the next
//!   step); a retried push of a step the trainer contributed to is "in progress" while
//!   the step is open and "already applied" once it closed ([`SyncState::took_part`]).
//! - A push for a step beyond the open one waits for the open step to close; with no
//!   step open, a push for a later step jumps the counter (a shard restored from an
//!   older checkpoint catches up with the trainers).
//! - Steps are bounded: none beyond [`MAX_STEP`], and once this shard applied a step,
//!   none more than [`MAX_STEP_AHEAD`] past the next one (a runaway counter from a buggy
//!   trainer would make every other trainer's push stale). Until then any step is
//!   accepted, so that a restored or re-initialised shard catches up.

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

/// Closed steps whose contributors are remembered, to answer retries.
const RECENT_STEPS: usize = 16;
/// The largest step accepted (far from overflowing any step arithmetic).
pub const MAX_STEP: u64 = 1 << 62;
/// How far past the next step a push may be, once the shard applied a step.
pub const MAX_STEP_AHEAD: u64 = 1 << 20;

/// What a push is told by [`SyncState::admit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admit {
    /// Accumulate the gradients into step `step`, then call
    /// [`SyncState::accumulated`].
    Join {
        /// The step joined.
        step: u64,
    },
    /// This trainer's gradients of this step were already applied.
    AlreadyApplied {
        /// The step.
        step: u64,
    },
    /// This trainer's gradients of this open step are already accumulated (a retry):
    /// wait for the step to close.
    InProgress {
        /// The step.
        step: u64,
    },
    /// The step is closed and this trainer did not take part: pull, push `next`.
    Stale {
        /// The step to push next.
        next: u64,
    },
    /// Not now (a step is being applied, or the push is for a later step than the open
    /// one): wait for the next change and ask again.
    Wait,
    /// The step is out of range (beyond [`MAX_STEP`], or more than [`MAX_STEP_AHEAD`]
    /// past `next`): refused.
    OutOfRange {
        /// The step to push next.
        next: u64,
    },
}

/// A step ready to be applied: the caller applies `sum / contributors` and then calls
/// [`SyncState::closed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CloseJob {
    /// The step.
    pub step: u64,
    /// Trainers whose gradients are in it.
    pub contributors: u32,
    /// Expected trainers dropped from it by the step timeout.
    pub timed_out: u32,
}

#[derive(Debug, Clone)]
struct Open {
    step: u64,
    expected: BTreeSet<String>,
    contributed: BTreeSet<String>,
    in_flight: u32,
    opened: Instant,
}

/// The step state of one shard.
#[derive(Debug, Clone)]
pub struct SyncState {
    last_closed: u64,
    open: Option<Open>,
    applying: Option<u64>,
    members: BTreeSet<String>,
    absent: BTreeSet<String>,
    recent: VecDeque<(u64, BTreeSet<String>)>,
    step_timeout: Duration,
    /// Whether a step was applied since this state was created.
    closed_any: bool,
}

impl SyncState {
    /// A shard whose last applied step is `last_closed` (0: none yet).
    pub fn new(last_closed: u64, step_timeout: Duration) -> Self {
        SyncState {
            last_closed,
            open: None,
            applying: None,
            members: BTreeSet::new(),
            absent: BTreeSet::new(),
            recent: VecDeque::new(),
            step_timeout,
            closed_any: false,
        }
    }

    /// The last applied step.
    pub fn last_closed(&self) -> u64 {
        self.last_closed
    }

    /// The step a trainer should push next: the open one, else the one after the last
    /// applied.
    pub fn next_step(&self) -> u64 {
        match (&self.open, self.applying) {
            (_, Some(s)) => s + 1,
            (Some(o), None) => o.step,
            (None, None) => self.last_closed + 1,
        }
    }

    /// Whether a step is being applied.
    pub fn is_applying(&self) -> bool {
        self.applying.is_some()
    }

    /// The trainers alive and not absent: those the next step will expect.
    pub fn participants(&self) -> impl Iterator<Item = &str> {
        self.members
            .iter()
            .filter(|m| !self.absent.contains(*m))
            .map(String::as_str)
    }

    /// Who pushed the open step.
    pub fn contributed(&self) -> impl Iterator<Item = &str> {
        self.open
            .iter()
            .flat_map(|o| o.contributed.iter().map(String::as_str))
    }

    /// Whether `trainer`'s gradients are in step `step`: it joined the open step (or the
    /// one being applied), or one of the recently closed steps. A push of that step by
    /// this trainer is its own retry, which [`admit`](Self::admit) answers.
    pub fn took_part(&self, trainer: &str, step: u64) -> bool {
        self.open
            .as_ref()
            .is_some_and(|o| o.step == step && o.contributed.contains(trainer))
            || self
                .recent
                .iter()
                .any(|(s, who)| *s == step && who.contains(trainer))
    }

    /// Replaces the registry members (a reconciliation with a listing). Returns a step
    /// that became ready to close.
    pub fn set_members(&mut self, members: BTreeSet<String>) -> Option<CloseJob> {
        self.absent.retain(|a| members.contains(a));
        if let Some(o) = &mut self.open {
            o.expected.retain(|e| members.contains(e));
        }
        self.members = members;
        self.ready()
    }

    /// A trainer registered.
    pub fn member_joined(&mut self, trainer: &str) {
        self.members.insert(trainer.to_owned());
    }

    /// A trainer's registration ended (deregistered, or its lease expired). Its gradients
    /// already accumulated in the open step stay. Returns whether the open step expected
    /// it, and a step that became ready to close.
    pub fn member_left(&mut self, trainer: &str) -> (bool, Option<CloseJob>) {
        self.members.remove(trainer);
        self.absent.remove(trainer);
        let was = self
            .open
            .as_mut()
            .is_some_and(|o| o.expected.remove(trainer) && !o.contributed.contains(trainer));
        (was, self.ready())
    }

    /// A trainer stops taking part until its next push (`Leave`). Returns whether it
    /// was taking part.
    pub fn leave(&mut self, trainer: &str) -> (bool, Option<CloseJob>) {
        let was = self.members.contains(trainer) && !self.absent.contains(trainer);
        if self.members.contains(trainer) {
            self.absent.insert(trainer.to_owned());
        }
        if let Some(o) = &mut self.open
            && !o.contributed.contains(trainer)
        {
            o.expected.remove(trainer);
        }
        (was, self.ready())
    }

    /// Decides what to do with `trainer`'s push of `step`. The second value is a step
    /// that became ready to close as a consequence.
    pub fn admit(&mut self, trainer: &str, step: u64, now: Instant) -> (Admit, Option<CloseJob>) {
        let next = self.next_step();
        if step > MAX_STEP || (self.closed_any && step > next.saturating_add(MAX_STEP_AHEAD)) {
            return (Admit::OutOfRange { next }, None);
        }
        if self
            .recent
            .iter()
            .any(|(s, who)| *s == step && who.contains(trainer))
        {
            return (Admit::AlreadyApplied { step }, None);
        }
        // A trainer that pushes takes part again.
        self.absent.remove(trainer);
        if let Some(applying) = self.applying {
            if step == applying
                && self
                    .open
                    .as_ref()
                    .is_some_and(|o| o.contributed.contains(trainer))
            {
                return (Admit::InProgress { step }, None);
            }
            return if step <= applying {
                (Admit::Stale { next: applying + 1 }, None)
            } else {
                (Admit::Wait, None)
            };
        }
        match &mut self.open {
            Some(o) if o.step == step => {
                if o.contributed.contains(trainer) {
                    return (Admit::InProgress { step }, None);
                }
                o.contributed.insert(trainer.to_owned());
                o.in_flight += 1;
                (Admit::Join { step }, None)
            }
            Some(o) if step < o.step => (Admit::Stale { next: o.step }, None),
            Some(o) => {
                // A later step: this trainer moved past the open one, which must no
                // longer wait for it.
                if !o.contributed.contains(trainer) {
                    o.expected.remove(trainer);
                }
                (Admit::Wait, self.ready())
            }
            None if step <= self.last_closed => (
                Admit::Stale {
                    next: self.last_closed + 1,
                },
                None,
            ),
            None => {
                let expected = self
                    .members
                    .iter()
                    .filter(|m| !self.absent.contains(*m))
                    .cloned()
                    .collect();
                self.open = Some(Open {
                    step,
                    expected,
                    contributed: BTreeSet::from([trainer.to_owned()]),
                    in_flight: 1,
                    opened: now,
                });
                (Admit::Join { step }, None)
            }
        }
    }

    /// `trainer`'s admitted push finished accumulating.
    pub fn accumulated(&mut self, trainer: &str) -> Option<CloseJob> {
        let o = self.open.as_mut()?;
        if o.contributed.contains(trainer) {
            o.in_flight = o.in_flight.saturating_sub(1);
        }
        self.ready()
    }

    /// Expected trainers that have not pushed the open step.
    pub fn missing(&self) -> Vec<String> {
        match &self.open {
            Some(o) => o.expected.difference(&o.contributed).cloned().collect(),
            None => Vec::new(),
        }
    }

    /// Marks absent the expected trainers that did not push a step open for longer
    /// than the step timeout, and closes it without them.
    pub fn tick(&mut self, now: Instant) -> Option<CloseJob> {
        if self.applying.is_some() {
            return None;
        }
        let o = self.open.as_mut()?;
        if now.saturating_duration_since(o.opened) < self.step_timeout {
            return None;
        }
        let missing: Vec<String> = o.expected.difference(&o.contributed).cloned().collect();
        if missing.is_empty() {
            return None;
        }
        for m in &missing {
            o.expected.remove(m);
        }
        self.absent.extend(missing.iter().cloned());
        self.ready().map(|mut job| {
            job.timed_out = missing.len() as u32;
            job
        })
    }

    /// The open step closes when nothing is in flight and every expected trainer
    /// pushed it.
    fn ready(&mut self) -> Option<CloseJob> {
        if self.applying.is_some() {
            return None;
        }
        let o = self.open.as_ref()?;
        if o.in_flight > 0 || !o.expected.is_subset(&o.contributed) {
            return None;
        }
        self.applying = Some(o.step);
        Some(CloseJob {
            step: o.step,
            contributors: o.contributed.len() as u32,
            timed_out: 0,
        })
    }

    /// The step of `job` was applied.
    /// A backup applied step `step` as its primary closed it: it is the last closed, and
    /// nothing is open here (the open step's pushes live on the primary only).
    pub fn replayed(&mut self, step: u64) {
        self.open = None;
        self.applying = None;
        self.last_closed = self.last_closed.max(step);
        self.closed_any = true;
    }

    pub fn closed(&mut self, job: CloseJob) {
        if self.applying != Some(job.step) {
            return;
        }
        self.applying = None;
        if let Some(o) = self.open.take() {
            self.recent.push_back((o.step, o.contributed));
            while self.recent.len() > RECENT_STEPS {
                self.recent.pop_front();
            }
        }
        self.last_closed = job.step;
        self.closed_any = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(10);

    fn with(members: &[&str], last_closed: u64) -> SyncState {
        let mut s = SyncState::new(last_closed, T);
        s.set_members(members.iter().map(|m| m.to_string()).collect());
        s
    }

    fn join(s: &mut SyncState, who: &str, step: u64, now: Instant) -> Option<CloseJob> {
        let (a, c) = s.admit(who, step, now);
        assert_eq!(a, Admit::Join { step }, "{who} step {step}");
        assert!(c.is_none());
        s.accumulated(who)
    }

    /// Joins and expects the step to close (then closes it).
    fn join_closing(s: &mut SyncState, who: &str, step: u64, now: Instant) -> CloseJob {
        let job = join(s, who, step, now).expect("step closes");
        s.closed(job);
        job
    }

    #[test]
    fn a_step_closes_when_every_live_trainer_pushed() {
        let now = Instant::now();
        let mut s = with(&["a", "b"], 0);
        assert_eq!(s.next_step(), 1);
        assert!(join(&mut s, "a", 1, now).is_none(), "waits for b");
        assert_eq!(s.missing(), vec!["b".to_string()]);
        assert_eq!(s.admit("a", 1, now).0, Admit::InProgress { step: 1 });
        let job = join(&mut s, "b", 1, now).unwrap();
        assert_eq!((job.step, job.contributors), (1, 2));
        assert_eq!(s.admit("a", 2, now).0, Admit::Wait, "applying");
        assert_eq!(s.admit("a", 1, now).0, Admit::InProgress { step: 1 });
        s.closed(job);
        assert_eq!(s.last_closed(), 1);
        assert_eq!(s.admit("a", 1, now).0, Admit::AlreadyApplied { step: 1 });
        // A newcomer pushing an old step is stale.
        assert_eq!(s.admit("c", 1, now).0, Admit::Stale { next: 2 });
    }

    #[test]
    fn a_dead_trainer_is_dropped_when_its_registration_ends() {
        let now = Instant::now();
        let mut s = with(&["a", "b"], 4);
        assert!(join(&mut s, "a", 5, now).is_none());
        let (was, job) = s.member_left("b");
        assert!(was);
        let job = job.unwrap();
        assert_eq!((job.step, job.contributors), (5, 1));
        s.closed(job);
        // b's contribution made before dying still counts.
        let mut s = with(&["a", "b", "c"], 0);
        assert!(join(&mut s, "b", 1, now).is_none());
        assert!(s.member_left("b").1.is_none(), "a and c still expected");
        assert!(join(&mut s, "a", 1, now).is_none());
        assert_eq!(join(&mut s, "c", 1, now).unwrap().contributors, 3);
    }

    #[test]
    fn a_joining_trainer_enters_at_the_next_step() {
        let now = Instant::now();
        let mut s = with(&["a", "b"], 0);
        assert!(join(&mut s, "a", 1, now).is_none());
        s.member_joined("c");
        // Step 1 does not wait for c.
        let job = join(&mut s, "b", 1, now).unwrap();
        assert_eq!(job.contributors, 2);
        s.closed(job);
        // Step 2 expects c.
        assert!(join(&mut s, "a", 2, now).is_none());
        assert!(join(&mut s, "b", 2, now).is_none());
        assert_eq!(join(&mut s, "c", 2, now).unwrap().contributors, 3);
        // A push of a joiner into a step still open is added, without being waited for.
        let mut s = with(&["a", "b"], 0);
        assert!(join(&mut s, "a", 1, now).is_none());
        s.member_joined("c");
        assert!(join(&mut s, "c", 1, now).is_none());
        assert_eq!(join(&mut s, "b", 1, now).unwrap().contributors, 3);
    }

    #[test]
    fn the_step_waits_for_pushes_in_flight() {
        let now = Instant::now();
        let mut s = with(&["a", "b"], 0);
        assert_eq!(s.admit("a", 1, now).0, Admit::Join { step: 1 });
        assert_eq!(s.admit("b", 1, now).0, Admit::Join { step: 1 });
        assert!(s.accumulated("a").is_none(), "b still accumulating");
        assert_eq!(s.accumulated("b").unwrap().contributors, 2);
    }

    #[test]
    fn silent_and_leaving_trainers_are_absent_until_they_push() {
        let t0 = Instant::now();
        let mut s = with(&["a", "b"], 0);
        assert!(join(&mut s, "a", 1, t0).is_none());
        assert!(s.tick(t0 + Duration::from_secs(5)).is_none());
        let job = s.tick(t0 + T).unwrap();
        assert_eq!((job.step, job.contributors, job.timed_out), (1, 1, 1));
        s.closed(job);
        // b is absent: step 2 does not wait for it.
        join_closing(&mut s, "a", 2, t0);
        // b's late push of step 1 is stale, and brings it back for step 3.
        assert_eq!(s.admit("b", 1, t0).0, Admit::Stale { next: 3 });
        assert!(join(&mut s, "a", 3, t0).is_none());
        // a leaves explicitly after pushing: its push counts, b completes the step.
        assert!(s.leave("a").0);
        assert_eq!(join(&mut s, "b", 3, t0).unwrap().contributors, 2);
        assert_eq!(s.participants().collect::<Vec<_>>(), vec!["b"]);
    }

    #[test]
    fn steps_out_of_range_are_refused() {
        let now = Instant::now();
        let mut s = with(&["a"], 0);
        assert_eq!(s.admit("a", u64::MAX, now).0, Admit::OutOfRange { next: 1 });
        assert_eq!(
            s.admit("a", MAX_STEP + 1, now).0,
            Admit::OutOfRange { next: 1 }
        );
        // Before any step is applied here, a push far ahead is how a restored shard
        // catches up.
        let far = 5 * MAX_STEP_AHEAD;
        join_closing(&mut s, "a", far, now);
        assert_eq!(
            s.admit("a", far + 1 + MAX_STEP_AHEAD + 1, now).0,
            Admit::OutOfRange { next: far + 1 }
        );
        join_closing(&mut s, "a", far + 1 + MAX_STEP_AHEAD, now);
        assert_eq!(s.last_closed(), far + 1 + MAX_STEP_AHEAD);
    }

    #[test]
    fn a_push_ahead_jumps_the_counter() {
        let now = Instant::now();
        // Restored at step 4 while the trainers are at step 9.
        let mut s = with(&["a", "b"], 4);
        assert_eq!(s.admit("a", 9, now).0, Admit::Join { step: 9 });
        assert_eq!(s.admit("b", 5, now).0, Admit::Stale { next: 9 });
        assert!(s.accumulated("a").is_none());
        let job = join(&mut s, "b", 9, now).unwrap();
        s.closed(job);
        // a pushes step 11 without pushing step 10: step 10 no longer waits for it.
        assert!(join(&mut s, "b", 10, now).is_none());
        let (a, job) = s.admit("a", 11, now);
        assert_eq!(a, Admit::Wait);
        let job = job.unwrap();
        assert_eq!((job.step, job.contributors), (10, 1));
        s.closed(job);
        assert_eq!(s.admit("a", 11, now).0, Admit::Join { step: 11 });
    }
}
