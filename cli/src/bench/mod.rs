//! `edl bench`: load commands that measure a whole job's machinery.
//!
//! - [`scale`]: `edl bench scale`, a job of up to a million tasks over a hundred thousand
//!   files, read by up to a thousand lightweight trainers through the real masters,
//!   pservers and etcd (docs/benchmarks.md, "Scale").

use clap::Subcommand;

mod cluster;
mod dataset;
mod probe;
pub mod scale;
mod trainers;

/// `edl bench` subcommands.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// A job at scale: a real etcd, `--masters` masters and `--pservers` pservers (edl
    /// processes), `--trainers` lightweight trainers in this process, each with its own
    /// lease, master and pserver connections; checks that every record is read once per
    /// pass and that every pserver ledger holds every task, and reports transitions per
    /// second, etcd bytes written per transition, etcd's size and the masters' memory.
    Scale(scale::ScaleArgs),
}

/// Runs `edl bench`.
pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Scale(args) => scale::run(args),
    }
}
