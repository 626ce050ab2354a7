//! A trainer pod whose process dies is noticed from its pod's status, not its lease
//! (issue 56): the operator revokes the dead trainer's leases before it replaces the
//! pod, so the master hands its tasks out again at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use edl_job::{JobKeys, Record, TrainerRecord};
use edl_operator::TrainingJob;
use edl_operator::crd::{EtcdSpec, Phase};
use edl_operator::metrics::Metrics;
use kube::Api;
use kube::api::PostParams;

use super::{NS, OnOperator, mnist_job, pod_logs, succeeded};
use crate::support::{World, wait_until};
use crate::trainer::mnist;

/// With a 60 s lease, a SIGKILLed trainer's registration (and with it its tasks) is
/// gone within a third of it, because the operator saw its pod fail; the pod is
/// replaced (a recovery) and the job succeeds with nothing failed. Without the
/// revocation the registration would stay for the whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_trainer_pod_is_noticed_from_its_status_not_after_its_lease() {
    const JOB: &str = "mnist-killed";
    const LEASE_S: u64 = 60;
    let w = World::new("unused").await;
    let (train, test) = mnist(w.dir.path());
    let OnOperator {
        pods_dir,
        client,
        _kubelet,
        stop,
        operator,
        ..
    } = OnOperator::start(&w, None, Arc::new(Metrics::default())).await;
    let tj = mnist_job(
        JOB,
        (&train, &test),
        4,
        &format!("{LEASE_S}s"),
        EtcdSpec {
            endpoints: w.etcd.endpoints(),
            ..EtcdSpec::default()
        },
    );
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);
    jobs.create(&PostParams::default(), &tj)
        .await
        .expect("create the job");
    let keys = JobKeys::new(&super::etcd_job(JOB));
    let registered = || async {
        w.backend
            .range(&keys.trainers())
            .await
            .map(|(kvs, _)| kvs)
            .unwrap_or_default()
    };
    let within = Duration::from_secs(120);
    let training = wait_until(within, || async {
        let running = jobs
            .get(JOB)
            .await
            .ok()
            .and_then(|j| j.status)
            .is_some_and(|s| s.pass >= Some(1) && s.phase == Phase::Running);
        running && registered().await.len() == 2
    })
    .await;
    assert!(training, "{}", pod_logs(&pods_dir));
    // The victim: a trainer this test's kubelet started, by the pid it registered.
    let victim = registered().await.remove(0);
    let pid = TrainerRecord::decode(&victim.value)
        .expect("a trainer record")
        .pid;
    let killed = Instant::now();
    edl_testkit::signal(pid, edl_testkit::Signal::SIGKILL).expect("SIGKILL the trainer");
    let gone = wait_until(Duration::from_secs(LEASE_S / 3), || async {
        w.backend
            .get(&victim.key)
            .await
            .is_ok_and(|kv| kv.is_none())
    })
    .await;
    assert!(
        gone,
        "{} still registered {:?} after its process was killed ({LEASE_S} s lease)\n{}",
        victim.key,
        killed.elapsed(),
        pod_logs(&pods_dir)
    );
    let noticed = killed.elapsed();
    let s = succeeded(&jobs, JOB, &pods_dir).await;
    // The witness: the operator saw the trainer pod fail and replaced it.
    assert!(
        s.recoveries.iter().any(|r| r.role == "trainer"),
        "no trainer recovery: {:?}",
        s.recoveries
    );
    eprintln!("a killed trainer's registration was gone after {noticed:?} ({LEASE_S} s lease)");
    stop.cancel();
    operator.await.expect("operator");
}
