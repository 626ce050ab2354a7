//! `--chaos`: the fault spec, and the clock that says which fault is due.
//!
//! A spec is `ACTION-ROLE=INTERVAL,...,seed=S`: `ACTION` is `kill` (SIGKILL), `stop`
//! (SIGSTOP for twice the lease TTL, then SIGCONT) or `notice` (a preemption notice:
//! SIGTERM, then SIGKILL if the process still runs at the notice's deadline, as
//! Kubernetes ends a pod's grace period; the process is restarted as after any injected
//! fault); `ROLE` is `trainer`, `pserver` or `master`; each interval is at least 1 s.
//! `deadline=D` is a notice's deadline (30 s by default, Kubernetes's default grace
//! period); `until=D` injects faults only during the run's first `D` (the job then
//! finishes in peace); `seed=S` seeds the victims' choice.

use std::time::{Duration, Instant};

use anyhow::Context;

use super::supervisor::Role;

/// How a fault hits its victim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Action {
    /// SIGKILL.
    Kill,
    /// SIGSTOP for twice the lease TTL (past it: the victim's lease ends), then SIGCONT.
    Stop,
    /// A preemption notice: SIGTERM, and SIGKILL at the notice's deadline if the victim
    /// still runs. It stops gracefully (a trainer hands its task back with the batches
    /// it applied, a pserver writes its final checkpoint or leaves its replicas the
    /// shard, a master resigns); it is restarted like any victim.
    Notice,
}

/// A notice's deadline unless the spec says `deadline=D`: Kubernetes's default grace
/// period.
pub(crate) const NOTICE_DEADLINE: Duration = Duration::from_secs(30);

impl Action {
    const ALL: [Action; 3] = [Action::Kill, Action::Stop, Action::Notice];

    /// Its name in a spec.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Action::Kill => "kill",
            Action::Stop => "stop",
            Action::Notice => "notice",
        }
    }

    /// The signal's name, as the report lists the fault.
    pub(crate) fn signal(self) -> &'static str {
        match self {
            Action::Kill => "sigkill",
            Action::Stop => "sigstop",
            Action::Notice => "notice",
        }
    }
}

/// A fault to inject: an action on a process of a role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Fault {
    pub action: Action,
    pub role: Role,
}

/// Seeded fault injection: an interval per fault kind.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Chaos {
    /// Each fault kind asked for and its interval, in the order of the spec.
    pub(crate) every: Vec<(Fault, Duration)>,
    /// Faults are injected only this long after the start (default: until the end).
    pub(crate) until: Option<Duration>,
    /// Seed of the victims' choice.
    pub seed: u64,
    /// A notice's deadline (`deadline=D`; [`NOTICE_DEADLINE`] when not given).
    pub(crate) deadline: Option<Duration>,
}

impl Chaos {
    /// The interval of `action` on `role`, if asked for.
    pub(crate) fn interval(&self, action: Action, role: Role) -> Option<Duration> {
        self.every
            .iter()
            .find(|(f, _)| f.action == action && f.role == role)
            .map(|(_, d)| *d)
    }

    /// How long a notice's victim has before it is SIGKILLed.
    pub(crate) fn notice_deadline(&self) -> Duration {
        self.deadline.unwrap_or(NOTICE_DEADLINE)
    }
}

impl std::str::FromStr for Chaos {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Chaos> {
        let mut c = Chaos::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .with_context(|| format!("--chaos: {part:?} is not KEY=VALUE"))?;
            if k == "seed" {
                c.seed = v.parse().with_context(|| format!("--chaos: seed {v:?}"))?;
                continue;
            }
            if k == "deadline" {
                c.deadline = Some(
                    humantime::parse_duration(v)
                        .with_context(|| format!("--chaos: deadline: invalid duration {v:?}"))?,
                );
                continue;
            }
            if k == "until" {
                c.until = Some(
                    humantime::parse_duration(v)
                        .with_context(|| format!("--chaos: until: invalid duration {v:?}"))?,
                );
                continue;
            }
            let fault = Action::ALL
                .iter()
                .flat_map(|&action| {
                    [Role::Trainer, Role::Pserver, Role::Master].map(|role| Fault { action, role })
                })
                .find(|f| k == format!("{}-{}", f.action.name(), f.role.name()))
                .with_context(|| {
                    format!(
                        "--chaos: unknown fault {k:?} (ACTION-ROLE with ACTION kill, stop or \
                         notice and ROLE trainer, pserver or master; or deadline, until, seed)"
                    )
                })?;
            let every = humantime::parse_duration(v)
                .with_context(|| format!("--chaos: {k}: invalid duration {v:?}"))?;
            anyhow::ensure!(every >= Duration::from_secs(1), "--chaos: {k}: at least 1s");
            anyhow::ensure!(
                c.interval(fault.action, fault.role).is_none(),
                "--chaos: {k} is given twice"
            );
            c.every.push((fault, every));
        }
        Ok(c)
    }
}

