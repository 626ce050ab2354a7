//! A job's speed as an autoscaler learns it: from samples of the job's progress (work
//! done so far, trainers running) to [`Observation`]s at each trainer count, and the
//! bookkeeping of the job's last change. The operator and `edl run --autoscale` keep one
//! [`JobMemory`] per job and count progress with [`task_progress`]; the simulator
//! measures speeds its own way (it knows them).
//!
//! Invariants (unit tests below):
//! - a speed is observed only over a window in which the running trainer count did not
//!   change and that lasted at least `window` seconds; the window restarts at every
//!   change of the count, so a scale event's stall and the trainers' start-up are not
//!   mistaken for the new count's speed;
//! - progress that goes backwards (a job restarted from a checkpoint, a counter reset)
//!   restarts the window and observes nothing;
//! - at most [`KEEP`] observations are kept, newest last, and the newest at each count
//!   stays while there is room for one per count ([`remember`]); time is an argument.

use crate::Observation;

/// Observations kept per job.
pub const KEEP: usize = 16;

/// What an autoscaler remembers of one job between passes.
#[derive(Debug, Clone, PartialEq)]
pub struct JobMemory {
    /// Seconds a window of steady trainers must last to give a speed.
    pub window: f64,
    /// Speeds observed, newest last.
    pub speed: Vec<Observation>,
    /// When the autoscaler last changed the job's trainer count.
    pub changed_at: Option<f64>,
    /// The current window: (start time, work done then, trainers running).
    start: Option<(f64, f64, u32)>,
}

impl JobMemory {
    /// A job not seen before; speeds are observed over windows of `window` seconds.
    pub fn new(window: f64) -> JobMemory {
        JobMemory {
            window,
            speed: Vec::new(),
            changed_at: None,
            start: None,
        }
    }

    /// The job had done `done` work (any unit, cumulative) at `now` with `trainers`
    /// training.
    pub fn sample(&mut self, now: f64, trainers: u32, done: f64) {
        let Some((t0, d0, n0)) = self.start else {
            self.start = Some((now, done, trainers));
            return;
        };
        if trainers != n0 || done < d0 || now < t0 || !done.is_finite() {
            self.start = Some((now, done, trainers));
            return;
        }
        let dt = now - t0;
        if dt < self.window {
            return;
        }
        if trainers > 0 {
            remember(
                &mut self.speed,
                Observation {
                    trainers,
                    rate: (done - d0) / dt,
                },
            );
        }
        self.start = Some((now, done, trainers));
    }

    /// The autoscaler changed the job's trainer count at `now`.
    pub fn changed(&mut self, now: f64) {
        self.changed_at = Some(now);
    }
}

/// Adds `o` to a job's speeds (newest last), keeping at most [`KEEP`]: the oldest
/// observation of a count observed again later goes first, so the last speed seen at
/// each count is kept (a count found slow is not tried again for being forgotten).
pub fn remember(speed: &mut Vec<Observation>, o: Observation) {
    speed.push(o);
    if speed.len() <= KEEP {
        return;
    }
    let repeated = (0..speed.len()).find(|&i| {
        speed[i + 1..]
            .iter()
            .any(|later| later.trainers == speed[i].trainers)
    });
    speed.remove(repeated.unwrap_or(0));
}

