//! A discrete-event simulator of a cluster running elastic training jobs under an
//! autoscaling policy, to compare policies on the same trace.
//!
//! The model (what is and is not simulated is listed in `docs/autoscaler.md`):
//! - **Nodes** offer CPU, memory and GPUs. A **scheduler** like Kubernetes' binds pending
//!   pods in creation order to the feasible node with the most room left (its
//!   `LeastAllocated` score), never puts a pod without GPUs on a GPU node (the usual
//!   taint), and does not gang-schedule: a job may run with part of its pods.
//! - **Jobs** arrive from a trace with their pservers, the requests of one trainer,
//!   min/max trainers (a fixed count for the policy `none`), an amount of work (records)
//!   and a true speed-up curve ([`Speedup`]). A job trains while all its pservers and at
//!   least one trainer run, at the curve's rate for the trainers running.
//! - **Costs**: a pod runs `startup` seconds after it is bound; each change of a job's
//!   running trainers stalls it for `event_cost` seconds (trainers rejoin, leases move);
//!   a trainer scaled down drains for `drain` seconds (it finishes its task and keeps its
//!   node), or, under a policy that kills, is gone at once and its task's work is lost.
//! - **Policies** see a [`Snapshot`](crate::Snapshot) every `tick` seconds and on every arrival and end of
//!   a job, and answer new trainer counts ([`Policy`]).
//! - **Measured**: per job the pending time (submission until it first trains) and the
//!   completion time; over the run the makespan, CPU and GPU utilisation (requests of
//!   bound pods over allocatable, averaged over the makespan) and scale events; and a
//!   timeline for the plots.
//!
//! Everything is deterministic: events at the same instant run in the order they were
//! scheduled, and the only randomness (noise on observed speeds) comes from the seed.
//!
//! Layout:
//! - this file: scenarios, results, [`simulate`] and [`compare`];
//! - `engine`: the event queue, the scheduler, the jobs' progress;
//! - `policies`: the three policies (`none`, EDL's, edl's) behind [`Policy`];
//! - `trace`: the scenarios: EDL's published experiment and a synthetic day on a large
//!   cluster;
//! - `report`: the side-by-side table; `plot`: the SVG figure.

use serde::{Deserialize, Serialize};

use crate::{Resources, Speedup};

pub mod apps;
pub mod bound;
pub mod calibration;
mod engine;
pub mod plot;
pub mod policies;
pub mod pollux_data;
pub mod report;
pub mod suite;
pub mod table;
pub mod tiresias;
pub mod trace;
pub mod workload;

#[cfg(test)]
mod tests;

pub use policies::{EdlPolicy, FixedPolicy, PaddlePolicy, Policy, ScaleDown};

/// The simulator's costs and clocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimConfig {
    /// Seconds between autoscaler runs (also run on each arrival and end of a job).
    pub tick: f64,
    /// Seconds from binding a pod to its process running.
    pub startup: f64,
    /// Seconds a drained trainer keeps its node while it finishes its task.
    pub drain: f64,
    /// Seconds a job makes no progress after its running trainers change.
    pub event_cost: f64,
    /// Seconds of one trainer's work lost when it is killed instead of drained.
    pub killed_work: f64,
    /// Seconds between timeline samples.
    pub sample_every: f64,
    /// Relative noise on the speeds a policy observes (0.05: +-5%).
    pub observation_noise: f64,
    /// Seed of that noise.
    pub seed: u64,
    /// The simulation stops here (seconds) even if jobs are left.
    pub horizon: f64,
    /// Seconds before a pod that found no node is tried again (doubling each time).
    pub backoff_initial: f64,
    /// The longest such wait (Kubernetes 1.6: 60 s; today 10 s).
    pub backoff_max: f64,
    /// Samples also record each job's running trainers and the CPU of the pods running
    /// (not those starting), as EDL's collector counts them (for `sim::calibration`).
    #[serde(default)]
    pub sample_jobs: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            tick: 5.0,
            startup: 5.0,
            drain: 5.0,
            event_cost: 2.0,
            killed_work: 5.0,
            sample_every: 10.0,
            observation_noise: 0.05,
            seed: 1,
            horizon: 14.0 * 86_400.0,
            backoff_initial: 1.0,
            backoff_max: 10.0,
            sample_jobs: false,
        }
    }
}

