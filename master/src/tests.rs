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
use edl_job::JobKeys;
use edl_master_client::Answer;

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

/// A backend whose watches under `prefix` go through `faulty` (so faults hit only them)
/// and everything else straight to `inner`.
#[derive(Debug)]
struct FaultyWatchesUnder {
    inner: Arc<dyn Backend>,
    faulty: Arc<FaultyBackend>,
    prefix: String,
}

#[async_trait::async_trait]
impl Backend for FaultyWatchesUnder {
    async fn get(&self, key: &str) -> edl_coord::Result<Option<edl_coord::KeyValue>> {
        self.inner.get(key).await
    }
    async fn range(
        &self,
        prefix: &str,
    ) -> edl_coord::Result<(Vec<edl_coord::KeyValue>, edl_coord::Revision)> {
        self.inner.range(prefix).await
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
    let backend = Arc::new(FaultyWatchesUnder {
        inner: h.backend.clone(),
        faulty: faulty.clone(),
        prefix: JobKeys::new(&h.job).trainers(),
    });
    // Reconciling on a timer only once (at the start): only the follower's own listings
    // and events can requeue the task.
    h.start_master_on(backend, Duration::from_secs(3600)).await;
    let client = h.client();
    client.set_dataset(vec![glob], 0, 0).await.unwrap();
    let lease = h.register("doomed").await;
    let Answer::Task(_) = client
        .get_task("doomed", 0, 1, Duration::ZERO)
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
