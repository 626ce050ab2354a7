//! The update rules on plain slices: [`Optimizer`] (a validated configuration) applies
//! one update to a slice with its [`SlotState`] (momentum buffers, sums of squares,
//! first and second moments, and the update count `t`). A state of the wrong size
//! (another optimizer's) is reset, never a panic.

use super::{ConfigError, OptimizerConfig, OptimizerKind};

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
    use crate::optim::close;
    use crate::optim::{Clip, LrSchedule};

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