/// One job of a trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceJob {
    /// Unique name.
    pub name: String,
    /// Submission time (seconds).
    pub submit: f64,
    /// Fewest trainers under an autoscaler.
    pub min: u32,
    /// Most trainers under an autoscaler.
    pub max: u32,
    /// Trainers without an autoscaler (the policy `none`).
    pub fixed: u32,
    /// Priority (higher first).
    pub priority: i32,
    /// Requests of one trainer.
    pub trainer: Resources,
    /// Parameter servers (fixed).
    pub pservers: u32,
    /// Requests of one parameter server.
    pub pserver: Resources,
    /// Records to train.
    pub work: f64,
    /// The job's true speed with n trainers (records/s).
    pub speed: Speed,
    /// How finely its progress is known: `None`, to the record (edl's master counts
    /// the records of a job of fixed passes); `Some(e)`, by whole epochs of `e` (the
    /// Pollux workloads' jobs): a policy sees the work of the epochs not yet completed.
    #[serde(default)]
    pub epochs: Option<u32>,
}

/// A job's true speed with `n` trainers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Speed {
    /// A speed-up curve.
    Curve(SpeedupSpec),
    /// Measured rates with 1, 2, ... trainers (beyond the last: the last).
    Table(Vec<f64>),
}

impl Speed {
    /// The rate with `n` trainers (0 with none).
    pub fn rate(&self, n: u32) -> f64 {
        match self {
            Speed::Curve(c) => Speedup::from(*c).rate(n),
            Speed::Table(rates) if n == 0 || rates.is_empty() => 0.0,
            Speed::Table(rates) => rates[(n as usize).min(rates.len()) - 1],
        }
    }

    /// The fewest trainers, up to `max`, at which it is fastest: more would add nothing.
    pub fn fastest_within(&self, max: u32) -> u32 {
        let mut best = 1;
        for n in 2..=max {
            if self.rate(n) > self.rate(best) {
                best = n;
            }
        }
        best.min(max.max(1))
    }
}

/// A serialisable [`Speedup`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SpeedupSpec {
    /// One trainer's rate (records/s).
    pub a: f64,
    /// Contention.
    pub sigma: f64,
}

impl From<SpeedupSpec> for Speedup {
    fn from(s: SpeedupSpec) -> Speedup {
        Speedup {
            a: s.a,
            sigma: s.sigma,
        }
    }
}

/// A cluster and the jobs submitted to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Scenario {
    /// Short name (`edl-experiment`, `day`).
    pub name: String,
    /// What it reproduces.
    pub description: String,
    /// Allocatable resources of each node.
    pub nodes: Vec<Resources>,
    /// The trace, in submission order.
    pub jobs: Vec<TraceJob>,
    /// Costs and clocks.
    pub config: SimConfig,
    /// The best average JCT it is judged against ([`bound`]), if any.
    #[serde(default)]
    pub bound: Option<BoundKind>,
}

/// Which bound a scenario's average JCT is judged against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BoundKind {
    /// [`bound::fluid`]: jobs that contend for the whole cluster.
    Fluid,
    /// [`bound::all_at_max`]: every job at its fastest from its submission.
    AllAtMax,
}

/// What happened to one job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobOutcome {
    /// The job's name.
    pub name: String,
    /// Seconds from submission until it first trained (`None`: never did).
    pub pending: Option<f64>,
    /// Seconds from submission until it finished (`None`: not by the horizon).
    pub completion: Option<f64>,
    /// Trainer-count changes applied to it.
    pub scale_events: u32,
}

/// One point of the timeline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds since the first submission.
    pub t: f64,
    /// CPU requested by bound pods over allocatable.
    pub cpu: f64,
    /// GPUs requested by bound pods over allocatable (0 without GPUs).
    pub gpu: f64,
    /// Trainers running.
    pub trainers: u32,
    /// Jobs submitted that have not trained yet.
    pub pending_jobs: u32,
    /// With [`SimConfig::sample_jobs`]: each job's running trainers (trace order).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub job_trainers: Vec<u32>,
    /// With [`SimConfig::sample_jobs`]: CPU requested by pods running or draining (not
    /// starting) over allocatable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_running: Option<f64>,
}

