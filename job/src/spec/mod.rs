//! [`JobSpec`]: a TOML file a user writes (`edl run JOB.toml`), and its resolved form
//! stored as JSON under `/edl/<job>/job/spec` in etcd, from which every role reads what it
//! needs (data globs, passes, model, mode, optimizer).
//!
//! ```toml
//! name = "wine"
//! [data]
//! train = "data/wine-*.recordio"        # RecordIO globs (a string or a list)
//! test = "data/wine-test-*.recordio"    # optional held-out split
//! [model]
//! kind = "mlp"        # fit_a_line | linear | mlp | mnist_mlp | mnist_cnn | word2vec
//! inputs = 13
//! hidden = [32]
//! classes = 3
//! standardize = true
//! [train]
//! mode = "sync"       # sync | async
//! passes = 20
//! batch_size = 32
//! optimizer = "adam"  # sgd | momentum | adagrad | adam | adamw
//! learning_rate = 0.01
//! [trainer]            # optional: run your own program as the trainers
//! # entry = ["./target/release/my-trainer", "--width", "64"]   # then [model] is optional
//! [cluster]
//! masters = 1
//! pservers = 1
//! # pserver_replicas = 2  # replicas per shard (docs/replication.md)
//! trainers = 2
//! min_trainers = 1
//! max_trainers = 4
//! lease_ttl = "10s"  # etcd lease of every process (see ClusterSpec::lease_ttl)
//! checkpoint_every = "10s"
//! # checkpoint_dir = "s3://bucket/checkpoints"  # default: the run directory
//! ```
//!
//! Unknown keys and missing required ones are an error naming the key and the file;
//! relative paths are relative to the spec file.
//!
//! # Layout
//!
//! - this module: the spec's types, as written in TOML and stored in etcd.
//! - [`parse`]: reading a TOML file ([`JobSpec::load`]): key, line and column in errors;
//!   paths resolved against the file.
//! - [`validate`]: [`JobSpec::validate`] and the typed [`SpecError`].
//! - [`convert`]: the training settings as the optimizer and mode the pservers apply
//!   ([`TrainSpec::optimizer_config`], [`TrainSpec::mode`]).
//! - [`store`]: the versioned JSON stored at `job/spec` ([`JobSpec::publish`],
//!   [`JobSpec::fetch`]).
//!
//! Turning a spec into the trainer's settings (the pservers' parameter config with its
//! block size, the runtime config) and checking the model by building it are the
//! trainer's: `edl_trainer::job`.

pub mod convert;
pub mod parse;
pub mod per_push;
#[cfg(feature = "schema")]
pub mod schema;
pub mod store;
pub mod validate;

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use store::{SPEC_VERSION, StoredSpec};

pub use per_push::PerPush;
pub use validate::SpecError;

/// Most pserver shards of a job (`cluster.pservers`).
pub const MAX_PSERVERS: u32 = 256;

use crate::model::ModelSpec;
use crate::name::JobName;

/// Durations written as `"3s"`, `"500ms"`, `"2m"`.
mod dur {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s)
            .map_err(|e| serde::de::Error::custom(format!("invalid duration {s:?}: {e}")))
    }
}

/// One glob or a list of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Globs {
    /// A single pattern.
    One(String),
    /// Several patterns.
    Many(Vec<String>),
}

impl Globs {
    /// The patterns.
    pub fn patterns(&self) -> Vec<String> {
        match self {
            Globs::One(s) => vec![s.clone()],
            Globs::Many(v) => v.clone(),
        }
    }

    pub(crate) fn resolve(&mut self, base: &Path) {
        let fix = |p: &mut String| {
            // A URL (`s3://bucket/...`) is not a path.
            if Path::new(p.as_str()).is_relative() && !p.contains("://") {
                *p = base.join(p.as_str()).to_string_lossy().into_owned();
            }
        };
        match self {
            Globs::One(s) => fix(s),
            Globs::Many(v) => v.iter_mut().for_each(fix),
        }
    }
}

