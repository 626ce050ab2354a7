//! Unit tests of the queue's transitions and the property test of its invariants (any
//! event sequence, with restores from what was made durable in between).

use super::*;
use edl_master_api::Release;
use proptest::prelude::*;
use std::collections::BTreeMap;

pub(crate) fn specs(n: u32) -> Vec<TaskSpec> {
    (0..n)
        .map(|i| TaskSpec {
            id: TaskSpec::make_id(i / 4, i % 4, i % 4 + 1),
            file: i / 4,
            chunk_begin: i % 4,
            chunk_end: i % 4 + 1,
            records: 10 + u64::from(i),
            offset_begin: 0,
            offset_end: 0,
        })
        .collect()
}

pub(crate) fn cfg(passes: u32, max_failures: u32) -> QueueConfig {
    QueueConfig {
        passes,
        max_failures,
        max_losses: max_failures,
        ..QueueConfig::default()
    }
}

/// A drain's hand-back of `trained` records without a resume point.
pub(crate) fn drained(trained: u64) -> Release {
    Release::Drained {
        trained,
        resume: None,
    }
}

/// A drain's hand-back after this attempt's `trained` records, the task's first
/// `batch` batches (`records` records) applied, answered by `answered`.
fn drained_at(trained: u64, batch: u32, records: u64, answered: Vec<u64>) -> Release {
    Release::Drained {
        trained,
        resume: Some(edl_master_api::Resume {
            batch,
            records,
            answered,
        }),
    }
}

pub(crate) fn take(q: &mut Queue, trainer: &str, now: Millis) -> Task {
    let pass = q.pass();
    match q.get_task(trainer, pass, 0, now) {
        GetTask::Task(t) => t,
        other => panic!("expected a task, got {other:?}"),
    }
}

#[test]
fn one_pass_dispatches_every_task_once_then_finishes() {
    let mut q = Queue::new(cfg(1, 3), specs(5));
    let mut seen = BTreeSet::new();
    for n in 0..5 {
        let t = take(&mut q, "a", n);
        assert_eq!(t.generation, 1);
        assert!(seen.insert(t.spec.id.clone()));
    }
    assert_eq!(q.get_task("a", 0, 0, 10), GetTask::Wait);
    for id in seen.clone() {
        assert_eq!(q.finished(&id, 1, 7, &[], 20), Ok(Ack::Applied));
    }
    assert!(q.is_finished());
    assert_eq!(q.get_task("a", 0, 0, 30), GetTask::JobFinished);
    assert_eq!(q.meta().counters.records_trained, 35);
    assert_eq!(q.meta().counters.passes_completed, 1);
}

#[test]
fn lost_trainers_do_not_use_up_a_tasks_failure_budget() {
    let mut q = Queue::new(
        QueueConfig {
            max_losses: 4,
            ..cfg(1, 1)
        },
        specs(1),
    );
    // Four holders die with it: still retried (failures stay 0).
    for n in 0..4 {
        let t = take(&mut q, &format!("t{n}"), 0);
        q.trainer_lost(&format!("t{n}"));
        assert_eq!(q.tasks[0].failures, 0);
        assert_eq!(q.tasks[0].losses, n + 1);
        assert!(matches!(q.tasks[0].state, TaskState::Todo), "{t:?}");
    }
    // The fifth loss exceeds max_losses: a task that kills every trainer is stopped.
    take(&mut q, "t4", 0);
    q.trainer_lost("t4");
    assert!(matches!(q.tasks[0].state, TaskState::Failed));
    assert!(q.is_finished());
}

#[test]
fn passes_advance_and_old_pass_requests_are_told() {
    let mut q = Queue::new(cfg(2, 3), specs(2));
    let a = take(&mut q, "a", 0);
    let b = take(&mut q, "b", 0);
    q.finished(&a.spec.id, a.generation, 1, &[], 1).unwrap();
    q.finished(&b.spec.id, b.generation, 1, &[], 1).unwrap();
    assert_eq!(q.pass(), 1);
    assert_eq!(
        q.get_task("a", 0, 0, 2),
        GetTask::PassFinished { next_pass: 1 }
    );
    let a2 = take(&mut q, "a", 3);
    assert_eq!(a2.pass, 1);
    assert_eq!(a2.generation, 2);
    // A retried completion of pass 0 is recognised as already applied.
    assert_eq!(
        q.finished(&b.spec.id, b.generation, 1, &[], 4),
        Ok(Ack::AlreadyApplied)
    );
}

