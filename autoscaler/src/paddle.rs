//! EDL's autoscaler (PaddlePaddle/edl `pkg/autoscaler.go`, last changed in 749a705),
//! reproduced as a pure function so the simulator can run it beside edl's policy.
//!
//! One pass, as published (run every 5 s and on every TrainingJob event):
//! 1. The snapshot: total allocatable CPU, memory and GPUs; the requests of every pod not
//!    finished, bound or pending (pservers, masters and other tenants included); each
//!    node's idle CPU and free memory (allocatable minus its bound pods' requests).
//! 2. Candidates: the elastic jobs (`min < max`); all of them if some job has all its
//!    trainer pods pending, otherwise only jobs whose trainer pods all run.
//! 3. Sort by fulfillment `(parallelism - min) / (max - min)` ascending; exact ties by the
//!    trainer's GPU, then CPU, then memory request. The order is fixed for the pass.
//! 4. Repeat dry runs until one changes nothing: walk the jobs ascending and try +1
//!    (below max; the cluster's free memory above one trainer's; a node whose idle CPU and
//!    memory fit one trainer; `total CPU * max_load - requested CPU >= trainer CPU`; GPU
//!    jobs also a free GPU), then walk descending and try -1 (above max; or, when the
//!    requested CPU (or GPU) exceeds `total * max_load`, above min). A +1 or -1 moves the
//!    cluster's requests by one trainer.
//! 5. Apply `parallelism + diff` to every candidate.
//!
//! Its defects are reproduced when asked ([`Defects`]); by default they are fixed, so
//! the comparison is with the algorithm, not its bugs:
//! - `node_sign`: a dry-run scale-up *adds* the trainer to the chosen node's idle CPU
//!   and memory instead of taking it away, so many trainers "fit" on one node;
//! - `unordered`: the node is the first of a Go map (arbitrary: an iteration starts at
//!   a random place), and so is the order of tied jobs; reproduced with a seeded
//!   random start and a seeded shuffle;
//! - `write_back`: every candidate is written back on every pass, changed or not (the
//!   answer then lists unchanged targets too);
//! - `gpu_threshold` (found while reproducing it): a scale-up fills GPUs to 100% but a
//!   scale-down starts above `max_load`, so with GPUs between the two every dry run adds
//!   a trainer and removes one, and EDL's loop never ends;
//! - `taints`: a trainer without GPUs is counted as fitting on a GPU node.
//!
//! What it cannot do by construction (and edl's policy does, see [`crate::policy`]):
//! move more than one trainer per job per dry run, leave a job alone for a while, tell
//! priorities apart, or ask whether a job speeds up with more trainers. Scaling down
//! lowers a Kubernetes Job's parallelism, so the surplus trainers are killed, not drained.

use rand::{Rng, SeedableRng, rngs::StdRng, seq::SliceRandom};
use serde::{Deserialize, Serialize};

use crate::{Resources, Snapshot, Target};

/// EDL's defects, each reproduced when `true`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Defects {
    /// A dry-run scale-up adds to the node's idle resources instead of taking from them.
    pub node_sign: bool,
    /// Nodes and tied jobs in an arbitrary (seeded) order.
    pub unordered: bool,
    /// Every candidate written back on every pass.
    pub write_back: bool,
    /// A scale-up fills GPUs to 100% while a scale-down starts above `max_load`: with
    /// GPUs between the two, each dry run adds one and removes one and a pass never ends
    /// (here: it stops after [`MAX_DRY_RUNS`]). Fixed: scale-ups stop at `max_load` too.
    pub gpu_threshold: bool,
    /// The node check ignores taints: a trainer without GPUs "fits" on a GPU node, where
    /// the scheduler will not put it. Fixed: such nodes are skipped.
    pub taints: bool,
}

impl Defects {
    /// All of them, as published.
    pub const ALL: Defects = Defects {
        node_sign: true,
        unordered: true,
        write_back: true,
        gpu_threshold: true,
        taints: true,
    };
}

/// EDL's settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PaddleConfig {
    /// `max_load_desired`: the fraction of the cluster's CPU (and GPUs) it fills (0.97).
    pub max_load: f64,
    /// Which defects to reproduce.
    pub defects: Defects,
    /// Seed of the arbitrary orders (with `defects.unordered`).
    pub seed: u64,
}

