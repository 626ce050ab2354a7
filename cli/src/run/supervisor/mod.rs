//! The supervisor of `edl run`'s processes as a pure state machine: events in (start,
//! a process exited, the clock moved, a scale request, a fault injected, stop), effects
//! out (spawn, signal, kill). Time is an argument and nothing here touches a process:
//! the shell (`processes.rs`, `procs.rs`) runs the effects, so this is tested without
//! processes.
//!
//! The restart policy counts crash loops, not preemptions. A *crash* is an exit that was
//! not asked for, not caused by an injected fault, and not a trainer's successful end
//! (nor a trainer's exit once the job has finished). A process is *healthy* once it has
//! run `healthy_after` (`cluster.healthy_after`, 30 s by default); a *slot* is a master
//! or pserver index or a trainer number, kept by the restarts of its process.
//!
//! Invariants:
//! - Every crash is restarted and counted in [`restarts`](Supervisor::restarts), but the
//!   one that makes a crash loop (below): that one fails the job. Nothing else does.
//! - A crash of a process that had been healthy (a preemption: counted in
//!   [`preemptions`](Supervisor::preemptions)) is restarted at once and does not count
//!   against the budget.
//! - A crash of a process that had not been healthy is a *fast failure* of its slot: the
//!   slot's fast failures in a row are counted, and the job fails when they exceed
//!   `max_restarts` (the budget is per slot: independent crashes of different slots
//!   never add up). Otherwise it is restarted after a backoff that doubles with that
//!   count `n` (0.5 s × 2^n, n ≤ 5, at most 10 s: 1 s, 2 s, 4 s, 8 s, then 10 s).
//! - The count of a slot goes back to 0 when one of its processes exits after a healthy
//!   run, whatever the cause: after a healthy run the next crash restarts at once.
//! - A process hit by an injected fault (SIGKILL, SIGSTOP past its lease, SIGTERM) is
//!   restarted at once, whatever its exit status, and does not count; a fast failure
//!   after it continues its slot's count.
//! - [`exited`](Supervisor::exited) tells the shell of each crash it restarts
//!   ([`Crash`]), whose recovery (until the role serves again) the shell measures, as it
//!   measures an injected fault's.
//! - A process asked to stop (drained by a scale-down, or at shutdown) is never
//!   restarted; nor is a trainer once the job has finished.
//! - After a scale event, the trainers alive and not draining plus those waiting for a
//!   restart are the desired count, clamped to `[min_trainers, max_trainers]`.
//! - A SIGSTOPped process is sent SIGCONT once its stop is over, and before it is asked
//!   to stop.
//! - A trainer that has not registered with the job `register_within` after it started
//!   (or after etcd last answered, whichever is later) is SIGKILLed; its exit is a fast
//!   failure of its slot (never a preemption), so a trainer program that hangs fails the
//!   job under the same budget as one that crashes.
//! - A trainer the master names stuck (its task lease timed out while it stayed
//!   registered: alive, no report for the task timeout) is SIGKILLed once; its exit is
//!   restarted at once and counted as a preemption, never against the budget: a stall
//!   of the job's own (a pserver unreachable past the task timeout makes every trainer
//!   stuck) must not fail the job.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::chaos::Action;
use super::report::{Recovery, ScaleEvent};

/// A role of a supervised process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Role {
    Master,
    Pserver,
    Trainer,
}

impl Role {
    /// Its name (the subcommand that runs it).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Role::Master => "master",
            Role::Pserver => "pserver",
            Role::Trainer => "trainer",
        }
    }
}

/// A supervised process, unique over the run (a restart is a new process).
pub(crate) type ProcId = u64;

/// A signal to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sig {
    /// Pause (an injected fault).
    Stop,
    /// Resume.
    Cont,
    /// Stop gracefully (trainers drain).
    Term,
}

/// What the shell must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Effect {
    /// Start `role` in `slot` (master/pserver index, trainer number) as process `id`.
    Spawn {
        id: ProcId,
        role: Role,
        slot: u32,
        name: String,
    },
    /// Send a signal.
    Signal { id: ProcId, sig: Sig },
    /// SIGKILL (an injected fault).
    Kill { id: ProcId },
}