#[test]
fn stale_finish_after_redispatch_is_rejected_and_counted() {
    let mut q = Queue::new(cfg(1, 3), specs(1));
    let t = take(&mut q, "a", 0);
    assert_eq!(q.trainer_lost("a"), vec![t.spec.id.clone()]);
    let t2 = take(&mut q, "b", 1);
    assert!(t2.generation > t.generation);
    let before = q.task(&t.spec.id).cloned();
    assert!(matches!(
        q.finished(&t.spec.id, t.generation, 10, &[], 2),
        Err(Reject::Stale { .. })
    ));
    assert_eq!(q.task(&t.spec.id).cloned(), before);
    assert_eq!(q.meta().counters.stale_rejected, 1);
    assert_eq!(
        q.finished(&t2.spec.id, t2.generation, 10, &[], 3),
        Ok(Ack::Applied)
    );
    assert_eq!(q.meta().counters.cutoff_records, 10);
    assert!(q.is_finished());
}

#[test]
fn a_task_failing_past_max_failures_fails_and_the_pass_still_ends() {
    let mut q = Queue::new(cfg(2, 2), specs(2));
    let good = take(&mut q, "a", 0);
    q.finished(&good.spec.id, good.generation, 1, &[], 1)
        .unwrap();
    for attempt in 0..3 {
        let t = take(&mut q, "a", 2);
        assert_eq!(t.failures, attempt);
        q.failed(&t.spec.id, t.generation, "corrupt chunk in f.recordio", 0)
            .unwrap();
    }
    // Third failure > max_failures = 2: failed for good, pass 0 over.
    assert_eq!(q.pass(), 1);
    let m = q.meta();
    assert_eq!(m.counters.failed_tasks, 1);
    assert_eq!(m.failed.len(), 1);
    assert_eq!(m.failed[0].reason, "corrupt chunk in f.recordio");
    assert_eq!(m.failed[0].pass, 0);
    assert_eq!(m.counters.lost_records, 11);
    // Next pass retries it from scratch.
    assert_eq!(q.counts().todo, 2);
}

#[test]
fn release_is_not_a_failure_and_goes_first() {
    let mut q = Queue::new(cfg(1, 0), specs(3));
    let t = take(&mut q, "a", 0);
    assert_eq!(
        q.released(&t.spec.id, t.generation, &drained(4)),
        Ok(Ack::Applied)
    );
    let again = take(&mut q, "b", 1);
    assert_eq!(again.spec.id, t.spec.id);
    assert_eq!(again.failures, 0);
    assert_eq!(q.meta().counters.released, 1);
    assert_eq!(q.meta().counters.duplicate_records, 4);
    assert_eq!(q.meta().counters.failures, 0);
}

