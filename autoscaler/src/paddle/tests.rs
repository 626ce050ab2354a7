//! EDL's algorithm on small cases computed by hand from its source.

use crate::paddle::{Defects, MAX_DRY_RUNS, PaddleConfig, decide, decide_counted};
use crate::{JobView, Node, PodCounts, Resources, Snapshot, Target};

fn cpu(cores: f64) -> Resources {
    Resources::new(cores, 1.0, 0)
}

fn node(alloc: Resources, requested: Resources) -> Node {
    Node {
        name: "n".to_owned(),
        allocatable: alloc,
        requested,
    }
}

/// A job whose `trainers` pods all run (or all wait for a node when `pending`).
fn job(
    name: &str,
    min: u32,
    max: u32,
    trainers: u32,
    trainer: Resources,
    pending: bool,
) -> JobView {
    JobView {
        name: name.to_owned(),
        min,
        max,
        priority: 0,
        trainer,
        trainers,
        waiting: if pending {
            vec![trainer; trainers as usize]
        } else {
            Vec::new()
        },
        pods: PodCounts {
            total: trainers,
            running: if pending { 0 } else { trainers },
            pending: if pending { trainers } else { 0 },
            unbound: if pending { trainers } else { 0 },
        },
        submitted: 0.0,
        changed_at: None,
        speed: Vec::new(),
        remaining: None,
    }
}

fn snapshot(nodes: Vec<Node>, unplaced: Resources, jobs: Vec<JobView>) -> Snapshot {
    Snapshot {
        now: 0.0,
        nodes,
        unplaced,
        jobs,
    }
}

fn changes(snap: &Snapshot, targets: &[Target]) -> Vec<(String, u32, u32)> {
    let mut v: Vec<_> = targets
        .iter()
        .map(|t| (snap.jobs[t.job].name.clone(), t.from, t.to))
        .collect();
    v.sort();
    v
}

#[test]
fn scale_up_stops_at_max_load_of_the_cluster_cpu() {
    // 16 cores, 2 requested by the job's one trainer: +1 while 15.52 - requested >= 2,
    // that is at 2, 4, ..., 12 requested: six more trainers.
    let snap = snapshot(
        vec![node(Resources::new(16.0, 64.0, 0), cpu(2.0))],
        Resources::ZERO,
        vec![job("a", 1, 10, 1, cpu(2.0), false)],
    );
    let t = decide(&PaddleConfig::default(), &snap, 1);
    assert_eq!(changes(&snap, &t), vec![("a".to_owned(), 1, 7)]);
}

#[test]
fn scale_down_on_overload_takes_from_the_most_fulfilled_first() {
    // 20 cores; a: 6 of 1..10 (fulfillment 5/9), b: 3 of 1..5 (1/2), both running;
    // c: 2 of 2..4 all pending. Requested 12 + 6 + 4 = 22 > 19.4: every job is a
    // candidate; c cannot grow (no room), a then b go -1 (22 -> 20 -> 18), then
    // 18 <= 19.4 stops it; the next dry run changes nothing.
    let snap = snapshot(
        vec![node(cpu(20.0), cpu(18.0))],
        cpu(4.0),
        vec![
            job("a", 1, 10, 6, cpu(2.0), false),
            job("b", 1, 5, 3, cpu(2.0), false),
            job("c", 2, 4, 2, cpu(2.0), true),
        ],
    );
    let t = decide(&PaddleConfig::default(), &snap, 1);
    assert_eq!(
        changes(&snap, &t),
        vec![("a".to_owned(), 6, 5), ("b".to_owned(), 3, 2)]
    );
}

#[test]
fn without_a_pending_job_only_all_running_jobs_are_candidates() {
    // The same cluster, but c has one trainer running and one pending: no job has all
    // its pods pending, so c is not a candidate and nobody is scaled down for it:
    // 12 + 6 + 4 = 22 > 19.4, yet only a and b are considered and both go -1 once.
    let mut c = job("c", 2, 4, 2, cpu(2.0), false);
    c.pods.running = 1;
    c.pods.pending = 1;
    c.pods.unbound = 1;
    let snap = snapshot(
        vec![node(cpu(20.0), cpu(20.0))],
        cpu(2.0),
        vec![
            job("a", 1, 10, 6, cpu(2.0), false),
            job("b", 1, 5, 3, cpu(2.0), false),
            c,
        ],
    );
    let t = decide(&PaddleConfig::default(), &snap, 1);
    assert_eq!(
        changes(&snap, &t),
        vec![("a".to_owned(), 6, 5), ("b".to_owned(), 3, 2)]
    );
}

