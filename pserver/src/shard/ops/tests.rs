//! Tests of the parent module.

use std::sync::{Arc, Mutex};

use proptest::prelude::*;

use super::*;
use crate::layout::Mode;
use crate::shard::testutil::{core, push};

/// What a replica holds, for comparison: the snapshot (values, slots, versions,
/// ledger, update count) and the deduplication table.
fn state(c: &ShardCore) -> (crate::checkpoint::Snapshot, Vec<(String, u64, u64, u64)>) {
    (c.snapshot(0), lock(&c.dedup).entries())
}

/// A change a trainer or the master asks of a primary.
#[derive(Debug, Clone)]
enum Ask {
    /// (trainer, session, step, gradient, rows, origin (pass, task, seq, count))
    Push(u8, u8, u8, i8, Vec<u8>, Option<(u8, u8, u8, u8)>),
    TaskDone(u8, u8),
    Settle(u8, u8),
}

fn ask() -> impl Strategy<Value = Ask> {
    prop_oneof![
        8 => (0u8..3, 0u8..2, 0u8..80, -3i8..4, prop::collection::vec(0u8..6, 0..4),
              prop::option::of((0u8..2, 0u8..4, 0u8..3, 1u8..3)))
            .prop_map(|(t, s, st, g, r, o)| Ask::Push(t, s, st, g, r, o)),
        1 => (0u8..2, 0u8..4).prop_map(|(p, t)| Ask::TaskDone(p, t)),
        1 => (0u8..2, 0u8..4).prop_map(|(p, t)| Ask::Settle(p, t)),
    ]
}

