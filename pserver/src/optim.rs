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

use serde::{Deserialize, Serialize};

/// Why an optimizer configuration was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid optimizer config: {0}")]
pub struct ConfigError(pub String);

fn check(cond: bool, what: impl FnOnce() -> String) -> Result<(), ConfigError> {
    if cond {
        Ok(())
    } else {
        Err(ConfigError(what()))
    }
}

fn finite_nonneg(name: &str, v: f32) -> Result<(), ConfigError> {
    check(v.is_finite() && v >= 0.0, || {
        format!("{name} must be finite and >= 0, got {v}")
    })
}

fn unit_interval(name: &str, v: f32) -> Result<(), ConfigError> {
    check(v.is_finite() && (0.0..1.0).contains(&v), || {
        format!("{name} must be in [0, 1), got {v}")
    })
}

fn positive(name: &str, v: f32) -> Result<(), ConfigError> {
    check(v.is_finite() && v > 0.0, || {
        format!("{name} must be finite and > 0, got {v}")
    })
}

fn default_beta1() -> f32 {
    0.9
}
fn default_beta2() -> f32 {
    0.999
}
fn default_adam_eps() -> f32 {
    1e-8
}
fn default_adagrad_eps() -> f32 {
    1e-10
}
fn default_adamw_decay() -> f32 {
    0.01
}

/// The update rule and its hyper-parameters (the learning rate is in [`LrSchedule`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum OptimizerKind {
    /// Stochastic gradient descent, with optional (Nesterov) momentum and L2 weight decay.
    Sgd {
        /// Momentum factor in `[0, 1)`; 0 disables momentum (and its state).
        #[serde(default)]
        momentum: f32,
        /// Nesterov momentum (needs `momentum > 0`).
        #[serde(default)]
        nesterov: bool,
        /// L2 penalty added to the gradient: `g + weight_decay * p`.
        #[serde(default)]
        weight_decay: f32,
    },
    /// Adagrad: per-coordinate rates from the running sum of squared gradients.
    Adagrad {
        /// Added to the denominator.
        #[serde(default = "default_adagrad_eps")]
        eps: f32,
        /// Initial value of the sum of squares.
        #[serde(default)]
        initial_accumulator: f32,
        /// L2 penalty added to the gradient.
        #[serde(default)]
        weight_decay: f32,
    },
    /// Adam, with L2 weight decay added to the gradient.
    Adam {
        /// Decay of the first moment.
        #[serde(default = "default_beta1")]
        beta1: f32,
        /// Decay of the second moment.
        #[serde(default = "default_beta2")]
        beta2: f32,
        /// Added to the denominator.
        #[serde(default = "default_adam_eps")]
        eps: f32,
        /// L2 penalty added to the gradient.
        #[serde(default)]
        weight_decay: f32,
    },
    /// AdamW: Adam with decoupled weight decay (`p *= 1 - lr * weight_decay` first).
    #[serde(rename = "adamw")]
    AdamW {
        /// Decay of the first moment.
        #[serde(default = "default_beta1")]
        beta1: f32,
        /// Decay of the second moment.
        #[serde(default = "default_beta2")]
        beta2: f32,
        /// Added to the denominator.
        #[serde(default = "default_adam_eps")]
        eps: f32,
        /// Decoupled weight decay.
        #[serde(default = "default_adamw_decay")]
        weight_decay: f32,
    },
}

impl OptimizerKind {
    /// Plain SGD.
    pub fn sgd() -> Self {
        OptimizerKind::Sgd {
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        }
    }

