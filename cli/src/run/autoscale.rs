//! `edl run --autoscale`: edl's autoscaler (`edl-autoscaler`'s policy) for the run's own
//! job, on this machine.
//!
//! Every [`EVERY`] the run's loop hands [`LocalAutoscaler::decide`] what it sees, and the
//! answer, a new trainer count, goes through the same path as `edl scale`: the job's
//! `scale/trainers` key is written (so `edl status` shows it) and the supervisor starts
//! trainers or drains surplus ones. A later `edl scale` sets a new starting point, which
//! the autoscaler may change again.
//!
//! The snapshot: one node, this machine, with `--autoscale-cores` CPUs (default: the
//! cores this process may use). Each pserver and each trainer process asks for one core;
//! the masters, which mostly wait on etcd, for none; memory and GPUs are not counted. The
//! job: `min_trainers`/`max_trainers` of the spec, the count asked for now, its trainers
//! registered (running) and started but not registered yet (pending; no growth while
//! any is). Speeds and work left come from the master's status: tasks done over all
//! passes while the registered count held for [`WINDOW`] seconds ([`JobMemory`]).
//!
//! With one job on the machine the policy only ever grows the job: while the cores allow
//! (within 97%), while another trainer adds at least 2% of one trainer's speed (the fitted
//! speed-up curve), and while the job has more than [`MIN_REMAINING`] seconds of work
//! left. It never goes above `max_trainers`.

use std::time::{Duration, Instant};

use edl_autoscaler::observe::{JobMemory, task_progress};
use edl_autoscaler::policy::{self, PolicyConfig};
use edl_autoscaler::{JobView, Node, PodCounts, Resources, Snapshot};
use edl_proto::master::StatusResponse;

/// How often the autoscaler decides.
pub(crate) const EVERY: Duration = Duration::from_secs(2);
/// Seconds a trainer count must hold to give a speed.
pub(crate) const WINDOW: f64 = 3.0;
/// A job with less work left than this (seconds at its speed) is not grown.
pub(crate) const MIN_REMAINING: f64 = 10.0;

/// What the run sees of its job when the autoscaler decides.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct JobNow {
    /// `cluster.min_trainers`.
    pub min: u32,
    /// `cluster.max_trainers`.
    pub max: u32,
    /// The trainer count asked for now.
    pub desired: u32,
    /// Trainer processes alive and not draining.
    pub alive: u32,
    /// Trainers registered with the job.
    pub registered: u32,
    /// Pserver processes.
    pub pservers: u32,
    /// Tasks done over all passes, and tasks left (once the master answers).
    pub progress: Option<(f64, f64)>,
}

/// The autoscaler of one `edl run`.
#[derive(Debug, Clone)]
pub(crate) struct LocalAutoscaler {
    cores: u32,
    policy: PolicyConfig,
    memory: JobMemory,
    started: Instant,
    last: Option<Instant>,
}

impl LocalAutoscaler {
    /// An autoscaler for a machine of `cores` CPUs; time counts from `started`.
    pub(crate) fn new(cores: u32, started: Instant) -> LocalAutoscaler {
        LocalAutoscaler {
            cores,
            policy: PolicyConfig {
                min_remaining: MIN_REMAINING,
                ..PolicyConfig::default()
            },
            memory: JobMemory::new(WINDOW),
            started,
            last: None,
        }
    }

    /// Whether a decision is due at `now`.
    pub(crate) fn due(&self, now: Instant) -> bool {
        self.last
            .is_none_or(|t| now.saturating_duration_since(t) >= EVERY)
    }

