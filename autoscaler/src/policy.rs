//! edl's autoscaling policy: a pure, deterministic function from a cluster snapshot to
//! new trainer counts, applied by draining (never killing) the trainers it removes.
//!
//! One pass, in order:
//! 1. **Bounds.** Every elastic job's count is clamped to `[min, max]` first.
//! 2. **Give up scale-ups that found no node.** Trainers of an earlier scale-up that are
//!    still unbound are taken back (a job left alone for `min_interval` is asked again
//!    later), so they neither hold a place in the scheduler's queue nor look like demand.
//! 3. **Too many trainers** (with `preempt`). A job running at a count observed slower
//!    than a smaller count worth running at, by more than the noise of an observation
//!    ([`NOISE`]), is lowered to it. A dip within the noise is not acted on: lowered, the
//!    job would grow back at the next pass.
//! 4. **Admission.** A *starved* job (fewer than `min` trainers bound, or pservers not
//!    bound) gets room for its minimum. Without `preempt`: in priority order (then
//!    oldest first), the trainers worth least are taken from jobs of the same or a lower
//!    priority, several per job if needed, until the minimum fits in the cluster's
//!    `max_load` share; if it cannot fit even then, nothing is taken for it and nobody
//!    grows in this pass. With `preempt` (`policy/preempt.rs`): by priority, then by the
//!    worth of its minimum, from units worth less (a trainer above a minimum, or a whole
//!    job suspended); a job not admitted is queued at 0 trainers.
//!    While a starved job's pods wait for a node, no trainer of their kind (GPU or not)
//!    is added: the scheduler would bind the newer pods first. Except for a job
//!    submitted at the pass's instant: its pods are then the oldest in the scheduler's
//!    queue and on the same backoff as the pods the pass creates, so they bind first.
//! 5. **Growth.** Free room goes to the job whose next trainers are worth most (priority
//!    first), a step at a time to its next count worth running at, while nodes can host
//!    them; growth that saves its job no more than `change_cost` is not made.
//! 6. **Rebalancing.** A trainer moves from the job where it is worth least to the job
//!    where it would be worth most when the gain beats the loss by `hysteresis` and the
//!    time saved beats the time lost plus the changes (or the receiver's priority is
//!    higher).
//!
//! A trainer's worth is what it adds to its job's speed (on the job's [`RateModel`]: the
//! hull of its observed and fitted speeds by count), divided by the work the job has left
//! raised to `size_exponent` and by the trainer's dominant share of the cluster: trainers
//! go where they shorten jobs most per unit of cluster, which favours jobs that still
//! scale and jobs close to done. A trainer adding less than `min_gain` of one trainer's
//! speed is never added, and a job that will finish within `min_remaining` seconds is not
//! grown.
//!
//! Invariants (property tests in `policy/tests.rs`, with and without `preempt`):
//! - an answered count is within `[min, max]`, or 0 for an elastic job with `preempt`; a
//!   job is answered at most once, only when its count changes; jobs with `min == max`
//!   inside their bounds are never answered;
//! - a job changed less than `min_interval` ago is only lowered, only to admit a job of
//!   the same or a higher priority (or to respect its bounds), and never suspended while
//!   it has trainers bound;
//! - no job is lowered for the benefit of a job of a lower priority;
//! - growth never takes the requests past `max_load` of the cluster;
//! - the answer depends on the jobs, not on their order in the snapshot.

use serde::{Deserialize, Serialize};

use crate::rate::NOISE;
use crate::{JobView, RateModel, Resources, Snapshot, Target};

mod grow;
mod preempt;

