//! `spec.suspend`, as an admission queue (Kueue) uses it to hold and preempt a job,
//! driven by the real `kubectl`: a running job drains (trainers hand their tasks back,
//! then the pserver writes a final checkpoint), has no pods while suspended, and resumes
//! where it stopped.

use std::sync::Arc;
use std::time::Duration;

use edl_job::JobKeys;
use edl_operator::TrainingJob;
use edl_operator::crd::{EtcdSpec, Phase};
use edl_operator::metrics::Metrics;
use kube::Api;
use kube::api::PostParams;

use super::{
    NS, OnOperator, final_ledger_holds, kubectl, mnist_job, pod_logs, restore, succeeded,
    write_kubeconfig,
};
use crate::support::{World, wait_until};
use crate::trainer::mnist;

/// A job suspended mid-training with `kubectl patch` drains: its trainers log their
/// SIGTERM drain, its pserver writes a final checkpoint, and it shows `Suspended` with no
/// pods, and makes none over several reconciles. Resumed with `kubectl patch`, its new
/// pserver restores that final checkpoint (holding every pass done before the
/// suspension), no pod counts as a recovery, and it trains to `Succeeded` with every
/// pass in its final ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_suspended_with_kubectl_drains_stays_without_pods_and_resumes_without_loss() {
    const SUSPEND_JOB: &str = "mnist-suspend";
    const PASSES: u32 = 8;
    let w = World::new("unused").await;
    let (train, test) = mnist(w.dir.path());
    let metrics = Arc::new(Metrics::default());
    let OnOperator {
        pods_dir,
        api,
        client,
        _kubelet,
        stop,
        operator,
        ..
    } = OnOperator::start(&w, None, metrics.clone()).await;
    let kubeconfig = w.dir.path().join("kubeconfig");
    write_kubeconfig(&kubeconfig, &api);
    let cache = w.dir.path().join("kube-cache");
    let kubectl = |args: &[&str]| -> String {
        let (ok, text) = kubectl(&kubeconfig, &cache, args);
        assert!(ok, "kubectl {args:?}: {text}");
        text
    };
    let tj = mnist_job(
        SUSPEND_JOB,
        (&train, &test),
        PASSES,
        "3s",
        EtcdSpec {
            endpoints: w.etcd.endpoints(),
            ..EtcdSpec::default()
        },
    );
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);
    jobs.create(&PostParams::default(), &tj)
        .await
        .expect("create the job");
    let status = || {
        let jobs = jobs.clone();
        async move { jobs.get(SUSPEND_JOB).await.ok().and_then(|j| j.status) }
    };
    let keys = JobKeys::new(&super::etcd_job(SUSPEND_JOB));
    let job_pods = || {
        api.list("pods", NS)
            .into_iter()
            .filter(|p| p["metadata"]["labels"]["edl.dev/job"] == SUSPEND_JOB)
            .count()
    };
    let within = Duration::from_secs(120);
    let training = wait_until(within, || async {
        status()
            .await
            .is_some_and(|s| s.pass >= Some(1) && s.phase == Phase::Running)
    })
    .await;
    assert!(training, "{:?}\n{}", status().await, pod_logs(&pods_dir));
    let first = restore(&w.backend, &keys).await.expect("the first restore");

    // Suspended, as Kueue does it: a merge patch of spec.suspend.
    kubectl(&[
        "patch",
        &format!("trainingjob/{SUSPEND_JOB}"),
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"suspend":true}}"#,
    ]);
    let suspended = wait_until(within, || async {
        job_pods() == 0
            && status().await.is_some_and(|s| {
                s.phase == Phase::Suspended
                    && s.conditions
                        .iter()
                        .any(|c| c.type_ == "Suspended" && c.message.contains("no pods running"))
            })
    })
    .await;
    assert!(suspended, "{:?}\n{}", status().await, pod_logs(&pods_dir));
    let phase = kubectl(&[
        "get",
        &format!("trainingjob/{SUSPEND_JOB}"),
        "-o",
        "jsonpath={.status.phase}",
    ]);
    assert_eq!(phase.trim(), "Suspended");
    let pass_at_suspension = status().await.and_then(|s| s.pass).expect("a pass");
    for i in 0..2 {
        let log = std::fs::read_to_string(pods_dir.join(format!("{SUSPEND_JOB}-trainer-{i}.log")))
            .unwrap_or_default();
        assert!(
            log.contains("SIGTERM") && log.contains("drained=true"),
            "trainer {i} did not drain:\n{log}"
        );
    }
    let ps_log = std::fs::read_to_string(pods_dir.join(format!("{SUSPEND_JOB}-pserver-0.log")))
        .unwrap_or_default();
    assert!(
        ps_log.contains("final checkpoint written"),
        "the pserver wrote no final checkpoint:\n{ps_log}"
    );
    // Held: the operator goes on reconciling the job (a witness that it looked) and
    // makes no pod.
    let seen = metrics.reconciles.get();
    let looked = wait_until(within, || async { metrics.reconciles.get() >= seen + 4 }).await;
    assert!(looked, "the operator stopped reconciling");
    assert_eq!(job_pods(), 0, "a pod was made while the job was suspended");

    // Resumed.
    kubectl(&[
        "patch",
        &format!("trainingjob/{SUSPEND_JOB}"),
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"suspend":false}}"#,
    ]);
    let s = succeeded(&jobs, SUSPEND_JOB, &pods_dir).await;
    assert!(s.recoveries.is_empty(), "{:?}", s.recoveries);
    // The resumed pserver restored the final checkpoint: every pass before the one the
    // job was suspended in, with nothing of them to train again.
    let resumed = restore(&w.backend, &keys).await.expect("a restore record");
    assert!(
        resumed.incarnation != first.incarnation && resumed.step > 0,
        "{resumed:?}"
    );
    assert!(
        resumed.contains.sealed >= pass_at_suspension,
        "the final checkpoint holds passes below {}, suspended in pass {pass_at_suspension}",
        resumed.contains.sealed
    );
    final_ledger_holds(&api, &pods_dir, &w.backend, SUSPEND_JOB, PASSES).await;
    let events: Vec<String> = api
        .list("events", NS)
        .into_iter()
        .filter_map(|e| e["reason"].as_str().map(str::to_owned))
        .collect();
    for reason in ["Suspended", "Resumed", "Succeeded"] {
        assert!(events.iter().any(|e| e == reason), "{reason} in {events:?}");
    }
    assert!(
        !events.iter().any(|e| e == "PodReplaced"),
        "a pod stopped by the suspension was counted as a recovery: {events:?}"
    );
    stop.cancel();
    operator.await.expect("operator");
}
