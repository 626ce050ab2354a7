use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use async_trait::async_trait;

use super::*;
use crate::backend::WatchStream;
use crate::mem::MemBackend;
use crate::types::{KeyValue, LeaseGrant, Revision, Txn, TxnResponse};

/// What the scripted backend does to lease requests.
#[derive(Debug, Default)]
struct Script {
    /// Every other keep-alive never answers (a hung etcd member the client does
    /// not fail over from by itself).
    hang_every_other: AtomicBool,
    /// Keep-alives fail as if etcd were unreachable (the lease itself is left to
    /// the inner backend).
    down: AtomicBool,
    /// Keep-alives are refused for good.
    denied: AtomicBool,
    /// Grants report this many seconds (0: the real TTL).
    grant_ttl_secs: AtomicU64,
    /// Keep-alives report `Duration::MAX`.
    huge_keep_alive_ttl: AtomicBool,
    /// Keep-alives panic.
    panic_keep_alive: AtomicBool,
    keep_alives: AtomicU32,
    /// The lease's `lost` token, and whether it had fired when the revoke came.
    lost: OnceLock<CancellationToken>,
    lost_at_revoke: Mutex<Option<bool>>,
}

#[derive(Debug)]
struct Scripted {
    inner: MemBackend,
    script: Arc<Script>,
}

fn scripted() -> (Arc<Scripted>, Arc<Script>, MemBackend) {
    let inner = MemBackend::new();
    let script = Arc::new(Script::default());
    let b = Arc::new(Scripted {
        inner: inner.clone(),
        script: script.clone(),
    });
    (b, script, inner)
}

#[async_trait]
impl Backend for Scripted {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        self.inner.get(key).await
    }
    async fn range(&self, prefix: &str) -> Result<(Vec<KeyValue>, Revision)> {
        self.inner.range(prefix).await
    }
    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision> {
        self.inner.put(key, value, lease).await
    }
    async fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(key).await
    }
    async fn delete_prefix(&self, prefix: &str) -> Result<u64> {
        self.inner.delete_prefix(prefix).await
    }
    async fn txn(&self, txn: Txn) -> Result<TxnResponse> {
        self.inner.txn(txn).await
    }
    async fn compact(&self, revision: Revision) -> Result<()> {
        self.inner.compact(revision).await
    }
    async fn free_space(&self) -> Result<crate::FreedSpace> {
        self.inner.free_space().await
    }
    async fn lease_grant(&self, ttl: Duration) -> Result<LeaseGrant> {
        let mut g = self.inner.lease_grant(ttl).await?;
        let secs = self.script.grant_ttl_secs.load(Ordering::SeqCst);
        if secs > 0 {
            g.ttl = Duration::from_secs(secs);
        }
        Ok(g)
    }
    async fn lease_keep_alive_once(&self, id: LeaseId) -> Result<Option<Duration>> {
        let n = self.script.keep_alives.fetch_add(1, Ordering::SeqCst);
        if self.script.panic_keep_alive.load(Ordering::SeqCst) {
            panic!("scripted keep-alive panic");
        }
        if self.script.down.load(Ordering::SeqCst) {
            return Err(Error::unavailable("scripted", "down"));
        }
        if self.script.denied.load(Ordering::SeqCst) {
            return Err(Error::PermissionDenied("scripted".into()));
        }
        if self.script.hang_every_other.load(Ordering::SeqCst) && n.is_multiple_of(2) {
            std::future::pending::<()>().await;
        }
        let ttl = self.inner.lease_keep_alive_once(id).await?;
        if self.script.huge_keep_alive_ttl.load(Ordering::SeqCst) {
            return Ok(ttl.map(|_| Duration::MAX));
        }
        Ok(ttl)
    }
    async fn lease_revoke(&self, id: LeaseId) -> Result<()> {
        if let Some(lost) = self.script.lost.get() {
            *self
                .script
                .lost_at_revoke
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(lost.is_cancelled());
        }
        self.inner.lease_revoke(id).await
    }
    async fn lease_ttl(&self, id: LeaseId) -> Result<Option<Duration>> {
        self.inner.lease_ttl(id).await
    }
    async fn watch_prefix(
        &self,
        prefix: &str,
        start_revision: Option<Revision>,
    ) -> Result<WatchStream> {
        self.inner.watch_prefix(prefix, start_revision).await
    }
}

