//! What a scenario's average JCT could be at best, to judge a policy against more than
//! another policy:
//!
//! - [`all_at_max`]: every job running from its submission at the fastest count its
//!   range allows, alone on the cluster, with no start-up. A true lower bound: no policy
//!   finishes a job sooner. Loose where jobs contend (the synthetic day's peaks).
//! - [`fluid`]: the experiment's jobs contend for the whole cluster, so the all-at-max
//!   bound says little there. A fluid model of the cluster: trainers divisible (in
//!   quarters), no start-up, stall, drain, scheduler or fragmentation across nodes, the
//!   share `load` of the cluster filled (as both autoscalers fill it), each admitted
//!   job's pservers held until it ends. The allocations searched: admit up to a cap of
//!   jobs at a time (first come), and share trainers by greatest worth, the marginal
//!   speed over the work left to the power `e`; `e` 0 is equal marginal speeds (as
//!   equal sharing when the jobs are alike), larger `e` favours the jobs nearest their
//!   end. The bound is the best average JCT of the searched allocations: what a policy
//!   without overheads reaches with the best of them, not a proof that nothing could do
//!   better.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::{Scenario, TraceJob};
use crate::Resources;

/// Trainers are divided in steps of this size in the fluid model.
const PIECE: f64 = 0.25;

/// The fluid model's time step (seconds).
const STEP: f64 = 0.5;

/// The worth exponents `e` of the allocations searched.
pub const EXPONENTS: [f64; 4] = [0.0, 0.5, 1.0, 2.0];

/// The caps on jobs admitted at a time searched (`None`: every job that fits).
pub const CAPS: [Option<usize>; 4] = [None, Some(16), Some(12), Some(8)];

/// The mean over jobs of each one's work at the fastest count of its range, from its
/// submission: no policy's average JCT is lower.
pub fn all_at_max(scenario: &Scenario) -> f64 {
    let n = scenario.jobs.len().max(1) as f64;
    scenario.jobs.iter().map(fastest_time).sum::<f64>() / n
}

fn fastest_time(j: &TraceJob) -> f64 {
    let best = (1..=j.max.max(1))
        .map(|n| j.speed.rate(n))
        .fold(0.0, f64::max);
    if best > 0.0 {
        j.work / best
    } else {
        f64::INFINITY
    }
}

/// The best fluid allocation's average JCT, and which it was.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fluid {
    /// Its average JCT (seconds).
    pub jct: f64,
    /// Its worth exponent.
    pub exponent: f64,
    /// Its cap on jobs admitted at a time (`None`: none).
    pub cap: Option<usize>,
}

/// The fluid bound of `scenario` with `load` of the cluster filled: the best average
/// JCT of the allocations of [`EXPONENTS`] x [`CAPS`] (module docs). `None` for a
/// scenario without jobs, or whose jobs never all end (a job that fits nowhere).
pub fn fluid(scenario: &Scenario, load: f64) -> Option<Fluid> {
    let mut best: Option<Fluid> = None;
    for exponent in EXPONENTS {
        for cap in CAPS {
            let Some(jct) = fluid_run(scenario, load, exponent, cap) else {
                continue;
            };
            if best.is_none_or(|b| jct < b.jct) {
                best = Some(Fluid { jct, exponent, cap });
            }
        }
    }
    best
}

/// Resources as fractions, for divisible trainers.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Amount([f64; 3]);

impl Amount {
    fn of(r: &Resources) -> Amount {
        Amount([r.cpu_milli as f64, r.mem_mib as f64, r.gpu as f64])
    }

    fn fits(&self, other: &Amount) -> bool {
        (0..3).all(|k| other.0[k] <= self.0[k] + 1e-9)
    }

    fn minus(&self, other: &Amount, times: f64) -> Amount {
        let mut out = *self;
        for k in 0..3 {
            out.0[k] -= other.0[k] * times;
        }
        out
    }
}

/// A job's rate with a fractional count: the rates between whole counts joined by lines.
fn rate(j: &TraceJob, n: f64) -> f64 {
    let lo = n.floor();
    let frac = n - lo;
    let lo_rate = j.speed.rate(lo as u32);
    if frac < 1e-12 {
        return lo_rate;
    }
    lo_rate + frac * (j.speed.rate(lo as u32 + 1) - lo_rate)
}

/// One piece of trainer offered to a job, by its worth.
#[derive(Debug, PartialEq)]
struct Offer {
    worth: f64,
    job: usize,
}

impl Eq for Offer {}

