//! The multi-job autoscaler of edl: which elastic job gets how many trainers.
//!
//! The policy is a pure function ([`policy::decide`]): a [`Snapshot`] of the cluster
//! (nodes' allocatable resources and requests; jobs with min/max, priority, trainer
//! requests, observed speeds and work left) in, new trainer counts ([`Target`]) out. No
//! clock is read and nothing is written: the operator (`edl operator run --autoscale`),
//! `edl run --autoscale` and the simulator (`edl sim`) build snapshots from what they see
//! and apply the answer their own way (the scale subresource, the supervisor, the model).
//!
//! EDL's published autoscaler is here too ([`paddle::decide`]), faithful to its source,
//! so the simulator can put the two side by side on EDL's own experiment.
//!
//! Layout:
//! - [`resources`]: CPU, memory, GPUs.
//! - [`snapshot`]: what a policy sees, and its answer.
//! - [`speedup`]: the speed-up curve, fitted to observed speeds.
//! - [`rate`]: a job's speed by trainer count as the policy predicts it (observed speeds,
//!   the fit elsewhere, the counts worth running at).
//! - [`observe`]: a job's speeds learnt from samples of its progress, and its last
//!   change (what the operator and `edl run` remember between passes).
//! - [`policy`]: edl's policy.
//! - [`paddle`]: EDL's algorithm (its defects reproducible, off by default).
//! - [`sim`]: the discrete-event cluster simulator, its policies, scenarios, table and plot.

pub mod observe;
pub mod paddle;
pub mod policy;
pub mod rate;
pub mod resources;
pub mod sim;
pub mod snapshot;
pub mod speedup;

pub use rate::RateModel;
pub use resources::Resources;
pub use snapshot::{JobView, Node, Observation, PodCounts, Snapshot, Target};
pub use speedup::Speedup;
