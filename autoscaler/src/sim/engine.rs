//! The simulator's engine: the event queue, the scheduler, the jobs' progress, and
//! what a policy's answer does to pods (see the model in `sim/mod.rs`).

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};

use rand::{SeedableRng, rngs::StdRng};

use crate::sim::{Policy, Sample, ScaleDown, Scenario, SimConfig, SimResult};

mod measure;
use crate::{Node, Observation, Resources};

#[derive(Debug, Clone, Copy, PartialEq)]
enum PodState {
    Pending,
    Starting,
    Running,
    Draining,
    Gone,
}

#[derive(Debug, Clone)]
struct Pod {
    job: usize,
    trainer: bool,
    req: Resources,
    node: Option<usize>,
    state: PodState,
    next_try: f64,
    backoff: f64,
}

#[derive(Debug, Clone, Copy)]
enum Ev {
    Arrive(usize),
    Tick,
    Ready(usize),
    Drained(usize),
    Done(usize, u64),
    Sample,
    Retry,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Time(f64);
impl Eq for Time {}
impl PartialOrd for Time {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Time {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

#[derive(Debug, Clone)]
struct JobRun {
    arrived: bool,
    parallelism: u32,
    pods: Vec<usize>,
    done: f64,
    rate: f64,
    updated: f64,
    stalled_until: f64,
    version: u64,
    trainers_running: u32,
    started: Option<f64>,
    finished: Option<f64>,
    changed_at: Option<f64>,
    scale_events: u32,
    speed: Vec<Observation>,
}

pub(crate) struct Engine<'a> {
    s: &'a Scenario,
    cfg: &'a SimConfig,
    policy: &'a mut dyn Policy,
    nodes: Vec<Node>,
    pods: Vec<Pod>,
    pending: BTreeSet<usize>,
    /// The pending pods by when they may be tried again (`next_try`): the scheduler
    /// looks only at those due.
    due: BTreeSet<(Time, usize)>,
    jobs: Vec<JobRun>,
    events: BinaryHeap<Reverse<(Time, u64, usize)>>,
    payloads: Vec<Ev>,
    now: f64,
    origin: f64,
    bound: Resources,
    cpu_area: f64,
    gpu_area: f64,
    area_at: f64,
    contended: bool,
    busy_cpu_area: f64,
    busy_gpu_area: f64,
    busy_secs: f64,
    rng: StdRng,
    samples: Vec<Sample>,
    scale_events: u32,
    left: usize,
    retry_at: f64,
    /// Jobs arrived and not finished.
    active: BTreeSet<usize>,
    /// Per job, the fewest trainers at which it is fastest (`Speed::fastest_within`).
    fastest: Vec<u32>,
}

impl<'a> Engine<'a> {
    pub(crate) fn new(s: &'a Scenario, policy: &'a mut dyn Policy) -> Self {
        let nodes = s
            .nodes
            .iter()
            .enumerate()
            .map(|(i, r)| Node {
                name: format!("node-{i}"),
                allocatable: *r,
                requested: Resources::ZERO,
            })
            .collect();
        let origin = s
            .jobs
            .iter()
            .map(|j| j.submit)
            .fold(f64::INFINITY, f64::min);
        let origin = if origin.is_finite() { origin } else { 0.0 };
        let jobs = s
            .jobs
            .iter()
            .map(|_| JobRun {
                arrived: false,
                parallelism: 0,
                pods: Vec::new(),
                done: 0.0,
                rate: 0.0,
                updated: 0.0,
                stalled_until: 0.0,
                version: 0,
                trainers_running: 0,
                started: None,
                finished: None,
                changed_at: None,
                scale_events: 0,
                speed: Vec::new(),
            })
            .collect();
        let mut e = Engine {
            s,
            cfg: &s.config,
            policy,
            nodes,
            pods: Vec::new(),
            pending: BTreeSet::new(),
            due: BTreeSet::new(),
            jobs,
            events: BinaryHeap::new(),
            payloads: Vec::new(),
            now: origin,
            origin,
            bound: Resources::ZERO,
            cpu_area: 0.0,
            gpu_area: 0.0,
            area_at: origin,
            contended: false,
            busy_cpu_area: 0.0,
            busy_gpu_area: 0.0,
            busy_secs: 0.0,
            rng: StdRng::seed_from_u64(s.config.seed),
            samples: Vec::new(),
            scale_events: 0,
            left: s.jobs.len(),
            retry_at: f64::INFINITY,
            active: BTreeSet::new(),
            fastest: s
                .jobs
                .iter()
                .map(|j| j.speed.fastest_within(j.max))
                .collect(),
        };
        for (i, j) in s.jobs.iter().enumerate() {
            e.push(j.submit, Ev::Arrive(i));
        }
        e.push(origin, Ev::Sample);
        if e.policy.resizes() {
            e.push(origin + s.config.tick, Ev::Tick);
        }
        e
    }

