//! Fault injection on the recipes (election, index claims, member registry)
//! through [`FaultyBackend`], on the in-memory backend and tokio's paused clock:
//! non-retryable errors end loops, outages and failed watches are retried with
//! backoff.

// Fixtures are plain functions, where clippy's `allow-unwrap-in-tests` does not reach.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use edl_coord::{
    Backend, Election, Error, Leadership, Lease, MemBackend, MemberEvent, MemberWatch, Registry,
    claim_index, claim_index_wait,
};
use edl_testkit::{FaultyBackend, WATCH_STREAM, wait_until};
use tokio_util::sync::CancellationToken;

fn denied() -> Error {
    Error::PermissionDenied("injected".into())
}

fn down() -> Error {
    Error::unavailable("test", "injected")
}

mod election {
    use super::*;

    const TTL: Duration = Duration::from_secs(10);

    async fn setup() -> (MemBackend, Arc<FaultyBackend>, Lease, Leadership) {
        let mem = MemBackend::new();
        let faulty = FaultyBackend::new(Arc::new(mem.clone()));
        let lease = Lease::grant(Arc::new(mem.clone()), TTL, CancellationToken::new())
            .await
            .unwrap();
        let leadership = Election::new(faulty.clone(), "/e")
            .campaign(&lease, b"me".to_vec(), &CancellationToken::new())
            .await
            .unwrap();
        (mem, faulty, lease, leadership)
    }

    #[tokio::test(start_paused = true)]
    async fn observer_ends_on_a_non_retryable_error() {
        let (_mem, faulty, _lease, _leadership) = setup().await;
        let mut rx = Election::new(faulty.clone(), "/e").observe(CancellationToken::new());
        let seen = wait_until(TTL, Duration::from_millis(10), || {
            let v = rx.borrow_and_update().is_some();
            async move { v }
        })
        .await;
        assert!(seen);
        faulty.fail(&["range", "watch_prefix", WATCH_STREAM], denied);
        let ended = tokio::time::timeout(TTL, async { while rx.changed().await.is_ok() {} }).await;
        assert!(ended.is_ok(), "the observer did not end");
    }

    #[tokio::test(start_paused = true)]
    async fn monitor_fires_lost_when_the_key_cannot_be_watched() {
        let (_mem, faulty, _lease, leadership) = setup().await;
        faulty.fail(&["watch_prefix", WATCH_STREAM], denied);
        tokio::time::timeout(TTL / 2, leadership.lost().cancelled())
            .await
            .expect("lost fires");
    }

    /// History compacted while the range that should replace it fails: the monitor
    /// backs off (it used to spin), and recovers once the range works.
    #[tokio::test(start_paused = true)]
    async fn monitor_backs_off_after_compaction_and_failed_checks() {
        let (mem, faulty, _lease, leadership) = setup().await;
        for i in 0..5 {
            mem.put(&format!("/other/{i}"), b"x".to_vec(), None)
                .await
                .unwrap();
        }
        mem.compact(mem.revision()).await.unwrap();
        faulty.fail(&["range"], down);
        faulty.break_watches();
        let before = faulty.requests();
        tokio::time::sleep(Duration::from_secs(8)).await;
        let made = faulty.requests() - before;
        assert!((2..=60).contains(&made), "{made} requests in 8 s");
        assert!(!leadership.is_lost());
        faulty.clear_failures();
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(!leadership.is_lost(), "the key is still there");
        let idle = faulty.requests();
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(
            faulty.requests(),
            idle,
            "the monitor is watching again, quietly"
        );
        leadership.resign().await.unwrap();
    }
}

mod index {
    use super::*;

    const TTL: Duration = Duration::from_secs(10);

