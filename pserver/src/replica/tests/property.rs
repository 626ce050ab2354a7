//! The property test over random interleavings, its witness, and the shrunk
//! regressions it found.

use proptest::prelude::*;

use super::*;

/// One step of the property test; indices pick among the processes alive.
#[derive(Debug, Clone)]
enum Ev {
    Submit,
    Retry(u8),
    Deliver(u8),
    Watch(u8),
    WatchNewest(u8),
    AnswerLost(u8),
    Advance(u16),
    Kill(u8),
    KillPrimary,
    StopPrimary,
    Stop(u8),
    Resume(u8),
    Cut(u8, u8),
    CutEtcd(u8),
    Heal,
    Start,
    Restore(u8),
}

fn ev() -> impl Strategy<Value = Ev> {
    prop_oneof![
        16 => Just(Ev::Submit),
        2 => any::<u8>().prop_map(Ev::Retry),
        40 => any::<u8>().prop_map(Ev::Deliver),
        6 => any::<u8>().prop_map(Ev::Watch),
        2 => any::<u8>().prop_map(Ev::WatchNewest),
        1 => any::<u8>().prop_map(Ev::AnswerLost),
        6 => (0u16..1500).prop_map(Ev::Advance),
        1 => any::<u8>().prop_map(Ev::Kill),
        1 => Just(Ev::KillPrimary),
        1 => Just(Ev::StopPrimary),
        1 => any::<u8>().prop_map(Ev::Stop),
        2 => any::<u8>().prop_map(Ev::Resume),
        1 => (any::<u8>(), any::<u8>()).prop_map(|(a, b)| Ev::Cut(a, b)),
        1 => any::<u8>().prop_map(Ev::CutEtcd),
        1 => Just(Ev::Heal),
        4 => Just(Ev::Start),
        1 => any::<u8>().prop_map(Ev::Restore),
    ]
}

/// Plays `events` on a fresh group of `replicas` (one process more than needed), then
/// lets everything heal and checks that the group serves again.
fn play(replicas: usize, events: &[Ev]) -> World {
    let mut w = World::group(cfg(replicas), replicas + 1);
    let pick = |w: &World, k: u8| -> Option<MemberId> {
        let ids: Vec<&MemberId> = w.nodes.keys().collect();
        (!ids.is_empty()).then(|| ids[k as usize % ids.len()].clone())
    };
    for e in events {
        match e {
            Ev::Submit => {
                // Clients send to whoever they believe is primary: the record's.
                if let Some(r) = w.record() {
                    let p = r.primary.clone();
                    w.submit(&p);
                }
            }
            Ev::Retry(k) => {
                if let Some(r) = w.record() {
                    let p = r.primary.clone();
                    w.retry(&p, *k as usize);
                }
            }
            Ev::Deliver(k) => {
                // The next message of one connection with something in flight.
                let busy: Vec<(MemberId, MemberId)> = w
                    .net
                    .iter()
                    .filter(|(_, q)| !q.is_empty())
                    .map(|(c, _)| c.clone())
                    .collect();
                if !busy.is_empty() {
                    let (f, t) = busy[*k as usize % busy.len()].clone();
                    w.deliver(&f, &t);
                }
            }
            Ev::Watch(k) => {
                if let Some(id) = pick(&w, *k) {
                    w.watch(&id, false);
                }
            }
            Ev::WatchNewest(k) => {
                if let Some(id) = pick(&w, *k) {
                    w.watch_newest(&id);
                }
            }
            Ev::AnswerLost(k) => {
                if let Some(id) = pick(&w, *k) {
                    w.nodes.get_mut(&id).unwrap().answer_lost = true;
                }
            }
            Ev::Advance(ms) => w.advance(u64::from(*ms)),
            Ev::Kill(k) => {
                if let Some(id) = pick(&w, *k) {
                    w.kill(&id);
                }
            }
            Ev::KillPrimary | Ev::StopPrimary => {
                let p = w.record().map(|r| r.primary.clone());
                if let Some(p) = p
                    && w.nodes.contains_key(&p)
                {
                    if matches!(e, Ev::KillPrimary) {
                        w.kill(&p);
                    } else {
                        w.nodes.get_mut(&p).unwrap().stopped = true;
                    }
                }
            }
            Ev::Stop(k) => {
                if let Some(id) = pick(&w, *k) {
                    w.nodes.get_mut(&id).unwrap().stopped = true;
                }
            }
            Ev::Resume(k) => {
                if let Some(id) = pick(&w, *k) {
                    w.nodes.get_mut(&id).unwrap().stopped = false;
                }
            }
            Ev::Cut(a, b) => {
                if let (Some(f), Some(t)) = (pick(&w, *a), pick(&w, *b))
                    && f != t
                {
                    w.cut_pair(&f, &t);
                }
            }
            Ev::CutEtcd(k) => {
                if let Some(id) = pick(&w, *k) {
                    w.nodes.get_mut(&id).unwrap().etcd_cut = true;
                }
            }
            Ev::Heal => {
                w.cut.clear();
                for n in w.nodes.values_mut() {
                    n.etcd_cut = false;
                }
            }
            Ev::Start => {
                if w.nodes.len() < 6 {
                    w.start();
                }
            }
            Ev::Restore(k) => {
                if let Some(id) = pick(&w, *k) {
                    w.restore(&id);
                }
            }
        }
    }
    w.settle();
    // The final primary holds every op acknowledged in its incarnation.
    let r = w.record().unwrap().clone();
    let held: BTreeSet<u64> = w.nodes[&r.primary].data.iter().copied().collect();
    for op in w.acked.get(&r.incarnation).into_iter().flatten() {
        assert!(
            held.contains(op),
            "the final primary lacks acknowledged op {op}"
        );
    }
    w
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn acknowledged_ops_survive_any_interleaving_of_faults(
        replicas in 2usize..4,
        events in prop::collection::vec(ev(), 0..400),
    ) {
        play(replicas, &events);
    }
}

