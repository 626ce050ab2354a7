//! The supervisor of `edl run`'s processes as a pure state machine: events in (start,
//! a process exited, the clock moved, a scale request, a fault injected, stop), effects
//! out (spawn, signal, kill). Time is an argument and nothing here touches a process:
//! the shell (`cluster.rs`, `procs.rs`) runs the effects, so this is tested without
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
//! - A process hit by an injected fault is restarted at once and does not count; a
//!   fast failure after it continues its slot's count.
//! - [`exited`](Supervisor::exited) tells the shell of each crash it restarts
//!   ([`Crash`]), whose recovery (until the role serves again) the shell measures, as it
//!   measures an injected fault's.
//! - A process asked to stop (drained by a scale-down, or at shutdown) is never
//!   restarted; nor is a trainer once the job has finished.
//! - After a scale event, the trainers alive and not draining plus those waiting for a
//!   restart are the desired count, clamped to `[min_trainers, max_trainers]`.
//! - A SIGSTOPped process is sent SIGCONT once its stop is over, and before it is asked
//!   to stop.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

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
    /// SIGSTOPped until then.
    pub stopped_until: Option<Instant>,
    /// When it was spawned.
    pub spawned: Instant,
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
                stopped_until: None,
                spawned: now,
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
    /// exit (a trainer that failed without being asked to stop).
    pub(crate) fn exit_needs_job_status(&self, id: ProcId, success: bool) -> bool {
        self.procs
            .get(&id)
            .is_some_and(|p| p.role == Role::Trainer && !success && !p.stopping)
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
        if p.role == Role::Trainer && success {
            tracing::info!(process = %p.name, "exited");
            return Ok(None);
        }
        if p.stopping || (p.role == Role::Trainer && job_finished) {
            return Ok(None);
        }
        let ran = now.saturating_duration_since(p.spawned);
        let healthy = ran >= self.limits.healthy_after;
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
                effects.push(Effect::Signal { id, sig: Sig::Cont });
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
        let live = self.live(Role::Trainer).count() as u32
            + self
                .restart_queue
                .iter()
                .filter(|r| r.role == Role::Trainer)
                .count() as u32;
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

    /// The processes of `role` that a fault may hit (in spawn order): not stopping, not
    /// already hit.
    pub(crate) fn victims(&self, role: Role) -> Vec<ProcId> {
        self.procs
            .iter()
            .filter(|(_, p)| {
                p.role == role && !p.stopping && !p.injected && p.stopped_until.is_none()
            })
            .map(|(&id, _)| id)
            .collect()
    }

    /// A fault hits process `id`: SIGSTOP for twice the lease TTL (`stop`), else
    /// SIGKILL. Its exit is then not a crash.
    pub(crate) fn inject(&mut self, id: ProcId, stop: bool, now: Instant) -> Option<Effect> {
        let p = self.procs.get_mut(&id)?;
        p.injected = true;
        if stop {
            p.stopped_until = Some(now + 2 * self.limits.lease_ttl);
            Some(Effect::Signal { id, sig: Sig::Stop })
        } else {
            Some(Effect::Kill { id })
        }
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
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            masters: 1,
            pservers: 2,
            trainers: 2,
            min_trainers: 1,
            max_trainers: 4,
            max_restarts: 2,
            healthy_after: 30 * SECOND,
            lease_ttl: Duration::from_secs(2),
        }
    }

    fn started() -> (Supervisor, Instant, Vec<Effect>) {
        let t0 = Instant::now();
        let mut sup = Supervisor::new(limits(), PathBuf::from("/run/logs"), t0);
        let effects = sup.start(t0);
        (sup, t0, effects)
    }

    fn spawned(effects: &[Effect]) -> Vec<String> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Spawn { name, .. } => Some(name.clone()),
                _ => None,
            })
            .collect()
    }

    fn id_of(sup: &Supervisor, name: &str) -> ProcId {
        sup.procs
            .iter()
            .find(|(_, p)| p.name == name)
            .map(|(&id, _)| id)
            .unwrap_or_else(|| panic!("no process {name}"))
    }

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn start_spawns_masters_pservers_then_trainers() {
        let (_, _, effects) = started();
        assert_eq!(
            spawned(&effects),
            [
                "master-0",
                "pserver-0",
                "pserver-1",
                "trainer-0",
                "trainer-1"
            ]
        );
    }

    #[test]
    fn a_crash_is_restarted_after_a_doubling_backoff() {
        let (mut sup, t0, _) = started();
        let ps = id_of(&sup, "pserver-1");
        assert!(!sup.exit_needs_job_status(ps, false));
        let crash = sup.exited(ps, false, "exit status: 1", false, t0).unwrap();
        assert_eq!(
            crash,
            Some(Crash {
                role: Role::Pserver,
                slot: 1,
                process: "pserver-1".into(),
                healthy: false,
            })
        );
        assert_eq!(sup.restarts(), 1);
        assert_eq!(sup.preemptions(), 0);
        // Its recovery is the shell's to measure (until the shard is served again).
        assert!(sup.recoveries().is_empty());
        // Not before the backoff (1 s for the first restart of the slot).
        assert!(sup.tick(t0 + SECOND / 2, false).is_empty());
        let e = sup.tick(t0 + SECOND, false);
        assert!(
            matches!(&e[..], [Effect::Spawn { role: Role::Pserver, slot: 1, name, .. }] if name == "pserver-1"),
            "{e:?}"
        );
        // The second crash of the same slot waits twice as long (2 s).
        let ps = id_of(&sup, "pserver-1");
        sup.exited(ps, false, "exit status: 1", false, t0 + 2 * SECOND)
            .unwrap();
        assert!(sup.tick(t0 + 3 * SECOND + SECOND / 2, false).is_empty());
        assert_eq!(spawned(&sup.tick(t0 + 4 * SECOND, false)), ["pserver-1"]);
    }

    #[test]
    fn trainer_names_tell_their_slot_and_generation() {
        for (slot, generation) in [(0, 0), (3, 0), (1, 1), (12, 40)] {
            let name = trainer_name(slot, generation);
            assert_eq!(trainer_slot(&name), Some((slot, generation)), "{name}");
        }
        assert_eq!(trainer_name(2, 0), "trainer-2");
        assert_eq!(trainer_name(2, 5), "trainer-2.5");
        for other in [
            "pserver-1",
            "trainer-",
            "trainer-x",
            "trainer-1.",
            "trainer-1.y",
        ] {
            assert_eq!(trainer_slot(other), None, "{other}");
        }
    }

    #[test]
    fn backoff_is_capped() {
        assert_eq!(backoff(1), SECOND);
        assert_eq!(backoff(4), 8 * SECOND);
        assert_eq!(backoff(5), 10 * SECOND);
        assert_eq!(backoff(40), 10 * SECOND);
    }

    /// Lets process `name` run from `from` for `ran`, then exit with `status`; returns
    /// what the supervisor made of the exit, and the exit time.
    fn exit_after(
        sup: &mut Supervisor,
        name: &str,
        from: Instant,
        ran: Duration,
        status: &str,
    ) -> (anyhow::Result<Option<Crash>>, Instant) {
        let id = id_of(sup, name);
        assert_eq!(sup.procs[&id].spawned, from, "{name} was spawned then");
        let at = from + ran;
        (sup.exited(id, false, status, false, at), at)
    }

    #[test]
    fn healthy_processes_preempted_again_and_again_never_fail_the_job() {
        let (mut sup, t0, _) = started();
        let mut now = t0;
        for round in 1..=30u32 {
            // Every process of the job runs past healthy_after, then is preempted.
            for (name, role) in [
                ("master-0", Role::Master),
                ("pserver-1", Role::Pserver),
                ("trainer-0", Role::Trainer),
            ] {
                let name = match (role, round) {
                    (Role::Trainer, 1) => name.to_owned(),
                    (Role::Trainer, n) => format!("{name}.{}", n - 1),
                    _ => name.to_owned(),
                };
                let (crash, _) =
                    exit_after(&mut sup, &name, now, 31 * SECOND, "signal: 9 (SIGKILL)");
                let crash = crash.unwrap_or_else(|e| panic!("round {round}: {e:#}"));
                assert!(crash.is_some_and(|c| c.healthy && c.process == name));
            }
            now += 31 * SECOND;
            // Restarted at once: no backoff, however many came before.
            let respawned = spawned(&sup.tick(now, false));
            assert_eq!(
                respawned,
                ["master-0", "pserver-1", &format!("trainer-0.{round}")],
                "round {round}"
            );
        }
        assert_eq!(sup.restarts(), 90);
        assert_eq!(sup.preemptions(), 90);
        assert!(sup.restart_queue.is_empty());
    }

    #[test]
    fn a_crash_loop_fails_the_job_once_its_slot_spent_the_budget() {
        let (mut sup, t0, _) = started();
        let fast = SECOND / 5;
        // trainer-1 fails right after every start: restarted after 1 s, then 2 s.
        let (crash, at) = exit_after(&mut sup, "trainer-1", t0, fast, "exit status: 2");
        assert!(crash.unwrap().is_some_and(|c| !c.healthy));
        assert!(sup.tick(at + SECOND - fast, false).is_empty());
        assert_eq!(spawned(&sup.tick(at + SECOND, false)), ["trainer-1.1"]);
        let (crash, at) = exit_after(&mut sup, "trainer-1.1", at + SECOND, fast, "exit status: 2");
        assert!(crash.unwrap().is_some());
        assert!(sup.tick(at + 2 * SECOND - fast, false).is_empty());
        assert_eq!(spawned(&sup.tick(at + 2 * SECOND, false)), ["trainer-1.2"]);
        assert_eq!(sup.restarts(), 2);
        // The third fast failure in a row is more than max_restarts (2): the job fails,
        // naming the process, why, and its log.
        let (crash, _) = exit_after(
            &mut sup,
            "trainer-1.2",
            at + 2 * SECOND,
            fast,
            "exit status: 2",
        );
        let err = format!("{:#}", crash.unwrap_err());
        assert!(err.starts_with("trainer-1.2 is in a crash loop"), "{err}");
        assert!(
            err.contains("it exited (exit status: 2) 0.2s after it started"),
            "{err}"
        );
        assert!(
            err.contains("failed 3 times in a row within cluster.healthy_after (30s)"),
            "{err}"
        );
        assert!(err.contains("cluster.max_restarts (2)"), "{err}");
        assert!(
            err.ends_with("the cause is in /run/logs/trainer-1.2.log"),
            "{err}"
        );
        assert_eq!(sup.restarts(), 2, "the failing exit is not restarted");
    }

    #[test]
    fn fast_failures_of_different_slots_do_not_add_up() {
        let (mut sup, t0, _) = started();
        // One fast failure of every slot: five in all, the budget being 2 per slot.
        for name in [
            "master-0",
            "pserver-0",
            "pserver-1",
            "trainer-0",
            "trainer-1",
        ] {
            let (crash, _) = exit_after(&mut sup, name, t0, SECOND, "exit status: 1");
            assert!(crash.unwrap().is_some_and(|c| !c.healthy), "{name}");
        }
        assert_eq!(sup.restarts(), 5);
        assert_eq!(sup.preemptions(), 0);
        // Each waits the first backoff only (1 s after its exit).
        assert!(sup.tick(t0 + 2 * SECOND - SECOND / 10, false).is_empty());
        assert_eq!(sup.tick(t0 + 2 * SECOND, false).len(), 5);
    }

    #[test]
    fn a_healthy_run_resets_the_backoff_and_the_budget_of_its_slot() {
        let (mut sup, t0, _) = started();
        // Two fast failures of pserver-0: backoffs of 1 s, then 2 s.
        let (crash, at) = exit_after(&mut sup, "pserver-0", t0, SECOND, "exit status: 1");
        crash.unwrap();
        assert_eq!(spawned(&sup.tick(at + SECOND, false)), ["pserver-0"]);
        let (crash, at) = exit_after(&mut sup, "pserver-0", at + SECOND, SECOND, "exit status: 1");
        crash.unwrap();
        assert!(sup.tick(at + SECOND, false).is_empty());
        assert_eq!(spawned(&sup.tick(at + 2 * SECOND, false)), ["pserver-0"]);
        // It then runs past healthy_after before it is preempted: restarted at once.
        let (crash, at) = exit_after(
            &mut sup,
            "pserver-0",
            at + 2 * SECOND,
            40 * SECOND,
            "signal: 9 (SIGKILL)",
        );
        assert!(crash.unwrap().is_some_and(|c| c.healthy));
        assert_eq!(spawned(&sup.tick(at, false)), ["pserver-0"]);
        assert_eq!(sup.preemptions(), 1);
        // Its next fast failures start over: 1 s, then 2 s, and two more are allowed.
        let (crash, at) = exit_after(&mut sup, "pserver-0", at, SECOND, "exit status: 1");
        crash.unwrap();
        assert!(sup.tick(at + SECOND - SECOND / 10, false).is_empty());
        assert_eq!(spawned(&sup.tick(at + SECOND, false)), ["pserver-0"]);
        let (crash, at) = exit_after(&mut sup, "pserver-0", at + SECOND, SECOND, "exit status: 1");
        crash.unwrap();
        assert!(sup.tick(at + SECOND, false).is_empty());
        assert_eq!(spawned(&sup.tick(at + 2 * SECOND, false)), ["pserver-0"]);
        let (crash, _) = exit_after(
            &mut sup,
            "pserver-0",
            at + 2 * SECOND,
            SECOND,
            "exit status: 1",
        );
        assert!(
            crash.is_err(),
            "the third fast failure in a row fails the job"
        );
        assert_eq!(sup.restarts(), 5);
    }

    #[test]
    fn an_injected_fault_neither_counts_nor_clears_a_crash_loop() {
        let (mut sup, t0, _) = started();
        let (crash, at) = exit_after(&mut sup, "master-0", t0, SECOND, "exit status: 1");
        crash.unwrap();
        assert_eq!(spawned(&sup.tick(at + SECOND, false)), ["master-0"]);
        let m = id_of(&sup, "master-0");
        let hit = at + 2 * SECOND;
        assert_eq!(sup.inject(m, false, hit), Some(Effect::Kill { id: m }));
        let crash = sup
            .exited(m, false, "signal: 9 (SIGKILL)", false, hit)
            .unwrap();
        assert_eq!(crash, None, "an injected fault is not a crash");
        assert_eq!(spawned(&sup.tick(hit, false)), ["master-0"], "at once");
        // The next fast failure is the second in a row: 2 s of backoff.
        let (crash, at) = exit_after(&mut sup, "master-0", hit, SECOND, "exit status: 1");
        crash.unwrap();
        assert!(sup.tick(at + 2 * SECOND - SECOND / 10, false).is_empty());
        assert_eq!(spawned(&sup.tick(at + 2 * SECOND, false)), ["master-0"]);
        assert_eq!(sup.restarts(), 2);
    }

    #[test]
    fn injected_faults_restart_at_once_and_do_not_count() {
        let (mut sup, t0, _) = started();
        let t = id_of(&sup, "trainer-1");
        assert_eq!(sup.inject(t, false, t0), Some(Effect::Kill { id: t }));
        assert!(sup.victims(Role::Trainer).iter().all(|&v| v != t));
        assert!(sup.exit_needs_job_status(t, false));
        let crash = sup.exited(t, false, "signal: 9 (SIGKILL)", false, t0);
        assert_eq!(
            crash.unwrap(),
            None,
            "its recovery is measured from the injection"
        );
        assert_eq!(sup.restarts(), 0);
        // A restarted trainer gets a new name: its registration is new.
        assert_eq!(spawned(&sup.tick(t0, false)), ["trainer-1.1"]);
    }

    #[test]
    fn a_stopped_trainer_is_resumed_after_twice_the_lease_ttl() {
        let (mut sup, t0, _) = started();
        let t = id_of(&sup, "trainer-0");
        assert_eq!(
            sup.inject(t, true, t0),
            Some(Effect::Signal {
                id: t,
                sig: Sig::Stop
            })
        );
        assert!(sup.tick(t0 + 3 * SECOND, false).is_empty());
        assert_eq!(
            sup.tick(t0 + 4 * SECOND, false),
            [Effect::Signal {
                id: t,
                sig: Sig::Cont
            }]
        );
        assert!(sup.tick(t0 + 5 * SECOND, false).is_empty(), "resumed once");
    }

    #[test]
    fn trainers_that_end_or_fail_after_the_job_finished_are_not_restarted() {
        let (mut sup, t0, _) = started();
        let (a, b) = (id_of(&sup, "trainer-0"), id_of(&sup, "trainer-1"));
        sup.exited(a, true, "exit status: 0", false, t0).unwrap();
        sup.exited(b, false, "exit status: 1", true, t0).unwrap();
        assert_eq!(sup.restarts(), 0);
        assert!(sup.tick(t0 + 60 * SECOND, false).is_empty());
        assert!(!sup.draining());
    }

    #[test]
    fn scaling_up_spawns_and_down_drains_the_latest_trainers() {
        let (mut sup, t0, _) = started();
        let up = sup.scale(4, t0 + 5 * SECOND);
        assert_eq!(spawned(&up), ["trainer-2", "trainer-3"]);
        assert_eq!(sup.scale_events()[0].from, 2);
        assert_eq!(sup.scale_events()[0].to, 4);
        assert_eq!(sup.scale_events()[0].at_s, 5.0);
        assert!(sup.scale(4, t0).is_empty(), "no change, no event");
        assert_eq!(sup.scale_events().len(), 1);

        // Below the minimum: clamped to 1; the three latest drain.
        let down = sup.scale(0, t0 + 6 * SECOND);
        let drained: Vec<&str> = down
            .iter()
            .map(|e| match e {
                Effect::Signal { id, sig: Sig::Term } => sup.proc(*id).unwrap().name.as_str(),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(drained, ["trainer-3", "trainer-2", "trainer-1"]);
        assert_eq!(sup.desired_trainers(), 1);
        // A drained trainer's exit is expected: no restart.
        let t3 = id_of(&sup, "trainer-3");
        sup.exited(t3, false, "signal: 15 (SIGTERM)", false, t0)
            .unwrap();
        assert_eq!(sup.restarts(), 0);
        assert!(sup.tick(t0 + 60 * SECOND, false).is_empty());
    }

    #[test]
    fn scaling_counts_trainers_waiting_for_a_restart() {
        let (mut sup, t0, _) = started();
        let t = id_of(&sup, "trainer-1");
        sup.exited(t, false, "exit status: 1", false, t0).unwrap();
        // One runs, one waits for its restart: 3 asked means one more.
        assert_eq!(spawned(&sup.scale(3, t0)), ["trainer-2"]);
    }

    #[test]
    fn the_end_waits_for_trainers_and_for_pserver_restarts_only() {
        let (mut sup, t0, _) = started();
        for name in ["trainer-0", "trainer-1"] {
            let id = id_of(&sup, name);
            sup.exited(id, true, "exit status: 0", false, t0).unwrap();
        }
        assert!(!sup.draining());
        let ps = id_of(&sup, "pserver-0");
        sup.exited(ps, false, "exit status: 1", false, t0).unwrap();
        assert!(sup.draining(), "a pserver waits for its restart");
        // Trainer restarts are skipped at the end; pserver ones are not.
        assert_eq!(spawned(&sup.tick(t0 + 10 * SECOND, true)), ["pserver-0"]);
        assert!(!sup.draining());
    }

    #[test]
    fn stopping_resumes_paused_processes_first_and_expects_their_exit() {
        let (mut sup, t0, _) = started();
        let t = id_of(&sup, "trainer-0");
        sup.inject(t, true, t0);
        let e = sup.stop(Role::Trainer);
        assert_eq!(
            e[0],
            Effect::Signal {
                id: t,
                sig: Sig::Cont
            }
        );
        assert_eq!(
            e[1],
            Effect::Signal {
                id: t,
                sig: Sig::Term
            }
        );
        assert_eq!(e.len(), 3, "{e:?}");
        sup.exited(t, false, "signal: 15 (SIGTERM)", false, t0)
            .unwrap();
        assert_eq!(sup.restarts(), 0);
        assert!(sup.tick(t0 + 60 * SECOND, false).is_empty());
    }
}
