//! The operator's decision: what it observed of one TrainingJob (the resource, its
//! pods and services, the job's state in etcd, the time) in, a [`Plan`] out. Pure and
//! deterministic; the controller (the thin kube-rs edge) gathers the observation and
//! applies the plan, in the plan's order: finalizer, etcd, deletions, creations,
//! status, events.
//!
//! Invariants (checked by the property test, `reconcile/tests/property.rs`):
//! - a pod is created only for a slot the spec wants (masters `0..masters`, pservers
//!   `0..pservers * pserver_replicas` (slot `s` holds shard `s % pservers`), trainers
//!   `0..trainers` with `min_trainers <= trainers <= max_trainers` or none (`trainers`
//!   0: the job held without trainers), the etcd when managed) and only when no pod of
//!   that name exists, terminating or not (a replacement waits until its predecessor
//!   is gone);
//! - a pod is deleted only if it exists and is not already terminating;
//! - a job being deleted gets no new pods; its finalizer goes only after its etcd keys
//!   and (when the operator made them) its etcd user and role;
//! - a finished job (Succeeded or Failed) gets no new pods, and its pods still running
//!   are deleted, but for a managed etcd's, which hold its final state until the job
//!   is deleted;
//! - a job admitted through a Kueue Workload runs only while its Workload is admitted,
//!   with no more trainers than Kueue admitted; otherwise it is held as a suspended job
//!   is, and after an eviction its quota is given back only once it has no pods; its
//!   Workload is marked finished when it ends;
//! - a suspended job gets no new pods; its trainers are deleted with their drain grace
//!   period, and its masters and pservers (graceful: a final checkpoint) only once no
//!   trainer pod is left; its etcd pod (managed) stays, holding its state; a pod that
//!   goes while it is suspended, or is made when it resumes, is no recovery;
//! - the job's NetworkPolicy (its pods admit only one another, the operator, and scrapes
//!   of the metrics port) exists before its pods, and so does its Volcano PodGroup when
//!   it asks for Volcano;
//! - a pserver pod mounts a claim of its own (`<job>-checkpoints-<slot>`, made before
//!   it) unless the job names its checkpoint volume; one that does not outlive its pod
//!   (`emptyDir`) or its node (`hostPath`) is a `CheckpointsDurable=False` condition and
//!   a warning Event;
//! - a trainer beyond the desired count is deleted with its drain grace period (SIGTERM:
//!   it hands its task back), never killed outright;
//! - a job its master paused (its etcd full: the space alarm) has the condition
//!   `EtcdSpaceAlarm` and one Warning Event, until the master goes on;
//! - every scale and every replacement is an Event; every problem that keeps a pod from
//!   running (an image that cannot be pulled, an unschedulable pod, a missing volume, an
//!   unreachable etcd, credentials the operator could not make) is a condition and an
//!   Event, never a silent Pending;
//! - when the operator makes a job's credentials, no job process is created before
//!   they exist, and every one requires them; likewise its TLS Secret, unless the job
//!   asked for `plaintext`.
//!
//! Layout: [`reconcile`] (here) runs the decision's phases in order, each a method of a
//! private `Draft` (the observation, the status the job had and the one being made, the
//! plan so far); a phase that finds the job over (deleted, invalid, finished,
//! crash-looping) returns the plan itself.
//! - `observed.rs`: what the decision looks at ([`Observed`] and its parts).
//! - `plan.rs`: what it asks for ([`Plan`] and its parts).
//! - `draft.rs`: the decision under way (`Draft`), and its conditions.
//! - `ending.rs`: a job being deleted, invalid, or ended in etcd.
//! - `etcd.rs`: the job's state in etcd into the status.
//! - `suspension.rs`: a held job (suspended, or Kueue not admitting it), and its resumption.
//! - `admission.rs`: Kueue's Workload and Volcano's PodGroup.
//! - `secrets.rs`: the job's credentials and TLS Secret.
//! - `network.rs`: the job's services and NetworkPolicy.
//! - `volumes.rs`: the pservers' checkpoint claims.
//! - `pods.rs`: surplus, ended and missing pods (replacements, crash loops, recoveries).
//! - `scale.rs`: a change of the trainer count.
//! - `status.rs`: the phase and the `Running` and `Scaling` conditions.
//!
//! The slots a job wants ([`desired_slots`]) are the objects' ([`crate::objects`]).

