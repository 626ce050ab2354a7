//! A job pod whose process dies is noticed from its pod's status, not its lease (issue
//! 56): the operator revokes the leases the dead process held before it replaces the pod
//! (a trainer's registration, so the master hands its tasks out again; a pserver's shard
//! claim and replica registration, so its replacement claims the shard; a master's
//! candidacy, so its replacement leads), and a pod deleted with a grace period (a node drain, a
//! preemption) hands its work back within it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use edl_coord::{Backend, KeyValue};
use edl_job::{JobKeys, PserverRecord, Record, TrainerRecord};
use edl_operator::TrainingJob;
use edl_operator::crd::{EtcdSpec, Phase};
use edl_operator::metrics::Metrics;
use edl_testkit::Signal;
use kube::Api;
use kube::api::{DeleteParams, PostParams};

use super::{NS, OnOperator, mnist_job, pod_logs, succeeded};
use crate::support::{World, env_u64, median_p95_max, wait_until};
use crate::trainer::mnist;

/// The job's lease: a process noticed only by its lease would hold on for a minute.
const LEASE_S: u64 = 60;
/// Each fault must be noticed well within the lease (a third of it: no timing bound
/// tuned to this machine, only the line between "from its pod's status" and "from its
/// lease").
const NOTICED_WITHIN: Duration = Duration::from_secs(LEASE_S / 3);

/// The job's processes and their keys in etcd, as this test watches them.
struct Job<'a> {
    backend: &'a Arc<dyn Backend>,
    keys: JobKeys,
}

impl Job<'_> {
    async fn range(&self, prefix: &str) -> Vec<KeyValue> {
        self.backend
            .range(prefix)
            .await
            .map(|(kvs, _)| kvs)
            .unwrap_or_default()
    }

    async fn trainers(&self) -> Vec<KeyValue> {
        self.range(&self.keys.trainers()).await
    }

    /// Shard 0's claim: the record of the pserver serving it.
    async fn claim(&self) -> Option<PserverRecord> {
        let kv = self.backend.get(&self.keys.ps(0)).await.ok()??;
        PserverRecord::decode(&kv.value).ok()
    }

    /// The leading master's candidacy key and its instance (`<pod>.<uid>`).
    async fn leader(&self) -> Option<(String, String)> {
        let mut candidates = self.range(&self.keys.master_election()).await;
        candidates.sort_by_key(|kv| kv.create_revision);
        let lead = candidates.first()?;
        let instances = self.range(&self.keys.master_instances()).await;
        let own = instances.iter().find(|kv| kv.lease == lead.lease)?;
        let instance = own.key.strip_prefix(&self.keys.master_instances())?;
        Some((lead.key.clone(), instance.to_owned()))
    }

    /// Whether every role serves: two trainers registered, shard 0 claimed, the master
    /// leading.
    async fn whole(&self) -> bool {
        self.trainers().await.len() == 2
            && self.claim().await.is_some()
            && self.leader().await.is_some()
    }
}

/// The pod of instance `<pod>.<uid>`.
fn pod_of(instance: &str) -> &str {
    instance.rsplit_once('.').map_or(instance, |(pod, _)| pod)
}

/// The times of one kind of fault: from the fault to its process's leases gone, and to
/// its role serving again.
#[derive(Default)]
struct Times {
    noticed: Vec<f64>,
    served: Vec<f64>,
}

impl Times {
    fn line(&self, what: &str) -> String {
        let (m, p, x) = median_p95_max(self.noticed.clone());
        let (sm, sp, sx) = median_p95_max(self.served.clone());
        format!(
            "{what}: {} faults; noticed after median {m:.2} s, p95 {p:.2} s, max {x:.2} s; \
             served again after median {sm:.2} s, p95 {sp:.2} s, max {sx:.2} s",
            self.noticed.len()
        )
    }
}

