//! Optimizers, learning-rate schedules and gradient clipping on plain `f32` slices.
//!
//! The pserver applies updates block by block (and row by row for sparse tables); the
//! trainer's single-process baseline applies the same code to whole tensors. Both give
//! the same numbers for the same gradients.
//!
//! - [`OptimizerConfig`]: the serde form (what the initialising trainer sends).
//! - [`Optimizer`]: a validated config; [`Optimizer::step`] updates one slice with its
//!   [`SlotState`] (momentum, second moments, the update count `t`).
//! - [`LrSchedule`]: constant, linear decay, step decay, cosine; [`Optimizer::lr`] gives
//!   the rate of update number `step` (counted from 0).
//! - [`Clip`]: by value, then by global L2 norm, over every gradient of one trainer step
//!   (the client clips before it pushes, so each shard sees already-clipped gradients and
//!   no cross-shard norm is needed). [`Clip::plan`] computes the factor,
//!   [`ClipPlan::apply`] transforms values.
//!
//! Conventions follow PyTorch (`torch.optim`): SGD momentum buffers start at the first
//! gradient, Nesterov uses `g + momentum * buf`, Adam's bias corrections use the update
//! count `t` of the slice, AdamW decays the weights before the Adam step, Adam and
//! Adagrad add `weight_decay * param` to the gradient (L2).
//!
//! Layout:
//! - the description ([`OptimizerKind`], [`LrSchedule`], [`OptimizerConfig`],
//!   [`ConfigError`], [`Clip`], [`ClipPlan`]) is `edl_job::optim`, re-exported here: the
//!   job spec and the pservers share it.
//! - `update`: [`Optimizer`] and [`SlotState`]: the update rules on slices.

mod update;

pub use edl_job::optim::{Clip, ClipPlan, ConfigError, LrSchedule, OptimizerConfig, OptimizerKind};
pub use update::{Optimizer, SlotState};

/// Asserts that `a` is `b` within a relative `1e-6` (the tests of every part use it).
#[cfg(test)]
fn close(a: f32, b: f64) {
    assert!(
        (f64::from(a) - b).abs() <= 1e-6 * b.abs().max(1.0),
        "{a} != {b}"
    );
}
