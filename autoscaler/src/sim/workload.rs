//! Real workloads: the Pollux (OSDI'21) artifact's Philly-derived job traces
//! (`name,time,application,num_replicas,batch_size`, one job per line) as scenarios, on
//! the artifact's cluster of 16 nodes of 4 GPUs, one trainer per GPU.
//!
//! Each job keeps its batch size (edl does not adapt it). Its work is its application's
//! whole progress and its true speed at `n` trainers is measured, not a curve
//! ([`Application::rate`](super::apps::Application::rate)). Its elastic range is 1 trainer to 4 times its request, never
//! more than its batch allows (each GPU takes at least the application's smallest
//! measured local batch) nor the cluster's 64 GPUs; without autoscaling it runs its
//! request.

use std::path::Path;

use super::apps::{Applications, GPUS_PER_NODE};
use super::table::{Table, TableError};
use super::{Scenario, SimConfig, Speed, TraceJob};
use crate::Resources;

/// Nodes of the artifact's cluster.
pub const NODES: u32 = 16;

/// A job's elastic range: up to this many times its request.
pub const MAX_FACTOR: u32 = 4;

/// Seconds a job makes no progress after its GPU count changes (the artifact's restore
/// from a checkpoint).
pub const CHANGE_COST: f64 = 30.0;

/// edl's policy as it runs on this cluster: it knows what a change costs, suspends whole
/// jobs when a job worth more would wait (the artifact's jobs restart from checkpoints),
/// and weighs work left by its square root, between equal sharing and shortest first.
/// Jobs are left alone 4 minutes after a change, and not grown within 8 minutes of
/// their end (8 and 16 changes' cost).
pub fn policy_config() -> crate::policy::PolicyConfig {
    crate::policy::PolicyConfig::preemptive(CHANGE_COST)
}

/// One job of a workload file.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadJob {
    /// Its name.
    pub name: String,
    /// Submission, seconds after the start.
    pub time: f64,
    /// Its application.
    pub application: String,
    /// GPUs it asked for.
    pub replicas: u32,
    /// Its (total) batch size.
    pub batch: u64,
    /// Its line in the file.
    pub line: usize,
}

/// Reads a workload (`file` names it in errors): every row checked, the first bad one
/// reported with its line.
pub fn parse(file: &str, text: &str, apps: &Applications) -> Result<Vec<WorkloadJob>, TableError> {
    let t = Table::parse(file, text)?;
    let (name, time, app, replicas, batch) = (
        t.column("name")?,
        t.column("time")?,
        t.column("application")?,
        t.column("num_replicas")?,
        t.column("batch_size")?,
    );
    let mut jobs = Vec::with_capacity(t.len());
    let mut names = std::collections::HashSet::new();
    for row in t.rows() {
        let job = WorkloadJob {
            name: row.text(name).to_owned(),
            time: row.number(time, "time")?,
            application: row.text(app).to_owned(),
            replicas: row.whole(replicas, "num_replicas", 1)? as u32,
            batch: row.whole(batch, "batch_size", 1)?,
            line: row.line,
        };
        if job.name.is_empty() || !names.insert(job.name.clone()) {
            return Err(row.error(format!("job name {:?} is empty or repeated", job.name)));
        }
        if job.time < 0.0 {
            return Err(row.error(format!("`time` is {}: negative", job.time)));
        }
        let Some(a) = apps.get(&job.application) else {
            return Err(row.error(format!(
                "unknown application {:?} (known: {})",
                job.application,
                super::apps::names().collect::<Vec<_>>().join(", ")
            )));
        };
        let (lo, hi) = a.batch_range;
        if job.batch < lo || job.batch > hi {
            return Err(row.error(format!(
                "batch_size {} is outside {}'s measured {lo}..={hi}",
                job.batch, job.application
            )));
        }
        if job.replicas > NODES * GPUS_PER_NODE || job.replicas > a.max_gpus(job.batch) {
            return Err(row.error(format!(
                "num_replicas {} is more than the cluster's {} GPUs or than batch {} allows ({})",
                job.replicas,
                NODES * GPUS_PER_NODE,
                job.batch,
                a.max_gpus(job.batch)
            )));
        }
        jobs.push(job);
    }
    if jobs.is_empty() {
        return Err(TableError {
            file: file.to_owned(),
            line: 0,
            why: "no job".into(),
        });
    }
    jobs.sort_by(|a, b| a.time.total_cmp(&b.time).then(a.line.cmp(&b.line)));
    Ok(jobs)
}

/// Reads the workload file at `path`.
pub fn read(path: &Path, apps: &Applications) -> Result<Vec<WorkloadJob>, TableError> {
    let text = std::fs::read_to_string(path).map_err(|e| TableError {
        file: path.display().to_string(),
        line: 0,
        why: format!("cannot read: {e}"),
    })?;
    parse(&path.display().to_string(), &text, apps)
}

