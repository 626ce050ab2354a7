//! A job's speed at each trainer count as the policy predicts it: what was observed where
//! it was observed, the fitted curve ([`Speedup`]) elsewhere, and only the counts worth
//! running at.
//!
//! Real speeds are not a smooth curve. A fixed global batch split over more GPUs, the
//! gradient accumulation that a small count needs and a placement that spans one node more
//! make some counts slower than fewer trainers (the Pollux artifact's YOLOv3 at batch 64:
//! 7.2 steps/s on 4 GPUs, 3.5 on 6, 6.6 on 9). A curve fitted to such speeds predicts
//! gains that are not there, and a policy that follows it grows, observes the loss,
//! shrinks, forgets, and grows again.
//!
//! So the model keeps the *upper concave hull* of the speeds by count, `(0, 0)` included:
//! - an observed count has the mean of its observations;
//! - a count not observed has the fitted curve's speed;
//! - only the counts on the hull, or below it by no more than the noise of an
//!   observation ([`NOISE`]), are worth running at: a count further below is slower
//!   than a mix of two counts on the hull.
//!
//! [`RateModel::rate`] interpolates the hull, so the speed a trainer adds
//! ([`RateModel::marginal`]) never rises with the count, and a greedy allocation by
//! marginal speed is the best one for the model.
//!
//! Invariants (tests below): the hull is concave, passes through `(0, 0)`, lies on or above
//! every count's speed, and its vertices are counts worth running at.

use crate::{Observation, Speedup};

/// How far below the hull a count's speed may be and still be worth running at: twice
/// the noise of an observed speed (the simulator's is 5%).
pub const NOISE: f64 = 0.1;

/// The predicted speed of one job at every trainer count up to its maximum.
#[derive(Debug, Clone, PartialEq)]
pub struct RateModel {
    /// The hull's vertices `(count, speed)`, by count, `(0, 0)` first.
    hull: Vec<(u32, f64)>,
    /// The hull's speed at each count up to the maximum and one more (index: count):
    /// [`RateModel::rate`] is a lookup, as policies ask it for every job and trainer.
    on_hull: Vec<f64>,
    /// The speed at each count (index: count): observed or fitted.
    speeds: Vec<f64>,
    /// The mean speed observed at each count, where observed (index: count).
    observed: Vec<Option<f64>>,
    /// One trainer's speed as the fit has it (the unit of `min_gain`).
    pub unit: f64,
}

impl RateModel {
    /// The model of a job with `observed` speeds and at most `max` trainers; `None`
    /// when nothing was observed.
    pub fn new(observed: &[Observation], prior_sigma: f64, max: u32) -> Option<RateModel> {
        let fit = Speedup::fit(observed, prior_sigma)?;
        let max = max.max(1);
        let mut sums = vec![(0.0, 0u32); max as usize + 1];
        for o in observed {
            if o.trainers > 0 && o.trainers <= max && o.rate.is_finite() && o.rate > 0.0 {
                let s = &mut sums[o.trainers as usize];
                s.0 += o.rate;
                s.1 += 1;
            }
        }
        let seen: Vec<Option<f64>> = sums
            .iter()
            .map(|&(sum, k)| (k > 0).then(|| sum / f64::from(k)))
            .collect();
        let speeds: Vec<f64> = (0..=max)
            .map(|n| match seen[n as usize] {
                _ if n == 0 => 0.0,
                Some(v) => v,
                None => fit.rate(n),
            })
            .collect();
        let hull = upper_hull(&speeds);
        let on_hull = hull_rates(&hull, max + 1);
        Some(RateModel {
            hull,
            on_hull,
            speeds,
            observed: seen,
            unit: fit.a,
        })
    }

    /// The speed with `n` trainers: the hull, flat past its last vertex.
    pub fn rate(&self, n: u32) -> f64 {
        match self.on_hull.get(n as usize) {
            Some(&r) => r,
            None => hull_rate(&self.hull, n),
        }
    }

    /// What the `n+1`-th trainer adds.
    pub fn marginal(&self, n: u32) -> f64 {
        self.rate(n + 1) - self.rate(n)
    }

    /// Whether `n` trainers is a count worth running at: its speed is on the hull, or
    /// below it by no more than [`NOISE`] (observed speeds are noisy).
    pub fn is_vertex(&self, n: u32) -> bool {
        n == 0
            || self
                .speeds
                .get(n as usize)
                .is_some_and(|&r| r >= (1.0 - NOISE) * self.rate(n))
    }

    /// The fewest trainers above `n` worth running at and faster than `n` (`None`: no
    /// count above `n` is).
    pub fn vertex_above(&self, n: u32) -> Option<u32> {
        let now = self.speeds.get(n as usize).copied().unwrap_or(0.0);
        (n + 1..self.speeds.len() as u32)
            .find(|&c| self.is_vertex(c) && self.speeds[c as usize] > now)
    }

    /// The most trainers below `n` worth running at (0 at worst).
    pub fn vertex_below(&self, n: u32) -> u32 {
        (1..n.min(self.speeds.len() as u32))
            .rev()
            .find(|&c| self.is_vertex(c))
            .unwrap_or(0)
    }

    /// The mean speed observed with `n` trainers, if observed.
    pub fn observed(&self, n: u32) -> Option<f64> {
        self.observed.get(n as usize).copied().flatten()
    }
}