/// A drain that says which batches it applied: the next attempt resumes after them,
/// through further drains and a lost holder, and their records are trained once (not
/// duplicates). A hand-back saying less than the task's resume point, or nothing (a
/// read-ahead task), keeps it; the task's end and a recompute (a shard's restore) drop it.
#[test]
fn a_drain_with_its_applied_batches_is_resumed_after_them() {
    let mut q = Queue::new(cfg(2, 5), specs(2));
    let t = take(&mut q, "a", 0);
    assert_eq!(t.resume, None);
    // 10 records: batches of 3, the first two (6 records) applied.
    let r = q.released(&t.spec.id, t.generation, &drained_at(6, 2, 6, vec![3, 0]));
    assert_eq!(r, Ok(Ack::Applied));
    let again = take(&mut q, "b", 1);
    assert_eq!(again.spec.id, t.spec.id, "handed back first");
    let at = |b: u32, r: u64, a: Vec<u64>| {
        Some(Box::new(Resume {
            batch: b,
            records: r,
            answered: a,
        }))
    };
    assert_eq!(again.resume, at(2, 6, vec![3, 0]));
    let c = &q.meta().counters;
    assert_eq!((c.released, c.resumed, c.resumed_records), (1, 1, 6));
    assert_eq!((c.records_trained, c.duplicate_records), (6, 0));
    // b trains one batch more and drains; then c is lost holding it: the point stands.
    let r = q.released(
        &again.spec.id,
        again.generation,
        &drained_at(3, 3, 9, vec![3, 4]),
    );
    assert_eq!(r, Ok(Ack::Applied));
    let third = take(&mut q, "c", 2);
    assert_eq!(third.resume, at(3, 9, vec![3, 4]));
    assert_eq!(q.trainer_lost("c"), vec![third.spec.id.clone()]);
    // (A lost holder's task goes to the back: the other task is dispatched first.)
    let other = take(&mut q, "d", 3);
    assert_ne!(other.spec.id, third.spec.id);
    assert_eq!(
        q.finished(&other.spec.id, other.generation, 11, &[], 3),
        Ok(Ack::Applied)
    );
    let fourth = take(&mut q, "d", 3);
    assert_eq!(fourth.spec.id, third.spec.id);
    assert_eq!(fourth.resume, at(3, 9, vec![3, 4]));
    // A hand-back claiming less than it was given keeps the point, and its records
    // are duplicates; one without a point (a read-ahead task) keeps it too.
    let r = q.released(
        &fourth.spec.id,
        fourth.generation,
        &drained_at(1, 2, 6, vec![]),
    );
    assert_eq!(r, Ok(Ack::Applied));
    let fifth = take(&mut q, "e", 4);
    assert_eq!(fifth.resume, at(3, 9, vec![3, 4]));
    let r = q.released(&fifth.spec.id, fifth.generation, &drained(0));
    assert_eq!(r, Ok(Ack::Applied));
    let sixth = take(&mut q, "f", 5);
    assert_eq!(sixth.resume, at(3, 9, vec![3, 4]));
    assert_eq!(q.meta().counters.duplicate_records, 1);
    // The last record is trained and the task is done: the point goes with it.
    assert_eq!(
        q.finished(&sixth.spec.id, sixth.generation, 1, &[3, 4], 6),
        Ok(Ack::Applied)
    );
    assert_eq!(q.tasks[q.index[&sixth.spec.id]].resume, None);
    // Its records are trained once: 6 + 3 (resumed), 1 (finished); the other's 11.
    assert_eq!(q.meta().counters.records_trained, 6 + 3 + 1 + 11);
    // In the next pass, a task drained with a point, then trained again whole after a
    // shard's restore (a holder's recompute): the point is dropped.
    assert_eq!(q.pass(), 1);
    let other = take(&mut q, "a", 7);
    let r = q.released(
        &other.spec.id,
        other.generation,
        &drained_at(3, 1, 3, vec![3, 4]),
    );
    assert_eq!(r, Ok(Ack::Applied));
    let other = take(&mut q, "b", 8);
    assert!(other.resume.is_some());
    let how = Release::Recompute { trained: 11 };
    assert_eq!(
        q.released(&other.spec.id, other.generation, &how),
        Ok(Ack::Applied)
    );
    let whole = take(&mut q, "b", 9);
    assert_eq!(whole.resume, None, "rewound: trained again whole");
    // Both tasks drained with points: each stands until its task is done.
    let second = take(&mut q, "d", 10);
    assert_ne!(second.spec.id, whole.spec.id);
    for t in [&whole, &second] {
        let r = q.released(&t.spec.id, t.generation, &drained_at(3, 1, 3, vec![]));
        assert_eq!(r, Ok(Ack::Applied));
    }
    assert_eq!(q.tasks.iter().filter(|t| t.resume.is_some()).count(), 2);
    // One done: its point goes, the other's stands.
    let next = take(&mut q, "c", 11);
    assert!(next.resume.is_some());
    assert_eq!(
        q.finished(&next.spec.id, next.generation, 8, &[], 11),
        Ok(Ack::Applied)
    );
    assert_eq!(q.tasks.iter().filter(|t| t.resume.is_some()).count(), 1);
}

