//! EDL's node search, fast: the first node in the map's order (a rotation of the
//! nodes' order) with room for a trainer's CPU and memory. EDL scans the nodes one by
//! one; this keeps the maxima of idle CPU and memory over ranges of nodes in a tree, so
//! a search skips the ranges where no node has room, and finds the same node.

/// The nodes' idle CPU and memory, searchable by first fit.
#[derive(Debug, Clone)]
pub(super) struct FirstFit {
    /// Leaves from `size`; node `k` at `size + k`. Nodes left out hold `i64::MIN`.
    cpu: Vec<i64>,
    mem: Vec<i64>,
    size: usize,
    nodes: usize,
}

impl FirstFit {
    /// The nodes of `idle` (CPU, memory) for which `kept` holds.
    pub(super) fn new(idle: &[(i64, i64)], kept: impl Fn(usize) -> bool) -> FirstFit {
        let size = idle.len().next_power_of_two().max(1);
        let mut f = FirstFit {
            cpu: vec![i64::MIN; 2 * size],
            mem: vec![i64::MIN; 2 * size],
            size,
            nodes: idle.len(),
        };
        for (k, &(c, m)) in idle.iter().enumerate() {
            if kept(k) {
                f.cpu[size + k] = c;
                f.mem[size + k] = m;
            }
        }
        for v in (1..size).rev() {
            f.cpu[v] = f.cpu[2 * v].max(f.cpu[2 * v + 1]);
            f.mem[v] = f.mem[2 * v].max(f.mem[2 * v + 1]);
        }
        f
    }

    /// Node `k`'s idle resources are now `idle` (a node left out stays out).
    pub(super) fn set(&mut self, k: usize, idle: (i64, i64)) {
        let mut v = self.size + k;
        if self.cpu[v] == i64::MIN {
            return;
        }
        (self.cpu[v], self.mem[v]) = idle;
        while v > 1 {
            v /= 2;
            self.cpu[v] = self.cpu[2 * v].max(self.cpu[2 * v + 1]);
            self.mem[v] = self.mem[2 * v].max(self.mem[2 * v + 1]);
        }
    }

    /// The first node from `start`, wrapping around, with at least `cpu` and `mem` idle.
    pub(super) fn first(&self, start: usize, cpu: i64, mem: i64) -> Option<usize> {
        let start = start.min(self.nodes);
        self.first_in(1, 0, self.size, start, self.nodes, cpu, mem)
            .or_else(|| self.first_in(1, 0, self.size, 0, start, cpu, mem))
    }

    /// The first node of `[lo, hi)` under tree node `v` (covering `[from, to)`).
    #[allow(clippy::too_many_arguments)]
    fn first_in(
        &self,
        v: usize,
        from: usize,
        to: usize,
        lo: usize,
        hi: usize,
        cpu: i64,
        mem: i64,
    ) -> Option<usize> {
        if to <= lo || hi <= from || self.cpu[v] < cpu || self.mem[v] < mem {
            return None;
        }
        if to - from == 1 {
            return Some(from);
        }
        let mid = (from + to) / 2;
        self.first_in(2 * v, from, mid, lo, hi, cpu, mem)
            .or_else(|| self.first_in(2 * v + 1, mid, to, lo, hi, cpu, mem))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::FirstFit;

    /// EDL's scan: the first node of the rotated order that is kept and has room.
    fn scan(idle: &[(i64, i64)], kept: &[bool], start: usize, cpu: i64, mem: i64) -> Option<usize> {
        let n = idle.len();
        (0..n)
            .map(|k| (start + k) % n)
            .find(|&k| kept[k] && idle[k].0 >= cpu && idle[k].1 >= mem)
    }

    proptest! {
        #[test]
        fn first_fit_finds_the_node_a_scan_finds(
            nodes in prop::collection::vec((0i64..10, 0i64..10, any::<bool>()), 1..40),
            changes in prop::collection::vec((0usize..40, -5i64..10, -5i64..10), 0..20),
            queries in prop::collection::vec((0usize..40, 0i64..10, 0i64..10), 1..20),
        ) {
            let mut idle: Vec<(i64, i64)> = nodes.iter().map(|&(c, m, _)| (c, m)).collect();
            let kept: Vec<bool> = nodes.iter().map(|&(_, _, k)| k).collect();
            let mut f = FirstFit::new(&idle, |k| kept[k]);
            for (k, c, m) in changes {
                let k = k % idle.len();
                idle[k] = (c, m);
                f.set(k, (c, m));
            }
            for (start, cpu, mem) in queries {
                let start = start % idle.len();
                prop_assert_eq!(f.first(start, cpu, mem), scan(&idle, &kept, start, cpu, mem));
            }
        }
    }
}
