//! Leader election among operator replicas on a `coordination.k8s.io/v1` Lease, as
//! client-go's leaderelection does it: the holder renews `renewTime` every `renew`;
//! another replica takes the Lease over once `renewTime + leaseDurationSeconds` has
//! passed. Every write carries the Lease's `resourceVersion`, so of two replicas racing
//! for it the API server lets one win (409 Conflict for the other).
//!
//! The decision is [`decide`], a pure function of the Lease, who we are and the time.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

/// What to do with the Lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseAction {
    /// We hold it: renew it.
    Renew,
    /// It is free or expired: take it (a new term: `leaseTransitions` + 1).
    Take,
    /// Another replica holds it: wait.
    Wait,
}

/// Whether `me` renews, takes or waits for `lease` at `now`.
pub fn decide(lease: Option<&LeaseSpec>, me: &str, now: Timestamp) -> LeaseAction {
    let Some(spec) = lease else {
        return LeaseAction::Take;
    };
    let holder = spec.holder_identity.as_deref().unwrap_or_default();
    if holder == me {
        return LeaseAction::Renew;
    }
    let ttl = i64::from(spec.lease_duration_seconds.unwrap_or(15));
    let renewed = spec.renew_time.as_ref().map(|t| t.0.as_second());
    match renewed {
        Some(at) if !holder.is_empty() && now.as_second() < at + ttl => LeaseAction::Wait,
        _ => LeaseAction::Take,
    }
}

/// LeaseElection settings.
#[derive(Debug, Clone)]
pub struct LeaseElection {
    /// The Lease's namespace.
    pub namespace: String,
    /// The Lease's name.
    pub name: String,
    /// This replica's identity (its pod name).
    pub identity: String,
    /// How long a holder that stopped renewing keeps the Lease.
    pub lease: Duration,
    /// How often the holder renews (well under `lease`).
    pub renew: Duration,
}

async fn try_once(api: &Api<Lease>, e: &LeaseElection) -> Result<bool, kube::Error> {
    let now = Timestamp::now();
    let current = match api.get(&e.name).await {
        Ok(l) => Some(l),
        Err(kube::Error::Api(s)) if s.code == 404 => None,
        Err(err) => return Err(err),
    };
    let decision = decide(
        current.as_ref().and_then(|l| l.spec.as_ref()),
        &e.identity,
        now,
    );
    if decision == LeaseAction::Wait {
        return Ok(false);
    }
    let old = current
        .as_ref()
        .and_then(|l| l.spec.clone())
        .unwrap_or_default();
    let spec = LeaseSpec {
        holder_identity: Some(e.identity.clone()),
        lease_duration_seconds: Some(e.lease.as_secs().max(1) as i32),
        renew_time: Some(MicroTime(now)),
        acquire_time: if decision == LeaseAction::Take {
            Some(MicroTime(now))
        } else {
            old.acquire_time.clone()
        },
        lease_transitions: Some(
            old.lease_transitions.unwrap_or(0) + i32::from(decision == LeaseAction::Take),
        ),
        ..LeaseSpec::default()
    };
    let result = match current {
        None => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(e.name.clone()),
                    namespace: Some(e.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(spec),
            };
            api.create(&PostParams::default(), &lease).await
        }
        Some(mut lease) => {
            // replace() sends the resourceVersion we read: a racing write wins, we lose.
            lease.spec = Some(spec);
            api.replace(&e.name, &PostParams::default(), &lease).await
        }
    };
    match result {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
        Err(err) => Err(err),
    }
}

/// Holds the election until `shutdown`: `leading` is set while this replica leads and
/// cancelled (a fresh token each term) when it stops leading, so the work of a term
/// stops before another replica's can start. Returns when `shutdown` fires.
pub async fn run<F, Fut>(client: Client, e: LeaseElection, shutdown: CancellationToken, mut term: F)
where
    F: FnMut(CancellationToken) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let api: Api<Lease> = Api::namespaced(client, &e.namespace);
    let mut current: Option<(CancellationToken, tokio::task::JoinHandle<()>)> = None;
    let mut last_renewal = tokio::time::Instant::now();
    loop {
        let held = match try_once(&api, &e).await {
            Ok(held) => held,
            Err(err) => {
                tracing::warn!(error = %err, "leader election: cannot reach the Lease");
                // Still ours until it would have expired for the others.
                current.is_some() && last_renewal.elapsed() < e.lease - e.renew
            }
        };
        if held {
            last_renewal = tokio::time::Instant::now();
        }
        match (held, current.take()) {
            (true, Some(c)) => current = Some(c),
            (true, None) => {
                tracing::info!(identity = %e.identity, "leader election: leading");
                let token = shutdown.child_token();
                let handle = tokio::spawn(term(token.clone()));
                current = Some((token, handle));
            }
            (false, Some((token, handle))) => {
                tracing::warn!(identity = %e.identity, "leader election: lost the lease");
                token.cancel();
                let _ = handle.await;
            }
            (false, None) => {}
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(e.renew) => {}
        }
    }
    if let Some((token, handle)) = current {
        token.cancel();
        let _ = handle.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).expect("time")
    }

    fn held_by(who: &str, renewed: i64) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(who.into()),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(at(renewed))),
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn a_lease_is_renewed_by_its_holder_taken_when_free_or_expired_else_waited_for() {
        assert_eq!(decide(None, "a", at(0)), LeaseAction::Take);
        assert_eq!(
            decide(Some(&held_by("a", 0)), "a", at(100)),
            LeaseAction::Renew
        );
        assert_eq!(
            decide(Some(&held_by("b", 0)), "a", at(14)),
            LeaseAction::Wait
        );
        assert_eq!(
            decide(Some(&held_by("b", 0)), "a", at(15)),
            LeaseAction::Take
        );
        assert_eq!(decide(Some(&held_by("", 0)), "a", at(1)), LeaseAction::Take);
        let never_renewed = LeaseSpec {
            holder_identity: Some("b".into()),
            ..LeaseSpec::default()
        };
        assert_eq!(decide(Some(&never_renewed), "a", at(0)), LeaseAction::Take);
    }
}