#[test]
fn timeouts_requeue_and_adapt_to_task_durations() {
    let mut policy = TimeoutPolicy {
        initial: 60_000,
        floor: 1_000,
        ..TimeoutPolicy::default()
    };
    policy.min_samples = 3;
    let mut q = Queue::new(
        QueueConfig {
            passes: 1,
            max_failures: 5,
            max_losses: 5,
            timeout: policy,
        },
        specs(8),
    );
    assert_eq!(q.timeout(), 60_000);
    for k in 0..4u64 {
        let t = take(&mut q, "a", k * 1000);
        q.finished(&t.spec.id, t.generation, 1, &[], k * 1000 + 500)
            .unwrap();
    }
    // p95 of 500 ms durations x4 = 2 s.
    assert_eq!(q.timeout(), 2_000);
    let t = take(&mut q, "hung", 10_000);
    assert_eq!(q.next_deadline(), Some(12_000));
    assert!(q.tick(11_999).is_empty());
    assert_eq!(
        q.tick(12_000),
        vec![Expired {
            task: t.spec.id.clone(),
            trainer: "hung".into(),
            held_ms: 2_000
        }]
    );
    assert_eq!(q.meta().counters.timeouts, 1);
    assert!(matches!(
        q.finished(&t.spec.id, t.generation, 1, &[], 12_001),
        Err(Reject::Stale { .. })
    ));
}

#[test]
fn restore_rebuilds_the_same_queue_and_rearms_leases() {
    let mut q = Queue::new(cfg(3, 3), specs(4));
    let mut store: BTreeMap<String, Task> = BTreeMap::new();
    let mut meta = Meta::default();
    let mut persist = |q: &mut Queue| {
        let c = q.take_changes();
        for t in c.tasks {
            store.insert(t.spec.id.clone(), t);
        }
        if let Some(m) = c.meta {
            meta = m;
        }
        (store.values().cloned().collect::<Vec<_>>(), meta.clone())
    };
    for _ in 0..4 {
        let t = take(&mut q, "a", 0);
        q.finished(&t.spec.id, t.generation, 1, &[], 5).unwrap();
    }
    let held = take(&mut q, "b", 6);
    let (tasks, m) = persist(&mut q);
    let r = Queue::restore(cfg(3, 3), m, tasks, Vec::new(), 1_000);
    assert_eq!(r.pass(), 1);
    assert_eq!(r.counts(), q.counts());
    match &r.task(&held.spec.id).unwrap().state {
        TaskState::Pending {
            trainer, deadline, ..
        } => {
            assert_eq!(trainer, "b");
            assert_eq!(*deadline, 1_000 + r.timeout());
        }
        s => panic!("expected pending, got {s:?}"),
    }
    assert_eq!(r.meta().counters.restores, 1);
}

#[test]
fn a_retried_get_task_returns_the_same_lease() {
    let mut q = Queue::new(cfg(1, 3), specs(3));
    let GetTask::Task(a) = q.get_task("a", 0, 7, 0) else {
        panic!("expected a task")
    };
    assert_eq!(q.get_task("a", 0, 7, 1), GetTask::Task(a.clone()));
    assert_eq!(q.meta().counters.dispatched, 1);
    // Another request number, or another trainer, gets another task.
    let GetTask::Task(b) = q.get_task("a", 0, 8, 2) else {
        panic!("expected a task")
    };
    assert_ne!(a.spec.id, b.spec.id);
    let GetTask::Task(c) = q.get_task("b", 0, 7, 3) else {
        panic!("expected a task")
    };
    assert_ne!(c.spec.id, a.spec.id);
}

#[test]
fn empty_dataset_finishes_at_once() {
    let mut q = Queue::new(cfg(3, 3), vec![]);
    assert!(q.is_finished());
    assert_eq!(q.get_task("a", 0, 0, 0), GetTask::JobFinished);
}

/// Events of the property test.
#[derive(Clone, Debug)]
enum Ev {
    Get(u8, u64),
    Finish(u8, bool),
    Fail(u8, bool),
    /// A drain's hand-back, with a resume point after this many batches (of 3).
    Release(u8, bool, Option<u8>),
    Lost(u8),
    /// A trainer waiting on a pserver keeps its leases.
    Keep(u8),
    Tick(u16),
    Restore,
}

