//! Distributed overhead: samples/s of `mnist_mlp` (batch 64, Adam) through the same
//! pull -> forward/backward -> push loop with
//! 1. a local store (parameters and optimizer in process: the baseline),
//! 2. one trainer and one pserver (in-process pserver, real gRPC + bulk TCP on loopback),
//! 3. two trainers (threads) and one pserver.
//!
//! Coordination runs on the in-memory backend (single process); every pull and push goes
//! over the loopback network. All three run in the same process, one after the other,
//! so the ratios compare like with like on a noisy machine.
//!
//! `cargo bench -p edl-trainer --bench ps_throughput [-- STEPS]` (default 150 steps per
//! trainer after 10 warm-up steps).

use std::sync::Arc;
use std::time::Instant;

use edl_coord::{Backend, MemBackend};
use edl_proto::sample::Sample;
use edl_pserver::PsConfig;
use edl_pserver_client::{Mode, OptimizerConfig, ParamConfig, PsClient, PsClientConfig};
use edl_trainer::{
    LocalStore, Model, ModelSpec, OptimizerKind, ParamInit, ParamStore, Params, PsStore, build,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

#[path = "../src/testdata.rs"]
mod testdata;

const BATCH: usize = 64;
const WARMUP: usize = 10;

/// Runs `steps` steps of trainer `id` on `rt`; returns (samples, seconds) after warm-up.
fn train(
    rt: &tokio::runtime::Runtime,
    model: Arc<dyn Model>,
    store: Arc<dyn ParamStore>,
    id: &str,
    data: &[Sample],
    steps: usize,
) -> (usize, f64) {
    let mut params = Params::default();
    let batches: Vec<&[Sample]> = data.chunks(BATCH).filter(|b| b.len() == BATCH).collect();
    let mut samples = 0;
    let mut timing = [0f64; 3];
    let mut start = Instant::now();
    for step in 0..WARMUP + steps {
        if step == WARMUP {
            start = Instant::now();
            samples = 0;
        }
        let batch = model
            .prepare(batches[step % batches.len()])
            .expect("prepare");
        let t0 = Instant::now();
        rt.block_on(store.pull_dense(&mut params)).expect("pull");
        let t1 = Instant::now();
        let out = model.forward_backward(&params, &batch).expect("step");
        let t2 = Instant::now();
        rt.block_on(store.push(id, step as u64, None, &out))
            .expect("push");
        if step >= WARMUP {
            timing[0] += (t1 - t0).as_secs_f64();
            timing[1] += (t2 - t1).as_secs_f64();
            timing[2] += t2.elapsed().as_secs_f64();
        }
        samples += batch.len();
    }
    rt.block_on(store.flush()).expect("flush");
    let ms = |t: f64| t * 1e3 / steps.max(1) as f64;
    eprintln!(
        "    {id}: per step pull {:.2} ms, forward+backward {:.2} ms, push {:.2} ms",
        ms(timing[0]),
        ms(timing[1]),
        ms(timing[2])
    );
    (samples, start.elapsed().as_secs_f64())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let steps: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with("--"))
        .map_or(Ok(150), |s| s.parse())?;
    let (train_set, _) = testdata::split_every(&testdata::mnist(), 5);
    let model: Arc<dyn Model> = Arc::from(build(&ModelSpec::MnistMlp)?);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "ps_throughput: mnist_mlp, batch {BATCH}, adam, {steps} steps per trainer, {threads} cpu(s)"
    );
    // Like `edl trainer`: the model math runs outside the async workers, so a push in
    // flight progresses while the next batch computes.
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;

    // 1. Local baseline.
    let local: Arc<dyn ParamStore> = Arc::new(LocalStore::new(
        model.clone(),
        OptimizerKind::adam(),
        1e-3,
        1,
    ));
    client_rt.block_on(local.init("local", &ParamInit::of(model.as_ref(), 1)))?;
    let (n, secs) = train(&client_rt, model.clone(), local, "local", &train_set, steps);
    let local_rate = n as f64 / secs;
    println!("  local (no pserver)      {local_rate:8.0} samples/s   1.00x");

    // A pserver in its own runtime.
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let backend: Arc<dyn Backend> = Arc::new(MemBackend::new());
    let stop = CancellationToken::new();
    {
        let backend = backend.clone();
        let stop = stop.clone();
        server_rt.block_on(async move {
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            let mut cfg = PsConfig::new(edl_job::JobName::new("bench").expect("a valid job name"));
            cfg.shards = Some(1);
            tokio::spawn(edl_pserver::run(backend, cfg, listener, stop));
            Ok::<_, std::io::Error>(())
        })?;
    }
    let connect = |rt: &tokio::runtime::Runtime| {
        rt.block_on(PsClient::connect(
            backend.clone(),
            PsClientConfig::new(edl_job::JobName::new("bench").expect("a valid job name")),
            stop.child_token(),
        ))
    };
    let config = ParamConfig::new(Mode::Async, OptimizerConfig::adam(1e-3));

    // 2. One trainer, one pserver.
    let ps: Arc<dyn ParamStore> = Arc::new(PsStore::new(connect(&client_rt)?, config.clone(), 1));
    client_rt.block_on(ps.init("t0", &ParamInit::of(model.as_ref(), 1)))?;
    let (n, secs) = train(&client_rt, model.clone(), ps, "t0", &train_set, steps);
    let one = n as f64 / secs;
    println!(
        "  1 trainer + 1 pserver   {one:8.0} samples/s   {:.2}x  (overhead {:.1}%)",
        one / local_rate,
        (1.0 - one / local_rate) * 100.0
    );

    // 3. Two trainers, one pserver.
    let start = Instant::now();
    let totals: Vec<usize> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|i| {
                let model = model.clone();
                let config = config.clone();
                let data = &train_set;
                let connect = &connect;
                s.spawn(move || {
                    let rt = tokio::runtime::Builder::new_multi_thread()
                        .worker_threads(1)
                        .enable_all()
                        .build()
                        .expect("runtime");
                    let ps: Arc<dyn ParamStore> =
                        Arc::new(PsStore::new(connect(&rt).expect("connect"), config, 1));
                    let id = format!("t{}", i + 1);
                    rt.block_on(ps.init(&id, &ParamInit::of(model.as_ref(), 1)))
                        .expect("init");
                    train(&rt, model, ps, &id, data, steps).0
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("trainer thread"))
            .collect()
    });
    // Both threads' warm-ups overlap the measured window; count every sample over the
    // whole wall time (a slight underestimate of the steady rate).
    let all = totals.iter().sum::<usize>() + 2 * WARMUP * BATCH;
    let two = all as f64 / start.elapsed().as_secs_f64();
    println!(
        "  2 trainers + 1 pserver  {two:8.0} samples/s   {:.2}x of local, {:.2}x of 1 trainer",
        two / local_rate,
        two / one
    );
    stop.cancel();
    Ok(())
}