/// The speed of `hull` at `n` trainers: between vertices on the line joining them, flat
/// past the last.
fn hull_rate(hull: &[(u32, f64)], n: u32) -> f64 {
    let k = hull.partition_point(|&(c, _)| c <= n);
    if k >= hull.len() {
        return hull.last().map_or(0.0, |v| v.1);
    }
    // hull[0] is (0, 0), so 0 < k here.
    let (c0, r0) = hull[k - 1];
    let (c1, r1) = hull[k];
    r0 + (r1 - r0) * f64::from(n - c0) / f64::from(c1 - c0)
}

/// [`hull_rate`] at every count from 0 to `last`, in one sweep over the vertices (the
/// same arithmetic: the policy builds a model per job per pass).
fn hull_rates(hull: &[(u32, f64)], last: u32) -> Vec<f64> {
    let mut out = Vec::with_capacity(last as usize + 1);
    // k: the first vertex past n, as `hull_rate`'s partition point.
    let mut k = 0;
    for n in 0..=last {
        while k < hull.len() && hull[k].0 <= n {
            k += 1;
        }
        out.push(if k >= hull.len() {
            hull.last().map_or(0.0, |v| v.1)
        } else {
            let (c0, r0) = hull[k - 1];
            let (c1, r1) = hull[k];
            r0 + (r1 - r0) * f64::from(n - c0) / f64::from(c1 - c0)
        });
    }
    out
}

/// The vertices of the upper concave hull of `(n, speeds[n])`, `(0, 0)` first. A count
/// no faster than the last vertex so far is under the hull (which never falls).
fn upper_hull(speeds: &[f64]) -> Vec<(u32, f64)> {
    let mut hull: Vec<(u32, f64)> = vec![(0, 0.0)];
    for (n, &r) in speeds.iter().enumerate().skip(1) {
        if r <= hull.last().map_or(0.0, |v| v.1) {
            continue;
        }
        let p = (n as u32, r);
        while hull.len() >= 2 {
            let (a, b) = (hull[hull.len() - 2], hull[hull.len() - 1]);
            // b is under the chord from a to p: not a vertex. A count on the chord (up
            // to rounding) stays one: a linear stretch is worth running at each count.
            let cross = f64::from(b.0 - a.0) * (p.1 - a.1) - (b.1 - a.1) * f64::from(p.0 - a.0);
            let scale = f64::from(p.0 - a.0) * (p.1 - a.1).abs().max(f64::MIN_POSITIVE);
            if cross > 1e-9 * scale {
                hull.pop();
            } else {
                break;
            }
        }
        hull.push(p);
    }
    hull
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn at(n: u32, rate: f64) -> Observation {
        Observation { trainers: n, rate }
    }

    /// YOLOv3 at batch 64 on the Pollux cluster (steps/s): 4 GPUs beat 5 to 8.
    #[test]
    fn a_count_slower_than_fewer_trainers_is_not_worth_running_at() {
        let seen = [
            at(1, 2.5),
            at(3, 6.5),
            at(4, 7.2),
            at(5, 3.9),
            at(6, 3.5),
            at(9, 6.6),
        ];
        let m = RateModel::new(&seen, 0.05, 16).expect("model");
        assert!(m.is_vertex(4), "{m:?}");
        for n in [5, 6] {
            assert!(!m.is_vertex(n), "{n}: {m:?}");
        }
        assert_eq!(m.vertex_below(6), 4);
        assert_eq!(
            m.vertex_above(1),
            Some(2).filter(|&n| m.is_vertex(n)).or(Some(3))
        );
        // Nothing observed past 4 is faster: growth from 4 skips at least to 10.
        assert!(m.vertex_above(4).is_none_or(|n| n >= 10), "{m:?}");
        assert_eq!(m.observed(6), Some(3.5));
        assert!(m.rate(6) >= 7.2 - 1e-9);
        assert!(m.marginal(0) > m.marginal(3));
    }

    #[test]
    fn counts_not_observed_follow_the_fit_anchored_to_what_was() {
        let truth = Speedup {
            a: 10.0,
            sigma: 0.1,
        };
        let seen = [at(2, truth.rate(2)), at(2, truth.rate(2))];
        let m = RateModel::new(&seen, 0.1, 8).expect("model");
        for n in 1..=8 {
            assert!((m.rate(n) - truth.rate(n)).abs() < 1e-9, "{n}");
            assert!(m.is_vertex(n), "{n}");
        }
        assert_eq!(m.vertex_above(8), None);
        assert_eq!(RateModel::new(&[], 0.1, 8), None);
    }

    proptest! {
        #[test]
        fn the_hull_is_concave_and_covers_every_count(
            rates in proptest::collection::vec(0.1f64..100.0, 1..24),
        ) {
            let seen: Vec<Observation> =
                rates.iter().enumerate().map(|(i, &r)| at(i as u32 + 1, r)).collect();
            let max = rates.len() as u32;
            let m = RateModel::new(&seen, 0.05, max).expect("model");
            prop_assert_eq!(m.rate(0), 0.0);
            for n in 1..=max {
                prop_assert!(m.rate(n) >= rates[n as usize - 1] - 1e-9);
                if m.is_vertex(n) {
                    prop_assert!(rates[n as usize - 1] >= (1.0 - NOISE) * m.rate(n) - 1e-9);
                }
                prop_assert!(m.marginal(n) <= m.marginal(n - 1) + 1e-9);
                prop_assert!(m.marginal(n - 1) >= -1e-9);
            }
            // The sweep is `hull_rate` at every count, to the bit (and past the end).
            for n in 0..=max + 3 {
                prop_assert_eq!(m.rate(n).to_bits(), hull_rate(&m.hull, n).to_bits());
            }
        }
    }
}