/// When each fault of a [`Chaos`] spec is next due (time is an argument).
#[derive(Debug)]
pub(crate) struct ChaosClock {
    next: Vec<(Fault, Duration, Instant)>,
    /// No fault is due from then on.
    end: Option<Instant>,
}

impl ChaosClock {
    /// The first of each fault is due one interval after `started`.
    pub(crate) fn new(chaos: Option<&Chaos>, started: Instant) -> ChaosClock {
        let next = chaos
            .map(|c| {
                c.every
                    .iter()
                    .map(|&(f, every)| (f, every, started + every))
                    .collect()
            })
            .unwrap_or_default();
        let end = chaos.and_then(|c| c.until).map(|d| started + d);
        ChaosClock { next, end }
    }

    /// `fault`, due now, found no victim: it is due again at `at` (its next one stays
    /// one interval after `at`).
    pub(crate) fn defer(&mut self, fault: Fault, at: Instant) {
        if let Some((_, _, next)) = self.next.iter_mut().find(|(f, _, _)| *f == fault) {
            *next = at;
        }
    }

    /// The first fault due at `now`, if any; it is next due one interval later.
    pub(crate) fn due(&mut self, now: Instant) -> Option<Fault> {
        if self.end.is_some_and(|end| now >= end) {
            return None;
        }
        for (f, every, at) in &mut self.next {
            if now >= *at {
                *at = now + *every;
                return Some(*f);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const fn fault(action: Action, role: Role) -> Fault {
        Fault { action, role }
    }

    #[test]
    fn chaos_specs_parse() {
        let c: Chaos = "kill-trainer=10s, kill-pserver=30s,kill-master=1m,stop-trainer=20s,\
                        notice-pserver=45s,stop-master=2m,seed=7,deadline=5s"
            .parse()
            .expect("valid");
        assert_eq!(
            c.interval(Action::Kill, Role::Trainer),
            Some(Duration::from_secs(10))
        );
        assert_eq!(
            c.interval(Action::Kill, Role::Master),
            Some(Duration::from_secs(60))
        );
        assert_eq!(
            c.interval(Action::Notice, Role::Pserver),
            Some(Duration::from_secs(45))
        );
        assert_eq!(
            c.interval(Action::Stop, Role::Master),
            Some(Duration::from_secs(120))
        );
        assert_eq!(c.interval(Action::Notice, Role::Trainer), None);
        assert_eq!(c.every.len(), 6);
        assert_eq!(c.seed, 7);
        assert_eq!(c.notice_deadline(), Duration::from_secs(5));
        assert_eq!(Chaos::default().notice_deadline(), NOTICE_DEADLINE);
        for bad in [
            "kill-trainer",
            "kill-everyone=1s",
            "pause-trainer=1s",
            "kill-trainer=soon",
            "kill-trainer=10ms",
            "kill-trainer=1s,kill-trainer=2s",
            "seed=x",
            "until=later",
            "term-trainer=1s",
            "deadline=never",
        ] {
            assert!(bad.parse::<Chaos>().is_err(), "{bad}");
        }
    }

    #[test]
    fn faults_fall_due_once_per_interval() {
        let c: Chaos = "kill-trainer=10s,notice-master=25s".parse().expect("valid");
        let t0 = Instant::now();
        let mut clock = ChaosClock::new(Some(&c), t0);
        let kill_trainer = fault(Action::Kill, Role::Trainer);
        assert_eq!(clock.due(t0 + Duration::from_secs(9)), None);
        assert_eq!(clock.due(t0 + Duration::from_secs(10)), Some(kill_trainer));
        assert_eq!(
            clock.due(t0 + Duration::from_secs(11)),
            None,
            "not again at once"
        );
        assert_eq!(clock.due(t0 + Duration::from_secs(20)), Some(kill_trainer));
        assert_eq!(
            clock.due(t0 + Duration::from_secs(25)),
            Some(fault(Action::Notice, Role::Master))
        );
        clock.defer(kill_trainer, t0 + Duration::from_secs(31));
        assert_eq!(
            clock.due(t0 + Duration::from_secs(30)),
            None,
            "a deferred fault waits"
        );
        assert_eq!(clock.due(t0 + Duration::from_secs(31)), Some(kill_trainer));
        let c: Chaos = "kill-trainer=10s,until=25s".parse().expect("valid");
        let mut clock = ChaosClock::new(Some(&c), t0);
        assert_eq!(clock.due(t0 + Duration::from_secs(20)), Some(kill_trainer));
        assert_eq!(
            clock.due(t0 + Duration::from_secs(30)),
            None,
            "no fault after `until`"
        );
        assert!(
            ChaosClock::new(None, t0)
                .due(t0 + Duration::from_secs(3600))
                .is_none()
        );
    }
}
