//! A Tiresias-style baseline (Gu et al., NSDI'19), as the Pollux (OSDI'21) artifact runs
//! it (`simulator/tiresias.py`): two-dimensional least-attained-service with discretized
//! queues, each job at the size it asked for or suspended.
//!
//! Rules, in order, at each decision (the state carries over between decisions):
//! 1. Jobs that ended are forgotten; a new job joins the end of the first queue.
//! 2. A running job's service grows by the time since the last decision (wall-clock time
//!    while admitted, restarts included) times the GPUs it asked for; one whose service
//!    reaches `threshold` GPU-seconds moves to the end of the second queue, for good.
//! 3. Admission: the first queue in arrival order, then the second in order of demotion;
//!    a job is admitted at its requested size when that fits in what the jobs before it
//!    left of the cluster (its nodes' allocatable resources summed: placement is the
//!    scheduler's), and suspended otherwise. A job that does not fit is skipped, so
//!    smaller jobs behind it run; a job admitted earlier that no longer fits is
//!    preempted (suspended, its progress kept).
//!
//! As in the artifact, it decides only every tick (not on arrivals and ends), there is
//! no promotion back and no starvation guard, and `threshold` is its 16 GPU-hours.

use std::collections::HashMap;

use crate::sim::TraceJob;
use crate::sim::policies::{Policy, ScaleDown};
use crate::{Snapshot, Target};

/// The artifact's queue threshold: 16 GPU-hours.
pub const THRESHOLD: f64 = 16.0 * 3600.0;

/// One job's place in the queues.
#[derive(Debug, Clone)]
struct Entry {
    /// Trainers (GPUs) it asked for.
    size: u32,
    /// GPU-seconds of service so far.
    service: f64,
    /// Admitted at the last decision.
    running: bool,
    /// When service was last counted.
    counted_at: f64,
}

/// The Tiresias-style policy.
#[derive(Debug, Clone)]
pub struct TiresiasPolicy {
    /// Service (GPU-seconds) after which a job drops to the second queue.
    pub threshold: f64,
    /// The sizes jobs asked for, learnt when they are submitted.
    asked: HashMap<String, u32>,
    entries: HashMap<String, Entry>,
    /// Job names by queue, in queue order.
    queues: [Vec<String>; 2],
}

impl Default for TiresiasPolicy {
    fn default() -> Self {
        TiresiasPolicy {
            threshold: THRESHOLD,
            asked: HashMap::new(),
            entries: HashMap::new(),
            queues: [Vec::new(), Vec::new()],
        }
    }
}

impl TiresiasPolicy {
    /// The new trainer count of every job of `snap` (by index), before comparing.
    fn plan(&mut self, snap: &Snapshot) -> Vec<u32> {
        let now = snap.now;
        let present: HashMap<&str, usize> = snap
            .jobs
            .iter()
            .enumerate()
            .map(|(i, j)| (j.name.as_str(), i))
            .collect();
        self.entries
            .retain(|name, _| present.contains_key(name.as_str()));
        for q in &mut self.queues {
            q.retain(|name| present.contains_key(name.as_str()));
        }
        let mut arrivals: Vec<usize> = (0..snap.jobs.len())
            .filter(|&i| !self.entries.contains_key(&snap.jobs[i].name))
            .collect();
        arrivals.sort_by(|&a, &b| {
            let (a, b) = (&snap.jobs[a], &snap.jobs[b]);
            a.submitted
                .total_cmp(&b.submitted)
                .then(a.name.cmp(&b.name))
        });
        for i in arrivals {
            let job = &snap.jobs[i];
            let size = self
                .asked
                .get(&job.name)
                .copied()
                .unwrap_or(job.min)
                .clamp(job.min.max(1), job.max.max(1));
            self.entries.insert(
                job.name.clone(),
                Entry {
                    size,
                    service: 0.0,
                    running: false,
                    counted_at: now,
                },
            );
            self.queues[0].push(job.name.clone());
        }
        // Every queued job has an entry (both are pruned and filled together above).
        for e in self.entries.values_mut() {
            if e.running {
                e.service += (now - e.counted_at).max(0.0) * f64::from(e.size);
            }
            e.counted_at = now;
        }
        let demoted: Vec<String> = self.queues[0]
            .iter()
            .filter(|n| self.entries[n.as_str()].service >= self.threshold)
            .cloned()
            .collect();
        self.queues[0].retain(|n| !demoted.contains(n));
        self.queues[1].extend(demoted);
        let mut free = snap.total();
        let mut to = vec![0; snap.jobs.len()];
        for name in self.queues[0].iter().chain(&self.queues[1]) {
            let i = present[name.as_str()];
            let e = self
                .entries
                .get_mut(name)
                .expect("queued jobs have entries");
            let need = snap.jobs[i].trainer * u64::from(e.size);
            e.running = free.fits(&need);
            if e.running {
                free = free.saturating_sub(&need);
                to[i] = e.size;
            }
        }
        to
    }
}

