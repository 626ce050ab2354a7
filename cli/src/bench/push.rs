//! `edl bench push`: what a shard's replicas cost a push (docs/benchmarks.md,
//! "Replicated pservers"). For each replica count asked (`--replicas 1,2`), in one
//! sitting and interleaved over `--rounds`: a real etcd and `R` `edl pserver --replicas
//! R` processes holding one shard of `--params` floats (default: the `scripts/bench-peer`
//! MLP's 784-256-10, 203,530), one client pushing `--pushes` dense gradients one after
//! another (async SGD, over the bulk path as trainers push), each timed from send to
//! acknowledgement. With R >= 2 the pushes start once every replica is in sync, so each
//! is acknowledged only after the backup applied it too.
//!
//! Prints, per replica count: push latency p50 / p99 / mean (medians over the rounds),
//! pushes per second, and each pserver's peak resident memory; and the R-replica rows'
//! ratios to the first row.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use edl_job::{GroupRecord, JobKeys, JobName, Record};
use edl_pserver_client::{DenseInit, Mode, OptimizerConfig, ParamConfig, PsClient, PsClientConfig};
use serde::Serialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::cluster::{Cluster, Setup};

/// Arguments of `edl bench push`.
#[derive(Debug, Args)]
pub struct PushArgs {
    /// Replica counts to compare, comma-separated (the first is the baseline).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub replicas: Vec<u32>,
    /// Floats in the shard's one dense parameter.
    #[arg(long, default_value_t = 203_530)]
    pub params: usize,
    /// Pushes timed per round and replica count.
    #[arg(long, default_value_t = 2000)]
    pub pushes: u64,
    /// Rounds (each runs every replica count once, in order).
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Also write the result as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One replica count's figures.
#[derive(Debug, Clone, Serialize)]
pub struct PushRow {
    /// Replicas of the shard.
    pub replicas: u32,
    /// Push latency, send to acknowledgement, median over rounds of each round's p50.
    pub p50_ms: f64,
    /// Likewise p99.
    pub p99_ms: f64,
    /// Likewise the mean.
    pub mean_ms: f64,
    /// Pushes acknowledged per second (one client, one push in flight).
    pub pushes_per_s: f64,
    /// Peak resident memory of each pserver process, MiB (the last round's).
    pub pserver_peak_mib: Vec<f64>,
}

/// Runs `edl bench push`.
pub fn run(args: PushArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !args.replicas.is_empty() && args.replicas.iter().all(|r| (1..=8).contains(r)),
        "--replicas: counts of 1..=8, comma-separated"
    );
    anyhow::ensure!(args.pushes >= 100, "--pushes: at least 100");
    anyhow::ensure!(args.rounds >= 1, "--rounds: at least 1");
    anyhow::ensure!(args.params >= 1, "--params: at least 1");
    let rows = crate::common::runtime()?.block_on(async {
        let shutdown = crate::common::shutdown_on_signals()?;
        tokio::select! {
            r = measure(&args) => r.map(Some),
            _ = shutdown.cancelled() => Ok(None),
        }
    })?;
    let Some(rows) = rows else {
        anyhow::bail!("interrupted");
    };
    print_table(&args, &rows);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("write {}", path.display()))?;
    }
    Ok(())
}

/// One round's figures for one replica count.
struct Round {
    p50: f64,
    p99: f64,
    mean: f64,
    per_s: f64,
    peaks: Vec<f64>,
}

