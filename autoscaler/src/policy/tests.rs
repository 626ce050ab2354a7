//! edl's policy: cases by hand, and the invariants of `policy.rs` by property tests.

use std::collections::BTreeMap;

use proptest::prelude::*;

use crate::policy::{PolicyConfig, decide};
use crate::{JobView, Node, Observation, PodCounts, Resources, Snapshot, Speedup, Target};

fn running_job(
    name: &str,
    min: u32,
    max: u32,
    trainers: u32,
    sigma: f64,
    remaining: f64,
) -> JobView {
    let curve = Speedup { a: 100.0, sigma };
    JobView {
        name: name.to_owned(),
        min,
        max,
        priority: 0,
        trainer: Resources::new(4.0, 8.0, 0),
        trainers,
        waiting: Vec::new(),
        pods: PodCounts {
            total: trainers,
            running: trainers,
            pending: 0,
            unbound: 0,
        },
        submitted: 0.0,
        changed_at: None,
        speed: vec![
            Observation {
                trainers: trainers.max(1),
                rate: curve.rate(trainers.max(1)),
            },
            Observation {
                trainers: trainers.max(1) + 1,
                rate: curve.rate(trainers.max(1) + 1),
            },
        ],
        remaining: Some(remaining),
    }
}

fn cluster(nodes: usize, cores: f64, used_per_node: f64) -> Vec<Node> {
    (0..nodes)
        .map(|i| Node {
            name: format!("n{i}"),
            allocatable: Resources::new(cores, 256.0, 0),
            requested: Resources::new(used_per_node, 8.0 * used_per_node / 4.0, 0),
        })
        .collect()
}

fn by_name(snap: &Snapshot, t: &[Target]) -> BTreeMap<String, u32> {
    t.iter()
        .map(|t| (snap.jobs[t.job].name.clone(), t.to))
        .collect()
}

#[test]
fn free_room_goes_first_to_the_job_that_scales_and_several_trainers_at_once() {
    // 4 nodes of 32 cores, 8 used on each: room for 24 trainers of 4 cores within 0.97.
    // `lin` scales linearly, `flat` hardly (sigma 0.9): all growth goes to `lin` until
    // its max, then what is left to `flat`.
    let snap = Snapshot {
        now: 100.0,
        nodes: cluster(4, 32.0, 8.0),
        unplaced: Resources::ZERO,
        jobs: vec![
            running_job("lin", 2, 16, 4, 0.0, 1e6),
            running_job("flat", 2, 16, 4, 0.9, 1e6),
        ],
    };
    let got = by_name(&snap, &decide(&PolicyConfig::default(), &snap));
    assert_eq!(got.get("lin"), Some(&16), "{got:?}");
    // flat's 5th trainer adds (1-0.9)/(1+0.9*3)^2 < 2% of one trainer: not added.
    assert_eq!(got.get("flat"), None, "{got:?}");
}

#[test]
fn a_starved_job_gets_its_minimum_from_the_trainers_worth_least() {
    // A full cluster (2 nodes of 16 cores, 4 trainers each). `new` waits for 2 trainers;
    // `near` (little work left) and `far` (much left) each run 4: the two trainers come
    // from `far`, whose trainers shorten it least.
    let mut new = running_job("new", 2, 8, 2, 0.0, 1e6);
    new.pods = PodCounts {
        total: 2,
        running: 0,
        pending: 2,
        unbound: 2,
    };
    new.waiting = vec![new.trainer; 2];
    new.speed.clear();
    let snap = Snapshot {
        now: 100.0,
        nodes: cluster(2, 16.0, 16.0),
        unplaced: Resources::new(8.0, 16.0, 0),
        jobs: vec![
            running_job("near", 1, 8, 4, 0.05, 1e4),
            running_job("far", 1, 8, 4, 0.05, 1e6),
            new,
        ],
    };
    let got = by_name(&snap, &decide(&PolicyConfig::default(), &snap));
    // Two trainers make node room for its two pods; a third keeps the cluster within
    // 0.97 of its 32 cores (32 - 12 + 8 = 28 <= 31.04).
    assert_eq!(got, BTreeMap::from([("far".to_owned(), 1)]), "{got:?}");
}