/// The policy's settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PolicyConfig {
    /// The share of the cluster's CPU, memory and GPUs the policy fills (0.97 as EDL).
    pub max_load: f64,
    /// Seconds a job is left alone after a change, except to admit another job.
    pub min_interval: f64,
    /// A rebalancing move must gain this much more than it loses (0.25: 25%).
    pub hysteresis: f64,
    /// A trainer is added only if it adds at least this share of one trainer's speed.
    pub min_gain: f64,
    /// A job expected to finish within this many seconds is not grown.
    pub min_remaining: f64,
    /// Contention assumed for a job observed at a single trainer count.
    pub prior_sigma: f64,
    /// Most trainers added to one job in one pass.
    pub max_step: u32,
    /// How much a job's work left weighs in a trainer's worth (worth = added speed /
    /// work left ^ this / share): 0 only looks at speed, 1 also favours jobs near their
    /// end (shortest remaining work first).
    pub size_exponent: f64,
    /// Seconds of progress a job loses when its trainer count changes (trainers
    /// rejoin, leases move; a restart from a checkpoint where jobs restart). A job is
    /// grown only when that saves it more than this, and a trainer moves between jobs
    /// only when the receiver saves more than the donor loses while the receiver runs,
    /// plus both changes. Default 0: only growth that saves nothing is left out.
    #[serde(default = "default_change_cost")]
    pub change_cost: f64,
    /// Whether whole jobs may be suspended (0 trainers) and queued: admission then goes
    /// by the worth of a job's minimum (shortest estimated time left first; a job never
    /// seen running first), and a job is suspended when a job worth more would wait.
    #[serde(default)]
    pub preempt: bool,
}

fn default_change_cost() -> f64 {
    0.0
}

impl PolicyConfig {
    /// Admission by worth with suspension ([`PolicyConfig::preempt`]), with the
    /// settings measured best on every scenario of `edl sim` (docs/autoscaler.md,
    /// "Latest figures"): a change costs `change_cost` seconds, work left weighs by its
    /// square root (`size_exponent` 0.5, between equal sharing and shortest first), and
    /// a job is left alone for [`HOLD_CHANGES`] changes' cost after a change (at least
    /// the default 15 s), so that changes stall a job at most a ninth of its time, and
    /// a job expected to finish within [`END_CHANGES`] changes' cost is not grown (at
    /// least the default 30 s): its room goes to the jobs waiting.
    pub fn preemptive(change_cost: f64) -> PolicyConfig {
        let defaults = PolicyConfig::default();
        PolicyConfig {
            change_cost,
            preempt: true,
            size_exponent: 0.5,
            min_interval: (HOLD_CHANGES * change_cost).max(defaults.min_interval),
            min_remaining: (END_CHANGES * change_cost).max(defaults.min_remaining),
            ..defaults
        }
    }
}

/// How many changes' cost a job is left alone after a change with
/// [`PolicyConfig::preemptive`]: 8 (a 30 s restart holds a job 4 minutes, a 2 s stall
/// 16 s).
pub const HOLD_CHANGES: f64 = 8.0;

/// With [`PolicyConfig::preemptive`], a job expected to finish within this many
/// changes' cost is not grown: 16 (8 minutes where a change is a 30 s restart; 30 s,
/// the default, where it is a 2 s stall).
pub const END_CHANGES: f64 = 16.0;

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            max_load: 0.97,
            min_interval: 15.0,
            hysteresis: 0.25,
            min_gain: 0.02,
            min_remaining: 30.0,
            prior_sigma: 0.05,
            max_step: 64,
            size_exponent: 1.0,
            change_cost: default_change_cost(),
            preempt: false,
        }
    }
}

struct Plan<'a> {
    cfg: &'a PolicyConfig,
    snap: &'a Snapshot,
    target: Vec<u32>,
    curve: Vec<Option<RateModel>>,
    /// Per job, its work left to the power `size_exponent` and its trainer's share of
    /// the cluster: what a trainer's worth is divided by.
    per: Vec<(f64, f64)>,
    frozen: Vec<bool>,
    /// Requests of the cluster as the plan stands, bound or waiting (fluid).
    used: Resources,
    cap: Resources,
    /// Idle resources per node as the plan stands (growth is placed on them).
    idle: Vec<Resources>,
    grown: Vec<u32>,
    /// Whether pods without GPUs (0) or with (1) of a starved job wait for a node.
    admitting: [bool; 2],
}