const TTL: Duration = Duration::from_secs(3);

#[test]
fn the_state_follows_lost_and_the_deadline() {
    let t0 = Instant::now();
    let deadline = t0 + TTL;
    assert_eq!(state_at(false, deadline, t0), LeaseState::Held);
    assert_eq!(
        state_at(false, deadline, deadline - Duration::from_nanos(1)),
        LeaseState::Held
    );
    assert_eq!(state_at(false, deadline, deadline), LeaseState::Uncertain);
    assert_eq!(
        state_at(false, deadline, t0 + 100 * TTL),
        LeaseState::Uncertain
    );
    assert_eq!(state_at(true, deadline, t0), LeaseState::Lost);
    assert_eq!(state_at(true, deadline, deadline), LeaseState::Lost);
}

/// A renewal is scheduled a third of the TTL from now, and at least a third
/// before the deadline.
#[test]
fn next_renewal_leaves_a_period_before_the_deadline() {
    let c = Cadence { ttl: TTL };
    let now = Instant::now();
    assert_eq!(c.next_renewal(now, now + TTL), now + TTL / 3);
    // A late answer: the deadline is only 1.2 periods away.
    assert_eq!(
        c.next_renewal(now, now + TTL / 3 + TTL / 15),
        now + TTL / 15
    );
    // Deadline already behind: renew at once.
    assert!(c.next_renewal(now, now) <= now);
    // Tiny TTLs still wait the shortest period.
    let tiny = Cadence {
        ttl: Duration::from_millis(30),
    };
    assert_eq!(tiny.period(), MIN_PERIOD);
}

proptest::proptest! {
    /// Whatever the TTL and deadline: the next renewal is at most a period away,
    /// and a period before the deadline whenever that is still ahead; retries
    /// pause between 50 ms and 1 s, and never longer than half a period.
    #[test]
    fn cadence_bounds(ttl_ms in 0u64..10_000_000, deadline_ms in 0u64..20_000_000) {
        let c = Cadence { ttl: Duration::from_millis(ttl_ms) };
        let now = Instant::now();
        let deadline = now + Duration::from_millis(deadline_ms);
        let next = c.next_renewal(now, deadline);
        proptest::prop_assert!(next <= now + c.period());
        if deadline >= now + c.period() {
            proptest::prop_assert!(next + c.period() <= deadline);
            proptest::prop_assert!(next >= now);
        }
        let d = c.max_retry_delay();
        proptest::prop_assert!(d >= 2 * MIN_RETRY_DELAY && d <= MAX_RETRY_DELAY);
        proptest::prop_assert!(d <= c.period() / 2);
    }
}

/// A renewal that never answers is abandoned after a third of the TTL and tried
/// again, instead of waiting until the deadline: the lease stays held.
#[tokio::test(start_paused = true)]
async fn unanswered_renewals_are_retried_within_the_ttl() {
    let (b, script, inner) = scripted();
    script.hang_every_other.store(true, Ordering::SeqCst);
    let lease = Lease::grant(b.clone(), TTL, CancellationToken::new())
        .await
        .unwrap();
    inner
        .put("k", b"v".to_vec(), Some(lease.id()))
        .await
        .unwrap();
    let state = lease.watch_state();
    for _ in 0..20 {
        tokio::time::sleep(TTL / 2).await;
        assert_eq!(
            lease.state(),
            LeaseState::Held,
            "lease unconfirmed by hung renewals"
        );
        assert!(inner.get("k").await.unwrap().is_some());
    }
    assert!(!state.has_changed().unwrap(), "the state never changed");
    assert!(script.keep_alives.load(Ordering::SeqCst) >= 20);
}