#[test]
fn a_recent_change_is_left_alone_and_a_big_gain_moves_trainers() {
    // `old` (poor scaling, much work) holds 10 trainers of a full cluster; `hot` (linear,
    // little work left) runs at its minimum: trainers move from old to hot...
    let mut snap = Snapshot {
        now: 1000.0,
        nodes: cluster(2, 32.0, 32.0),
        unplaced: Resources::ZERO,
        jobs: vec![
            running_job("old", 2, 12, 10, 0.3, 1e7),
            running_job("hot", 2, 12, 4, 0.0, 1e5),
        ],
    };
    let got = by_name(&snap, &decide(&PolicyConfig::default(), &snap));
    assert!(got.get("hot").is_some_and(|&n| n > 4), "{got:?}");
    assert!(got.get("old").is_some_and(|&n| n < 10), "{got:?}");
    // ... unless old was changed 10 s ago (min_interval 30 s).
    snap.jobs[0].changed_at = Some(990.0);
    let got = by_name(&snap, &decide(&PolicyConfig::default(), &snap));
    assert!(got.is_empty(), "{got:?}");
}

/// Growth and moves are made only where they save a job more than a change costs
/// (`change_cost`): the same snapshots that grow and move at no cost do nothing when a
/// change costs more than it saves.
#[test]
fn a_change_is_made_only_when_it_saves_more_than_it_costs() {
    // A lone linear job, 1e5 records left at 400/s on 4 trainers (250 s), with room for
    // 3 more within 0.97 of the node: 7 trainers save it 107 s.
    let grow = Snapshot {
        now: 100.0,
        nodes: cluster(1, 32.0, 16.0),
        unplaced: Resources::ZERO,
        jobs: vec![running_job("lone", 1, 8, 4, 0.0, 1e5)],
    };
    let cost = |c: f64| PolicyConfig {
        change_cost: c,
        ..PolicyConfig::default()
    };
    let got = by_name(&grow, &decide(&cost(100.0), &grow));
    assert_eq!(got.get("lone"), Some(&7), "saves 107 s > 100 s: {got:?}");
    let got = by_name(&grow, &decide(&cost(110.0), &grow));
    assert!(got.is_empty(), "saves 107 s < 110 s: {got:?}");

    // The move of the test above: `hot` saves 50 s a trainer, `old` loses about 4 s
    // while hot runs (it gets the trainer back when hot ends).
    let moves = Snapshot {
        now: 1000.0,
        nodes: cluster(2, 32.0, 32.0),
        unplaced: Resources::ZERO,
        jobs: vec![
            running_job("old", 2, 12, 10, 0.3, 1e7),
            running_job("hot", 2, 12, 4, 0.0, 1e5),
        ],
    };
    let got = by_name(&moves, &decide(&cost(10.0), &moves));
    assert!(got.get("hot").is_some_and(|&n| n > 4), "{got:?}");
    let got = by_name(&moves, &decide(&cost(30.0), &moves));
    assert!(got.is_empty(), "50 s < 4 s + 2 x 30 s: {got:?}");
}

/// What `edl operator run --autoscale --autoscale-preempt` runs, at its default cost of
/// a change.
fn preemptive() -> PolicyConfig {
    PolicyConfig::preemptive(30.0)
}

/// A job submitted at `submitted`, never seen running, its one trainer waiting for a
/// node.
fn waiting_job(name: &str, submitted: f64) -> JobView {
    let mut new = running_job(name, 1, 8, 1, 0.1, 1e9);
    new.speed.clear();
    new.remaining = None;
    new.pods.running = 0;
    new.pods.pending = 1;
    new.pods.unbound = 1;
    new.waiting = vec![new.trainer];
    new.submitted = submitted;
    new
}

