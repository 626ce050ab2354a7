//! Tests of the parent module.

use edl_job::{JobKeys, JobName};
use edl_testkit::etcd::EtcdCluster;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::*;
use crate::layout::Mode;
use crate::shard::testutil::{core, push};

/// One replica process in the test: its shard, replication, listener and stop.
struct Node {
    shard: Arc<Shard>,
    rep: Arc<Replication>,
    stop: CancellationToken,
}

async fn node(etcd: &EtcdCluster, id: &str, with_values: bool, cfg: &ReplicaConfig) -> Node {
    let backend = etcd.connect().await.unwrap();
    let keys = JobKeys::new(&JobName::new("r").unwrap());
    let stop = CancellationToken::new();
    let lease = Arc::new(
        Lease::grant(backend.clone(), Duration::from_secs(2), stop.clone())
            .await
            .unwrap(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let store = Arc::new(GroupStore::new(backend, keys, 0));
    let rec = MemberRecord::of_this_process(listener.local_addr().unwrap().to_string());
    store.register(id, &rec, &lease).await.unwrap();
    let shard = Arc::new(Shard::new(0, 1, 9, Arc::default()));
    if with_values {
        shard.install(core(Mode::Async, 0, 1));
    }
    let rep = Replication::start(
        id.into(),
        shard.clone(),
        store,
        lease,
        Links {
            replica: cfg.clone(),
            upstream: Upstream {
                job: "r".into(),
                token: None,
                tls: None,
            },
            stall: Duration::from_secs(5),
        },
        stop.clone(),
    );
    let (r, s) = (rep.clone(), stop.clone());
    tokio::spawn(async move {
        loop {
            let (mut conn, _) = tokio::select! {
                _ = s.cancelled() => break,
                a = listener.accept() => a.unwrap(),
            };
            let r = r.clone();
            tokio::spawn(async move {
                if let Ok((0, peer)) = accept_replica(&mut conn).await {
                    r.serve_peer(conn, peer).await;
                }
            });
        }
    });
    Node { shard, rep, stop }
}

/// The pserver's side of opening a replication connection, as `bulk` does it (the
/// hello taken as is: this test has no token).
async fn accept_replica(conn: &mut tokio::net::TcpStream) -> std::io::Result<(u32, String)> {
    let mut head = [0u8; 12];
    conn.read_exact(&mut head).await?;
    let len = u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize;
    let mut hello = vec![0u8; len];
    conn.read_exact(&mut hello).await?;
    conn.write_all(&edl_pserver_api::bulk::STATUS_OK.to_le_bytes())
        .await?;
    let mut frame = [0u8; 8];
    conn.read_exact(&mut frame).await?;
    assert_eq!(
        frame[..4],
        edl_pserver_api::bulk::KIND_REPLICATE.to_le_bytes()
    );
    let len = u32::from_le_bytes([frame[4], frame[5], frame[6], frame[7]]) as usize;
    let mut header = vec![0u8; len];
    conn.read_exact(&mut header).await?;
    replicate_header(&header).map_err(std::io::Error::other)
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "{what}: not within 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Pushes on the primary `n`, each answered only once the backups hold it.
async fn pushes(n: &Node, steps: std::ops::Range<u64>) {
    for step in steps {
        let core = n.shard.core().unwrap();
        let rep = n.rep.clone();
        let seq = tokio::task::spawn_blocking(move || {
            let p = core
                .validate_push(push(&core, "t", 1, step, 1.0, &[step % 3]))
                .unwrap();
            assert!(core.apply_async(&p).unwrap().applied);
            let seq = Replication::take_last_seq().expect("the push got no place");
            rep.local_applied(seq);
            seq
        })
        .await
        .unwrap();
        n.rep
            .wait_acked(seq, Duration::from_secs(20))
            .await
            .unwrap();
    }
}

fn state(
    n: &Node,
) -> (
    Vec<crate::checkpoint::format::BlockSnap>,
    u64,
    edl_job::ledger::LedgerSummary,
) {
    let c = n.shard.core().unwrap();
    let s = c.snapshot(0);
    (s.blocks, s.updates, c.contains())
}

/// A fresh member joins the primary's group by snapshot, follows its pushes (each
/// answered only once it holds it), and takes over with all of them when the
/// primary's lease ends; nothing is read from a checkpoint. A live member of another
/// shard (registered first, so listed first) is never recruited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_joins_follows_every_acknowledged_push_and_takes_over() {
    let etcd = EtcdCluster::start(1).await.unwrap();
    let cfg = ReplicaConfig {
        replicas: 2,
        timeout: 2_000,
        join_timeout: 20_000,
    };
    let other = node(&etcd, "1-x", false, &cfg).await;
    let a = node(&etcd, "0-a", true, &cfg).await;
    a.rep.restore(9);
    until("a primary", || a.rep.role() == Role::Primary).await;
    // Pushes before the backup exists are acknowledged by the primary alone.
    pushes(&a, 1..6).await;
    let b = node(&etcd, "0-b", false, &cfg).await;
    until("b in sync", || {
        a.rep.record().is_some_and(|r| r.backups.contains("0-b"))
    })
    .await;
    let r = a.rep.record().unwrap();
    assert!(
        !r.backups.contains("1-x") && !r.joining.contains("1-x"),
        "{r:?}"
    );
    pushes(&a, 6..40).await;
    // Every acknowledged push is in the backup (it confirmed each before the answer).
    until("b caught up", || {
        b.shard.core().is_ok_and(|c| c.updates() == 39)
    })
    .await;
    assert_eq!(state(&b), state(&a));
    // The primary's process ends (its lease revoked): the backup takes over.
    a.stop.cancel();
    until("b primary", || b.rep.role() == Role::Primary).await;
    let r = b.rep.record().unwrap();
    assert_eq!(r.primary, "0-b");
    assert_eq!(r.epoch, 2);
    assert_eq!(r.incarnation, 9, "a promotion is not a restore");
    assert_eq!(b.shard.core().unwrap().updates(), 39);
    // It serves: a push is acknowledged (alone: no other member to recruit).
    pushes(&b, 40..45).await;
    assert_eq!(b.shard.core().unwrap().updates(), 44);
    let r = b.rep.record().unwrap();
    assert!(r.backups.is_empty() && r.joining.is_empty(), "{r:?}");
    b.stop.cancel();
    other.stop.cancel();
}

#[test]
fn a_member_id_names_its_shard() {
    let id = member_id(12);
    assert_eq!(shard_of_member(&id), Some(12));
    assert!(id.starts_with("12-"), "{id}");
    assert_ne!(member_id(12), id, "a new id at every start");
    assert_eq!(shard_of_member("x-1-2"), None);
    assert_eq!(shard_of_member(""), None);
}
