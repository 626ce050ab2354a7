//! The master against real etcd, with trainers (`edl consume`) and masters SIGKILLed.

use std::collections::BTreeMap;
use std::time::Duration;

use edl_master_client::Answer;
use tokio::time::Instant;

use crate::support::{Proc, World, wait_until};

/// `GET /metrics` from a master over plain HTTP/1.1.
pub(crate) async fn get_metrics(addr: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("send");
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out))
        .await
        .expect("metrics answered in time")
        .expect("read");
    out
}

/// Counts how often each record was consumed over the given consumers.
fn tally(world: &World, names: &[&str]) -> BTreeMap<String, u32> {
    let mut n = BTreeMap::new();
    for name in names {
        for (_, _, rec) in world.consumed(name) {
            *n.entry(rec).or_default() += 1;
        }
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_trainer_processes_get_every_record_exactly_once() {
    let w = World::new("four").await;
    let (glob, all) = w.dataset(3, 200);
    let (_master, addr) = w.master("master", &[]).await;
    let ds = w.client().set_dataset(vec![glob], 2, 1).await.unwrap();
    assert_eq!(ds.records, 600);
    let names = ["c0", "c1", "c2", "c3"];
    let mut consumers: Vec<_> = names.iter().map(|n| w.consumer(n, &[])).collect();
    for c in &mut consumers {
        let status = c.wait_exit(Duration::from_secs(60)).await;
        assert!(status.success(), "{} failed:\n{}", c.name, c.log());
        assert!(c.log().contains("job finished"), "{}", c.log());
    }
    let n = tally(&w, &names);
    assert_eq!(n.len(), all.len(), "every record delivered");
    assert!(
        n.values().all(|&c| c == 1),
        "no record twice without failures"
    );
    let st = w.client().status().await.unwrap();
    let c = st.counters.unwrap();
    assert!(st.finished);
    assert_eq!(
        (c.records_trained, c.failures, c.duplicate_records),
        (600, 0, 0)
    );
    let metrics = get_metrics(&addr).await;
    assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
    assert!(
        metrics.contains("edl_master_leader{job=\"four\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("edl_master_records_trained_total{job=\"four\"} 600"),
        "{metrics}"
    );
    assert!(
        metrics.contains("edl_master_finished{job=\"four\"} 1"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_trainer_task_is_back_in_todo_within_ttl_plus_3s() {
    let w = World::new("killed-trainer").await;
    let (glob, all) = w.dataset(2, 100);
    let (_master, _) = w.master("master", &[]).await;
    w.client().set_dataset(vec![glob], 2, 1).await.unwrap();
    // A slow trainer: 20 ms a record, so it is mid-task when killed.
    let mut slow = w.consumer("slow", &["--per-record", "20ms", "--read-ahead", "1"]);
    let client = w.client();
    let held = wait_until(Duration::from_secs(20), || async {
        client
            .status()
            .await
            .is_ok_and(|s| s.trainers.iter().any(|t| t == "slow"))
    })
    .await;
    assert!(held, "the slow trainer never held a task:\n{}", slow.log());
    slow.kill();
    let killed = Instant::now();
    let requeued = wait_until(Duration::from_secs(10), || async {
        client.status().await.is_ok_and(|s| {
            s.counters.is_some_and(|c| c.trainer_lost >= 1)
                && !s.trainers.iter().any(|t| t == "slow")
        })
    })
    .await;
    let took = killed.elapsed();
    assert!(requeued, "the killed trainer's tasks were never requeued");
    // The consumer's lease TTL (2 s) plus a margin for etcd's expiry checks and the
    // master's watch on a loaded 2-core machine.
    assert!(took <= Duration::from_secs(5), "requeue took {took:?}");
    eprintln!("killed trainer's task back in todo after {took:?}");

    let mut fast = w.consumer("fast", &[]);
    let status = fast.wait_exit(Duration::from_secs(60)).await;
    assert!(status.success(), "{}", fast.log());
    let n = tally(&w, &["slow", "fast"]);
    assert!(
        all.iter().all(|r| n.contains_key(r)),
        "every record trained at least once"
    );
    let st = client.status().await.unwrap();
    assert!(st.finished);
    let c = st.counters.unwrap();
    assert!(c.cutoff_records > 0, "the cut-off task is counted: {c:?}");
    assert_eq!(c.failed_tasks, 0);
}

/// Two masters of `w`'s job (with `extra`), a dataset of three files of 150 records
/// defined, and two consumers (1 ms a record) under way: the masters and their
/// addresses, the consumers' names and processes, every record.
struct Training {
    masters: [(Proc, String); 2],
    names: [&'static str; 2],
    consumers: Vec<Proc>,
    all: Vec<String>,
}

async fn two_masters_training(w: &World, extra: &[&str]) -> Training {
    let (glob, all) = w.dataset(3, 150);
    let m0 = w.master("m0", extra).await;
    let client = w.client();
    client
        .set_dataset(vec![glob], 1, 1)
        .await
        .expect("define the dataset");
    let m1 = w.master("m1", extra).await;
    let names = ["c0", "c1"];
    let consumers: Vec<_> = names
        .iter()
        .map(|n| w.consumer(n, &["--per-record", "1ms"]))
        .collect();
    let started = wait_until(Duration::from_secs(20), || async {
        client.status().await.is_ok_and(|s| s.done >= 5)
    })
    .await;
    assert!(started, "no progress before the kill");
    Training {
        masters: [m0, m1],
        names,
        consumers,
        all,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leading_master_mid_pass_loses_nothing() {
    let w = World::new("master-kill").await;
    let client = w.client();
    let Training {
        masters: [(mut m0, a0), (mut m1, a1)],
        names,
        mut consumers,
        all,
    } = two_masters_training(&w, &[]).await;
    let leader = client.status().await.unwrap().leader;
    let (victim, standby) = if leader == a0 {
        (&mut m0, &a1)
    } else {
        (&mut m1, &a0)
    };
    assert!(
        leader == a0 || leader == a1,
        "leader {leader} is neither master"
    );
    victim.kill();
    for c in &mut consumers {
        let status = c.wait_exit(Duration::from_secs(90)).await;
        assert!(status.success(), "{} failed:\n{}", c.name, c.log());
    }
    let n = tally(&w, &names);
    assert!(all.iter().all(|r| n.contains_key(r)), "no record lost");
    let st = client.status().await.unwrap();
    assert_eq!(&st.leader, standby, "the standby leads");
    assert!(st.finished);
    let c = st.counters.unwrap();
    assert!(c.failovers >= 1);
    assert_eq!(c.records_trained, all.len() as u64, "{c:?}");
}

/// A leading master SIGKILLed while its election lease has a minute left: its standby
/// sees the leader's address close and then refuse connections, revokes the lease and
/// leads from its own copy of the queue (followed from a watch, not read again), long
/// before the lease could have ended; every record is consumed, none twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_leader_is_replaced_at_once_by_a_standby_leading_from_its_copy() {
    let w = World::new("master-standby").await;
    let client = w.client();
    let Training {
        masters: [(mut m0, a0), (mut m1, a1)],
        names,
        mut consumers,
        all,
    } = two_masters_training(&w, &["--lease-ttl", "60s"]).await;
    let leader = client.status().await.unwrap().leader;
    let (victim, standby, standby_addr) = if leader == a0 {
        (&mut m0, &mut m1, a1.clone())
    } else {
        (&mut m1, &mut m0, a0.clone())
    };
    assert!(
        leader == a0 || leader == a1,
        "leader {leader} is neither master"
    );
    let following = wait_until(Duration::from_secs(30), || async {
        standby.log().contains("following the queue as a standby")
    })
    .await;
    assert!(
        following,
        "the standby does not follow the queue:\n{}",
        standby.log()
    );
    victim.kill();
    let killed = Instant::now();
    // Half the lease: only the standby's detection can have ended it by then.
    let took_over = wait_until(Duration::from_secs(30), || async {
        client
            .status()
            .await
            .is_ok_and(|s| s.leader == standby_addr)
    })
    .await;
    let after = killed.elapsed();
    assert!(
        took_over,
        "the standby did not lead within half the lease:\n{}",
        standby.log()
    );
    let log = standby.log();
    assert!(
        log.contains("the leading master's process is gone"),
        "the standby did not say why it took over:\n{log}\nthe old leader's log:\n{}",
        victim.log()
    );
    let serving = log
        .lines()
        .find(|l| l.contains("serving the queue"))
        .unwrap_or_else(|| panic!("the standby never served:\n{log}"));
    assert!(
        serving.contains("standby copy"),
        "the standby read the queue from etcd: {serving}"
    );
    eprintln!(
        "the standby led {:.2} s after the SIGKILL: {serving}",
        after.as_secs_f64()
    );
    for c in &mut consumers {
        let status = c.wait_exit(Duration::from_secs(90)).await;
        assert!(status.success(), "{} failed:\n{}", c.name, c.log());
    }
    let n = tally(&w, &names);
    assert!(
        all.iter().all(|r| n.get(r) == Some(&1)),
        "every record once: {n:?}"
    );
    let st = client.status().await.unwrap();
    assert!(st.finished);
    let c = st.counters.unwrap();
    assert_eq!(c.records_trained, all.len() as u64, "{c:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_chunk_fails_its_task_with_the_file_named_and_the_pass_ends() {
    let w = World::new("corrupt").await;
    let (glob, all) = w.dataset(2, 60);
    let bad = w.dir.path().join("data/part-001.recordio");
    let index = edl_recordio::ChunkIndex::build(&bad).unwrap();
    let mut bytes = std::fs::read(&bad).unwrap();
    bytes[index.chunks[4].offset as usize + edl_recordio::HEADER_LEN + 2] ^= 0x55;
    std::fs::write(&bad, bytes).unwrap();
    let (_master, _) = w.master("master", &["--max-failures", "2"]).await;
    let client = w.client();
    client.set_dataset(vec![glob], 1, 1).await.unwrap();
    let mut c = w.consumer("c", &[]);
    let status = c.wait_exit(Duration::from_secs(60)).await;
    assert!(status.success(), "{}", c.log());
    let st = client.status().await.unwrap();
    assert!(st.finished, "the pass ends despite the failed task");
    assert_eq!(st.failed_tasks.len(), 1, "{:?}", st.failed_tasks);
    let f = &st.failed_tasks[0];
    assert!(f.reason.contains("part-001.recordio"), "{}", f.reason);
    let c = st.counters.unwrap();
    assert_eq!(
        c.failures, 3,
        "failed for good after max_failures + 1 attempts"
    );
    assert_eq!(c.lost_records, 5);
    assert_eq!(tally(&w, &["c"]).len(), all.len() - 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_task_finished_after_redispatch_is_rejected() {
    let w = World::new("stale").await;
    let (glob, _) = w.dataset(1, 10);
    let (_master, _) = w.master("master", &[]).await;
    let client = w.client();
    client.set_dataset(vec![glob], 1, 1).await.unwrap();
    let lease = w.register_trainer("old").await;
    let Answer::Task(task) = client
        .get_task("old", 0, 1, Duration::ZERO, None)
        .await
        .unwrap()
    else {
        panic!("expected a task")
    };
    lease.revoke().await.unwrap();
    let requeued = wait_until(Duration::from_secs(10), || async {
        client.status().await.is_ok_and(|s| s.pending == 0)
    })
    .await;
    assert!(requeued);
    let _lease2 = w.register_trainer("new").await;
    // The requeued task went to the back of the queue: finish the others first.
    let mut again = None;
    for request in 1..=3 {
        let Answer::Task(t) = client
            .get_task("new", 0, request, Duration::ZERO, None)
            .await
            .unwrap()
        else {
            panic!("expected a task")
        };
        if t.id == task.id {
            again = Some(t);
            break;
        }
        assert!(client.task_finished("new", &t, 5, &[]).await.unwrap());
    }
    let again = again.expect("the requeued task is dispatched again");
    assert!(again.generation > task.generation);
    let err = client
        .task_finished("old", &task, 5, &[])
        .await
        .unwrap_err();
    assert!(err.is_stale(), "{err}");
    assert!(client.task_finished("new", &again, 5, &[]).await.unwrap());
    let st = client.status().await.unwrap();
    assert_eq!(st.counters.unwrap().stale_rejected, 1);
}

/// Task transitions [`a_million_task_transitions_leave_the_etcd_database_bounded`]
/// drives: `EDL_TRANSITIONS`, a million by default.
fn transitions() -> u64 {
    std::env::var("EDL_TRANSITIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000)
}

/// A million task transitions (dispatches and completions, group-committed 100 at a
/// time through the master's `Store`, as the leader's actor commits them) against an
/// etcd started like the private etcd of `edl run`, its compaction window scaled down
/// from 5 minutes to 2 s so that the run spans several: the database in use stays
/// bounded by the window's writes, not by the run's, and falls back to about the live
/// records once writing stops. The file (`dbSize`) grows to the high-water mark of
/// what was in use and does not shrink without a defragmentation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_task_transitions_leave_the_etcd_database_bounded() {
    use edl_coord::Fence;
    use edl_coord::local_etcd::{Compaction, LocalEtcd, Options};
    use edl_job::{JobKeys, JobName};
    use edl_master::dataset::{Dataset, DatasetSpec};
    use edl_master::queue::{GetTask, Queue, QueueConfig, TaskSpec};
    use edl_master::store::Store;

    const WINDOW: Duration = Duration::from_secs(2);
    const TASKS: u32 = 1000;
    const BATCH: usize = 100;
    const MIB: i64 = 1 << 20;
    let target = transitions();
    let options = Options {
        compaction: Compaction { retention: WINDOW },
        ..Options::default()
    };
    let etcd = LocalEtcd::start_with(1, options).await.expect("start etcd");
    let backend = etcd.connect().await.expect("connect");
    let keys = JobKeys::new(&JobName::new("million").unwrap());
    let key = format!("{}master/election/test", keys.root());
    let revision = backend.put(&key, b"x".to_vec(), None).await.unwrap();
    let store = Store::new(backend.clone(), keys.clone(), Fence { key, revision });
    let specs = (0..TASKS)
        .map(|i| TaskSpec {
            id: TaskSpec::make_id(0, i, i + 1),
            file: 0,
            chunk_begin: i,
            chunk_end: i + 1,
            records: 100,
            offset_begin: u64::from(i) * 4096,
            offset_end: u64::from(i + 1) * 4096,
        })
        .collect();
    let cfg = QueueConfig {
        passes: u32::MAX,
        ..QueueConfig::default()
    };
    let mut q = Queue::new(cfg, specs);
    let ds = Dataset {
        spec: DatasetSpec {
            globs: vec!["/data/part-*".into()],
            chunks_per_task: 1,
            records_per_task: 0,
            min_records_per_task: 0,
            passes: u32::MAX,
        },
        files: Vec::new(),
        tasks: u64::from(TASKS),
        records: u64::from(TASKS) * 100,
    };
    store.create_dataset(&ds, &q.take_changes()).await.unwrap();

    let first = etcd.db_status(0).await.unwrap();
    let started = Instant::now();
    let (mut done, mut bytes) = (0u64, 0u64);
    let mut peak_in_use = 0;
    // (elapsed, revision) every second or so.
    let mut samples: Vec<(Duration, i64)> = Vec::new();
    // At least `target` transitions, over at least six compaction windows (a fast
    // machine writes them sooner and goes on).
    while done < target || started.elapsed() < WINDOW * 6 {
        let now = started.elapsed().as_millis() as u64;
        let pass = q.pass();
        let mut held = Vec::with_capacity(BATCH);
        for n in 0..BATCH {
            match q.get_task(&format!("t{}", n % 10), pass, 0, now) {
                GetTask::Task(t) => held.push(t),
                _ => break,
            }
        }
        for _ in 0..2 {
            let changes = q.take_changes();
            if let Some(t) = changes.tasks.first() {
                let record = serde_json::to_vec(t).unwrap().len() as u64;
                bytes += record * changes.tasks.len() as u64;
            }
            store.commit(&changes).await.expect("commit");
            done += changes.tasks.len() as u64;
            for t in held.drain(..) {
                q.finished(&t.spec.id, t.generation, 100, &[], now).unwrap();
            }
        }
        if samples
            .last()
            .is_none_or(|s| started.elapsed() >= s.0 + Duration::from_secs(1))
        {
            let s = etcd.db_status(0).await.unwrap();
            peak_in_use = peak_in_use.max(s.db_size_in_use);
            samples.push((started.elapsed(), s.revision));
        }
    }
    let took = started.elapsed();
    let last = etcd.db_status(0).await.unwrap();
    eprintln!(
        "{done} transitions in {took:.1?} ({:.0}/s), {} revisions, {} MiB of records written; \
         in use: peak {} MiB, at the end {} MiB; file {} MiB",
        done as f64 / took.as_secs_f64(),
        last.revision - first.revision,
        bytes >> 20,
        peak_in_use / MIB,
        last.db_size_in_use / MIB,
        last.db_size / MIB,
    );

    // The run spanned several compaction windows (the loop's condition), and etcd
    // compacted all along: its compact revision is past what the store had written two
    // thirds into the run.
    let two_thirds = samples
        .iter()
        .find(|s| s.0 >= took * 2 / 3)
        .expect("samples all along")
        .1;
    let compact = etcd.compact_revision(0).await.unwrap();
    assert!(
        compact >= two_thirds,
        "compacted to revision {compact}, not past {two_thirds} (two thirds into the run)"
    );
    // Bounded: what is in use never held more than about two windows of writes (at
    // twice the records' bytes, for etcd's own bytes per version) over the live
    // records, however long the run; and once writing stops it falls back to about the
    // live records (1000 task records, the queue record).
    let written = bytes as i64;
    let per_window = (written as f64 * WINDOW.as_secs_f64() / took.as_secs_f64()) as i64;
    assert!(
        written >= 100 * MIB,
        "the run wrote {} MiB of records",
        written / MIB
    );
    assert!(
        peak_in_use <= 16 * MIB + 4 * per_window && peak_in_use <= written / 2,
        "peak in use {} MiB; {} MiB written, {} MiB a window",
        peak_in_use / MIB,
        written / MIB,
        per_window / MIB
    );
    // Writing stopped: within a window or two etcd compacts to the run's last revision.
    let caught_up = edl_testkit::wait_until(
        3 * WINDOW + Duration::from_secs(10),
        Duration::from_millis(500),
        || async { etcd.compact_revision(0).await.unwrap() >= last.revision },
    )
    .await;
    assert!(caught_up, "etcd compacted up to the last revision");
    // etcd deletes the compacted versions in the background. What stays in use is
    // mostly bbolt's own pages (measured 14-22 MiB here for 0.3 MB of live records).
    let bound = (32 * MIB).min(peak_in_use * 2 / 3);
    let settled = wait_until(Duration::from_secs(30), || async {
        etcd.db_status(0).await.unwrap().db_size_in_use <= bound
    })
    .await;
    let end = etcd.db_status(0).await.unwrap();
    eprintln!("in use once compacted: {} MiB", end.db_size_in_use / MIB);
    assert!(
        settled,
        "{} MiB still in use after compacting the whole run",
        end.db_size_in_use / MIB
    );
    // The file grew to the high-water mark only (freed pages are reused): it does not
    // shrink without `etcdctl defrag`.
    assert!(
        end.db_size <= peak_in_use + 32 * MIB && end.db_size <= written / 2,
        "file {} MiB, peak in use {} MiB",
        end.db_size / MIB,
        peak_in_use / MIB
    );
}
