//! `edl bench`: load commands that measure a whole job's machinery.
//!
//! - [`scale`]: `edl bench scale`, a job of up to a million tasks over a hundred thousand
//!   files, read by up to a thousand lightweight trainers through the real masters,
//!   pservers and etcd (docs/benchmarks.md, "Scale").
//! - [`push`]: `edl bench push`, the latency, rate and memory of pushes to one shard
//!   with 1 and with 2 replicas (docs/benchmarks.md, "Replicated pservers").
//! - [`local`]: `edl bench local`, edl's own single-process loop on a job's built-in
//!   model, data and device: the ceiling its trainers are compared with (docs/gpu.md).

use clap::Subcommand;

mod cluster;
mod dataset;
pub mod local;
mod probe;
pub mod push;
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
    /// What a shard's replicas cost a push: etcd and `R` `edl pserver --replicas R`
    /// processes per replica count asked, one client timing each push from send to
    /// acknowledgement; prints latency p50/p99, pushes/s and the pservers' peak memory.
    Push(push::PushArgs),
    /// edl's own single-process loop on a job's built-in model and data, on a device
    /// (`--device`): per batch size (`--batch 32,256`), samples/s and each step's
    /// prepare / forward and backward / update time; no etcd, master or pserver.
    Local(local::LocalArgs),
}

/// Runs `edl bench`.
pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Scale(args) => scale::run(args),
        BenchCommand::Push(args) => push::run(args),
        BenchCommand::Local(args) => local::run(args),
    }
}