    /// Adam with PyTorch's defaults.
    pub fn adam() -> Self {
        OptimizerKind::Adam {
            beta1: default_beta1(),
            beta2: default_beta2(),
            eps: default_adam_eps(),
            weight_decay: 0.0,
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        match *self {
            OptimizerKind::Sgd {
                momentum,
                nesterov,
                weight_decay,
            } => {
                unit_interval("momentum", momentum)?;
                finite_nonneg("weight_decay", weight_decay)?;
                check(!nesterov || momentum > 0.0, || {
                    "nesterov momentum needs momentum > 0".into()
                })
            }
            OptimizerKind::Adagrad {
                eps,
                initial_accumulator,
                weight_decay,
            } => {
                positive("eps", eps)?;
                finite_nonneg("initial_accumulator", initial_accumulator)?;
                finite_nonneg("weight_decay", weight_decay)
            }
            OptimizerKind::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
            }
            | OptimizerKind::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                unit_interval("beta1", beta1)?;
                unit_interval("beta2", beta2)?;
                positive("eps", eps)?;
                finite_nonneg("weight_decay", weight_decay)
            }
        }
    }

    /// State floats per parameter.
    pub fn slots(&self) -> usize {
        match self {
            OptimizerKind::Sgd { momentum, .. } if *momentum > 0.0 => 1,
            OptimizerKind::Sgd { .. } => 0,
            OptimizerKind::Adagrad { .. } => 1,
            OptimizerKind::Adam { .. } | OptimizerKind::AdamW { .. } => 2,
        }
    }
}

/// The learning rate as a function of the update count (`step`, from 0).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum LrSchedule {
    /// `lr` throughout.
    Constant {
        /// The rate.
        lr: f32,
    },
    /// Linear from `lr` (step 0) to `end_lr` (step `steps`), then `end_lr`.
    Linear {
        /// Rate at step 0.
        lr: f32,
        /// Rate from step `steps` on.
        end_lr: f32,
        /// Length of the decay.
        steps: u64,
    },
    /// `lr * gamma^floor(step / every)`.
    Step {
        /// Initial rate.
        lr: f32,
        /// Steps between decays.
        every: u64,
        /// Factor applied at each decay.
        gamma: f32,
    },
    /// Cosine annealing: `min_lr + (lr - min_lr) * (1 + cos(pi * step / steps)) / 2`,
    /// then `min_lr` from step `steps` on.
    Cosine {
        /// Rate at step 0.
        lr: f32,
        /// Rate from step `steps` on.
        min_lr: f32,
        /// Length of the annealing.
        steps: u64,
    },
}

impl LrSchedule {
    /// A constant rate.
    pub fn constant(lr: f32) -> Self {
        LrSchedule::Constant { lr }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        match *self {
            LrSchedule::Constant { lr } => finite_nonneg("lr", lr),
            LrSchedule::Linear { lr, end_lr, steps } => {
                finite_nonneg("lr", lr)?;
                finite_nonneg("end_lr", end_lr)?;
                check(steps > 0, || "linear schedule needs steps > 0".into())
            }
            LrSchedule::Step { lr, every, gamma } => {
                finite_nonneg("lr", lr)?;
                positive("gamma", gamma)?;
                check(every > 0, || "step schedule needs every > 0".into())
            }
            LrSchedule::Cosine { lr, min_lr, steps } => {
                finite_nonneg("lr", lr)?;
                finite_nonneg("min_lr", min_lr)?;
                check(steps > 0, || "cosine schedule needs steps > 0".into())
            }
        }
    }

    /// The rate of update number `step` (0 for the first update).
    pub fn at(&self, step: u64) -> f32 {
        match *self {
            LrSchedule::Constant { lr } => lr,
            LrSchedule::Linear { lr, end_lr, steps } => {
                if step >= steps {
                    end_lr
                } else {
                    let f = step as f64 / steps as f64;
                    (f64::from(lr) + (f64::from(end_lr) - f64::from(lr)) * f) as f32
                }
            }
            LrSchedule::Step { lr, every, gamma } => {
                let k = (step / every).min(i32::MAX as u64) as i32;
                (f64::from(lr) * f64::from(gamma).powi(k)) as f32
            }
            LrSchedule::Cosine { lr, min_lr, steps } => {
                if step >= steps {
                    min_lr
                } else {
                    let f = step as f64 / steps as f64;
                    let c = 0.5 * (1.0 + (std::f64::consts::PI * f).cos());
                    (f64::from(min_lr) + (f64::from(lr) - f64::from(min_lr)) * c) as f32
                }
            }
        }
    }
}