/// A node full of jobs at their minimum (1 trainer of 4 cores each, 28 of 32 cores) and
/// a job just submitted, never seen running, waiting for its first trainer.
fn full_of_minimums() -> Snapshot {
    let mut jobs: Vec<JobView> = [1e3, 1e4, 1e5, 1e7, 1e6, 2e3, 3e3]
        .iter()
        .enumerate()
        .map(|(k, &left)| running_job(&format!("run{k}"), 1, 8, 1, 0.1, left))
        .collect();
    jobs.push(waiting_job("new", 500.0));
    Snapshot {
        now: 1000.0,
        nodes: cluster(1, 32.0, 28.0),
        unplaced: Resources::new(4.0, 8.0, 0),
        jobs,
    }
}

/// With `preempt`, a job never seen running goes first (least attained service), and
/// the job with the most time left is suspended for it; without, nobody is below min.
#[test]
fn a_new_job_suspends_the_job_with_the_most_time_left() {
    let snap = full_of_minimums();
    let got = by_name(&snap, &decide(&preemptive(), &snap));
    assert_eq!(got, BTreeMap::from([("run3".to_owned(), 0)]));
    let got = by_name(&snap, &decide(&PolicyConfig::default(), &snap));
    assert!(got.values().all(|&n| n >= 1), "{got:?}");

    // A higher priority is never suspended for a lower one: the next longest goes.
    let mut snap = full_of_minimums();
    snap.jobs[3].priority = 1;
    let got = by_name(&snap, &decide(&preemptive(), &snap));
    assert_eq!(got, BTreeMap::from([("run4".to_owned(), 0)]));

    // A job changed a moment ago is not suspended either.
    let mut snap = full_of_minimums();
    snap.jobs[3].changed_at = Some(995.0);
    let got = by_name(&snap, &decide(&preemptive(), &snap));
    assert_eq!(got, BTreeMap::from([("run4".to_owned(), 0)]));
}

/// A suspended job waits while every running job is worth more than it, and is resumed,
/// suspending the longest, once it is the shorter.
#[test]
fn a_queued_job_is_resumed_only_when_it_is_worth_more() {
    let mut snap = full_of_minimums();
    let queued = snap.jobs.len() - 1;
    let q = &mut snap.jobs[queued];
    *q = running_job("queued", 1, 8, 0, 0.1, 1e8);
    q.speed = vec![Observation {
        trainers: 1,
        rate: 100.0,
    }];
    snap.unplaced = Resources::ZERO;
    let got = by_name(&snap, &decide(&preemptive(), &snap));
    assert!(got.is_empty(), "it waits: {got:?}");

    snap.jobs[queued].remaining = Some(1e2);
    let got = by_name(&snap, &decide(&preemptive(), &snap));
    assert_eq!(
        got,
        BTreeMap::from([("queued".to_owned(), 1), ("run3".to_owned(), 0)])
    );
}

/// A job running at a count observed slower than a smaller one is lowered to it (the
/// Pollux artifact's YOLOv3: 4 GPUs 7.2 steps/s, 5 GPUs 3.9).
#[test]
fn a_job_slower_with_more_trainers_is_lowered() {
    let mut j = running_job("dip", 1, 16, 5, 0.0, 1e6);
    j.speed = [(1, 2.5), (3, 6.3), (4, 7.2), (5, 3.9), (5, 3.8)]
        .iter()
        .map(|&(trainers, rate)| Observation { trainers, rate })
        .collect();
    let snap = Snapshot {
        now: 1000.0,
        nodes: cluster(1, 32.0, 20.0),
        unplaced: Resources::ZERO,
        jobs: vec![j],
    };
    let got = by_name(&snap, &decide(&preemptive(), &snap));
    assert_eq!(got.get("dip"), Some(&4), "{got:?}");
}