/// Applies `a` on the primary; the ops it makes go to `log`, as bytes.
fn run(c: &ShardCore, a: &Ask, log: &Mutex<Vec<Bytes>>) {
    let order = |op: &ShardOp| {
        log.lock().unwrap().push(c.encode_op(op));
        Ok(())
    };
    match a {
        Ask::Push(t, s, st, g, rows, origin) => {
            let rows: Vec<u64> = rows.iter().map(|&r| u64::from(r)).collect();
            let mut raw = push(
                c,
                &format!("t{t}"),
                u64::from(*s),
                u64::from(*st),
                f32::from(*g),
                &rows,
            );
            // Runs of 1 or 2 batches: some overlap others (refused, no op).
            raw.origin = origin.map(|(pass, task, seq, count)| Origin {
                pass: u32::from(pass),
                task: u32::from(task),
                seq: u32::from(seq),
                count: u32::from(count),
            });
            let p = c.validate_push(raw).unwrap();
            let _ = c.apply_async_ordered(&p, order);
        }
        Ask::TaskDone(pass, task) => {
            let _ = c.task_done_ordered(u32::from(*pass), u32::from(*task), 4, 0, order);
        }
        Ask::Settle(pass, task) => {
            let r = FailedRecord {
                version: edl_job::RECORD_VERSION,
                pass: u32::from(*pass),
                tasks: 4,
                failed: [u32::from(*task)].into(),
            };
            let _ = c.settle_ordered(&r, order);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// A backup replaying the primary's ops, through their bytes, holds the
    /// primary's state bitwise, after every op.
    #[test]
    fn a_backup_replaying_the_ops_holds_the_primarys_state(
        asks in prop::collection::vec(ask(), 0..120),
    ) {
        let primary = core(Mode::Async, 0, 1);
        let backup = core(Mode::Async, 0, 1);
        let log = Mutex::new(Vec::new());
        let mut replayed = 0;
        for a in &asks {
            let before = state(&primary);
            let made = log.lock().unwrap().len();
            run(&primary, a, &log);
            let ops: Vec<Bytes> = log.lock().unwrap()[replayed..].to_vec();
            prop_assert!(ops.len() <= 1);
            if ops.is_empty() {
                // No op, no change (a repeat, or refused).
                prop_assert_eq!(&state(&primary), &before);
                prop_assert_eq!(log.lock().unwrap().len(), made);
            }
            for bytes in ops {
                let op = backup.decode_op(bytes).unwrap();
                backup.replay(&op).unwrap();
                replayed += 1;
            }
            prop_assert_eq!(state(&backup), state(&primary));
        }
    }
}

/// A joiner built from a snapshot, then following the ops since, holds the
/// primary's state; a damaged snapshot is refused.
#[test]
fn a_joiner_from_a_snapshot_and_the_ops_since_holds_the_primarys_state() {
    let primary = core(Mode::Async, 0, 1);
    let log = Mutex::new(Vec::new());
    let asks: Vec<Ask> = (0..40u8)
        .map(|i| {
            let origin = (i % 3 == 0).then_some((0, i % 4, i / 4, 1 + i % 2));
            Ask::Push(i % 3, 0, i, (i % 5) as i8 - 2, vec![i % 6], origin)
        })
        .collect();
    for a in &asks[..20] {
        run(&primary, a, &log);
    }
    let (bytes, ops_held) = primary
        .replica_snapshot(|| log.lock().unwrap().len())
        .unwrap();
    for a in &asks[20..] {
        run(&primary, a, &log);
    }
    let joiner = ShardCore::from_replica_snapshot(bytes.clone(), 9, Arc::default()).unwrap();
    for op in log.lock().unwrap()[ops_held..].iter().cloned() {
        joiner.replay(&joiner.decode_op(op).unwrap()).unwrap();
    }
    assert_eq!(state(&joiner), state(&primary));
    // Witness: the deduplication table travelled (sessions without an origin).
    assert!(!lock(&joiner.dedup).entries().is_empty());
    for cut in [0, 3, 10, bytes.len() / 2, bytes.len() - 1] {
        assert!(
            ShardCore::from_replica_snapshot(bytes.slice(..cut), 9, Arc::default()).is_err(),
            "cut at {cut}"
        );
    }
}

/// Sync mode: a backup replaying the primary's steps (and tasks) holds its state
/// bitwise after every step, through overflowing steps, repeats and trainers that
/// leave; a stream that refuses leaves the step unapplied.
#[test]
fn a_backup_replaying_sync_steps_holds_the_primarys_state() {
    let primary = core(Mode::sync(), 0, 1);
    let backup = core(Mode::sync(), 0, 1);
    let log: Arc<Mutex<Vec<Bytes>>> = Arc::default();
    let (l, p) = (log.clone(), Arc::new(core(Mode::sync(), 0, 1)));
    // The stream encodes with a shard of the same layout (encoding reads only it).
    primary
        .set_stream(OpStream(Arc::new(move |op| {
            l.lock().unwrap().push(p.encode_op(op));
            Ok(())
        })))
        .unwrap();
    let now = tokio::time::Instant::now();
    primary.sync_set_members(["a".to_string(), "b".to_string()].into());
    let mut replayed = 0;
    let mut steps_seen = 0;
    for step in 1..=30u64 {
        for (t, g) in [("a", 1.0), ("b", (step % 7) as f32 - 3.0)] {
            let mut raw = push(&primary, t, 1, step, g, &[step % 4, 5]);
            raw.origin = (step % 3 != 0).then_some(Origin {
                pass: 0,
                task: u32::from(t == "b"),
                seq: step as u32,
                count: 1,
            });
            if step == 10 {
                // A sum that overflows: the step is dropped, on both.
                raw.dense[0].values = crate::wire::encode(&[f32::MAX; 4]);
            }
            let p = primary.validate_push(raw).unwrap();
            primary.sync_push(&p, now).unwrap();
        }
        if step == 20 {
            primary.task_done(0, 0, 4, 0).unwrap();
        }
        let ops: Vec<Bytes> = log.lock().unwrap()[replayed..].to_vec();
        for bytes in ops {
            let op = backup.decode_op(bytes).unwrap();
            steps_seen += usize::from(matches!(op, ShardOp::Step { .. }));
            backup.replay(&op).unwrap();
            replayed += 1;
        }
        assert_eq!(backup.last_closed(), primary.last_closed());
        assert_eq!(state(&backup), state(&primary), "after step {step}");
    }
    assert_eq!(steps_seen, 30);
    // Witness: step 10 was dropped (counted as refused), the others applied.
    assert_eq!(
        primary.counters.nonfinite_rejected.load(Ordering::Relaxed),
        1
    );
    assert_eq!(backup.updates(), primary.updates());
    assert_eq!(primary.last_closed(), 30);
    // A step applied again on the backup is a divergence (its batches are in).
    let ops = log.lock().unwrap().clone();
    let first_step = ops
        .iter()
        .map(|b| backup.decode_op(b.clone()).unwrap())
        .find(|op| matches!(op, ShardOp::Step { origins, .. } if !origins.is_empty()))
        .unwrap();
    assert!(backup.replay(&first_step).is_err());
}

#[test]
fn a_sync_step_refused_by_the_stream_is_not_applied() {
    let c = core(Mode::sync(), 0, 1);
    c.set_stream(OpStream(Arc::new(|_| {
        Err(PsError::NotServing("not primary".into()))
    })))
    .unwrap();
    c.sync_set_members(["a".to_string()].into());
    let before = state(&c);
    let p = c.validate_push(push(&c, "a", 1, 1, 2.0, &[3])).unwrap();
    assert_eq!(
        c.sync_push(&p, tokio::time::Instant::now()).unwrap(),
        crate::sync::Admit::Join { step: 1 }
    );
    assert_eq!(c.last_closed(), 0, "closed without the stream");
    assert_eq!(state(&c).0.blocks, before.0.blocks);
}

#[test]
fn an_op_refused_by_the_stream_changes_nothing() {
    let c = core(Mode::Async, 0, 1);
    let mut raw = push(&c, "t", 1, 1, 1.0, &[3]);
    raw.origin = Some(Origin {
        pass: 0,
        task: 1,
        seq: 0,
        count: 1,
    });
    let p = c.validate_push(raw).unwrap();
    let before = state(&c);
    let refused = c.apply_async_ordered(&p, |_| Err(PsError::NotServing("not primary".into())));
    assert!(matches!(refused, Err(PsError::NotServing(_))));
    assert_eq!(state(&c), before);
    // Witness: the same push is applied once the stream takes it.
    assert!(c.apply_async_ordered(&p, |_| Ok(())).unwrap().applied);
    assert_ne!(state(&c), before);
    let refused = c.task_done_ordered(0, 1, 4, 0, |_| Err(PsError::NotServing("no".into())));
    assert!(refused.is_err());
    assert!(!c.contains().contains(0, 1));
}

/// Two trainers push at once: the ops are in the order the primary decided, and a
/// backup replaying them holds the same ledger, table and update count, and (the
/// gradients being small integers, exact in any order) the same values.
#[test]
fn concurrent_pushes_replay_to_the_same_shard() {
    let primary = Arc::new(core(Mode::Async, 0, 1));
    let log = Arc::new(Mutex::new(Vec::new()));
    let threads: Vec<_> = (0..2)
        .map(|t| {
            let (c, log) = (primary.clone(), log.clone());
            std::thread::spawn(move || {
                for step in 1..=200u64 {
                    let mut raw = push(&c, &format!("t{t}"), 1, step, (t + 1) as f32, &[step % 5]);
                    raw.origin = (step % 2 == 0).then_some(Origin {
                        pass: 0,
                        task: t,
                        seq: step as u32,
                        count: 1,
                    });
                    let p = c.validate_push(raw).unwrap();
                    c.apply_async_ordered(&p, |op| {
                        log.lock().unwrap().push(c.encode_op(op));
                        Ok(())
                    })
                    .unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let backup = core(Mode::Async, 0, 1);
    let ops = log.lock().unwrap().clone();
    assert_eq!(ops.len(), 400);
    for bytes in ops {
        backup.replay(&backup.decode_op(bytes).unwrap()).unwrap();
    }
    assert_eq!(state(&backup), state(&primary));
    // A replayed op applied again is a divergence, said as such.
    let again = push(&backup, "t0", 1, 199, 1.0, &[]);
    let p = backup.validate_push(again).unwrap();
    let err = backup
        .replay(&ShardOp::Push {
            push: p,
            update: 400,
        })
        .unwrap_err();
    assert!(err.to_string().contains("diverged"), "{err}");
}

#[test]
fn a_damaged_op_is_an_error_not_a_panic() {
    let c = core(Mode::Async, 0, 1);
    let mut raw = push(&c, "t", 1, 1, 1.0, &[3, 4]);
    raw.origin = Some(Origin {
        pass: 0,
        task: 1,
        seq: 0,
        count: 1,
    });
    let p = c.validate_push(raw).unwrap();
    let ops = [
        ShardOp::Push { push: p, update: 7 },
        ShardOp::TaskDone {
            pass: 1,
            task: 2,
            tasks: 4,
        },
        ShardOp::Settle(FailedRecord {
            version: edl_job::RECORD_VERSION,
            pass: 0,
            tasks: 4,
            failed: [1, 3].into(),
        }),
        ShardOp::Step {
            job: CloseJob {
                step: 3,
                contributors: 2,
                timed_out: 0,
            },
            update: 2,
            dropped: false,
            dense: vec![(0, vec![1.0; 4])],
            sparse: vec![(0, 7, vec![2.0, 3.0])],
            origins: vec![Origin {
                pass: 0,
                task: 2,
                seq: 1,
                count: 1,
            }],
        },
    ];
    for op in &ops {
        let bytes = c.encode_op(op);
        // Witness: the whole op decodes.
        assert!(c.decode_op(bytes.clone()).is_ok());
        for cut in 0..bytes.len() {
            assert!(c.decode_op(bytes.slice(..cut)).is_err(), "cut at {cut}");
        }
        let mut longer = bytes.to_vec();
        longer.push(0);
        assert!(c.decode_op(Bytes::from(longer)).is_err());
        let mut kind = bytes.to_vec();
        kind[0] = 99;
        assert!(c.decode_op(Bytes::from(kind)).is_err());
    }
    // A gradient made infinite in transit is refused as from a trainer.
    let bytes = c.encode_op(&ops[0]).to_vec();
    let at = bytes.len() - 4;
    let mut bad = bytes.clone();
    bad[at..].copy_from_slice(&f32::INFINITY.to_le_bytes());
    assert!(c.decode_op(Bytes::from(bad)).is_err());
}
