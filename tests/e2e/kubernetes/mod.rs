//! The Kubernetes operator end to end: `edl_operator::controller` against the fake API
//! server (`edl_testkit::kube_api`), whose pods the test kubelet
//! (`edl_testkit::kubelet`) runs as real `edl` processes against a real etcd. A job spec
//! submitted with `edl submit` trains MNIST to the end while it is scaled 2 -> 4 (`edl
//! scale`) -> 1 (the scale subresource, as `kubectl scale` or an autoscaler does; surplus
//! trainers drain), loses a trainer pod and a pserver pod to deletions, and reports
//! Succeeded (with two replicas of its pserver shard, the deleted pserver pod costs no
//! restore); `edl jobs`, `edl status` and `edl logs` show it on the way, and `edl kill`
//! removes it and, through the finalizer, its etcd keys. A second job runs on a shared
//! etcd with authentication on, under an operator given admin credentials: its pods
//! train as the job's own etcd user, with the job's token, from the Secret the operator
//! made. The other modules: durable and managed etcd, its restore, Kueue, suspension,
//! tenants, the stand-in's own semantics, and `recovery` (a SIGKILLed trainer pod noticed
//! from its status, not its lease).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use edl_operator::TrainingJob;
use edl_operator::controller::{self, ControllerConfig};
use edl_operator::crd::{Phase, TrainingJobStatus};
use edl_operator::metrics::Metrics;
use edl_testkit::kube_api::{FakeApi, ResourceType};
use edl_testkit::kubelet::{Kubelet, KubeletConfig};
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::{Api, Client, Config};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::support::{World, edl_bin, wait_until};
use crate::trainer::mnist;

const NS: &str = "ml";
const JOB: &str = "mnist-k8s";

/// A fake API server serving the operator's types, and a test kubelet running its pods
/// (logs and volumes under `pods_dir`).
async fn stand_in(pods_dir: &std::path::Path) -> (Arc<FakeApi>, Kubelet) {
    std::fs::create_dir_all(pods_dir).expect("mkdir");
    let api = Arc::new(
        FakeApi::start(ResourceType::for_operator())
            .await
            .expect("fake API server"),
    );
    let kubelet = Kubelet::start(
        api.clone(),
        KubeletConfig {
            namespace: NS.to_owned(),
            edl: edl_bin().into(),
            dir: pods_dir.to_path_buf(),
            claims: BTreeMap::new(),
        },
    );
    (api, kubelet)
}

