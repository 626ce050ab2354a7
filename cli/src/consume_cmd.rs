//! `edl consume`: reads a job's tasks like a trainer, without a model.
//!
//! It registers under `trainers/<id>` with its own lease, leases tasks through the
//! `cloud_reader`, "trains" each record (optionally writing it to a file and sleeping a
//! little per record), and acknowledges each task afterwards. Use it to dry-run a
//! dataset's distribution and throughput; the fault tests SIGKILL it mid-task.

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use edl_job::TrainerRecord;
use edl_trainer::process::{Session, SessionConfig};
use edl_trainer::tasks::Next;
use tokio_util::sync::CancellationToken;

use crate::common::RoleArgs;

/// Arguments of `edl consume`.
#[derive(Debug, Args)]
pub struct ConsumeArgs {
    /// etcd, startup wait, job.
    #[command(flatten)]
    pub role: RoleArgs,
    /// This consumer's id (default: `consumer-<pid>`).
    #[arg(long)]
    pub id: Option<String>,
    /// TTL of the registration lease: the master notices a dead consumer within it.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub lease_ttl: Duration,
    /// Append each consumed record to this file as `<task> <generation> <record>` lines
    /// (records are written as UTF-8 when they are, else as hex).
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// Pretend each record takes this long to train.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "0s")]
    pub per_record: Duration,
    /// Tasks read ahead.
    #[arg(long, default_value_t = 2)]
    pub read_ahead: usize,
}

/// Runs `edl consume`.
pub fn run(args: ConsumeArgs) -> anyhow::Result<()> {
    let role = &args.role;
    let (job, token, etcd_wait) = (
        role.job.job.clone(),
        role.job.token.clone(),
        role.wait.etcd_wait,
    );
    let tls = role.job.tls.load()?;
    role.run(|backend, shutdown| async move {
        let id = args
            .id
            .clone()
            .unwrap_or_else(|| format!("consumer-{}", std::process::id()));
        // The session lives until the drain is over: `shutdown` only starts it.
        let life = CancellationToken::new();
        let _life_guard = life.clone().drop_guard();
        let joining = Session::join(
            backend,
            SessionConfig {
                job,
                id: id.clone(),
                lease_ttl: args.lease_ttl,
                etcd_wait,
                token,
                tls,
                record: TrainerRecord::model_less(),
            },
            life.clone(),
        );
        let session = tokio::select! {
            r = joining => r?,
            _ = shutdown.cancelled() => return Ok(()),
        };
        let mut reader = session.reader(Some(args.read_ahead), None);
        let mut out = match &args.out {
            Some(p) => Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .with_context(|| format!("open {}", p.display()))?,
            ),
            None => None,
        };
        println!("consumer {id} registered");
        let (mut tasks, mut records) = (0u64, 0u64);
        let lost = session.lost();
        loop {
            let item = tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = lost.cancelled() => anyhow::bail!("lost the etcd lease; exiting"),
                item = reader.next() => item,
            };
            let Some(item) = item else { break };
            match item? {
                Next::Task(t) => {
                    let mut buf = Vec::new();
                    for r in &t.records {
                        if !args.per_record.is_zero() {
                            tokio::time::sleep(args.per_record).await;
                        }
                        if out.is_some() {
                            let text = match std::str::from_utf8(r) {
                                Ok(s) if !s.contains('\n') => s.to_owned(),
                                _ => r.iter().map(|b| format!("{b:02x}")).collect(),
                            };
                            writeln!(buf, "{} {} {text}", t.task.id, t.task.generation)?;
                        }
                    }
                    if let Some(f) = &mut out {
                        f.write_all(&buf).context("write --out")?;
                    }
                    match reader
                        .acks()
                        .finished(&t.task, t.records.len() as u64, &[])
                        .await
                    {
                        Ok(_) => {}
                        Err(e) if e.is_stale() => {
                            tracing::warn!(task = %t.task.id, "task was taken away meanwhile");
                            continue;
                        }
                        Err(e) => return Err(e).context("report a finished task"),
                    }
                    tasks += 1;
                    records += t.records.len() as u64;
                }
                Next::PassFinished { ended, next } => {
                    println!("pass {ended} finished; next pass {next}");
                }
                Next::JobFinished => {
                    println!("job finished");
                    break;
                }
                // The reader yields neither (they are `Tasks::next`'s).
                Next::Drained | Next::Closed => break,
            }
        }
        reader.drain().await;
        session.leave().await;
        println!("consumed {tasks} tasks, {records} records");
        Ok(())
    })
}
