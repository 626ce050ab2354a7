//! [`Goodput`]: where a trainer's wall time went, in buckets that sum to it. The trainer
//! measures it (`edl_trainer::goodput`), reports it in its final report and `/metrics`,
//! and sends it with each `GetTask`, so that the leading master can show every trainer's
//! and the job's in `Status` (`edl status`). Converted to and from protobuf here only.

use edl_proto::master as pb;

/// A share of a trainer's wall time. When several apply at once (the pipeline computes
/// while a push is sent and the next task is asked for), the instant goes to the first
/// in this order that applies: what the trainer's math is doing wins over what it waits
/// for, and a start (until the first task) over the waits within it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Bucket {
    /// The model's math and preparing its batches, on a task's first attempt (or past a
    /// drained attempt's resume point).
    Computing,
    /// Training a task an earlier attempt of this pass had (it was cut off from a lost
    /// trainer, rewound by a shard's restore, or handed back without a resume point):
    /// its math, and its pulls and pushes too.
    Recomputing,
    /// Evaluating the held-out split (at the start and at each pass end).
    Evaluating,
    /// From the process's start to its first task: the spec, the model, joining the job,
    /// the parameters' initialisation, waiting for pservers that are not up yet.
    Starting,
    /// Waiting on a pserver call that failed and is being retried (a pserver killed,
    /// restarting or moved to a replica).
    Recovering,
    /// Waiting on pulls, pushes and task reports that did not fail.
    Communicating,
    /// Waiting for the master to lease a task (none free yet, or the pass is ending
    /// while others finish theirs).
    WaitingForTask,
    /// None of the above: the loop's own bookkeeping, and leaving.
    Idle,
}

impl Bucket {
    /// Every bucket, in priority order.
    pub const ALL: [Bucket; 8] = [
        Bucket::Computing,
        Bucket::Recomputing,
        Bucket::Evaluating,
        Bucket::Starting,
        Bucket::Recovering,
        Bucket::Communicating,
        Bucket::WaitingForTask,
        Bucket::Idle,
    ];

    /// Its name in reports, metrics (the `bucket` label) and `edl status`.
    pub fn name(self) -> &'static str {
        match self {
            Bucket::Computing => "computing",
            Bucket::Recomputing => "recomputing",
            Bucket::Recovering => "recovering",
            Bucket::Communicating => "communicating",
            Bucket::Evaluating => "evaluating",
            Bucket::WaitingForTask => "waiting_for_task",
            Bucket::Starting => "starting",
            Bucket::Idle => "idle",
        }
    }

    /// Its index in [`Bucket::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Seconds per [`Bucket`] (indexed by [`Bucket::index`]); their sum is the wall time
/// measured.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Goodput {
    /// Seconds per bucket.
    pub seconds: [f64; Bucket::ALL.len()],
}

impl Goodput {
    /// The seconds of `b`.
    pub fn get(&self, b: Bucket) -> f64 {
        self.seconds[b.index()]
    }

    /// Their sum: the wall time measured.
    pub fn total(&self) -> f64 {
        self.seconds.iter().sum()
    }

    /// Adds `other`'s seconds (a job's: the sum of its trainers').
    pub fn add(&mut self, other: &Goodput) {
        for (a, b) in self.seconds.iter_mut().zip(other.seconds) {
            *a += b;
        }
    }

    /// `(name, seconds)` per bucket, in priority order.
    pub fn named(&self) -> impl Iterator<Item = (&'static str, f64)> + '_ {
        Bucket::ALL.iter().map(|b| (b.name(), self.get(*b)))
    }

    /// Whether every value is a finite number of seconds, none negative (what the
    /// master keeps from a request).
    pub fn is_valid(&self) -> bool {
        self.seconds.iter().all(|s| s.is_finite() && *s >= 0.0)
    }
}

impl From<&Goodput> for pb::Goodput {
    fn from(g: &Goodput) -> Self {
        pb::Goodput {
            computing_s: g.get(Bucket::Computing),
            recomputing_s: g.get(Bucket::Recomputing),
            recovering_s: g.get(Bucket::Recovering),
            communicating_s: g.get(Bucket::Communicating),
            evaluating_s: g.get(Bucket::Evaluating),
            waiting_for_task_s: g.get(Bucket::WaitingForTask),
            starting_s: g.get(Bucket::Starting),
            idle_s: g.get(Bucket::Idle),
        }
    }
}

impl From<&pb::Goodput> for Goodput {
    fn from(g: &pb::Goodput) -> Self {
        let mut out = Goodput::default();
        for b in Bucket::ALL {
            out.seconds[b.index()] = match b {
                Bucket::Computing => g.computing_s,
                Bucket::Recomputing => g.recomputing_s,
                Bucket::Evaluating => g.evaluating_s,
                Bucket::Starting => g.starting_s,
                Bucket::Recovering => g.recovering_s,
                Bucket::Communicating => g.communicating_s,
                Bucket::WaitingForTask => g.waiting_for_task_s,
                Bucket::Idle => g.idle_s,
            };
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_in_priority_order_and_survive_the_wire() {
        for (i, b) in Bucket::ALL.iter().enumerate() {
            assert_eq!(b.index(), i);
        }
        let mut g = Goodput::default();
        for (i, s) in g.seconds.iter_mut().enumerate() {
            *s = i as f64 + 0.5;
        }
        assert_eq!(Goodput::from(&pb::Goodput::from(&g)), g);
        assert_eq!(g.total(), (0..8).map(|i| i as f64 + 0.5).sum::<f64>());
        let names: Vec<_> = g.named().map(|(n, _)| n).collect();
        assert_eq!(names[0], "computing");
        assert_eq!(names[7], "idle");
        assert!(g.is_valid());
        g.seconds[3] = f64::NAN;
        assert!(!g.is_valid());
    }
}
