//! [`Working`] against a model of the pservers: random interleavings of batches, hand-overs,
//! applications, other trainers' pushes, pulls (exact, and racing a push), landings and
//! advances (claims that the pservers hold a mark, true or not).
//! Values are small integers, so every sum is exact in f32.

use std::collections::VecDeque;

use super::*;
use crate::rng::SplitMix64;

const LEN: usize = 5;

struct World {
    rng: SplitMix64,
    /// The pservers' values.
    z: Vec<f32>,
    applied: u64,
    /// Pushes handed over, not applied: (number, sum).
    queue: VecDeque<(u64, Vec<f32>)>,
    /// Every push's sum, by number (index number - 1).
    sums: Vec<Vec<f32>>,
    /// Pulls in flight: (values, absorbed, exact).
    pulls: VecDeque<(Vec<f32>, u64, bool)>,
    /// Local updates not handed over.
    acc: Vec<f32>,
    working: Working,
    /// Exact landings used, racing landings, advances made.
    exact_landings: u64,
    racing_landings: u64,
    advances: u64,
}

impl World {
    fn new(seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let z: Vec<f32> = (0..LEN).map(|_| small(&mut rng)).collect();
        World {
            working: Working::new(vec![z.clone()]),
            rng,
            z,
            applied: 0,
            queue: VecDeque::new(),
            sums: Vec::new(),
            pulls: VecDeque::new(),
            acc: vec![0.0; LEN],
            exact_landings: 0,
            racing_landings: 0,
            advances: 0,
        }
    }

    fn delta(&mut self) -> Vec<f32> {
        (0..LEN).map(|_| small(&mut self.rng)).collect()
    }

    fn batch(&mut self) {
        let d = self.delta();
        add(&mut self.working.params().dense[0], &d);
        add(&mut self.acc, &d);
    }

    fn hand_over(&mut self) {
        let n = self.sums.len() as u64 + 1;
        let sum = std::mem::replace(&mut self.acc, vec![0.0; LEN]);
        self.sums.push(sum.clone());
        self.queue.push_back((n, sum));
        self.working.mark(n);
    }

    fn apply(&mut self) -> bool {
        let Some((n, sum)) = self.queue.pop_front() else {
            return false;
        };
        add(&mut self.z, &sum);
        assert_eq!(n, self.applied + 1, "pushes apply in order");
        self.applied = n;
        true
    }

    fn land(&mut self) {
        let Some((values, absorbed, exact)) = self.pulls.pop_front() else {
            return;
        };
        let used = self.working.land(vec![values.clone()], absorbed);
        if !used {
            return;
        }
        if exact {
            self.exact_landings += 1;
            // work = P + the sums of every push after `absorbed` + what is not handed over.
            let mut want = values;
            for s in &self.sums[absorbed as usize..] {
                add(&mut want, s);
            }
            add(&mut want, &self.acc);
            assert_eq!(self.working.params().dense[0], want);
            assert_eq!(self.working.base(), absorbed);
        } else {
            self.racing_landings += 1;
        }
    }

    fn step(&mut self) {
        match self.rng.below(9) {
            0 | 1 => self.batch(),
            2 => self.hand_over(),
            3 => {
                self.apply();
            }
            4 => {
                let d = self.delta();
                add(&mut self.z, &d);
            }
            5 => self.pulls.push_back((self.z.clone(), self.applied, true)),
            6 => {
                // A pull issued after push `applied`, answered after the next one applied.
                let absorbed = self.applied;
                let exact = !self.apply();
                self.pulls.push_back((self.z.clone(), absorbed, exact));
            }
            7 => self.land(),
            _ => {
                // The comm side says the pservers hold the newest applied push's mark
                // (true when no other update came between; here, whatever came).
                let base = self.working.base();
                if self.working.advance(self.applied) {
                    assert!(self.applied > base);
                    assert_eq!(self.working.base(), self.applied);
                    self.advances += 1;
                }
            }
        }
    }

    /// Everything handed over, applied, and one exact pull landed: the working values
    /// are the pservers'.
    fn settle(&mut self) {
        if self.acc.iter().any(|&v| v != 0.0) {
            self.hand_over();
        }
        while self.apply() {}
        while !self.pulls.is_empty() {
            self.land();
        }
        self.pulls.push_back((self.z.clone(), self.applied, true));
        self.land();
        assert_eq!(self.working.params().dense[0], self.z);
    }
}

fn small(rng: &mut SplitMix64) -> f32 {
    rng.below(7) as f32 - 3.0
}

fn add(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

#[test]
fn the_working_values_are_the_pservers_plus_the_updates_not_absorbed() {
    let (mut exact, mut racing, mut advances) = (0, 0, 0);
    for seed in 0..2_500 {
        let mut w = World::new(seed);
        for _ in 0..w.rng.below(60) + 1 {
            w.step();
        }
        w.settle();
        exact += w.exact_landings;
        racing += w.racing_landings;
        advances += w.advances;
    }
    // Witnesses: both kinds of landing were reached, many times.
    assert!(exact > 10_000, "exact landings: {exact}");
    assert!(racing > 1_000, "racing landings: {racing}");
    assert!(advances > 1_000, "advances: {advances}");
}

#[test]
fn an_advance_moves_the_base_and_keeps_the_working_values() {
    let mut w = Working::new(vec![vec![1.0, 2.0]]);
    w.params().dense[0][0] += 1.0;
    w.mark(1);
    w.params().dense[0][1] += 1.0;
    w.mark(2);
    w.params().dense[0][1] += 1.0;
    assert!(!w.advance(3), "push 3 was not handed over");
    assert!(w.advance(1));
    assert_eq!((w.base(), &w.params().dense[0]), (1, &vec![2.0, 4.0]));
    assert!(!w.advance(1), "already the base");
    assert!(w.advance(2));
    assert!(
        !w.land(vec![vec![9.0, 9.0]], 1),
        "push 1 is older than the base"
    );
    // The pservers held 5, 5 at push 2, not the mark (2, 3): the landing rebases.
    assert!(w.land(vec![vec![5.0, 5.0]], 2));
    assert_eq!(w.params().dense[0], vec![5.0, 6.0]);
}

#[test]
fn a_landing_older_than_the_base_is_dropped() {
    let mut w = Working::new(vec![vec![1.0, 2.0]]);
    w.params().dense[0][0] += 1.0;
    w.mark(1);
    w.mark(2);
    assert!(w.land(vec![vec![5.0, 5.0]], 2));
    assert_eq!(w.base(), 2);
    assert!(
        !w.land(vec![vec![9.0, 9.0]], 1),
        "push 1 is older than the base"
    );
    assert_eq!(w.params().dense[0], vec![5.0, 5.0]);
    assert_eq!(w.rebases, 1);
}

#[test]
fn a_landing_of_another_shape_is_dropped() {
    let mut w = Working::new(vec![vec![1.0, 2.0]]);
    assert!(!w.land(vec![vec![5.0]], 0));
    assert_eq!(w.params().dense[0], vec![1.0, 2.0]);
}
