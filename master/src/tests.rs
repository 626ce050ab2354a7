//! In-process tests of the master service: real gRPC on loopback (port 0), the
//! in-memory coordination backend. Cross-process and real-etcd tests are in `tests/`;
//! those that read tasks through the trainer's `cloud_reader` are the reader's, in
//! `edl_trainer::tasks`.

use std::sync::Arc;
use std::time::Duration;

use edl_coord::Backend;
use edl_testkit::{FaultyBackend, WATCH_STREAM};
use tokio::net::TcpListener;

use crate::server::{MasterConfig, run};
use crate::testing::{Harness, dataset};
use edl_job::{JobKeys, JobName};
use edl_master_client::{Answer, LeasedTask, MasterClient, MasterClientConfig};

/// A client of the job's masters that retries for 20 s.
fn client_of(h: &Harness) -> MasterClient {
    let mut cfg = MasterClientConfig::new(h.job.clone());
    cfg.retry_for = Duration::from_secs(20);
    MasterClient::new(h.backend.clone(), cfg, h.stop.child_token())
}

/// Job and token are checked from the headers before the body is decoded: a 5 MiB
/// request (over the master's 4 MiB) without the token is `Unauthenticated`; with the
/// token, the same request fails at decoding (the positive witness that the body would
/// have been refused only later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_are_checked_before_the_body_is_decoded() {
    use edl_proto::master as pb;
    let h = Harness::new("auth");
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut cfg = MasterConfig::new(h.job.clone());
    cfg.token = Some("s3cret".into());
    let backend = h.backend.clone();
    let stop = h.stop.child_token();
    tokio::spawn(async move { run(backend, cfg, listener, stop).await.unwrap() });
    // The listener is bound: the connection is accepted at once.
    let mut raw = pb::master_client::MasterClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .max_encoding_message_size(16 << 20);
    let huge = || pb::TaskFailedRequest {
        trainer: "t".into(),
        task_id: "x".into(),
        generation: 1,
        reason: "x".repeat(5 << 20),
        records_trained: 0,
    };
    for (job, token) in [
        ("auth", None),
        ("auth", Some("wrong")),
        ("other", Some("s3cret")),
    ] {
        let mut r = tonic::Request::new(huge());
        edl_proto::headers::set_credentials(r.metadata_mut(), job, token);
        let err = raw.task_failed(r).await.unwrap_err();
        assert_eq!(
            err.code(),
            tonic::Code::Unauthenticated,
            "{job} {token:?}: {err}"
        );
    }
    let mut r = tonic::Request::new(huge());
    edl_proto::headers::set_credentials(r.metadata_mut(), "auth", Some("s3cret"));
    let err = raw.task_failed(r).await.unwrap_err();
    assert_ne!(err.code(), tonic::Code::Unauthenticated, "{err}");
    assert!(
        err.message().contains("too large") || err.code() == tonic::Code::OutOfRange,
        "refused at decoding: {err}"
    );
    // `/metrics` on the same port wants the token too.
    let scrape = |auth: Option<&'static str>| async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let auth = auth
            .map(|a| format!("Authorization: {a}\r\n"))
            .unwrap_or_default();
        s.write_all(
            format!("GET /metrics HTTP/1.1\r\nHost: m\r\n{auth}Connection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out))
            .await
            .expect("an answer in time")
            .unwrap();
        out
    };
    for auth in [None, Some("Bearer wrong"), Some("s3cret")] {
        let out = scrape(auth).await;
        assert!(out.starts_with("HTTP/1.1 401"), "{auth:?}: {out}");
        assert!(!out.contains("edl_master"), "{auth:?}: {out}");
    }
    let out = scrape(Some("Bearer s3cret")).await;
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
}

/// A backend whose watches and ranges under `prefix` go through `faulty` (so faults hit
/// only them) and everything else straight to `inner`.
#[derive(Debug)]
struct FaultyUnder {
    inner: Arc<dyn Backend>,
    faulty: Arc<FaultyBackend>,
    prefix: String,
}