/// With a 60 s lease, each role's process SIGKILLed in its pod (a trainer, the pserver
/// of the job's one shard, the job's one master: no standby, whose own watch of the
/// leader would notice it first) is noticed from its pod's status: its leases are gone
/// within a third of the lease, and its role serves again (two trainers registered, the
/// shard claimed by its replacement, the replacement master leading). A
/// trainer pod deleted with its grace period (a preemption notice: SIGTERM) hands its
/// task back and leaves at once. The job then succeeds with nothing failed, and its
/// status lists the recoveries. Without the revocations each killed process's keys
/// would stay for the whole lease.
///
/// `EDL_OPERATOR_FAULTS` (default 1) repeats the four faults that many times and prints
/// each kind's median, p95 and max: docs/benchmarks.md's figures on the operator
/// (`cargo nextest run --profile soak ...`: the default profile stops a test at 5
/// minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_pod_of_each_role_is_noticed_from_its_status_not_after_its_lease() {
    const JOB: &str = "mnist-killed";
    let rounds = env_u64("EDL_OPERATOR_FAULTS", 1).max(1);
    let w = World::new("unused").await;
    let (train, test) = mnist(w.dir.path());
    let metrics = Arc::new(Metrics::default());
    let OnOperator {
        pods_dir,
        client,
        _kubelet: kubelet,
        stop,
        operator,
        ..
    } = OnOperator::start(&w, None, metrics.clone()).await;
    // Passes enough for every fault while the job trains (a round took about 2 s, a
    // pass about 3 s here).
    let passes = 6 + rounds as u32;
    let mut tj = mnist_job(
        JOB,
        (&train, &test),
        passes,
        &format!("{LEASE_S}s"),
        EtcdSpec {
            endpoints: w.etcd.endpoints(),
            ..EtcdSpec::default()
        },
    );
    // Each kill ends a pod that ran for seconds, under `healthy_after`: the operator
    // counts it toward a crash loop (it cannot tell an injected fault), so rounds of
    // kills need a bound above their number.
    tj.spec.cluster.max_restarts = 10 + 2 * rounds as u32;
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);
    jobs.create(&PostParams::default(), &tj)
        .await
        .expect("create the job");
    let job = Job {
        backend: &w.backend,
        keys: JobKeys::new(&super::etcd_job(JOB)),
    };
    let within = Duration::from_secs(120);
    let running = || async {
        jobs.get(JOB)
            .await
            .ok()
            .and_then(|j| j.status)
            .is_some_and(|s| s.pass >= Some(1) && s.phase == Phase::Running)
    };
    let (mut trainer, mut pserver, mut master, mut notice) = Default::default();
    for round in 0..rounds {
        let ready = wait_until(within, || async { running().await && job.whole().await }).await;
        assert!(
            ready,
            "round {round}: the job is not whole and training\n{}",
            pod_logs(&pods_dir)
        );
        kill_trainer(&job, &mut trainer, &pods_dir).await;
        assert!(
            wait_until(within, || job.whole()).await,
            "{}",
            pod_logs(&pods_dir)
        );
        kill_pserver(&job, &mut pserver, &pods_dir).await;
        assert!(
            wait_until(within, || job.whole()).await,
            "{}",
            pod_logs(&pods_dir)
        );
        kill_master(&job, &kubelet, &mut master, &pods_dir).await;
        assert!(
            wait_until(within, || job.whole()).await,
            "{}",
            pod_logs(&pods_dir)
        );
        notice_trainer(&job, &client, &mut notice, &pods_dir).await;
        eprintln!("round {} of {rounds}: four faults noticed", round + 1);
        let finished = jobs
            .get(JOB)
            .await
            .ok()
            .and_then(|j| j.status)
            .is_some_and(|s| s.phase.is_finished());
        assert!(
            !finished,
            "round {round}: the job finished before its faults (raise the passes)"
        );
    }
    let s = succeeded(&jobs, JOB, &pods_dir).await;
    // The witnesses: the operator saw each role's pod end and replaced it, and it was
    // the operator that revoked each killed process's leases (a replacement master, as
    // a standby, would also find its predecessor's address dead, some seconds later).
    for role in ["trainer", "pserver", "master"] {
        assert!(
            s.recoveries.iter().any(|r| r.role == role),
            "no {role} recovery: {:?}",
            s.recoveries
        );
        assert!(
            metrics.revoked_of(role) >= rounds,
            "the operator revoked {} leases of ended {role} processes in {rounds} rounds",
            metrics.revoked_of(role)
        );
    }
    for (times, what) in [
        (&trainer, "SIGKILL of a trainer"),
        (&pserver, "SIGKILL of the pserver"),
        (&master, "SIGKILL of the leading master"),
        (&notice, "a trainer pod deleted (SIGTERM)"),
    ] {
        eprintln!("on the operator, {LEASE_S} s lease: {}", times.line(what));
    }
    stop.cancel();
    operator.await.expect("operator");
}