/// `[data]`.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSpec {
    /// Training RecordIO files (globs).
    pub train: Globs,
    /// Held-out RecordIO files (globs) evaluated after every pass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test: Option<Globs>,
    /// Consecutive chunks per task (0: sized by `records_per_task`).
    #[serde(default)]
    pub chunks_per_task: u32,
    /// Records per task, when `chunks_per_task` is 0 (default 4096): each task the
    /// fewest consecutive chunks of a file holding this many, fewer when a pass would
    /// otherwise have under 32 tasks, but never fewer than `batch_size` (a smaller task
    /// would make its steps smaller than the batch); 0: the master's chunks per task. Tasks large
    /// enough make the per-task costs (two etcd commits and a `TaskDone` per task) a
    /// small part of the time; a lost trainer's task is trained again whole.
    #[serde(default = "d_records_per_task")]
    pub records_per_task: u64,
    /// How `edl run` creates the RecordIO files from a raw file when they are missing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prepare: Option<PrepareSpec>,
}

fn d_test_every() -> usize {
    5
}

/// `[data.prepare]`: convert a raw file (CSV, MNIST CSV or text; gzip allowed) into the
/// `train` (and `test`) RecordIO files, holding out every `test_every`-th line. The
/// `train` and `test` globs must then be of the form `DIR/PREFIX-*.recordio`.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrepareSpec {
    /// The raw file (relative to the spec).
    pub from: String,
    /// `csv`, `mnist-csv`, `text` or `multislot` (as `edl data convert --format`).
    pub format: String,
    /// For multislot: what each slot is (as `edl data convert --slots`, e.g.
    /// `"dense,sparse*26,label"`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub slots: String,
    /// Every this many lines one goes to the test split (0: no test split; default 5).
    #[serde(default = "d_test_every")]
    pub test_every: usize,
    /// Training shards (default 1).
    #[serde(default = "d_shards")]
    pub shards: u32,
    /// Uncompressed bytes per chunk (default: `edl data convert`'s); a task is made of
    /// chunks, so smaller chunks give more tasks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk_size: Option<String>,
    /// For csv and multislot: `value` (regression, default), `class` or `none`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// For csv: the first line is a header.
    #[serde(default)]
    pub header: bool,
    /// Shuffle the lines (seeded by `train.seed`) before they are split and written, so
    /// that the tasks of a file sorted by label (as the bundled MNIST digits are) mix
    /// the labels. The whole input is held in memory either way.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shuffle: bool,
}

fn d_shards() -> u32 {
    1
}

/// `train.mode`.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ModeName {
    /// Synchronous SGD: each step averages the live trainers' gradients.
    Sync,
    /// Asynchronous SGD: every push applied on arrival.
    #[default]
    Async,
}

/// `train.optimizer`.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerName {
    /// Plain SGD.
    #[default]
    Sgd,
    /// SGD with momentum (`train.momentum`, `train.nesterov`).
    Momentum,
    /// Adagrad.
    Adagrad,
    /// Adam.
    Adam,
    /// AdamW (decoupled weight decay).
    Adamw,
}

/// `train.lr_schedule`.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleName {
    /// Constant.
    #[default]
    Constant,
    /// Linear decay to `lr_end` over `lr_decay_steps`.
    Linear,
    /// Multiply by `lr_gamma` every `lr_decay_steps`.
    Step,
    /// Cosine annealing to `lr_end` over `lr_decay_steps`.
    Cosine,
}

fn one() -> u32 {
    1
}
fn d_batch() -> usize {
    32
}
fn d_lr() -> f32 {
    0.01
}
fn d_momentum() -> f32 {
    0.9
}
fn d_gamma() -> f32 {
    0.1
}
fn d_decay_steps() -> u64 {
    1000
}
fn d_step_timeout() -> Duration {
    Duration::from_secs(60)
}
fn d_records_per_task() -> u64 {
    4096
}
fn d_eval_batch() -> usize {
    256
}