/// A count observed slower than one fewer by less than the noise of an observation is
/// not lowered (it would grow back at the next pass); further below, it is.
#[test]
fn a_dip_within_the_noise_is_not_lowered() {
    let snap_with = |dip: f64| {
        let mut j = running_job("dip", 1, 16, 5, 0.0, 1e6);
        j.speed = [(2, 200.0), (3, 300.0), (4, 400.0), (5, dip)]
            .iter()
            .map(|&(trainers, rate)| Observation { trainers, rate })
            .collect();
        Snapshot {
            now: 1000.0,
            nodes: cluster(1, 24.0, 20.0),
            unplaced: Resources::ZERO,
            jobs: vec![j],
        }
    };
    let noisy = snap_with(385.0);
    let got = by_name(&noisy, &decide(&preemptive(), &noisy));
    assert!(got.is_empty(), "a 4% dip: {got:?}");
    let slow = snap_with(300.0);
    let got = by_name(&slow, &decide(&preemptive(), &slow));
    assert_eq!(got.get("dip"), Some(&4), "a 25% dip: {got:?}");
}

/// A job submitted at the pass's instant, its pod waiting for a node, does not stop
/// another job from growing (its pod is older than the growth's and on the same
/// backoff); one that has waited since an earlier pass does.
#[test]
fn only_a_job_waiting_since_an_earlier_pass_holds_growth() {
    let snap_with = |submitted: f64| {
        let new = waiting_job("new", submitted);
        Snapshot {
            now: 1000.0,
            nodes: cluster(1, 32.0, 8.0),
            unplaced: new.trainer,
            jobs: vec![running_job("run", 1, 8, 2, 0.0, 1e6), new],
        }
    };
    for cfg in [PolicyConfig::default(), preemptive()] {
        let now = snap_with(1000.0);
        let got = by_name(&now, &decide(&cfg, &now));
        assert!(got.get("run").is_some_and(|&n| n > 2), "{got:?}");
        let earlier = snap_with(995.0);
        let got = by_name(&earlier, &decide(&cfg, &earlier));
        assert!(got.is_empty(), "{got:?}");
    }
}

#[test]
fn unbound_scale_ups_are_given_back() {
    let mut j = running_job("a", 2, 12, 8, 0.0, 1e6);
    j.pods.running = 5;
    j.pods.pending = 3;
    j.pods.unbound = 3;
    j.waiting = vec![j.trainer; 3];
    let snap = Snapshot {
        now: 1000.0,
        nodes: cluster(1, 20.0, 20.0),
        unplaced: Resources::new(12.0, 24.0, 0),
        jobs: vec![j],
    };
    let t = decide(&PolicyConfig::default(), &snap);
    assert_eq!(
        t,
        vec![Target {
            job: 0,
            from: 8,
            to: 5
        }]
    );
}

/// Job `i` of a snapshot taken at `now` (its last change, if any, before it).
fn arb_job(i: usize, now: f64) -> impl Strategy<Value = JobView> {
    (
        1u32..4,
        0u32..8,
        0u32..14,
        0i32..3,
        prop::bool::ANY,
        0u32..4,
        prop::option::of(0.0f64..now),
        prop::option::of((0.0f64..0.5, 10.0f64..200.0)),
        prop::option::of(1.0f64..1e6),
        prop::bool::ANY,
    )
        .prop_map(
            move |(
                min,
                span,
                trainers,
                priority,
                gpu,
                unbound,
                changed,
                speed,
                remaining,
                pserver,
            )| {
                let max = min + span;
                let trainer = if gpu {
                    Resources::new(8.0, 32.0, 1)
                } else {
                    Resources::new(4.0, 8.0, 0)
                };
                let unbound = unbound.min(trainers);
                let mut waiting = vec![trainer; unbound as usize];
                if pserver {
                    waiting.push(Resources::new(2.0, 4.0, 0));
                }
                let obs = speed
                    .map(|(sigma, a)| {
                        let c = Speedup { a, sigma };
                        let n = trainers.max(1);
                        vec![Observation {
                            trainers: n,
                            rate: c.rate(n),
                        }]
                    })
                    .unwrap_or_default();
                JobView {
                    name: format!("job{i}"),
                    min,
                    max,
                    priority,
                    trainer,
                    trainers,
                    waiting,
                    pods: PodCounts {
                        total: trainers,
                        running: trainers - unbound,
                        pending: unbound,
                        unbound,
                    },
                    submitted: i as f64,
                    changed_at: changed,
                    speed: obs,
                    remaining,
                }
            },
        )
}

