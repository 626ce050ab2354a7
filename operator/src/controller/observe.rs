//! What the decision looks at: the job's objects by label, its TLS Secret and
//! credentials (made here when missing), its state in etcd and its master, and its Kueue
//! Workload.
//!
//! Credentials: given admin credentials for the jobs' etcd
//! ([`ControllerConfig::etcd_auth`](super::ControllerConfig::etcd_auth)), the controller
//! makes sure, while observing a live job on a shared etcd, that the Secret
//! `<job>-edl-credentials` exists: made once, with an etcd user `edl-job-<ns>.<job>` whose
//! only role may read and write `/edl/<ns>.<job>/` (the job's name in etcd,
//! [`objects::etcd_job`](crate::objects::etcd_job))
//! ([`EtcdBackend::grant_prefix`](edl_coord::EtcdBackend::grant_prefix)) and a random job
//! token; found, it is reused as it is (the password is not reset every round). The
//! decision then gives every job pod the Secret as `envFrom`, so the job's processes work
//! as the job's user, not as the operator.

use std::sync::Arc;
use std::time::Duration;

use edl_coord::Backend;
use edl_job::{JobKeys, JobName};
use edl_master_client::overview::job_status_with;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::api::ListParams;

use super::admission::observe_workload;
use super::secrets::{ensure_credentials, ensure_tls};
use super::{Ctx, Error, JobApis, kube_err};
use crate::crd::{TaskCounts, TrainingJob};
use crate::objects::{INDEX_LABEL, JOB_LABEL, ROLE_LABEL, Role, Slot};
use crate::reconcile::{EtcdState, Finished, JobCredentials, JobTls, Observed, PodPhase, PodView};
use edl_coord::EtcdMember;

/// The pod as the decision sees it (`None`: not one of the job's pods).
pub fn pod_view(pod: &Pod) -> Option<PodView> {
    let labels = pod.metadata.labels.as_ref()?;
    let slot = Slot {
        role: Role::parse(labels.get(ROLE_LABEL)?)?,
        index: labels.get(INDEX_LABEL)?.parse().ok()?,
    };
    let status = pod.status.as_ref();
    let phase = match status.and_then(|s| s.phase.as_deref()) {
        Some("Running") => PodPhase::Running,
        Some("Succeeded") => PodPhase::Succeeded,
        Some("Failed") => PodPhase::Failed,
        Some("Unknown") => PodPhase::Unknown,
        _ => PodPhase::Pending,
    };
    let container = status
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first());
    let waiting = container
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.waiting.as_ref())
        .filter(|w| {
            !matches!(
                w.reason.as_deref(),
                None | Some("ContainerCreating" | "PodInitializing")
            )
        })
        .map(|w| {
            (
                w.reason.clone().unwrap_or_default(),
                w.message.clone().unwrap_or_default(),
            )
        });
    let unschedulable = status
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| {
            cs.iter().find(|c| {
                c.type_ == "PodScheduled"
                    && c.status == "False"
                    && c.reason.as_deref() == Some("Unschedulable")
            })
        })
        .map(|c| {
            (
                "Unschedulable".to_owned(),
                c.message.clone().unwrap_or_default(),
            )
        });
    let terminated = container
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.terminated.as_ref());
    let ran_for = terminated.and_then(|t| {
        let (start, end) = (t.started_at.as_ref()?, t.finished_at.as_ref()?);
        let secs = end.0.as_second() - start.0.as_second();
        Some(Duration::from_secs(secs.max(0) as u64))
    });
    Some(PodView {
        name: pod.name_any(),
        slot,
        phase,
        terminating: pod.metadata.deletion_timestamp.is_some(),
        problem: waiting.or(unschedulable),
        ran_for,
        exit_code: terminated.map(|t| t.exit_code),
        node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
        uid: pod.metadata.uid.clone(),
    })
}

/// How long a reconcile waits for the job's leading master's progress: shortly, since
/// the reconcile waits with it (a pod's end seen, the leases its process held are
/// revoked after this observation: a dead master's address refuses calls until its
/// leases go, and waiting longer cost each master's death 4 s). Without an answer the
/// job's status keeps the progress last known.
const MASTER_WAIT: Duration = Duration::from_millis(500);