impl Default for PaddleConfig {
    fn default() -> Self {
        PaddleConfig {
            max_load: 0.97,
            defects: Defects::default(),
            seed: 1,
        }
    }
}

/// Dry runs of one pass stop here even if the last one changed something. EDL's loop
/// had no bound: with the `gpu_threshold` defect it never returned, as if its process
/// hung until restarted. A pass that settles needs at most one dry run per trainer it
/// adds to one job (+1 per job per dry run), fewer than this for the jobs simulated here
/// (the most is 96, a day's job from 32 to 128 trainers).
pub const MAX_DRY_RUNS: usize = 150;

struct Cluster {
    total: Resources,
    requested: Resources,
    node_idle: Vec<(i64, i64)>,
    /// `node_idle`, every node, searchable.
    all: FirstFit,
    /// `node_idle`, the nodes without GPUs (where a tainted GPU node is no choice).
    cpu_only: FirstFit,
}

mod first_fit;

use first_fit::FirstFit;

/// One pass of EDL's autoscaler over `snapshot`: the jobs whose trainer count changes
/// (or, with `defects.write_back`, every candidate). `pass` numbers the passes (it seeds
/// the arbitrary orders of `defects.unordered`).
pub fn decide(config: &PaddleConfig, snapshot: &Snapshot, pass: u64) -> Vec<Target> {
    decide_counted(config, snapshot, pass).0
}