#[async_trait::async_trait]
impl Backend for FaultyUnder {
    async fn get(&self, key: &str) -> edl_coord::Result<Option<edl_coord::KeyValue>> {
        self.inner.get(key).await
    }
    async fn range(
        &self,
        prefix: &str,
    ) -> edl_coord::Result<(Vec<edl_coord::KeyValue>, edl_coord::Revision)> {
        if prefix.starts_with(&self.prefix) {
            self.faulty.range(prefix).await
        } else {
            self.inner.range(prefix).await
        }
    }
    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<edl_coord::LeaseId>,
    ) -> edl_coord::Result<edl_coord::Revision> {
        self.inner.put(key, value, lease).await
    }
    async fn delete(&self, key: &str) -> edl_coord::Result<bool> {
        self.inner.delete(key).await
    }
    async fn delete_prefix(&self, prefix: &str) -> edl_coord::Result<u64> {
        self.inner.delete_prefix(prefix).await
    }
    async fn txn(&self, txn: edl_coord::Txn) -> edl_coord::Result<edl_coord::TxnResponse> {
        self.inner.txn(txn).await
    }
    async fn compact(&self, revision: edl_coord::Revision) -> edl_coord::Result<()> {
        self.inner.compact(revision).await
    }
    async fn free_space(&self) -> edl_coord::Result<edl_coord::FreedSpace> {
        self.inner.free_space().await
    }
    async fn lease_grant(&self, ttl: Duration) -> edl_coord::Result<edl_coord::LeaseGrant> {
        self.inner.lease_grant(ttl).await
    }
    async fn lease_keep_alive_once(
        &self,
        id: edl_coord::LeaseId,
    ) -> edl_coord::Result<Option<Duration>> {
        self.inner.lease_keep_alive_once(id).await
    }
    async fn lease_revoke(&self, id: edl_coord::LeaseId) -> edl_coord::Result<()> {
        self.inner.lease_revoke(id).await
    }
    async fn lease_ttl(&self, id: edl_coord::LeaseId) -> edl_coord::Result<Option<Duration>> {
        self.inner.lease_ttl(id).await
    }
    async fn watch_prefix(
        &self,
        prefix: &str,
        start_revision: Option<edl_coord::Revision>,
    ) -> edl_coord::Result<edl_coord::WatchStream> {
        if prefix.starts_with(&self.prefix) {
            self.faulty.watch_prefix(prefix, start_revision).await
        } else {
            self.inner.watch_prefix(prefix, start_revision).await
        }
    }
}

/// The master's trainer watch ends on an error retrying cannot cure; the master goes on
/// following its trainers (watching again, and reconciling with each new listing), so a
/// trainer that dies meanwhile still gets its task requeued. (Before, the follower
/// stopped for good, and the task stayed with the dead trainer.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_lost_after_the_trainer_watch_ended_gets_its_task_requeued() {
    let dir = tempfile::tempdir().unwrap();
    let glob = dataset(dir.path(), 1, 20);
    let mut h = Harness::new("rewatch");
    let faulty = FaultyBackend::new(h.backend.clone());
    // Only the trainer watch is faulty (the election's is not: the master stays leader).
    let backend = Arc::new(FaultyUnder {
        inner: h.backend.clone(),
        faulty: faulty.clone(),
        prefix: JobKeys::new(&h.job).trainers(),
    });
    // Reconciling on a timer only once (at the start): only the follower's own listings
    // and events can requeue the task.
    h.start_master_on(backend, Duration::from_secs(3600)).await;
    let client = client_of(&h);
    client.set_dataset(vec![glob], 0, 0).await.unwrap();
    let lease = h.register("doomed").await;
    let Answer::Task(_) = client
        .get_task("doomed", 0, 1, Duration::ZERO, None)
        .await
        .unwrap()
    else {
        panic!("expected a task")
    };
    faulty.fail(&[WATCH_STREAM], || {
        edl_coord::Error::PermissionDenied("injected".into())
    });
    // The trainer dies while no watch can see it leave.
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
    faulty.clear_failures();
}