/// Writes a kubeconfig whose context "fake" is `api`, namespace NS.
fn write_kubeconfig(path: &std::path::Path, api: &FakeApi) {
    std::fs::write(
        path,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n\
             clusters: [{{name: fake, cluster: {{server: \"{}\"}}}}]\n\
             users: [{{name: test, user: {{}}}}]\n\
             contexts: [{{name: fake, context: {{cluster: fake, user: test, namespace: {NS}}}}}]\n",
            api.url()
        ),
    )
    .expect("write kubeconfig");
}

/// Runs `edl ARGS --context fake` against the fake API server: (success, stdout + stderr).
async fn edl(kubeconfig: &std::path::Path, args: &[&str]) -> (bool, String) {
    let out = tokio::process::Command::new(edl_bin())
        .args(args)
        .args(["--context", "fake"])
        .env("KUBECONFIG", kubeconfig)
        .env_remove("EDL_ETCD")
        .output()
        .await
        .expect("run edl");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The name in etcd of job `name` of [`NS`] on the operator: its namespace, a dot, its
/// name (`edl_operator::objects::etcd_job`).
fn etcd_job(name: &str) -> edl_job::JobName {
    edl_job::JobName::new(format!("{NS}.{name}")).expect("a job name")
}

/// Runs the machine's real `kubectl ARGS` with `kubeconfig` (its discovery cache under
/// `cache`): (success, stdout + stderr).
fn kubectl(kubeconfig: &std::path::Path, cache: &std::path::Path, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new("kubectl")
        .args(args)
        .arg("--cache-dir")
        .arg(cache)
        .env("KUBECONFIG", kubeconfig)
        .output()
        .expect("run kubectl");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// TrainingJob `name` in [`NS`] training MNIST (`train`, `test`) for `passes` async
/// passes with one pserver and two trainers, checkpointing every second, with lease TTL
/// `lease_ttl`, on `etcd`, and every other field at its default.
fn mnist_job(
    name: &str,
    (train, test): (&str, &str),
    passes: u32,
    lease_ttl: &str,
    etcd: edl_operator::crd::EtcdSpec,
) -> TrainingJob {
    let spec = edl_job::JobSpec::parse_toml(&format!(
        "name = \"{name}\"\n[data]\ntrain = [\"{train}\"]\ntest = [\"{test}\"]\n\
         [model]\nkind = \"mnist_mlp\"\n\
         [train]\nmode = \"async\"\npasses = {passes}\nbatch_size = 32\noptimizer = \"adam\"\n\
         learning_rate = 0.001\nseed = 7\n\
         [cluster]\npservers = 1\ntrainers = 2\nlease_ttl = \"{lease_ttl}\"\n\
         checkpoint_every = \"1s\"\n"
    ))
    .expect("spec");
    let mut tj = TrainingJob::from_job_spec(&spec, "edl:test", Some(NS));
    tj.spec.etcd = etcd;
    tj
}

/// Shard 0's `restores/0` record in `backend`.
async fn restore(
    backend: &Arc<dyn edl_coord::Backend>,
    keys: &edl_job::JobKeys,
) -> Option<edl_job::RestoreRecord> {
    use edl_job::Record;
    let kv = backend.get(&keys.restore(0)).await.ok()??;
    edl_job::RestoreRecord::decode(&kv.value).ok()
}

/// Waits (400 s at most) until job `name` ends, and checks that it succeeded with every
/// task of its last pass done and none failed or left; its status.
async fn succeeded(
    jobs: &Api<TrainingJob>,
    name: &str,
    pods_dir: &std::path::Path,
) -> TrainingJobStatus {
    let status = || async { jobs.get(name).await.ok().and_then(|j| j.status) };
    let done = wait_until(Duration::from_secs(400), || async {
        status().await.is_some_and(|s| s.phase.is_finished())
    })
    .await;
    let s = status().await.expect("status");
    assert!(
        done && s.phase == Phase::Succeeded,
        "{s:?}\n{}",
        pod_logs(pods_dir)
    );
    let tasks = s.tasks.clone().expect("tasks");
    assert!(
        tasks.failed == 0 && tasks.todo == 0 && tasks.pending == 0 && tasks.done > 0,
        "{tasks:?}"
    );
    s
}

/// Waits until job `name`'s pserver pod stopped (its final checkpoint written), then
/// checks that the final checkpoint's ledger, read from the file, holds `passes` passes.
async fn final_ledger_holds(
    api: &FakeApi,
    pods_dir: &std::path::Path,
    backend: &Arc<dyn edl_coord::Backend>,
    name: &str,
    passes: u32,
) {
    let pserver = format!("{name}-pserver-0");
    let stopped = wait_until(Duration::from_secs(120), || async {
        api.get("pods", NS, &pserver)
            .is_none_or(|p| p["status"]["phase"] == "Succeeded")
    })
    .await;
    assert!(stopped, "the pserver never stopped: {}", pod_logs(pods_dir));
    let keys = edl_job::JobKeys::new(&etcd_job(name));
    assert_eq!(
        crate::support::checkpointed_passes(backend, &keys, 1).await,
        vec![passes],
        "the final checkpoint's ledger"
    );
}

/// The value of `key` in Secret `name` of [`NS`], decoded.
pub(super) fn secret_value(api: &FakeApi, name: &str, key: &str) -> Vec<u8> {
    api.get("secrets", NS, name)
        .unwrap_or_else(|| panic!("no Secret {name}"))["data"][key]
        .as_str()
        .and_then(edl_testkit::kube_api::base64_decode)
        .unwrap_or_else(|| panic!("no {key} in Secret {name}"))
}

/// The TLS setup of the Secret `name` (its CA, certificate and key) as a pod of job
/// `job` in [`NS`] uses it.
pub(super) fn tls_of(
    api: &edl_testkit::kube_api::FakeApi,
    name: &str,
    job: &str,
) -> edl_proto::tls::Tls {
    let value = |k: &str| secret_value(api, name, k);
    tls_from(&value("ca.crt"), &value("tls.crt"), &value("tls.key"), job)
}

/// The TLS setup of a pod of job `job` in [`NS`] with these PEM files.
pub(super) fn tls_from(ca: &[u8], cert: &[u8], key: &[u8], job: &str) -> edl_proto::tls::Tls {
    let identity = edl_proto::tls::PemIdentity {
        cert: cert.to_vec(),
        key: key.to_vec(),
        cert_name: "cert".into(),
        key_name: "key".into(),
    };
    edl_proto::tls::Tls::from_pem(
        ca,
        "ca",
        Some(identity),
        Some(edl_operator::objects::tls_domain(job, NS)),
        true,
    )
    .expect("a TLS setup")
}

/// The last lines of every pod's log in `pods_dir`, for a failed assertion.
fn pod_logs(pods_dir: &std::path::Path) -> String {
    let mut out = String::new();
    for e in std::fs::read_dir(pods_dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "log") {
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(5).collect();
            out.push_str(&format!("== {}\n{}\n", p.display(), tail.join("\n")));
        }
    }
    out
}

fn uid(api: &FakeApi, pod: &str) -> Option<String> {
    api.get("pods", NS, pod)
        .and_then(|p| p["metadata"]["uid"].as_str().map(str::to_owned))
}

/// The fake API server, its test kubelet running pods as real `edl` processes (logs in
/// `pods_dir`), and the operator's controller for [`NS`], with `etcd_auth` for the
/// jobs' etcd.
struct OnOperator {
    checkpoints: std::path::PathBuf,
    pods_dir: std::path::PathBuf,
    api: Arc<FakeApi>,
    client: Client,
    _kubelet: Kubelet,
    stop: CancellationToken,
    operator: tokio::task::JoinHandle<()>,
    config: ControllerConfig,
    metrics: Arc<Metrics>,
}

impl OnOperator {
    async fn start(
        w: &World,
        etcd_auth: Option<edl_coord::EtcdAuth>,
        metrics: Arc<Metrics>,
    ) -> OnOperator {
        Self::start_with(w, etcd_auth, metrics, false).await
    }

    /// [`OnOperator::start`], admitting queued jobs through Kueue Workloads if `kueue`.
    async fn start_with(
        w: &World,
        etcd_auth: Option<edl_coord::EtcdAuth>,
        metrics: Arc<Metrics>,
        kueue: bool,
    ) -> OnOperator {
        let checkpoints = w.dir.path().join("checkpoints");
        let pods_dir = w.dir.path().join("pods");
        std::fs::create_dir_all(&checkpoints).expect("mkdir");
        let (api, kubelet) = stand_in(&pods_dir).await;
        let client =
            Client::try_from(Config::new(api.url().parse().expect("url"))).expect("client");
        let config = ControllerConfig {
            namespace: Some(NS.to_owned()),
            resync: Duration::from_millis(500),
            etcd_auth,
            etcd_endpoints: w.etcd.endpoints(),
            // A managed etcd's members by the loopback ports the kubelet gave them.
            resolve: controller::Resolve(kubelet.resolver()),
            kueue,
            // What the jobs' NetworkPolicies let through (checked by
            // `managed_etcd::network_policy_keeps_the_job_to_itself`).
            network: edl_operator::objects::JobNetwork {
                metrics_namespaces: vec!["monitoring".to_owned()],
                egress_namespaces: vec!["storage".to_owned()],
                ..edl_operator::objects::JobNetwork::default()
            },
            ..ControllerConfig::default()
        };
        let stop = CancellationToken::new();
        let operator = tokio::spawn(controller::run(
            client.clone(),
            config.clone(),
            metrics.clone(),
            stop.clone(),
        ));
        OnOperator {
            checkpoints,
            pods_dir,
            api,
            client,
            _kubelet: kubelet,
            stop,
            operator,
            config,
            metrics,
        }
    }

    /// Stops the operator (as `kubectl scale deployment edl-operator --replicas=0`
    /// does) and, once it has stopped, waits for `meanwhile` before starting it again.
    async fn restart_around<F: std::future::Future<Output = ()>>(&mut self, meanwhile: F) {
        self.stop.cancel();
        (&mut self.operator).await.expect("the operator stopped");
        meanwhile.await;
        self.stop = CancellationToken::new();
        self.operator = tokio::spawn(controller::run(
            self.client.clone(),
            self.config.clone(),
            self.metrics.clone(),
            self.stop.clone(),
        ));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_training_job_is_scaled_survives_deleted_pods_and_succeeds_on_the_operator() {
    let w = World::new("unused").await;
    let (train, test) = mnist(w.dir.path());
    let metrics = Arc::new(Metrics::default());
    let OnOperator {
        checkpoints,
        pods_dir,
        api,
        client,
        _kubelet,
        stop,
        operator,
        ..
    } = OnOperator::start(&w, None, metrics.clone()).await;

    // A kubeconfig whose context "fake" is the fake API server, namespace NS.
    let kubeconfig = w.dir.path().join("kubeconfig");
    write_kubeconfig(&kubeconfig, &api);
    let job_toml = w.dir.path().join("job.toml");
    std::fs::write(
        &job_toml,
        format!(
            "name = \"{JOB}\"\n[data]\ntrain = [\"{train}\"]\ntest = [\"{test}\"]\n\
             [model]\nkind = \"mnist_mlp\"\n\
             [train]\nmode = \"async\"\npasses = 12\nbatch_size = 32\noptimizer = \"adam\"\n\
             learning_rate = 0.001\nseed = 7\n\
             [cluster]\npservers = 1\npserver_replicas = 2\ntrainers = 2\nmin_trainers = 1\n\
             max_trainers = 4\nlease_ttl = \"3s\"\ncheckpoint_every = \"2s\"\n"
        ),
    )
    .expect("write the job spec");
    let checkpoints_arg = format!("host:{}", checkpoints.display());
    let etcd_arg = w.etcd.endpoints().join(",");
    let submit: Vec<&str> = vec![
        "submit",
        job_toml.to_str().expect("utf-8 path"),
        "--image",
        "edl:test",
        "--checkpoints",
        &checkpoints_arg,
        "--etcd",
        &etcd_arg,
    ];
    let (ok, out) = edl(&kubeconfig, &submit).await;
    assert!(ok && out.contains("submitted"), "edl submit: {out}");
    // Twice is refused, saying how to remove the first.
    let (ok, out) = edl(&kubeconfig, &submit).await;
    assert!(
        !ok && out.contains("exists") && out.contains("edl kill"),
        "{out}"
    );
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);

    let status = || {
        let jobs = jobs.clone();
        async move { jobs.get(JOB).await.ok().and_then(|j| j.status) }
    };
    let logs = || pod_logs(&pods_dir);
    // Running with `n` trainers, all registered, the job not over yet.
    let at = |n: u32| async move {
        status().await.is_some_and(|s: TrainingJobStatus| {
            s.trainers.running == n
                && s.trainers.registered == n
                && s.trainers.desired == n
                && s.phase == Phase::Running
        })
    };
    let within = Duration::from_secs(90);
    assert!(
        wait_until(within, || at(2)).await,
        "two trainers: {:?}\n{}",
        status().await,
        logs()
    );

    let scale = |n: u32| {
        let jobs = jobs.clone();
        async move {
            jobs.patch_scale(
                JOB,
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": {"replicas": n}})),
            )
            .await
            .expect("scale");
        }
    };
    let (ok, out) = edl(&kubeconfig, &["jobs"]).await;
    assert!(
        ok && out.contains("SUBMITTED-JOBS 1") && out.contains("RUNNING-TRAINERS 2"),
        "edl jobs: {out}"
    );
    let row = out.lines().find(|l| l.contains(JOB)).unwrap_or_default();
    assert!(
        row.contains("Running") && row.contains("2/2"),
        "edl jobs: {out}"
    );
    let (ok, out) = edl(&kubeconfig, &["status", JOB]).await;
    assert!(
        ok && out.contains("[Running]") && out.contains("trainers running 2"),
        "edl status: {out}"
    );

    let (ok, out) = edl(&kubeconfig, &["scale", JOB, "--trainers", "4"]).await;
    assert!(ok && out.contains("desired trainers 4"), "edl scale: {out}");
    assert!(
        wait_until(within, || at(4)).await,
        "four trainers: {:?}\n{}",
        status().await,
        logs()
    );
    scale(1).await;
    assert!(
        wait_until(within, || at(1)).await,
        "one trainer: {:?}\n{}",
        status().await,
        logs()
    );
    // The three that went drained (SIGTERM: the task handed back, exit 0), then their
    // pods were removed.
    let gone = wait_until(within, || {
        let api = api.clone();
        async move { (1..4).all(|i| api.get("pods", NS, &format!("{JOB}-trainer-{i}")).is_none()) }
    })
    .await;
    assert!(gone, "the surplus trainers' pods stayed:\n{}", logs());
    for i in 1..4 {
        let log = std::fs::read_to_string(pods_dir.join(format!("{JOB}-trainer-{i}.log")))
            .unwrap_or_default();
        assert!(
            log.contains("SIGTERM") && log.contains("drained=true"),
            "trainer {i} did not drain:\n{log}"
        );
    }

    // The trainer's log through the API server; only the trainer's.
    let (ok, out) = edl(&kubeconfig, &["logs", JOB, "--role", "trainer"]).await;
    assert!(
        ok && out.contains(&format!("[{JOB}-trainer-0] ")) && !out.contains("pserver-0]"),
        "edl logs: {out}"
    );

    // The shard's two replicas (pods pserver-0 and pserver-1) are in sync.
    let group = || {
        let backend = w.backend.clone();
        async move {
            use edl_job::Record;
            let keys = edl_job::JobKeys::new(&etcd_job(JOB));
            let kv = backend.get(&keys.ps_group(0)).await.ok()??;
            edl_job::GroupRecord::decode(&kv.value).ok()
        }
    };
    let synced = wait_until(within, || async {
        group().await.is_some_and(|g| g.backups.len() == 1)
    })
    .await;
    assert!(
        synced,
        "the replicas never got in sync: {:?}\n{}",
        group().await,
        logs()
    );
    let in_sync = group().await.expect("the group");

    // A deleted trainer pod and a deleted pserver pod come back.
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), NS);
    for pod in [format!("{JOB}-trainer-0"), format!("{JOB}-pserver-0")] {
        let before = uid(&api, &pod);
        pods.delete(&pod, &DeleteParams::default())
            .await
            .expect("delete a pod");
        let back = wait_until(within, || {
            let (api, pod, before) = (api.clone(), pod.clone(), before.clone());
            async move {
                api.get("pods", NS, &pod).is_some_and(|p| {
                    p["metadata"]["uid"].as_str() != before.as_deref()
                        && p["status"]["phase"] == "Running"
                })
            }
        })
        .await;
        assert!(
            back,
            "{pod} was not recreated: {:?}\n{}",
            status().await,
            logs()
        );
        let s = status().await.expect("status");
        assert!(
            !s.phase.is_finished(),
            "the job ended before the faults: {s:?}"
        );
    }

    // The replacement pserver pod joined its shard and caught up: the group is whole
    // again (a new record: the deleted replica left it, the new one came in).
    let whole = wait_until(within, || async {
        group()
            .await
            .is_some_and(|g| g.backups.len() == 1 && g.change > in_sync.change)
    })
    .await;
    assert!(
        whole,
        "the group stayed short: {:?}\n{}",
        group().await,
        logs()
    );

    // It trains to the end.
    // Every task of the last pass done (as the master reported it when the job
    // ended), none failed, none left.
    let s = succeeded(&jobs, JOB, &pods_dir).await;
    assert_eq!(s.pass, Some(11), "the 12th pass was the last");
    // The pserver pod's loss cost no restore: the shard kept its incarnation.
    let end = group().await.expect("the group");
    assert_eq!(end.incarnation, in_sync.incarnation, "a restore: {end:?}");
    assert!(
        s.recoveries
            .iter()
            .filter(|r| r.reason.contains("deleted"))
            .count()
            >= 2,
        "{:?}",
        s.recoveries
    );
    let events: Vec<String> = api
        .list("events", NS)
        .into_iter()
        .filter_map(|e| e["reason"].as_str().map(str::to_owned))
        .collect();
    for reason in ["ScaledUp", "ScaledDown", "PodReplaced", "Succeeded"] {
        assert!(events.iter().any(|e| e == reason), "{reason} in {events:?}");
    }

    // `edl kill` deletes the resource; the finalizer removes the job's etcd keys first.
    let (ok, out) = edl(&kubeconfig, &["kill", JOB]).await;
    assert!(ok && out.contains("deleted"), "edl kill: {out}");
    let removed = wait_until(within, || {
        let api = api.clone();
        async move { api.get("trainingjobs", NS, JOB).is_none() }
    })
    .await;
    assert!(removed, "the TrainingJob stayed: {:?}", status().await);
    let etcd = edl_coord::EtcdBackend::connect(edl_coord::EtcdConfig::new(w.etcd.endpoints()))
        .await
        .expect("connect to etcd");
    let keys = edl_job::JobKeys::new(&etcd_job(JOB));
    let (left, _) = edl_coord::Backend::range(&etcd, keys.root())
        .await
        .expect("read etcd");
    assert!(left.is_empty(), "{} etcd keys left", left.len());
    let (ok, out) = edl(&kubeconfig, &["status", JOB]).await;
    assert!(!ok && out.contains("no TrainingJob"), "{out}");
    stop.cancel();
    operator.await.expect("operator");
}

/// A job on a shared etcd with authentication on, run by an operator given its admin
/// credentials (root): the operator makes the job's etcd user and token (the Secret
/// `<job>-edl-credentials`) before its pods; the test kubelet gives the pods only their
/// own environment and the Secret (`envFrom`), so the master, pserver and trainers reach
/// etcd as the job's user, which may touch nothing but `/edl/<job>/`, and one another
/// with the token. The job trains to Succeeded, and the operator reads its pass and tasks
/// from the master, with the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_on_a_shared_etcd_trains_as_its_own_etcd_user_on_the_operator() {
    use edl_coord::{Backend, EtcdAuth, EtcdBackend, EtcdConfig};
    use edl_operator::crd::{EtcdSpec, VolumeSource};
    use k8s_openapi::api::core::v1::Secret;

    const SECURE_JOB: &str = "mnist-secure";
    let w = World::new("unused").await;
    let open = EtcdBackend::connect(EtcdConfig::new(w.etcd.endpoints()))
        .await
        .expect("connect to etcd");
    open.enable_auth("pw").await.expect("enable auth");
    let root = EtcdBackend::connect(EtcdConfig::new(w.etcd.endpoints()).with_auth("root", "pw"))
        .await
        .expect("connect as root");
    let (train, test) = mnist(w.dir.path());
    let admin = EtcdAuth {
        user: "root".into(),
        password: "pw".into(),
    };
    let OnOperator {
        checkpoints,
        pods_dir,
        api,
        client,
        _kubelet,
        stop,
        operator,
        ..
    } = OnOperator::start(&w, Some(admin), Arc::new(Metrics::default())).await;
    let spec = edl_job::JobSpec::parse_toml(&format!(
        "name = \"{SECURE_JOB}\"\n[data]\ntrain = [\"{train}\"]\ntest = [\"{test}\"]\n\
         [model]\nkind = \"mnist_mlp\"\n\
         [train]\nmode = \"async\"\npasses = 3\nbatch_size = 32\noptimizer = \"adam\"\n\
         learning_rate = 0.001\nseed = 7\n\
         [cluster]\npservers = 1\ntrainers = 2\nlease_ttl = \"3s\"\ncheckpoint_every = \"2s\"\n"
    ))
    .expect("spec");
    let mut tj = TrainingJob::from_job_spec(&spec, "edl:test", Some(NS));
    tj.spec.etcd = EtcdSpec {
        endpoints: w.etcd.endpoints(),
        ..EtcdSpec::default()
    };
    tj.spec.volumes.checkpoints = Some(VolumeSource {
        host_path: Some(checkpoints.display().to_string()),
        ..VolumeSource::default()
    });
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), NS);
    jobs.create(&kube::api::PostParams::default(), &tj)
        .await
        .expect("create the job");
    let status = || {
        let jobs = jobs.clone();
        async move { jobs.get(SECURE_JOB).await.ok().and_then(|j| j.status) }
    };
    // Every task of the last pass done (as the master reported it when the job
    // ended), none failed, none left.
    let s = succeeded(&jobs, SECURE_JOB, &pods_dir).await;
    assert_eq!(s.pass, Some(2), "the 3rd pass was the last");

    // The job's user: in the Secret, and limited to the job's prefix.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    let secret = secrets
        .get(&format!("{SECURE_JOB}-edl-credentials"))
        .await
        .expect("the job's Secret");
    let value = |k: &str| {
        let data = secret.data.as_ref().expect("data");
        String::from_utf8(data[k].0.clone()).expect("UTF-8")
    };
    assert_eq!(value("EDL_ETCD_USER"), format!("edl-job-{NS}.{SECURE_JOB}"));
    assert!(!value("EDL_JOB_TOKEN").is_empty());
    let as_job = EtcdBackend::connect(
        EtcdConfig::new(w.etcd.endpoints())
            .with_auth(value("EDL_ETCD_USER"), value("EDL_ETCD_PASSWORD")),
    )
    .await
    .expect("connect as the job's user");
    let prefix = format!("/edl/{NS}.{SECURE_JOB}/");
    let (own, _) = as_job.range(&prefix).await.expect("the job's keys");
    assert!(!own.is_empty(), "the job's user reads its keys");
    assert!(
        matches!(
            as_job.range("/edl/").await,
            Err(edl_coord::Error::PermissionDenied(_))
        ),
        "the job's user lists every job"
    );

    // The job goes: its keys (the finalizer, as root) and its Secret (owned by it).
    jobs.delete(SECURE_JOB, &DeleteParams::default())
        .await
        .expect("delete the job");
    let removed = wait_until(Duration::from_secs(60), || {
        let api = api.clone();
        async move {
            api.get("trainingjobs", NS, SECURE_JOB).is_none()
                && api
                    .get("secrets", NS, &format!("{SECURE_JOB}-edl-credentials"))
                    .is_none()
        }
    })
    .await;
    assert!(removed, "{:?}", status().await);
    let (left, _) = root.range(&prefix).await.expect("read etcd");
    assert!(left.is_empty(), "{} etcd keys left", left.len());
    stop.cancel();
    operator.await.expect("operator");
}

mod durable;
mod etcd_restore;
mod kueue;
mod managed_etcd;
mod recovery;
mod stand_in;
mod suspend;
mod tenants;

/// `edl operator run` with admin credentials for a shared etcd but no `--etcd-endpoints`
/// (where they belong) refuses to start, in one line with the fix, before it reaches for
/// a Kubernetes API server; with the endpoints it gets past that check to its next step
/// that can fail here (`--metrics-addr` on a port in use), the witness that the refusal
/// is the check's.
#[test]
fn the_operator_refuses_admin_credentials_without_their_etcd() {
    let dir = tempfile::tempdir().expect("temp dir");
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: \
         http://127.0.0.1:9\ncontexts:\n- name: c\n  context:\n    cluster: c\n    \
         user: u\ncurrent-context: c\nusers:\n- name: u\n  user: {}\n",
    )
    .expect("write kubeconfig");
    let busy = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let busy = busy.local_addr().expect("addr").to_string();
    let run = |extra: &[&str]| {
        let mut child = std::process::Command::new(edl_bin())
            .args([
                "operator",
                "run",
                "--etcd-user",
                "root",
                "--etcd-password",
                "pw",
            ])
            .args(["--metrics-addr", &busy])
            .args(extra)
            .env("KUBECONFIG", &kubeconfig)
            .env_remove(edl_job::env::ETCD_ENDPOINTS)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run edl operator");
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(s) = child.try_wait().expect("wait") {
                break s;
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                panic!("edl operator run did not exit within 60 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut err)
            .expect("read stderr");
        (status.success(), err)
    };
    let (ok, err) = run(&[]);
    assert!(!ok, "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {err}");
    assert!(
        lines[0].contains("--etcd-user needs --etcd-endpoints")
            && lines[0].contains(edl_job::env::ETCD_ENDPOINTS),
        "{err}"
    );
    let (ok, err) = run(&["--etcd-endpoints", "http://127.0.0.1:2379"]);
    assert!(!ok, "the metrics port is in use: {err}");
    assert!(!err.contains("--etcd-endpoints"), "{err}");
    assert!(err.contains("bind --metrics-addr"), "{err}");
}
