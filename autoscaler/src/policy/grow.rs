//! Steps 4 and 5 of the policy: growth where it pays (the best receiver a step at a
//! time, from a heap), and rebalancing (a trainer moves when the receiver's worth beats
//! the donor's by `hysteresis` and the move saves time).

use super::{Plan, canonical};

/// A job that may grow, by [`Plan::best_receiver`]'s order: priority, then the worth of
/// its next trainer, then canonical order (`rank` in it, first best).
#[derive(Debug, PartialEq)]
struct Receiver {
    priority: i32,
    worth: f64,
    rank: std::cmp::Reverse<usize>,
    job: usize,
}

impl Eq for Receiver {}

impl PartialOrd for Receiver {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Receiver {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.priority
            .cmp(&other.priority)
            .then(self.worth.total_cmp(&other.worth))
            .then(self.rank.cmp(&other.rank))
    }
}

/// Growth and rebalancing.
impl Plan<'_> {
    /// Whether job `i` may take one more trainer, capacity aside.
    fn may_grow(&self, i: usize) -> bool {
        let j = self.job(i);
        let n = self.target[i];
        if !j.is_elastic()
            || self.admitting[usize::from(j.trainer.gpu > 0)]
            || n < j.min
            || n >= j.max
            || self.frozen[i]
            || self.grown[i] >= self.cfg.max_step
        {
            return false;
        }
        if j.pods.unbound > 0 || j.pods.pending > 0 || n < j.trainers {
            return false;
        }
        let Some(curve) = &self.curve[i] else {
            return false;
        };
        if curve.marginal(n) < self.cfg.min_gain * curve.unit {
            return false;
        }
        let rate = curve.rate(n.max(1));
        j.remaining
            .is_none_or(|left| left / rate > self.cfg.min_remaining)
    }

    /// The node a trainer of job `i` would be bound to (most room left, no GPU node for
    /// a trainer without GPUs).
    fn place(&self, i: usize) -> Option<usize> {
        let t = self.job(i).trainer;
        self.idle
            .iter()
            .enumerate()
            .filter(|(n, idle)| {
                idle.fits(&t) && (t.gpu > 0 || self.snap.nodes[*n].allocatable.gpu == 0)
            })
            .max_by(|a, b| a.1.cpu_milli.cmp(&b.1.cpu_milli).then(b.0.cmp(&a.0)))
            .map(|(n, _)| n)
    }

    pub(super) fn best_receiver(&self, order: &[usize]) -> Option<usize> {
        order
            .iter()
            .copied()
            .filter(|&i| self.may_grow(i))
            .max_by(|&a, &b| {
                self.job(a)
                    .priority
                    .cmp(&self.job(b).priority)
                    .then(
                        self.worth(a, self.target[a] + 1)
                            .total_cmp(&self.worth(b, self.target[b] + 1)),
                    )
                    .then(canonical(self.job(b), self.job(a)))
            })
    }

    /// Step 4, keeping only the growth that saves its job more than a change costs: a
    /// job whose growth does not is put back, and the room goes to the others.
    pub(super) fn grow_where_it_pays(&mut self, order: &[usize]) {
        let mut order = order.to_vec();
        let before = (
            self.target.clone(),
            self.used,
            self.idle.clone(),
            self.grown.clone(),
        );
        loop {
            self.grow(&order);
            let unpaid: Vec<usize> = order
                .iter()
                .copied()
                .filter(|&i| self.grown[i] > 0)
                .filter(|&i| {
                    let to = self.target[i];
                    let from = to - self.grown[i];
                    match (self.time_left(i, from), self.time_left(i, to)) {
                        (Some(a), Some(b)) => a - b <= self.cfg.change_cost,
                        _ => false,
                    }
                })
                .collect();
            if unpaid.is_empty() {
                return;
            }
            // Grow again without them, from where growth started.
            (self.target, self.used, self.idle, self.grown) = before.clone();
            order.retain(|i| !unpaid.contains(i));
        }
    }

    /// Step 4: the best receiver ([`Plan::best_receiver`]'s order) grows a step at a
    /// time, from a heap: a job's worth and whether it may grow depend on its own count
    /// only, so only the job grown is put back.
    fn grow(&mut self, order: &[usize]) {
        let key = |plan: &Self, rank: usize, i: usize| Receiver {
            priority: plan.job(i).priority,
            worth: plan.worth(i, plan.target[i] + 1),
            rank: std::cmp::Reverse(rank),
            job: i,
        };
        let mut heap: std::collections::BinaryHeap<Receiver> = order
            .iter()
            .enumerate()
            .filter(|&(_, &i)| self.may_grow(i))
            .map(|(rank, &i)| key(self, rank, i))
            .collect();
        while let Some(Receiver { rank, job: i, .. }) = heap.pop() {
            let step = self.step_up(i);
            let t = self.job(i).trainer;
            let saved = (self.idle.clone(), self.used);
            let mut placed = 0;
            while placed < step {
                match self.place(i) {
                    Some(n) if self.free().fits(&t) => {
                        self.idle[n] = self.idle[n].saturating_sub(&t);
                        self.used += t;
                        placed += 1;
                    }
                    _ => break,
                }
            }
            if placed == step {
                self.target[i] += step;
                self.grown[i] += step;
                if self.may_grow(i) {
                    heap.push(key(self, rank.0, i));
                }
            } else {
                (self.idle, self.used) = saved;
            }
        }
    }

    /// The trainers job `i` grows by in one step: to the next count worth running at
    /// ([`RateModel::vertex_above`]), within its maximum and `max_step`.
    fn step_up(&self, i: usize) -> u32 {
        let n = self.target[i];
        let j = self.job(i);
        let room = j.max.min(n + self.cfg.max_step - self.grown[i]);
        let to = self.curve[i]
            .as_ref()
            .and_then(|c| c.vertex_above(n))
            .unwrap_or(n + 1);
        to.clamp(n + 1, room.max(n + 1)) - n
    }

    /// Step 5. A job's worths and whether it may grow change only with its own count:
    /// they are kept, and updated for the two jobs a move changes.
    pub(super) fn rebalance(&mut self, order: &[usize]) {
        let mut budget: u32 = self.target.iter().sum();
        let jobs = self.snap.jobs.len();
        let mut shrunk = vec![false; jobs];
        let mut grows: Vec<bool> = (0..jobs).map(|i| self.may_grow(i)).collect();
        let mut next: Vec<f64> = (0..jobs)
            .map(|i| self.worth(i, self.target[i] + 1))
            .collect();
        let mut last: Vec<f64> = (0..jobs).map(|i| self.worth(i, self.target[i])).collect();
        while budget > 0 {
            budget -= 1;
            // As `best_receiver`, from the kept worths.
            let receiver = order
                .iter()
                .copied()
                .filter(|&i| !shrunk[i] && grows[i])
                .max_by(|&a, &b| {
                    self.job(a)
                        .priority
                        .cmp(&self.job(b).priority)
                        .then(next[a].total_cmp(&next[b]))
                        .then(canonical(self.job(b), self.job(a)))
                });
            let Some(r) = receiver else {
                return;
            };
            let gain = next[r];
            let rt = self.job(r).trainer;
            let donor = order
                .iter()
                .copied()
                .filter(|&d| {
                    let dj = self.job(d);
                    d != r
                        && dj.is_elastic()
                        && self.target[d] > dj.min
                        && !self.frozen[d]
                        && self.grown[d] == 0
                        && self.curve[d].is_some()
                        && dj.priority <= self.job(r).priority
                        && dj.trainer.fits(&rt)
                })
                .min_by(|&a, &b| {
                    last[a]
                        .total_cmp(&last[b])
                        .then(canonical(self.job(b), self.job(a)))
                });
            let Some(d) = donor else { return };
            let loss = last[d];
            let higher = self.job(r).priority > self.job(d).priority;
            let pays = self.move_pays(r, d);
            if !(higher || (pays && gain > loss * (1.0 + self.cfg.hysteresis))) {
                return;
            }
            self.target[d] -= 1;
            self.target[r] += 1;
            self.grown[r] += 1;
            shrunk[r] = false;
            shrunk[d] = true;
            for i in [r, d] {
                grows[i] = self.may_grow(i);
                next[i] = self.worth(i, self.target[i] + 1);
                last[i] = self.worth(i, self.target[i]);
            }
        }
    }
}