/// One pass of edl's policy: the jobs whose trainer count changes.
pub fn decide(config: &PolicyConfig, snapshot: &Snapshot) -> Vec<Target> {
    let jobs = &snapshot.jobs;
    let total = snapshot.total();
    let scale = |v: u64| (v as f64 * config.max_load).floor() as u64;
    let mut plan = Plan {
        cfg: config,
        snap: snapshot,
        target: jobs
            .iter()
            .map(|j| j.trainers.clamp(j.min, j.max.max(j.min)))
            .collect(),
        curve: jobs
            .iter()
            .map(|j| RateModel::new(&j.speed, config.prior_sigma, j.max.max(j.min)))
            .collect(),
        per: jobs
            .iter()
            .map(|j| {
                let left = j.remaining.unwrap_or(1.0).max(1.0);
                (left.powf(config.size_exponent), share(&j.trainer, &total))
            })
            .collect(),
        frozen: jobs
            .iter()
            .map(|j| {
                j.changed_at
                    .is_some_and(|t| snapshot.now - t < config.min_interval)
            })
            .collect(),
        used: snapshot.nodes.iter().map(|n| n.requested).sum(),
        cap: Resources {
            cpu_milli: scale(total.cpu_milli),
            mem_mib: scale(total.mem_mib),
            gpu: scale(total.gpu),
        },
        idle: snapshot.nodes.iter().map(|n| n.idle()).collect(),
        grown: vec![0; jobs.len()],
        admitting: [false; 2],
    };
    // Jobs in a canonical order (priority, then age, then name): the answer must not
    // depend on the snapshot's order.
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by(|&a, &b| canonical(&jobs[a], &jobs[b]));

    let starved = plan.give_up_unbound(&order);
    // While a job's pods wait for the scheduler to make its minimum, trainers of the
    // same kind (GPU or not) do not grow: the scheduler would bind the newer pods first
    // and take the room being made for it. Not for a job submitted at this instant: its
    // pods are older than those this pass creates and on the same backoff (each failed
    // once, now), so the scheduler tries them first each time both are due.
    for (i, j) in jobs.iter().enumerate() {
        if starved[i].is_some() && j.submitted < snapshot.now {
            let pods = j
                .waiting
                .iter()
                .chain((j.pods.unbound > 0).then_some(&j.trainer));
            for pod in pods {
                plan.admitting[usize::from(pod.gpu > 0)] = true;
            }
        }
    }
    if config.preempt {
        plan.trim(&order);
        let queued = plan.admit_by_worth(&order, &starved);
        plan.grow_where_it_pays(&order);
        plan.admit_into_free_room(&queued);
        plan.rebalance(&order);
    } else if plan.admit(&order, &starved) {
        plan.grow_where_it_pays(&order);
        plan.rebalance(&order);
    }
    order.sort_unstable();
    order
        .into_iter()
        .filter(|&i| plan.target[i] != jobs[i].trainers)
        .map(|i| Target {
            job: i,
            from: jobs[i].trainers,
            to: plan.target[i],
        })
        .collect()
}

/// A trainer's dominant share of a cluster of `total`.
fn share(r: &Resources, total: &Resources) -> f64 {
    let part = |v: u64, t: u64| if t == 0 { 0.0 } else { v as f64 / t as f64 };
    part(r.cpu_milli, total.cpu_milli)
        .max(part(r.mem_mib, total.mem_mib))
        .max(part(r.gpu, total.gpu))
        .max(1e-12)
}

fn canonical(a: &JobView, b: &JobView) -> std::cmp::Ordering {
    b.priority
        .cmp(&a.priority)
        .then(a.submitted.total_cmp(&b.submitted))
        .then(a.name.cmp(&b.name))
}