fn arb_snapshot() -> impl Strategy<Value = Snapshot> {
    arb_snapshot_at(200.0)
}

/// A snapshot taken at `now`: with the shipped hold of 240 s, `now` 600 leaves 40% of
/// the jobs changed before it frozen and 60% free.
fn arb_snapshot_at(now: f64) -> impl Strategy<Value = Snapshot> {
    let nodes = prop::collection::vec((prop::bool::ANY, 0.0f64..1.0), 1..6);
    let jobs = (1usize..7)
        .prop_flat_map(move |n| (0..n).map(move |i| arb_job(i, now)).collect::<Vec<_>>());
    (nodes, jobs).prop_map(move |(nodes, jobs)| {
        let nodes: Vec<Node> = nodes
            .into_iter()
            .enumerate()
            .map(|(i, (gpu, used))| {
                let alloc = if gpu {
                    Resources::new(64.0, 512.0, 8)
                } else {
                    Resources::new(32.0, 128.0, 0)
                };
                let requested = Resources {
                    cpu_milli: (alloc.cpu_milli as f64 * used) as u64,
                    mem_mib: (alloc.mem_mib as f64 * used) as u64,
                    gpu: (alloc.gpu as f64 * used) as u64,
                };
                Node {
                    name: format!("n{i}"),
                    allocatable: alloc,
                    requested,
                }
            })
            .collect();
        let unplaced = jobs.iter().flat_map(|j| j.waiting.iter().copied()).sum();
        Snapshot {
            now,
            nodes,
            unplaced,
            jobs,
        }
    })
}

fn starved(j: &JobView) -> bool {
    j.pods.total - j.pods.unbound < j.min || j.waiting.len() as u32 > j.pods.unbound
}