    fn push(&mut self, at: f64, ev: Ev) {
        let seq = self.payloads.len();
        self.payloads.push(ev);
        self.events.push(Reverse((Time(at), seq as u64, seq)));
    }

    pub(crate) fn run(mut self) -> SimResult {
        let mut dirty: BTreeSet<usize> = BTreeSet::new();
        let on_events = self.policy.decides_on_events();
        while self.left > 0 {
            let Some(Reverse((Time(t), _, _))) = self.events.peek().copied() else {
                break;
            };
            if t > self.cfg.horizon {
                break;
            }
            self.account(t);
            self.now = t;
            let mut decide = false;
            while let Some(Reverse((Time(t2), _, id))) = self.events.peek().copied() {
                if t2 != t {
                    break;
                }
                self.events.pop();
                match self.payloads[id] {
                    Ev::Arrive(j) => {
                        self.arrive(j);
                        dirty.insert(j);
                        decide |= on_events;
                    }
                    Ev::Tick => {
                        decide = true;
                        self.observe();
                        self.push(t + self.cfg.tick, Ev::Tick);
                    }
                    Ev::Ready(p) => {
                        if self.pods[p].state == PodState::Starting {
                            self.pods[p].state = PodState::Running;
                            dirty.insert(self.pods[p].job);
                        }
                    }
                    Ev::Drained(p) => {
                        if self.pods[p].state == PodState::Draining {
                            self.release(p);
                            dirty.insert(self.pods[p].job);
                        }
                    }
                    Ev::Done(j, version) => {
                        if self.jobs[j].version == version && self.jobs[j].finished.is_none() {
                            self.finish(j);
                            decide |= on_events;
                        }
                    }
                    Ev::Retry => {
                        if self.retry_at <= t {
                            self.retry_at = f64::INFINITY;
                        }
                    }
                    Ev::Sample => {
                        self.sample();
                        self.push(t + self.cfg.sample_every, Ev::Sample);
                    }
                }
            }
            self.schedule();
            if decide && self.policy.resizes() {
                let snapshot = self.snapshot();
                let targets = self.policy.decide(&snapshot);
                self.restore(snapshot);
                let index: Vec<usize> = self.active.iter().copied().collect();
                for target in targets {
                    let j = index.get(target.job).copied().unwrap_or(usize::MAX);
                    self.apply(j, target.to);
                    dirty.insert(j);
                }
                self.schedule();
            }
            // A job's running trainers change only with its pods' states, and every
            // such change marks it dirty.
            for j in std::mem::take(&mut dirty) {
                if self.active.contains(&j) {
                    self.rerate(j);
                }
            }
            self.contended = self.is_contended();
        }
        self.account(self.now);
        self.sample();
        self.result()
    }

    /// Whether some job waits for pods or could use more trainers: fewer than its fixed
    /// count without an autoscaler; with one, fewer than the fewest at which it is
    /// fastest within its maximum (its true speeds: a trainer that would make it no
    /// faster is not wanted).
    fn is_contended(&self) -> bool {
        let resizes = self.policy.resizes();
        self.active.iter().any(|&j| {
            let run = &self.jobs[j];
            let wants = if resizes {
                self.fastest[j]
            } else {
                self.s.jobs[j].fixed
            };
            let mut bound_trainers = 0;
            for &p in &run.pods {
                let pod = &self.pods[p];
                if pod.state == PodState::Pending && !pod.trainer {
                    return true;
                }
                if pod.trainer && !matches!(pod.state, PodState::Pending | PodState::Gone) {
                    bound_trainers += 1;
                }
            }
            bound_trainers < wants
        })
    }

