//! Gradient clipping of one trainer step: [`Clip`] (by value, then by global L2 norm)
//! computes a [`ClipPlan`] over every gradient of the step, and the plan transforms
//! values. The client clips before it pushes, so each shard sees already-clipped
//! gradients and no cross-shard norm is needed.

use serde::{Deserialize, Serialize};

use super::ConfigError;
use super::config::positive;

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
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::close;

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
}
