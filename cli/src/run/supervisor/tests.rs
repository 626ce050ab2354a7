use super::*;

fn limits() -> Limits {
    Limits {
        masters: 1,
        pservers: 2,
        trainers: 2,
        min_trainers: 1,
        max_trainers: 4,
        max_restarts: 2,
        healthy_after: 30 * SECOND,
        lease_ttl: Duration::from_secs(2),
        register_within: 60 * SECOND,
        notice_deadline: 5 * SECOND,
    }
}

fn started() -> (Supervisor, Instant, Vec<Effect>) {
    let t0 = Instant::now();
    let mut sup = Supervisor::new(limits(), PathBuf::from("/run/logs"), t0);
    let effects = sup.start(t0);
    (sup, t0, effects)
}

fn spawned(effects: &[Effect]) -> Vec<String> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Spawn { name, .. } => Some(name.clone()),
            _ => None,
        })
        .collect()
}

fn id_of(sup: &Supervisor, name: &str) -> ProcId {
    sup.procs
        .iter()
        .find(|(_, p)| p.name == name)
        .map(|(&id, _)| id)
        .unwrap_or_else(|| panic!("no process {name}"))
}

const SECOND: Duration = Duration::from_secs(1);

#[test]
fn start_spawns_masters_pservers_then_trainers() {
    let (_, _, effects) = started();
    assert_eq!(
        spawned(&effects),
        [
            "master-0",
            "pserver-0",
            "pserver-1",
            "trainer-0",
            "trainer-1"
        ]
    );
}

#[test]
fn a_crash_is_restarted_after_a_doubling_backoff() {
    let (mut sup, t0, _) = started();
    let ps = id_of(&sup, "pserver-1");
    assert!(!sup.exit_needs_job_status(ps, false));
    let crash = sup.exited(ps, false, "exit status: 1", false, t0).unwrap();
    assert_eq!(
        crash,
        Some(Crash {
            role: Role::Pserver,
            slot: 1,
            process: "pserver-1".into(),
            healthy: false,
        })
    );
    assert_eq!(sup.restarts(), 1);
    assert_eq!(sup.preemptions(), 0);
    // Its recovery is the shell's to measure (until the shard is served again).
    assert!(sup.recoveries().is_empty());
    // Not before the backoff (1 s for the first restart of the slot).
    assert!(sup.tick(t0 + SECOND / 2, false).is_empty());
    let e = sup.tick(t0 + SECOND, false);
    assert!(
        matches!(&e[..], [Effect::Spawn { role: Role::Pserver, slot: 1, name, .. }] if name == "pserver-1"),
        "{e:?}"
    );
    // The second crash of the same slot waits twice as long (2 s).
    let ps = id_of(&sup, "pserver-1");
    sup.exited(ps, false, "exit status: 1", false, t0 + 2 * SECOND)
        .unwrap();
    assert!(sup.tick(t0 + 3 * SECOND + SECOND / 2, false).is_empty());
    assert_eq!(spawned(&sup.tick(t0 + 4 * SECOND, false)), ["pserver-1"]);
}

#[test]
fn trainer_names_tell_their_slot_and_generation() {
    for (slot, generation) in [(0, 0), (3, 0), (1, 1), (12, 40)] {
        let name = trainer_name(slot, generation);
        assert_eq!(trainer_slot(&name), Some((slot, generation)), "{name}");
    }
    assert_eq!(trainer_name(2, 0), "trainer-2");
    assert_eq!(trainer_name(2, 5), "trainer-2.5");
    for other in [
        "pserver-1",
        "trainer-",
        "trainer-x",
        "trainer-1.",
        "trainer-1.y",
    ] {
        assert_eq!(trainer_slot(other), None, "{other}");
    }
}

#[test]
fn backoff_is_capped() {
    assert_eq!(backoff(1), SECOND);
    assert_eq!(backoff(4), 8 * SECOND);
    assert_eq!(backoff(5), 10 * SECOND);
    assert_eq!(backoff(40), 10 * SECOND);
}