/// `[train]`.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSpec {
    /// `sync` or `async` (default async).
    #[serde(default)]
    pub mode: ModeName,
    /// Passes over the training data (default 1).
    #[serde(default = "one")]
    pub passes: u32,
    /// Samples per gradient step (default 32).
    #[serde(default = "d_batch")]
    pub batch_size: usize,
    /// The optimizer (default sgd).
    #[serde(default)]
    pub optimizer: OptimizerName,
    /// Learning rate (default 0.01).
    #[serde(default = "d_lr")]
    pub learning_rate: f32,
    /// Momentum of `optimizer = "momentum"` (default 0.9).
    #[serde(default = "d_momentum")]
    pub momentum: f32,
    /// Nesterov momentum for `optimizer = "momentum"`.
    #[serde(default)]
    pub nesterov: bool,
    /// Weight decay (L2 for sgd/momentum/adagrad/adam; decoupled for adamw).
    #[serde(default)]
    pub weight_decay: f32,
    /// Learning rate schedule (default constant).
    #[serde(default)]
    pub lr_schedule: ScheduleName,
    /// Final rate of the linear and cosine schedules (default 0).
    #[serde(default)]
    pub lr_end: f32,
    /// Length of the linear/cosine schedules, period of the step schedule (updates).
    #[serde(default = "d_decay_steps")]
    pub lr_decay_steps: u64,
    /// Factor of the step schedule (default 0.1).
    #[serde(default = "d_gamma")]
    pub lr_gamma: f32,
    /// Clip each step's gradient to this global L2 norm.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_norm: Option<f32>,
    /// Clip each gradient value to `[-clip_value, clip_value]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_value: Option<f32>,
    /// Seed of parameter initialisation and sampling (default 0).
    #[serde(default)]
    pub seed: u64,
    /// Sync mode: how long a step waits for a live but silent trainer (default 60s).
    #[serde(default = "d_step_timeout", with = "dur")]
    #[cfg_attr(feature = "schema", schemars(with = "String"))]
    pub step_timeout: Duration,
    /// Batch size of the evaluation (default 256).
    #[serde(default = "d_eval_batch")]
    pub eval_batch_size: usize,
    /// Floats per dense parameter block on the pservers (default: the pserver's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<usize>,
    /// Async mode: how many consecutive batches of a task a trainer sums into one push
    /// ([`PerPush`]): `"adaptive"` (the default; see [`PerPush::Adaptive`]) or a number
    /// (fewer pushes and pulls for staler parameters). A push names its batches, so each
    /// counts once whatever the grouping of another attempt at the task.
    #[serde(default, skip_serializing_if = "PerPush::is_adaptive")]
    pub batches_per_push: PerPush,
}

impl Default for TrainSpec {
    fn default() -> Self {
        // An empty table gets every default.
        toml::from_str("").unwrap_or_else(|_| unreachable!("every field has a default"))
    }
}

fn d_trainers() -> u32 {
    2
}
fn d_ttl() -> Duration {
    edl_coord::lease::DEFAULT_TTL
}
fn d_ckpt() -> Duration {
    Duration::from_secs(10)
}
fn d_keep() -> usize {
    3
}
fn d_restarts() -> u32 {
    10
}
fn d_healthy_after() -> Duration {
    Duration::from_secs(30)
}
fn d_min_task_timeout() -> Duration {
    Duration::from_secs(10)
}
fn is_d_min_task_timeout(d: &Duration) -> bool {
    *d == d_min_task_timeout()
}

