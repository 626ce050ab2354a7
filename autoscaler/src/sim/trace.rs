//! The scenarios: EDL's published experiment, and a synthetic day on a large cluster.

use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::Resources;
use crate::sim::{BoundKind, Scenario, SimConfig, Speed, SpeedupSpec, TraceJob};

/// EDL's experiment (its `doc/autoscale/experiment`, case 1): 133 nodes; 20 MNIST jobs
/// submitted 10 s apart, each with 10 pservers (4 CPU, 5 GiB), trainers of 5 CPU and
/// 8 GiB, min 2 and max 60 trainers (submitted with 2) or a fixed 60 without autoscaling;
/// 10 passes of MNIST's 60,000 records.
///
/// What the experiment does not publish is chosen and stated here:
/// - node sizes: the total allocatable CPU is inferred from its collector's per-job CPU
///   shares (a 60-trainer job, 341 cores, was 14.52%): about 2,348 cores. Here 40 nodes
///   of 24 cores and 93 of 16 cores with 1.6 reserved for the system (14.4 allocatable):
///   2,299 cores, 64 GiB each. The layout matters (how 5-core trainers and 4-core
///   pservers pack); `docs/autoscaler.md` shows the results under other layouts;
/// - the job's speed: 160 records/s per trainer, contention 0.08 (60 trainers run 10.5x
///   one; a small model with 10 pservers and batches of 10 scales poorly), so a job at
///   60 trainers trains its 10 passes in about 6 minutes, as the experiment's jobs ran
///   for minutes;
/// - Kubernetes 1.6's scheduler backoff (1 s doubling to 60 s) and a 2 s pod start (the
///   experiment's second case, with room to spare, measured 1.5 s pending);
/// - the master's 1 CPU per job is left out.
pub fn edl_experiment() -> Scenario {
    let mut nodes = vec![Resources::new(24.0, 64.0, 0); 40];
    nodes.extend(vec![Resources::new(14.4, 64.0, 0); 93]);
    let jobs = (0..20)
        .map(|i| TraceJob {
            name: format!("mnist{i}"),
            submit: 10.0 * f64::from(i),
            min: 2,
            max: 60,
            fixed: 60,
            priority: 0,
            trainer: Resources::new(5.0, 8.0, 0),
            pservers: 10,
            pserver: Resources::new(4.0, 5.0, 0),
            work: 600_000.0,
            speed: Speed::Curve(SpeedupSpec {
                a: 160.0,
                sigma: 0.08,
            }),
            epochs: None,
        })
        .collect();
    Scenario {
        name: "edl-experiment".to_owned(),
        description: "EDL's experiment: 133 nodes, 20 jobs 10 s apart, 2-60 trainers vs a fixed 60"
            .to_owned(),
        nodes,
        jobs,
        config: SimConfig {
            startup: 2.0,
            backoff_initial: 1.0,
            backoff_max: 60.0,
            ..SimConfig::default()
        },
        bound: Some(BoundKind::Fluid),
    }
}

/// The synthetic day's knobs.
#[derive(Debug, Clone, PartialEq)]
pub struct DayParams {
    /// Jobs submitted over the day.
    pub jobs: usize,
    /// Nodes with 8 GPUs, 64 cores and 512 GiB.
    pub gpu_nodes: usize,
    /// Nodes with 32 cores and 128 GiB.
    pub cpu_nodes: usize,
    /// Median run time of a job at its requested size (seconds).
    pub median_secs: f64,
    /// Spread of the log-normal run time.
    pub sigma: f64,
    /// Seed of everything random.
    pub seed: u64,
}

impl Default for DayParams {
    fn default() -> Self {
        DayParams {
            jobs: 3000,
            gpu_nodes: 250,
            cpu_nodes: 750,
            median_secs: 7200.0,
            sigma: 1.5,
            seed: 7,
        }
    }
}