    /// Samples the job's progress and decides: the new trainer count, if it changes.
    pub(crate) fn decide(&mut self, now: Instant, job: &JobNow) -> Option<u32> {
        self.last = Some(now);
        let t = now.saturating_duration_since(self.started).as_secs_f64();
        if let Some((done, _)) = job.progress {
            self.memory.sample(t, job.registered, done);
        }
        let core = Resources {
            cpu_milli: 1000,
            mem_mib: 0,
            gpu: 0,
        };
        let pending = job.alive.saturating_sub(job.registered);
        let snapshot = Snapshot {
            now: t,
            nodes: vec![Node {
                name: "this machine".to_owned(),
                allocatable: core * u64::from(self.cores),
                requested: core * u64::from(job.pservers + job.alive),
            }],
            unplaced: Resources::default(),
            jobs: vec![JobView {
                name: "this job".to_owned(),
                min: job.min,
                max: job.max,
                priority: 0,
                trainer: core,
                trainers: job.desired,
                waiting: Vec::new(),
                pods: PodCounts {
                    total: job.alive,
                    running: job.alive - pending,
                    pending,
                    unbound: 0,
                },
                submitted: 0.0,
                changed_at: self.memory.changed_at,
                speed: self.memory.speed.clone(),
                remaining: job.progress.map(|(_, left)| left),
            }],
        };
        let target = policy::decide(&self.policy, &snapshot).into_iter().next()?;
        self.memory.changed(t);
        Some(target.to)
    }
}

/// Tasks done over all passes, and tasks left, from the master's status.
pub(crate) fn progress(s: &StatusResponse) -> Option<(f64, f64)> {
    task_progress(s.pass, s.passes, s.todo, s.pending, s.done, s.failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(desired: u32, registered: u32, done: f64) -> JobNow {
        JobNow {
            min: 1,
            max: 6,
            desired,
            alive: desired,
            registered,
            pservers: 1,
            progress: Some((done, 10_000.0 - done)),
        }
    }

    #[test]
    fn grows_into_free_cores_once_its_speed_is_known() {
        let t0 = Instant::now();
        let mut a = LocalAutoscaler::new(4, t0);
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert!(a.due(at(0)));
        assert_eq!(a.decide(at(0), &job(1, 1, 0.0)), None, "no speed yet");
        assert!(!a.due(at(1)));
        assert_eq!(a.decide(at(2), &job(1, 1, 20.0)), None, "window not over");
        // 4 cores, 3.88 usable: the pserver and 2 trainers of one core each.
        assert_eq!(a.decide(at(4), &job(1, 1, 40.0)), Some(2));
        // Just changed, and the new trainer has not registered: left alone.
        assert_eq!(a.decide(at(6), &job(2, 1, 60.0)), None);
    }

    #[test]
    fn stays_within_max_and_waits_for_pending_trainers() {
        let t0 = Instant::now();
        let mut a = LocalAutoscaler::new(64, t0);
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut pending = job(2, 1, 0.0);
        a.decide(at(0), &pending);
        pending.progress = Some((40.0, 9_960.0));
        assert_eq!(a.decide(at(4), &pending), None, "a trainer is starting");
        let mut b = LocalAutoscaler::new(64, t0);
        b.decide(at(0), &job(2, 2, 0.0));
        assert_eq!(b.decide(at(4), &job(2, 2, 80.0)), Some(6), "max 6");
    }

    #[test]
    fn a_job_about_to_end_is_not_grown() {
        let t0 = Instant::now();
        let mut a = LocalAutoscaler::new(8, t0);
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut j = job(1, 1, 0.0);
        j.progress = Some((0.0, 100.0));
        a.decide(at(0), &j);
        // 10 tasks/s with 60 left: 6 s, under MIN_REMAINING.
        j.progress = Some((40.0, 60.0));
        assert_eq!(a.decide(at(4), &j), None);
    }

    #[test]
    fn progress_counts_every_pass() {
        let s = StatusResponse {
            pass: 2,
            passes: 5,
            todo: 6,
            pending: 1,
            done: 2,
            failed: 1,
            ..StatusResponse::default()
        };
        assert_eq!(progress(&s), Some((23.0, 27.0)));
        assert_eq!(progress(&StatusResponse::default()), None);
    }
}
