//! The Rust client's rates, the baseline of the Python package's benchmark
//! (`python/bench/rates.py` runs this next to its Python twin on the same job data and
//! pservers and prints both):
//!
//! - `read`: joins a job as a trainer and reads every task of its passes through
//!   [`edl_trainer::Tasks`] (the `cloud_reader`, acknowledging each task), touching every
//!   record's bytes; prints `{"records", "bytes", "secs"}`.
//! - `pushpull FLOATS ROUNDS`: joins a job, declares one dense parameter of `FLOATS`
//!   values (the one-trainer initialisation), then times `ROUNDS` rounds of a push
//!   (flushed: applied on the pservers) and a pull of the new values into the trainer's
//!   parameters; prints `{"floats", "rounds", "pull_secs", "push_secs"}`.
//!
//! `cargo run --release -p edl-trainer --example client_rates -- ETCD JOB read|pushpull ...`

use std::sync::Arc;
use std::time::Instant;

use edl_coord::{Backend, EtcdConfig};
use edl_trainer::process::{self, Joined, Member, TrainerConfig};
use edl_trainer::{DenseParam, Next, ParamInit, ParamStore, Params, StepOutput};
use tokio_util::sync::CancellationToken;

type Error = Box<dyn std::error::Error + Send + Sync>;

fn usage() -> Error {
    "usage: client_rates ETCD_URL JOB read | pushpull FLOATS ROUNDS".into()
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (etcd, job, what) = match &args[..] {
        [etcd, job, what, ..] => (etcd.clone(), job.parse()?, what.as_str()),
        _ => return Err(usage()),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let shutdown = CancellationToken::new();
    let mut cfg = TrainerConfig::new(job);
    cfg.id = format!("rust-{what}");
    rt.block_on(async {
        let backend: Arc<dyn Backend> =
            edl_role::connect(&EtcdConfig::new(vec![etcd]), cfg.etcd_wait, &shutdown)
                .await?
                .ok_or("stopped")?;
        let spec = process::fetch_spec(&backend, &cfg, &shutdown).await?;
        let member = match Member::join(backend, &cfg, spec, "cpu", Instant::now(), &shutdown)
            .await?
        {
            Joined::Member(m) => m,
            Joined::Drained(_) => return Err("drained while joining".into()),
        };
        let store = member.store();
        let line = match what {
            "read" => {
                let init = ParamInit {
                    dense: vec![DenseParam {
                        name: "w".into(),
                        shape: vec![1],
                    }],
                    values: vec![vec![0.0]],
                    sparse: vec![],
                };
                store.init(&cfg.id, &init).await?;
                let tasks = member.tasks();
                read(tasks, &shutdown).await?
            }
            "pushpull" => {
                let floats: usize = args.get(3).ok_or_else(usage)?.parse()?;
                let rounds: usize = args.get(4).ok_or_else(usage)?.parse()?;
                let init = ParamInit {
                    dense: vec![DenseParam {
                        name: "w".into(),
                        shape: vec![floats],
                    }],
                    values: vec![vec![0.0; floats]],
                    sparse: vec![],
                };
                store.init(&cfg.id, &init).await?;
                let mut params = Params::default();
                store.pull_dense(&mut params).await?; // warm-up: the layout
                let grads = vec![1e-6f32; floats];
                let (mut pull_secs, mut push_secs) = (0.0, 0.0);
                for step in 0..rounds {
                    // A push applied on the pservers, then a pull of the new values.
                    let t = Instant::now();
                    let out = StepOutput {
                        loss: 0.0,
                        examples: 1,
                        dense: vec![grads.clone()],
                        sparse: vec![],
                    };
                    store.push_owned(&cfg.id, step as u64, None, out).await?;
                    store.flush().await?;
                    let mid = Instant::now();
                    store.pull_dense(&mut params).await?;
                    push_secs += (mid - t).as_secs_f64();
                    pull_secs += mid.elapsed().as_secs_f64();
                }
                format!(
                    r#"{{"floats": {floats}, "rounds": {rounds}, "pull_secs": {pull_secs}, "push_secs": {push_secs}}}"#
                )
            }
            _ => return Err(usage()),
        };
        member.abandon().await;
        println!("{line}");
        Ok(())
    })
}

/// Reads every task of the job's remaining passes, acknowledging each.
async fn read(
    mut tasks: edl_trainer::Tasks,
    shutdown: &CancellationToken,
) -> Result<String, Error> {
    let (mut records, mut bytes) = (0u64, 0u64);
    let t = Instant::now();
    loop {
        match tasks.next(shutdown).await? {
            Next::Task(data) => {
                let started = Instant::now();
                for r in &data.records {
                    bytes += r.len() as u64;
                    // Touch the bytes, as a consumer does.
                    std::hint::black_box(r.first());
                }
                let n = data.records.len() as u64;
                records += n;
                tasks.trained(data.task, n, started).await?;
            }
            Next::PassFinished { .. } => {}
            Next::JobFinished | Next::Drained | Next::Closed => break,
        }
    }
    tasks.close().await?;
    let secs = t.elapsed().as_secs_f64();
    Ok(format!(
        r#"{{"records": {records}, "bytes": {bytes}, "secs": {secs}}}"#
    ))
}
