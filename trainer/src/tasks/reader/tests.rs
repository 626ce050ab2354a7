//! In-process tests of the `cloud_reader` with the master service: real gRPC on loopback
//! (port 0), the in-memory coordination backend (they moved here from the master with
//! the reader). Cross-process and real-etcd tests are in `tests/`.

use std::collections::BTreeMap;
use std::time::Duration;

use edl_coord::LeaseState;

use super::{CloudReader, Next, ReaderConfig};
use edl_master::queue::{QueueConfig, TimeoutPolicy};
use edl_master::testing::{Harness, dataset};
use edl_master_client::{Answer, MasterClient, MasterClientConfig};

/// A client of the job's masters that retries for 20 s.
fn client_of(h: &Harness) -> MasterClient {
    let mut cfg = MasterClientConfig::new(h.job.clone());
    cfg.retry_for = Duration::from_secs(20);
    MasterClient::new(h.backend.clone(), cfg, h.stop.child_token())
}

/// Reads to the end of the job, acknowledging every task: each record read with the
/// pass it was read in, and the pass ends seen.
async fn read_all(reader: &mut CloudReader) -> (Vec<(u32, String)>, u32) {
    let mut seen = Vec::new();
    let mut passes = 0;
    while let Some(item) = reader.next().await {
        match item.unwrap() {
            Next::Task(t) => {
                for r in &t.records {
                    seen.push((t.task.pass, String::from_utf8(r.clone()).unwrap()));
                }
                assert!(
                    reader
                        .acks()
                        .finished(&t.task, t.records.len() as u64, &[])
                        .await
                        .unwrap()
                );
            }
            Next::PassFinished { .. } => passes += 1,
            Next::JobFinished => break,
            Next::Drained | Next::Closed => unreachable!("the reader yields neither"),
        }
    }
    (seen, passes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_readers_see_every_record_exactly_once_per_pass() {
    let dir = tempfile::tempdir().unwrap();
    let glob = dataset(dir.path(), 3, 137);
    let mut h = Harness::new("exactly-once");
    h.start_master().await;
    let client = client_of(&h);
    let ds = client.set_dataset(vec![glob.clone()], 2, 2).await.unwrap();
    assert_eq!((ds.files, ds.records, ds.created), (3, 411, true));
    // Idempotent: the same dataset again is a no-op; another one is refused.
    assert!(
        !client
            .set_dataset(vec![glob.clone()], 2, 2)
            .await
            .unwrap()
            .created
    );
    let err = client.set_dataset(vec![glob], 3, 2).await.unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::AlreadyExists), "{err}");

    let mut readers = Vec::new();
    for i in 0..4 {
        let name = format!("trainer-{i}");
        let lease = h.register(&name).await;
        let mut reader = CloudReader::start(client_of(&h), ReaderConfig::new(name));
        readers.push(tokio::spawn(async move {
            let r = read_all(&mut reader).await;
            drop(lease);
            r
        }));
    }
    let mut count: BTreeMap<(u32, String), u32> = BTreeMap::new();
    for r in readers {
        let (seen, passes) = r.await.unwrap();
        assert_eq!(passes, 1, "each reader sees the end of pass 0");
        for s in seen {
            *count.entry(s).or_default() += 1;
        }
    }
    assert_eq!(
        count.len(),
        2 * 411,
        "every record read in each of the two passes"
    );
    assert!(
        count.values().all(|&c| c == 1),
        "each record once per pass: {:?}",
        count.iter().filter(|&(_, &c)| c != 1).collect::<Vec<_>>()
    );
    let st = client.status().await.unwrap();
    assert!(st.finished);
    let c = st.counters.unwrap();
    assert_eq!(c.records_trained, 822);
    assert_eq!(
        (c.failures, c.stale_rejected, c.duplicate_records),
        (0, 0, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_trainer_gets_its_tasks_requeued_and_stale_reports_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let glob = dataset(dir.path(), 1, 20);
    let mut h = Harness::new("lost");
    h.start_master().await;
    let client = client_of(&h);
    // 0 chunks per task and 0 passes take the master's defaults (1 and 1).
    let ds = client.set_dataset(vec![glob], 0, 0).await.unwrap();
    assert_eq!(ds.tasks, 4, "20 records, 5 a chunk, 1 chunk a task");
    let lease = h.register("doomed").await;
    let Answer::Task(task) = client
        .get_task("doomed", 0, 1, Duration::ZERO, None)
        .await
        .unwrap()
    else {
        panic!("expected a task")
    };
    // A retry of the same request gets the same lease.
    assert_eq!(
        client
            .get_task("doomed", 0, 1, Duration::ZERO, None)
            .await
            .unwrap(),
        Answer::Task(task.clone())
    );
    // The trainer's lease ends: its task goes back to todo.
    lease.revoke().await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let st = client.status().await.unwrap();
        if st.counters.as_ref().unwrap().trainer_lost == 1 {
            assert_eq!(st.pending, 0);
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "task not requeued: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let err = client
        .task_finished("doomed", &task, 5, &[])
        .await
        .unwrap_err();
    assert!(err.is_stale(), "{err}");
    assert_eq!(
        client
            .status()
            .await
            .unwrap()
            .counters
            .unwrap()
            .stale_rejected,
        1
    );
    // A live trainer finishes the pass.
    let _l = h.register("alive").await;
    let mut reader = CloudReader::start(client_of(&h), ReaderConfig::new("alive"));
    let (seen, _) = read_all(&mut reader).await;
    assert_eq!(seen.len(), 20);
}

/// Reports with oversized fields (a 2 MiB failure reason, 10,000 shard incarnations, a
/// trainer id with a '/', a 1 MiB task id) are refused with InvalidArgument, leave the
/// task and the queue as they were, and do not disturb another trainer reading the pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_report_fields_are_refused_without_disturbing_other_trainers() {
    use edl_proto::master as pb;
    let dir = tempfile::tempdir().unwrap();
    let glob = dataset(dir.path(), 1, 40);
    let mut h = Harness::new("bounds");
    h.start_master().await;
    let client = client_of(&h);
    client.set_dataset(vec![glob], 0, 0).await.unwrap();
    let _a = h.register("a").await;
    let Answer::Task(task) = client
        .get_task("a", 0, 1, Duration::ZERO, None)
        .await
        .unwrap()
    else {
        panic!("expected a task")
    };
    // A raw client, as a hostile or broken peer would be (edl's client cuts reasons).
    let mut leader =
        edl_master_client::observe_leader(h.backend.clone(), &h.job, h.stop.child_token());
    let addr = loop {
        if let Some(l) = leader.borrow_and_update().as_ref() {
            break String::from_utf8_lossy(&l.value).into_owned();
        }
        tokio::time::timeout(Duration::from_secs(10), leader.changed())
            .await
            .expect("a leader within 10 s")
            .unwrap();
    };
    let mut raw = pb::master_client::MasterClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .max_encoding_message_size(8 << 20);
    fn req<T>(msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        edl_proto::headers::set_credentials(r.metadata_mut(), "bounds", None);
        r
    }
    let failed = |reason: String, trainer: &str, id: &str| pb::TaskFailedRequest {
        trainer: trainer.to_owned(),
        task_id: id.to_owned(),
        generation: task.generation,
        reason,
        records_trained: 0,
    };
    // Another trainer reads the whole pass meanwhile.
    let _b = h.register("b").await;
    let mut reader = CloudReader::start(client_of(&h), ReaderConfig::new("b"));
    let other = tokio::spawn(async move { read_all(&mut reader).await });
    for (what, msg) in [
        ("2 MiB reason", failed("x".repeat(2 << 20), "a", &task.id)),
        ("trainer id", failed("bad".into(), "a/b", &task.id)),
        ("task id", failed("bad".into(), "a", &"t".repeat(1 << 20))),
    ] {
        let err = raw.task_failed(req(msg)).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{what}: {err}");
    }
    let err = raw
        .task_finished(req(pb::TaskFinishedRequest {
            trainer: "a".into(),
            task_id: task.id.clone(),
            generation: task.generation,
            records: 5,
            shard_incarnations: vec![1; 10_000],
        }))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    assert!(err.message().contains("at most 256"), "{err}");
    // Nothing was applied: the task is still a's, and a reason just under the bound is
    // taken (the record keeps its first 256 bytes).
    let st = client.status().await.unwrap();
    assert_eq!(st.counters.as_ref().unwrap().failures, 0, "{st:?}");
    let long = "y".repeat(60 << 10);
    assert!(client.task_failed("a", &task, &long, 0).await.unwrap());
    // The other trainer read every record but the failed task's (requeued, it reads it
    // too: 40 in all), and saw no error.
    let (seen, _) = other.await.unwrap();
    assert_eq!(seen.len(), 40);
    let st = client.status().await.unwrap();
    assert_eq!(st.counters.unwrap().failures, 1, "the one accepted report");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_chunk_fails_its_task_after_max_failures_and_the_pass_ends() {
    let dir = tempfile::tempdir().unwrap();
    let glob = dataset(dir.path(), 2, 50);
    // Flip a byte inside the payload of part-001's third chunk.
    let bad = dir.path().join("part-001.recordio");
    let index = edl_recordio::ChunkIndex::build(&bad).unwrap();
    let mut bytes = std::fs::read(&bad).unwrap();
    let at = index.chunks[2].offset as usize + edl_recordio::HEADER_LEN + 3;
    bytes[at] ^= 0xff;
    std::fs::write(&bad, bytes).unwrap();

    let mut h = Harness::new("corrupt");
    h.start_master().await;
    let client = client_of(&h);
    client.set_dataset(vec![glob], 1, 1).await.unwrap();
    let _l = h.register("t").await;
    let mut reader = CloudReader::start(client_of(&h), ReaderConfig::new("t"));
    let (seen, _) = read_all(&mut reader).await;
    assert_eq!(seen.len(), 95, "all but the corrupt chunk's 5 records");
    let st = client.status().await.unwrap();
    assert!(st.finished);
    assert_eq!(st.failed_tasks.len(), 1);
    let f = &st.failed_tasks[0];
    assert!(f.reason.contains("part-001.recordio"), "{}", f.reason);
    assert!(f.reason.contains("corrupt"), "{}", f.reason);
    assert_eq!(f.records, 5);
    let c = st.counters.unwrap();
    assert_eq!(
        c.failures, 4,
        "max_failures = 3, so the 4th failure is final"
    );
    assert_eq!(c.lost_records, 5);
}

/// A reader whose trainer's lease is uncertain asks for no new task, while the master
/// has some to give, until the lease is held again (the state is a plain watch here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_takes_no_task_while_its_lease_is_uncertain() {
    let dir = tempfile::tempdir().unwrap();
    let glob = dataset(dir.path(), 1, 20);
    let mut h = Harness::new("uncertain");
    h.start_master().await;
    let client = client_of(&h);
    client.set_dataset(vec![glob], 1, 1).await.unwrap();
    let _lease = h.register("t").await;
    let (state, rx) = tokio::sync::watch::channel(LeaseState::Uncertain);
    let mut cfg = ReaderConfig::new("t");
    cfg.lease = Some(rx);
    let mut reader = CloudReader::start(client_of(&h), cfg);
    let early = tokio::time::timeout(Duration::from_secs(1), reader.next()).await;
    assert!(early.is_err(), "a task arrived with the lease uncertain");
    let st = client.status().await.unwrap();
    assert_eq!(
        (st.pending, st.todo),
        (0, 4),
        "the tasks were there to lease"
    );

    state.send(LeaseState::Held).unwrap();
    let item = tokio::time::timeout(Duration::from_secs(10), reader.next())
        .await
        .expect("a task once the lease is held")
        .unwrap()
        .unwrap();
    assert!(matches!(item, Next::Task(_)), "{item:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_and_readers_continue() {
    let dir = tempfile::tempdir().unwrap();
    let glob = dataset(dir.path(), 2, 100);
    let mut h = Harness::new("failover");
    h.start_master().await;
    let client = client_of(&h);
    client.set_dataset(vec![glob], 1, 1).await.unwrap();
    h.start_master().await;
    let _l = h.register("t").await;
    let mut reader = CloudReader::start(client_of(&h), ReaderConfig::new("t"));
    let mut seen = Vec::new();
    let mut stopped = false;
    while let Some(item) = reader.next().await {
        match item.unwrap() {
            Next::Task(t) => {
                seen.extend(
                    t.records
                        .iter()
                        .map(|r| String::from_utf8(r.clone()).unwrap()),
                );
                reader
                    .acks()
                    .finished(&t.task, t.records.len() as u64, &[])
                    .await
                    .unwrap();
                if seen.len() >= 50 && !stopped {
                    // Stop the leader: the standby takes over from etcd state.
                    let (stop, handle) = h.masters.remove(0);
                    stop.cancel();
                    handle.await.unwrap();
                    stopped = true;
                }
            }
            Next::PassFinished { .. } => {}
            Next::JobFinished => break,
            Next::Drained | Next::Closed => unreachable!("the reader yields neither"),
        }
    }
    assert!(stopped);
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 200, "every record, none lost");
    let st = client.status().await.unwrap();
    assert!(st.finished);
    assert!(st.counters.unwrap().failovers >= 1);
}

/// Read-ahead follows the consumer: while the trainer initialises (before its first
/// `next`) and while it evaluates (after a pass-end item), the reader leases nothing, so
/// no read-ahead lease times out however long the pause; within a pass it does read
/// ahead. Each pause outlasts a task lease: a control lease taken at its start times out.
/// The lease (2 s) is far longer than the test takes to acknowledge a task even on a
/// loaded 2-core machine (milliseconds), so within a pass no lease times out: the count
/// of timeouts is exactly the control leases'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_read_ahead_lease_times_out_while_the_trainer_initialises_or_evaluates() {
    const TIMEOUT_MS: u64 = 2000;
    let dir = tempfile::tempdir().unwrap();
    let glob = dataset(dir.path(), 1, 40);
    let mut h = Harness::new("pauses");
    let queue = QueueConfig {
        timeout: TimeoutPolicy {
            initial: TIMEOUT_MS,
            floor: TIMEOUT_MS,
            ceiling: TIMEOUT_MS,
            ..TimeoutPolicy::default()
        },
        ..QueueConfig::default()
    };
    h.start_master_with(h.backend.clone(), Duration::from_millis(200), queue)
        .await;
    let client = client_of(&h);
    client.set_dataset(vec![glob], 1, 2).await.unwrap();
    let _t = h.register("t").await;
    let _idle = h.register("idle").await;
    let counters = |st: &edl_proto::master::StatusResponse| st.counters.unwrap();
    // A pause of the trainer: a control lease taken after the reader is up, held by a
    // trainer that never reports, until the master timed it out.
    let pause = |pass: u32, request: u64| {
        let client = client.clone();
        async move {
            let before = counters(&client.status().await.unwrap()).timeouts;
            let next = client
                .get_task("idle", pass, request, Duration::ZERO, None)
                .await
                .unwrap();
            assert!(matches!(next, Answer::Task(_)), "{next:?}");
            let timed_out = edl_testkit::wait_until(
                Duration::from_secs(30),
                Duration::from_millis(20),
                || async { counters(&client.status().await.unwrap()).timeouts > before },
            )
            .await;
            assert!(timed_out, "the control lease timed out");
            let st = client.status().await.unwrap();
            assert_eq!(st.pending, 0, "the reader leased nothing during the pause");
            st
        }
    };

    let mut reader = CloudReader::start(client_of(&h), ReaderConfig::new("t"));
    // Initialising.
    let st = pause(0, 1).await;
    assert_eq!(counters(&st).dispatched, 1, "only the control lease");

    let mut passes = Vec::new();
    let mut records = 0;
    let mut witnessed_read_ahead = false;
    while let Some(item) = reader.next().await {
        match item.unwrap() {
            Next::Task(t) => {
                if !witnessed_read_ahead {
                    // Holding this task, the reader leases ahead of the trainer.
                    witnessed_read_ahead = edl_testkit::wait_until(
                        Duration::from_secs(10),
                        Duration::from_millis(10),
                        || async { client.status().await.unwrap().pending >= 3 },
                    )
                    .await;
                    assert!(witnessed_read_ahead, "two tasks leased ahead");
                }
                records += t.records.len();
                reader
                    .acks()
                    .finished(&t.task, t.records.len() as u64, &[])
                    .await
                    .unwrap();
            }
            Next::PassFinished { ended, next } => {
                passes.push(ended);
                // Evaluating.
                let st = pause(next, 2).await;
                assert_eq!(st.pass, next);
            }
            Next::JobFinished => break,
            Next::Drained | Next::Closed => unreachable!("the reader yields neither"),
        }
    }
    assert_eq!(
        (passes, records),
        (vec![0], 80),
        "both passes, every record"
    );
    let st = client.status().await.unwrap();
    assert!(st.finished);
    let c = counters(&st);
    assert_eq!(c.timeouts, 2, "the two control leases only");
    assert_eq!(c.cutoff_records, 10, "the control leases' 5 records each");
    assert_eq!((c.failed_tasks, c.lost_records), (0, 0));
}