    async fn lease(b: &MemBackend) -> Lease {
        Lease::grant(Arc::new(b.clone()), TTL, CancellationToken::new())
            .await
            .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_claim_backs_off_then_fails_on_non_retryable_errors() {
        let mem = MemBackend::new();
        let faulty = FaultyBackend::new(Arc::new(mem.clone()));
        let holder = lease(&mem).await;
        claim_index(&mem, "/ps", 1, "holder", &holder)
            .await
            .unwrap();
        let waiter = lease(&mem).await;
        let cancel = CancellationToken::new();
        // Watches that fail at once: the waiter re-lists, with backoff.
        faulty.fail(&[WATCH_STREAM], down);
        let wait = claim_index_wait(faulty.as_ref(), "/ps", 1, "waiter", &waiter, &cancel);
        tokio::pin!(wait);
        let r = tokio::time::timeout(Duration::from_secs(8), &mut wait).await;
        assert!(r.is_err(), "nothing is free");
        let made = faulty.requests();
        assert!((4..=80).contains(&made), "{made} requests in 8 s");

        faulty.clear_failures();
        faulty.fail(&["range", "watch_prefix", WATCH_STREAM], denied);
        let r = tokio::time::timeout(Duration::from_secs(8), &mut wait)
            .await
            .expect("the wait ends");
        assert!(matches!(r, Err(Error::PermissionDenied(_))), "{r:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_claim_gets_a_freed_slot() {
        let mem = MemBackend::new();
        let holder = lease(&mem).await;
        claim_index(&mem, "/ps", 1, "holder", &holder)
            .await
            .unwrap();
        let waiter = lease(&mem).await;
        let cancel = CancellationToken::new();
        let wait = claim_index_wait(&mem, "/ps", 1, "waiter", &waiter, &cancel);
        tokio::pin!(wait);
        assert!(
            tokio::time::timeout(Duration::from_secs(1), &mut wait)
                .await
                .is_err()
        );
        holder.revoke().await.unwrap();
        let claim = tokio::time::timeout(Duration::from_secs(1), &mut wait)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(claim.index, 0);
    }
}

mod registry {
    use futures::StreamExt;

    use super::*;

    async fn next(w: &mut MemberWatch) -> Option<MemberEvent> {
        tokio::time::timeout(Duration::from_secs(10), w.next())
            .await
            .expect("member watch answers within 10 s")
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_the_watch_leaves_the_callers_token_alone() {
        let reg = Registry::new(Arc::new(MemBackend::new()), "/r");
        let token = CancellationToken::new();
        drop(reg.watch_members(token.clone()));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(
            !token.is_cancelled(),
            "dropping the watch cancelled the caller's token"
        );
        // The caller's token still ends a watch.
        let mut w = reg.watch_members(token.clone());
        token.cancel();
        assert_eq!(next(&mut w).await, None);
        assert!(w.take_error().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn non_retryable_error_ends_the_stream_with_it() {
        let mem = MemBackend::new();
        let faulty = FaultyBackend::new(Arc::new(mem.clone()));
        let writer = Registry::new(Arc::new(mem.clone()), "/r");
        let lease = Lease::grant(
            Arc::new(mem.clone()),
            Duration::from_secs(10),
            CancellationToken::new(),
        )
        .await
        .unwrap();
        writer.register("a", b"1".to_vec(), &lease).await.unwrap();
        let mut w = Registry::new(faulty.clone(), "/r").watch_members(CancellationToken::new());
        assert!(matches!(next(&mut w).await, Some(MemberEvent::Joined(m)) if m.id == "a"));

        faulty.fail(&["range", "watch_prefix", WATCH_STREAM], denied);
        assert_eq!(next(&mut w).await, None, "the stream ends");
        assert!(matches!(w.take_error(), Some(Error::PermissionDenied(_))));
        // And nothing is retried any more.
        let seen = faulty.requests();
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(faulty.requests(), seen);
    }

    #[tokio::test(start_paused = true)]
    async fn outage_is_retried_with_backoff() {
        let mem = MemBackend::new();
        let faulty = FaultyBackend::new(Arc::new(mem.clone()));
        let mut w = Registry::new(faulty.clone(), "/r").watch_members(CancellationToken::new());
        tokio::time::sleep(Duration::from_millis(10)).await;
        faulty.set_down(true);
        let before = faulty.requests();
        tokio::time::sleep(Duration::from_secs(30)).await;
        let made = faulty.requests() - before;
        assert!(
            (5..=60).contains(&made),
            "{made} requests in 30 s of outage"
        );
        faulty.set_down(false);
        let lease = Lease::grant(
            Arc::new(mem.clone()),
            Duration::from_secs(10),
            CancellationToken::new(),
        )
        .await
        .unwrap();
        Registry::new(Arc::new(mem), "/r")
            .register("b", b"1".to_vec(), &lease)
            .await
            .unwrap();
        assert!(matches!(next(&mut w).await, Some(MemberEvent::Joined(m)) if m.id == "b"));
    }
}