impl Plan<'_> {
    fn job(&self, i: usize) -> &JobView {
        &self.snap.jobs[i]
    }

    /// Step 2, and the pods each starved job still needs bound (`Some(pods)`).
    fn give_up_unbound(&mut self, order: &[usize]) -> Vec<Option<Vec<Resources>>> {
        let mut starved = vec![None; self.snap.jobs.len()];
        for &i in order {
            let j = self.job(i).clone();
            // The unbound pods that are not trainers (pservers): a job needs all of them.
            let mut others = j.waiting.clone();
            for _ in 0..j.pods.unbound {
                if let Some(k) = others.iter().position(|r| *r == j.trainer) {
                    others.swap_remove(k);
                }
            }
            let bound = j.pods.total - j.pods.unbound;
            if bound < j.min || !others.is_empty() {
                let short = j.min.saturating_sub(bound);
                // Unbound trainers beyond the minimum: given up like any scale-up that
                // found no node (kept, and counted, while the job is left alone).
                let extra = j.pods.unbound.saturating_sub(short);
                let back = if self.frozen[i] || !j.is_elastic() {
                    0
                } else {
                    extra.min(self.target[i].saturating_sub(j.min))
                };
                self.target[i] -= back;
                self.used += j.trainer * u64::from(extra - back);
                others.extend(std::iter::repeat_n(j.trainer, short as usize));
                starved[i] = Some(others);
                continue;
            }
            if j.pods.unbound == 0 {
                continue;
            }
            if self.frozen[i] || !j.is_elastic() {
                // A recent scale-up whose room is being made: it stays, and counts.
                self.used += j.trainer * u64::from(j.pods.unbound);
                continue;
            }
            let back = j.pods.unbound.min(self.target[i].saturating_sub(j.min));
            self.target[i] -= back;
            self.used += j.trainer * u64::from(j.pods.unbound - back);
        }
        starved
    }

    fn free(&self) -> Resources {
        self.cap.saturating_sub(&self.used)
    }

    /// Step 3. False when a starved job cannot be admitted even with every donor at its
    /// minimum.
    ///
    /// Each pod the job needs is placed on a node with room (the fullest that fits, so
    /// large holes stay). A pod that fits nowhere takes a donor's trainer at least as
    /// large as itself: that trainer's node will have room once it drained. The cluster's
    /// `max_load` share is respected the same way, by more donors.
    fn admit(&mut self, order: &[usize], starved: &[Option<Vec<Resources>>]) -> bool {
        let mut all_admitted = true;
        for &s in order {
            let Some(pods) = &starved[s] else { continue };
            let placed = self.place_minimum(pods, |plan, pod| {
                let d = plan.donor(order, starved, s, pod)?;
                plan.target[d] -= 1;
                plan.used = plan.used.saturating_sub(&plan.job(d).trainer);
                Some((plan.job(d).trainer, 1))
            });
            if !placed {
                // Its room is held: nobody grows into it.
                self.used += pods.iter().copied().sum();
                all_admitted = false;
            }
        }
        all_admitted
    }

    /// Places a starved job's `pods` (largest first): each on the fullest node it fits,
    /// else in the fullest hole a donor's drained trainers leave, else by `take` taking
    /// a donor's unit (a trainer, or a whole job's `count` trainers) at least as large as
    /// the pod, whose trainers each leave a hole; then more donors until the cluster
    /// stays within its `max_load` share. True when placed, the pods then counted; when
    /// not, nothing changes.
    fn place_minimum(
        &mut self,
        pods: &[Resources],
        mut take: impl FnMut(&mut Self, Option<&Resources>) -> Option<(Resources, u32)>,
    ) -> bool {
        let saved = (self.target.clone(), self.used, self.idle.clone());
        let mut pods = pods.to_vec();
        pods.sort_by_key(|r| std::cmp::Reverse((r.gpu, r.cpu_milli, r.mem_mib)));
        let need: Resources = pods.iter().copied().sum();
        let mut holes: Vec<Resources> = Vec::new();
        let mut ok = true;
        for pod in &pods {
            if let Some(n) = self.tightest(pod) {
                self.idle[n] = self.idle[n].saturating_sub(pod);
                continue;
            }
            if holes.iter().all(|h| !h.fits(pod)) {
                match take(self, Some(pod)) {
                    Some((trainer, count)) => {
                        holes.extend(std::iter::repeat_n(trainer, count as usize));
                    }
                    None => {
                        ok = false;
                        break;
                    }
                }
            }
            // The fullest hole that fits (the donor's trainer fits the pod).
            if let Some(h) = holes
                .iter_mut()
                .filter(|h| h.fits(pod))
                .min_by_key(|h| (h.gpu, h.cpu_milli, h.mem_mib))
            {
                *h = h.saturating_sub(pod);
            }
        }
        while ok && !self.free().fits(&need) {
            ok = take(self, None).is_some();
        }
        if ok {
            self.used += need;
        } else {
            (self.target, self.used, self.idle) = saved;
        }
        ok
    }

    /// The node with the least room that still fits `pod` (no GPU node for a pod
    /// without GPUs).
    fn tightest(&self, pod: &Resources) -> Option<usize> {
        self.idle
            .iter()
            .enumerate()
            .filter(|(n, idle)| {
                idle.fits(pod) && (pod.gpu > 0 || self.snap.nodes[*n].allocatable.gpu == 0)
            })
            .min_by(|a, b| a.1.cpu_milli.cmp(&b.1.cpu_milli).then(a.0.cmp(&b.0)))
            .map(|(n, _)| n)
    }

    /// The trainer worth least among the jobs that may give one to starved job `s`
    /// (same or lower priority, above their minimum, not starved), at least as large as
    /// `pod` when given.
    fn donor(
        &self,
        order: &[usize],
        starved: &[Option<Vec<Resources>>],
        s: usize,
        pod: Option<&Resources>,
    ) -> Option<usize> {
        order
            .iter()
            .copied()
            .filter(|&d| {
                let dj = self.job(d);
                d != s
                    && starved[d].is_none()
                    && dj.priority <= self.job(s).priority
                    && self.target[d] > dj.min
                    && pod.is_none_or(|p| dj.trainer.fits(p))
            })
            // Unknown speed counts as worth most (a job just admitted keeps its trainers).
            .map(|d| match &self.curve[d] {
                None => (f64::INFINITY, d),
                Some(_) => (self.worth(d, self.target[d]), d),
            })
            .min_by(|&(wa, a), &(wb, b)| {
                wa.total_cmp(&wb)
                    .then(self.job(a).priority.cmp(&self.job(b).priority))
                    .then(canonical(self.job(b), self.job(a)))
            })
            .map(|(_, d)| d)
    }

    /// The worth of a job's `k`-th trainer (0 for a job whose speed is unknown).
    fn worth(&self, i: usize, k: u32) -> f64 {
        let Some(curve) = &self.curve[i] else {
            return 0.0;
        };
        if k == 0 {
            return f64::INFINITY;
        }
        let gain = curve.marginal(k - 1);
        let (left_pow, share) = self.per[i];
        gain / left_pow / share
    }

    /// Seconds job `i` needs to finish with `n` trainers (`None`: its work left or its
    /// speed is unknown).
    fn time_left(&self, i: usize, n: u32) -> Option<f64> {
        let curve = self.curve[i].as_ref()?;
        let left = self.job(i).remaining?;
        let rate = curve.rate(n);
        Some(if rate > 0.0 {
            left / rate
        } else {
            f64::INFINITY
        })
    }

    /// Whether moving a trainer from job `d` to job `r` saves time, in seconds: the
    /// receiver's time saved must beat what the donor loses while the receiver runs
    /// with it (the donor gets it back when the receiver ends) plus both changes.
    /// Unknown work or speed: it does.
    fn move_pays(&self, r: usize, d: usize) -> bool {
        let (tr, td) = (self.target[r], self.target[d]);
        let (Some(r0), Some(r1), Some(cd)) = (
            self.time_left(r, tr),
            self.time_left(r, tr + 1),
            self.curve[d].as_ref(),
        ) else {
            return true;
        };
        let before = cd.rate(td);
        if before <= 0.0 {
            return true;
        }
        let lost = r1 * (before - cd.rate(td - 1)) / before;
        // A job already changed in this pass pays no second change.
        let changes = [r, d]
            .iter()
            .filter(|&&i| self.target[i] == self.job(i).trainers)
            .count() as f64;
        r0 - r1 > lost + changes * self.cfg.change_cost
    }

    /// Lowers jobs running at a count observed slower than a smaller count worth running
    /// at (they train faster with fewer trainers, and the rest is free room).
    fn trim(&mut self, order: &[usize]) {
        for &i in order {
            let j = self.job(i);
            let n = self.target[i];
            let Some(curve) = &self.curve[i] else {
                continue;
            };
            if !j.is_elastic() || self.frozen[i] || n != j.trainers || n <= j.min {
                continue;
            }
            let lower = curve.vertex_below(n).max(j.min);
            // Slower than `lower` by more than the noise of an observation.
            let slower = curve
                .observed(n)
                .is_some_and(|r| r < (1.0 - NOISE) * curve.rate(lower));
            let long = self
                .time_left(i, lower)
                .is_some_and(|t| t > self.cfg.min_remaining + self.cfg.change_cost);
            if slower && long {
                let freed = j.trainer * u64::from(n - lower);
                self.target[i] = lower;
                self.used = self.used.saturating_sub(&freed);
                self.grown[i] = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests;
