//! Sub-linear speed-up with trainers: `rate(n) = a * n / (1 + sigma * (n - 1))`.
//!
//! `a` is one trainer's rate and `sigma` the contention (0: linear; 1: no gain from a
//! second trainer). The simulator gives each job a true curve of this family; the edl
//! policy fits one to a job's observed speeds ([`Speedup::fit`]) to judge what another
//! trainer is worth.

use crate::Observation;

/// A speed-up curve.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Speedup {
    /// One trainer's rate.
    pub a: f64,
    /// Contention in `[0, 1]`.
    pub sigma: f64,
}

impl Speedup {
    /// The rate with `n` trainers (0 with none).
    pub fn rate(&self, n: u32) -> f64 {
        if n == 0 {
            return 0.0;
        }
        let n = f64::from(n);
        self.a * n / (1.0 + self.sigma * (n - 1.0))
    }

    /// What the `n+1`-th trainer adds.
    pub fn marginal(&self, n: u32) -> f64 {
        self.rate(n + 1) - self.rate(n)
    }

    /// The curve that best explains `observed` (least squares of `n / rate` against
    /// `n - 1`, which is linear in this family). With speeds at a single trainer count the
    /// contention is `prior_sigma`; with none, `None`.
    pub fn fit(observed: &[Observation], prior_sigma: f64) -> Option<Speedup> {
        let points: Vec<(f64, f64)> = observed
            .iter()
            .filter(|o| o.trainers > 0 && o.rate.is_finite() && o.rate > 0.0)
            .map(|o| (f64::from(o.trainers) - 1.0, f64::from(o.trainers) / o.rate))
            .collect();
        if points.is_empty() {
            return None;
        }
        let len = points.len() as f64;
        let mx = points.iter().map(|p| p.0).sum::<f64>() / len;
        let my = points.iter().map(|p| p.1).sum::<f64>() / len;
        let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
        let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        let sigma_fit = |intercept: f64, slope: f64| (slope / intercept).clamp(0.0, 1.0);
        let (a, sigma) = if sxx < 1e-9 {
            // One trainer count: `n / rate = (1 + sigma * (n - 1)) / a` with the prior sigma.
            let a = (1.0 + prior_sigma * mx) / my;
            (a, prior_sigma)
        } else {
            let slope = sxy / sxx;
            let intercept = my - slope * mx;
            if intercept <= 0.0 {
                // Noise made the fit meaningless: fall back to the mean rate per trainer.
                let a = (1.0 + prior_sigma * mx) / my;
                (a, prior_sigma)
            } else {
                (1.0 / intercept, sigma_fit(intercept, slope))
            }
        };
        (a.is_finite() && a > 0.0).then_some(Speedup { a, sigma })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(curve: Speedup, ns: &[u32]) -> Vec<Observation> {
        ns.iter()
            .map(|&n| Observation {
                trainers: n,
                rate: curve.rate(n),
            })
            .collect()
    }

    #[test]
    fn a_curve_is_recovered_from_two_trainer_counts() {
        let truth = Speedup {
            a: 120.0,
            sigma: 0.05,
        };
        let fit = Speedup::fit(&obs(truth, &[2, 8, 8, 20]), 0.0).expect("fit");
        assert!((fit.a - 120.0).abs() < 1e-6, "{fit:?}");
        assert!((fit.sigma - 0.05).abs() < 1e-9, "{fit:?}");
    }

    #[test]
    fn one_trainer_count_uses_the_prior_contention() {
        let truth = Speedup {
            a: 10.0,
            sigma: 0.1,
        };
        let fit = Speedup::fit(&obs(truth, &[4, 4]), 0.1).expect("fit");
        assert!((fit.a - 10.0).abs() < 1e-9, "{fit:?}");
        assert_eq!(Speedup::fit(&[], 0.1), None);
    }

    #[test]
    fn the_marginal_rate_falls_with_contention() {
        let c = Speedup { a: 1.0, sigma: 0.2 };
        assert!(c.marginal(1) > c.marginal(5));
        assert!(c.marginal(5) > c.marginal(20));
        let linear = Speedup { a: 1.0, sigma: 0.0 };
        assert!((linear.marginal(7) - 1.0).abs() < 1e-12);
    }
}