    fn account(&mut self, t: f64) {
        let dt = t - self.area_at;
        if dt > 0.0 {
            self.cpu_area += self.bound.cpu_milli as f64 * dt;
            self.gpu_area += self.bound.gpu as f64 * dt;
            if self.contended {
                self.busy_cpu_area += self.bound.cpu_milli as f64 * dt;
                self.busy_gpu_area += self.bound.gpu as f64 * dt;
                self.busy_secs += dt;
            }
            self.area_at = t;
        }
    }

    fn new_pod(&mut self, job: usize, trainer: bool) {
        let spec = &self.s.jobs[job];
        let req = if trainer { spec.trainer } else { spec.pserver };
        let id = self.pods.len();
        self.pods.push(Pod {
            job,
            trainer,
            req,
            node: None,
            state: PodState::Pending,
            next_try: self.now,
            backoff: self.cfg.backoff_initial,
        });
        self.pending.insert(id);
        self.due.insert((Time(self.now), id));
        self.jobs[job].pods.push(id);
    }

    fn arrive(&mut self, j: usize) {
        let spec = &self.s.jobs[j];
        let n = self
            .policy
            .initial(spec)
            .min(spec.max.max(spec.fixed).max(1));
        let pservers = spec.pservers;
        let job = &mut self.jobs[j];
        job.arrived = true;
        self.active.insert(j);
        job.parallelism = n;
        job.updated = self.now;
        for _ in 0..pservers {
            self.new_pod(j, false);
        }
        for _ in 0..n {
            self.new_pod(j, true);
        }
    }

    /// Binds pending pods in creation order (Kubernetes' default scheduler, one pod at a
    /// time, no gang scheduling). A pod that finds no node is tried again after a backoff
    /// that doubles up to `backoff_max`; a request at least as large as one that found no
    /// node in this pass fails without a search.
    fn schedule(&mut self) {
        let mut failed: Vec<Resources> = Vec::new();
        // The pods due, in creation order; those not due keep waiting.
        let mut ids: Vec<usize> = Vec::new();
        while let Some(&(Time(at), p)) = self.due.first() {
            if at > self.now {
                break;
            }
            self.due.pop_first();
            ids.push(p);
        }
        ids.sort_unstable();
        for p in ids {
            let req = self.pods[p].req;
            if failed.iter().any(|f| req.fits(f)) {
                self.back_off(p);
                continue;
            }
            let mut best: Option<(f64, usize)> = None;
            for (i, n) in self.nodes.iter().enumerate() {
                if n.allocatable.gpu > 0 && req.gpu == 0 {
                    continue;
                }
                let idle = n.idle();
                if !idle.fits(&req) {
                    continue;
                }
                let free = |left: u64, total: u64| {
                    if total == 0 {
                        0.0
                    } else {
                        left as f64 / total as f64
                    }
                };
                let score = free(idle.cpu_milli - req.cpu_milli, n.allocatable.cpu_milli)
                    + free(idle.mem_mib - req.mem_mib, n.allocatable.mem_mib);
                if best.is_none_or(|(b, _)| score > b) {
                    best = Some((score, i));
                }
            }
            match best {
                None => {
                    failed.push(req);
                    self.back_off(p);
                }
                Some((_, node)) => {
                    self.pending.remove(&p);
                    self.nodes[node].requested += req;
                    self.bound += req;
                    let pod = &mut self.pods[p];
                    pod.node = Some(node);
                    pod.state = PodState::Starting;
                    self.push(self.now + self.cfg.startup, Ev::Ready(p));
                }
            }
        }
        let next_retry = self.due.first().map_or(f64::INFINITY, |&(Time(at), _)| at);
        if next_retry < self.retry_at {
            self.retry_at = next_retry;
            self.push(next_retry, Ev::Retry);
        }
    }

    fn back_off(&mut self, p: usize) {
        let max = self.cfg.backoff_max;
        let pod = &mut self.pods[p];
        pod.next_try = self.now + pod.backoff;
        pod.backoff = (pod.backoff * 2.0).min(max);
        self.due.insert((Time(pod.next_try), p));
    }

    fn release(&mut self, p: usize) {
        let pod = &mut self.pods[p];
        if let Some(node) = pod.node.take() {
            let req = pod.req;
            let n = &mut self.nodes[node];
            n.requested = n.requested.saturating_sub(&req);
            self.bound = self.bound.saturating_sub(&req);
        }
        if pod.state == PodState::Pending {
            self.pending.remove(&p);
            self.due.remove(&(Time(pod.next_try), p));
        }
        pod.state = PodState::Gone;
        let job = &mut self.jobs[pod.job].pods;
        if let Some(k) = job.iter().position(|&q| q == p) {
            job.remove(k);
        }
    }

