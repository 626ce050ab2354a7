//! Durable task transitions per second: 8 concurrent trainer clients doing
//! GetTask + TaskFinished against a master on a single local etcd, with group commit
//! and, in the same run, with a baseline master that persists each transition with its
//! own etcd round trip (`max_batch = 1`). Prints transitions/s, etcd writes per task,
//! and GetTask latency percentiles.
//!
//! Run: `cargo bench -p edl-master --bench task_throughput`
//! (`EDL_BENCH_TASKS=N` sets the tasks of the group-commit runs; default 20000.)

use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, Lease, Registry};
use edl_job::{JobKeys, JobName};
use edl_master::{MasterConfig, run};
use edl_master_client::{Answer, MasterClient, MasterClientConfig};
use edl_recordio::{FileWriter, WriterOptions};
use edl_testkit::EtcdCluster;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const CLIENTS: usize = 8;

struct Outcome {
    tasks: u64,
    secs: f64,
    etcd_writes: i64,
    get_latency_us: Vec<u64>,
}

async fn revision(backend: &Arc<dyn Backend>) -> i64 {
    backend
        .range("/edl/bench-rev-probe/")
        .await
        .expect("range")
        .1
}

/// One run: a fresh job of `tasks` one-chunk tasks, `CLIENTS` clients with `lanes`
/// concurrent GetTask+TaskFinished loops each.
async fn run_once(
    etcd: &EtcdCluster,
    data: &str,
    job: &str,
    max_batch: usize,
    lanes: usize,
) -> Outcome {
    let backend = etcd.connect().await.expect("connect");
    let stop = CancellationToken::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let job = JobName::new(job).expect("a valid job name");
    let mut cfg = MasterConfig::new(job.clone());
    cfg.max_batch = max_batch;
    let master = tokio::spawn(run(backend.clone(), cfg, listener, stop.clone()));
    let mut ccfg = MasterClientConfig::new(job.clone());
    ccfg.retry_for = Duration::from_secs(30);
    let client = MasterClient::new(backend.clone(), ccfg.clone(), stop.child_token());
    let ds = client
        .set_dataset(vec![data.to_owned()], 1, 1)
        .await
        .expect("set dataset");
    let registry = Registry::new(backend.clone(), JobKeys::new(&job).trainers());
    let mut leases = Vec::new();
    for c in 0..CLIENTS {
        let lease = Lease::grant(backend.clone(), Duration::from_secs(10), stop.child_token())
            .await
            .expect("lease");
        registry
            .register(&format!("t{c}"), b"bench".to_vec(), &lease)
            .await
            .expect("register");
        leases.push(lease);
    }
    let rev0 = revision(&backend).await;
    let start = Instant::now();
    let mut handles = Vec::new();
    for c in 0..CLIENTS {
        // Each client is its own connection, as trainers are.
        let client = MasterClient::new(backend.clone(), ccfg.clone(), stop.child_token());
        for lane in 0..lanes {
            let client = client.clone();
            let trainer = format!("t{c}");
            handles.push(tokio::spawn(async move {
                let mut lat = Vec::new();
                let mut request = (lane as u64 + 1) << 40;
                loop {
                    request += 1;
                    let t0 = Instant::now();
                    let next = client
                        .get_task(&trainer, 0, request, Duration::ZERO, None)
                        .await
                        .expect("get task");
                    lat.push(t0.elapsed().as_micros() as u64);
                    match next {
                        Answer::Task(t) => {
                            client
                                .task_finished(&trainer, &t, t.records, &[])
                                .await
                                .expect("finish");
                        }
                        Answer::Wait => tokio::task::yield_now().await,
                        Answer::PassFinished(_) | Answer::JobFinished => return lat,
                    }
                }
            }));
        }
    }
    let mut lat = Vec::new();
    for h in handles {
        lat.extend(h.await.expect("client"));
    }
    let secs = start.elapsed().as_secs_f64();
    let rev1 = revision(&backend).await;
    stop.cancel();
    let _ = master.await;
    lat.sort_unstable();
    Outcome {
        tasks: ds.tasks,
        secs,
        etcd_writes: rev1 - rev0,
        get_latency_us: lat,
    }
}

fn pct(v: &[u64], p: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    v[((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1]
}

fn dataset(dir: &std::path::Path, name: &str, tasks: usize) -> String {
    let path = dir.join(format!("{name}.recordio"));
    // One record per chunk: one chunk per task.
    let mut w = FileWriter::create(
        &path,
        WriterOptions {
            max_chunk_bytes: 1,
            ..WriterOptions::default()
        },
    )
    .expect("create");
    for i in 0..tasks {
        w.write(format!("record-{i}").as_bytes()).expect("write");
    }
    w.finish().expect("finish");
    path.display().to_string()
}

fn main() {
    let tasks: usize = std::env::var("EDL_BENCH_TASKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let baseline_tasks = (tasks / 10).max(200);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let dir = tempfile::tempdir().expect("tempdir");
        let etcd = EtcdCluster::start(1).await.expect("start etcd");
        let mut rows = Vec::new();
        let configs: Vec<(usize, String)> = std::env::var("EDL_BENCH_LANES")
            .unwrap_or_else(|_| "1,8".into())
            .split(',')
            .filter_map(|l| l.trim().parse().ok())
            .map(|l: usize| (l, format!("8 clients x {l} in flight")))
            .collect();
        for (lanes, label) in configs.iter().map(|(l, s)| (*l, s.as_str())) {
            for (max_batch, mode, n) in [
                (1usize, "baseline: one etcd txn per transition", baseline_tasks),
                (edl_master::core::DEFAULT_MAX_BATCH, "group commit", tasks),
            ] {
                let job = format!("bench-{lanes}-{max_batch}");
                let data = dataset(dir.path(), &job, n);
                let o = run_once(&etcd, &data, &job, max_batch, lanes).await;
                let transitions = 2.0 * o.tasks as f64;
                let tps = transitions / o.secs;
                println!(
                    "{label:<24} {mode:<40} tasks {:>6}  {:>9.0} transitions/s  {:.3} etcd writes/task  GetTask p50 {:>6} us  p99 {:>7} us",
                    o.tasks,
                    tps,
                    o.etcd_writes as f64 / o.tasks as f64,
                    pct(&o.get_latency_us, 0.50),
                    pct(&o.get_latency_us, 0.99),
                );
                rows.push((lanes, max_batch, tps));
            }
        }
        println!();
        for &(lanes, _) in &configs {
            let base = rows.iter().find(|r| r.0 == lanes && r.1 == 1).map(|r| r.2).unwrap_or(1.0);
            let gc = rows.iter().find(|r| r.0 == lanes && r.1 != 1).map(|r| r.2).unwrap_or(0.0);
            println!(
                "{} in flight per client: group commit / baseline = {:.1}x",
                lanes,
                gc / base
            );
        }
    });
}
