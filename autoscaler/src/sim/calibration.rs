//! The simulated EDL against EDL's own logs of its experiment (case 1, with
//! autoscaling; `data/edl-experiment/`): the figures of the logs' steady state (t =
//! 300-550 s, every job submitted and none done), and the same figures of a simulated
//! run, measured as EDL's collector measured them.
//!
//! - **trainers**: the mean of the trainer pods running;
//! - **CPU**: the requests of the pods running (not those bound and still starting) over
//!   the nodes' allocatable CPU;
//! - **spread**: the jobs' running trainers, sorted from most to fewest, each place
//!   averaged over the window (and the rounds);
//! - **below minimum**: the mean number of jobs with fewer than 2 trainers running.

use serde::Serialize;

use super::SimResult;
use super::report::Goal;
use super::table::TableError;

/// The steady state of EDL's logs: from this second...
pub const FROM: f64 = 300.0;
/// ...to this one.
pub const TO: f64 = 550.0;

/// The published average pending time of the experiment with autoscaling (s).
pub const PUBLISHED_PENDING: f64 = 47.2;

/// The logs of the 10 rounds with autoscaling, built in: (file, text).
pub const LOGS: [(&str, &str); 10] = [
    (
        "on-round_0.log",
        include_str!("../../data/edl-experiment/on-round_0.log"),
    ),
    (
        "on-round_1.log",
        include_str!("../../data/edl-experiment/on-round_1.log"),
    ),
    (
        "on-round_2.log",
        include_str!("../../data/edl-experiment/on-round_2.log"),
    ),
    (
        "on-round_3.log",
        include_str!("../../data/edl-experiment/on-round_3.log"),
    ),
    (
        "on-round_4.log",
        include_str!("../../data/edl-experiment/on-round_4.log"),
    ),
    (
        "on-round_5.log",
        include_str!("../../data/edl-experiment/on-round_5.log"),
    ),
    (
        "on-round_6.log",
        include_str!("../../data/edl-experiment/on-round_6.log"),
    ),
    (
        "on-round_7.log",
        include_str!("../../data/edl-experiment/on-round_7.log"),
    ),
    (
        "on-round_8.log",
        include_str!("../../data/edl-experiment/on-round_8.log"),
    ),
    (
        "on-round_9.log",
        include_str!("../../data/edl-experiment/on-round_9.log"),
    ),
];

/// A job counts as below its minimum with fewer trainers running than this.
pub const MIN_TRAINERS: u32 = 2;

/// The steady state's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Stats {
    /// Mean trainers running.
    pub trainers: f64,
    /// Mean CPU of the pods running over allocatable (0..1).
    pub cpu: f64,
    /// The jobs' running trainers, most first, each place's mean.
    pub spread: Vec<f64>,
    /// Mean number of jobs below [`MIN_TRAINERS`].
    pub below_min: f64,
}

/// One instant: CPU (0..1) and each job's running trainers.
struct Point {
    cpu: f64,
    jobs: Vec<u32>,
}

/// The figures of instants (several runs' together, each run weighing the same).
fn stats(runs: &[Vec<Point>]) -> Option<Stats> {
    let width = runs.iter().flatten().map(|p| p.jobs.len()).max()?;
    let (mut trainers, mut cpu, mut below) = (0.0, 0.0, 0.0);
    let mut spread = vec![0.0; width];
    let mut counted = 0.0;
    for run in runs.iter().filter(|r| !r.is_empty()) {
        let n = run.len() as f64;
        for p in run {
            let mut sorted = p.jobs.clone();
            sorted.sort_unstable_by(|a, b| b.cmp(a));
            trainers += f64::from(sorted.iter().sum::<u32>()) / n;
            cpu += p.cpu / n;
            below += sorted.iter().filter(|&&t| t < MIN_TRAINERS).count() as f64 / n;
            for (k, &t) in sorted.iter().enumerate() {
                spread[k] += f64::from(t) / n;
            }
        }
        counted += 1.0;
    }
    if counted == 0.0 {
        return None;
    }
    Some(Stats {
        trainers: trainers / counted,
        cpu: cpu / counted,
        spread: spread.into_iter().map(|s| s / counted).collect(),
        below_min: below / counted,
    })
}