    fn trainers_running(&self, j: usize) -> u32 {
        self.jobs[j]
            .pods
            .iter()
            .filter(|&&p| {
                let pod = &self.pods[p];
                pod.trainer && matches!(pod.state, PodState::Running | PodState::Draining)
            })
            .count() as u32
    }

    fn pservers_running(&self, j: usize) -> bool {
        self.jobs[j].pods.iter().all(|&p| {
            let pod = &self.pods[p];
            pod.trainer || pod.state == PodState::Running
        })
    }

    /// Brings a job's progress up to now at its old rate.
    fn advance(&mut self, j: usize) {
        let now = self.now;
        let job = &mut self.jobs[j];
        let from = job.updated.max(job.stalled_until);
        if now > from {
            job.done += job.rate * (now - from);
        }
        job.updated = now;
    }

    /// A job's rate after its pods changed, and when it will finish at that rate.
    fn rerate(&mut self, j: usize) {
        self.advance(j);
        let running = self.trainers_running(j);
        let rate = if running > 0 && self.pservers_running(j) {
            self.s.jobs[j].speed.rate(running)
        } else {
            0.0
        };
        let now = self.now;
        let cost = self.cfg.event_cost;
        let job = &mut self.jobs[j];
        if running != job.trainers_running {
            // A change of a training job's trainers stalls it; one resumed from none
            // has paid its pods' startup instead.
            if job.started.is_some() && rate > 0.0 && job.trainers_running > 0 {
                job.stalled_until = job.stalled_until.max(now + cost);
            }
            job.trainers_running = running;
        }
        if rate > 0.0 && job.started.is_none() {
            job.started = Some(now);
        }
        job.rate = rate;
        job.version += 1;
        if rate > 0.0 {
            let left = (self.s.jobs[j].work - job.done).max(0.0);
            let at = now.max(job.stalled_until) + left / rate;
            let version = job.version;
            self.push(at, Ev::Done(j, version));
        }
    }

    fn finish(&mut self, j: usize) {
        self.advance(j);
        self.jobs[j].finished = Some(self.now);
        self.active.remove(&j);
        self.jobs[j].rate = 0.0;
        for p in self.jobs[j].pods.clone() {
            self.release(p);
        }
        self.left -= 1;
    }

    /// Sets a job's trainer count: new trainer pods wait for a node; surplus ones go
    /// unbound first, then starting, then running (newest first), drained or killed.
    fn apply(&mut self, j: usize, to: u32) {
        if j >= self.jobs.len() || self.jobs[j].finished.is_some() || !self.jobs[j].arrived {
            return;
        }
        let job = &mut self.jobs[j];
        if job.parallelism == to {
            return;
        }
        job.parallelism = to;
        job.changed_at = Some(self.now);
        job.scale_events += 1;
        self.scale_events += 1;
        let alive: Vec<usize> = self.jobs[j]
            .pods
            .iter()
            .copied()
            .filter(|&p| {
                let pod = &self.pods[p];
                pod.trainer && !matches!(pod.state, PodState::Draining | PodState::Gone)
            })
            .collect();
        let have = alive.len() as u32;
        if to > have {
            for _ in have..to {
                self.new_pod(j, true);
            }
            return;
        }
        let mut surplus = (have - to) as usize;
        for wanted in [PodState::Pending, PodState::Starting, PodState::Running] {
            for &p in alive.iter().rev() {
                if surplus == 0 {
                    return;
                }
                if self.pods[p].state != wanted {
                    continue;
                }
                surplus -= 1;
                if wanted != PodState::Running {
                    self.release(p);
                    continue;
                }
                match self.policy.scale_down() {
                    ScaleDown::Drain => {
                        self.pods[p].state = PodState::Draining;
                        self.push(self.now + self.cfg.drain, Ev::Drained(p));
                    }
                    ScaleDown::Kill => {
                        self.release(p);
                        self.advance(j);
                        let lost = self.s.jobs[j].speed.rate(1) * self.cfg.killed_work;
                        self.jobs[j].done = (self.jobs[j].done - lost).max(0.0);
                    }
                }
            }
        }
    }
}
