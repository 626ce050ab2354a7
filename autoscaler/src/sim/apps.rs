//! The six applications of the Pollux (OSDI'21) artifact, from their measurements: how
//! long a job of each takes at a given batch size on `n` GPUs, as the artifact's
//! simulator derives it for a job that keeps its batch size (its Tiresias and Optimus
//! baselines; edl does not adapt batch sizes either).
//!
//! The measurements of an application (a folder `<app>/` laid out as the artifact's
//! `traces/<app>/`, or the copy in this repository, [`Applications::builtin`]):
//! - `placements.csv` (`placement,local_bsz,step_time,sync_time`): seconds per step on
//!   a placement (GPUs per node as digits) at a local batch size;
//! - `scalability.csv` (`num_nodes,num_replicas,local_bsz,step_time,sync_time`): the
//!   same on 6 to 16 nodes;
//! - `validation-<batch>.csv` (`progress,...,grad_sqr,grad_var`, one row per epoch): the
//!   statistical efficiency of training at that batch size.
//!
//! The model (the artifact's `simulator.py` and `applications.py`; `docs/autoscaler.md`
//! says where this differs):
//! - **Batch.** `n` GPUs share the job's batch `B`: each takes `ceil(B / n)`, in
//!   `accum + 1` micro-steps when that is above the application's largest local batch
//!   (one GPU with a batch above the smallest validated one always takes two, as in the
//!   artifact), clamped so the batch run stays within the largest validated one.
//! - **Step time.** The job's GPUs are packed on as few 4-GPU nodes as they need; a
//!   placement of up to 4 nodes is measured (interpolated in the local batch), a larger
//!   one is interpolated linearly in the local batch, the GPUs, then the nodes between
//!   the measured grids (the artifact's scipy triangulation, which is exact on the grid
//!   points too). A step with `accum` extra micro-steps costs `step + accum * (step -
//!   sync)`.
//! - **Work.** A job trains the application's epochs (`max_epochs`); epoch `e` needs
//!   `P(e+1) - P(e)` units of progress (`P(e)` the least `progress` at the end of epoch
//!   `e - 1` over the validated batch sizes), and a step at batch `b` makes
//!   `(var + sqr) / (var / (b / b0) + sqr)` of them (`b0` the smallest validated batch,
//!   the epoch's gradient statistics interpolated in `b`).
//!
//! A job's rate at `n` GPUs is then its whole progress over the time it takes at `n`:
//! exact for a job that keeps its GPUs, and an average over epochs for one that changes.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use super::table::{Table, TableError};

/// GPUs per node of the artifact's cluster.
pub const GPUS_PER_NODE: u32 = 4;

/// The applications the artifact measured, with the settings its `applications.py`
/// gives them (lines 231-238): epochs trained, and a largest local batch below the
/// measured one.
const SETTINGS: &[(&str, u32, Option<f64>)] = &[
    ("bert", 2, None),
    ("cifar10", 100, None),
    ("deepspeech2", 80, None),
    ("imagenet", 90, None),
    ("ncf", 10, None),
    ("yolov3", 50, Some(8.0)),
];

/// The names of the applications, as workloads name them.
pub fn names() -> impl Iterator<Item = &'static str> {
    SETTINGS.iter().map(|(n, _, _)| *n)
}

/// One epoch's row of a validation table.
#[derive(Debug, Clone, Copy)]
struct Epoch {
    progress: f64,
    grad_sqr: f64,
    grad_var: f64,
}

/// (local batch, step seconds, sync seconds), sorted by local batch.
type Curve = Vec<(f64, f64, f64)>;

/// One application's measurements.
#[derive(Debug, Clone)]
pub struct Application {
    /// Its name.
    pub name: String,
    /// Epochs a job trains.
    pub max_epochs: u32,
    /// The smallest and largest validated batch sizes.
    pub batch_range: (u64, u64),
    /// The smallest and largest local batch a GPU takes.
    pub local_range: (f64, f64),
    validation: BTreeMap<u64, Vec<Epoch>>,
    /// Measured placements (normalised ids) and their curves.
    placements: HashMap<String, Curve>,
    /// (nodes, GPUs) -> curve: the means over measured placements (up to 4 nodes) and
    /// the scalability grid (6 to 16 nodes).
    grid: BTreeMap<(u32, u32), Curve>,
}

