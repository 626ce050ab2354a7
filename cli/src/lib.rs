//! The `edl` command line: one binary for every role of an elastic training job and for
//! the operator and data tools.
//!
//! Layout:
//! - [`data`]: `edl data convert|stat|verify|cat|split`, RecordIO dataset tools.
//! - [`master_cmd`]: `edl master`, a master of a job.
//! - [`consume_cmd`]: `edl consume`, a model-less consumer of a job's tasks.
//! - [`pserver_cmd`]: `edl pserver`, a parameter server (one shard) of a job.
//! - [`trainer_cmd`]: `edl trainer`, an elastic trainer of a job (arguments over
//!   `edl_trainer::process::run`).
//! - [`run`](mod@run): `edl run`, a whole job on one machine, supervised.
//! - [`job_cmd`]: `edl status|scale|kill|logs`, a running job's state and controls.
//! - [`kubernetes`]: `edl submit`, `edl jobs`, `edl operator run|crd|render`, and the
//!   verbs above with `--context` (the TrainingJob resource is the `edl-operator` crate;
//!   the `kubernetes` cargo feature, on by default).
//! - [`sim_cmd`]: `edl sim`, the autoscaling policies side by side in the cluster
//!   simulator (the `edl-autoscaler` crate).
//! - [`bench`](mod@bench): `edl bench scale`, a job at scale through the real servers, measured.
//! - [`paddle`]: PaddlePaddle's environment variables as a role.
//! - the job spec, keys and records are the `edl-job` crate; the trainer process is
//!   `edl_trainer::process`.
//! - [`common`]: etcd and job options, signals, the runtime.
//! - [`logging`]: quiet query commands, INFO for roles, per-role files in process.
//!
//! `main` only parses arguments and sets up logging; each subcommand is a function here
//! that returns an exit code or an error with context.

#![warn(missing_docs)]

use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub mod bench;
pub mod common;
pub mod consume_cmd;
pub mod data;
pub mod job_cmd;
pub mod kubernetes;
pub mod logging;
pub mod master_cmd;
pub mod paddle;
pub mod pserver_cmd;
pub mod run;
pub mod sim_cmd;
pub mod trainer_cmd;

/// edl: elastic, fault-tolerant distributed training.
#[derive(Debug, Parser)]
#[command(name = "edl", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    /// More logging (-v debug, -vv trace); the EDL_LOG environment variable overrides it
    /// with a tracing filter such as `info,edl_coord=debug`.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// The subcommand (none: the role named by PaddlePaddle's environment variables).
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// The subcommands of `edl`.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// RecordIO dataset tools: convert, stat, verify, cat, split.
    #[command(subcommand)]
    Data(data::DataCommand),
    /// Run a master of a job: leases the dataset's tasks to trainers (one master leads,
    /// the others stand by).
    Master(master_cmd::MasterArgs),
    /// Read a job's tasks like a trainer, without a model (dry run of the data path).
    Consume(consume_cmd::ConsumeArgs),
    /// Run a parameter server of a job: claims a shard index, restores its latest
    /// checkpoint and serves pushes and pulls.
    Pserver(pserver_cmd::PserverArgs),
    /// Run an elastic trainer of a job: leases tasks from the master, pulls parameters
    /// from the pservers, pushes gradients; SIGTERM drains it.
    Trainer(trainer_cmd::TrainerArgs),
    /// Run a whole job on this machine from a TOML job spec: masters, pservers and
    /// trainers as supervised child processes (or in process without etcd), with live
    /// progress, a summary and a report.
    Run(run::RunArgs),
    /// Show jobs: state, pass, tasks, trainers, pservers, masters, recent failures (of
    /// `edl run` through etcd, or a TrainingJob with --context).
    Status(job_cmd::StatusArgs),
    /// Set the desired trainer count of a job (of `edl run`, or a TrainingJob's scale
    /// subresource with --context).
    Scale(job_cmd::ScaleArgs),
    /// Stop a job gracefully (of `edl run`, or delete a TrainingJob with --context).
    Kill(job_cmd::KillArgs),
    /// Print (or follow) the logs of a job (of `edl run`, or a TrainingJob's pods with
    /// --context).
    Logs(job_cmd::LogsArgs),
    /// Submit a job to a Kubernetes cluster: creates the TrainingJob of a job spec
    /// (JOB.toml) or a TrainingJob file.
    Submit(kubernetes::SubmitArgs),
    /// The jobs on a Kubernetes cluster: submitted, pending, running trainers, CPU.
    Jobs(kubernetes::JobsArgs),
    /// edl on Kubernetes: run the operator, print the TrainingJob resource's definition,
    /// or the objects the operator creates for a job.
    #[command(subcommand)]
    Operator(kubernetes::OperatorCommand),
    /// Simulate a cluster under no autoscaling, EDL's autoscaler and edl's, side by side:
    /// EDL's published experiment and a synthetic day (tables, goals, plots).
    Sim(sim_cmd::SimArgs),
    /// Load commands that measure a whole job's machinery (`edl bench scale`: a million
    /// tasks, a thousand trainers, real etcd, masters and pservers).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