/// Lets process `name` run from `from` for `ran`, then exit with `status`; returns
/// what the supervisor made of the exit, and the exit time.
fn exit_after(
    sup: &mut Supervisor,
    name: &str,
    from: Instant,
    ran: Duration,
    status: &str,
) -> (anyhow::Result<Option<Crash>>, Instant) {
    let id = id_of(sup, name);
    assert_eq!(sup.procs[&id].spawned, from, "{name} was spawned then");
    let at = from + ran;
    (sup.exited(id, false, status, false, at), at)
}

#[test]
fn healthy_processes_preempted_again_and_again_never_fail_the_job() {
    let (mut sup, t0, _) = started();
    let mut now = t0;
    for round in 1..=30u32 {
        // Every process of the job runs past healthy_after, then is preempted.
        for (name, role) in [
            ("master-0", Role::Master),
            ("pserver-1", Role::Pserver),
            ("trainer-0", Role::Trainer),
        ] {
            let name = match (role, round) {
                (Role::Trainer, 1) => name.to_owned(),
                (Role::Trainer, n) => format!("{name}.{}", n - 1),
                _ => name.to_owned(),
            };
            let (crash, _) = exit_after(&mut sup, &name, now, 31 * SECOND, "signal: 9 (SIGKILL)");
            let crash = crash.unwrap_or_else(|e| panic!("round {round}: {e:#}"));
            assert!(crash.is_some_and(|c| c.healthy && c.process == name));
        }
        now += 31 * SECOND;
        // Restarted at once: no backoff, however many came before.
        let respawned = spawned(&sup.tick(now, false));
        assert_eq!(
            respawned,
            ["master-0", "pserver-1", &format!("trainer-0.{round}")],
            "round {round}"
        );
    }
    assert_eq!(sup.restarts(), 90);
    assert_eq!(sup.preemptions(), 90);
    assert!(sup.restart_queue.is_empty());
}

#[test]
fn a_crash_loop_fails_the_job_once_its_slot_spent_the_budget() {
    let (mut sup, t0, _) = started();
    let fast = SECOND / 5;
    // trainer-1 fails right after every start: restarted after 1 s, then 2 s.
    let (crash, at) = exit_after(&mut sup, "trainer-1", t0, fast, "exit status: 2");
    assert!(crash.unwrap().is_some_and(|c| !c.healthy));
    assert!(sup.tick(at + SECOND - fast, false).is_empty());
    assert_eq!(spawned(&sup.tick(at + SECOND, false)), ["trainer-1.1"]);
    let (crash, at) = exit_after(&mut sup, "trainer-1.1", at + SECOND, fast, "exit status: 2");
    assert!(crash.unwrap().is_some());
    assert!(sup.tick(at + 2 * SECOND - fast, false).is_empty());
    assert_eq!(spawned(&sup.tick(at + 2 * SECOND, false)), ["trainer-1.2"]);
    assert_eq!(sup.restarts(), 2);
    // The third fast failure in a row is more than max_restarts (2): the job fails,
    // naming the process, why, and its log.
    let (crash, _) = exit_after(
        &mut sup,
        "trainer-1.2",
        at + 2 * SECOND,
        fast,
        "exit status: 2",
    );
    let err = format!("{:#}", crash.unwrap_err());
    assert!(err.starts_with("trainer-1.2 is in a crash loop"), "{err}");
    assert!(
        err.contains("it exited (exit status: 2) 0.2s after it started"),
        "{err}"
    );
    assert!(
        err.contains("failed 3 times in a row within cluster.healthy_after (30s)"),
        "{err}"
    );
    assert!(err.contains("cluster.max_restarts (2)"), "{err}");
    assert!(
        err.ends_with("the cause is in /run/logs/trainer-1.2.log"),
        "{err}"
    );
    assert_eq!(sup.restarts(), 2, "the failing exit is not restarted");
}