/// The result of one policy on one scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimResult {
    /// The policy's name.
    pub policy: String,
    /// Per job, in trace order.
    pub jobs: Vec<JobOutcome>,
    /// Seconds from the first submission to the last completion (or the horizon).
    pub makespan: f64,
    /// Mean CPU utilisation over the makespan.
    pub cpu_util: f64,
    /// Mean GPU utilisation over the makespan (`None` without GPUs).
    pub gpu_util: Option<f64>,
    /// Mean CPU utilisation while the cluster was contended: some job waited for its
    /// first trainer or a pod of its minimum, or could take more trainers (below its
    /// max under an autoscaler, below its fixed count without). Outside those times no
    /// policy could use more, so this is the share a policy used of what it could.
    pub cpu_util_contended: f64,
    /// The same for GPUs (`None` without GPUs).
    pub gpu_util_contended: Option<f64>,
    /// Seconds the cluster was contended.
    pub contended_secs: f64,
    /// Trainer-count changes applied, all jobs.
    pub scale_events: u32,
    /// The timeline.
    pub samples: Vec<Sample>,
}

/// Runs `scenario` under `policy` to the end of its last job (or the horizon).
pub fn simulate(scenario: &Scenario, policy: &mut dyn Policy) -> SimResult {
    engine::Engine::new(scenario, policy).run()
}

/// The policies of a run on a real workload: none, EDL's, the Tiresias-style
/// baseline, edl's.
pub fn workload_policies() -> Vec<Box<dyn Policy>> {
    let mut p = standard_policies(crate::paddle::Defects::default());
    p.insert(2, Box::new(tiresias::TiresiasPolicy::default()));
    // edl's policy knows what a change costs on this cluster.
    if let Some(last) = p.last_mut() {
        *last = Box::new(EdlPolicy {
            config: workload::policy_config(),
        });
    }
    p
}

/// The policies of a side-by-side run: none, EDL's (defects as asked), edl's.
pub fn standard_policies(paddle_defects: crate::paddle::Defects) -> Vec<Box<dyn Policy>> {
    vec![
        Box::new(FixedPolicy),
        Box::new(PaddlePolicy::new(crate::paddle::PaddleConfig {
            defects: paddle_defects,
            ..Default::default()
        })),
        Box::new(EdlPolicy::default()),
    ]
}

/// Every policy's run on one scenario, with the table's rows and the goals.
#[derive(Debug, Clone)]
pub struct Comparison {
    /// The scenario's name.
    pub scenario: String,
    /// Its description (the table's title).
    pub description: String,
    /// One run per policy: none, EDL, [EDL with its defects,] edl.
    pub results: Vec<SimResult>,
    /// The rows of the table, in the same order.
    pub summaries: Vec<report::Summary>,
    /// The bound the scenario is judged against, computed: which and its JCT.
    pub bound: Option<(BoundKind, f64)>,
    /// edl against EDL and none.
    pub goals: Vec<report::Goal>,
}

/// Runs none, EDL's algorithm (and, with `with_defects`, EDL's algorithm with its
/// defects) and edl's policy with settings `edl` on `scenario`; `progress` is told each
/// policy before it runs.
pub fn compare(
    scenario: &Scenario,
    with_defects: bool,
    edl: crate::policy::PolicyConfig,
    progress: &mut dyn FnMut(&str),
) -> Comparison {
    let mut policies = standard_policies(crate::paddle::Defects::default());
    if let Some(last) = policies.last_mut() {
        *last = Box::new(EdlPolicy { config: edl });
    }
    if with_defects {
        policies.insert(
            2,
            Box::new(PaddlePolicy::new(crate::paddle::PaddleConfig {
                defects: crate::paddle::Defects::ALL,
                ..Default::default()
            })),
        );
    }
    compare_policies(scenario, policies, progress)
}

/// Runs `policies` on `scenario`: the first must be none, the second EDL's and the
/// last edl's (the goals compare those three).
pub fn compare_policies(
    scenario: &Scenario,
    policies: Vec<Box<dyn Policy>>,
    progress: &mut dyn FnMut(&str),
) -> Comparison {
    let mut results = Vec::new();
    for mut policy in policies {
        progress(&policy.name());
        results.push(simulate(scenario, policy.as_mut()));
    }
    let summaries: Vec<report::Summary> = results.iter().map(report::Summary::of).collect();
    let edl = summaries.len() - 1;
    let bound = scenario.bound.and_then(|kind| {
        let jct = match kind {
            // The share of the cluster both autoscalers fill.
            BoundKind::Fluid => {
                bound::fluid(scenario, crate::policy::PolicyConfig::default().max_load)?.jct
            }
            BoundKind::AllAtMax => bound::all_at_max(scenario),
        };
        Some((kind, jct))
    });
    let goals = report::goals(&summaries[0], &summaries[1], &summaries[edl], bound);
    Comparison {
        scenario: scenario.name.clone(),
        description: scenario.description.clone(),
        results,
        summaries,
        bound,
        goals,
    }
}