use crate::objects::{Role, desired_slots};

use admission::within_admission;
use draft::Draft;
use ending::{being_deleted, has_finalizer, stop_running};
use suspension::Hold;

pub use observed::{
    Admission, EtcdState, Finished, JobCredentials, JobTls, Observed, PodPhase, PodView,
    TlsRenewals,
};
pub use plan::{Deletion, EtcdAction, FINALIZER, FinalizerChange, JobEvent, Plan, WorkloadChange};

/// Decides what to do about one TrainingJob.
///
/// The phases, in order (each ends the decision when it says the job is over): a job
/// being deleted only loses its keys and finalizer; an invalid spec fails the job; a
/// finished job only stops its pods; then the job's state in etcd (which may say it
/// ended), its suspension, its credentials, its PodGroup, services and checkpoint
/// claims, its ended and surplus pods (a crash loop fails the job), its missing pods,
/// its scale, and last its phase and conditions.
pub fn reconcile(obs: &Observed<'_>) -> Plan {
    let tj = obs.job;
    if tj.metadata.deletion_timestamp.is_some() {
        return being_deleted(tj);
    }
    let mut d = Draft::new(obs);
    if !has_finalizer(tj) && !tj.spec.etcd.managed {
        d.plan.finalizer = Some(FinalizerChange::Add);
    }
    d.condition(
        "Created",
        true,
        "Accepted",
        "the operator accepted the job".to_owned(),
    );
    let spec = match tj.job_spec() {
        Ok(spec) => spec,
        Err(e) => return d.invalid_spec(e.to_string()),
    };
    let desired = desired_slots(tj);
    let want = desired.iter().filter(|s| s.role == Role::Trainer).count() as u32;
    d.status.trainers.desired = want;
    if d.old.phase.is_finished() {
        // Over: stop what still runs but the managed etcd, which stays whole.
        d.finish_workload();
        stop_running(&mut d.plan, &obs.pods);
        d.lost_members();
        d.keep_managed_etcd(&desired);
        return d.plan_if_changed();
    }
    let progress = d.etcd_state();
    if let Some(p) = progress {
        if let Some(end) = &p.finished {
            d.finish_workload();
            return d.ended(end);
        }
        if !p.spec_published {
            // Under the job's name in etcd, which its processes are given (`EDL_JOB`).
            let mut published = spec.clone();
            if let Ok(name) = edl_job::JobName::new(crate::objects::etcd_job(tj)) {
                published.name = name;
            }
            d.plan
                .etcd
                .push(EtcdAction::PublishSpec(Box::new(published)));
        }
    }
    if tj.spec.suspend {
        return d.suspended(Hold::Suspend);
    }
    let desired = match &obs.admission {
        Admission::NoWorkload
        | Admission::Pending
        | Admission::Unplaced(_)
        | Admission::Evicted(_) => {
            return d.awaiting_admission();
        }
        Admission::Admitted {
            trainers: Some(admitted),
            ..
        } => within_admission(desired, *admitted),
        _ => desired,
    };
    let want = desired.iter().filter(|s| s.role == Role::Trainer).count() as u32;
    d.status.trainers.desired = want;
    d.resumed();
    let credentials_failed = d.credentials();
    let tls_failed = d.tls();
    let credentials_failed = credentials_failed.or(tls_failed);
    d.pod_group();
    d.services();
    d.checkpoint_volumes();
    d.lost_members();
    if let Some(why) = d.ended_and_surplus_pods(&desired) {
        return d.crash_loop(why);
    }
    // Job processes need the etcd (and, there, the spec) and their credentials.
    let processes_ready = progress.is_some() && credentials_failed.is_none();
    d.missing_pods(&desired, processes_ready);
    d.pods_ready(&desired);
    let running_trainers = d.scale(want, progress);
    d.phase_and_conditions(
        &desired,
        want,
        running_trainers,
        progress.is_some(),
        credentials_failed,
    );
    d.plan_if_changed()
}

mod admission;
mod draft;
mod ending;
mod etcd;
mod network;
mod observed;
mod plan;
mod pods;
mod scale;
mod secrets;
mod status;
mod suspension;
#[cfg(test)]
mod tests;
mod volumes;