#[test]
fn fast_failures_of_different_slots_do_not_add_up() {
    let (mut sup, t0, _) = started();
    // One fast failure of every slot: five in all, the budget being 2 per slot.
    for name in [
        "master-0",
        "pserver-0",
        "pserver-1",
        "trainer-0",
        "trainer-1",
    ] {
        let (crash, _) = exit_after(&mut sup, name, t0, SECOND, "exit status: 1");
        assert!(crash.unwrap().is_some_and(|c| !c.healthy), "{name}");
    }
    assert_eq!(sup.restarts(), 5);
    assert_eq!(sup.preemptions(), 0);
    // Each waits the first backoff only (1 s after its exit).
    assert!(sup.tick(t0 + 2 * SECOND - SECOND / 10, false).is_empty());
    assert_eq!(sup.tick(t0 + 2 * SECOND, false).len(), 5);
}

#[test]
fn a_healthy_run_resets_the_backoff_and_the_budget_of_its_slot() {
    let (mut sup, t0, _) = started();
    // Two fast failures of pserver-0: backoffs of 1 s, then 2 s.
    let (crash, at) = exit_after(&mut sup, "pserver-0", t0, SECOND, "exit status: 1");
    crash.unwrap();
    assert_eq!(spawned(&sup.tick(at + SECOND, false)), ["pserver-0"]);
    let (crash, at) = exit_after(&mut sup, "pserver-0", at + SECOND, SECOND, "exit status: 1");
    crash.unwrap();
    assert!(sup.tick(at + SECOND, false).is_empty());
    assert_eq!(spawned(&sup.tick(at + 2 * SECOND, false)), ["pserver-0"]);
    // It then runs past healthy_after before it is preempted: restarted at once.
    let (crash, at) = exit_after(
        &mut sup,
        "pserver-0",
        at + 2 * SECOND,
        40 * SECOND,
        "signal: 9 (SIGKILL)",
    );
    assert!(crash.unwrap().is_some_and(|c| c.healthy));
    assert_eq!(spawned(&sup.tick(at, false)), ["pserver-0"]);
    assert_eq!(sup.preemptions(), 1);
    // Its next fast failures start over: 1 s, then 2 s, and two more are allowed.
    let (crash, at) = exit_after(&mut sup, "pserver-0", at, SECOND, "exit status: 1");
    crash.unwrap();
    assert!(sup.tick(at + SECOND - SECOND / 10, false).is_empty());
    assert_eq!(spawned(&sup.tick(at + SECOND, false)), ["pserver-0"]);
    let (crash, at) = exit_after(&mut sup, "pserver-0", at + SECOND, SECOND, "exit status: 1");
    crash.unwrap();
    assert!(sup.tick(at + SECOND, false).is_empty());
    assert_eq!(spawned(&sup.tick(at + 2 * SECOND, false)), ["pserver-0"]);
    let (crash, _) = exit_after(
        &mut sup,
        "pserver-0",
        at + 2 * SECOND,
        SECOND,
        "exit status: 1",
    );
    assert!(
        crash.is_err(),
        "the third fast failure in a row fails the job"
    );
    assert_eq!(sup.restarts(), 5);
}

#[test]
fn an_injected_fault_neither_counts_nor_clears_a_crash_loop() {
    let (mut sup, t0, _) = started();
    let (crash, at) = exit_after(&mut sup, "master-0", t0, SECOND, "exit status: 1");
    crash.unwrap();
    assert_eq!(spawned(&sup.tick(at + SECOND, false)), ["master-0"]);
    let m = id_of(&sup, "master-0");
    let hit = at + 2 * SECOND;
    assert_eq!(
        sup.inject(m, Action::Kill, hit),
        Some(Effect::Kill { id: m })
    );
    let crash = sup
        .exited(m, false, "signal: 9 (SIGKILL)", false, hit)
        .unwrap();
    assert_eq!(crash, None, "an injected fault is not a crash");
    assert_eq!(spawned(&sup.tick(hit, false)), ["master-0"], "at once");
    // The next fast failure is the second in a row: 2 s of backoff.
    let (crash, at) = exit_after(&mut sup, "master-0", hit, SECOND, "exit status: 1");
    crash.unwrap();
    assert!(sup.tick(at + 2 * SECOND - SECOND / 10, false).is_empty());
    assert_eq!(spawned(&sup.tick(at + 2 * SECOND, false)), ["master-0"]);
    assert_eq!(sup.restarts(), 2);
}

