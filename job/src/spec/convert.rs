//! The spec's training settings as the description the pservers apply
//! ([`crate::optim`]): the one place the spec's names (`optimizer = "adam"`,
//! `lr_schedule = "cosine"`, `mode = "sync"` and their flat parameters) map onto
//! [`OptimizerConfig`] and [`Mode`].

use super::{ModeName, OptimizerName, ScheduleName, TrainSpec};
use crate::optim::{Clip, LrSchedule, Mode, OptimizerConfig, OptimizerKind};

impl TrainSpec {
    /// The optimizer: rule and hyper-parameters, schedule, clipping.
    pub fn optimizer_config(&self) -> OptimizerConfig {
        let kind = match self.optimizer {
            OptimizerName::Sgd => OptimizerKind::Sgd {
                momentum: 0.0,
                nesterov: false,
                weight_decay: self.weight_decay,
            },
            OptimizerName::Momentum => OptimizerKind::Sgd {
                momentum: self.momentum,
                nesterov: self.nesterov,
                weight_decay: self.weight_decay,
            },
            OptimizerName::Adagrad => OptimizerKind::Adagrad {
                eps: 1e-10,
                initial_accumulator: 0.0,
                weight_decay: self.weight_decay,
            },
            OptimizerName::Adam => match OptimizerKind::adam() {
                OptimizerKind::Adam {
                    beta1, beta2, eps, ..
                } => OptimizerKind::Adam {
                    beta1,
                    beta2,
                    eps,
                    weight_decay: self.weight_decay,
                },
                other => other,
            },
            OptimizerName::Adamw => match OptimizerKind::adam() {
                OptimizerKind::Adam {
                    beta1, beta2, eps, ..
                } => OptimizerKind::AdamW {
                    beta1,
                    beta2,
                    eps,
                    weight_decay: if self.weight_decay > 0.0 {
                        self.weight_decay
                    } else {
                        0.01
                    },
                },
                other => other,
            },
        };
        let lr = self.learning_rate;
        let lr = match self.lr_schedule {
            ScheduleName::Constant => LrSchedule::constant(lr),
            ScheduleName::Linear => LrSchedule::Linear {
                lr,
                end_lr: self.lr_end,
                steps: self.lr_decay_steps,
            },
            ScheduleName::Step => LrSchedule::Step {
                lr,
                every: self.lr_decay_steps,
                gamma: self.lr_gamma,
            },
            ScheduleName::Cosine => LrSchedule::Cosine {
                lr,
                min_lr: self.lr_end,
                steps: self.lr_decay_steps,
            },
        };
        OptimizerConfig {
            kind,
            lr,
            clip: Clip {
                max_norm: self.clip_norm,
                max_value: self.clip_value,
            },
        }
    }

    /// How the pservers apply updates.
    pub fn mode(&self) -> Mode {
        match self.mode {
            ModeName::Async => Mode::Async,
            ModeName::Sync => Mode::Sync {
                step_timeout_ms: self.step_timeout.as_millis().min(u128::from(u64::MAX)) as u64,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::JobSpec;

    #[test]
    fn names_map_onto_the_description() {
        let spec = JobSpec::parse_toml(
            "name = \"w\"\n[data]\ntrain = \"/d/*.recordio\"\n[model]\nkind = \"fit_a_line\"\n\
             [train]\nmode = \"sync\"\noptimizer = \"adamw\"\nlr_schedule = \"cosine\"\n\
             learning_rate = 0.1\nlr_decay_steps = 10\nclip_norm = 1.0\n",
        )
        .expect("valid");
        assert!(spec.train.mode().is_sync());
        let o = spec.train.optimizer_config();
        assert!(
            matches!(o.kind, OptimizerKind::AdamW { weight_decay, .. } if weight_decay == 0.01)
        );
        assert_eq!(
            o.lr,
            LrSchedule::Cosine {
                lr: 0.1,
                min_lr: 0.0,
                steps: 10
            }
        );
        assert_eq!(o.clip.max_norm, Some(1.0));
        assert!(o.validate().is_ok());
    }
}