/// Why a live process is stuck: alive, but what it is there for has gone on without it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stuck {
    /// A trainer the master names stuck: its task lease timed out while it stayed
    /// registered (its task is already handed out again).
    NoProgress,
    /// A pserver that held its shard's claim (or its replica's registration) and holds
    /// nothing now, while its process lives: its lease ended because it stopped
    /// answering (stopped, hung), so its shard waits for a new claim.
    ClaimLost,
}

impl Stuck {
    /// The role it is about.
    pub(crate) fn role(self) -> Role {
        match self {
            Stuck::NoProgress => Role::Trainer,
            Stuck::ClaimLost => Role::Pserver,
        }
    }

    /// What it says in a log and an exit status.
    pub(crate) fn said(self) -> &'static str {
        match self {
            Stuck::NoProgress => "no report on its task for the task timeout",
            Stuck::ClaimLost => "its shard's lease ended while it lived",
        }
    }
}

/// The job's shape, from the spec's `[cluster]`.
#[derive(Debug, Clone)]
pub(crate) struct Limits {
    pub masters: u32,
    pub pservers: u32,
    pub trainers: u32,
    pub min_trainers: u32,
    pub max_trainers: u32,
    /// Fast failures in a row of one slot allowed before the job fails.
    pub max_restarts: u32,
    /// Run time after which a process is healthy.
    pub healthy_after: Duration,
    pub lease_ttl: Duration,
    /// How long a trainer may take to register.
    pub register_within: Duration,
    /// How long a process given a notice (`--chaos notice-*`) has before it is
    /// SIGKILLed.
    pub notice_deadline: Duration,
}

/// What the supervisor knows of a process.
#[derive(Debug, Clone)]
pub(crate) struct Proc {
    pub role: Role,
    pub slot: u32,
    pub name: String,
    /// Asked to stop (drain or shutdown): its exit is expected.
    pub stopping: bool,
    /// Hit by an injected fault: its death is not a crash.
    pub injected: bool,
    /// Resumed after an injected stop: alive and whole again, so a fault may hit it
    /// again (its death still is not a crash: it may come of the stop).
    pub resumed: bool,
    /// SIGSTOPped until then.
    pub stopped_until: Option<Instant>,
    /// Given a notice (SIGTERM): SIGKILLed at this deadline if it still runs.
    pub notice_until: Option<Instant>,
    /// When it was spawned.
    pub spawned: Instant,
    /// A trainer that has registered with the job.
    pub registered: bool,
    /// A trainer killed because it did not register in time.
    pub unregistered: bool,
    /// Killed because it was stuck, and why.
    pub stuck: Option<Stuck>,
}

/// A crash that [`Supervisor::exited`] restarts: the shell measures its recovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Crash {
    pub role: Role,
    pub slot: u32,
    /// The process that exited.
    pub process: String,
    /// It had run `healthy_after` (a preemption, restarted at once).
    pub healthy: bool,
}

/// What the supervisor keeps of a slot over its restarts.
#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    /// Restarts of any kind (the names of restarted trainers).
    generation: u32,
    /// Fast failures in a row (the budget and the backoff).
    fast_failures: u32,
}

/// A restart waiting for its time.
#[derive(Debug, Clone, Copy)]
struct Restart {
    role: Role,
    slot: u32,
    at: Instant,
}

/// The supervisor's state.
#[derive(Debug)]
pub(crate) struct Supervisor {
    limits: Limits,
    /// Where the processes' logs are (named in errors).
    logs_dir: PathBuf,
    started: Instant,
    /// Processes that run (in spawn order).
    procs: BTreeMap<ProcId, Proc>,
    next_id: ProcId,
    next_trainer: u32,
    desired_trainers: u32,
    /// Crash restarts, preemptions included.
    restarts: u32,
    /// Crash restarts of processes that had been healthy.
    preemptions: u32,
    slots: BTreeMap<(Role, u32), Slot>,
    restart_queue: Vec<Restart>,
    recoveries: Vec<Recovery>,
    scale_events: Vec<ScaleEvent>,
    /// Notices whose process still ran at the deadline (SIGKILLed then).
    notices_past_deadline: u32,
}

