//! Admission when whole jobs may be suspended ([`PolicyConfig::preempt`]): the order of
//! the jobs waiting for their minimum, the units (trainers above a minimum, or whole jobs
//! at it) taken to make room, and the queued jobs put into the room growth leaves.

#[cfg(doc)]
use super::PolicyConfig;

/// A job queued at 0 trainers in this pass.
#[derive(Debug, Clone)]
pub(super) struct Queued {
    job: usize,
    /// The pods its minimum needs (its other pods, then its trainers).
    pods: Vec<Resources>,
    /// What of those already counts in the plan (its other pods, still waiting).
    held: Resources,
}
use super::{Plan, canonical};
use crate::Resources;

/// Admission when whole jobs may be suspended ([`PolicyConfig::preempt`]).
impl Plan<'_> {
    /// What a job's minimum is worth per unit of cluster: its speed with `min` trainers
    /// over its work left (the inverse of its estimated time left), infinite for a job
    /// never seen running (least attained service first).
    fn block_worth(&self, i: usize) -> f64 {
        let j = self.job(i);
        let Some(curve) = &self.curve[i] else {
            return f64::INFINITY;
        };
        let n = j.min.max(1);
        let (left_pow, share) = self.per[i];
        curve.rate(n) / left_pow / (f64::from(n) * share)
    }

    /// The best worth of a trainer growth could add now (0: none).
    fn best_growth(&self, order: &[usize]) -> f64 {
        self.best_receiver(order)
            .map_or(0.0, |i| self.worth(i, self.target[i] + 1))
    }

    /// Step 4 with preemption: starved jobs in order of priority, then of the worth of
    /// their minimum. A job whose minimum is worth at least every running job's next
    /// trainers is admitted when free room, or trainers and suspended jobs worth less
    /// than it (by `hysteresis`, or of a lower priority), make room for its minimum. An
    /// elastic job that is not admitted is queued (0 trainers) and returned; a fixed one
    /// keeps its pods waiting, and its room is held.
    pub(super) fn admit_by_worth(
        &mut self,
        order: &[usize],
        starved: &[Option<Vec<Resources>>],
    ) -> Vec<Queued> {
        let mut by_worth: Vec<usize> = order
            .iter()
            .copied()
            .filter(|&s| starved[s].is_some())
            .collect();
        by_worth.sort_by(|&a, &b| self.by_block_worth(a, b));
        let mut queued = Vec::new();
        for s in by_worth {
            let Some(pods) = &starved[s] else { continue };
            let worth = self.block_worth(s);
            // A job worth less than some running job's growth waits for the room
            // growth leaves.
            let admitted = worth >= self.best_growth(order)
                && self.place_minimum(pods, |plan, pod| {
                    plan.take_from_donor(order, starved, s, pod, worth)
                });
            if !admitted {
                let j = self.job(s);
                let bound = j.pods.total - j.pods.unbound;
                // A recent change keeps the trainers it has bound.
                if j.is_elastic() && (bound == 0 || !self.frozen[s]) {
                    // Its pods for the minimum once all its trainers are gone.
                    let mut all = pods.clone();
                    all.extend(std::iter::repeat_n(j.trainer, bound.min(j.min) as usize));
                    // Its other pods (pservers) keep waiting, and count.
                    let short = j.min.saturating_sub(bound) as usize;
                    let others: Resources = pods[..pods.len() - short].iter().copied().sum();
                    self.used += others;
                    self.target[s] = 0;
                    queued.push(Queued {
                        job: s,
                        pods: all,
                        held: others,
                    });
                } else {
                    self.used += pods.iter().copied().sum();
                }
            }
        }
        queued
    }

    /// Takes the unit worth least that may go to starved job `s`: a trainer above a
    /// job's minimum, or a whole job at its minimum (suspended), of the same or a lower
    /// priority, worth less than `worth` by `hysteresis` unless of a lower priority. A
    /// job is suspended only when it would take longer than `s` plus two changes.
    /// The trainer and how many were taken; `None` when there is none.
    fn take_from_donor(
        &mut self,
        order: &[usize],
        starved: &[Option<Vec<Resources>>],
        s: usize,
        pod: Option<&Resources>,
        worth: f64,
    ) -> Option<(Resources, u32)> {
        let sj = self.job(s);
        let s_time = self.time_left(s, sj.min.max(1)).unwrap_or(0.0);
        let unit = |d: usize| -> Option<(f64, u32)> {
            let dj = self.job(d);
            let n = self.target[d];
            if d == s
                || starved[d].is_some()
                || dj.priority > sj.priority
                || n == 0
                || self.curve[d].is_none()
                || pod.is_some_and(|p| !dj.trainer.fits(p))
            {
                return None;
            }
            let (w, count) = if n > dj.min {
                (self.worth(d, n), 1)
            } else if dj.is_elastic() && !self.frozen[d] {
                let left = self.time_left(d, n)?;
                if left <= s_time + 2.0 * self.cfg.change_cost {
                    return None;
                }
                (self.block_worth(d), n)
            } else {
                return None;
            };
            let lower = dj.priority < sj.priority;
            (lower || w * (1.0 + self.cfg.hysteresis) < worth).then_some((w, count))
        };
        let best = order
            .iter()
            .copied()
            .filter_map(|d| unit(d).map(|u| (d, u)))
            .min_by(|a, b| {
                (a.1.0)
                    .total_cmp(&b.1.0)
                    .then(self.job(a.0).priority.cmp(&self.job(b.0).priority))
                    .then(canonical(self.job(b.0), self.job(a.0)))
            });
        let (d, (_, count)) = best?;
        self.target[d] -= count;
        let trainer = self.job(d).trainer;
        self.used = self.used.saturating_sub(&(trainer * u64::from(count)));
        Some((trainer, count))
    }

    /// After growth: queued jobs, worth most first, into the room left.
    pub(super) fn admit_into_free_room(&mut self, queued: &[Queued]) {
        let mut queued = queued.to_vec();
        queued.sort_by(|a, b| self.by_block_worth(a.job, b.job));
        for q in queued {
            let need = q
                .pods
                .iter()
                .copied()
                .sum::<Resources>()
                .saturating_sub(&q.held);
            if !self.free().fits(&need) {
                continue;
            }
            let saved = self.idle.clone();
            let placed = q.pods.iter().all(|pod| match self.tightest(pod) {
                Some(k) => {
                    self.idle[k] = self.idle[k].saturating_sub(pod);
                    true
                }
                None => false,
            });
            if placed {
                self.used += need;
                self.target[q.job] = self.job(q.job).min.max(1);
            } else {
                self.idle = saved;
            }
        }
    }

    /// Priority first, then the worth of the minimum, most first.
    fn by_block_worth(&self, a: usize, b: usize) -> std::cmp::Ordering {
        self.job(b)
            .priority
            .cmp(&self.job(a).priority)
            .then(self.block_worth(b).total_cmp(&self.block_worth(a)))
            .then(canonical(self.job(a), self.job(b)))
    }
}