/// How a job's batch is split on `n` GPUs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Split {
    /// The local batch of one micro-step.
    pub atomic: u64,
    /// Extra micro-steps per step (gradient accumulation).
    pub accum: u64,
    /// The batch of one step: `n * atomic * (accum + 1)`.
    pub batch: u64,
}

impl Application {
    /// Builds application `name` from its files (`(file name, text)`); an error when
    /// the name is not one of the artifact's or a file is missing or malformed.
    pub fn parse(name: &str, files: &[(String, String)]) -> Result<Application, TableError> {
        let Some(&(_, max_epochs, local_cap)) = SETTINGS.iter().find(|(n, _, _)| *n == name) else {
            return Err(TableError {
                file: name.to_owned(),
                line: 0,
                why: format!(
                    "unknown application (known: {})",
                    names().collect::<Vec<_>>().join(", ")
                ),
            });
        };
        let file = |f: &str| -> Result<Table, TableError> {
            let label = format!("{name}/{f}");
            let text = files
                .iter()
                .find(|(n, _)| n == f)
                .map(|(_, t)| t.as_str())
                .ok_or_else(|| TableError {
                    file: label.clone(),
                    line: 0,
                    why: "missing".into(),
                })?;
            Table::parse(&label, text)
        };
        let mut validation = BTreeMap::new();
        for (f, _) in files {
            let Some(batch) = f
                .strip_prefix("validation-")
                .and_then(|b| b.strip_suffix(".csv"))
            else {
                continue;
            };
            let t = file(f)?;
            let batch: u64 = batch.parse().map_err(|_| TableError {
                file: format!("{name}/{f}"),
                line: 0,
                why: "the name's batch size is not a whole number".into(),
            })?;
            let (p, s, v) = (
                t.column("progress")?,
                t.column("grad_sqr")?,
                t.column("grad_var")?,
            );
            let mut epochs = Vec::new();
            for row in t.rows() {
                epochs.push(Epoch {
                    progress: row.number(p, "progress")?,
                    grad_sqr: row.number(s, "grad_sqr")?,
                    grad_var: row.number(v, "grad_var")?,
                });
            }
            if epochs.len() < max_epochs as usize {
                return Err(TableError {
                    file: format!("{name}/{f}"),
                    line: 0,
                    why: format!("{} epochs, {max_epochs} wanted", epochs.len()),
                });
            }
            validation.insert(batch, epochs);
        }
        let (Some(&lo), Some(&hi)) = (validation.keys().next(), validation.keys().last()) else {
            return Err(TableError {
                file: format!("{name}/validation-<batch>.csv"),
                line: 0,
                why: "no validation table".into(),
            });
        };
        let placements = read_placements(&file("placements.csv")?)?;
        let mut grid = mean_grid(&placements);
        for ((nodes, gpus), curve) in read_scalability(&file("scalability.csv")?)? {
            grid.insert((nodes, gpus), curve);
        }
        let locals = placements.values().flatten().map(|&(lb, _, _)| lb);
        let min_local = locals.clone().fold(f64::INFINITY, f64::min);
        let max_local = local_cap.unwrap_or_else(|| locals.fold(0.0, f64::max));
        Ok(Application {
            name: name.to_owned(),
            max_epochs,
            batch_range: (lo, hi),
            local_range: (min_local, max_local),
            validation,
            placements,
            grid,
        })
    }

    /// How batch `batch` is split on `n` GPUs (`n` at least 1).
    pub fn split(&self, batch: u64, n: u32) -> Split {
        let n = u64::from(n.max(1));
        let local = batch.div_ceil(n);
        let mut accum = (local as f64 / self.local_range.1 - 1e-8).ceil().max(1.0) as u64 - 1;
        if n == 1 && batch > self.batch_range.0 {
            accum = accum.max(1);
        }
        let atomic = local
            .div_ceil(accum + 1)
            .min(self.batch_range.1 / (n * (accum + 1)))
            .max(1);
        Split {
            atomic,
            accum,
            batch: n * atomic * (accum + 1),
        }
    }