/// The scenario of a workload on the artifact's cluster.
pub fn scenario(name: &str, jobs: &[WorkloadJob], apps: &Applications, seed: u64) -> Scenario {
    let gpus = NODES * GPUS_PER_NODE;
    let node = Resources::new(64.0, 256.0, u64::from(GPUS_PER_NODE));
    let trainer = Resources::new(4.0, 16.0, 1);
    let specs = jobs
        .iter()
        .map(|j| {
            let app = apps
                .get(&j.application)
                .unwrap_or_else(|| panic!("{}: checked when read", j.application));
            let max = (j.replicas * MAX_FACTOR)
                .min(app.max_gpus(j.batch))
                .min(gpus)
                .max(j.replicas);
            TraceJob {
                name: j.name.clone(),
                submit: j.time,
                min: 1,
                max,
                fixed: j.replicas,
                priority: 0,
                trainer,
                pservers: 0,
                pserver: Resources::ZERO,
                work: app.progress_end(),
                speed: Speed::Table((1..=max).map(|n| app.rate(j.batch, n)).collect()),
                epochs: Some(app.max_epochs),
            }
        })
        .collect();
    Scenario {
        name: name.to_owned(),
        description: format!(
            "{name}: {} jobs of the Pollux workloads on {NODES} nodes x {GPUS_PER_NODE} GPUs",
            jobs.len()
        ),
        nodes: vec![node; NODES as usize],
        jobs: specs,
        config: SimConfig {
            tick: 60.0,
            startup: 30.0,
            drain: 0.0,
            event_cost: CHANGE_COST,
            seed,
            ..SimConfig::default()
        },
        // Judged by the goals of issue 36 (`suite`), not against a bound.
        bound: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn apps() -> Applications {
        Applications::builtin()
    }

    const HEADER: &str = "name,time,application,num_replicas,batch_size\n";

    #[test]
    fn a_workload_becomes_jobs_in_submission_order_with_measured_speeds() {
        let text = format!("{HEADER}ncf-2,135,ncf,1,32768\ncifar10-0,107,cifar10,6,2048\n");
        let jobs = parse("w.csv", &text, &apps()).expect("parse");
        assert_eq!(jobs[0].name, "cifar10-0");
        assert_eq!(jobs[1].line, 2);
        let s = scenario("w", &jobs, &apps(), 1);
        assert_eq!(s.nodes.len(), 16);
        let cifar = &s.jobs[0];
        assert_eq!((cifar.min, cifar.fixed, cifar.max), (1, 6, 24));
        // ncf asks for one GPU: up to four.
        assert_eq!((s.jobs[1].min, s.jobs[1].max), (1, 4));
        let Speed::Table(rates) = &cifar.speed else {
            panic!("measured speeds")
        };
        assert_eq!(rates.len(), 24);
        let app = apps().get("cifar10").cloned().expect("cifar10");
        // At its request, its work takes its measured run time.
        let secs = cifar.work / cifar.speed.rate(6);
        assert!((secs - app.run_time(2048, 6)).abs() < 1e-6, "{secs}");
    }

    #[test]
    fn bad_rows_are_one_error_naming_the_line() {
        let cases = [
            (
                "name,time,application,batch_size\nx,1,ncf,1\n",
                1,
                "no column `num_replicas`",
            ),
            (
                &format!("{HEADER}a,1,ncf,1,32768\nb,2,gpt,1,32\n") as &str,
                3,
                "unknown application \"gpt\"",
            ),
            (&format!("{HEADER}a,-5,ncf,1,32768\n"), 2, "negative"),
            (&format!("{HEADER}a,1,ncf,0,32768\n"), 2, "num_replicas"),
            (
                &format!("{HEADER}a,1,ncf,1,32768\na,2,ncf,1,32768\n"),
                3,
                "repeated",
            ),
            (&format!("{HEADER}a,1,cifar10,6,99999\n"), 2, "outside"),
            (&format!("{HEADER}a,x,ncf,1,32768\n"), 2, "`time` is \"x\""),
            (
                &format!("{HEADER}a,1,ncf,1\n"),
                2,
                "4 fields, the header has 5",
            ),
        ];
        for (text, line, what) in cases {
            let e = parse("w.csv", text, &apps()).expect_err(text);
            assert_eq!(e.line, line, "{e}");
            assert!(e.to_string().starts_with(&format!("w.csv:{line}: ")), "{e}");
            assert!(e.to_string().contains(what), "{e} lacks {what}");
        }
        let e = parse("w.csv", HEADER, &apps()).expect_err("no job");
        assert!(e.to_string().contains("no job"), "{e}");
    }
}
