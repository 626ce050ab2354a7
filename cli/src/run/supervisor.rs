//! The supervisor of `edl run`'s processes as a pure state machine: events in (start,
//! a process exited, the clock moved, a scale request, a fault injected, stop), effects
//! out (spawn, signal, kill). Time is an argument and nothing here touches a process:
//! the shell (`cluster.rs`, `procs.rs`) runs the effects, so this is tested without
//! processes.
//!
//! Invariants:
//! - A crash (an exit that was not asked for, not caused by an injected fault, and not
//!   a trainer's successful end) counts against the restart budget; once more than
//!   `max_restarts` crashes happened the job fails.
//! - A crashed process is restarted after a backoff that doubles with the restarts of
//!   its slot (0.5 s × 2^n, n ≤ 5, at most 10 s); one hit by an injected fault is
//!   restarted at once and does not count.
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
    pub max_restarts: u32,
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
    /// Crash restarts (counted against the budget).
    restarts: u32,
    /// Restarts per slot, crashes and injected faults alike (for the backoff and the
    /// names of restarted trainers).
    restart_counts: BTreeMap<(Role, u32), u32>,
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
            restart_counts: BTreeMap::new(),
            restart_queue: Vec::new(),
            recoveries: Vec::new(),
            scale_events: Vec::new(),
        }
    }

    /// The masters, the pservers and the trainers of the spec.
    pub(crate) fn start(&mut self) -> Vec<Effect> {
        let mut effects = Vec::new();
        for i in 0..self.limits.masters {
            effects.push(self.spawn(Role::Master, i));
        }
        for i in 0..self.limits.pservers {
            effects.push(self.spawn(Role::Pserver, i));
        }
        for _ in 0..self.limits.trainers {
            effects.push(self.spawn_trainer());
        }
        effects
    }

    fn spawn_trainer(&mut self) -> Effect {
        let n = self.next_trainer;
        self.next_trainer += 1;
        self.spawn(Role::Trainer, n)
    }

    fn spawn(&mut self, role: Role, slot: u32) -> Effect {
        let generation = self.restart_counts.get(&(role, slot)).copied().unwrap_or(0);
        let name = match role {
            Role::Master => format!("master-{slot}"),
            Role::Pserver => format!("pserver-{slot}"),
            Role::Trainer if generation == 0 => format!("trainer-{slot}"),
            Role::Trainer => format!("trainer-{slot}.{generation}"),
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

    /// Process `id` exited (`success`, described by `status`). A crash is queued for a
    /// restart after its backoff; an error once the restart budget is spent.
    pub(crate) fn exited(
        &mut self,
        id: ProcId,
        success: bool,
        status: &str,
        job_finished: bool,
        now: Instant,
    ) -> anyhow::Result<()> {
        let Some(p) = self.procs.remove(&id) else {
            return Ok(());
        };
        if p.role == Role::Trainer && success {
            tracing::info!(process = %p.name, "exited");
            return Ok(());
        }
        if p.stopping || (p.role == Role::Trainer && job_finished) {
            return Ok(());
        }
        let count = self.restart_counts.entry((p.role, p.slot)).or_insert(0);
        *count += 1;
        let count = *count;
        if p.injected {
            tracing::info!(process = %p.name, %status, "restarting after an injected fault");
            self.restart_queue.push(Restart {
                role: p.role,
                slot: p.slot,
                at: now,
            });
            return Ok(());
        }
        self.restarts += 1;
        anyhow::ensure!(
            self.restarts <= self.limits.max_restarts,
            "{} exited with {status} and the restart budget ({}) is spent; see {}",
            p.name,
            self.limits.max_restarts,
            self.logs_dir.join(format!("{}.log", p.name)).display()
        );
        let backoff = backoff(count);
        tracing::warn!(process = %p.name, %status, ?backoff, "crashed; restarting");
        self.recoveries.push(Recovery {
            fault: "crash".into(),
            role: p.role.name().into(),
            process: p.name,
            seconds: backoff.as_secs_f64(),
        });
        self.restart_queue.push(Restart {
            role: p.role,
            slot: p.slot,
            at: now + backoff,
        });
        Ok(())
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
            effects.push(self.spawn(r.role, r.slot));
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
                effects.push(self.spawn_trainer());
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

    /// Records the recovery from an injected fault.
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

    /// Crash restarts so far.
    pub(crate) fn restarts(&self) -> u32 {
        self.restarts
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

/// The wait before the `n`th restart of a slot: 0.5 s × 2^n (n ≤ 5), at most 10 s.
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
            lease_ttl: Duration::from_secs(2),
        }
    }

    fn started() -> (Supervisor, Instant, Vec<Effect>) {
        let t0 = Instant::now();
        let mut sup = Supervisor::new(limits(), PathBuf::from("/run/logs"), t0);
        let effects = sup.start();
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
        sup.exited(ps, false, "exit status: 1", false, t0).unwrap();
        assert_eq!(sup.restarts(), 1);
        assert_eq!(sup.recoveries()[0].fault, "crash");
        assert_eq!(sup.recoveries()[0].seconds, 1.0);
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
    fn backoff_is_capped() {
        assert_eq!(backoff(1), SECOND);
        assert_eq!(backoff(4), 8 * SECOND);
        assert_eq!(backoff(5), 10 * SECOND);
        assert_eq!(backoff(40), 10 * SECOND);
    }

    #[test]
    fn spending_the_restart_budget_fails_the_job() {
        let (mut sup, t0, _) = started();
        for round in 0..2 {
            let m = id_of(&sup, "master-0");
            sup.exited(m, false, "exit status: 3", false, t0).unwrap();
            sup.tick(t0 + 20 * SECOND * (round + 1), false);
        }
        let m = id_of(&sup, "master-0");
        let err = sup
            .exited(m, false, "exit status: 3", false, t0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("master-0 exited with exit status: 3"), "{err}");
        assert!(err.contains("restart budget (2) is spent"), "{err}");
        assert!(err.contains("/run/logs/master-0.log"), "{err}");
    }

    #[test]
    fn injected_faults_restart_at_once_and_do_not_count() {
        let (mut sup, t0, _) = started();
        let t = id_of(&sup, "trainer-1");
        assert_eq!(sup.inject(t, false, t0), Some(Effect::Kill { id: t }));
        assert!(sup.victims(Role::Trainer).iter().all(|&v| v != t));
        assert!(sup.exit_needs_job_status(t, false));
        sup.exited(t, false, "signal: 9 (SIGKILL)", false, t0)
            .unwrap();
        assert_eq!(sup.restarts(), 0);
        assert!(sup.recoveries().is_empty());
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
