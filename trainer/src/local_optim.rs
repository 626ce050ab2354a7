//! `local_optim`: the parameter servers' optimizers ([`edl_pserver_client::Optimizer`]) applied
//! in process, for the single-process baseline ([`crate::train_local`]) and the
//! in-process [`crate::LocalStore`].
//!
//! In a distributed job the parameter servers own the optimizers and their state; here
//! the same update rules run over a [`Params`] in place, so a local run and a job with
//! one trainer apply identical math. State is kept per dense parameter and per sparse
//! row: a row's moments and step count advance only when the row has a gradient ("lazy"
//! updates, as on the pservers).

use std::collections::HashMap;

use edl_pserver_client::{LrSchedule, Optimizer, OptimizerConfig, OptimizerKind, SlotState};

use crate::error::{Error, Result};
use crate::model::{Params, StepOutput};

/// An optimizer with its state, for one [`Params`].
#[derive(Debug, Clone)]
pub struct LocalOptimizer {
    optimizer: Optimizer,
    /// Updates applied so far (the learning-rate schedule's step).
    step: u64,
    dense: Vec<SlotState>,
    sparse: HashMap<String, HashMap<u64, SlotState>>,
}

impl LocalOptimizer {
    /// A fresh `kind` optimizer with the constant learning rate `lr`.
    pub fn new(kind: OptimizerKind, lr: f32) -> Result<Self> {
        if !(lr.is_finite() && lr > 0.0) {
            return Err(Error::Config(format!(
                "learning rate must be positive, got {lr}"
            )));
        }
        Self::with_config(OptimizerConfig {
            kind,
            lr: LrSchedule::constant(lr),
            clip: Default::default(),
        })
    }

    /// A fresh optimizer of any configuration the pservers accept.
    pub fn with_config(cfg: OptimizerConfig) -> Result<Self> {
        let optimizer = Optimizer::new(cfg).map_err(|e| Error::Config(e.to_string()))?;
        Ok(LocalOptimizer {
            optimizer,
            step: 0,
            dense: Vec::new(),
            sparse: HashMap::new(),
        })
    }

    /// Whether its rule is additive ([`OptimizerConfig::is_additive`]).
    pub fn is_additive(&self) -> bool {
        self.optimizer.config().is_additive()
    }

    /// Applies one step's gradients to `params`. Every sparse row with a gradient must
    /// be in `params`; nothing is changed when a gradient does not fit its parameter.
    pub fn step(&mut self, params: &mut Params, grads: &StepOutput) -> Result<()> {
        check(params, grads)?;
        let lr = self.optimizer.lr(self.step);
        self.step += 1;
        let opt = &self.optimizer;
        self.dense
            .resize_with(params.dense.len(), SlotState::default);
        for ((p, g), state) in params
            .dense
            .iter_mut()
            .zip(&grads.dense)
            .zip(&mut self.dense)
        {
            opt.step(lr, p, g, 1.0, state);
        }
        for sg in &grads.sparse {
            let states = self.sparse.entry(sg.table.clone()).or_default();
            if let Some(table) = params.sparse.get_mut(&sg.table) {
                for (i, row) in sg.rows.iter().enumerate() {
                    if let (Some(p), Some(g)) = (table.get_mut(*row), sg.row(i)) {
                        opt.step(lr, p, g, 1.0, states.entry(*row).or_default());
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
        params.rows(&sg.table, &sg.rows, sg.dim)?;
    }
    Ok(())
}