impl Supervisor {
    /// A supervisor of nothing yet; [`start`](Self::start) starts the job.
    pub(crate) fn new(limits: Limits, logs_dir: PathBuf, started: Instant) -> Supervisor {
        Supervisor {
            desired_trainers: limits.trainers,
            limits,
            logs_dir,
            started,
            procs: BTreeMap::new(),
            next_id: 0,
            next_trainer: 0,
            restarts: 0,
            preemptions: 0,
            slots: BTreeMap::new(),
            restart_queue: Vec::new(),
            recoveries: Vec::new(),
            scale_events: Vec::new(),
            notices_past_deadline: 0,
        }
    }

    /// The masters, the pservers and the trainers of the spec, started at `now`.
    pub(crate) fn start(&mut self, now: Instant) -> Vec<Effect> {
        let mut effects = Vec::new();
        for i in 0..self.limits.masters {
            effects.push(self.spawn(Role::Master, i, now));
        }
        for i in 0..self.limits.pservers {
            effects.push(self.spawn(Role::Pserver, i, now));
        }
        for _ in 0..self.limits.trainers {
            effects.push(self.spawn_trainer(now));
        }
        effects
    }

    fn spawn_trainer(&mut self, now: Instant) -> Effect {
        let n = self.next_trainer;
        self.next_trainer += 1;
        self.spawn(Role::Trainer, n, now)
    }

    fn spawn(&mut self, role: Role, slot: u32, now: Instant) -> Effect {
        let generation = self.slots.get(&(role, slot)).map_or(0, |s| s.generation);
        let name = match role {
            Role::Master => format!("master-{slot}"),
            Role::Pserver => format!("pserver-{slot}"),
            Role::Trainer => trainer_name(slot, generation),
        };
        let id = self.next_id;
        self.next_id += 1;
        self.procs.insert(
            id,
            Proc {
                role,
                slot,
                name: name.clone(),
                stopping: false,
                injected: false,
                resumed: false,
                stopped_until: None,
                notice_until: None,
                spawned: now,
                registered: false,
                unregistered: false,
                stuck: None,
            },
        );
        Effect::Spawn {
            id,
            role,
            slot,
            name,
        }
    }

    /// Whether [`exited`](Self::exited) needs to know if the job has finished for this
    /// exit (a trainer that failed without being asked to stop, or one hit by a fault).
    pub(crate) fn exit_needs_job_status(&self, id: ProcId, success: bool) -> bool {
        self.procs
            .get(&id)
            .is_some_and(|p| p.role == Role::Trainer && !p.stopping && (!success || p.injected))
    }