/// The job's state in etcd (and its master's, asked with the job's `token` if it has
/// one, over its `tls` if it has that).
async fn progress(
    backend: &Arc<dyn Backend>,
    job: &JobName,
    token: Option<&str>,
    tls: Option<&edl_proto::tls::Tls>,
) -> Result<EtcdState, String> {
    let keys = JobKeys::new(job);
    let spec_published = backend
        .get(&keys.spec())
        .await
        .map_err(|e| e.to_string())?
        .is_some();
    if !spec_published {
        return Ok(EtcdState::default());
    }
    let s = job_status_with(backend, job, token, tls, MASTER_WAIT)
        .await
        .map_err(|e| e.to_string())?;
    let finished = match s.state.as_str() {
        "succeeded" => Some(Finished::Succeeded),
        "failed" => Some(Finished::Failed(
            "the job failed (edl status names why)".into(),
        )),
        "stopped" => Some(Finished::Failed("stopped by `edl kill`".into())),
        _ => None,
    };
    Ok(EtcdState {
        spec_published,
        pass: s.pass.map(|p| p.current.saturating_sub(1)),
        tasks: s.tasks.map(|t| TaskCounts {
            todo: t.todo,
            pending: t.pending,
            done: t.done,
            failed: t.failed,
        }),
        trainers: s.trainers.len() as u32,
        // Shards served (a replicated shard between a primary's loss and its
        // successor's claim is listed without an address).
        pservers: s.pservers.iter().filter(|p| !p.address.is_empty()).count() as u32,
        leader: s
            .masters
            .iter()
            .find(|m| m.leader)
            .map(|m| m.address.clone()),
        scale: s.desired_trainers,
        finished,
        paused: s.paused.clone(),
        stuck: s.stuck.clone(),
    })
}

/// What the decision looks at: the job's pods, services and claims (by the job's label), its
/// state in etcd and its credentials, and the time; and the job's TLS as the operator
/// speaks it to the job's processes and its managed etcd.
pub(super) async fn observe<'a>(
    ctx: &Ctx,
    apis: &JobApis,
    tj: &'a TrainingJob,
    ns: &str,
    job: Option<&JobName>,
) -> Result<(Observed<'a>, Option<edl_proto::tls::Tls>), Error> {
    let selector = ListParams::default().labels(&format!("{JOB_LABEL}={}", tj.name_any()));
    let pods = apis
        .pods
        .list(&selector)
        .await
        .map_err(kube_err("list the job's pods"))?;
    let services = apis
        .services
        .list(&selector)
        .await
        .map_err(kube_err("list the job's services"))?;
    let claims = apis
        .claims
        .list(&selector)
        .await
        .map_err(kube_err("list the job's claims"))?;
    let policies = apis
        .network_policies
        .list(&selector)
        .await
        .map_err(kube_err("list the job's NetworkPolicies"))?;
    let budgets = apis
        .disruption_budgets
        .list(&selector)
        .await
        .map_err(kube_err("list the job's PodDisruptionBudgets"))?;
    // Only a job that asks for Volcano: a cluster without it has no PodGroups.
    let pod_groups = if tj.spec.volcano.is_some() {
        apis.pod_groups
            .list(&selector)
            .await
            .map_err(kube_err("list the job's Volcano PodGroups"))?
            .items
    } else {
        Vec::new()
    };
    // A live job's TLS Secret. An ended or deleted one needs none any more, but for
    // the operator to read its managed etcd, which stays (then taken as it is).
    let (tls, job_tls) = if tj.spec.plaintext {
        (JobTls::Plaintext, None)
    } else if tj.is_live() {
        match ensure_tls(ctx, tj, ns, true).await {
            Ok((t, renewals)) => (JobTls::Ready(renewals), Some(t)),
            Err(why) => (JobTls::Failed(why), None),
        }
    } else if tj.spec.etcd.managed {
        let tls = ensure_tls(ctx, tj, ns, false).await.ok().map(|(t, _)| t);
        (JobTls::Plaintext, tls)
    } else {
        (JobTls::Plaintext, None)
    };
    let (etcd, credentials, etcd_members) = observe_etcd(ctx, tj, ns, job, job_tls.as_ref()).await;
    let admission = observe_workload(ctx, tj, ns).await?;
    let observed = Observed {
        job: tj,
        pods: pods.items.iter().filter_map(pod_view).collect(),
        services: services.items.iter().map(ResourceExt::name_any).collect(),
        claims: claims.items.iter().map(ResourceExt::name_any).collect(),
        claims_going: claims
            .items
            .iter()
            .filter(|c| c.metadata.deletion_timestamp.is_some())
            .map(ResourceExt::name_any)
            .collect(),
        disruption_budgets: budgets.items.iter().map(ResourceExt::name_any).collect(),
        network_policies: policies
            .items
            .into_iter()
            .map(|p| (p.name_any(), p.spec))
            .collect(),
        pod_groups: pod_groups
            .iter()
            .map(|g| {
                let min = g.data["spec"]["minMember"].as_u64().unwrap_or(0);
                (g.name_any(), u32::try_from(min).unwrap_or(u32::MAX))
            })
            .collect(),
        network: ctx.config.network.clone(),
        etcd,
        etcd_members,
        credentials,
        tls,
        admission,
        lost_nodes: lost_nodes(ctx, &pods.items),
        node_lost_after: ctx.config.node_lost_after,
        now: Time(k8s_openapi::jiff::Timestamp::now()),
    };
    Ok((observed, job_tls))
}

