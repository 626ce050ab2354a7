//! The serde form of an optimizer ([`OptimizerConfig`]: rule, schedule, clipping) and
//! its validation: the update rules and their hyper-parameters ([`OptimizerKind`], with
//! PyTorch's defaults), the learning-rate schedules ([`LrSchedule`]), and
//! [`ConfigError`] for a refused configuration. A configuration is validated once, when
//! the pservers build their optimizer from it (`edl_pserver_client::Optimizer`).

use serde::{Deserialize, Serialize};

use super::Clip;

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

pub(super) fn positive(name: &str, v: f32) -> Result<(), ConfigError> {
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

    /// Whether the rule keeps no state: plain SGD (weight decay aside, no momentum), whose
    /// update of a gradient is the same whoever applies it and in whatever order. A
    /// trainer may then apply its own gradients locally and have the pservers' update
    /// of them match exactly (see the trainer's pipeline).
    pub fn is_stateless(&self) -> bool {
        matches!(*self, OptimizerKind::Sgd { momentum, .. } if momentum == 0.0)
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

    /// Whether one update with the sum of several steps' gradients equals those steps'
    /// updates one after another, up to rounding: plain SGD (no momentum, no weight
    /// decay) at a constant rate, with no clipping. A trainer running such a rule locally
    /// on its batches then holds what the pservers hold once they applied its sums.
    pub fn is_additive(&self) -> bool {
        matches!(
            self.kind,
            OptimizerKind::Sgd {
                momentum,
                weight_decay,
                ..
            } if momentum == 0.0 && weight_decay == 0.0
        ) && matches!(self.lr, LrSchedule::Constant { .. })
            && self.clip == Clip::default()
    }

    /// Checks every hyper-parameter.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.kind.validate()?;
        self.lr.validate()?;
        self.clip.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::close;

    #[test]
    fn only_plain_sgd_at_a_constant_rate_without_clipping_is_additive() {
        assert!(OptimizerConfig::sgd(0.1).is_additive());
        assert!(!OptimizerConfig::adam(0.1).is_additive());
        let with = |f: &dyn Fn(&mut OptimizerConfig)| {
            let mut c = OptimizerConfig::sgd(0.1);
            f(&mut c);
            c.is_additive()
        };
        assert!(!with(&|c| c.kind = OptimizerKind::Sgd {
            momentum: 0.9,
            nesterov: false,
            weight_decay: 0.0,
        }));
        assert!(!with(&|c| c.kind = OptimizerKind::Sgd {
            momentum: 0.0,
            nesterov: false,
            weight_decay: 1e-4,
        }));
        assert!(!with(&|c| c.lr = LrSchedule::Step {
            lr: 0.1,
            every: 10,
            gamma: 0.5,
        }));
        assert!(!with(&|c| c.clip.max_norm = Some(1.0)));
        assert!(!with(&|c| c.clip.max_value = Some(1.0)));
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
            assert!(cfg.validate().is_err(), "{cfg:?}");
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
}