#[test]
fn injected_faults_restart_at_once_and_do_not_count() {
    let (mut sup, t0, _) = started();
    let t = id_of(&sup, "trainer-1");
    assert_eq!(
        sup.inject(t, Action::Kill, t0),
        Some(Effect::Kill { id: t })
    );
    assert!(sup.victims(Role::Trainer).iter().all(|&v| v != t));
    assert!(sup.exit_needs_job_status(t, false));
    let crash = sup.exited(t, false, "signal: 9 (SIGKILL)", false, t0);
    assert_eq!(
        crash.unwrap(),
        None,
        "its recovery is measured from the injection"
    );
    assert_eq!(sup.restarts(), 0);
    // A restarted trainer gets a new name: its registration is new.
    assert_eq!(spawned(&sup.tick(t0, false)), ["trainer-1.1"]);
}

#[test]
fn a_trainer_given_a_notice_drains_and_is_restarted_though_it_exits_cleanly() {
    let (mut sup, t0, _) = started();
    let t = id_of(&sup, "trainer-0");
    assert_eq!(
        sup.inject(t, Action::Notice, t0),
        Some(Effect::Signal {
            id: t,
            sig: Sig::Term
        })
    );
    assert!(sup.victims(Role::Trainer).iter().all(|&v| v != t));
    assert!(
        sup.exit_needs_job_status(t, true),
        "a drained trainer is restarted only while the job runs"
    );
    let crash = sup.exited(t, true, "exit status: 0", false, t0).unwrap();
    assert_eq!(crash, None, "an injected fault is not a crash");
    assert_eq!(sup.restarts(), 0);
    assert_eq!(spawned(&sup.tick(t0, false)), ["trainer-0.1"]);
    // Once the job has finished, a trainer given a notice is not restarted.
    let t = id_of(&sup, "trainer-0.1");
    sup.inject(t, Action::Notice, t0);
    assert_eq!(
        sup.exited(t, true, "exit status: 0", true, t0).unwrap(),
        None
    );
    assert!(spawned(&sup.tick(t0 + SECOND, false)).is_empty());
}

/// A notice's victim that still runs at the deadline is SIGKILLed, once; one that
/// exited before is not (the deadline goes with its process).
#[test]
fn a_notice_ends_in_sigkill_at_its_deadline_only_while_the_process_runs() {
    let (mut sup, t0, _) = started();
    let (slow, quick) = (id_of(&sup, "trainer-0"), id_of(&sup, "trainer-1"));
    sup.inject(slow, Action::Notice, t0);
    sup.inject(quick, Action::Notice, t0);
    assert_eq!(
        sup.exited(quick, true, "exit status: 0", false, t0 + SECOND)
            .unwrap(),
        None
    );
    let before = t0 + limits().notice_deadline - Duration::from_millis(1);
    assert!(!sup.tick(before, true).contains(&Effect::Kill { id: slow }));
    assert_eq!(sup.notices_past_deadline(), 0);
    let at = t0 + limits().notice_deadline;
    let effects = sup.tick(at, true);
    assert!(effects.contains(&Effect::Kill { id: slow }), "{effects:?}");
    assert!(
        !effects.contains(&Effect::Kill { id: quick }),
        "{effects:?}"
    );
    assert_eq!(sup.notices_past_deadline(), 1);
    assert!(
        !sup.tick(at + SECOND, true)
            .contains(&Effect::Kill { id: slow }),
        "once"
    );
    assert_eq!(sup.notices_past_deadline(), 1);
}