/// Gradient clipping of one trainer step: first each value into
/// `[-max_value, max_value]`, then the whole step's gradient scaled down so that its
/// global L2 norm is at most `max_norm` (PyTorch's `clip_grad_norm_`: factor
/// `max_norm / (norm + 1e-6)` when below 1).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Clip {
    /// Largest global L2 norm.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_norm: Option<f32>,
    /// Largest absolute value of one gradient coordinate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_value: Option<f32>,
}

/// What [`Clip::plan`] decided: apply with [`ClipPlan::apply`] or [`ClipPlan::value`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClipPlan {
    /// Bound of each value (after which `scale` applies).
    pub max_value: Option<f32>,
    /// Factor applied to every (value-clipped) gradient coordinate.
    pub scale: f32,
    /// Global L2 norm of the value-clipped gradient, before scaling.
    pub norm: f64,
}

impl ClipPlan {
    /// The identity.
    pub const NONE: ClipPlan = ClipPlan {
        max_value: None,
        scale: 1.0,
        norm: 0.0,
    };

    /// Whether the plan changes nothing.
    pub fn is_identity(&self) -> bool {
        self.max_value.is_none() && self.scale == 1.0
    }

    /// One transformed value.
    #[inline]
    pub fn value(&self, g: f32) -> f32 {
        let g = match self.max_value {
            Some(m) => g.clamp(-m, m),
            None => g,
        };
        g * self.scale
    }

    /// Transforms `grad` in place.
    pub fn apply(&self, grad: &mut [f32]) {
        if self.is_identity() {
            return;
        }
        for g in grad {
            *g = self.value(*g);
        }
    }
}

impl Clip {
    fn validate(&self) -> Result<(), ConfigError> {
        if let Some(n) = self.max_norm {
            positive("clip.max_norm", n)?;
        }
        if let Some(v) = self.max_value {
            positive("clip.max_value", v)?;
        }
        Ok(())
    }

    /// Whether clipping is off.
    pub fn is_off(&self) -> bool {
        self.max_norm.is_none() && self.max_value.is_none()
    }

    /// Computes the clipping of one step's gradients (every slice of it).
    pub fn plan<'a>(&self, grads: impl IntoIterator<Item = &'a [f32]>) -> ClipPlan {
        if self.is_off() {
            return ClipPlan::NONE;
        }
        let value_only = ClipPlan {
            max_value: self.max_value,
            scale: 1.0,
            norm: 0.0,
        };
        let Some(max_norm) = self.max_norm else {
            return value_only;
        };
        // Squares summed in f64: finite gradients (up to f32::MAX) never overflow it.
        // Eight lanes keep the loop free of one long dependency chain.
        let mut lanes = [0.0f64; 8];
        let add = |lanes: &mut [f64; 8], xs: &[f32]| {
            for (a, &x) in lanes.iter_mut().zip(xs) {
                let x = f64::from(value_only.value(x));
                *a += x * x;
            }
        };
        for g in grads {
            let mut chunks = g.chunks_exact(8);
            for c in &mut chunks {
                add(&mut lanes, c);
            }
            add(&mut lanes, chunks.remainder());
        }
        let norm = lanes.iter().sum::<f64>().sqrt();
        let coef = f64::from(max_norm) / (norm + 1e-6);
        ClipPlan {
            max_value: self.max_value,
            scale: if coef < 1.0 { coef as f32 } else { 1.0 },
            norm,
        }
    }

    /// Clips `grads` in place; returns the plan applied.
    pub fn apply(&self, grads: &mut [&mut [f32]]) -> ClipPlan {
        let plan = self.plan(grads.iter().map(|g| &**g));
        for g in grads.iter_mut() {
            plan.apply(g);
        }
        plan
    }
}

/// The serde form of an optimizer: rule, learning-rate schedule, clipping.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    /// The update rule.
    pub kind: OptimizerKind,
    /// The learning rate schedule.
    pub lr: LrSchedule,
    /// Gradient clipping (applied by the client to each trainer step).
    #[serde(default)]
    pub clip: Clip,
}

impl OptimizerConfig {
    /// Plain SGD at a constant rate.
    pub fn sgd(lr: f32) -> Self {
        OptimizerConfig {
            kind: OptimizerKind::sgd(),
            lr: LrSchedule::constant(lr),
            clip: Clip::default(),
        }
    }

