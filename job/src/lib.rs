//! The contract of an edl job in etcd: what every process of a job agrees on.
//!
//! Every key of a job lives under `/edl/<job>/`; [`JobKeys`] is the one place that builds
//! (and parses) those paths, [`JobName`] the one validated job name, and [`records`] the
//! typed, versioned values stored under them. The full tree, with who writes and who
//! reads each key, is in `docs/design.md` ("etcd keys").
//!
//! # Layout
//!
//! - [`name`]: [`JobName`], the one job-name type and its validator.
//! - [`keys`]: [`JobKeys`], every key of the job tree.
//! - [`env`](mod@env): the environment contract's variable names (`EDL_ETCD`, `EDL_JOB`, ...).
//! - [`records`]: the typed, versioned values ([`JobStateRecord`], [`ControlRecord`],
//!   [`RunRecord`], [`ScaleRecord`], [`TrainerRecord`], [`PserverRecord`]) and their
//!   encoding.
//! - [`holders`]: the etcd leases a job's process holds, revoked at once by whoever sees
//!   it die ([`holders::Holder`], [`holders::revoke_held`]).
//! - [`ledger`]: which tasks' updates a shard contains ([`LedgerSummary`](ledger::LedgerSummary)),
//!   as a restored pserver tells the master.
//! - [`model`]: [`ModelSpec`](model::ModelSpec), the built-in model a job trains (the
//!   description; the trainer builds it), and feature statistics.
//! - [`optim`]: the optimizer, schedule, clipping and mode, described once (the spec
//!   converts to them; the pservers apply them).
//! - [`spec`]: [`JobSpec`], the job spec: parse, validate, store in etcd.
//! - [`launch`]: the spec translated once into each role's settings ([`MasterLaunch`],
//!   [`PserverLaunch`], [`TrainerLaunch`]), rendered as arguments or used in process.

#![warn(missing_docs)]

pub mod env;
pub mod holders;
pub mod keys;
pub mod launch;
pub mod ledger;
pub mod model;
pub mod name;
pub mod optim;
pub mod records;
pub mod spec;

pub use keys::JobKeys;
pub use launch::{MasterLaunch, PserverLaunch, SnapshotLaunch, TrainerLaunch};
pub use name::{InvalidJobName, JobName, valid_member_id};
pub use records::{
    CheckpointPin, Control, ControlRecord, FailedRecord, FinalState, GroupRecord, JobStateRecord,
    MemberRecord, PserverRecord, RECORD_VERSION, Record, RecordError, RestoreRecord, RunRecord,
    ScaleRecord, TrainerRecord,
};
pub use spec::{JobSpec, SpecError};
