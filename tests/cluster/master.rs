//! The master against real etcd, with trainers (`edl consume`) and masters SIGKILLed.

use std::collections::BTreeMap;
use std::time::Duration;

use edl_master::client::Next;
use tokio::time::Instant;

use crate::support::{World, wait_until};

/// `GET /metrics` from a master over plain HTTP/1.1.
async fn get_metrics(addr: &str) -> String {
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
async fn a_killed_trainer_task_is_back_in_todo_within_ttl_plus_1s() {
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
    // Lease TTL 2 s + 1 s.
    assert!(took <= Duration::from_secs(3), "requeue took {took:?}");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leading_master_mid_pass_loses_nothing() {
    let w = World::new("master-kill").await;
    let (glob, all) = w.dataset(3, 150);
    let (mut m0, a0) = w.master("m0", &[]).await;
    let client = w.client();
    client.set_dataset(vec![glob], 1, 1).await.unwrap();
    let (mut m1, a1) = w.master("m1", &[]).await;
    let names = ["c0", "c1"];
    let mut consumers: Vec<_> = names
        .iter()
        .map(|n| w.consumer(n, &["--per-record", "1ms"]))
        .collect();
    let started = wait_until(Duration::from_secs(20), || async {
        client.status().await.is_ok_and(|s| s.done >= 5)
    })
    .await;
    assert!(started, "no progress before the kill");
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
    let Next::Task(task) = client.get_task("old", 0, 1, Duration::ZERO).await.unwrap() else {
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
        let Next::Task(t) = client
            .get_task("new", 0, request, Duration::ZERO)
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