#[test]
fn ties_in_fulfillment_go_to_the_smaller_trainer_first() {
    // x (2 cores) and y (1 core) both at 1 of 1..3 (fulfillment 0). 10 cores, 7
    // requested: room 9.7 - 7 = 2.7. y sorts first (less CPU): +1 (8), x: 1.7 < 2 no;
    // next dry run y +1 (9), then y is at max.
    let x = job("x", 1, 3, 1, Resources::new(2.0, 4.0, 0), false);
    let y = job("y", 1, 3, 1, Resources::new(1.0, 8.0, 0), false);
    let snap = snapshot(
        vec![node(
            Resources::new(10.0, 64.0, 0),
            Resources::new(7.0, 12.0, 0),
        )],
        Resources::ZERO,
        vec![x, y],
    );
    let t = decide(&PaddleConfig::default(), &snap, 1);
    assert_eq!(changes(&snap, &t), vec![("y".to_owned(), 1, 3)]);
    // With x first (its trainer made smaller than y's), x takes the room instead.
    let mut snap2 = snap.clone();
    snap2.jobs[0].trainer = Resources::new(1.0, 4.0, 0);
    snap2.jobs[1].trainer = Resources::new(2.0, 8.0, 0);
    let t = decide(&PaddleConfig::default(), &snap2, 1);
    assert_eq!(changes(&snap2, &t), vec![("x".to_owned(), 1, 3)]);
}

#[test]
fn a_gpu_job_needs_a_free_gpu_and_the_published_thresholds_never_settle() {
    // 8 GPUs, 6 used by the job's trainers (1 GPU, 4 cores each).
    let gpu_trainer = Resources::new(4.0, 8.0, 1);
    let snap = snapshot(
        vec![node(
            Resources::new(64.0, 512.0, 8),
            Resources::new(24.0, 48.0, 6),
        )],
        Resources::ZERO,
        vec![job("g", 1, 16, 6, gpu_trainer, false)],
    );
    // Fixed: scale-ups stop at trunc(8 * 0.97) = 7 GPUs, like scale-downs.
    let (t, runs) = decide_counted(&PaddleConfig::default(), &snap, 1);
    assert_eq!(changes(&snap, &t), vec![("g".to_owned(), 6, 7)]);
    assert!(runs < 5, "{runs}");
    // As published: +1 to 8 GPUs, then -1 because 8 > 7, in every dry run, and the
    // node the +1 uses only gains idle CPU (the sign defect): no end.
    let published = PaddleConfig {
        defects: Defects::ALL,
        ..PaddleConfig::default()
    };
    let (t, runs) = decide_counted(&published, &snap, 1);
    assert_eq!(runs, MAX_DRY_RUNS);
    // With the sign fixed the node's idle CPU runs out after 10 rounds (40 idle cores,
    // 4 per +1; a -1 gives no node back), which ends the pass.
    let sign_fixed = PaddleConfig {
        defects: Defects {
            gpu_threshold: true,
            ..Defects::default()
        },
        ..PaddleConfig::default()
    };
    assert_eq!(decide_counted(&sign_fixed, &snap, 1).1, 11);
    assert_eq!(changes(&snap, &t), vec![("g".to_owned(), 6, 7)]);
    // No free GPU under the threshold (7 of 8 used): no scale-up however much CPU is
    // idle; one more (8 > 7) is an overload and the job goes -1.
    let mut full = snap.clone();
    full.nodes[0].requested.gpu = 7;
    let t = decide(&PaddleConfig::default(), &full, 1);
    assert!(t.is_empty(), "{t:?}");
    full.nodes[0].requested.gpu = 8;
    let t = decide(&PaddleConfig::default(), &full, 1);
    assert_eq!(changes(&full, &t), vec![("g".to_owned(), 6, 5)]);
}

#[test]
fn the_node_sign_defect_places_many_trainers_on_one_node() {
    // Trainers of 4 cores. Node 0 has 4 idle, nine nodes have 3 idle each: one trainer
    // fits. Cluster room: 77.6 - 49 = 28.6 cores, seven trainers.
    let big = Resources::new(8.0, 64.0, 0);
    let mut nodes = vec![node(big, cpu(4.0))];
    nodes.extend((0..9).map(|_| node(big, cpu(5.0))));
    let snap = snapshot(
        nodes,
        Resources::ZERO,
        vec![job("a", 1, 20, 1, cpu(4.0), false)],
    );
    let fixed = decide(&PaddleConfig::default(), &snap, 1);
    assert_eq!(changes(&snap, &fixed), vec![("a".to_owned(), 1, 2)]);
    let published = PaddleConfig {
        defects: Defects {
            node_sign: true,
            ..Defects::default()
        },
        ..PaddleConfig::default()
    };
    let buggy = decide(&published, &snap, 1);
    assert_eq!(changes(&snap, &buggy), vec![("a".to_owned(), 1, 8)]);
}

#[test]
fn write_back_answers_every_candidate_and_unordered_is_seeded() {
    let snap = snapshot(
        vec![node(cpu(100.0), cpu(4.0))],
        Resources::ZERO,
        vec![
            job("a", 1, 2, 2, cpu(2.0), false),
            job("b", 1, 2, 2, cpu(2.0), false),
        ],
    );
    let quiet = decide(&PaddleConfig::default(), &snap, 1);
    assert!(quiet.is_empty(), "{quiet:?}");
    let loud = PaddleConfig {
        defects: Defects::ALL,
        ..PaddleConfig::default()
    };
    let all = decide(&loud, &snap, 1);
    assert_eq!(all.len(), 2, "{all:?}");
    assert!(all.iter().all(|t| t.from == t.to));
    assert_eq!(decide(&loud, &snap, 7), decide(&loud, &snap, 7));
}