    /// Adam (PyTorch defaults) at a constant rate.
    pub fn adam(lr: f32) -> Self {
        OptimizerConfig {
            kind: OptimizerKind::adam(),
            lr: LrSchedule::constant(lr),
            clip: Clip::default(),
        }
    }

    /// Checks every hyper-parameter.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.kind.validate()?;
        self.lr.validate()?;
        self.clip.validate()
    }
}

/// The optimizer state of one slice (a dense block, a sparse row, a whole tensor).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SlotState {
    /// Updates applied so far (Adam's bias corrections use it).
    pub t: u64,
    /// `slots * len` floats: for SGD the momentum buffer; Adagrad the sum of squares;
    /// Adam the first moments then the second moments.
    pub slots: Vec<f32>,
}

/// A validated optimizer.
#[derive(Clone, Debug, PartialEq)]
pub struct Optimizer {
    cfg: OptimizerConfig,
}

impl Optimizer {
    /// Validates `cfg`.
    pub fn new(cfg: OptimizerConfig) -> Result<Self, ConfigError> {
        cfg.validate()?;
        Ok(Optimizer { cfg })
    }

    /// The configuration.
    pub fn config(&self) -> &OptimizerConfig {
        &self.cfg
    }

    /// State floats per parameter.
    pub fn slots(&self) -> usize {
        self.cfg.kind.slots()
    }

    /// Fresh state for a slice of `len` parameters.
    pub fn state(&self, len: usize) -> SlotState {
        let fill = match self.cfg.kind {
            OptimizerKind::Adagrad {
                initial_accumulator,
                ..
            } => initial_accumulator,
            _ => 0.0,
        };
        SlotState {
            t: 0,
            slots: vec![fill; self.slots() * len],
        }
    }

    /// The learning rate of update number `step` (from 0).
    pub fn lr(&self, step: u64) -> f32 {
        self.cfg.lr.at(step)
    }

    /// Applies one update with rate `lr` to `params`, with gradient `scale * grad` (the
    /// pserver's sync mode passes `1 / trainers`). `grad` must be as long as `params`
    /// (extra values on either side are ignored); a `state` of the wrong size (another
    /// optimizer's) is reset first.
    pub fn step(
        &self,
        lr: f32,
        params: &mut [f32],
        grad: &[f32],
        scale: f32,
        state: &mut SlotState,
    ) {
        let n = params.len().min(grad.len());
        let (params, grad) = (&mut params[..n], &grad[..n]);
        if state.slots.len() != self.slots() * n {
            *state = self.state(n);
        }
        state.t = state.t.saturating_add(1);
        match self.cfg.kind {
            OptimizerKind::Sgd {
                momentum,
                nesterov,
                weight_decay: wd,
            } => {
                if momentum > 0.0 {
                    let buf = &mut state.slots[..n];
                    if nesterov {
                        for ((p, &g), b) in params.iter_mut().zip(grad).zip(buf) {
                            let g = g * scale + wd * *p;
                            *b = momentum * *b + g;
                            *p -= lr * (g + momentum * *b);
                        }
                    } else {
                        for ((p, &g), b) in params.iter_mut().zip(grad).zip(buf) {
                            let g = g * scale + wd * *p;
                            *b = momentum * *b + g;
                            *p -= lr * *b;
                        }
                    }
                } else {
                    for (p, &g) in params.iter_mut().zip(grad) {
                        let g = g * scale + wd * *p;
                        *p -= lr * g;
                    }
                }
            }
            OptimizerKind::Adagrad {
                eps,
                weight_decay: wd,
                ..
            } => {
                let sum = &mut state.slots[..n];
                for ((p, &g), s) in params.iter_mut().zip(grad).zip(sum) {
                    let g = g * scale + wd * *p;
                    *s += g * g;
                    *p -= lr * g / (s.sqrt() + eps);
                }
            }
            OptimizerKind::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => adam(
                params,
                grad,
                scale,
                state,
                AdamParams {
                    lr,
                    beta1,
                    beta2,
                    eps,
                    l2: weight_decay,
                },
            ),
            OptimizerKind::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                let keep = 1.0 - lr * weight_decay;
                for p in params.iter_mut() {
                    *p *= keep;
                }
                adam(
                    params,
                    grad,
                    scale,
                    state,
                    AdamParams {
                        lr,
                        beta1,
                        beta2,
                        eps,
                        l2: 0.0,
                    },
                )
            }
        }
    }
}