/// A new leader loading its queue (a million task records take tens of seconds; here
/// they cannot be read for a while) answers calls as loading, and a client waits for as
/// long as that lasts, past its `retry_for`, then is answered. (Before, the client gave
/// up after `retry_for`, and at a million tasks every trainer exited.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_wait_while_a_new_leader_loads_the_queue() {
    let dir = tempfile::tempdir().unwrap();
    let glob = dataset(dir.path(), 1, 20);
    let mut h = Harness::new("loading");
    h.start_master().await;
    let client = client_of(&h);
    client.set_dataset(vec![glob], 0, 0).await.unwrap();
    let _lease = h.register("t").await;
    let Answer::Task(held) = client
        .get_task("t", 0, 1, Duration::ZERO, None)
        .await
        .unwrap()
    else {
        panic!("expected a task")
    };
    let (stop, first) = h.masters.remove(0);
    stop.cancel();
    first.await.unwrap();
    // The next leader cannot read the task records until the failures are cleared.
    let faulty = FaultyBackend::new(h.backend.clone());
    faulty.fail(&["range"], || {
        edl_coord::Error::unavailable("test", "injected")
    });
    let backend = Arc::new(FaultyUnder {
        inner: h.backend.clone(),
        faulty: faulty.clone(),
        prefix: JobKeys::new(&h.job).tasks(),
    });
    h.start_master_on(backend, Duration::from_millis(200)).await;
    let mut cfg = MasterClientConfig::new(h.job.clone());
    cfg.retry_for = Duration::from_millis(500);
    let impatient = MasterClient::new(h.backend.clone(), cfg, h.stop.child_token());
    let ack = tokio::spawn({
        let (c, held) = (impatient.clone(), held.clone());
        async move { c.task_finished("t", &held, held.records, &[]).await }
    });
    // The new leader tried to load, and failed, for four times the client's patience.
    let started = tokio::time::Instant::now();
    let deadline = started + Duration::from_secs(20);
    while faulty.injected() < 3 || started.elapsed() < Duration::from_secs(2) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the new leader never tried to load"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !ack.is_finished(),
        "the acknowledgement did not wait: {:?}",
        ack.await
    );
    faulty.clear_failures();
    let acked = tokio::time::timeout(Duration::from_secs(20), ack)
        .await
        .expect("answered once the queue loaded")
        .unwrap();
    assert!(acked.unwrap(), "the held task is acknowledged");
}

/// Publishes a restore of pserver shard 0 at `incarnation` from a state holding nothing
/// (a shard that started over), as a restarting pserver does.
async fn publish_empty_restore(backend: &Arc<dyn Backend>, job: &JobName, incarnation: u64) {
    use edl_job::{RECORD_VERSION, Record, RestoreRecord};
    let r = RestoreRecord {
        version: RECORD_VERSION,
        shard: 0,
        incarnation,
        step: 0,
        contains: Default::default(),
        at_ms: 0,
    };
    backend
        .put(&JobKeys::new(job).restore(0), r.encode(), None)
        .await
        .unwrap();
}

/// Waits up to 10 s for the master's status to satisfy `done`.
async fn wait_for_status(
    client: &MasterClient,
    what: &str,
    done: impl Fn(&edl_proto::master::StatusResponse) -> bool,
) -> edl_proto::master::StatusResponse {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(st) = client.status().await {
            if done(&st) {
                return st;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: still {st:?}"
            );
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}: no status");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Takes a task for trainer `t` and acknowledges it through incarnation 5 of shard 0;
/// then takes another and returns it (held).
async fn one_done_one_held(client: &MasterClient) -> LeasedTask {
    let Answer::Task(done) = client
        .get_task("t", 0, 1, Duration::ZERO, None)
        .await
        .unwrap()
    else {
        panic!("expected a task")
    };
    assert!(
        client
            .task_finished("t", &done, done.records, &[5])
            .await
            .unwrap()
    );
    let Answer::Task(held) = client
        .get_task("t", 0, 2, Duration::ZERO, None)
        .await
        .unwrap()
    else {
        panic!("expected a second task")
    };
    held
}

/// A restore the master applied in a batch whose commit failed survives the reload: the
/// rebuilt queue reads every restore record from etcd (before, it started with none and
/// heard of a record again only when it changed, so the rewind the failed commit lost
/// was never made, and a late acknowledgement through the shard's old incarnation was
/// taken as done). On the in-memory backend here, on real etcd below.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_survives_a_failed_commit_and_a_late_ack_is_trained_again() {
    restore_survives_a_failed_commit(Harness::new("restore-reload")).await;
}

