//! Admission when whole jobs may be suspended ([`PolicyConfig::preempt`]): the order of
//! the jobs waiting for their minimum, the units (trainers above a minimum, or whole jobs
//! at it) taken to make room, and the queued jobs put into the room growth leaves.

#[cfg(doc)]
use super::PolicyConfig;
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
        let left = j.remaining.unwrap_or(1.0).max(1.0);
        curve.rate(n) / left.powf(self.cfg.size_exponent) / (f64::from(n) * self.share(&j.trainer))
    }

    /// The best worth of a trainer growth could add now (0: none).
    fn best_growth(&self, order: &[usize]) -> f64 {
        self.best_receiver(order)
            .map_or(0.0, |i| self.worth(i, self.target[i] + 1))
    }

    /// Step 3 with preemption: starved jobs in order of priority, then of the worth of
    /// their minimum. A job is admitted when free room, or trainers and suspended jobs
    /// worth less than it (by `hysteresis`, or of a lower priority), make room for its
    /// minimum; free room only when no running job's growth is worth more. An elastic
    /// job that is not admitted is queued (0 trainers) and returned; a fixed one keeps
    /// its pods waiting, and its room is held.
    pub(super) fn admit_by_worth(
        &mut self,
        order: &[usize],
        starved: &[Option<Vec<Resources>>],
    ) -> Vec<(usize, Vec<Resources>)> {
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
            let may_use_free = worth >= self.best_growth(order);
            if !self.make_room(order, starved, s, pods, worth, may_use_free) {
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
                    queued.push((s, all));
                } else {
                    self.used += pods.iter().copied().sum();
                }
            }
        }
        queued
    }

    /// Makes room for starved job `s`'s `pods`, from free room when `may_use_free` and
    /// from donors worth less than `worth`: true when done; nothing changes when not.
    fn make_room(
        &mut self,
        order: &[usize],
        starved: &[Option<Vec<Resources>>],
        s: usize,
        pods: &[Resources],
        worth: f64,
        may_use_free: bool,
    ) -> bool {
        let saved = (self.target.clone(), self.used, self.idle.clone());
        let mut pods = pods.to_vec();
        pods.sort_by_key(|r| std::cmp::Reverse((r.gpu, r.cpu_milli, r.mem_mib)));
        let need: Resources = pods.iter().copied().sum();
        let mut ok = true;
        for pod in &pods {
            if may_use_free && let Some(n) = self.tightest(pod) {
                self.idle[n] = self.idle[n].saturating_sub(pod);
                continue;
            }
            if !self.take_from_donor(order, starved, s, Some(pod), worth) {
                ok = false;
                break;
            }
        }
        while ok && !(may_use_free && self.free().fits(&need)) {
            if !self.take_from_donor(order, starved, s, None, worth) {
                ok = false;
            }
        }
        if ok {
            self.used += need;
        } else {
            (self.target, self.used, self.idle) = saved;
        }
        ok
    }

    /// Takes the unit worth least that may go to starved job `s`: a trainer above a
    /// job's minimum, or a whole job at its minimum (suspended), of the same or a lower
    /// priority, worth less than `worth` by `hysteresis` unless of a lower priority. A
    /// job is suspended only when it would take longer than `s` plus two changes.
    /// False when there is none.
    fn take_from_donor(
        &mut self,
        order: &[usize],
        starved: &[Option<Vec<Resources>>],
        s: usize,
        pod: Option<&Resources>,
        worth: f64,
    ) -> bool {
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
        let Some((d, (_, count))) = best else {
            return false;
        };
        self.target[d] -= count;
        let freed = self.job(d).trainer * u64::from(count);
        self.used = self.used.saturating_sub(&freed);
        true
    }

    /// After growth: queued jobs (with the pods each needs for its minimum), worth most
    /// first, into the room left.
    pub(super) fn admit_into_free_room(&mut self, queued: &[(usize, Vec<Resources>)]) {
        let mut queued = queued.to_vec();
        queued.sort_by(|a, b| self.by_block_worth(a.0, b.0));
        for (s, pods) in queued {
            // Its other pods already count (admit_by_worth): only its trainers are new.
            let trainer = self.job(s).trainer;
            let others: Resources = pods.iter().copied().filter(|r| *r != trainer).sum();
            let need: Resources = pods
                .iter()
                .copied()
                .sum::<Resources>()
                .saturating_sub(&others);
            if !self.free().fits(&need) {
                continue;
            }
            let saved = self.idle.clone();
            let placed = pods.iter().all(|pod| match self.tightest(pod) {
                Some(k) => {
                    self.idle[k] = self.idle[k].saturating_sub(pod);
                    true
                }
                None => false,
            });
            if placed {
                self.used += need;
                self.target[s] = self.job(s).min.max(1);
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