impl PartialOrd for Offer {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Offer {
    fn cmp(&self, other: &Self) -> Ordering {
        self.worth
            .total_cmp(&other.worth)
            .then(other.job.cmp(&self.job))
    }
}

/// One allocation's average JCT in the fluid model (`None` if some job never ends).
fn fluid_run(scenario: &Scenario, load: f64, exponent: f64, cap: Option<usize>) -> Option<f64> {
    let jobs = &scenario.jobs;
    if jobs.is_empty() {
        return None;
    }
    let total: Resources = scenario.nodes.iter().copied().sum();
    let room = Amount(Amount::of(&total).0.map(|v| v * load));
    let mut done = vec![0.0f64; jobs.len()];
    let mut end: Vec<Option<f64>> = vec![None; jobs.len()];
    let mut admitted = vec![false; jobs.len()];
    let last_submit = jobs.iter().map(|j| j.submit).fold(0.0, f64::max);
    // Long enough for every job alone, one after another, at a single trainer.
    let horizon = last_submit
        + jobs
            .iter()
            .map(|j| j.work / j.speed.rate(1).max(1e-9))
            .sum::<f64>();
    let mut count = vec![0.0f64; jobs.len()];
    let mut t = 0.0;
    while end.iter().any(Option::is_none) {
        if t > horizon {
            return None;
        }
        // Admission, first come, within the cap and the room for pservers.
        let mut free = room;
        let mut live = 0;
        for (i, j) in jobs.iter().enumerate() {
            if admitted[i] && end[i].is_none() {
                free = free.minus(&Amount::of(&j.pserver), f64::from(j.pservers));
                live += 1;
            }
        }
        for (i, j) in jobs.iter().enumerate() {
            if admitted[i] || end[i].is_some() || j.submit > t {
                continue;
            }
            let ps = Amount::of(&(j.pserver * u64::from(j.pservers)));
            if cap.is_some_and(|c| live >= c) || !free.fits(&ps) {
                break;
            }
            admitted[i] = true;
            free = free.minus(&ps, 1.0);
            live += 1;
        }
        // Trainers, a piece at a time, to the greatest worth.
        let worth = |i: usize, n: f64| {
            let j = &jobs[i];
            let gain = (rate(j, n + PIECE) - rate(j, n)) / PIECE;
            let left = (j.work - done[i]).max(1.0);
            gain / left.powf(exponent)
        };
        let mut offers = BinaryHeap::new();
        for i in 0..jobs.len() {
            count[i] = 0.0;
            if admitted[i] && end[i].is_none() {
                offers.push(Offer {
                    worth: worth(i, 0.0),
                    job: i,
                });
            }
        }
        while let Some(Offer { job: i, .. }) = offers.pop() {
            let j = &jobs[i];
            let piece = Amount::of(&j.trainer);
            let piece = Amount(piece.0.map(|v| v * PIECE));
            if !free.fits(&piece) || count[i] + PIECE > f64::from(j.max) + 1e-9 {
                continue;
            }
            free = free.minus(&piece, 1.0);
            count[i] += PIECE;
            offers.push(Offer {
                worth: worth(i, count[i]),
                job: i,
            });
        }
        for (i, j) in jobs.iter().enumerate() {
            if !admitted[i] || end[i].is_some() {
                continue;
            }
            let r = rate(j, count[i]);
            if r <= 0.0 {
                continue;
            }
            let left = j.work - done[i];
            if r * STEP >= left {
                end[i] = Some(t + left / r);
            }
            done[i] += r * STEP;
        }
        t += STEP;
    }
    let n = jobs.len() as f64;
    Some(
        jobs.iter()
            .zip(&end)
            .map(|(j, e)| e.unwrap_or(f64::INFINITY) - j.submit)
            .sum::<f64>()
            / n,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{SimConfig, Speed, SpeedupSpec};

    fn job(name: &str, submit: f64, work: f64, sigma: f64, max: u32) -> TraceJob {
        TraceJob {
            name: name.to_owned(),
            submit,
            min: 1,
            max,
            fixed: max,
            priority: 0,
            trainer: Resources::new(1.0, 1.0, 0),
            pservers: 1,
            pserver: Resources::new(1.0, 1.0, 0),
            work,
            speed: Speed::Curve(SpeedupSpec { a: 10.0, sigma }),
            epochs: None,
        }
    }

    fn scenario(cores: f64, jobs: Vec<TraceJob>) -> Scenario {
        Scenario {
            name: "t".into(),
            description: String::new(),
            nodes: vec![Resources::new(cores, 1024.0, 0)],
            jobs,
            config: SimConfig::default(),
            bound: None,
        }
    }

    #[test]
    fn all_at_max_is_each_jobs_fastest_time() {
        // Linear: 10/s per trainer; 4 trainers: 1,000 records in 25 s; 8: 12.5 s.
        let s = scenario(
            100.0,
            vec![job("a", 0.0, 1000.0, 0.0, 4), job("b", 5.0, 1000.0, 0.0, 8)],
        );
        assert!((all_at_max(&s) - (25.0 + 12.5) / 2.0).abs() < 1e-9);
    }

    #[test]
    fn a_lone_job_on_a_large_cluster_runs_at_its_max() {
        // Room for far more than 4 trainers: the fluid bound is the all-at-max bound.
        let s = scenario(100.0, vec![job("a", 0.0, 1000.0, 0.1, 4)]);
        let f = fluid(&s, 1.0).expect("ends");
        assert!(
            (f.jct - all_at_max(&s)).abs() <= STEP,
            "{f:?} vs {}",
            all_at_max(&s)
        );
    }

    #[test]
    fn jobs_that_share_a_full_cluster_take_longer_than_alone() {
        // 9 cores: a pserver each, 7 trainers to share; linear speed-up, so any split
        // of the trainers trains at 70/s; one job first is best: it ends at 1000/70 s,
        // then the other has its pserver's core too, 8 trainers, for the rest.
        let s = scenario(
            9.0,
            vec![job("a", 0.0, 1000.0, 0.0, 8), job("b", 0.0, 1000.0, 0.0, 8)],
        );
        let f = fluid(&s, 1.0).expect("ends");
        let first = 1000.0 / 70.0;
        let best = (first + first + 1000.0 / 80.0) / 2.0;
        assert!(
            f.jct >= best - STEP && f.jct <= best + 2.0 * STEP,
            "{f:?} vs {best}"
        );
        assert!(f.jct > all_at_max(&s), "{f:?}");
    }

    #[test]
    fn a_job_that_fits_nowhere_has_no_fluid_bound() {
        let mut j = job("a", 0.0, 1000.0, 0.0, 4);
        j.pserver = Resources::new(50.0, 1.0, 0);
        assert_eq!(fluid(&scenario(10.0, vec![j]), 1.0), None);
    }
}
