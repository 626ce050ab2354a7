//! `--chaos`: the fault spec, and the clock that says which fault is due.

use std::time::{Duration, Instant};

use anyhow::Context;

/// Seeded fault injection: an interval per fault kind.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Chaos {
    /// SIGKILL a random trainer this often.
    pub kill_trainer: Option<Duration>,
    /// SIGKILL a random pserver this often.
    pub kill_pserver: Option<Duration>,
    /// SIGKILL the leading master this often.
    pub kill_master: Option<Duration>,
    /// SIGSTOP a random trainer for twice the lease TTL this often.
    pub stop_trainer: Option<Duration>,
    /// Seed of the victims' choice.
    pub seed: u64,
}

impl std::str::FromStr for Chaos {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Chaos> {
        let mut c = Chaos::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .with_context(|| format!("--chaos: {part:?} is not KEY=VALUE"))?;
            let dur = || {
                humantime::parse_duration(v)
                    .with_context(|| format!("--chaos: {k}: invalid duration {v:?}"))
                    .and_then(|d| {
                        anyhow::ensure!(d >= Duration::from_secs(1), "--chaos: {k}: at least 1s");
                        Ok(d)
                    })
            };
            match k {
                "kill-trainer" => c.kill_trainer = Some(dur()?),
                "kill-pserver" => c.kill_pserver = Some(dur()?),
                "kill-master" => c.kill_master = Some(dur()?),
                "stop-trainer" => c.stop_trainer = Some(dur()?),
                "seed" => c.seed = v.parse().with_context(|| format!("--chaos: seed {v:?}"))?,
                other => anyhow::bail!(
                    "--chaos: unknown fault {other:?} (kill-trainer, kill-pserver, kill-master, stop-trainer, seed)"
                ),
            }
        }
        Ok(c)
    }
}

/// A fault to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    KillTrainer,
    KillPserver,
    KillMaster,
    StopTrainer,
}

/// When each fault of a [`Chaos`] spec is next due (time is an argument).
#[derive(Debug)]
pub(crate) struct ChaosClock {
    next: Vec<(Fault, Duration, Instant)>,
}

impl ChaosClock {
    /// The first of each fault is due one interval after `started`.
    pub(crate) fn new(chaos: Option<&Chaos>, started: Instant) -> ChaosClock {
        let mut next = Vec::new();
        if let Some(c) = chaos {
            for (f, every) in [
                (Fault::KillTrainer, c.kill_trainer),
                (Fault::KillPserver, c.kill_pserver),
                (Fault::KillMaster, c.kill_master),
                (Fault::StopTrainer, c.stop_trainer),
            ] {
                if let Some(d) = every {
                    next.push((f, d, started + d));
                }
            }
        }
        ChaosClock { next }
    }

    /// The first fault due at `now`, if any; it is next due one interval later.
    pub(crate) fn due(&mut self, now: Instant) -> Option<Fault> {
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

    #[test]
    fn chaos_specs_parse() {
        let c: Chaos = "kill-trainer=10s, kill-pserver=30s,kill-master=1m,stop-trainer=20s,seed=7"
            .parse()
            .expect("valid");
        assert_eq!(c.kill_trainer, Some(Duration::from_secs(10)));
        assert_eq!(c.kill_master, Some(Duration::from_secs(60)));
        assert_eq!(c.seed, 7);
        for bad in [
            "kill-trainer",
            "kill-everyone=1s",
            "kill-trainer=soon",
            "kill-trainer=10ms",
        ] {
            assert!(bad.parse::<Chaos>().is_err(), "{bad}");
        }
    }

    #[test]
    fn faults_fall_due_once_per_interval() {
        let c: Chaos = "kill-trainer=10s,kill-master=25s".parse().expect("valid");
        let t0 = Instant::now();
        let mut clock = ChaosClock::new(Some(&c), t0);
        assert_eq!(clock.due(t0 + Duration::from_secs(9)), None);
        assert_eq!(
            clock.due(t0 + Duration::from_secs(10)),
            Some(Fault::KillTrainer)
        );
        assert_eq!(
            clock.due(t0 + Duration::from_secs(11)),
            None,
            "not again at once"
        );
        assert_eq!(
            clock.due(t0 + Duration::from_secs(20)),
            Some(Fault::KillTrainer)
        );
        assert_eq!(
            clock.due(t0 + Duration::from_secs(25)),
            Some(Fault::KillMaster)
        );
        assert!(
            ChaosClock::new(None, t0)
                .due(t0 + Duration::from_secs(3600))
                .is_none()
        );
    }
}
