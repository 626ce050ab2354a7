//! `local_optim`: minimal SGD and Adam for the single-process baseline
//! ([`crate::train_local`]).
//!
//! In a distributed job the parameter server owns the optimizers and their state; these
//! exist only so the local trainer (tests, benchmarks, the throughput baseline) can
//! train without one. They update [`Params`] in place from a [`StepOutput`]:
//!
//! - SGD: `p -= lr * g`.
//! - Adam (Kingma & Ba 2015): `m = b1 m + (1 - b1) g`, `v = b2 v + (1 - b2) g^2`,
//!   `p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)`. Sparse rows use
//!   "lazy" Adam: each row keeps its own moments and step count, updated only when the
//!   row has a gradient.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::model::{Params, StepOutput};

/// Which optimizer the local trainer uses.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum OptimizerKind {
    /// Plain stochastic gradient descent.
    Sgd,
    /// Adam.
    Adam {
        /// Decay of the first moment (0.9).
        beta1: f32,
        /// Decay of the second moment (0.999).
        beta2: f32,
        /// Added to the root of the second moment (1e-8).
        epsilon: f32,
    },
}

impl OptimizerKind {
    /// Adam with the usual constants (0.9, 0.999, 1e-8).
    pub fn adam() -> Self {
        OptimizerKind::Adam {
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
        }
    }

    pub(crate) fn check(&self) -> Result<()> {
        if let OptimizerKind::Adam {
            beta1,
            beta2,
            epsilon,
        } = *self
        {
            let unit = |b: f32| (0.0..1.0).contains(&b);
            if !(unit(beta1) && unit(beta2) && epsilon.is_finite() && epsilon > 0.0) {
                return Err(Error::Config(format!(
                    "adam needs 0 <= beta1, beta2 < 1 and epsilon > 0, got {beta1}, {beta2}, {epsilon}"
                )));
            }
        }
        Ok(())
    }
}

/// Adam moments of one tensor or row.
#[derive(Debug, Clone, Default)]
struct Moments {
    m: Vec<f32>,
    v: Vec<f32>,
    /// Updates applied so far.
    t: i32,
}

impl Moments {
    fn apply(&mut self, p: &mut [f32], g: &[f32], lr: f32, b1: f32, b2: f32, eps: f32) {
        if self.m.len() != p.len() {
            self.m = vec![0.0; p.len()];
            self.v = vec![0.0; p.len()];
            self.t = 0;
        }
        self.t = self.t.saturating_add(1);
        let lr_t = lr * (1.0 - b2.powi(self.t)).sqrt() / (1.0 - b1.powi(self.t));
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(&mut self.m).zip(&mut self.v) {
            *m = b1 * *m + (1.0 - b1) * g;
            *v = b2 * *v + (1.0 - b2) * g * g;
            *p -= lr_t * *m / (v.sqrt() + eps);
        }
    }
}

/// An optimizer with its state, for one [`Params`].
#[derive(Debug, Clone)]
pub struct LocalOptimizer {
    kind: OptimizerKind,
    lr: f32,
    dense: Vec<Moments>,
    sparse: HashMap<String, HashMap<u64, Moments>>,
}

impl LocalOptimizer {
    /// A fresh optimizer with learning rate `lr`.
    pub fn new(kind: OptimizerKind, lr: f32) -> Result<Self> {
        kind.check()?;
        if !(lr.is_finite() && lr > 0.0) {
            return Err(Error::Config(format!(
                "learning rate must be positive, got {lr}"
            )));
        }
        Ok(LocalOptimizer {
            kind,
            lr,
            dense: Vec::new(),
            sparse: HashMap::new(),
        })
    }

    /// Applies one step's gradients to `params`. Every sparse row with a gradient must
    /// be in `params`; nothing is changed when a gradient does not fit its parameter.
    pub fn step(&mut self, params: &mut Params, grads: &StepOutput) -> Result<()> {
        check(params, grads)?;
        let lr = self.lr;
        match self.kind {
            OptimizerKind::Sgd => {
                for (p, g) in params.dense.iter_mut().zip(&grads.dense) {
                    sgd(p, g, lr);
                }
                for sg in &grads.sparse {
                    if let Some(table) = params.sparse.get_mut(&sg.table) {
                        for (i, row) in sg.rows.iter().enumerate() {
                            if let (Some(p), Some(g)) = (table.get_mut(row), sg.row(i)) {
                                sgd(p, g, lr);
                            }
                        }
                    }
                }
            }
            OptimizerKind::Adam {
                beta1,
                beta2,
                epsilon,
            } => {
                self.dense.resize_with(params.dense.len(), Moments::default);
                for ((p, g), state) in params
                    .dense
                    .iter_mut()
                    .zip(&grads.dense)
                    .zip(&mut self.dense)
                {
                    state.apply(p, g, lr, beta1, beta2, epsilon);
                }
                for sg in &grads.sparse {
                    let states = self.sparse.entry(sg.table.clone()).or_default();
                    if let Some(table) = params.sparse.get_mut(&sg.table) {
                        for (i, row) in sg.rows.iter().enumerate() {
                            if let (Some(p), Some(g)) = (table.get_mut(row), sg.row(i)) {
                                states
                                    .entry(*row)
                                    .or_default()
                                    .apply(p, g, lr, beta1, beta2, epsilon);
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// Checks that every gradient fits its parameter.
fn check(params: &Params, grads: &StepOutput) -> Result<()> {
    if grads.dense.len() != params.dense.len() {
        return Err(Error::Config(format!(
            "{} dense gradients for {} dense parameters",
            grads.dense.len(),
            params.dense.len()
        )));
    }
    for (i, (g, p)) in grads.dense.iter().zip(&params.dense).enumerate() {
        if g.len() != p.len() {
            return Err(Error::Config(format!(
                "dense gradient {i} has {} values, its parameter {}",
                g.len(),
                p.len()
            )));
        }
    }
    for sg in &grads.sparse {
        if sg.values.len() != sg.rows.len() * sg.dim {
            return Err(Error::Config(format!(
                "sparse gradient of {} has {} values for {} rows of {}",
                sg.table,
                sg.values.len(),
                sg.rows.len(),
                sg.dim
            )));
        }
        let table = params.sparse.get(&sg.table);
        for &row in &sg.rows {
            let p = table
                .and_then(|t| t.get(&row))
                .ok_or_else(|| Error::MissingSparseRow {
                    table: sg.table.clone(),
                    row,
                })?;
            if p.len() != sg.dim {
                return Err(Error::SparseRowWidth {
                    table: sg.table.clone(),
                    row,
                    found: p.len(),
                    expected: sg.dim,
                });
            }
        }
    }
    Ok(())
}

fn sgd(p: &mut [f32], g: &[f32], lr: f32) {
    for (p, g) in p.iter_mut().zip(g) {
        *p -= lr * g;
    }
}