/// etcd unreachable for ten TTLs while the server keeps the lease (as etcd does
/// through a quorum loss: its new leader extends every lease): the lease turns
/// uncertain at its deadline by our clock, is never lost, and is held again at the
/// first renewal after etcd answers.
#[tokio::test(start_paused = true)]
async fn an_outage_makes_the_lease_uncertain_not_lost_and_held_again_after() {
    let (b, script, inner) = scripted();
    let lease = Lease::grant(b.clone(), TTL, CancellationToken::new())
        .await
        .unwrap();
    inner
        .put("k", b"v".to_vec(), Some(lease.id()))
        .await
        .unwrap();
    tokio::time::sleep(TTL).await;
    let mut state = lease.watch_state();
    script.down.store(true, Ordering::SeqCst);
    // The server side stands in for etcd extending the lease meanwhile.
    let server = {
        let (inner, id) = (inner.clone(), lease.id());
        tokio::spawn(async move {
            loop {
                let _ = inner.lease_keep_alive_once(id).await;
                tokio::time::sleep(TTL / 3).await;
            }
        })
    };
    let deadline = lease.valid_until();
    state
        .wait_for(|s| *s == LeaseState::Uncertain)
        .await
        .unwrap();
    let noticed = Instant::now();
    assert!(
        noticed >= deadline && noticed <= deadline + Duration::from_millis(10),
        "uncertain at {:?} past the deadline",
        noticed.saturating_duration_since(deadline)
    );
    assert_eq!(lease.state(), LeaseState::Uncertain);
    assert!(!lease.is_held());
    tokio::time::sleep(10 * TTL).await;
    assert_eq!(lease.state(), LeaseState::Uncertain);
    assert!(!lease.is_lost(), "an outage alone never loses the lease");
    assert!(inner.get("k").await.unwrap().is_some());

    script.down.store(false, Ordering::SeqCst);
    let back = Instant::now();
    state.wait_for(|s| *s == LeaseState::Held).await.unwrap();
    assert!(
        back.elapsed() <= Cadence { ttl: TTL }.max_retry_delay(),
        "held again {:?} after etcd answered",
        back.elapsed()
    );
    assert_eq!(lease.state(), LeaseState::Held);
    assert!(lease.valid_until() > Instant::now() + TTL / 2);
    server.abort();
    // Renewed on its own from now on.
    tokio::time::sleep(5 * TTL).await;
    assert_eq!(lease.state(), LeaseState::Held);
    assert!(inner.get("k").await.unwrap().is_some());
}

/// etcd unreachable while the server lets the lease expire (this holder alone was
/// cut off): uncertain, not lost, until etcd answers that the lease is gone.
#[tokio::test(start_paused = true)]
async fn a_lease_that_ended_during_an_outage_is_lost_when_etcd_answers() {
    let (b, script, inner) = scripted();
    let lease = Lease::grant(b.clone(), TTL, CancellationToken::new())
        .await
        .unwrap();
    inner
        .put("k", b"v".to_vec(), Some(lease.id()))
        .await
        .unwrap();
    let mut state = lease.watch_state();
    script.down.store(true, Ordering::SeqCst);
    tokio::time::sleep(3 * TTL).await;
    assert!(
        inner.get("k").await.unwrap().is_none(),
        "expired on the server"
    );
    assert_eq!(lease.state(), LeaseState::Uncertain);
    assert!(!lease.is_lost(), "nobody told the holder yet");
    script.down.store(false, Ordering::SeqCst);
    tokio::time::timeout(Duration::from_secs(2), lease.lost().cancelled())
        .await
        .expect("lost fires once etcd says the lease is gone");
    assert_eq!(lease.state(), LeaseState::Lost);
    state.wait_for(|s| *s == LeaseState::Lost).await.unwrap();
}