    /// Seconds of one step of batch `batch` on `n` GPUs packed on 4-GPU nodes.
    pub fn step_time(&self, batch: u64, n: u32) -> f64 {
        let split = self.split(batch, n);
        let (step, sync) = self.measured(&packed(n), split.atomic as f64);
        step + split.accum as f64 * (step - sync)
    }

    /// Progress a job makes in all its epochs.
    pub fn progress_end(&self) -> f64 {
        self.boundary(self.max_epochs)
    }

    /// Steps a job of batch `batch` (the batch it runs, [`Split::batch`]) needs.
    pub fn steps(&self, batch: u64) -> f64 {
        (0..self.max_epochs)
            .map(|e| (self.boundary(e + 1) - self.boundary(e)) / self.gain(batch, e))
            .sum()
    }

    /// Seconds a job of batch `batch` takes on `n` GPUs, restarts and waits aside.
    pub fn run_time(&self, batch: u64, n: u32) -> f64 {
        self.steps(self.split(batch, n).batch) * self.step_time(batch, n)
    }

    /// Progress per second of a job of batch `batch` on `n` GPUs (its whole progress
    /// over [`Application::run_time`]).
    pub fn rate(&self, batch: u64, n: u32) -> f64 {
        self.progress_end() / self.run_time(batch, n)
    }

    /// The most GPUs a job of batch `batch` can use: each takes at least the smallest
    /// local batch.
    pub fn max_gpus(&self, batch: u64) -> u32 {
        ((batch as f64 / self.local_range.0).floor() as u32).max(1)
    }

    /// `P(e)`: the least progress at the end of epoch `e - 1` over the batch sizes.
    fn boundary(&self, e: u32) -> f64 {
        if e == 0 {
            return 0.0;
        }
        self.validation
            .values()
            .map(|epochs| epochs[e as usize - 1].progress)
            .fold(f64::INFINITY, f64::min)
    }

    /// Progress per step in epoch `e` at batch `batch`.
    fn gain(&self, batch: u64, e: u32) -> f64 {
        let b = (batch as f64).clamp(self.batch_range.0 as f64, self.batch_range.1 as f64);
        let at = |k: &u64| self.validation[k][e as usize];
        let below = self
            .validation
            .range(..=b as u64)
            .next_back()
            .map(|(k, _)| *k);
        let above = self
            .validation
            .range(b.ceil() as u64..)
            .next()
            .map(|(k, _)| *k);
        let (sqr, var) = match (below, above) {
            (Some(lo), Some(hi)) if lo != hi => {
                let w = (b - lo as f64) / (hi - lo) as f64;
                let (l, h) = (at(&lo), at(&hi));
                (
                    l.grad_sqr + w * (h.grad_sqr - l.grad_sqr),
                    l.grad_var + w * (h.grad_var - l.grad_var),
                )
            }
            (Some(k), _) | (_, Some(k)) => (at(&k).grad_sqr, at(&k).grad_var),
            (None, None) => unreachable!("validation tables are checked to exist"),
        };
        let scale = b / self.batch_range.0 as f64;
        (var + sqr) / (var / scale + sqr)
    }

    /// (step, sync) seconds on `placement` (GPUs per node) at local batch `local`.
    fn measured(&self, placement: &[u32], local: f64) -> (f64, f64) {
        let id = necklace(placement);
        if let Some(curve) = self.placements.get(&id) {
            return along(curve, local);
        }
        let nodes = (placement.len() as u32).min(16);
        let gpus: u32 = placement.iter().sum();
        let node_counts: Vec<u32> = dedup(self.grid.keys().map(|(n, _)| *n));
        between(&node_counts, nodes, |n| self.on_nodes(n, gpus, local))
    }

    /// (step, sync) on `nodes` nodes of the grid, interpolated in the GPUs.
    fn on_nodes(&self, nodes: u32, gpus: u32, local: f64) -> (f64, f64) {
        let counts: Vec<u32> = dedup(
            self.grid
                .keys()
                .filter(|(n, _)| *n == nodes)
                .map(|(_, g)| *g),
        );
        between(&counts, gpus, |g| along(&self.grid[&(nodes, g)], local))
    }
}

/// The GPUs of `n`, packed on 4-GPU nodes: `[4, 4, ..., rest]`.
pub fn packed(n: u32) -> Vec<u32> {
    let mut p = vec![GPUS_PER_NODE; (n / GPUS_PER_NODE) as usize];
    if !n.is_multiple_of(GPUS_PER_NODE) {
        p.push(n % GPUS_PER_NODE);
    }
    p
}