/// The same after a failover: the new leader knows the restore the old one applied
/// before its first acknowledgement, not only once its follower hears of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_survives_a_failover_and_a_late_ack_is_trained_again() {
    restore_survives_a_failover(Harness::new("restore-failover")).await;
}

/// Both restore reloads above, on a real etcd (one cluster, a job each): what etcd
/// returns for a failed commit and a failover's load is what the queue must survive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restores_survive_a_failed_commit_and_a_failover_on_real_etcd() {
    let etcd = edl_testkit::EtcdCluster::start(1)
        .await
        .expect("start etcd");
    let backend = etcd.connect().await.expect("connect to etcd");
    restore_survives_a_failed_commit(Harness::on("restore-reload", backend.clone())).await;
    restore_survives_a_failover(Harness::on("restore-failover", backend)).await;
}

async fn restore_survives_a_failed_commit(mut h: Harness) {
    let dir = tempfile::tempdir().unwrap();
    let glob = dataset(dir.path(), 1, 20);
    let faulty = FaultyBackend::new(h.backend.clone());
    h.start_master_on(faulty.clone(), Duration::from_millis(200))
        .await;
    let client = client_of(&h);
    client.set_dataset(vec![glob], 0, 0).await.unwrap();
    let _lease = h.register("t").await;
    let held = one_done_one_held(&client).await;
    // Shard 0 restarts from nothing (incarnation 9); the master's commit of that restore
    // (its next transaction: an idle master commits nothing) fails.
    faulty.fail_once("txn", || edl_coord::Error::unavailable("test", "injected"));
    publish_empty_restore(&h.backend, &h.job, 9).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while faulty.injected() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the master never committed the restore"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The held task's acknowledgement through incarnation 5 arrives after the reload.
    client
        .task_finished("t", &held, held.records, &[5])
        .await
        .unwrap();
    let st = wait_for_status(&client, "both tasks trained again", |st| {
        st.counters.as_ref().is_some_and(|c| c.recomputed == 2)
    })
    .await;
    assert_eq!(
        st.done, 0,
        "nothing the restored shard lacks is done: {st:?}"
    );
}

async fn restore_survives_a_failover(mut h: Harness) {
    let dir = tempfile::tempdir().unwrap();
    let glob = dataset(dir.path(), 1, 20);
    h.start_master().await;
    let client = client_of(&h);
    client.set_dataset(vec![glob], 0, 0).await.unwrap();
    let _lease = h.register("t").await;
    let held = one_done_one_held(&client).await;
    publish_empty_restore(&h.backend, &h.job, 9).await;
    wait_for_status(&client, "the first master applied the restore", |st| {
        st.counters.as_ref().is_some_and(|c| c.recomputed == 1)
    })
    .await;
    let (stop, first) = h.masters.remove(0);
    stop.cancel();
    first.await.unwrap();
    h.start_master().await;
    client
        .task_finished("t", &held, held.records, &[5])
        .await
        .unwrap();
    let st = wait_for_status(&client, "the held task trained again", |st| {
        st.counters.as_ref().is_some_and(|c| c.recomputed == 2)
    })
    .await;
    assert_eq!(
        st.done, 0,
        "nothing the restored shard lacks is done: {st:?}"
    );
}
