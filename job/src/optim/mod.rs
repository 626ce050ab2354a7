//! The optimizer a job trains with, described once: the update rule and its
//! hyper-parameters ([`OptimizerKind`]), the learning-rate schedule ([`LrSchedule`]),
//! gradient clipping ([`Clip`], and the [`ClipPlan`] it computes for one step), the
//! serde form the job spec converts to and the initialising trainer sends to the
//! pservers ([`OptimizerConfig`], checked by [`OptimizerConfig::validate`]), and the
//! [`Mode`] updates are applied in. The update rules themselves are the pservers'
//! (`edl_pserver_client::Optimizer`); a local run applies the same ones.
//!
//! Layout:
//! - `config`: [`OptimizerKind`], [`LrSchedule`], [`OptimizerConfig`], [`ConfigError`].
//! - `clip`: [`Clip`] and [`ClipPlan`].
//! - `mode`: [`Mode`].

mod clip;
mod config;
mod mode;

pub use clip::{Clip, ClipPlan};
pub use config::{ConfigError, LrSchedule, OptimizerConfig, OptimizerKind};
pub use mode::Mode;

/// Asserts that `a` is `b` within a relative `1e-6`.
#[cfg(test)]
fn close(a: f32, b: f64) {
    assert!(
        (f64::from(a) - b).abs() <= 1e-6 * b.abs().max(1.0),
        "{a} != {b}"
    );
}