/// Asserts that `gone` (the victim's leases gone) comes true within [`NOTICED_WITHIN`]
/// of `at`, then waits for `back` (its role serving again); records both.
async fn time_fault<G, GF, B, BF>(
    what: &str,
    at: Instant,
    times: &mut Times,
    pods_dir: &std::path::Path,
    gone: G,
    back: B,
) where
    G: FnMut() -> GF,
    GF: std::future::Future<Output = bool>,
    B: FnMut() -> BF,
    BF: std::future::Future<Output = bool>,
{
    let noticed = wait_until(NOTICED_WITHIN, gone).await;
    assert!(
        noticed,
        "{what}: its leases still held {:?} after the fault ({LEASE_S} s lease)\n{}",
        at.elapsed(),
        pod_logs(pods_dir)
    );
    times.noticed.push(at.elapsed().as_secs_f64());
    let served = wait_until(Duration::from_secs(120), back).await;
    assert!(served, "{what}: never served again\n{}", pod_logs(pods_dir));
    times.served.push(at.elapsed().as_secs_f64());
}

/// SIGKILLs a registered trainer (by the pid it registered: a process this test's
/// kubelet started): noticed when its registration is gone, served again when two
/// trainers are registered again.
async fn kill_trainer(job: &Job<'_>, times: &mut Times, pods_dir: &std::path::Path) {
    let victim = job.trainers().await.remove(0);
    let pid = TrainerRecord::decode(&victim.value)
        .expect("a trainer record")
        .pid;
    let at = Instant::now();
    edl_testkit::signal(pid, Signal::SIGKILL).expect("SIGKILL the trainer");
    let what = format!("trainer {}", victim.key);
    time_trainer_fault(job, &victim.key, &what, at, times, pods_dir).await;
}

/// [`time_fault`] of a trainer's fault: noticed when its registration `key` is gone,
/// served again when two trainers are registered again.
async fn time_trainer_fault(
    job: &Job<'_>,
    key: &str,
    what: &str,
    at: Instant,
    times: &mut Times,
    pods_dir: &std::path::Path,
) {
    time_fault(
        what,
        at,
        times,
        pods_dir,
        || async { job.backend.get(key).await.is_ok_and(|kv| kv.is_none()) },
        || async { job.trainers().await.len() == 2 },
    )
    .await;
}

/// SIGKILLs the pserver claiming shard 0 (its claim names its pod's incarnation, the
/// witness that the operator can find it): noticed when its claim is gone, served again
/// when another incarnation claims the shard.
async fn kill_pserver(job: &Job<'_>, times: &mut Times, pods_dir: &std::path::Path) {
    let victim = job.claim().await.expect("shard 0 claimed");
    assert!(
        !victim.instance.is_empty(),
        "the pserver's claim names no instance: {victim:?}"
    );
    let at = Instant::now();
    edl_testkit::signal(victim.pid, Signal::SIGKILL).expect("SIGKILL the pserver");
    let old = victim.instance.clone();
    let other = |c: Option<PserverRecord>| c.is_none_or(|c| c.instance != old);
    time_fault(
        &format!("pserver {}", pod_of(&victim.instance)),
        at,
        times,
        pods_dir,
        || async { other(job.claim().await) },
        || async { job.claim().await.is_some_and(|c| c.instance != old) },
    )
    .await;
}

/// SIGKILLs the leading master, found by the instance it wrote beside its candidacy:
/// noticed when its candidacy is gone, served again when another master (its pod's
/// replacement) leads.
async fn kill_master(
    job: &Job<'_>,
    kubelet: &edl_testkit::kubelet::Kubelet,
    times: &mut Times,
    pods_dir: &std::path::Path,
) {
    let (key, instance) = job.leader().await.expect("a leader");
    let pid = kubelet
        .pid(pod_of(&instance))
        .unwrap_or_else(|| panic!("no process for the leading master {instance}"));
    let at = Instant::now();
    edl_testkit::signal(pid, Signal::SIGKILL).expect("SIGKILL the master");
    time_fault(
        &format!("master {}", pod_of(&instance)),
        at,
        times,
        pods_dir,
        || async { job.backend.get(&key).await.is_ok_and(|kv| kv.is_none()) },
        || async { job.leader().await.is_some_and(|(k, _)| k != key) },
    )
    .await;
}

/// Deletes a trainer's pod with its grace period (SIGTERM, as a drain or a preemption
/// does): noticed when its registration is gone (its task handed back first), served
/// again when two trainers are registered again.
async fn notice_trainer(
    job: &Job<'_>,
    client: &kube::Client,
    times: &mut Times,
    pods_dir: &std::path::Path,
) {
    let victim = job.trainers().await.remove(0);
    let id = victim
        .key
        .rsplit('/')
        .next()
        .expect("a trainer id")
        .to_owned();
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), NS);
    let at = Instant::now();
    pods.delete(pod_of(&id), &DeleteParams::default())
        .await
        .expect("delete the trainer's pod");
    let what = format!("trainer pod {}", pod_of(&id));
    time_trainer_fault(job, &victim.key, &what, at, times, pods_dir).await;
}
