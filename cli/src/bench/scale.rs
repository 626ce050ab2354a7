//! `edl bench scale`: one job at scale, measured (see the module docs of
//! [`super`] and docs/benchmarks.md, "Scale").
//!
//! The run: write the dataset (tmpfs where there is one), start etcd, the masters and
//! the pservers, define the dataset (timed: indexing and writing every task record),
//! start the trainers, sample once a second until the master says the job finished
//! (etcd's size, the masters' memory, progress; with `--failover`, SIGKILL the leading
//! master halfway through the first pass and time until the queue moves again), then
//! check: every record read once per pass, every shard's ledger holding every pass,
//! every weight minus the tasks applied, and the largest record of each kind in etcd
//! against the request limit.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use edl_job::{JobKeys, JobName};
use edl_master_client::{MasterClient, MasterClientConfig};
use edl_pserver_client::{DenseCache, PsClient, PsClientConfig};
use serde::Serialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::cluster::{Cluster, Setup};
use super::dataset::{self, Shape};
use super::probe;
use super::trainers::{self, Counts, DIM, Seen, Shared};

/// Arguments of `edl bench scale`.
#[derive(Debug, Args)]
pub struct ScaleArgs {
    /// Tasks per pass (one chunk each), over `--files` files.
    #[arg(long, default_value_t = 1_000_000)]
    pub tasks: u64,
    /// RecordIO files (`--tasks` must be a multiple).
    #[arg(long, default_value_t = 100_000)]
    pub files: u64,
    /// Records per task.
    #[arg(long, default_value_t = 1)]
    pub records_per_task: u64,
    /// Passes over the dataset.
    #[arg(long, default_value_t = 1)]
    pub passes: u32,
    /// Lightweight trainers in this process.
    #[arg(long, default_value_t = 1000)]
    pub trainers: usize,
    /// Masters (`edl master` processes; one leads).
    #[arg(long, default_value_t = 2)]
    pub masters: usize,
    /// Pservers (`edl pserver` processes, one shard each; at most 8).
    #[arg(long, default_value_t = 4)]
    pub pservers: u32,
    /// SIGKILL the leading master halfway through the first pass (needs two masters).
    #[arg(long)]
    pub failover: bool,
    /// With `--failover`: the tasks acknowledged before the SIGKILL (default: a quarter
    /// of the first pass).
    #[arg(long)]
    pub failover_after: Option<u64>,
    /// With `--failover`: end once the queue moved again after it, without training the
    /// rest or checking the records and ledgers (the failover's figure alone, at a scale
    /// whose whole run would take too long).
    #[arg(long, requires = "failover")]
    pub until_failover: bool,
    /// The masters' `--standby-copy` (false: a new leader reads the queue from etcd, as
    /// before standbys kept a copy).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub standby_copy: bool,
    /// etcd's history kept (periodic compaction), as `edl run` starts it.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5m")]
    pub compaction: Duration,
    /// Longest the job may take once its dataset is defined.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2h")]
    pub timeout: Duration,
    /// Work directory (data, logs, checkpoints); default: a new one on /dev/shm (or the
    /// temporary directory), removed at the end.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Also write the result as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// The largest record of one kind in etcd.
#[derive(Debug, Serialize)]
pub struct RecordSize {
    /// The kind: the key with its variable part as `*`.
    pub kind: String,
    /// How many there are.
    pub count: u64,
    /// The largest value, in bytes.
    pub max_bytes: u64,
    /// How many times it fits the master's transaction bound (1 MiB).
    pub margin: f64,
}

/// What `edl bench scale` measured.
#[derive(Debug, Default, Serialize)]
pub struct Outcome {
    /// Tasks per pass.
    pub tasks: u64,
    /// Files.
    pub files: u64,
    /// Passes.
    pub passes: u32,
    /// Trainers.
    pub trainers: usize,
    /// Seconds to write the dataset files.
    pub write_secs: f64,
    /// Seconds until every trainer joined (lease, registration, pserver connections,
    /// parameters).
    pub join_secs: f64,
    /// Seconds of `SetDataset` (indexing every file, writing every task record).
    pub define_secs: f64,
    /// etcd bytes written by `SetDataset`.
    pub define_etcd_bytes: u64,
    /// Seconds from the dataset defined to the job finished.
    pub train_secs: f64,
    /// Task transitions the master committed: leases (`dispatched`) and
    /// acknowledgements (`finished`), as its durable counters say at the end.
    pub transitions: u64,
    /// Tasks leased, every pass, a lease again after a failover or a requeue included
    /// (the master's durable counter).
    pub dispatched: u64,
    /// Tasks finished (the master's durable counter).
    pub finished: u64,
    /// Tasks put back in the queue (their trainer lost, or a lease taken away).
    pub requeued: u64,
    /// Tasks trained again because a restored pserver lacked their updates.
    pub recomputed: u64,
    /// Leader terms that took over a job already started.
    pub failovers: u64,
    /// Acknowledgements the master applied, as the trainers were told.
    pub acks_applied: u64,
    /// Acknowledgements answered as already applied (a retry after its answer was
    /// lost).
    pub acks_repeated: u64,
    /// Transitions per second of `train_secs`.
    pub transitions_per_sec: f64,
    /// etcd WAL bytes written while training, per transition (every role's writes).
    pub etcd_bytes_per_transition: f64,
    /// etcd's database at its largest, in bytes.
    pub etcd_db_max_bytes: i64,
    /// etcd's database in use at its largest, in bytes.
    pub etcd_db_in_use_max_bytes: i64,
    /// The leading master's peak resident memory, in bytes.
    pub master_peak_rss: u64,
    /// The leading master's peak resident memory per task.
    pub master_rss_per_task: f64,
    /// Seconds from the leader's SIGKILL to the queue moving again (`--failover`).
    pub failover_secs: Option<f64>,
    /// Seconds each leader term took to load the queue (the first leader's, of an empty
    /// job, then the one after the failover).
    pub loads_secs: Vec<f64>,
    /// Acknowledgements refused as stale.
    pub stale_acks: u64,
    /// The largest record of each kind in etcd.
    pub records: Vec<RecordSize>,
}

/// Runs `edl bench scale`.
pub fn run(args: ScaleArgs) -> anyhow::Result<()> {
    check(&args)?;
    edl_role::raise_open_files();
    let (dir, temp) = match &args.dir {
        Some(d) => (d.clone(), None),
        None => {
            let base = if std::path::Path::new("/dev/shm").is_dir() {
                PathBuf::from("/dev/shm")
            } else {
                std::env::temp_dir()
            };
            let t = tempfile::Builder::new()
                .prefix("edl-bench-scale-")
                .tempdir_in(base)
                .context("create a work directory")?;
            (t.path().to_owned(), Some(t))
        }
    };
    std::fs::create_dir_all(&dir)?;
    let result = crate::common::runtime()?.block_on(async {
        let shutdown = crate::common::shutdown_on_signals()?;
        tokio::select! {
            r = measure(&args, &dir) => r.map(Some),
            // Everything stops and is removed (etcd's directory too) as it drops.
            _ = shutdown.cancelled() => Ok(None),
        }
    });
    let out = match result {
        Ok(Some(o)) => o,
        Ok(None) => anyhow::bail!("interrupted"),
        Err(e) => {
            // Keep the logs of what failed.
            if let Some(t) = temp {
                let kept = t.keep();
                eprintln!("the work directory is kept: {}", kept.display());
            }
            return Err(e);
        }
    };
    print(&out);
    if let Some(p) = &args.json {
        std::fs::write(p, serde_json::to_vec_pretty(&out)?)
            .with_context(|| format!("write {}", p.display()))?;
    }
    Ok(())
}

fn check(a: &ScaleArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.files > 0 && a.tasks > 0,
        "--files and --tasks must be at least 1"
    );
    anyhow::ensure!(
        a.tasks.is_multiple_of(a.files),
        "--tasks ({}) must be a multiple of --files ({})",
        a.tasks,
        a.files
    );
    anyhow::ensure!(
        a.passes >= 1 && a.trainers >= 1 && a.masters >= 1 && a.records_per_task >= 1,
        "--passes, --trainers, --masters and --records-per-task must be at least 1"
    );
    anyhow::ensure!((1..=8).contains(&a.pservers), "--pservers must be 1 to 8");
    anyhow::ensure!(
        !a.failover || a.masters >= 2,
        "--failover needs at least two --masters"
    );
    // Each weight ends at minus the tasks applied: exact in f32 up to 2^24.
    anyhow::ensure!(
        a.tasks * u64::from(a.passes) <= 1 << 24,
        "--tasks times --passes must be at most 16,777,216 (the parameter check is exact in f32 up to there)"
    );
    Ok(())
}

