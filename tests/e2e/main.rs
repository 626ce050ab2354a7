//! Cross-process tests: real etcd servers and real `edl` processes, killed with SIGKILL.
//!
//! One test binary (built once) with a module per area:
//! - [`support`]: etcd clusters, `edl` child processes, datasets, deadlines.
//! - [`chaos`]: `edl run --chaos` with kills of every role, async groups of batches.
//! - [`entry`]: `[trainer] entry` programs: the own-model example under a trainer
//!   SIGKILL, and programs that cannot start, exit at once or never register.
//! - [`etcd`]: etcd unreachable at startup, and outages (a leader's death, a quorum
//!   loss) under a running job.
//! - [`kubernetes`]: the operator end to end: a TrainingJob on the fake API server, its
//!   pods run as real `edl` processes, scaled, with pods deleted, to Succeeded.
//! - [`master`]: the master's task queue across trainer and master failures.
//! - [`monitoring`]: every metric `deploy/monitoring.yaml` names is served; `/metrics`
//!   behind the job token.
//! - [`objects`]: `edl data put/ls` against a real S3 server; bad URLs and missing
//!   credentials.
//! - [`pserver`]: parameter servers across pserver and trainer failures.
//! - [`replicas`]: replicated shards: a primary SIGKILLed, SIGSTOPped, or partitioned
//!   from etcd, and its backup promoted with every acknowledged push.
//! - [`restore`]: a job whose etcd is lost whole, restored from the master's snapshot.
//! - [`run`]: `edl run` of the examples, operator commands, bad input.
//! - [`scale`]: `edl bench scale`, short: every record once through a master failover;
//!   `edl bench local`, edl's own single-process loop.
//! - [`secure`]: `edl run --secure` over mutual TLS as a job user; jobs isolated by
//!   etcd; a pserver's memory under an unauthenticated flood.
//! - [`soak`]: a seeded soak with faults in every role and in etcd (`scripts/soak`).
//! - [`trainer`]: `edl trainer` quality through pservers, and elasticity.

mod chaos;
mod entry;
mod etcd;
#[cfg(feature = "kubernetes")]
mod kubernetes;
mod master;
mod monitoring;
mod objects;
mod pserver;
mod replicas;
mod restore;
mod run;
mod scale;
mod secure;
mod soak;
mod support;
mod trainer;