/// [`decide`], and the dry runs the pass took ([`MAX_DRY_RUNS`] when it did not settle).
pub fn decide_counted(
    config: &PaddleConfig,
    snapshot: &Snapshot,
    pass: u64,
) -> (Vec<Target>, usize) {
    let mut rng = StdRng::seed_from_u64(config.seed ^ pass.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let have_pending = snapshot.jobs.iter().any(|j| j.pods.total == j.pods.pending);
    let mut order: Vec<usize> = (0..snapshot.jobs.len())
        .filter(|&i| {
            let j = &snapshot.jobs[i];
            j.is_elastic() && (have_pending || j.pods.total == j.pods.running)
        })
        .collect();
    if config.defects.unordered {
        order.shuffle(&mut rng);
    }
    let fulfillment = |i: usize| {
        let j = &snapshot.jobs[i];
        (f64::from(j.trainers) - f64::from(j.min)) / (f64::from(j.max) - f64::from(j.min))
    };
    // Go's sort.Sort is not stable; the shuffle above stands for that. Without the defect
    // ties keep the snapshot's order.
    order.sort_by(|&a, &b| {
        let (ja, jb) = (&snapshot.jobs[a], &snapshot.jobs[b]);
        fulfillment(a)
            .total_cmp(&fulfillment(b))
            .then(ja.trainer.gpu.cmp(&jb.trainer.gpu))
            .then(ja.trainer.cpu_milli.cmp(&jb.trainer.cpu_milli))
            .then(ja.trainer.mem_mib.cmp(&jb.trainer.mem_mib))
    });
    let node_idle: Vec<(i64, i64)> = snapshot
        .nodes
        .iter()
        .map(|n| {
            (
                n.allocatable.cpu_milli as i64 - n.requested.cpu_milli as i64,
                n.allocatable.mem_mib as i64 - n.requested.mem_mib as i64,
            )
        })
        .collect();
    let mut cluster = Cluster {
        total: snapshot.total(),
        requested: snapshot.requested(),
        all: FirstFit::new(&node_idle, |_| true),
        cpu_only: FirstFit::new(&node_idle, |k| snapshot.nodes[k].allocatable.gpu == 0),
        node_idle,
    };
    // The map's order of the nodes: the nodes' order from `node_start`, wrapping.
    let mut node_start = 0;
    let nodes = snapshot.nodes.len();
    let mut diff = vec![0i64; snapshot.jobs.len()];
    let mut runs = 0;
    while runs < MAX_DRY_RUNS {
        runs += 1;
        let mut changed = false;
        // Scale up from the jobs that need it most, then down from those that need it
        // least; the map order of the nodes is drawn again for each scale-up.
        let walk = order
            .iter()
            .map(|&i| (i, false))
            .chain(order.iter().rev().map(|&i| (i, true)));
        for (i, down) in walk {
            if !down && config.defects.unordered && nodes > 0 {
                // A Go map's iteration starts at a random place and wraps around.
                let start = rng.random_range(0..nodes);
                node_start = (node_start + start) % nodes;
            }
            let d = dry_run(config, snapshot, &mut cluster, node_start, i, diff[i], down);
            diff[i] += d;
            changed |= d != 0;
        }
        if !changed {
            break;
        }
    }
    let targets = order
        .into_iter()
        .filter(|&i| config.defects.write_back || diff[i] != 0)
        .map(|i| {
            let from = snapshot.jobs[i].trainers;
            let to = (i64::from(from) + diff[i]).max(0) as u32;
            Target { job: i, from, to }
        })
        .collect();
    (targets, runs)
}

/// EDL's `scaleDryRun`: +1, -1 or 0 for one job, with the cluster's numbers moved by
/// the answer.
fn dry_run(
    config: &PaddleConfig,
    snapshot: &Snapshot,
    cluster: &mut Cluster,
    node_start: usize,
    i: usize,
    cur_diff: i64,
    scale_down: bool,
) -> i64 {
    let job = &snapshot.jobs[i];
    let t = job.trainer;
    let planned = i64::from(job.trainers) + cur_diff;
    let (min, max) = (i64::from(job.min), i64::from(job.max));
    let max_load = config.max_load;
    let mut node = None;
    let additional = if scale_down {
        if planned > max {
            -1
        } else {
            let gpu_over =
                cluster.requested.gpu as f64 > (cluster.total.gpu as f64 * max_load).trunc();
            let cpu_over = cluster.requested.cpu_milli as f64
                > (cluster.total.cpu_milli as f64 * max_load).trunc();
            if (gpu_over || cpu_over) && planned > min {
                -1
            } else {
                0
            }
        }
    } else if planned >= max {
        max - planned
    } else if cluster.total.mem_mib as i64 - cluster.requested.mem_mib as i64 <= t.mem_mib as i64 {
        0
    } else {
        // A trainer without GPUs is kept off GPU nodes (their taint), unless the
        // defect.
        let nodes = if !config.defects.taints && t.gpu == 0 {
            &cluster.cpu_only
        } else {
            &cluster.all
        };
        node = nodes.first(node_start, t.cpu_milli as i64, t.mem_mib as i64);
        match node {
            None => 0,
            Some(_) => {
                let cpu_room = (cluster.total.cpu_milli as f64 * max_load).trunc() as i64
                    - cluster.requested.cpu_milli as i64;
                let cpu = i64::from(cpu_room >= t.cpu_milli as i64);
                if t.gpu > 0 {
                    let gpus = if config.defects.gpu_threshold {
                        cluster.total.gpu as i64
                    } else {
                        (cluster.total.gpu as f64 * max_load).trunc() as i64
                    };
                    let gpu = i64::from(gpus - cluster.requested.gpu as i64 >= t.gpu as i64);
                    cpu.min(gpu)
                } else {
                    cpu
                }
            }
        }
    };
    // The deferred update of every return.
    let moved = |v: u64, n: u64| v as i64 + n as i64 * additional;
    cluster.requested = Resources {
        cpu_milli: moved(cluster.requested.cpu_milli, t.cpu_milli).max(0) as u64,
        mem_mib: moved(cluster.requested.mem_mib, t.mem_mib).max(0) as u64,
        gpu: moved(cluster.requested.gpu, t.gpu).max(0) as u64,
    };
    if let Some(n) = node {
        let sign = if config.defects.node_sign { 1 } else { -1 };
        let (cpu, mem) = &mut cluster.node_idle[n];
        *cpu += sign * t.cpu_milli as i64 * additional;
        *mem += sign * t.mem_mib as i64 * additional;
        let idle = (*cpu, *mem);
        cluster.all.set(n, idle);
        cluster.cpu_only.set(n, idle);
    }
    additional
}

#[cfg(test)]
mod tests;