/// Waits until `n` trainers joined (a trainer that fails to join ends the run).
async fn wait_joined(
    counts: &Counts,
    n: usize,
    workers: &mut tokio::task::JoinSet<anyhow::Result<()>>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut last = Instant::now();
    while counts.joined.load(Ordering::Relaxed) < n as u64 {
        if let Some(r) = workers.try_join_next() {
            r.context("a trainer panicked")??;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{} of {n} trainers joined within 10 minutes",
            counts.joined.load(Ordering::Relaxed)
        );
        if last.elapsed() >= Duration::from_secs(5) {
            last = Instant::now();
            println!(
                "{}/{n} trainers joined",
                counts.joined.load(Ordering::Relaxed)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

async fn measure(a: &ScaleArgs, dir: &std::path::Path) -> anyhow::Result<Outcome> {
    let shape = Shape {
        files: a.files,
        tasks_per_file: a.tasks / a.files,
        records_per_task: a.records_per_task,
    };
    let mut out = Outcome {
        tasks: a.tasks,
        files: a.files,
        passes: a.passes,
        trainers: a.trainers,
        ..Outcome::default()
    };
    let data = dir.join("data");
    out.write_secs = write_dataset(&data, shape, a).await?;
    let job = JobName::new("scale").expect("a valid job name");
    let mut cluster = Cluster::start(Setup {
        job: &job,
        dir,
        masters: a.masters,
        pservers: a.pservers,
        replicas: 1,
        compaction: a.compaction,
        master_args: vec!["--standby-copy".into(), a.standby_copy.to_string()],
    })
    .await?;
    let endpoint = cluster.etcd.endpoint(0);
    let stop = CancellationToken::new();
    let _stop = stop.clone().drop_guard();
    let mut mcfg = MasterClientConfig::new(job.clone());
    mcfg.retry_for = Duration::from_secs(120);
    let master = MasterClient::new(cluster.backend.clone(), mcfg, stop.child_token());
    let shared = Shared {
        backend: cluster.backend.clone(),
        job: job.clone(),
        seen: Arc::new(Seen::new(shape.records(), a.passes)),
        counts: Arc::new(Counts::default()),
        go: CancellationToken::new(),
    };
    let t = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for n in 0..a.trainers {
        workers.spawn(trainers::run(n, shared.clone(), stop.child_token()));
    }
    wait_joined(&shared.counts, a.trainers, &mut workers).await?;
    out.join_secs = t.elapsed().as_secs_f64();
    println!("{} trainers joined in {:.1} s", a.trainers, out.join_secs);
    let wal1 = define(&master, &data, a, &endpoint, &mut out).await?;
    shared.go.cancel();
    let t = Instant::now();
    let total = a.tasks * u64::from(a.passes);
    let watch = Watch {
        master: &master,
        total,
        failover: a.failover.then(|| a.failover_after.unwrap_or(total / 4)),
        until_failover: a.until_failover,
        timeout: a.timeout,
    };
    watch
        .run(&mut cluster, &shared.counts, &mut workers, &mut out)
        .await?;
    out.train_secs = t.elapsed().as_secs_f64();
    if a.until_failover {
        stop.cancel();
        while workers.join_next().await.is_some() {}
        out.loads_secs = cluster.masters.iter().flat_map(|m| m.loads(dir)).collect();
        println!("ended after the failover (--until-failover): records and ledgers not checked");
        return Ok(out);
    }
    let wal2 = probe::etcd_wal_bytes(&endpoint).await?;
    let counters = master
        .status()
        .await
        .context("the master's status at the end")?
        .counters
        .unwrap_or_default();
    out.dispatched = counters.dispatched;
    out.finished = counters.finished;
    out.requeued = counters.requeued;
    out.recomputed = counters.recomputed;
    out.failovers = counters.failovers;
    out.transitions = counters.dispatched + counters.finished;
    out.acks_applied = shared.counts.tasks.load(Ordering::Relaxed);
    out.acks_repeated = shared.counts.repeated.load(Ordering::Relaxed);
    out.transitions_per_sec = out.transitions as f64 / out.train_secs;
    out.etcd_bytes_per_transition = (wal2 - wal1) as f64 / out.transitions as f64;
    out.master_rss_per_task = out.master_peak_rss as f64 / a.tasks as f64;
    out.stale_acks = shared.counts.stale.load(Ordering::Relaxed);
    while let Some(r) = workers.join_next().await {
        r.context("a trainer panicked")??;
    }
    out.loads_secs = cluster.masters.iter().flat_map(|m| m.loads(dir)).collect();
    verify(&cluster, &job, &shared.seen, a, &stop).await?;
    out.records = record_sizes(&cluster, &job).await?;
    Ok(out)
}

/// Writes the dataset (off the runtime); returns the seconds it took.
async fn write_dataset(data: &std::path::Path, shape: Shape, a: &ScaleArgs) -> anyhow::Result<f64> {
    let started = Instant::now();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    tokio::task::spawn_blocking({
        let data = data.to_owned();
        move || dataset::write(&data, shape, threads)
    })
    .await??;
    let secs = started.elapsed().as_secs_f64();
    println!(
        "wrote {} files, {} tasks, {} records in {secs:.1} s",
        a.files,
        a.tasks,
        shape.records()
    );
    Ok(secs)
}

/// Defines the dataset, timed, with the etcd bytes it wrote; returns etcd's WAL bytes
/// after it.
async fn define(
    master: &MasterClient,
    data: &std::path::Path,
    a: &ScaleArgs,
    endpoint: &str,
    out: &mut Outcome,
) -> anyhow::Result<u64> {
    let wal0 = probe::etcd_wal_bytes(endpoint).await?;
    let t = Instant::now();
    let ds = master
        .set_dataset(vec![dataset::glob(data)], 1, a.passes)
        .await
        .context("define the dataset")?;
    out.define_secs = t.elapsed().as_secs_f64();
    let wal1 = probe::etcd_wal_bytes(endpoint).await?;
    out.define_etcd_bytes = wal1 - wal0;
    anyhow::ensure!(
        ds.tasks == a.tasks,
        "the master indexed {} tasks, not {}",
        ds.tasks,
        a.tasks
    );
    println!(
        "dataset defined in {:.1} s ({:.1} MB written to etcd)",
        out.define_secs,
        out.define_etcd_bytes as f64 / 1e6
    );
    Ok(wal1)
}

/// The sampling loop while the job trains.
struct Watch<'a> {
    master: &'a MasterClient,
    total: u64,
    /// SIGKILL the leader once this many tasks are acknowledged.
    failover: Option<u64>,
    /// Return once the failover is measured.
    until_failover: bool,
    timeout: Duration,
}

impl Watch<'_> {
    async fn run(
        &self,
        cluster: &mut Cluster,
        counts: &Counts,
        workers: &mut tokio::task::JoinSet<anyhow::Result<()>>,
        out: &mut Outcome,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + self.timeout;
        // (the master killed, when, the tasks acknowledged when another one led)
        let mut killed: Option<(usize, Instant, Option<u64>)> = None;
        let mut last_print = Instant::now();
        loop {
            anyhow::ensure!(
                Instant::now() < deadline,
                "the job did not finish within {:?}",
                self.timeout
            );
            cluster.check_alive(killed.map(|k| k.0))?;
            if let Some(r) = workers.try_join_next() {
                r.context("a trainer panicked")??;
            }
            let done = counts.tasks.load(Ordering::Relaxed);
            if let Ok(db) = cluster.etcd.db_status(0).await {
                out.etcd_db_max_bytes = out.etcd_db_max_bytes.max(db.db_size);
                out.etcd_db_in_use_max_bytes = out.etcd_db_in_use_max_bytes.max(db.db_size_in_use);
            }
            if let Some(l) = cluster.leader().await
                && let Some((_, peak)) = cluster.masters[l].memory()
            {
                out.master_peak_rss = out.master_peak_rss.max(peak);
            }
            // The failover: SIGKILL the leader a quarter of the way in; it is over once
            // another master leads and a task was acknowledged since.
            match killed {
                None if self.failover.is_some_and(|at| done >= at) => {
                    if let Some(l) = cluster.leader().await {
                        println!("SIGKILL the leading master ({})", cluster.masters[l].name);
                        cluster.masters[l].kill();
                        killed = Some((l, Instant::now(), None));
                    }
                }
                Some((who, at, None)) if cluster.leader().await.is_some_and(|l| l != who) => {
                    killed = Some((who, at, Some(done)));
                }
                Some((_, at, Some(then))) if out.failover_secs.is_none() && done > then => {
                    out.failover_secs = Some(at.elapsed().as_secs_f64());
                    if self.until_failover {
                        return Ok(());
                    }
                }
                _ => {}
            }
            if last_print.elapsed() >= Duration::from_secs(5) {
                last_print = Instant::now();
                println!(
                    "{done}/{} tasks acknowledged, {} trainers joined, etcd {:.1} MB",
                    self.total,
                    counts.joined.load(Ordering::Relaxed),
                    out.etcd_db_max_bytes as f64 / 1e6
                );
            }
            // The master says when the job finished (a retried acknowledgement counts as
            // repeated, not again).
            if let Ok(s) = self.master.status().await
                && s.finished
            {
                return Ok(());
            }
            // Finer while the failover is under way: it is measured to a tenth of a second.
            let failing_over = killed.is_some() && out.failover_secs.is_none();
            let every = if failing_over { 100 } else { 1000 };
            tokio::time::sleep(Duration::from_millis(every)).await;
        }
    }
}

/// Every record read once per pass; every shard's ledger holding every pass; every
/// weight minus the tasks applied.
async fn verify(
    cluster: &Cluster,
    job: &JobName,
    seen: &Seen,
    a: &ScaleArgs,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    let (missing, repeated, first) = seen.check();
    anyhow::ensure!(
        missing == 0 && repeated == 0,
        "records not read exactly once per pass: {missing} missing, {repeated} repeated ({first:?})"
    );
    let ps = PsClient::connect(
        cluster.backend.clone(),
        PsClientConfig::new(job.clone()),
        stop.child_token(),
    )
    .await?;
    for (i, s) in ps.status().await.into_iter().enumerate() {
        let s = s.with_context(|| format!("status of shard {i}"))?;
        anyhow::ensure!(
            s.passes_contained >= a.passes,
            "shard {i}'s ledger holds {} of {} passes",
            s.passes_contained,
            a.passes
        );
    }
    let mut cache = DenseCache::new();
    ps.pull_dense(&mut cache).await?;
    let w = cache.get("w").context("the parameter w")?;
    let want = -((a.tasks * u64::from(a.passes)) as f32);
    anyhow::ensure!(
        w.len() == DIM && w.iter().all(|&x| x == want),
        "the weights are not {want} (each task applied once): {:?}",
        &w[..w.len().min(4)]
    );
    println!(
        "checked: every record read once per pass, every ledger holds every pass, every weight {want}"
    );
    Ok(())
}

/// The largest record of each kind under the job's prefix.
async fn record_sizes(cluster: &Cluster, job: &JobName) -> anyhow::Result<Vec<RecordSize>> {
    let keys = JobKeys::new(job);
    let (kvs, _) = cluster.backend.range(keys.root()).await?;
    let mut kinds: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for kv in &kvs {
        let rest = kv.key.strip_prefix(keys.root()).unwrap_or(&kv.key);
        // A collection's members (numbered or named after a member) as one kind.
        let kind = match rest.rsplit_once('/') {
            Some((head, last)) if last.chars().any(|c| c.is_ascii_digit()) => {
                format!("{head}/*")
            }
            _ => rest.to_owned(),
        };
        let e = kinds.entry(kind).or_default();
        e.0 += 1;
        e.1 = e.1.max(kv.value.len() as u64);
    }
    let limit = edl_master::store::MAX_BYTES_PER_TXN as f64;
    Ok(kinds
        .into_iter()
        .map(|(kind, (count, max))| RecordSize {
            kind,
            count,
            max_bytes: max,
            margin: limit / max.max(1) as f64,
        })
        .collect())
}

fn print(o: &Outcome) {
    println!();
    println!(
        "{} tasks over {} files, {} passes, {} trainers",
        o.tasks, o.files, o.passes, o.trainers
    );
    println!("  join: {:.1} s for every trainer", o.join_secs);
    println!(
        "  define: {:.1} s, {:.2} etcd bytes per task",
        o.define_secs,
        o.define_etcd_bytes as f64 / o.tasks as f64
    );
    println!(
        "  train: {:.1} s, {:.0} transitions/s, {:.0} etcd bytes per transition",
        o.train_secs, o.transitions_per_sec, o.etcd_bytes_per_transition
    );
    println!(
        "  etcd database at most {:.1} MB ({:.1} MB in use); leading master at most {:.1} MB resident ({:.0} bytes per task)",
        o.etcd_db_max_bytes as f64 / 1e6,
        o.etcd_db_in_use_max_bytes as f64 / 1e6,
        o.master_peak_rss as f64 / 1e6,
        o.master_rss_per_task
    );
    if let Some(f) = o.failover_secs {
        println!("  failover: the queue moved again {f:.1} s after the leader's SIGKILL");
    }
    println!("  leader terms loaded the queue in {:?} s", o.loads_secs);
    println!("  largest record of each kind (margin: times it fits the 1 MiB transaction bound):");
    for r in &o.records {
        println!(
            "    {:<28} {:>9} records, largest {:>9} bytes, margin {:>8.1}x",
            r.kind, r.count, r.max_bytes, r.margin
        );
    }
}