/// The invariants of `policy.rs` on one snapshot under `cfg`.
fn check_invariants(cfg: &PolicyConfig, snap: &Snapshot) -> Result<(), TestCaseError> {
    let targets = decide(cfg, snap);
    let mut seen = std::collections::BTreeSet::new();
    let mut delta = Resources::ZERO;
    let mut freed = Resources::ZERO;
    for t in &targets {
        let j = &snap.jobs[t.job];
        prop_assert!(seen.insert(t.job), "answered twice: {t:?}");
        prop_assert_eq!(t.from, j.trainers);
        prop_assert_ne!(t.from, t.to);
        // Suspended (0) only where whole jobs may be, and only an elastic job.
        let suspended = cfg.preempt && t.to == 0 && j.is_elastic();
        prop_assert!(
            suspended || (j.min <= t.to && t.to <= j.max.max(j.min)),
            "{t:?} outside {}..{}",
            j.min,
            j.max
        );
        let in_bounds = j.min <= j.trainers && j.trainers <= j.max;
        if !j.is_elastic() {
            prop_assert!(!in_bounds, "fixed job answered: {t:?}");
        }
        let frozen = j
            .changed_at
            .is_some_and(|c| snap.now - c < cfg.min_interval);
        if t.to > t.from {
            prop_assert!(!frozen || !in_bounds, "a recent change grew: {t:?}");
            // Grown (past min: admission aside) only while expected to run longer than
            // `min_remaining` at some count it grew from.
            if t.from >= j.min
                && let Some(left) = j.remaining
            {
                let curve = crate::RateModel::new(&j.speed, cfg.prior_sigma, j.max.max(j.min));
                prop_assert!(
                    curve.is_some_and(
                        |c| (t.from..t.to).any(|n| left / c.rate(n.max(1)) > cfg.min_remaining)
                    ),
                    "grew a job expected to end within min_remaining: {t:?}"
                );
            }
            // (A count below min is raised to min by admission, not growth: bounds first.)
            let from = t.from.max(j.min);
            delta += j.trainer * u64::from(t.to.saturating_sub(from));
        } else {
            freed += j.trainer * u64::from(t.from - t.to);
            let bound = j.pods.total - j.pods.unbound;
            prop_assert!(
                !(suspended && frozen && bound > 0),
                "a recent change suspended: {t:?}"
            );
            if in_bounds && frozen && j.pods.unbound == 0 {
                // Only to admit a starved job of the same or a higher priority.
                prop_assert!(
                    snap.jobs
                        .iter()
                        .any(|s| starved(s) && s.priority >= j.priority),
                    "a recent change lowered without an admission: {t:?}"
                );
            }
            if in_bounds && j.pods.unbound == 0 && j.trainers > 0 {
                // Never for a lower priority.
                let helped = snap.jobs.iter().enumerate().any(|(k, s)| {
                    s.priority >= j.priority
                        && (starved(s) || targets.iter().any(|u| u.job == k && u.to > u.from))
                });
                prop_assert!(helped, "lowered for nobody of its priority: {t:?}");
            }
        }
    }
    // Growth never takes the requests past max_load (when they were within it).
    let before = snap.requested();
    let total = snap.total();
    let cap = |v: u64| (v as f64 * cfg.max_load).floor() as u64;
    let after_cpu = (before.cpu_milli + delta.cpu_milli).saturating_sub(freed.cpu_milli);
    if delta.cpu_milli > freed.cpu_milli && before.cpu_milli <= cap(total.cpu_milli) {
        prop_assert!(
            after_cpu <= cap(total.cpu_milli),
            "cpu {after_cpu} > cap {}",
            cap(total.cpu_milli)
        );
    }
    let after_gpu = (before.gpu + delta.gpu).saturating_sub(freed.gpu);
    if delta.gpu > freed.gpu && before.gpu <= cap(total.gpu) {
        prop_assert!(
            after_gpu <= cap(total.gpu),
            "gpu {after_gpu} > cap {}",
            cap(total.gpu)
        );
    }
    // The answer does not depend on the jobs' order.
    let mut reversed = snap.clone();
    reversed.jobs.reverse();
    let again = decide(cfg, &reversed);
    prop_assert_eq!(by_name(snap, &targets), by_name(&reversed, &again));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn the_policy_keeps_its_invariants(snap in arb_snapshot()) {
        check_invariants(&PolicyConfig::default(), &snap)?;
    }

    /// What `edl operator run --autoscale --autoscale-preempt` runs (its default cost of
    /// a change, 30 s: a 240 s hold, no growth within 480 s of the end), on snapshots
    /// whose jobs changed up to 600 s before.
    #[test]
    fn the_shipped_preemptive_policy_keeps_its_invariants(snap in arb_snapshot_at(600.0)) {
        check_invariants(&PolicyConfig::preemptive(30.0), &snap)?;
    }

    /// Whole jobs suspended and a cost per change without the holds (15 s, 30 s), so
    /// that recent changes are drawn on both sides of the hold.
    #[test]
    fn the_preemptive_policy_keeps_its_invariants(snap in arb_snapshot()) {
        check_invariants(&PolicyConfig {
            preempt: true,
            change_cost: 30.0,
            size_exponent: 0.5,
            ..PolicyConfig::default()
        }, &snap)?;
    }
}
