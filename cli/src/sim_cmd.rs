//! `edl sim`: the cluster simulator of the `edl-autoscaler` crate on its scenarios,
//! no autoscaling, EDL's autoscaler and edl's side by side: a table per scenario, the
//! goals, a plot (SVG) and the results (JSON).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, ValueEnum};
use edl_autoscaler::policy::PolicyConfig;
use edl_autoscaler::sim::{self, plot, report, trace};

/// Which scenarios to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Which {
    /// EDL's published experiment: 133 nodes, 20 jobs 10 s apart.
    EdlExperiment,
    /// A synthetic day on 1,000 nodes (about a minute).
    Day,
    /// Both.
    All,
}

/// Arguments of `edl sim`.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// The scenarios to run.
    #[arg(long, value_enum, default_value = "all")]
    pub scenario: Which,
    /// Folder for the plots (SCENARIO.svg) and the results (SCENARIO.json); created
    /// when missing.
    #[arg(long, default_value = "sim-out")]
    pub out: PathBuf,
    /// Also run EDL's autoscaler with its published defects (an extra row; not on
    /// clusters with GPUs, where its passes never settle).
    #[arg(long)]
    pub with_defects: bool,
    /// Jobs of the synthetic day.
    #[arg(long, default_value_t = 3000)]
    pub jobs: usize,
    /// Seed of the synthetic day.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Exit with status 1 when a goal is not met.
    #[arg(long)]
    pub check: bool,
    /// On the scenarios, run edl's policy with the defaults of `edl operator run
    /// --autoscale` (no job held at 0 trainers, the cost of a change unknown) instead of
    /// the settings of `--autoscale-preempt` that every scenario and workload uses.
    #[arg(long, conflicts_with_all = ["workload", "pollux"])]
    pub no_preempt: bool,
    /// Compare the simulated EDL on its experiment with EDL's own logs of it (steady
    /// state: trainers, CPU, their spread over jobs; pending) instead of the scenarios.
    #[arg(long, conflicts_with_all = ["workload", "pollux", "no_preempt"])]
    pub calibrate: bool,
    /// Workloads of the Pollux artifact (`name,time,application,num_replicas,
    /// batch_size`) to run instead of the scenarios, on its cluster of 16 nodes x 4 GPUs
    /// (several files, or repeated).
    #[arg(long, value_name = "FILE.csv", num_args = 1..)]
    pub workload: Vec<PathBuf>,
    /// Run the artifact's 16 workloads (4 workloads at loads 0.5, 1.0, 1.5, 2.0), built
    /// into edl, as `--workload` runs files.
    #[arg(long)]
    pub pollux: bool,
    /// With workloads: run each with this many seeds (`--seed`, `--seed`+1, ...) of the
    /// observation noise, and average. With the synthetic day: that many days
    /// (`--seed`, `--seed`+1, ...), and a table and the goals over them.
    #[arg(long, default_value_t = 1)]
    pub seeds: u64,
    /// The applications' measurements: a folder laid out as the artifact's `traces/`
    /// (default: the copy built into edl).
    #[arg(long, value_name = "DIR")]
    pub apps: Option<PathBuf>,
}