/// The nodes of `pods` that are not Ready (as the nodes' watch last saw them), each
/// with the time its `Ready` condition last changed. A node unknown to the watch (not
/// seen yet, or the nodes not readable) is taken as Ready: nothing is replaced on a
/// guess.
fn lost_nodes(ctx: &Ctx, pods: &[Pod]) -> std::collections::BTreeMap<String, Time> {
    let mut lost = std::collections::BTreeMap::new();
    for node in pods
        .iter()
        .filter_map(|p| p.spec.as_ref()?.node_name.as_deref())
    {
        if lost.contains_key(node) {
            continue;
        }
        let Some(n) = ctx
            .nodes
            .get(&kube::runtime::reflector::ObjectRef::new(node))
        else {
            continue;
        };
        let ready = n
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
        if let Some(c) = ready.filter(|c| c.status != "True")
            && let Some(since) = &c.last_transition_time
        {
            lost.insert(node.to_owned(), since.clone());
        }
    }
    lost
}

/// The job's own credentials, for a live, valid job on its managed etcd, or on a shared
/// etcd when the operator may make users; then the job's state, its master asked with the job's token (over
/// the job's TLS, `tls`, when it has it); and a managed etcd's membership.
async fn observe_etcd(
    ctx: &Ctx,
    tj: &TrainingJob,
    ns: &str,
    job: Option<&JobName>,
    tls: Option<&edl_proto::tls::Tls>,
) -> (
    Result<EtcdState, String>,
    JobCredentials,
    Option<Vec<EtcdMember>>,
) {
    let Some(job) = job else {
        // An invalid name fails the job in the decision; etcd is not needed.
        return (Ok(EtcdState::default()), JobCredentials::NotIssued, None);
    };
    // A job gets its own etcd user and token: on a shared etcd when the operator may
    // make users, always on its managed etcd.
    let issues = (ctx.config.etcd_auth.is_some() || tj.spec.etcd.managed) && tj.is_live();
    let b = match ctx.backend(tj, tls).await {
        Ok(b) => b,
        Err(e) => return (Err(e), JobCredentials::NotIssued, None),
    };
    // The managed etcd's membership (a lost member is replaced in it).
    let members = if tj.spec.etcd.managed {
        b.members()
            .await
            .ok()
            .map(|m| as_pods_name_them(ctx, tj, m))
    } else {
        None
    };
    let (credentials, token) = if issues {
        match ensure_credentials(ctx, &b, tj, ns, job).await {
            Ok(token) => (JobCredentials::Ready, token),
            Err(why) => (JobCredentials::Failed(why), None),
        }
    } else {
        (JobCredentials::NotIssued, None)
    };
    let b: Arc<dyn Backend> = b;
    let etcd = progress(&b, job, token.as_deref(), tls).await;
    // An etcd that cannot be read is said once, by its own condition: no job process
    // starts then anyway.
    let credentials = match (&etcd, credentials) {
        (Err(_), JobCredentials::Failed(_)) => JobCredentials::NotIssued,
        (_, c) => c,
    };
    (etcd, credentials, members)
}

/// `members` of `tj`'s managed etcd with each peer URL as the job's pods name it
/// ([`crate::objects::etcd_peer_url`]), where the operator reaches the members at other
/// addresses ([`ControllerConfig::resolve`](super::ControllerConfig): the stand-in's).
fn as_pods_name_them(ctx: &Ctx, tj: &TrainingJob, mut members: Vec<EtcdMember>) -> Vec<EtcdMember> {
    let named: Vec<(String, String)> = (0..tj.spec.etcd.members.max(1))
        .map(|i| {
            let url = crate::objects::etcd_peer_url(tj, i);
            ((ctx.config.resolve.0)(&url), url)
        })
        .collect();
    for url in members.iter_mut().flat_map(|m| m.peer_urls.iter_mut()) {
        if let Some((_, name)) = named.iter().find(|(reached, _)| reached == url) {
            *url = name.clone();
        }
    }
    members
}