/// Sets up `tracing` for this command line (see [`logging`]): queries, data tools
/// and `edl run` print warnings only unless `-v`; the roles log INFO.
pub fn init_logging(cli: &Cli) {
    let verbosity = match &cli.command {
        Some(
            Command::Data(_)
            | Command::Run(_)
            | Command::Status(_)
            | Command::Scale(_)
            | Command::Kill(_)
            | Command::Logs(_)
            | Command::Submit(_)
            | Command::Jobs(_)
            | Command::Sim(_)
            | Command::Bench(_)
            | Command::Operator(
                kubernetes::OperatorCommand::Crd
                | kubernetes::OperatorCommand::Render(_)
                | kubernetes::OperatorCommand::RestoreEtcd(_)
                | kubernetes::OperatorCommand::RestoreEtcdMember(_),
            ),
        ) => logging::Verbosity::Quiet,
        Some(
            Command::Master(_)
            | Command::Consume(_)
            | Command::Pserver(_)
            | Command::Trainer(_)
            | Command::Operator(kubernetes::OperatorCommand::Run(_)),
        )
        | None => logging::Verbosity::Info,
    };
    logging::init(verbosity, cli.verbose);
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let command = match cli.command {
        Some(c) => c,
        None => {
            let args = paddle::role_args(|k| std::env::var(k).ok())?;
            tracing::info!(?args, "running the role named by PADDLE_TRAINING_ROLE");
            match Cli::try_parse_from(std::iter::once("edl".to_owned()).chain(args)) {
                Ok(Cli {
                    command: Some(c), ..
                }) => c,
                Ok(_) => anyhow::bail!("no command"),
                Err(e) => anyhow::bail!("{e}"),
            }
        }
    };
    match command {
        Command::Data(cmd) => data::run(cmd),
        Command::Master(args) => master_cmd::run(args).map(|()| ExitCode::SUCCESS),
        Command::Consume(args) => consume_cmd::run(args).map(|()| ExitCode::SUCCESS),
        Command::Pserver(args) => pserver_cmd::run(args).map(|()| ExitCode::SUCCESS),
        Command::Trainer(args) => trainer_cmd::run(args).map(|()| ExitCode::SUCCESS),
        Command::Run(args) => run::run(args),
        Command::Status(args) => job_cmd::status(args).map(|()| ExitCode::SUCCESS),
        Command::Scale(args) => job_cmd::scale(args).map(|()| ExitCode::SUCCESS),
        Command::Kill(args) => job_cmd::kill(args).map(|()| ExitCode::SUCCESS),
        Command::Logs(args) => job_cmd::logs(args).map(|()| ExitCode::SUCCESS),
        Command::Submit(args) => kubernetes::submit(args).map(|()| ExitCode::SUCCESS),
        Command::Jobs(args) => kubernetes::jobs(args).map(|()| ExitCode::SUCCESS),
        Command::Operator(cmd) => kubernetes::operator(cmd),
        Command::Sim(args) => sim_cmd::run(args),
        Command::Bench(cmd) => bench::run(cmd).map(|()| ExitCode::SUCCESS),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    /// The README's command tables: the rows whose first cell is an `edl` command line.
    fn command_rows(readme: &str) -> Vec<&str> {
        readme.lines().filter(|l| l.starts_with("| `edl")).collect()
    }

    /// Every verb of `edl --help`, and every verb under it (`edl data convert`, `edl
    /// operator crd`), has a row in the README's command table.
    #[test]
    fn every_verb_of_edl_help_is_in_the_readmes_command_table() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md");
        let readme = std::fs::read_to_string(path).expect("read README.md");
        let rows = command_rows(&readme);
        // Positive witness: the table was found and read.
        assert!(rows.len() >= 10, "README command table not found: {rows:?}");
        let cli = Cli::command();
        let mut verbs = 0;
        let mut missing = Vec::new();
        for verb in cli.get_subcommands().filter(|c| !c.is_hide_set()) {
            let name = verb.get_name();
            verbs += 1;
            let lead = format!("| `edl {name}");
            let own: Vec<&str> = rows
                .iter()
                .copied()
                .filter(|r| r.starts_with(&lead) || r.contains(&format!("`edl {name} ")))
                .collect();
            // `edl status|scale|kill|logs JOB --context` names several verbs in one row.
            let shared = rows.iter().any(|r| {
                r.split('`')
                    .nth(1)
                    .and_then(|cmd| cmd.strip_prefix("edl "))
                    .and_then(|cmd| cmd.split(' ').next())
                    .is_some_and(|first| first.split('|').any(|v| v == name))
            });
            if own.is_empty() && !shared {
                missing.push(format!("edl {name}"));
                continue;
            }
            for sub in verb.get_subcommands().filter(|c| !c.is_hide_set()) {
                let sub = sub.get_name();
                let named = own.iter().any(|r| {
                    r.contains(&format!("`edl {name} {sub}")) || r.contains(&format!("`{sub}"))
                });
                if !named {
                    missing.push(format!("edl {name} {sub}"));
                }
            }
        }
        assert!(verbs >= 10, "edl --help lists {verbs} verbs");
        assert!(
            missing.is_empty(),
            "README.md's command table lacks {missing:?}: add a row (or name the verb in its group's row)"
        );
    }

    /// docs/design.md's crate map names every package of the workspace (`Cargo.toml`'s
    /// members), with its folder and its name, and says how many there are.
    #[test]
    fn design_names_every_package() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
        let read = |p: &str| {
            std::fs::read_to_string(format!("{root}/{p}")).unwrap_or_else(|e| panic!("{p}: {e}"))
        };
        let workspace: toml::Table = read("Cargo.toml").parse().expect("Cargo.toml");
        let members: Vec<String> = workspace["workspace"]["members"]
            .as_array()
            .expect("members")
            .iter()
            .map(|m| m.as_str().expect("a member's folder").to_owned())
            .collect();
        assert!(members.len() >= 15, "{members:?}");
        let design = read("docs/design.md");
        let mut missing = Vec::new();
        for dir in &members {
            let manifest: toml::Table = read(&format!("{dir}/Cargo.toml")).parse().expect(dir);
            let name = manifest["package"]["name"]
                .as_str()
                .expect("a package name");
            if !design.contains(&format!("- **`{dir}/` (`{name}`")) {
                missing.push(format!("{dir}/ ({name})"));
            }
        }
        assert!(
            missing.is_empty(),
            "docs/design.md's crate map (section 2) lacks {missing:?}"
        );
        const WORDS: [&str; 31] = [
            "zero",
            "one",
            "two",
            "three",
            "four",
            "five",
            "six",
            "seven",
            "eight",
            "nine",
            "ten",
            "eleven",
            "twelve",
            "thirteen",
            "fourteen",
            "fifteen",
            "sixteen",
            "seventeen",
            "eighteen",
            "nineteen",
            "twenty",
            "twenty-one",
            "twenty-two",
            "twenty-three",
            "twenty-four",
            "twenty-five",
            "twenty-six",
            "twenty-seven",
            "twenty-eight",
            "twenty-nine",
            "thirty",
        ];
        let count = WORDS.get(members.len()).expect("fewer than 31 packages");
        assert!(
            design.contains(&format!(
                "The workspace (`Cargo.toml`) has {count} packages"
            )),
            "docs/design.md must say the workspace has {count} packages"
        );
    }

    /// The layers of docs/design.md ("Crates") hold: no server depends on its client (or
    /// on the trainer, or candle) and no client on a server, through any chain of the
    /// workspace's `[dependencies]` (dev-dependencies aside: tests drive servers through
    /// their clients); the role kit and the contracts depend on no role.
    #[test]
    fn no_server_depends_on_its_client_and_the_kit_on_no_role() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
        let read = |p: &str| -> toml::Table {
            std::fs::read_to_string(format!("{root}/{p}"))
                .unwrap_or_else(|e| panic!("{p}: {e}"))
                .parse()
                .unwrap_or_else(|e| panic!("{p}: {e}"))
        };
        let workspace = read("Cargo.toml");
        let mut deps = std::collections::BTreeMap::<String, Vec<String>>::new();
        for dir in workspace["workspace"]["members"]
            .as_array()
            .expect("members")
        {
            let manifest = read(&format!("{}/Cargo.toml", dir.as_str().expect("a folder")));
            let name = manifest["package"]["name"]
                .as_str()
                .expect("a name")
                .to_owned();
            let direct = manifest
                .get("dependencies")
                .and_then(|d| d.as_table())
                .map(|d| d.keys().cloned().collect())
                .unwrap_or_default();
            deps.insert(name, direct);
        }
        let closure = |krate: &str| {
            let mut seen = std::collections::BTreeSet::new();
            let mut todo = vec![krate.to_owned()];
            while let Some(k) = todo.pop() {
                for d in deps.get(&k).into_iter().flatten() {
                    if seen.insert(d.clone()) {
                        todo.push(d.clone());
                    }
                }
            }
            seen
        };
        // Positive witness: the graph was read, and a chain through it is followed.
        assert!(closure("edl").contains("candle-core"), "{deps:?}");
        assert!(
            closure("edl-trainer").contains("edl-pserver-api"),
            "{deps:?}"
        );
        let rules: [(&str, &[&str]); 7] = [
            (
                "edl-master",
                &[
                    "edl-master-client",
                    "edl-trainer",
                    "candle-core",
                    "edl-pserver",
                ],
            ),
            (
                "edl-pserver",
                &[
                    "edl-pserver-client",
                    "edl-trainer",
                    "candle-core",
                    "edl-master",
                ],
            ),
            ("edl-master-client", &["edl-master", "edl-trainer"]),
            ("edl-pserver-client", &["edl-pserver", "edl-trainer"]),
            (
                "edl-role",
                &["edl-master", "edl-pserver", "edl-trainer", "candle-core"],
            ),
            ("edl-master-api", &["edl-master", "edl-master-client"]),
            ("edl-pserver-api", &["edl-pserver", "edl-pserver-client"]),
        ];
        let mut broken = Vec::new();
        for (krate, never) in rules {
            let reach = closure(krate);
            for n in never {
                if reach.contains(*n) {
                    broken.push(format!("{krate} reaches {n}"));
                }
            }
        }
        assert!(broken.is_empty(), "layering broken: {broken:?}");
    }
}