struct AdamParams {
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    l2: f32,
}

fn adam(params: &mut [f32], grad: &[f32], scale: f32, state: &mut SlotState, a: AdamParams) {
    let n = params.len();
    let t = i32::try_from(state.t).unwrap_or(i32::MAX);
    let bc1 = 1.0 - f64::from(a.beta1).powi(t);
    let bc2 = 1.0 - f64::from(a.beta2).powi(t);
    let step_size = (f64::from(a.lr) / bc1) as f32;
    let inv_bc2_sqrt = (1.0 / bc2.sqrt()) as f32;
    let (m, v) = state.slots.split_at_mut(n);
    let (b1, b2) = (a.beta1, a.beta2);
    for (((p, &g), m), v) in params.iter_mut().zip(grad).zip(m).zip(v) {
        let g = g * scale + a.l2 * *p;
        *m = b1 * *m + (1.0 - b1) * g;
        *v = b2 * *v + (1.0 - b2) * g * g;
        let denom = v.sqrt() * inv_bc2_sqrt + a.eps;
        *p -= step_size * *m / denom;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f64) {
        assert!(
            (f64::from(a) - b).abs() <= 1e-6 * b.abs().max(1.0),
            "{a} != {b}"
        );
    }

    fn opt(kind: OptimizerKind, lr: f32) -> Optimizer {
        Optimizer::new(OptimizerConfig {
            kind,
            lr: LrSchedule::constant(lr),
            clip: Clip::default(),
        })
        .unwrap()
    }

    /// Runs updates of one parameter starting at 1.0 with the given gradients.
    fn run(o: &Optimizer, grads: &[f32]) -> Vec<f32> {
        let mut p = [1.0f32];
        let mut st = o.state(1);
        grads
            .iter()
            .enumerate()
            .map(|(i, &g)| {
                o.step(o.lr(i as u64), &mut p, &[g], 1.0, &mut st);
                p[0]
            })
            .collect()
    }

    #[test]
    fn sgd_plain_and_weight_decay() {
        // p = 1 - 0.1 * 0.5 = 0.95; then 0.95 - 0.1 * 0.5 = 0.9
        let o = opt(OptimizerKind::sgd(), 0.1);
        let r = run(&o, &[0.5, 0.5]);
        close(r[0], 0.95);
        close(r[1], 0.9);
        // g = 0.5 + 0.1 * 1 = 0.6, p = 1 - 0.06 = 0.94
        let o = opt(
            OptimizerKind::Sgd {
                momentum: 0.0,
                nesterov: false,
                weight_decay: 0.1,
            },
            0.1,
        );
        close(run(&o, &[0.5])[0], 0.94);
        assert_eq!(o.slots(), 0);
    }

    #[test]
    fn sgd_momentum_and_nesterov() {
        // buf = 0.5, p = 0.95; buf = 0.9 * 0.5 + 0.5 = 0.95, p = 0.95 - 0.095 = 0.855
        let o = opt(
            OptimizerKind::Sgd {
                momentum: 0.9,
                nesterov: false,
                weight_decay: 0.0,
            },
            0.1,
        );
        let r = run(&o, &[0.5, 0.5]);
        close(r[0], 0.95);
        close(r[1], 0.855);
        // Nesterov: buf = 0.5, d = 0.5 + 0.45 = 0.95, p = 0.905;
        // buf = 0.95, d = 0.5 + 0.855 = 1.355, p = 0.905 - 0.1355 = 0.7695
        let o = opt(
            OptimizerKind::Sgd {
                momentum: 0.9,
                nesterov: true,
                weight_decay: 0.0,
            },
            0.1,
        );
        let r = run(&o, &[0.5, 0.5]);
        close(r[0], 0.905);
        close(r[1], 0.7695);
    }

    #[test]
    fn adagrad() {
        // s = 0.25, p = 1 - 0.1 * 0.5 / 0.5 = 0.9; s = 0.5, p = 0.9 - 0.05 / sqrt(0.5)
        let o = opt(
            OptimizerKind::Adagrad {
                eps: 1e-10,
                initial_accumulator: 0.0,
                weight_decay: 0.0,
            },
            0.1,
        );
        let r = run(&o, &[0.5, 0.5]);
        close(r[0], 0.9);
        close(r[1], 0.9 - 0.05 / 0.5f64.sqrt());
    }

    #[test]
    fn adam_matches_hand_computation() {
        // t=1: m = 0.05, v = 0.00025, bias corrections 0.1 and 0.001, so
        //   m^ = 0.5, sqrt(v^) = 0.5 and p = 1 - 0.1 * 0.5 / (0.5 + 1e-8) = 0.900000002.
        // t=2 with g = -0.25: m = 0.045 - 0.025 = 0.02, v = 0.00024975 + 0.0000625
        //   = 0.00031225; m^ = 0.02 / 0.19, v^ = 0.00031225 / 0.001999;
        //   p = 0.900000002 - 0.1 * m^ / (sqrt(v^) + 1e-8) = 0.873366299.
        let o = opt(OptimizerKind::adam(), 0.1);
        let r = run(&o, &[0.5, -0.25]);
        close(r[0], 0.900000002);
        close(r[1], 0.8733662987);
        assert_eq!(o.slots(), 2);
    }

    #[test]
    fn adam_l2_and_adamw_decoupled() {
        // AdamW: p = 1 * (1 - 0.1 * 0.1) = 0.99, then the Adam step of 0.1: 0.89.
        let w = opt(
            OptimizerKind::AdamW {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.1,
            },
            0.1,
        );
        let r = run(&w, &[0.5, -0.25]);
        close(r[0], 0.890000002);
        close(r[1], 0.8544662987);
        // Adam with L2: the first step's size is lr whatever the gradient (m^/sqrt(v^) = 1).
        let l2 = opt(
            OptimizerKind::Adam {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.1,
            },
            0.1,
        );
        let r = run(&l2, &[0.5, -0.25]);
        close(r[0], 0.9000000017);
        close(r[1], 0.8544413675);
    }

    #[test]
    fn scale_is_applied_to_the_gradient_not_the_decay() {
        // Sync mode: mean of 4 gradients of 2.0 = scale 0.25 on the sum 8.0.
        let o = opt(OptimizerKind::sgd(), 0.1);
        let mut p = [1.0];
        let mut st = o.state(1);
        o.step(0.1, &mut p, &[8.0], 0.25, &mut st);
        close(p[0], 0.8);
        assert_eq!(st.t, 1);
    }

    #[test]
    fn schedules() {
        let lin = LrSchedule::Linear {
            lr: 1.0,
            end_lr: 0.0,
            steps: 10,
        };
        close(lin.at(0), 1.0);
        close(lin.at(5), 0.5);
        close(lin.at(10), 0.0);
        close(lin.at(1000), 0.0);
        let step = LrSchedule::Step {
            lr: 1.0,
            every: 3,
            gamma: 0.5,
        };
        close(step.at(2), 1.0);
        close(step.at(3), 0.5);
        close(step.at(7), 0.25);
        let cos = LrSchedule::Cosine {
            lr: 1.0,
            min_lr: 0.0,
            steps: 10,
        };
        close(cos.at(0), 1.0);
        close(cos.at(5), 0.5);
        // (1 + cos(0.3 pi)) / 2
        close(cos.at(3), 0.7938926261);
        close(cos.at(10), 0.0);
        let cos_min = LrSchedule::Cosine {
            lr: 1.0,
            min_lr: 0.2,
            steps: 4,
        };
        close(cos_min.at(2), 0.6);
        close(cos_min.at(9), 0.2);
    }

    #[test]
    fn the_norm_of_large_finite_gradients_does_not_overflow() {
        let clip = Clip {
            max_norm: Some(1.0),
            max_value: None,
        };
        let mut g = [3e19f32, 4e19, 0.0];
        let plan = clip.apply(&mut [&mut g[..]]);
        close(plan.norm as f32, 5e19);
        assert!(plan.scale > 0.0, "{plan:?}");
        close(g[0], 0.6);
        close(g[1], 0.8);
        assert_eq!(g[2], 0.0);
    }

    #[test]
    fn clip_by_norm_and_value() {
        // norm of [3, 4] is 5; factor 1 / (5 + 1e-6)
        let clip = Clip {
            max_norm: Some(1.0),
            max_value: None,
        };
        let mut a = vec![3.0f32];
        let mut b = vec![4.0f32];
        let plan = clip.apply(&mut [&mut a, &mut b]);
        close(plan.norm as f32, 5.0);
        close(a[0], 0.6);
        close(b[0], 0.8);
        // Below the bound: untouched.
        let mut c = vec![0.3f32, 0.4];
        clip.apply(&mut [&mut c]);
        assert_eq!(c, vec![0.3, 0.4]);
        // By value.
        let clip = Clip {
            max_norm: None,
            max_value: Some(2.0),
        };
        let mut g = vec![3.0f32, -4.0, 1.0];
        clip.apply(&mut [&mut g]);
        assert_eq!(g, vec![2.0, -2.0, 1.0]);
        // Both: values first ([2, -2, 1], norm 3), then the norm bound 1.5 halves them.
        let clip = Clip {
            max_norm: Some(1.5),
            max_value: Some(2.0),
        };
        let mut g = vec![3.0f32, -4.0, 1.0];
        let plan = clip.apply(&mut [&mut g]);
        close(plan.norm as f32, 3.0);
        close(g[0], 1.0);
        close(g[1], -1.0);
        close(g[2], 0.5);
    }

    #[test]
    fn invalid_configs_are_refused() {
        let bad = [
            OptimizerConfig::sgd(-1.0),
            OptimizerConfig::sgd(f32::NAN),
            OptimizerConfig {
                kind: OptimizerKind::Sgd {
                    momentum: 1.0,
                    nesterov: false,
                    weight_decay: 0.0,
                },
                ..OptimizerConfig::sgd(0.1)
            },
            OptimizerConfig {
                kind: OptimizerKind::Sgd {
                    momentum: 0.0,
                    nesterov: true,
                    weight_decay: 0.0,
                },
                ..OptimizerConfig::sgd(0.1)
            },
            OptimizerConfig {
                lr: LrSchedule::Cosine {
                    lr: 0.1,
                    min_lr: 0.0,
                    steps: 0,
                },
                ..OptimizerConfig::sgd(0.1)
            },
            OptimizerConfig {
                clip: Clip {
                    max_norm: Some(0.0),
                    max_value: None,
                },
                ..OptimizerConfig::sgd(0.1)
            },
        ];
        for cfg in bad {
            assert!(Optimizer::new(cfg.clone()).is_err(), "{cfg:?}");
        }
    }

    #[test]
    fn config_json_round_trip_and_defaults() {
        let cfg: OptimizerConfig = serde_json::from_str(
            r#"{"kind":{"type":"adamw"},"lr":{"type":"cosine","lr":0.001,"min_lr":0.0,"steps":100},"clip":{"max_norm":1.0}}"#,
        )
        .unwrap();
        assert_eq!(
            cfg.kind,
            OptimizerKind::AdamW {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01
            }
        );
        let json = serde_json::to_string(&cfg).unwrap();
        assert_eq!(serde_json::from_str::<OptimizerConfig>(&json).unwrap(), cfg);
        assert!(
            serde_json::from_str::<OptimizerConfig>(
                r#"{"kind":{"type":"rmsprop"},"lr":{"type":"constant","lr":1}}"#
            )
            .is_err()
        );
    }

    #[test]
    fn mismatched_state_is_reset_not_a_panic() {
        let o = opt(OptimizerKind::adam(), 0.1);
        let mut p = vec![1.0f32; 4];
        let mut st = SlotState {
            t: 7,
            slots: vec![0.0; 3],
        };
        o.step(0.1, &mut p, &[0.5; 4], 1.0, &mut st);
        assert_eq!(st.slots.len(), 8);
        assert_eq!(st.t, 1);
        close(p[0], 0.900000002);
    }
}