    /// Process `id` exited (`success`, described by `status`) at `now`. A crash is
    /// queued for a restart (at once after a healthy run, else after its backoff) and
    /// returned, so that its recovery is measured; an error when it makes its slot's
    /// fast failures exceed the budget (a crash loop).
    pub(crate) fn exited(
        &mut self,
        id: ProcId,
        success: bool,
        status: &str,
        job_finished: bool,
        now: Instant,
    ) -> anyhow::Result<Option<Crash>> {
        let Some(p) = self.procs.remove(&id) else {
            return Ok(None);
        };
        if p.role == Role::Trainer && success && !p.injected {
            tracing::info!(process = %p.name, "exited");
            return Ok(None);
        }
        if p.stopping || (p.role == Role::Trainer && job_finished) {
            return Ok(None);
        }
        let ran = now.saturating_duration_since(p.spawned);
        // A stuck trainer is restarted at once and not counted: the cause may be the
        // job's (a pserver unreachable for longer than the task timeout makes every
        // trainer stuck), which a crash budget must not turn into a failed job.
        let healthy = (ran >= self.limits.healthy_after || p.stuck.is_some()) && !p.unregistered;
        let status = if p.unregistered {
            format!(
                "killed: it did not register with the job within trainer.register_within ({})",
                humantime::format_duration(self.limits.register_within)
            )
        } else if let Some(why) = p.stuck {
            format!("killed: stuck ({})", why.said())
        } else {
            status.to_owned()
        };
        let slot = self.slots.entry((p.role, p.slot)).or_default();
        slot.generation += 1;
        if healthy {
            slot.fast_failures = 0;
        }
        let restart = |at| Restart {
            role: p.role,
            slot: p.slot,
            at,
        };
        if p.injected {
            tracing::info!(process = %p.name, %status, "restarting after an injected fault");
            self.restart_queue.push(restart(now));
            return Ok(None);
        }
        let at = if healthy {
            self.restarts += 1;
            self.preemptions += 1;
            tracing::warn!(
                process = %p.name,
                %status,
                ran_s = ran.as_secs_f64(),
                "exited after a healthy run; restarting at once"
            );
            now
        } else {
            slot.fast_failures += 1;
            let n = slot.fast_failures;
            anyhow::ensure!(
                n <= self.limits.max_restarts,
                "{} is in a crash loop: it exited ({status}) {:.1}s after it started, and its \
                 slot has now failed {n} times in a row within cluster.healthy_after ({}) of a \
                 start, more than cluster.max_restarts ({}); the cause is in {}",
                p.name,
                ran.as_secs_f64(),
                humantime::format_duration(self.limits.healthy_after),
                self.limits.max_restarts,
                self.logs_dir.join(format!("{}.log", p.name)).display()
            );
            self.restarts += 1;
            let backoff = backoff(n);
            tracing::warn!(
                process = %p.name,
                %status,
                ran_s = ran.as_secs_f64(),
                fast_failures = n,
                ?backoff,
                "crashed before it was healthy; restarting after a backoff"
            );
            now + backoff
        };
        self.restart_queue.push(restart(at));
        Ok(Some(Crash {
            role: p.role,
            slot: p.slot,
            process: p.name,
            healthy,
        }))
    }