async fn measure(a: &PushArgs) -> anyhow::Result<Vec<PushRow>> {
    let mut rounds: Vec<Vec<Round>> = a.replicas.iter().map(|_| Vec::new()).collect();
    for round in 0..a.rounds {
        for (i, &r) in a.replicas.iter().enumerate() {
            eprintln!(
                "bench push: round {}/{}, {r} replica(s), {} pushes",
                round + 1,
                a.rounds,
                a.pushes
            );
            rounds[i].push(one(a, r).await?);
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok(a.replicas
        .iter()
        .zip(rounds)
        .map(|(&replicas, rs)| PushRow {
            replicas,
            p50_ms: median(rs.iter().map(|r| r.p50).collect()),
            p99_ms: median(rs.iter().map(|r| r.p99).collect()),
            mean_ms: median(rs.iter().map(|r| r.mean).collect()),
            pushes_per_s: median(rs.iter().map(|r| r.per_s).collect()),
            pserver_peak_mib: rs.last().map(|r| r.peaks.clone()).unwrap_or_default(),
        })
        .collect())
}

/// One cluster with `replicas` replicas of one shard, `a.pushes` pushes timed.
async fn one(a: &PushArgs, replicas: u32) -> anyhow::Result<Round> {
    let dir = tempfile::Builder::new()
        .prefix("edl-bench-push-")
        .tempdir()
        .context("create a work directory")?;
    let job = JobName::new("bench-push").expect("a valid job name");
    let mut cluster = Cluster::start(Setup {
        job: &job,
        dir: dir.path(),
        masters: 0,
        pservers: 1,
        replicas,
        compaction: Duration::from_secs(300),
        master_args: Vec::new(),
    })
    .await?;
    let cancel = CancellationToken::new();
    let _stop = cancel.clone().drop_guard();
    let ps = PsClient::connect(
        cluster.backend.clone(),
        PsClientConfig::new(job.clone()),
        cancel.child_token(),
    )
    .await
    .context("connect to the pservers")?;
    let zeros = vec![0.0f32; a.params];
    ps.init(
        "bench",
        &[DenseInit {
            name: "w",
            shape: &[a.params],
            values: &zeros,
        }],
        &[],
        ParamConfig::new(Mode::Async, OptimizerConfig::sgd(1e-6)),
    )
    .await
    .context("initialise the shard")?;
    if replicas > 1 {
        wait_in_sync(&cluster, &job, replicas - 1).await?;
    }
    let grad: Vec<f32> = (0..a.params).map(|i| (i % 7) as f32 * 1e-3).collect();
    // A few untimed pushes: connections open, buffers sized.
    for k in 1..=20u64 {
        ps.push("bench", k, &[("w", &grad)], &[]).await?;
    }
    let mut lat = Vec::with_capacity(a.pushes as usize);
    let started = Instant::now();
    for k in 21..21 + a.pushes {
        let t = Instant::now();
        let out = ps.push("bench", k, &[("w", &grad)], &[]).await?;
        anyhow::ensure!(out.applied, "push {k} was not applied");
        lat.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let wall = started.elapsed().as_secs_f64();
    cluster.check_alive(None)?;
    let peaks = cluster
        .pservers
        .iter()
        .map(|p| {
            p.memory()
                .map_or(0.0, |(_, peak)| peak as f64 / (1 << 20) as f64)
        })
        .collect();
    let mean = lat.iter().sum::<f64>() / lat.len() as f64;
    lat.sort_by(f64::total_cmp);
    let at = |q: f64| lat[((lat.len() - 1) as f64 * q).round() as usize];
    Ok(Round {
        p50: at(0.5),
        p99: at(0.99),
        mean,
        per_s: a.pushes as f64 / wall,
        peaks,
    })
}

/// Waits until the shard's group names `backups` backups in sync.
async fn wait_in_sync(cluster: &Cluster, job: &JobName, backups: u32) -> anyhow::Result<()> {
    let key = JobKeys::new(job).ps_group(0);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let group = cluster
            .backend
            .get(&key)
            .await
            .ok()
            .flatten()
            .and_then(|kv| GroupRecord::decode(&kv.value).ok());
        if group
            .as_ref()
            .is_some_and(|g| g.backups.len() == backups as usize)
        {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the shard's {backups} backup(s) did not get in sync within 120 s: {group:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn print_table(a: &PushArgs, rows: &[PushRow]) {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "?".to_owned());
    println!(
        "one shard of {} floats, {} pushes x {} rounds (medians), one client, {} cores ({cpu})",
        a.params,
        a.pushes,
        a.rounds,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "| replicas | push p50 ms | push p99 ms | mean ms | pushes/s | vs {} replica(s) | peak memory per pserver, MiB |",
        rows[0].replicas
    );
    println!("|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {:.2} | {:.2} | {:.2} | {:.0} | {:.2}x | {} |",
            r.replicas,
            r.p50_ms,
            r.p99_ms,
            r.mean_ms,
            r.pushes_per_s,
            r.pushes_per_s / rows[0].pushes_per_s,
            r.pserver_peak_mib
                .iter()
                .map(|m| format!("{m:.0}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}
