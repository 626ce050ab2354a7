//! `edl sim`: the cluster simulator of the `edl-autoscaler` crate on its scenarios,
//! no autoscaling, EDL's autoscaler and edl's side by side: a table per scenario, the
//! goals, a plot (SVG) and the results (JSON).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, ValueEnum};
use edl_autoscaler::sim::{self, plot, report, trace};

/// Which scenarios to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Which {
    /// EDL's published experiment: 133 nodes, 20 jobs 10 s apart.
    EdlExperiment,
    /// A synthetic day on 1,000 nodes (takes minutes).
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
}

/// Runs `edl sim`.
pub fn run(args: SimArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.jobs > 0, "--jobs must be at least 1");
    let mut scenarios = Vec::new();
    if matches!(args.scenario, Which::EdlExperiment | Which::All) {
        scenarios.push(trace::edl_experiment());
    }
    if matches!(args.scenario, Which::Day | Which::All) {
        scenarios.push(trace::day(&trace::DayParams {
            jobs: args.jobs,
            seed: args.seed,
            ..Default::default()
        }));
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("create the output folder {}", args.out.display()))?;
    let mut all_met = true;
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
        let comparison = sim::compare(scenario, with_defects, &mut |policy| {
            eprintln!("simulating {} under {policy}", scenario.name);
        });
        println!(
            "{}",
            report::table(&comparison.description, &comparison.summaries)
        );
        for goal in &comparison.goals {
            all_met &= goal.met;
            println!(
                "  [{}] {}: {}",
                if goal.met { "met" } else { "NOT met" },
                goal.what,
                goal.detail
            );
        }
        let svg_path = args.out.join(format!("{}.svg", scenario.name));
        let title = format!(
            "{} ({})",
            comparison.description, "utilisation and trainers over time"
        );
        std::fs::write(&svg_path, plot::svg(&title, &comparison.results))
            .with_context(|| format!("write {}", svg_path.display()))?;
        let json_path = args.out.join(format!("{}.json", scenario.name));
        let json = serde_json::json!({
            "scenario": comparison.scenario,
            "description": comparison.description,
            "summaries": comparison.summaries,
            "goals": comparison.goals,
            "results": comparison.results,
        });
        std::fs::write(&json_path, serde_json::to_vec_pretty(&json)?)
            .with_context(|| format!("write {}", json_path.display()))?;
        println!(
            "  plot {}, results {} ({:.1} s)\n",
            svg_path.display(),
            json_path.display(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(if args.check && !all_met {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
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

    #[test]
    fn zero_jobs_is_refused() {
        let err = run(SimArgs {
            scenario: Which::Day,
            out: PathBuf::from("unused"),
            with_defects: false,
            jobs: 0,
            seed: 7,
            check: false,
        })
        .expect_err("refused");
        assert!(err.to_string().contains("--jobs"), "{err}");
    }
}