    /// The clock moved to `now`: paused processes whose stop is over are resumed, and
    /// restarts that are due are started (trainers' too unless `skip_trainers`).
    pub(crate) fn tick(&mut self, now: Instant, skip_trainers: bool) -> Vec<Effect> {
        let mut effects = Vec::new();
        for (&id, p) in &mut self.procs {
            if p.stopped_until.is_some_and(|until| now >= until) {
                p.stopped_until = None;
                p.resumed = true;
                effects.push(Effect::Signal { id, sig: Sig::Cont });
            }
            if p.notice_until.is_some_and(|until| now >= until) {
                p.notice_until = None;
                self.notices_past_deadline += 1;
                tracing::warn!(process = %p.name, deadline = ?self.limits.notice_deadline, "still running at its notice's deadline: SIGKILL");
                effects.push(Effect::Kill { id });
            }
        }
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.restart_queue)
            .into_iter()
            .partition(|r| now >= r.at && !(skip_trainers && r.role == Role::Trainer));
        self.restart_queue = later;
        for r in due {
            effects.push(self.spawn(r.role, r.slot, now));
        }
        effects
    }

    /// The trainers registered with the job now (by name, read from etcd at `now`;
    /// `etcd_since`: since when etcd has answered without a gap). Each is marked
    /// registered; a trainer that has not registered `register_within` after the later
    /// of its start and `etcd_since` is SIGKILLed (returned with its name).
    pub(crate) fn registrations(
        &mut self,
        registered: &[String],
        etcd_since: Instant,
        now: Instant,
    ) -> Vec<(Effect, String)> {
        let within = self.limits.register_within;
        let mut kills = Vec::new();
        for (&id, p) in &mut self.procs {
            if p.role != Role::Trainer || p.registered || p.stopping || p.unregistered {
                continue;
            }
            if registered.contains(&p.name) {
                p.registered = true;
            } else if p.stopped_until.is_none()
                && now.saturating_duration_since(p.spawned.max(etcd_since)) >= within
            {
                p.unregistered = true;
                kills.push((Effect::Kill { id }, p.name.clone()));
            }
        }
        kills
    }

    /// The processes found stuck (`names`, for `why`): each of ours of the role `why`
    /// is about, not already stopping or killed, is SIGKILLed (returned with its name)
    /// and restarted at once when its exit is seen, never counted against the budget.
    pub(crate) fn stuck(&mut self, names: &[String], why: Stuck) -> Vec<(Effect, String)> {
        let mut kills = Vec::new();
        for (&id, p) in &mut self.procs {
            if p.role == why.role()
                && !(p.stopping || p.unregistered || p.stuck.is_some())
                && names.contains(&p.name)
            {
                p.stuck = Some(why);
                kills.push((Effect::Kill { id }, p.name.clone()));
            }
        }
        kills
    }

    /// `edl scale` asked for `asked` trainers: new ones are started, surplus ones
    /// drained (the latest first).
    pub(crate) fn scale(&mut self, asked: u32, now: Instant) -> Vec<Effect> {
        let want = asked.clamp(self.limits.min_trainers, self.limits.max_trainers);
        if want == self.desired_trainers {
            return Vec::new();
        }
        tracing::info!(from = self.desired_trainers, to = want, "scaling trainers");
        self.scale_events.push(ScaleEvent {
            at_s: now.saturating_duration_since(self.started).as_secs_f64(),
            from: self.desired_trainers,
            to: want,
        });
        self.desired_trainers = want;
        let live = self.trainers_kept();
        let mut effects = Vec::new();
        if want > live {
            for _ in live..want {
                effects.push(self.spawn_trainer(now));
            }
        } else {
            let mut surplus = live - want;
            for (&id, p) in self.procs.iter_mut().rev() {
                if surplus == 0 {
                    break;
                }
                if p.role == Role::Trainer && !p.stopping {
                    p.stopping = true;
                    effects.push(Effect::Signal { id, sig: Sig::Term });
                    surplus -= 1;
                }
            }
        }
        effects
    }

    /// The job goes on after it had finished (a pserver restored since lacks training
    /// that the master had counted done, so the master trains it again): trainers are
    /// started up to the desired count, counting those waiting for a restart.
    pub(crate) fn resume_trainers(&mut self, now: Instant) -> Vec<Effect> {
        let live = self.trainers_kept();
        (live..self.desired_trainers)
            .map(|_| self.spawn_trainer(now))
            .collect()
    }

    /// Trainers running and not asked to stop, plus those waiting for a restart.
    fn trainers_kept(&self) -> u32 {
        let queued = self
            .restart_queue
            .iter()
            .filter(|r| r.role == Role::Trainer)
            .count();
        (self.live(Role::Trainer).count() + queued) as u32
    }

    /// The processes of `role` that a fault may hit (in spawn order): not stopping, not
    /// already hit.
    pub(crate) fn victims(&self, role: Role) -> Vec<ProcId> {
        self.procs
            .iter()
            .filter(|(_, p)| {
                p.role == role
                    && !p.stopping
                    && (!p.injected || p.resumed)
                    && p.stopped_until.is_none()
            })
            .map(|(&id, _)| id)
            .collect()
    }

    /// A fault hits process `id`: SIGKILL, SIGSTOP for twice the lease TTL, or a notice
    /// (SIGTERM, then SIGKILL at the notice's deadline if it still runs).
    /// Its exit, whatever its status, is then not a crash, and it is restarted at once.
    pub(crate) fn inject(&mut self, id: ProcId, action: Action, now: Instant) -> Option<Effect> {
        let p = self.procs.get_mut(&id)?;
        p.injected = true;
        p.resumed = false;
        Some(match action {
            Action::Kill => Effect::Kill { id },
            Action::Stop => {
                p.stopped_until = Some(now + 2 * self.limits.lease_ttl);
                Effect::Signal { id, sig: Sig::Stop }
            }
            Action::Notice => {
                p.notice_until = Some(now + self.limits.notice_deadline);
                Effect::Signal { id, sig: Sig::Term }
            }
        })
    }

    /// Asks every process of `role` to stop (resuming paused ones first).
    pub(crate) fn stop(&mut self, role: Role) -> Vec<Effect> {
        let mut effects = Vec::new();
        for (&id, p) in self.procs.iter_mut().filter(|(_, p)| p.role == role) {
            if p.stopped_until.take().is_some() {
                effects.push(Effect::Signal { id, sig: Sig::Cont });
            }
            p.stopping = true;
            effects.push(Effect::Signal { id, sig: Sig::Term });
        }
        effects
    }

    /// Forgets every process (the shell has reaped them all).
    pub(crate) fn clear(&mut self) {
        self.procs.clear();
    }

    /// Whether the end of the job still waits on processes: trainers that run, or
    /// masters and pservers waiting for a restart (the final parameters are pulled
    /// from the pservers).
    pub(crate) fn draining(&self) -> bool {
        self.live(Role::Trainer).count() > 0
            || self.restart_queue.iter().any(|r| r.role != Role::Trainer)
    }

    fn live(&self, role: Role) -> impl Iterator<Item = &Proc> {
        self.procs
            .values()
            .filter(move |p| p.role == role && !p.stopping)
    }

    /// Records the recovery from an injected fault or a crash.
    pub(crate) fn recovered(&mut self, recovery: Recovery) {
        self.recoveries.push(recovery);
    }

    /// The process `id`, while it runs.
    pub(crate) fn proc(&self, id: ProcId) -> Option<&Proc> {
        self.procs.get(&id)
    }

    /// The processes of `role`.
    pub(crate) fn ids(&self, role: Role) -> Vec<ProcId> {
        self.procs
            .iter()
            .filter(|(_, p)| p.role == role)
            .map(|(&id, _)| id)
            .collect()
    }

    /// Whether `slot` of `role` is no longer wanted: none of its processes runs without
    /// being asked to stop, and no restart of it is queued (a scale-down drained it).
    pub(crate) fn slot_retired(&self, role: Role, slot: u32) -> bool {
        !self.live(role).any(|p| p.slot == slot)
            && !self
                .restart_queue
                .iter()
                .any(|r| r.role == role && r.slot == slot)
    }

    /// The trainers wanted now.
    pub(crate) fn desired_trainers(&self) -> u32 {
        self.desired_trainers
    }

    /// Crash restarts so far, preemptions included.
    pub(crate) fn restarts(&self) -> u32 {
        self.restarts
    }

    /// Crash restarts so far of processes that had been healthy (not counted against
    /// the budget).
    pub(crate) fn preemptions(&self) -> u32 {
        self.preemptions
    }

    /// Recoveries so far, one per fault.
    pub(crate) fn recoveries(&self) -> &[Recovery] {
        &self.recoveries
    }

    /// Scale events so far.
    pub(crate) fn scale_events(&self) -> &[ScaleEvent] {
        &self.scale_events
    }

    /// Notices so far whose process still ran at the deadline (SIGKILLed then).
    pub(crate) fn notices_past_deadline(&self) -> u32 {
        self.notices_past_deadline
    }
}

/// The name of a trainer process (its id in etcd): `trainer-<slot>`, and
/// `trainer-<slot>.<n>` after `n` restarts of its slot (a restarted trainer registers
/// anew).
pub(crate) fn trainer_name(slot: u32, generation: u32) -> String {
    if generation == 0 {
        format!("trainer-{slot}")
    } else {
        format!("trainer-{slot}.{generation}")
    }
}

/// The slot and generation of a trainer named by [`trainer_name`].
pub(crate) fn trainer_slot(name: &str) -> Option<(u32, u32)> {
    let rest = name.strip_prefix("trainer-")?;
    let (slot, generation) = match rest.split_once('.') {
        Some((slot, generation)) => (slot, generation.parse().ok()?),
        None => (rest, 0),
    };
    Some((slot.parse().ok()?, generation))
}

/// The wait before the restart after the `n`th fast failure in a row of a slot:
/// 0.5 s × 2^n (n ≤ 5), at most 10 s.
fn backoff(n: u32) -> Duration {
    Duration::from_millis(500)
        .saturating_mul(1 << n.min(5))
        .min(Duration::from_secs(10))
}

#[cfg(test)]
mod tests;
