//! Measures how fast coordination recovers from a killed process, on a local
//! single-member etcd started by the test kit (lease TTL 2 s):
//!
//! - SIGKILL of a lease holder → deletion of its key (seen by a watch);
//! - SIGKILL of the leader → a waiting follower is elected.
//!
//! Each run kills a child process (this executable, re-run in a child role) at a
//! random point of its keep-alive period. Prints every sample and the medians.
//!
//! ```text
//! cargo run -p edl-coord --example failover_bench [-- RUNS]
//! ```

use std::error::Error as StdError;
use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, Election, EtcdBackend, EtcdConfig, EventKind, Lease};
use edl_testkit::{ChildProcess, EtcdCluster, child_role};
use futures::StreamExt;
use rand::Rng;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

type BoxResult<T> = Result<T, Box<dyn StdError + Send + Sync>>;

const TTL: Duration = Duration::from_secs(2);
const CHILD_MAX_LIFE: Duration = Duration::from_secs(60);

async fn connect(endpoints: Vec<String>) -> BoxResult<Arc<dyn Backend>> {
    let cfg = EtcdConfig::new(endpoints)
        .with_dial_timeout(Duration::from_secs(2))
        .with_request_timeout(Duration::from_secs(2));
    Ok(Arc::new(EtcdBackend::connect(cfg).await?))
}

fn var(name: &str) -> BoxResult<String> {
    std::env::var(name).map_err(|_| format!("child needs {name}").into())
}

/// The child roles: hold a lease with a key, or lead an election; then idle until
/// killed (bounded).
async fn child(role: &str) -> BoxResult<()> {
    let endpoints = var("BENCH_ENDPOINTS")?
        .split(',')
        .map(str::to_owned)
        .collect();
    let backend = connect(endpoints).await?;
    let lease = Lease::grant(backend.clone(), TTL, CancellationToken::new()).await?;
    match role {
        "holder" => {
            backend
                .put(&var("BENCH_KEY")?, b"x".to_vec(), Some(lease.id()))
                .await?;
            println!("READY");
        }
        "leader" => {
            let election = Election::new(backend.clone(), var("BENCH_ELECTION")?);
            let _leadership = election
                .campaign(&lease, b"child".to_vec(), &CancellationToken::new())
                .await?;
            println!("READY");
            tokio::time::sleep(CHILD_MAX_LIFE).await;
            return Ok(());
        }
        other => return Err(format!("unknown role {other}").into()),
    }
    tokio::time::sleep(CHILD_MAX_LIFE).await;
    Ok(())
}

/// Kills at a random point of the keep-alive period (renewals every TTL / 3).
async fn random_phase() {
    let ms = rand::rng().random_range(0..(TTL / 3).as_millis() as u64);
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

async fn key_deletion(
    cluster: &EtcdCluster,
    backend: &Arc<dyn Backend>,
    run: usize,
) -> BoxResult<Duration> {
    let key = format!("/bench/holder/{run}");
    let endpoints = cluster.endpoints().join(",");
    let mut child = ChildProcess::spawn_self(
        &[],
        "holder",
        &[
            ("BENCH_ENDPOINTS", endpoints.as_str()),
            ("BENCH_KEY", key.as_str()),
        ],
    )?;
    child.expect_line("READY", Duration::from_secs(20)).await?;
    let kv = backend.get(&key).await?.ok_or("holder key missing")?;
    let mut watch = backend
        .watch_prefix(&key, Some(kv.mod_revision + 1))
        .await?;
    random_phase().await;
    child.kill().await?;
    let killed = Instant::now();
    loop {
        let ev = tokio::time::timeout(TTL * 3, watch.next())
            .await
            .map_err(|_| "key not deleted within 3 ttl")?
            .ok_or("watch ended")??;
        if ev.kind == EventKind::Delete && ev.kv.key == key {
            return Ok(killed.elapsed());
        }
    }
}

async fn failover(
    cluster: &EtcdCluster,
    backend: &Arc<dyn Backend>,
    run: usize,
) -> BoxResult<Duration> {
    let prefix = format!("/bench/election/{run}");
    let endpoints = cluster.endpoints().join(",");
    let mut child = ChildProcess::spawn_self(
        &[],
        "leader",
        &[
            ("BENCH_ENDPOINTS", endpoints.as_str()),
            ("BENCH_ELECTION", prefix.as_str()),
        ],
    )?;
    child.expect_line("READY", Duration::from_secs(20)).await?;
    let lease = Lease::grant(backend.clone(), TTL, CancellationToken::new()).await?;
    let election = Election::new(backend.clone(), prefix);
    let (tx, rx) = tokio::sync::oneshot::channel();
    let follower = {
        let election = election.clone();
        tokio::spawn(async move {
            let r = election
                .campaign(&lease, b"follower".to_vec(), &CancellationToken::new())
                .await;
            let _ = tx.send(Instant::now());
            r.map(|_| lease)
        })
    };
    // Wait until the follower stands in line.
    let deadline = Instant::now() + Duration::from_secs(5);
    while backend.range(election.prefix()).await?.0.len() < 2 {
        if Instant::now() > deadline {
            return Err("follower did not queue".into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    random_phase().await;
    child.kill().await?;
    let killed = Instant::now();
    let elected = tokio::time::timeout(TTL * 3, rx)
        .await
        .map_err(|_| "no failover within 3 ttl")??;
    let lease = follower.await??;
    lease.revoke().await?;
    Ok(elected - killed)
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

fn show(xs: &[Duration]) -> String {
    xs.iter()
        .map(|d| format!("{:.3}", d.as_secs_f64()))
        .collect::<Vec<_>>()
        .join(", ")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> BoxResult<()> {
    if let Some(role) = child_role() {
        return child(&role).await;
    }
    let runs: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(5)
        .max(1);
    let cluster = EtcdCluster::start(1).await?;
    let backend = cluster.connect().await?;

    let mut deletions = Vec::new();
    for run in 0..runs {
        deletions.push(key_deletion(&cluster, &backend, run).await?);
    }
    let mut failovers = Vec::new();
    for run in 0..runs {
        failovers.push(failover(&cluster, &backend, run).await?);
    }
    println!("etcd 1 member, lease ttl {TTL:?}, {runs} runs");
    println!(
        "sigkill of lease holder -> key deleted: median {:.3} s  (runs: {})",
        median(deletions.clone()).as_secs_f64(),
        show(&deletions)
    );
    println!(
        "sigkill of leader -> follower elected:  median {:.3} s  (runs: {})",
        median(failovers.clone()).as_secs_f64(),
        show(&failovers)
    );
    Ok(())
}