/// The figures of EDL's logs (`(file, text)` each) in `[from, to]`: one clear error
/// naming the file and line for a row that cannot be read; `None` when no row falls in
/// the window.
pub fn log_stats(logs: &[(&str, &str)], from: f64, to: f64) -> Result<Option<Stats>, TableError> {
    let mut runs = Vec::new();
    for (file, text) in logs {
        let mut run = Vec::new();
        for (k, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let bad = |why: &str| TableError {
                file: (*file).to_owned(),
                line: k + 1,
                why: why.to_owned(),
            };
            let cols: Vec<&str> = line.trim().split(',').collect();
            if cols.len() < 9 {
                return Err(bad(
                    "expected 10 columns (time, CPU %, trainers, ..., trainers per job, CPU per job)",
                ));
            }
            let t: f64 = cols[0]
                .parse()
                .map_err(|_| bad("the time is not a number"))?;
            if !(from..=to).contains(&t) {
                continue;
            }
            let cpu: f64 = cols[1]
                .parse()
                .map_err(|_| bad("the CPU utilisation is not a number"))?;
            let jobs = cols[8]
                .split('|')
                .map(|v| v.parse::<u32>())
                .collect::<Result<Vec<u32>, _>>()
                .map_err(|_| bad("the trainers per job are not '|'-separated counts"))?;
            run.push(Point {
                cpu: cpu / 100.0,
                jobs,
            });
        }
        runs.push(run);
    }
    Ok(stats(&runs))
}

/// The same figures of a simulated run with [`super::SimConfig::sample_jobs`] (`None`
/// without its samples in the window).
pub fn sim_stats(result: &SimResult, from: f64, to: f64) -> Option<Stats> {
    let run: Vec<Point> = result
        .samples
        .iter()
        .filter(|s| (from..=to).contains(&s.t) && !s.job_trainers.is_empty())
        .map(|s| Point {
            cpu: s.cpu_running.unwrap_or(s.cpu),
            jobs: s.job_trainers.clone(),
        })
        .collect();
    stats(&[run])
}

/// The calibration's checks: the simulated EDL's steady state against the logs', and its
/// average pending time against the published one, each within its stated tolerance:
/// trainers within 10%, CPU within 5 points, the six busiest jobs' share of the
/// trainers within 10 points, jobs below their minimum within 2, pending within 15%.
pub fn checks(logs: &Stats, sim: &Stats, sim_pending: f64) -> Vec<Goal> {
    let top = |s: &Stats| {
        let all: f64 = s.spread.iter().sum();
        if all > 0.0 {
            s.spread.iter().take(6).sum::<f64>() / all
        } else {
            0.0
        }
    };
    let within = |what: &str, log: f64, simulated: f64, ok: bool, unit: &str| Goal {
        what: what.to_owned(),
        detail: format!("logs {log:.1}{unit}, simulated {simulated:.1}{unit}"),
        met: ok,
    };
    vec![
        within(
            "trainers running, within 10%",
            logs.trainers,
            sim.trainers,
            (sim.trainers / logs.trainers - 1.0).abs() <= 0.10,
            "",
        ),
        within(
            "CPU of the pods running, within 5 points",
            logs.cpu * 100.0,
            sim.cpu * 100.0,
            (sim.cpu - logs.cpu).abs() <= 0.05,
            "%",
        ),
        within(
            "the six busiest jobs' share of the trainers, within 10 points",
            top(logs) * 100.0,
            top(sim) * 100.0,
            (top(sim) - top(logs)).abs() <= 0.10,
            "%",
        ),
        within(
            "jobs below 2 trainers, within 2",
            logs.below_min,
            sim.below_min,
            (sim.below_min - logs.below_min).abs() <= 2.0,
            "",
        ),
        within(
            "average pending (published), within 15%",
            PUBLISHED_PENDING,
            sim_pending,
            (sim_pending / PUBLISHED_PENDING - 1.0).abs() <= 0.15,
            " s",
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_logs_steady_state_is_as_read_by_hand() {
        let s = log_stats(&LOGS, FROM, TO).expect("logs").expect("rows");
        // Read from the logs with a script (the shared data's README): 253 trainers,
        // 86.3% CPU, six jobs with about 35 trainers and the rest with few.
        assert!((s.trainers - 253.1).abs() < 0.1, "{s:?}");
        assert!((s.cpu - 0.863).abs() < 0.001, "{s:?}");
        assert_eq!(s.spread.len(), 20);
        assert!(s.spread[..6].iter().all(|&t| t > 30.0), "{s:?}");
        assert!(s.spread[6] < 10.0 && s.spread[19] < 1.0, "{s:?}");
        assert!((s.below_min - 5.0).abs() < 1.5, "{s:?}");
    }

    #[test]
    fn a_bad_row_is_one_error_naming_the_file_and_line() {
        let e = log_stats(
            &[(
                "x.log",
                "300,50.0,3,0,0,2,0,0,1|2,1|1\n301,lots,3,0,0,2,0,0,1|2,1|1\n",
            )],
            0.0,
            1e9,
        )
        .expect_err("refused");
        let text = e.to_string();
        assert!(
            text.contains("x.log") && text.contains('2') && text.contains("CPU"),
            "{text}"
        );
        let short = log_stats(&[("y.log", "300,50.0,3\n")], 0.0, 1e9).expect_err("refused");
        assert!(short.to_string().contains("y.log"), "{short}");
        // Rows outside the window do not count.
        assert_eq!(
            log_stats(&[("z.log", "10,5,1,0,0,1,0,0,1|0,1|0\n")], 300.0, 550.0).expect("read"),
            None
        );
    }
}