/// A placement's id: its smallest rotation (nodes with none dropped), as digits.
fn necklace(placement: &[u32]) -> String {
    let p: Vec<u32> = placement.iter().copied().filter(|&g| g > 0).collect();
    (0..p.len().max(1))
        .map(|i| {
            p[i..]
                .iter()
                .chain(&p[..i])
                .map(u32::to_string)
                .collect::<String>()
        })
        .min()
        .unwrap_or_default()
}

fn dedup(it: impl Iterator<Item = u32>) -> Vec<u32> {
    let mut v: Vec<u32> = it.collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Linear interpolation of `f` between the nearest of `points` (sorted) around `x`,
/// clamped to their ends.
fn between(points: &[u32], x: u32, f: impl Fn(u32) -> (f64, f64)) -> (f64, f64) {
    let lo = points.iter().rev().find(|&&p| p <= x).copied();
    let hi = points.iter().find(|&&p| p >= x).copied();
    match (lo, hi) {
        (Some(lo), Some(hi)) if lo != hi => {
            let w = f64::from(x - lo) / f64::from(hi - lo);
            let (a, b) = (f(lo), f(hi));
            (a.0 + w * (b.0 - a.0), a.1 + w * (b.1 - a.1))
        }
        (Some(p), _) | (_, Some(p)) => f(p),
        (None, None) => (f64::NAN, f64::NAN),
    }
}

/// A curve at local batch `x`, linear between its points, clamped to its ends.
fn along(curve: &Curve, x: f64) -> (f64, f64) {
    let i = curve.partition_point(|&(lb, _, _)| lb < x);
    if i == 0 {
        return (curve[0].1, curve[0].2);
    }
    if i == curve.len() {
        let last = curve[curve.len() - 1];
        return (last.1, last.2);
    }
    let (a, b) = (curve[i - 1], curve[i]);
    let w = (x - a.0) / (b.0 - a.0);
    (a.1 + w * (b.1 - a.1), a.2 + w * (b.2 - a.2))
}

fn read_placements(t: &Table) -> Result<HashMap<String, Curve>, TableError> {
    let (p, lb, st, sy) = (
        t.column("placement")?,
        t.column("local_bsz")?,
        t.column("step_time")?,
        t.column("sync_time")?,
    );
    let mut out: HashMap<String, Curve> = HashMap::new();
    for row in t.rows() {
        let id = row.text(p);
        if id.is_empty() || !id.bytes().all(|c| (b'1'..=b'4').contains(&c)) {
            return Err(row.error(format!(
                "placement {id:?}: GPUs per node as digits 1-4 were expected"
            )));
        }
        let gpus: Vec<u32> = id.bytes().map(|c| u32::from(c - b'0')).collect();
        out.entry(necklace(&gpus)).or_default().push((
            row.number(lb, "local_bsz")?,
            row.number(st, "step_time")?,
            row.number(sy, "sync_time")?,
        ));
    }
    for curve in out.values_mut() {
        curve.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    if out.is_empty() {
        return Err(TableError {
            file: "placements.csv".into(),
            line: 0,
            why: "no measurement".into(),
        });
    }
    Ok(out)
}

fn read_scalability(t: &Table) -> Result<BTreeMap<(u32, u32), Curve>, TableError> {
    let (n, r, lb, st, sy) = (
        t.column("num_nodes")?,
        t.column("num_replicas")?,
        t.column("local_bsz")?,
        t.column("step_time")?,
        t.column("sync_time")?,
    );
    let mut out: BTreeMap<(u32, u32), Curve> = BTreeMap::new();
    for row in t.rows() {
        let key = (
            row.whole(n, "num_nodes", 1)? as u32,
            row.whole(r, "num_replicas", 1)? as u32,
        );
        out.entry(key).or_default().push((
            row.number(lb, "local_bsz")?,
            row.number(st, "step_time")?,
            row.number(sy, "sync_time")?,
        ));
    }
    for curve in out.values_mut() {
        curve.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    Ok(out)
}

/// (nodes, GPUs) -> the mean curve over the measured placements of that shape, at
/// each local batch measured.
fn mean_grid(placements: &HashMap<String, Curve>) -> BTreeMap<(u32, u32), Curve> {
    /// Per local batch (its bits): (local batch, step sum, sync sum, count).
    type Sums = BTreeMap<u64, (f64, f64, f64, u32)>;
    let mut sums: BTreeMap<(u32, u32), Sums> = BTreeMap::new();
    for (id, curve) in placements {
        let nodes = id.len() as u32;
        let gpus: u32 = id.bytes().map(|c| u32::from(c - b'0')).sum();
        for &(lb, st, sy) in curve {
            let e = sums
                .entry((nodes, gpus))
                .or_default()
                .entry(lb.to_bits())
                .or_insert((lb, 0.0, 0.0, 0));
            e.1 += st;
            e.2 += sy;
            e.3 += 1;
        }
    }
    sums.into_iter()
        .map(|(k, points)| {
            let mut curve: Curve = points
                .into_values()
                .map(|(lb, st, sy, c)| (lb, st / f64::from(c), sy / f64::from(c)))
                .collect();
            curve.sort_by(|a, b| a.0.total_cmp(&b.0));
            (k, curve)
        })
        .collect()
}

/// The six applications.
#[derive(Debug, Clone)]
pub struct Applications {
    apps: BTreeMap<String, Application>,
}

impl Applications {
    /// Reads `dir/<app>/` for each application (a folder laid out as the artifact's
    /// `traces/`).
    pub fn from_dir(dir: &Path) -> Result<Applications, TableError> {
        let mut apps = BTreeMap::new();
        for name in names() {
            let folder = dir.join(name);
            let entries = std::fs::read_dir(&folder).map_err(|e| TableError {
                file: folder.display().to_string(),
                line: 0,
                why: format!("cannot list the folder: {e}"),
            })?;
            let mut files = Vec::new();
            for entry in entries.flatten() {
                let file = entry.file_name().to_string_lossy().into_owned();
                if !file.ends_with(".csv") {
                    continue;
                }
                let text = std::fs::read_to_string(entry.path()).map_err(|e| TableError {
                    file: entry.path().display().to_string(),
                    line: 0,
                    why: format!("cannot read: {e}"),
                })?;
                files.push((file, text));
            }
            apps.insert(name.to_owned(), Application::parse(name, &files)?);
        }
        Ok(Applications { apps })
    }

    /// The copy of the artifact's measurements this repository keeps
    /// (`autoscaler/data/pollux/traces/`).
    pub fn builtin() -> Applications {
        let mut apps = BTreeMap::new();
        for name in names() {
            let files: Vec<(String, String)> = super::pollux_data::FILES
                .iter()
                .filter(|(app, _, _)| *app == name)
                .map(|(_, f, text)| ((*f).to_owned(), (*text).to_owned()))
                .collect();
            let app = Application::parse(name, &files)
                .unwrap_or_else(|e| panic!("the built-in measurements are broken: {e}"));
            apps.insert(name.to_owned(), app);
        }
        Applications { apps }
    }

    /// Application `name`.
    pub fn get(&self, name: &str) -> Option<&Application> {
        self.apps.get(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The artifact's own figures for a job started on a tick and never moved: 30 s of
    /// restore plus its run time is its published Tiresias JCT (workload 1, load 1.0),
    /// to within the rounding of each epoch to whole seconds.
    #[test]
    fn run_times_match_the_artifacts_published_jcts_of_undisturbed_jobs() {
        let apps = Applications::builtin();
        for (app, gpus, batch, jct) in [
            ("cifar10", 6, 2048, 953.0 - (120.0 - 107.0)),
            ("deepspeech2", 6, 320, 4182.0 - (120.0 - 110.0)),
            ("ncf", 1, 32768, 122.0 - (180.0 - 135.0)),
            ("deepspeech2", 12, 640, 2545.0 - (300.0 - 262.0)),
            ("cifar10", 16, 4096, 516.0 - (360.0 - 356.0)),
            ("cifar10", 12, 4096, 702.0 - (1380.0 - 1332.0)),
            ("cifar10", 8, 2048, 904.0 - (1620.0 - 1611.0)),
        ] {
            let a = apps.get(app).expect("known");
            let run = 30.0 + a.run_time(batch, gpus);
            // The artifact rounds each epoch's end to a whole second, which adds up
            // to 2.2% on cifar10's 100 epochs of 5 to 9 s (0.1% to 1.4% on the others).
            assert!(
                (run - jct).abs() <= 0.022 * jct,
                "{app} {gpus}x{batch}: {run:.1} s, published {jct} s"
            );
        }
    }

    #[test]
    fn batches_split_as_the_artifact_splits_them() {
        let apps = Applications::builtin();
        let split = |app: &str, batch, n| apps.get(app).expect("known").split(batch, n);
        assert_eq!(
            split("bert", 384, 6),
            Split {
                atomic: 10,
                accum: 5,
                batch: 360
            }
        );
        assert_eq!(split("cifar10", 4096, 12).batch, 4092);
        assert_eq!(split("cifar10", 2048, 6).atomic, 342);
        assert_eq!(
            split("ncf", 32768, 1),
            Split {
                atomic: 16384,
                accum: 1,
                batch: 32768
            }
        );
        assert_eq!(split("yolov3", 64, 4).accum, 1);
    }

    #[test]
    fn placements_are_named_by_their_smallest_rotation() {
        assert_eq!(necklace(&[4, 2]), "24");
        assert_eq!(necklace(&[2, 1, 1]), "112");
        assert_eq!(necklace(&[1, 3, 2]), "132");
        assert_eq!(necklace(&[4, 0, 4]), "44");
        assert_eq!(packed(6), vec![4, 2]);
        assert_eq!(packed(8), vec![4, 4]);
    }

    /// Every application has a finite, positive rate on every GPU count its batch
    /// allows, and all but ncf gain from a few GPUs.
    #[test]
    fn rates_are_positive_and_grow_from_one_gpu() {
        let apps = Applications::builtin();
        for (app, batch) in [
            ("bert", 384),
            ("cifar10", 2048),
            ("deepspeech2", 320),
            ("imagenet", 6400),
            ("ncf", 32768),
            ("yolov3", 64),
        ] {
            let a = apps.get(app).expect("known");
            let top = a.max_gpus(batch).min(64);
            let one = a.rate(batch, 1);
            assert!(one.is_finite() && one > 0.0, "{app}: {one}");
            for n in 2..=top {
                let r = a.rate(batch, n);
                assert!(r.is_finite() && r > 0.0, "{app} at {n}: {r}");
            }
            // ncf's steps are milliseconds: its sync across nodes eats the gain.
            if app != "ncf" {
                assert!(a.rate(batch, 4) > 2.0 * one, "{app}: no gain from GPUs");
            }
        }
    }

    #[test]
    fn bad_measurements_are_one_error_naming_the_file_and_line() {
        let placements = "placement,local_bsz,step_time,sync_time\n1,32,0.1,0.01\n";
        let scal = "num_nodes,num_replicas,local_bsz,step_time,sync_time\n";
        let val = |rows: usize| {
            let mut t = String::from("progress,iteration,metric,grad_sqr,grad_var\n");
            for e in 0..rows {
                t.push_str(&format!("{},{e},0.5,1.0,2.0\n", (e + 1) * 10));
            }
            t
        };
        let files = |p: &str, v: String| {
            vec![
                ("placements.csv".to_owned(), p.to_owned()),
                ("scalability.csv".to_owned(), scal.to_owned()),
                ("validation-128.csv".to_owned(), v),
            ]
        };
        assert!(Application::parse("bert", &files(placements, val(2))).is_ok());
        let e = Application::parse("gpt", &files(placements, val(2))).unwrap_err();
        assert!(e.to_string().contains("unknown application"), "{e}");
        let e = Application::parse("bert", &files(placements, val(1))).unwrap_err();
        assert!(e.to_string().contains("1 epochs, 2 wanted"), "{e}");
        let bad = "placement,local_bsz,step_time,sync_time\n1,32,0.1,0.01\n9,32,x,0\n";
        let e = Application::parse("bert", &files(bad, val(2))).unwrap_err();
        assert_eq!((e.file.as_str(), e.line), ("bert/placements.csv", 3), "{e}");
        let e = Application::parse("bert", &files("placement,step_time\n", val(2))).unwrap_err();
        assert!(e.to_string().contains("no column `local_bsz`"), "{e}");
    }
}