/// A job's progress counted in tasks, from its master's queue: the current pass (0-based)
/// of `passes`, and the current pass's tasks by state. Returns the tasks done over all
/// passes (failed ones count: they are over) and the tasks left; `None` before the
/// master has a dataset (no tasks).
pub fn task_progress(
    pass: u32,
    passes: u32,
    todo: u64,
    pending: u64,
    done: u64,
    failed: u64,
) -> Option<(f64, f64)> {
    let per_pass = (todo + pending + done + failed) as f64;
    if per_pass == 0.0 {
        return None;
    }
    let so_far = f64::from(pass) * per_pass + (done + failed) as f64;
    let all = f64::from(passes) * per_pass;
    Some((so_far, (all - so_far).max(0.0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_speed_at_each_count_is_kept() {
        let mut speed = Vec::new();
        remember(
            &mut speed,
            Observation {
                trainers: 5,
                rate: 3.0,
            },
        );
        for k in 0..2 * KEEP {
            remember(
                &mut speed,
                Observation {
                    trainers: 4,
                    rate: k as f64,
                },
            );
        }
        assert_eq!(speed.len(), KEEP);
        assert_eq!(
            speed[0],
            Observation {
                trainers: 5,
                rate: 3.0
            }
        );
        assert_eq!(speed[KEEP - 1].rate, (2 * KEEP - 1) as f64);
        // One per count and no room left: the oldest goes.
        let mut distinct = Vec::new();
        for n in 1..=KEEP as u32 + 1 {
            remember(
                &mut distinct,
                Observation {
                    trainers: n,
                    rate: 1.0,
                },
            );
        }
        assert_eq!(distinct.len(), KEEP);
        assert_eq!(distinct[0].trainers, 2);
    }

    #[test]
    fn progress_counts_every_pass() {
        assert_eq!(task_progress(2, 5, 6, 1, 2, 1), Some((23.0, 27.0)));
        assert_eq!(task_progress(0, 1, 0, 0, 0, 0), None);
        // Past the last pass (a reopened job counting again): nothing is left.
        assert_eq!(task_progress(5, 5, 0, 0, 10, 0), Some((60.0, 0.0)));
    }

    #[test]
    fn a_steady_window_gives_its_speed() {
        let mut m = JobMemory::new(10.0);
        m.sample(0.0, 2, 0.0);
        m.sample(5.0, 2, 100.0);
        assert!(m.speed.is_empty(), "a window shorter than 10 s");
        m.sample(10.0, 2, 200.0);
        assert_eq!(
            m.speed,
            vec![Observation {
                trainers: 2,
                rate: 20.0
            }]
        );
        // The next window starts where this one ended.
        m.sample(20.0, 2, 500.0);
        assert_eq!(m.speed[1].rate, 30.0);
    }

    #[test]
    fn a_change_of_trainers_or_progress_going_back_restarts_the_window() {
        let mut m = JobMemory::new(10.0);
        m.sample(0.0, 2, 0.0);
        m.sample(8.0, 3, 80.0);
        // 3 trainers since 8 s: the window 8..16 is too short, 8..18 is one.
        m.sample(16.0, 3, 200.0);
        assert!(m.speed.is_empty());
        m.sample(18.0, 3, 230.0);
        assert_eq!(m.speed.len(), 1);
        assert_eq!(m.speed[0].trainers, 3);
        assert!((m.speed[0].rate - 15.0).abs() < 1e-9);
        // Restored from a checkpoint: less done than before.
        m.sample(20.0, 3, 100.0);
        m.sample(29.0, 3, 190.0);
        assert_eq!(m.speed.len(), 1, "no window across a reset");
        m.sample(30.0, 3, 200.0);
        assert_eq!(m.speed.len(), 2);
        assert!((m.speed[1].rate - 10.0).abs() < 1e-9);
    }

    #[test]
    fn no_trainers_observe_nothing_and_only_the_newest_are_kept() {
        let mut m = JobMemory::new(1.0);
        m.sample(0.0, 0, 0.0);
        m.sample(5.0, 0, 0.0);
        assert!(m.speed.is_empty());
        for i in 0..40 {
            m.sample(6.0 + f64::from(i), 1, f64::from(i) * 3.0);
        }
        assert_eq!(m.speed.len(), KEEP);
        assert!(m.speed.iter().all(|o| (o.rate - 3.0).abs() < 1e-9));
        m.changed(50.0);
        assert_eq!(m.changed_at, Some(50.0));
    }
}