/// A day on a 1,000-node cluster, shaped like the public GPU-cluster traces (Microsoft's
/// Philly, SenseTime's Helios, Alibaba's PAI):
/// - arrivals: a Poisson process whose rate follows the day (peak in the afternoon at
///   1.6x the mean, trough at night at 0.4x);
/// - 70% GPU jobs (trainers of 1 GPU, 8 cores, 64 GiB) and 30% CPU jobs (trainers of 4
///   cores, 8 GiB);
/// - most jobs small: the requested trainers are 1, 2, 4, 8, 16, 32 or 64 with
///   probabilities 40, 20, 15, 10, 8, 5 and 2%;
/// - heavy-tailed run times: log-normal at the requested size (median 2 hours, sigma
///   1.5: most jobs run minutes to hours, a few half a day), capped at 12 hours;
/// - speed-up contention uniform in [0, 0.3] (some jobs scale well, some hardly);
/// - elastic range: half to twice the request (1 to 2 for one trainer); 10% of the jobs
///   are not elastic, 10% have a higher priority;
/// - pservers: one per 8 trainers requested (2 cores, 8 GiB);
/// - no job asks for more than a quarter of the trainers its kind of node can hold.
///
/// Without an autoscaler a job runs with what it requested.
pub fn day(p: &DayParams) -> Scenario {
    let mut rng = StdRng::seed_from_u64(p.seed);
    let mut nodes = vec![Resources::new(64.0, 512.0, 8); p.gpu_nodes];
    nodes.extend(vec![Resources::new(32.0, 128.0, 0); p.cpu_nodes]);
    let day = 86_400.0;
    let mean_gap = day / p.jobs as f64;
    let rate_at = |t: f64| 1.0 - 0.6 * (2.0 * std::f64::consts::PI * t / day).cos();
    let mut t = 0.0;
    let mut jobs = Vec::with_capacity(p.jobs);
    while jobs.len() < p.jobs {
        // Thinning: candidate arrivals at the peak rate, kept with rate_at / peak.
        t += -(1.0 - rng.random::<f64>()).ln() * mean_gap / 1.6;
        if rng.random::<f64>() * 1.6 > rate_at(t % day) {
            continue;
        }
        let i = jobs.len();
        let sizes = [
            (1, 0.40),
            (2, 0.20),
            (4, 0.15),
            (8, 0.10),
            (16, 0.08),
            (32, 0.05),
            (64, 0.02),
        ];
        let mut u = rng.random::<f64>();
        let mut want = 64u32;
        for (n, prob) in sizes {
            if u < prob {
                want = n;
                break;
            }
            u -= prob;
        }
        let gpu = rng.random::<f64>() < 0.7;
        // No job asks for more than a quarter of its kind of node (a cluster's admission
        // would refuse it), so every job's minimum fits.
        let capacity = if gpu {
            8 * p.gpu_nodes as u32
        } else {
            8 * p.cpu_nodes as u32
        };
        let want = want.min((capacity / 4).max(1));
        let trainer = if gpu {
            Resources::new(8.0, 64.0, 1)
        } else {
            Resources::new(4.0, 8.0, 0)
        };
        let sigma = rng.random::<f64>() * 0.3;
        let a = 100.0;
        let z = normal(&mut rng);
        let secs = (p.median_secs * (p.sigma * z).exp()).clamp(60.0, day / 2.0);
        let curve = crate::Speedup { a, sigma };
        let work = secs * curve.rate(want);
        let elastic = rng.random::<f64>() >= 0.1;
        let (min, max) = if elastic {
            ((want / 2).max(1), (want * 2).max(2))
        } else {
            (want, want)
        };
        let priority = i32::from(rng.random::<f64>() < 0.1);
        jobs.push(TraceJob {
            name: format!("job{i:04}"),
            submit: t,
            min,
            max,
            fixed: want,
            priority,
            trainer,
            pservers: want.div_ceil(8),
            pserver: Resources::new(2.0, 8.0, 0),
            work,
            speed: Speed::Curve(SpeedupSpec { a, sigma }),
            epochs: None,
        });
    }
    Scenario {
        name: "day".to_owned(),
        description: format!(
            "a synthetic day: {} nodes ({} with 8 GPUs), {} jobs, seed {}",
            p.gpu_nodes + p.cpu_nodes,
            p.gpu_nodes,
            p.jobs,
            p.seed
        ),
        nodes,
        jobs,
        config: SimConfig {
            sample_every: 120.0,
            seed: p.seed,
            ..SimConfig::default()
        },
        bound: Some(BoundKind::AllAtMax),
    }
}

/// A standard normal draw (Box-Muller).
fn normal(rng: &mut StdRng) -> f64 {
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}
