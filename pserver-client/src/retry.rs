//! One call to one shard, retried: transient failures (unreachable, moved, not serving)
//! are retried at the shard's current pserver with a bounded backoff until the call's
//! `retry_for` ends; each caller says how the refusals it expects are treated (a retry,
//! or a specific error).

use std::time::Duration;

use edl_coord::{CallError, call_until};

use crate::connection::Target;
use crate::error::{ErrorKind, next_step_of};
use crate::{PsClient, PsClientError, Result};

/// A call being retried, for the config's [`RetryObserver`](crate::RetryObserver).
struct Recovering<'a>(&'a dyn crate::RetryObserver);

impl<'a> Recovering<'a> {
    fn begin(o: &'a dyn crate::RetryObserver) -> Self {
        o.retrying(true);
        Recovering(o)
    }
}

impl Drop for Recovering<'_> {
    fn drop(&mut self) {
        self.0.retrying(false);
    }
}

/// Codes worth retrying (possibly at a replacement pserver).
fn retryable(s: &tonic::Status) -> bool {
    edl_proto::headers::transient(s) || ErrorKind::of(s) == Some(ErrorKind::NotServing)
}

/// How one attempt of a call ended.
pub(super) type Attempt<R> = edl_coord::Attempt<R, PsClientError>;

impl PsClient {
    /// Runs `op` on shard `shard`, retrying transient failures (reconnecting to the
    /// shard's current holder) until `retry_for` ends. `classify` may turn a refusal into
    /// a retry or a specific error.
    pub(super) async fn call<T, R, F, Fut>(
        &self,
        shard: u32,
        msg: T,
        timeout: Duration,
        op: F,
        classify: impl Fn(&tonic::Status) -> Option<Attempt<R>>,
    ) -> Result<R>
    where
        T: Clone,
        F: Fn(Target, tonic::Request<T>) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<tonic::Response<R>, tonic::Status>>,
    {
        let observer = self.inner.cfg.observer.as_deref();
        let (mut attempts, mut recovering) = (0u32, None);
        let r = call_until(self.inner.cfg.retry_for, &self.inner.cancel, |until| {
            attempts += 1;
            if attempts == 2 {
                recovering = observer.map(Recovering::begin);
            }
            let (op, msg, classify) = (&op, &msg, &classify);
            async move {
                match self.client(shard, until).await {
                    Ok((c, revision)) => match tokio::select! {
                        r = op(c, self.request(msg.clone(), timeout)) => Some(r),
                        _ = self.moved(shard, revision) => None,
                    } {
                        None => {
                            self.inner.conns.lock().await.remove(&shard);
                            Attempt::Retry(format!("shard {shard} moved to another pserver"))
                        }
                        Some(Ok(resp)) => Attempt::Done(resp.into_inner()),
                        Some(Err(s)) => match classify(&s) {
                            Some(a) => a,
                            None if retryable(&s) => {
                                // The shard may have moved: reconnect on the next attempt.
                                self.inner.conns.lock().await.remove(&shard);
                                Attempt::Retry(format!("{}: {}", s.code(), s.message()))
                            }
                            None => Attempt::Fail(PsClientError::Refused { shard, status: s }),
                        },
                    },
                    Err(e) => Attempt::Retry(e),
                }
            }
        })
        .await;
        drop(recovering);
        r.map_err(|e| match e {
            CallError::Failed(e) => e,
            CallError::Cancelled => PsClientError::Cancelled,
            CallError::GaveUp { waited, last } => PsClientError::Unavailable {
                job: self.inner.cfg.job.to_string(),
                shard,
                waited,
                last,
            },
        })
    }
}

pub(super) fn spec_mismatch<R>(s: &tonic::Status, shard: u32) -> Option<Attempt<R>> {
    (ErrorKind::of(s) == Some(ErrorKind::SpecMismatch)).then(|| {
        Attempt::Fail(PsClientError::SpecMismatch(format!(
            "shard {shard}: {}",
            s.message()
        )))
    })
}

pub(super) fn uninitialised<R>(s: &tonic::Status, shard: u32) -> Option<Attempt<R>> {
    (ErrorKind::of(s) == Some(ErrorKind::Uninitialised)).then(|| {
        Attempt::Fail(PsClientError::Refused {
            shard,
            status: s.clone(),
        })
    })
}

pub(super) fn push_refusal<R>(
    s: &tonic::Status,
    shard: u32,
    step: u64,
    sync: bool,
) -> Option<Attempt<R>> {
    match ErrorKind::of(s) {
        // A sync step's pushes wait for each other, and each trainer pulls only after
        // its push: nobody would pull, so the pusher does.
        Some(ErrorKind::Uninitialised) if sync => {
            Some(Attempt::Fail(PsClientError::Uninitialised { shard }))
        }
        Some(ErrorKind::StaleStep) => Some(Attempt::Fail(PsClientError::StaleStep {
            step,
            next: next_step_of(s).unwrap_or(step + 1),
        })),
        Some(ErrorKind::Overlap) => Some(Attempt::Fail(PsClientError::Overlap {
            shard,
            msg: s.message().to_owned(),
        })),
        // Another trainer's pull initialises a shard that lost its parameters.
        Some(ErrorKind::Uninitialised) => Some(Attempt::Retry(format!(
            "shard {shard} has no parameters yet"
        ))),
        _ => None,
    }
}