fn ev() -> impl Strategy<Value = Ev> {
    prop_oneof![
        4 => (0u8..4, 0u64..4).prop_map(|(t, r)| Ev::Get(t, r)),
        4 => (any::<u8>(), any::<bool>()).prop_map(|(i, s)| Ev::Finish(i, s)),
        1 => (any::<u8>(), any::<bool>()).prop_map(|(i, s)| Ev::Fail(i, s)),
        1 => (any::<u8>(), any::<bool>(), prop::option::of(1u8..5))
            .prop_map(|(i, s, b)| Ev::Release(i, s, b)),
        1 => (0u8..4).prop_map(Ev::Lost),
        1 => (0u8..4).prop_map(Ev::Keep),
        1 => (0u16..2000).prop_map(Ev::Tick),
        1 => Just(Ev::Restore),
    ]
}

/// The indexes agree with the tasks and every task is in exactly one state.
pub(crate) fn check_invariants(q: &Queue) {
    let todo: BTreeSet<usize> = q.todo.iter().copied().collect();
    assert_eq!(todo.len(), q.todo.len(), "a task is twice in todo");
    for (i, t) in q.tasks.iter().enumerate() {
        let in_todo = todo.contains(&i);
        let in_pending = q.pending.contains(&i);
        match &t.state {
            TaskState::Todo => assert!(in_todo && !in_pending),
            TaskState::Pending { trainer, .. } => {
                assert!(!in_todo && in_pending);
                assert!(q.by_trainer[trainer].contains(&i));
            }
            TaskState::Done | TaskState::Failed => assert!(!in_todo && !in_pending),
        }
        if let Some(r) = &t.resume {
            assert!(
                !matches!(t.state, TaskState::Done),
                "a done task keeps no resume point"
            );
            assert!(r.batch > 0 && r.records <= t.spec.records, "{r:?} of {t:?}");
        }
        assert_eq!(t.pass, q.meta.pass, "every task is in the current pass");
    }
    let held: usize = q.by_trainer.values().map(BTreeSet::len).sum();
    assert_eq!(held, q.pending.len());
    assert!(q.by_trainer.values().all(|s| !s.is_empty()));
    if !q.meta.finished {
        assert!(
            !q.todo.is_empty() || !q.pending.is_empty(),
            "a pass with nothing todo or pending must have ended"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn invariants_hold_under_any_event_sequence(
        n in 0u32..12,
        passes in 1u32..4,
        max_failures in 0u32..3,
        events in prop::collection::vec(ev(), 0..300),
    ) {
        let config = cfg(passes, max_failures);
        let mut q = Queue::new(config.clone(), specs(n));
        let mut store: BTreeMap<String, Task> = BTreeMap::new();
        let mut meta = Meta::default();
        let mut failed: BTreeMap<u32, edl_job::FailedRecord> = BTreeMap::new();
        let mut now: Millis = 0;
        let mut leases: Vec<Task> = Vec::new();
        let mut generations: HashMap<String, u64> = HashMap::new();
        // Per (task, pass): the generations of its leases seen.
        let mut leased: HashMap<(String, u32), BTreeSet<u64>> = HashMap::new();
        let mut passes_seen = 0;
        // The service makes the fresh queue durable before it serves.
        let c = q.take_changes();
        for t in c.tasks {
            store.insert(t.spec.id.clone(), t);
        }
        meta = c.meta.unwrap_or(meta);
        for e in events {
            now += 7;
            let before = q.clone();
            match e {
                Ev::Get(tr, request) => {
                    let pass = q.pass();
                    if let GetTask::Task(t) = q.get_task(&format!("t{tr}"), pass, request, now) {
                        // Only a task's first lease in its pass is a first dispatch (a
                        // retried request gets the same lease again).
                        let seen = leased.entry((t.spec.id.clone(), t.pass)).or_default();
                        if !seen.contains(&t.generation) {
                            prop_assert_eq!(t.dispatches == 1, seen.is_empty(), "{:?}", t);
                            prop_assert_eq!(t.dispatches as usize, seen.len() + 1);
                            seen.insert(t.generation);
                        }
                        leases.push(t);
                    }
                }
                Ev::Finish(k, stale) | Ev::Fail(k, stale) | Ev::Release(k, stale, _)
                    if !leases.is_empty() =>
                {
                    let t = leases[k as usize % leases.len()].clone();
                    let generation = if stale { t.generation.saturating_sub(1) } else { t.generation };
                    let r = match e {
                        Ev::Finish(..) => q.finished(&t.spec.id, generation, t.spec.records, &[], now),
                        Ev::Fail(..) => q.failed(&t.spec.id, generation, "boom", 1),
                        Ev::Release(_, _, Some(b)) => {
                            let records = (u64::from(b) * 3).min(t.spec.records);
                            q.released(&t.spec.id, generation, &drained_at(1, b.into(), records, vec![]))
                        }
                        _ => q.released(&t.spec.id, generation, &drained(1)),
                    };
                    if let Err(Reject::Stale { .. }) = r {
                        // A stale report changes nothing but the counter.
                        let mut expect = before.clone();
                        expect.meta.counters.stale_rejected += 1;
                        prop_assert_eq!(&q.tasks, &expect.tasks);
                        prop_assert_eq!(&q.meta, &expect.meta);
                    }
                }
                Ev::Finish(..) | Ev::Fail(..) | Ev::Release(..) => {}
                Ev::Lost(tr) => {
                    q.trainer_lost(&format!("t{tr}"));
                }
                Ev::Keep(tr) => {
                    let trainer = format!("t{tr}");
                    let until = now + q.timeout();
                    let kept = q.keep(&trainer, now);
                    // Only the trainer's own deadlines move, never earlier, and there
                    // is nothing to make durable.
                    let mut held = 0;
                    for (t, b) in q.tasks.iter().zip(&before.tasks) {
                        match (&t.state, &b.state) {
                            (
                                TaskState::Pending { trainer: h, deadline, .. },
                                TaskState::Pending { deadline: was, .. },
                            ) if *h == trainer => {
                                held += 1;
                                prop_assert_eq!(*deadline, (*was).max(until));
                            }
                            _ => prop_assert_eq!(t, b),
                        }
                    }
                    prop_assert_eq!(kept, held);
                    prop_assert_eq!(&q.meta, &before.meta);
                    prop_assert!(q.take_changes().is_empty());
                }
                Ev::Tick(d) => {
                    now += u64::from(d) * 1000;
                    q.tick(now);
                }
                Ev::Restore => {
                    q = Queue::restore(
                        config.clone(),
                        meta.clone(),
                        store.values().cloned().collect(),
                        failed.values().cloned().collect(),
                        now,
                    );
                    // Restoring only bumps the restore counter.
                    let mut expect = before.meta.clone();
                    expect.counters.restores += 1;
                    prop_assert_eq!(&q.meta, &expect);
                    for t in &before.tasks {
                        let r = q.task(&t.spec.id).unwrap();
                        prop_assert_eq!(r.generation, t.generation);
                        prop_assert_eq!(&r.resume, &t.resume, "a resume point is durable");
                        prop_assert_eq!(
                            std::mem::discriminant(&r.state),
                            std::mem::discriminant(&t.state)
                        );
                    }
                }
            }
            check_invariants(&q);
            prop_assert!(q.pass() >= before.pass());
            prop_assert!(q.pass() < passes);
            for t in &q.tasks {
                let g = generations.entry(t.spec.id.clone()).or_default();
                prop_assert!(t.generation >= *g, "generation went down");
                *g = t.generation;
            }
            passes_seen = passes_seen.max(q.meta.counters.passes_completed);
            let c = q.take_changes();
            for t in c.tasks {
                store.insert(t.spec.id.clone(), t);
            }
            if let Some(m) = c.meta {
                meta = m;
            }
            for f in c.failed {
                failed.insert(f.pass, f);
            }
        }
        // Drive the job to the end: it always finishes.
        let mut guard = 0;
        while !q.is_finished() {
            guard += 1;
            prop_assert!(guard < 10_000, "job did not finish");
            now += 1;
            q.tick(now + 10_000_000);
            let pass = q.pass();
            if let GetTask::Task(t) = q.get_task("drain", pass, 0, now) {
                q.finished(&t.spec.id, t.generation, t.spec.records, &[], now).unwrap();
            }
            check_invariants(&q);
        }
        prop_assert_eq!(q.meta.counters.passes_completed, u64::from(passes));
        prop_assert!(passes_seen <= u64::from(passes));
    }
}