#[test]
fn a_pserver_given_a_notice_is_restarted_at_once() {
    let (mut sup, t0, _) = started();
    let ps = id_of(&sup, "pserver-0");
    sup.inject(ps, Action::Notice, t0);
    assert_eq!(
        sup.exited(ps, true, "exit status: 0", false, t0).unwrap(),
        None
    );
    assert_eq!(spawned(&sup.tick(t0, false)), ["pserver-0"]);
    assert_eq!(sup.restarts(), 0);
}

#[test]
fn a_stopped_trainer_is_resumed_after_twice_the_lease_ttl() {
    let (mut sup, t0, _) = started();
    let t = id_of(&sup, "trainer-0");
    assert_eq!(
        sup.inject(t, Action::Stop, t0),
        Some(Effect::Signal {
            id: t,
            sig: Sig::Stop
        })
    );
    assert!(
        !sup.victims(Role::Trainer).contains(&t),
        "hit while stopped"
    );
    assert!(sup.tick(t0 + 3 * SECOND, false).is_empty());
    assert_eq!(
        sup.tick(t0 + 4 * SECOND, false),
        [Effect::Signal {
            id: t,
            sig: Sig::Cont
        }]
    );
    assert!(sup.tick(t0 + 5 * SECOND, false).is_empty(), "resumed once");
    // Resumed, it may be hit again (a master resumed as a standby lives on: without
    // this, each process could be stopped once only).
    assert!(sup.victims(Role::Trainer).contains(&t));
    // Killed by a fault, it is not hit again before its exit.
    sup.inject(t, Action::Kill, t0 + 6 * SECOND);
    assert!(!sup.victims(Role::Trainer).contains(&t));
}

#[test]
fn trainers_that_end_or_fail_after_the_job_finished_are_not_restarted() {
    let (mut sup, t0, _) = started();
    let (a, b) = (id_of(&sup, "trainer-0"), id_of(&sup, "trainer-1"));
    sup.exited(a, true, "exit status: 0", false, t0).unwrap();
    sup.exited(b, false, "exit status: 1", true, t0).unwrap();
    assert_eq!(sup.restarts(), 0);
    assert!(sup.tick(t0 + 60 * SECOND, false).is_empty());
    assert!(!sup.draining());
}