/// Runs `edl sim`.
pub fn run(args: SimArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.jobs > 0, "--jobs must be at least 1");
    if !args.workload.is_empty() || args.pollux {
        return run_workloads(&args);
    }
    if args.calibrate {
        return calibrate(args.check);
    }
    let mut scenarios = Vec::new();
    if matches!(args.scenario, Which::EdlExperiment | Which::All) {
        scenarios.push(trace::edl_experiment());
    }
    anyhow::ensure!(args.seeds > 0, "--seeds must be at least 1");
    if matches!(args.scenario, Which::Day | Which::All) {
        for seed in args.seed..args.seed + args.seeds {
            let mut day = trace::day(&trace::DayParams {
                jobs: args.jobs,
                seed,
                ..Default::default()
            });
            if args.seeds > 1 {
                day.name = format!("day-seed{seed}");
            }
            scenarios.push(day);
        }
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("create the output folder {}", args.out.display()))?;
    let mut all_met = true;
    let mut days = Vec::new();
    for scenario in &scenarios {
        let started = std::time::Instant::now();
        // EDL as published does not settle on a cluster with GPUs (its GPU thresholds):
        // every pass runs to the bound, and a simulated day would take hours.
        let with_defects = args.with_defects && scenario.nodes.iter().all(|n| n.gpu == 0);
        if args.with_defects && !with_defects {
            eprintln!(
                "EDL with its defects is left out of {}: on GPU nodes its passes never settle",
                scenario.name
            );
        }
        // The settings of `edl operator run --autoscale-preempt`, a change costing the
        // scenario's stall; `--no-preempt`: the defaults of `--autoscale`.
        let edl = if args.no_preempt {
            PolicyConfig::default()
        } else {
            PolicyConfig::preemptive(scenario.config.event_cost)
        };
        let comparison = sim::compare(scenario, with_defects, edl, &mut |policy| {
            eprintln!("simulating {} under {policy}", scenario.name);
        });
        println!(
            "{}",
            report::table(&comparison.description, &comparison.summaries)
        );
        if let Some((kind, jct)) = comparison.bound {
            println!("  {}: {jct:.0}s", bound_name(kind));
        }
        all_met &= print_goals(&comparison.goals, ["met", "NOT met"]);
        write_run(&args.out, &scenario.name, &comparison)?;
        println!(
            "  plot and results in {} ({:.1} s)\n",
            args.out.display(),
            started.elapsed().as_secs_f64()
        );
        if scenario.name.starts_with("day-seed") {
            days.push((scenario.config.seed, comparison));
        }
    }
    if days.len() > 1 {
        let rows: Vec<report::SeedRow> = days
            .iter()
            .map(|(seed, c)| report::SeedRow::of(*seed, c))
            .collect();
        println!(
            "{}",
            report::seeds_table("the synthetic day, by seed", &rows)
        );
        all_met &= print_goals(&report::seed_goals(&rows), ["met", "NOT met"]);
        let path = args.out.join("day-seeds.json");
        std::fs::write(&path, serde_json::to_vec_pretty(&rows)?)
            .with_context(|| format!("write {}", path.display()))?;
    }
    Ok(if args.check && !all_met {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// `edl sim --workload`/`--pollux`: every workload under every seed, each run's plots
/// (over time, and its completion times' distribution) and results, then the summary
/// table and the goals over all of them.
fn run_workloads(args: &SimArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.seeds > 0, "--seeds must be at least 1");
    let apps = match &args.apps {
        Some(dir) => sim::apps::Applications::from_dir(dir)?,
        None => sim::apps::Applications::builtin(),
    };
    // (workload, load, jobs), all read (and checked) before anything runs.
    let mut workloads = Vec::new();
    if args.pollux {
        for (name, load, text) in sim::pollux_data::WORKLOADS {
            let jobs = sim::workload::parse(&format!("{name}@{load:.1}"), text, &apps)?;
            workloads.push((name.to_string(), *load, jobs));
        }
    }
    for path in &args.workload {
        let jobs = sim::workload::read(path, &apps)?;
        let (name, load) = workload_name(path);
        workloads.push((name, load, jobs));
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("create the output folder {}", args.out.display()))?;
    let started = std::time::Instant::now();
    let mut runs = Vec::new();
    for (name, load, jobs) in &workloads {
        for seed in args.seed..args.seed + args.seeds {
            let tag = format!("{name}@{load:.1}-seed{seed}");
            let scenario = sim::workload::scenario(&tag, jobs, &apps, seed);
            let comparison =
                sim::compare_policies(&scenario, sim::workload_policies(), &mut |policy| {
                    eprintln!("simulating {tag} under {policy}");
                });
            if workloads.len() == 1 && args.seeds == 1 {
                println!(
                    "{}",
                    report::table(&comparison.description, &comparison.summaries)
                );
            }
            write_run(&args.out, &tag, &comparison)?;
            let cdf_path = args.out.join(format!("{tag}-jct.svg"));
            let title = format!("{} (job completion times)", comparison.description);
            std::fs::write(&cdf_path, plot::jct_cdf(&title, &comparison.results))
                .with_context(|| format!("write {}", cdf_path.display()))?;
            runs.push(sim::suite::Run {
                workload: name.clone(),
                load: *load,
                seed,
                summaries: comparison.summaries,
            });
        }
    }
    let rows = sim::suite::rows(&runs);
    let goals = sim::suite::goals(&rows);
    println!(
        "{} workloads x {} seeds, mean JCT per policy (the published figures beside):\n{}",
        workloads.len(),
        args.seeds,
        sim::suite::table(&rows)
    );
    print_goals(&goals, ["met", "NOT met"]);
    let json_path = args.out.join("workloads.json");
    let json = serde_json::json!({ "rows": rows, "goals": goals, "runs": runs });
    std::fs::write(&json_path, serde_json::to_vec_pretty(&json)?)
        .with_context(|| format!("write {}", json_path.display()))?;
    println!(
        "  results {} and one plot and result per run ({:.1} s)",
        json_path.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(if args.check && !goals.iter().all(|g| g.met) {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// A workload's name and load from its path: `workloads-1.5/workload-2.csv` is
/// `workload-2` at 1.5; a file elsewhere is at load 1.0.
fn workload_name(path: &std::path::Path) -> (String, f64) {
    let name = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "workload".into());
    let load = path
        .parent()
        .and_then(|p| p.file_name())
        .and_then(|d| d.to_str())
        .and_then(|d| d.strip_prefix("workloads-"))
        .and_then(|l| l.parse().ok())
        .unwrap_or(1.0);
    (name, load)
}

/// Writes one run's plot (`TAG.svg`) and results (`TAG.json`) under `out`.
/// `edl sim --calibrate`: EDL's algorithm on its experiment against its logs.
fn calibrate(check: bool) -> anyhow::Result<ExitCode> {
    use sim::calibration::{self, FROM, LOGS, TO};
    let logs = calibration::log_stats(&LOGS, FROM, TO)?
        .context("EDL's logs have no row in the steady state")?;
    let mut scenario = trace::edl_experiment();
    scenario.config.sample_jobs = true;
    let mut edl = sim::PaddlePolicy::new(Default::default());
    let result = sim::simulate(&scenario, &mut edl);
    let simulated = calibration::sim_stats(&result, FROM, TO)
        .context("the simulated experiment has no sample in the steady state")?;
    let pending = report::Summary::of(&result).pending_avg;
    println!(
        "EDL's experiment, t = {FROM:.0}-{TO:.0} s: its logs (10 rounds) and the simulated EDL"
    );
    let row = |s: &calibration::Stats| {
        s.spread
            .iter()
            .map(|t| format!("{t:.1}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!("  trainers by job, most first (logs):      {}", row(&logs));
    println!(
        "  trainers by job, most first (simulated): {}",
        row(&simulated)
    );
    let all_met = print_goals(
        &calibration::checks(&logs, &simulated, pending),
        ["within", "NOT within"],
    );
    Ok(if check && !all_met {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// Prints each goal, `[met]` or `[NOT met]` (the words of `said`) with its figures;
/// whether all are met.
fn print_goals(goals: &[report::Goal], said: [&str; 2]) -> bool {
    for goal in goals {
        let word = if goal.met { said[0] } else { said[1] };
        println!("  [{word}] {}: {}", goal.what, goal.detail);
    }
    goals.iter().all(|g| g.met)
}

/// What a bound is, for the table.
fn bound_name(kind: sim::BoundKind) -> &'static str {
    match kind {
        sim::BoundKind::Fluid => {
            "fluid bound (the best of 16 allocations of a fluid model without overheads; \
             docs/autoscaler.md)"
        }
        sim::BoundKind::AllAtMax => {
            "all-at-max bound (every job at its fastest from its submission)"
        }
    }
}

fn write_run(out: &std::path::Path, tag: &str, c: &sim::Comparison) -> anyhow::Result<()> {
    let svg_path = out.join(format!("{tag}.svg"));
    let title = format!("{} (utilisation and trainers over time)", c.description);
    std::fs::write(&svg_path, plot::svg(&title, &c.results))
        .with_context(|| format!("write {}", svg_path.display()))?;
    let json_path = out.join(format!("{tag}.json"));
    let json = serde_json::json!({
        "scenario": c.scenario,
        "description": c.description,
        "summaries": c.summaries,
        "goals": c.goals,
        "bound": c.bound.map(|(kind, jct)| serde_json::json!({"kind": kind, "jct": jct})),
        "results": c.results,
    });
    std::fs::write(&json_path, serde_json::to_vec_pretty(&json)?)
        .with_context(|| format!("write {}", json_path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_experiment_writes_its_plot_and_results() {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("nested/out");
        let code = run(SimArgs {
            scenario: Which::EdlExperiment,
            out: out.clone(),
            with_defects: false,
            jobs: 3000,
            seed: 7,
            check: false,
            workload: Vec::new(),
            apps: None,
            pollux: false,
            seeds: 1,
            no_preempt: false,
            calibrate: false,
        })
        .expect("edl sim");
        assert_eq!(code, ExitCode::SUCCESS);
        let svg = std::fs::read_to_string(out.join("edl-experiment.svg")).expect("svg");
        assert!(svg.starts_with("<svg") && svg.contains("<polyline"));
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("edl-experiment.json")).expect("json"))
                .expect("parse");
        let policies: Vec<&str> = json["summaries"]
            .as_array()
            .expect("summaries")
            .iter()
            .filter_map(|s| s["policy"].as_str())
            .collect();
        assert_eq!(policies, ["none", "EDL", "edl"]);
        assert_eq!(
            json["results"][0]["jobs"].as_array().map(Vec::len),
            Some(20)
        );
    }

    fn workload_args(out: PathBuf, workload: PathBuf) -> SimArgs {
        SimArgs {
            scenario: Which::All,
            out,
            with_defects: false,
            jobs: 3000,
            seed: 7,
            check: false,
            workload: vec![workload],
            apps: None,
            pollux: false,
            seeds: 1,
            no_preempt: false,
            calibrate: false,
        }
    }

    /// A workload file in a `workloads-1.5` folder runs on the Pollux cluster under
    /// every policy and is named with its load; a bad row stops it before anything runs.
    #[test]
    fn a_workload_file_runs_and_a_bad_one_names_its_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let folder = dir.path().join("workloads-1.5");
        std::fs::create_dir_all(&folder).expect("mkdir");
        let file = folder.join("workload-9.csv");
        std::fs::write(
            &file,
            "name,time,application,num_replicas,batch_size\n\
             cifar10-0,107,cifar10,6,2048\nncf-1,135,ncf,1,32768\nbert-2,300,bert,8,384\n",
        )
        .expect("write");
        let out = dir.path().join("out");
        let code = run(workload_args(out.clone(), file.clone())).expect("edl sim");
        assert_eq!(code, ExitCode::SUCCESS);
        let json: serde_json::Value = serde_json::from_slice(
            &std::fs::read(out.join("workload-9@1.5-seed7.json")).expect("json"),
        )
        .expect("parse");
        let jobs = json["results"][0]["jobs"].as_array().expect("jobs");
        assert_eq!(jobs.len(), 3);
        // The completion times' distribution: one line per policy, each reaching
        // every job (the top of the panel, y = 40).
        let cdf = std::fs::read_to_string(out.join("workload-9@1.5-seed7-jct.svg")).expect("cdf");
        let lines: Vec<&str> = cdf.lines().filter(|l| l.starts_with("<polyline")).collect();
        assert_eq!(lines.len(), 4, "{cdf}");
        assert!(
            lines
                .iter()
                .all(|l| l.trim_end_matches("\"/>").ends_with(",40.0")),
            "{cdf}"
        );
        assert!(
            jobs.iter().all(|j| j["completion"].as_f64().is_some()),
            "every job finishes: {jobs:?}"
        );

        std::fs::write(
            &file,
            "name,time,application,num_replicas,batch_size\nx,5,cifar10,6,2048\ny,-1,ncf,1,32768\n",
        )
        .expect("write");
        let err = run(workload_args(out, file.clone())).expect_err("refused");
        assert!(
            err.to_string()
                .contains(&format!("{}:3: `time` is -1: negative", file.display())),
            "{err}"
        );
    }

    #[test]
    fn zero_jobs_is_refused() {
        let err = run(SimArgs {
            scenario: Which::Day,
            out: PathBuf::from("unused"),
            with_defects: false,
            jobs: 0,
            seed: 7,
            check: false,
            workload: Vec::new(),
            apps: None,
            pollux: false,
            seeds: 1,
            no_preempt: false,
            calibrate: false,
        })
        .expect_err("refused");
        assert!(err.to_string().contains("--jobs"), "{err}");
    }
}