/// `[cluster]`.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    /// Masters (2 or more: standbys take over; default 1).
    #[serde(default = "one")]
    pub masters: u32,
    /// Parameter server shards (default 1).
    #[serde(default = "one")]
    pub pservers: u32,
    /// Replicas of each shard, the primary included: `edl run` starts `pservers *
    /// pserver_replicas` pserver processes, and with 2 or more a lost pserver costs no
    /// checkpoint restore while another replica of its shard is in sync
    /// (docs/replication.md). Default 1 (a lost pserver is restored from its checkpoint).
    #[serde(default = "one")]
    pub pserver_replicas: u32,
    /// Initial trainers (default 2).
    #[serde(default = "d_trainers")]
    pub trainers: u32,
    /// Fewest trainers `edl scale` may ask for (default 1).
    #[serde(default = "one")]
    pub min_trainers: u32,
    /// Most trainers `edl scale` may ask for (default: max(trainers, 4)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_trainers: Option<u32>,
    /// TTL of every process's etcd lease (default 10s): a process cut off or hung is
    /// noticed within it (one that dies under `edl run`, or a trainer pod the operator
    /// sees fail, at once: its lease is revoked), its tasks requeued, its shard or
    /// leadership taken over; and etcd's leader may go this long without hearing a
    /// renewal (a slow fsync, a congested network) before it ends a lease. An etcd without a leader (an election, a quorum loss) ends no
    /// lease: processes wait such outages out whatever the TTL. Shorter suits a fast,
    /// dedicated etcd (and tests); see [`edl_coord::lease::DEFAULT_TTL`].
    #[serde(default = "d_ttl", with = "dur")]
    #[cfg_attr(feature = "schema", schemars(with = "String"))]
    pub lease_ttl: Duration,
    /// Pserver checkpoint interval (default 10s).
    #[serde(default = "d_ckpt", with = "dur")]
    #[cfg_attr(feature = "schema", schemars(with = "String"))]
    pub checkpoint_every: Duration,
    /// Checkpoints kept per shard (default 3).
    #[serde(default = "d_keep")]
    pub checkpoint_keep: usize,
    /// Where the pservers write checkpoints: a directory (relative to the spec file) or
    /// an object URL such as `s3://bucket/checkpoints` (docs/storage.md); a shard's
    /// files go to `<checkpoint_dir>/<job>/ps-<index>/`. Default: `checkpoints` in the
    /// run directory of `edl run`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_dir: Option<String>,
    /// How many times in a row one process slot of `edl run` may exit unexpectedly
    /// within `healthy_after` of its start before the job fails: a crash loop (default
    /// 10). An exit after a healthy run (a preemption), a drain, a scale event and an
    /// injected fault do not count, and a healthy run clears the count.
    #[serde(default = "d_restarts")]
    pub max_restarts: u32,
    /// How long a process of `edl run` must have run to count as healthy: its unexpected
    /// exit is then restarted at once and not counted against `max_restarts` (default
    /// 30s, at least 1s).
    #[serde(default = "d_healthy_after", with = "dur")]
    #[cfg_attr(feature = "schema", schemars(with = "String"))]
    pub healthy_after: Duration,
    /// The shortest a task's lease may last (default 10s, at least 1s). A task's lease
    /// lasts four times the 95th percentile of the job's recent task times, at least
    /// this (300 s until five tasks are done); a trainer that holds a task that long
    /// without a report while it stays registered is stuck: its task is handed out
    /// again, the master names it (`edl status`), and `edl run` restarts it.
    /// Written only when set otherwise: a stored spec without it stays readable by
    /// processes older than it.
    #[serde(
        default = "d_min_task_timeout",
        with = "dur",
        skip_serializing_if = "is_d_min_task_timeout"
    )]
    #[cfg_attr(feature = "schema", schemars(with = "String"))]
    pub min_task_timeout: Duration,
    /// etcd endpoints (optional; `edl run --etcd` wins).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub etcd: Vec<String>,
}

impl Default for ClusterSpec {
    fn default() -> Self {
        toml::from_str("").unwrap_or_else(|_| unreachable!("every field has a default"))
    }
}

impl ClusterSpec {
    /// The upper bound of the trainer count.
    pub fn max_trainers(&self) -> u32 {
        self.max_trainers.unwrap_or(self.trainers.max(4))
    }
}

/// `[trainer]`: the program that runs as each of the job's trainers.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainerSpec {
    /// The user's trainer program and its arguments (default: edl's own `edl trainer`,
    /// which trains `[model]`). A relative program path with a `/` is relative to the
    /// spec file; one without is looked up on `PATH`. `edl run` starts it in the spec
    /// file's directory with the environment of docs/trainer-api.md.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub entry: Vec<String>,
    /// Extra environment variables for the trainer program.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub env: std::collections::BTreeMap<String, String>,
    /// How long a trainer process may take to register with the job before `edl run`
    /// names it, kills it and counts a failed start (default 60s).
    #[serde(default, skip_serializing_if = "Option::is_none", with = "opt_dur")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<String>"))]
    pub register_within: Option<Duration>,
}

impl TrainerSpec {
    /// Whether nothing is set (edl's own trainer).
    pub fn is_default(&self) -> bool {
        self == &TrainerSpec::default()
    }

    /// How long a trainer may take to register (default 60s).
    pub fn register_within(&self) -> Duration {
        self.register_within.unwrap_or(Duration::from_secs(60))
    }
}

/// Optional durations written as `"3s"`.
mod opt_dur {
    use std::time::Duration;

    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => super::dur::serialize(d, s),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        super::dur::deserialize(d).map(Some)
    }
}

/// A whole job.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// Job name (letters, digits, `-`, `_`, `.`).
    pub name: JobName,
    /// The data.
    pub data: DataSpec,
    /// The built-in model and its hyper-parameters; absent when the trainers are
    /// `[trainer] entry` programs that bring their own model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelSpec>,
    /// What runs as the job's trainers.
    #[serde(default, skip_serializing_if = "TrainerSpec::is_default")]
    pub trainer: TrainerSpec,
    /// Training settings.
    #[serde(default)]
    pub train: TrainSpec,
    /// Processes.
    #[serde(default)]
    pub cluster: ClusterSpec,
}

#[cfg(test)]
mod tests;