#[test]
fn scaling_up_spawns_and_down_drains_the_latest_trainers() {
    let (mut sup, t0, _) = started();
    let up = sup.scale(4, t0 + 5 * SECOND);
    assert_eq!(spawned(&up), ["trainer-2", "trainer-3"]);
    assert_eq!(sup.scale_events()[0].from, 2);
    assert_eq!(sup.scale_events()[0].to, 4);
    assert_eq!(sup.scale_events()[0].at_s, 5.0);
    assert!(sup.scale(4, t0).is_empty(), "no change, no event");
    assert_eq!(sup.scale_events().len(), 1);

    // Below the minimum: clamped to 1; the three latest drain.
    let down = sup.scale(0, t0 + 6 * SECOND);
    let drained: Vec<&str> = down
        .iter()
        .map(|e| match e {
            Effect::Signal { id, sig: Sig::Term } => sup.proc(*id).unwrap().name.as_str(),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(drained, ["trainer-3", "trainer-2", "trainer-1"]);
    assert_eq!(sup.desired_trainers(), 1);
    // A drained trainer's exit is expected: no restart.
    let t3 = id_of(&sup, "trainer-3");
    sup.exited(t3, false, "signal: 15 (SIGTERM)", false, t0)
        .unwrap();
    assert_eq!(sup.restarts(), 0);
    assert!(sup.tick(t0 + 60 * SECOND, false).is_empty());
}

#[test]
fn scaling_counts_trainers_waiting_for_a_restart() {
    let (mut sup, t0, _) = started();
    let t = id_of(&sup, "trainer-1");
    sup.exited(t, false, "exit status: 1", false, t0).unwrap();
    // One runs, one waits for its restart: 3 asked means one more.
    assert_eq!(spawned(&sup.scale(3, t0)), ["trainer-2"]);
}

#[test]
fn the_end_waits_for_trainers_and_for_pserver_restarts_only() {
    let (mut sup, t0, _) = started();
    for name in ["trainer-0", "trainer-1"] {
        let id = id_of(&sup, name);
        sup.exited(id, true, "exit status: 0", false, t0).unwrap();
    }
    assert!(!sup.draining());
    let ps = id_of(&sup, "pserver-0");
    sup.exited(ps, false, "exit status: 1", false, t0).unwrap();
    assert!(sup.draining(), "a pserver waits for its restart");
    // Trainer restarts are skipped at the end; pserver ones are not.
    assert_eq!(spawned(&sup.tick(t0 + 10 * SECOND, true)), ["pserver-0"]);
    assert!(!sup.draining());
}

#[test]
fn stopping_resumes_paused_processes_first_and_expects_their_exit() {
    let (mut sup, t0, _) = started();
    let t = id_of(&sup, "trainer-0");
    sup.inject(t, Action::Stop, t0);
    let e = sup.stop(Role::Trainer);
    assert_eq!(
        e[0],
        Effect::Signal {
            id: t,
            sig: Sig::Cont
        }
    );
    assert_eq!(
        e[1],
        Effect::Signal {
            id: t,
            sig: Sig::Term
        }
    );
    assert_eq!(e.len(), 3, "{e:?}");
    sup.exited(t, false, "signal: 15 (SIGTERM)", false, t0)
        .unwrap();
    assert_eq!(sup.restarts(), 0);
    assert!(sup.tick(t0 + 60 * SECOND, false).is_empty());
}

#[test]
fn trainers_resume_up_to_the_desired_count_when_the_job_goes_on_after_its_end() {
    let (mut sup, t0, _) = started();
    for name in ["trainer-0", "trainer-1"] {
        let t = id_of(&sup, name);
        assert_eq!(
            sup.exited(t, true, "exit status: 0", true, t0).unwrap(),
            None
        );
    }
    assert!(!sup.draining());
    assert_eq!(
        spawned(&sup.resume_trainers(t0 + SECOND)),
        ["trainer-2", "trainer-3"],
        "new trainers, up to the desired two"
    );
    assert!(sup.resume_trainers(t0 + SECOND).is_empty(), "not twice");
}

#[test]
fn a_trainer_that_never_registers_is_killed_and_counts_as_a_failed_start() {
    let (mut sup, t0, _) = started();
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    // trainer-0 registers; trainer-1 never does.
    assert!(
        sup.registrations(&names(&["trainer-0"]), t0, t0 + 10 * SECOND)
            .is_empty()
    );
    assert!(
        sup.registrations(&names(&["trainer-0"]), t0, t0 + 59 * SECOND)
            .is_empty()
    );
    // etcd was away until t0 + 30 s: the deadline runs from then.
    assert!(
        sup.registrations(&names(&["trainer-0"]), t0 + 30 * SECOND, t0 + 61 * SECOND)
            .is_empty()
    );
    let kills = sup.registrations(&[], t0, t0 + 61 * SECOND);
    let t1 = id_of(&sup, "trainer-1");
    assert_eq!(
        kills,
        vec![(Effect::Kill { id: t1 }, "trainer-1".to_owned())]
    );
    // Killed once only, and trainer-0 (registered earlier, gone from etcd now) is left alone.
    assert!(sup.registrations(&[], t0, t0 + 70 * SECOND).is_empty());
    // Its exit is a fast failure, not a preemption, though it ran past healthy_after.
    let crash = sup
        .exited(t1, false, "signal: 9 (SIGKILL)", false, t0 + 61 * SECOND)
        .expect("within the budget")
        .expect("a crash");
    assert!(!crash.healthy);
    assert_eq!(sup.preemptions(), 0);
    assert_eq!(sup.restarts(), 1);
    // The budget (2) runs out on the third hang in a row.
    let mut now = t0 + 61 * SECOND;
    for n in 2..=3 {
        now += 20 * SECOND;
        let effects = sup.tick(now, false);
        assert_eq!(spawned(&effects), [format!("trainer-1.{}", n - 1)]);
        let kills = sup.registrations(&names(&["trainer-0"]), t0, now + 61 * SECOND);
        assert_eq!(kills.len(), 1);
        now += 61 * SECOND;
        let r = sup.exited(
            id_of(&sup, &format!("trainer-1.{}", n - 1)),
            false,
            "signal: 9",
            false,
            now,
        );
        if n == 3 {
            let e = r.expect_err("a crash loop");
            assert!(
                e.to_string()
                    .contains("did not register with the job within"),
                "{e}"
            );
        } else {
            assert!(r.expect("within the budget").is_some());
        }
    }
}

#[test]
fn a_trainer_the_master_names_stuck_is_killed_once_and_restarted_as_a_crash() {
    let (mut sup, t0, _) = started();
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    // Not one of ours (a trainer of another run, say): nothing.
    assert!(
        sup.stuck(&names(&["trainer-9"]), Stuck::NoProgress)
            .is_empty()
    );
    let t1 = id_of(&sup, "trainer-1");
    assert_eq!(
        sup.stuck(&names(&["trainer-1", "trainer-9"]), Stuck::NoProgress),
        vec![(Effect::Kill { id: t1 }, "trainer-1".to_owned())]
    );
    // Named again by the next status before its exit is seen: killed once only.
    assert!(
        sup.stuck(&names(&["trainer-1"]), Stuck::NoProgress)
            .is_empty()
    );
    // After a healthy run its exit is a crash restarted at once, said as what it was.
    let now = t0 + 40 * SECOND;
    let crash = sup
        .exited(t1, false, "signal: 9 (SIGKILL)", false, now)
        .expect("within the budget")
        .expect("a crash");
    assert!(crash.healthy, "{crash:?}");
    assert_eq!(spawned(&sup.tick(now, false)), ["trainer-1.1"]);
    // Stuck again and again soon after each start (a pserver away, say): restarted at
    // once each time, never counted against the budget (2).
    let mut now = now;
    for n in 1..=4 {
        let name = format!("trainer-1.{n}");
        let t = id_of(&sup, &name);
        assert_eq!(sup.stuck(&[name], Stuck::NoProgress).len(), 1);
        now += 5 * SECOND;
        let crash = sup
            .exited(t, false, "signal: 9 (SIGKILL)", false, now)
            .expect("never a crash loop")
            .expect("a crash");
        assert!(crash.healthy, "{crash:?}");
        assert_eq!(
            spawned(&sup.tick(now, false)),
            [format!("trainer-1.{}", n + 1)]
        );
    }
    // A trainer asked to stop is not killed for being stuck.
    let drained = sup.scale(1, now + 6 * SECOND);
    let Some(Effect::Signal { id, .. }) = drained.first() else {
        panic!("a drain: {drained:?}")
    };
    let name = sup.proc(*id).expect("the drained trainer").name.clone();
    assert!(sup.stuck(&[name], Stuck::NoProgress).is_empty());
}

#[test]
fn a_slot_whose_replacement_a_scale_down_drained_is_retired() {
    let (mut sup, t0, _) = started();
    let t1 = id_of(&sup, "trainer-1");
    assert!(!sup.slot_retired(Role::Trainer, 1));
    // A fault hits trainer-1: it is restarted at once, so its slot is still wanted.
    sup.inject(t1, Action::Notice, t0);
    assert!(
        sup.exited(t1, true, "exit status: 0", false, t0)
            .expect("ok")
            .is_none()
    );
    assert!(!sup.slot_retired(Role::Trainer, 1), "its restart is queued");
    let effects = sup.tick(t0, false);
    assert_eq!(spawned(&effects), ["trainer-1.1"]);
    // Scaling down drains the latest trainer, the replacement: the slot is retired.
    sup.scale(1, t0 + SECOND);
    assert!(sup.slot_retired(Role::Trainer, 1));
    assert!(!sup.slot_retired(Role::Trainer, 0));
}