/// A renewal refused for good (permission denied) loses the lease at once.
#[tokio::test(start_paused = true)]
async fn a_refused_renewal_loses_the_lease() {
    let (b, script, _inner) = scripted();
    let lease = Lease::grant(b, TTL, CancellationToken::new())
        .await
        .unwrap();
    script.denied.store(true, Ordering::SeqCst);
    tokio::time::timeout(TTL / 2, lease.lost().cancelled())
        .await
        .expect("lost fires at the first refused renewal");
    assert_eq!(lease.state(), LeaseState::Lost);
}

/// A server TTL too large for the clock does not panic the keeper (or the
/// grant).
#[tokio::test(start_paused = true)]
async fn huge_server_ttls_are_clamped() {
    let (b, script, _inner) = scripted();
    script.huge_keep_alive_ttl.store(true, Ordering::SeqCst);
    let lease = Lease::grant(b.clone(), TTL, CancellationToken::new())
        .await
        .unwrap();
    tokio::time::sleep(TTL * 2).await;
    assert!(script.keep_alives.load(Ordering::SeqCst) >= 2);
    assert!(!lease.is_lost(), "the keeper died");
    assert!(lease.is_held());

    let (b, script, _inner) = scripted();
    script.grant_ttl_secs.store(u64::MAX / 4, Ordering::SeqCst);
    let lease = Lease::grant(b, TTL, CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(lease.ttl(), MAX_TRACKED_TTL);
    assert!(lease.is_held());
}

/// Whatever ends the keeper, a panic included, loses the lease.
#[tokio::test(start_paused = true)]
async fn keeper_panic_fires_lost() {
    let (b, script, _inner) = scripted();
    script.panic_keep_alive.store(true, Ordering::SeqCst);
    let lease = Lease::grant(b, TTL, CancellationToken::new())
        .await
        .unwrap();
    let mut state = lease.watch_state();
    // Well before the deadline: the keeper panics at its first renewal.
    tokio::time::timeout(TTL / 2, lease.lost().cancelled())
        .await
        .expect("lost fires when the keeper panics");
    assert_eq!(lease.state(), LeaseState::Lost);
    state.wait_for(|s| *s == LeaseState::Lost).await.unwrap();
}

/// `lost` fires before the revoke is sent, on `revoke` and on the cancel token;
/// dropping the lease fires it too.
#[tokio::test(start_paused = true)]
async fn revoke_fires_lost_before_revoking() {
    let (b, script, inner) = scripted();
    let lease = Lease::grant(b.clone(), TTL, CancellationToken::new())
        .await
        .unwrap();
    script.lost.set(lease.lost()).unwrap();
    inner
        .put("k", b"v".to_vec(), Some(lease.id()))
        .await
        .unwrap();
    let state = lease.watch_state();
    lease.revoke().await.unwrap();
    assert_eq!(*script.lost_at_revoke.lock().unwrap(), Some(true));
    assert!(inner.get("k").await.unwrap().is_none());
    assert_eq!(*state.borrow(), LeaseState::Lost);

    let (b, script, inner) = scripted();
    let cancel = CancellationToken::new();
    let lease = Lease::grant(b.clone(), TTL, cancel.clone()).await.unwrap();
    script.lost.set(lease.lost()).unwrap();
    inner
        .put("k", b"v".to_vec(), Some(lease.id()))
        .await
        .unwrap();
    cancel.cancel();
    assert!(wait_revoked(&inner, "k").await, "cancel revoked the lease");
    assert_eq!(*script.lost_at_revoke.lock().unwrap(), Some(true));
    assert!(lease.is_lost());

    let (b, _script, _inner) = scripted();
    let lease = Lease::grant(b, TTL, CancellationToken::new())
        .await
        .unwrap();
    let (lost, state) = (lease.lost(), lease.watch_state());
    drop(lease);
    assert!(lost.is_cancelled());
    assert_eq!(*state.borrow(), LeaseState::Lost);
}

async fn wait_revoked(b: &MemBackend, key: &str) -> bool {
    edl_testkit::wait_until(TTL / 2, Duration::from_millis(10), || async {
        b.get(key).await.unwrap().is_none()
    })
    .await
}