impl Policy for TiresiasPolicy {
    fn name(&self) -> String {
        "Tiresias".to_owned()
    }
    fn resizes(&self) -> bool {
        true
    }
    fn initial(&mut self, job: &TraceJob) -> u32 {
        self.asked.insert(job.name.clone(), job.fixed);
        0
    }
    fn decide(&mut self, snapshot: &Snapshot) -> Vec<Target> {
        let plan = self.plan(snapshot);
        snapshot
            .jobs
            .iter()
            .zip(plan)
            .enumerate()
            .filter(|(_, (j, to))| j.trainers != *to)
            .map(|(i, (j, to))| Target {
                job: i,
                from: j.trainers,
                to,
            })
            .collect()
    }
    fn scale_down(&self) -> ScaleDown {
        ScaleDown::Drain
    }
    /// The artifact decides every 60 s only.
    fn decides_on_events(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{Speed, SpeedupSpec};
    use crate::{JobView, Node, PodCounts, Resources};

    const GPU: Resources = Resources {
        cpu_milli: 1000,
        mem_mib: 1024,
        gpu: 1,
    };

    fn spec(name: &str, size: u32) -> TraceJob {
        TraceJob {
            name: name.to_owned(),
            submit: 0.0,
            min: 1,
            max: 4 * size,
            fixed: size,
            priority: 0,
            trainer: GPU,
            pservers: 0,
            pserver: Resources::ZERO,
            work: 1.0,
            speed: Speed::Curve(SpeedupSpec { a: 1.0, sigma: 0.0 }),
            epochs: None,
        }
    }

    fn view(name: &str, submitted: f64, trainers: u32, size: u32) -> JobView {
        JobView {
            name: name.to_owned(),
            min: 1,
            max: 4 * size,
            priority: 0,
            trainer: GPU,
            trainers,
            waiting: Vec::new(),
            pods: PodCounts {
                total: trainers,
                running: trainers,
                pending: 0,
                unbound: 0,
            },
            submitted,
            changed_at: None,
            speed: Vec::new(),
            remaining: None,
        }
    }

    fn snap(now: f64, jobs: Vec<JobView>) -> Snapshot {
        Snapshot {
            now,
            nodes: (0..2)
                .map(|i| Node {
                    name: format!("n{i}"),
                    allocatable: Resources::new(16.0, 64.0, 4),
                    requested: Resources::ZERO,
                })
                .collect(),
            unplaced: Resources::ZERO,
            jobs,
        }
    }

    fn targets(p: &mut TiresiasPolicy, s: &Snapshot) -> Vec<(String, u32)> {
        p.decide(s)
            .into_iter()
            .map(|t| (s.jobs[t.job].name.clone(), t.to))
            .collect()
    }

    /// On 8 GPUs: a job of 6 arrives first, then one of 4 and one of 2. The 4 does not
    /// fit behind the 6 and is skipped; the 2 fills the gap. Every job runs at the size
    /// it asked for or not at all.
    #[test]
    fn admits_in_arrival_order_at_the_asked_size_and_backfills_what_fits() {
        let mut p = TiresiasPolicy::default();
        for (name, size) in [("a", 6), ("b", 4), ("c", 2)] {
            assert_eq!(p.initial(&spec(name, size)), 0, "queued until admitted");
        }
        let s = snap(
            0.0,
            vec![
                view("a", 0.0, 0, 6),
                view("b", 1.0, 0, 4),
                view("c", 2.0, 0, 2),
            ],
        );
        assert_eq!(
            targets(&mut p, &s),
            [("a".to_owned(), 6), ("c".to_owned(), 2)]
        );
    }

    /// A job whose service passes the threshold drops behind a newer one, which
    /// preempts it; the demoted job keeps its place ahead of later demotions and runs
    /// again when room frees.
    #[test]
    fn a_job_past_the_threshold_is_preempted_by_newer_ones() {
        let mut p = TiresiasPolicy {
            threshold: 600.0,
            ..TiresiasPolicy::default()
        };
        p.initial(&spec("old", 6));
        p.initial(&spec("new", 4));
        let t = targets(&mut p, &snap(0.0, vec![view("old", 0.0, 0, 6)]));
        assert_eq!(t, [("old".to_owned(), 6)]);
        // 60 s of 6 GPUs: 360 GPU-seconds, still first.
        let t = targets(
            &mut p,
            &snap(60.0, vec![view("old", 0.0, 6, 6), view("new", 50.0, 0, 4)]),
        );
        assert!(t.is_empty(), "new waits behind old: {t:?}");
        // 120 s: 720 GPU-seconds: old drops behind new, which takes its place.
        let t = targets(
            &mut p,
            &snap(120.0, vec![view("old", 0.0, 6, 6), view("new", 50.0, 0, 4)]),
        );
        assert_eq!(t, [("old".to_owned(), 0), ("new".to_owned(), 4)]);
        // new ends: old runs again.
        let t = targets(&mut p, &snap(180.0, vec![view("old", 0.0, 0, 6)]));
        assert_eq!(t, [("old".to_owned(), 6)]);
    }

    /// The calibration of issue 36: on the artifact's workloads at load 1.0, the
    /// average JCT is within 15% of the one the Pollux paper published for Tiresias
    /// (`results-jobload/tiresias-1.0/summary.json`).
    #[test]
    fn reproduces_the_published_tiresias_jcts() {
        use crate::sim::{apps::Applications, simulate, workload};
        let apps = Applications::builtin();
        let at_load_1: Vec<_> = crate::sim::pollux_data::WORKLOADS
            .iter()
            .filter(|(_, load, _)| *load == 1.0)
            .collect();
        assert_eq!(
            at_load_1.len(),
            4,
            "the artifact's four workloads at load 1.0"
        );
        for (name, load, text) in at_load_1 {
            let published =
                crate::sim::suite::published("Tiresias", name, *load).expect("published");
            let jobs = workload::parse(name, text, &apps).expect("workload");
            let scenario = workload::scenario("w", &jobs, &apps, 1);
            let result = simulate(&scenario, &mut TiresiasPolicy::default());
            let jcts: Vec<f64> = result.jobs.iter().filter_map(|j| j.completion).collect();
            assert_eq!(jcts.len(), jobs.len(), "every job finishes");
            let avg = jcts.iter().sum::<f64>() / jcts.len() as f64;
            assert!(
                (avg / published - 1.0).abs() <= 0.15,
                "{name}: {avg:.0} s, published {published} s"
            );
        }
    }
}