/// The random runs reach the states where the invariants could fail: promotions,
/// snapshots to joiners and diverged backups, restores, and acknowledgements across
/// them.
#[test]
fn random_runs_reach_promotions_snapshots_and_restores() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]),
    );
    let strategy = prop::collection::vec(ev(), 300..400);
    let (mut promotions, mut restores, mut installs, mut acks) = (0, 0, 0, 0);
    for i in 0..100 {
        let events = strategy.new_tree(&mut runner).unwrap().current();
        let w = play(2 + i % 2, &events);
        promotions += w.promotions;
        restores += w.restores;
        installs += w.installs;
        acks += w.acks;
    }
    assert!(promotions >= 20, "promotions: {promotions}");
    assert!(restores >= 10, "restores: {restores}");
    assert!(installs >= 100, "snapshots installed: {installs}");
    assert!(acks >= 1_000, "acknowledgements: {acks}");
}

/// Regressions the property test found, replayed as they were shrunk.
#[test]
fn shrunk_regressions_hold() {
    use Ev::*;
    // A restore refused by its guard left its proposal pending for ever.
    play(3, &[Kill(0), Kill(0), Restore(43), Kill(224)]);
    // A dead primary whose only backup was waiting for a snapshot: the backup holds every
    // op acknowledged and is promoted from its own state.
    play(
        3,
        &[
            Submit,
            StopPrimary,
            Start,
            Advance(281),
            Advance(458),
            Deliver(105),
            Start,
            Advance(909),
            KillPrimary,
            Advance(1352),
            Submit,
            Watch(40),
            Kill(215),
        ],
    );
    // A compare-and-swap landed but its answer was lost; its resend, refused because the
    // record moved on, must not settle the proposal as not landed (the primary then
    // acknowledged without the joiner it had just put in sync).
    play(
        3,
        &[
            Kill(0),
            Kill(0),
            CutEtcd(65),
            Advance(785),
            Heal,
            Submit,
            Submit,
            Start,
            Kill(15),
            Start,
            Start,
            Start,
            Advance(306),
            WatchNewest(12),
            Start,
            Advance(1461),
            Advance(570),
            Advance(663),
            Restore(128),
            Advance(889),
            Advance(1424),
            Advance(976),
            Advance(711),
            Restore(33),
            Submit,
            AnswerLost(68),
            Deliver(0),
            Deliver(0),
            Deliver(0),
            Submit,
        ],
    );
    // A confirmation sent before a backup was removed (and its copy discarded) arrived
    // after it was added again: it must not count.
    play(
        3,
        &[
            KillPrimary,
            Start,
            Advance(126),
            Advance(687),
            Advance(1328),
            Advance(859),
            Start,
            Start,
            Stop(3),
            Watch(247),
            Kill(189),
            Watch(27),
            Start,
            Advance(19),
            Advance(161),
            Advance(1358),
            Advance(1057),
            Advance(1405),
            Watch(128),
            Deliver(0),
            Deliver(0),
            Deliver(0),
            Kill(151),
        ],
    );
}
