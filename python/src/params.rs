//! `Params`: a trainer's parameters on the job's pservers, as NumPy float32 arrays.
//!
//! Declaring them (`Trainer._params`) is the one-trainer initialisation: exactly one
//! trainer of the job has its initial values installed, every other one waits and then
//! uses the installed values; each checks its declaration against what the pservers
//! hold. `pull` copies the dense values straight into NumPy arrays (one copy, as the
//! Rust trainers make into theirs); `pull_sparse` fetches rows by id; `push` sends the
//! gradients of a step, named by the task batch they come from, through the same
//! [`PsStore`](edl_trainer::PsStore) as the Rust trainers (sync steps, the async push in
//! the background, the ledger that keeps a task's updates exactly once). The GIL is
//! released while values move.

use std::collections::HashMap;
use std::sync::Arc;

use edl_trainer::model::{DenseParam, SparseGrad, SparseInit, SparseTable, StepOutput};
use edl_trainer::{InitOutcome, ParamInit, ParamStore};
use numpy::{PyArray1, PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::{PyKeyError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::task::Task;
use crate::trainer::{Inner, Trainer, store_error};
use crate::{block_on, value_error};

/// A trainer's parameters on the pservers.
#[pyclass(module = "edl._edl", frozen)]
#[derive(Debug)]
pub struct Params {
    trainer: Arc<Inner>,
    names: Vec<String>,
    shapes: Vec<Vec<usize>>,
    index: HashMap<String, usize>,
    /// Sparse tables: name -> values per row.
    tables: HashMap<String, usize>,
    initialised: bool,
}

/// A float32 array's values, or the error that names it.
fn f32_values<'py>(what: &str, a: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
    match a.cast::<PyArrayDyn<f32>>() {
        Ok(arr) => Ok(arr.clone()),
        Err(_) => {
            let dtype = a
                .getattr("dtype")
                .map(|d| d.to_string())
                .unwrap_or_else(|_| a.get_type().to_string());
            Err(PyTypeError::new_err(format!(
                "{what} must be a NumPy float32 array, not {dtype} (use .astype(numpy.float32))"
            )))
        }
    }
}

/// An array of row ids (any NumPy integer array or sequence of ints, non-negative).
fn row_ids(table: &str, ids: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Ok(a) = ids.cast::<PyArray1<u64>>() {
        return Ok(a.readonly().as_array().to_vec());
    }
    let signed: Vec<i64> = match ids.cast::<PyArray1<i64>>() {
        Ok(a) => a.readonly().as_array().to_vec(),
        Err(_) => ids.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "row ids of table {table:?} must be a 1-d integer array or a sequence of ints"
            ))
        })?,
    };
    signed
        .into_iter()
        .map(|i| {
            u64::try_from(i)
                .map_err(|_| value_error(format!("row id {i} of table {table:?} is negative")))
        })
        .collect()
}

impl Params {
    fn sparse_dim(&self, table: &str) -> PyResult<usize> {
        self.tables.get(table).copied().ok_or_else(|| {
            let mut known: Vec<&String> = self.tables.keys().collect();
            known.sort();
            PyKeyError::new_err(format!("no sparse table {table:?} (declared: {known:?})"))
        })
    }
}

#[pymethods]
impl Params {
    /// Whether this trainer's values initialised the job's parameters (exactly one
    /// trainer's did).
    #[getter]
    fn initialised(&self) -> bool {
        self.initialised
    }

    /// The dense parameters' names, in order.
    #[getter]
    fn names(&self) -> Vec<String> {
        self.names.clone()
    }

    /// The shape of dense parameter `name`.
    fn shape(&self, name: &str) -> PyResult<Vec<usize>> {
        let i = self
            .index
            .get(name)
            .ok_or_else(|| PyKeyError::new_err(format!("no dense parameter {name:?}")))?;
        Ok(self.shapes[*i].clone())
    }

    /// Pulls the dense parameters. Into the float32 arrays of `out` (by name, each of its
    /// parameter's size and C-contiguous) when given, else into new arrays; returns them
    /// by name.
    #[pyo3(signature = (out=None))]
    fn pull<'py>(
        &self,
        py: Python<'py>,
        out: Option<Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let out = match out {
            Some(d) => d,
            None => {
                let d = PyDict::new(py);
                for (name, shape) in self.names.iter().zip(&self.shapes) {
                    d.set_item(name, zeros(py, shape)?)?;
                }
                d
            }
        };
        let mut arrays = Vec::with_capacity(self.names.len());
        for (name, shape) in self.names.iter().zip(&self.shapes) {
            let a = out.get_item(name)?.ok_or_else(|| {
                PyKeyError::new_err(format!("out has no array for dense parameter {name:?}"))
            })?;
            let a = f32_values(&format!("out[{name:?}]"), &a)?;
            if !a.is_c_contiguous() {
                return Err(value_error(format!(
                    "out[{name:?}] must be C-contiguous (numpy.ascontiguousarray)"
                )));
            }
            let want: usize = shape.iter().product();
            if a.len() != want {
                return Err(value_error(format!(
                    "out[{name:?}] has {} values; the parameter has shape {shape:?} ({want})",
                    a.len()
                )));
            }
            arrays.push(a);
        }
        let mut guards = Vec::with_capacity(arrays.len());
        for (a, name) in arrays.iter().zip(&self.names) {
            guards.push(
                a.try_readwrite()
                    .map_err(|e| value_error(format!("out[{name:?}] cannot be written: {e}")))?,
            );
        }
        let mut slices = Vec::with_capacity(guards.len());
        for (g, name) in guards.iter_mut().zip(&self.names) {
            slices.push(
                g.as_slice_mut()
                    .map_err(|_| value_error(format!("out[{name:?}] must be C-contiguous")))?,
            );
        }
        let store = self.trainer.store.clone();
        let pulled = block_on(py, async move {
            let mut bad = None;
            let r = store
                .pull_dense_with(|i, values| match slices.get_mut(i) {
                    Some(dst) if dst.len() == values.len() => dst.copy_from_slice(values),
                    _ => bad = Some(i),
                })
                .await;
            (r, bad)
        })?;
        drop(guards);
        match pulled {
            (Err(e), _) => Err(store_error(e)),
            (Ok(()), Some(i)) => Err(value_error(format!(
                "the pservers hold a different parameter {i} than declared: declare the \
                 job's parameters as every trainer does"
            ))),
            (Ok(()), None) => Ok(out),
        }
    }

    /// Rows `ids` of sparse table `table`: a float32 array of shape `(len(ids), dim)`.
    fn pull_sparse<'py>(
        &self,
        py: Python<'py>,
        table: &str,
        ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let dim = self.sparse_dim(table)?;
        let ids = row_ids(table, ids)?;
        let n = ids.len();
        let store = self.trainer.store.clone();
        let t = table.to_owned();
        let values =
            block_on(py, async move { store.pull_rows(&t, &ids).await })?.map_err(store_error)?;
        Ok(PyArray1::from_vec(py, values).reshape([n, dim])?.into_any())
    }

    /// Pushes a step's gradients: `grads` has a float32 array for every dense parameter
    /// (by name, of its size); `sparse` maps a table to `(ids, values)` with values of
    /// shape `(len(ids), dim)`. `task`: the task the batch comes from (its updates are
    /// then kept exactly once however often it is retried); `loss`: the step's loss, for
    /// the report. Async mode returns once the push is handed off (the next push, a pull
    /// after `flush`, and the task's acknowledgement wait for it).
    #[pyo3(signature = (grads, *, sparse=None, task=None, loss=None))]
    fn push(
        &self,
        py: Python<'_>,
        grads: Bound<'_, PyDict>,
        sparse: Option<Bound<'_, PyDict>>,
        task: Option<PyRef<'_, Task>>,
        loss: Option<f32>,
    ) -> PyResult<()> {
        for key in grads.keys() {
            let k: String = key.extract()?;
            if !self.index.contains_key(&k) {
                return Err(PyKeyError::new_err(format!(
                    "gradient for {k:?}, which is not a declared dense parameter"
                )));
            }
        }
        let mut arrays = Vec::with_capacity(self.names.len());
        for (name, shape) in self.names.iter().zip(&self.shapes) {
            let g = grads.get_item(name)?.ok_or_else(|| {
                PyKeyError::new_err(format!("no gradient for dense parameter {name:?}"))
            })?;
            let g = f32_values(&format!("the gradient of {name:?}"), &g)?;
            let want: usize = shape.iter().product();
            if g.len() != want {
                return Err(value_error(format!(
                    "the gradient of {name:?} has shape {:?}; the parameter has shape {shape:?}",
                    g.shape()
                )));
            }
            arrays.push(g.readonly());
        }
        let mut sparse_grads = Vec::new();
        if let Some(sparse) = sparse {
            for (table, pair) in sparse.iter() {
                let table: String = table.extract()?;
                let dim = self.sparse_dim(&table)?;
                let (ids, values): (Bound<'_, PyAny>, Bound<'_, PyAny>) =
                    pair.extract().map_err(|_| {
                        PyTypeError::new_err(format!(
                            "sparse[{table:?}] must be a pair (ids, values)"
                        ))
                    })?;
                let rows = row_ids(&table, &ids)?;
                let values = f32_values(&format!("the sparse gradient of {table:?}"), &values)?;
                if values.len() != rows.len() * dim {
                    return Err(value_error(format!(
                        "the sparse gradient of {table:?} has shape {:?}; {} rows of {dim} \
                         values expected",
                        values.shape(),
                        rows.len()
                    )));
                }
                let values = values.readonly().as_array().iter().copied().collect();
                sparse_grads.push(SparseGrad {
                    table,
                    rows,
                    dim,
                    values,
                });
            }
        }
        let origin = task.as_ref().map(|t| t.next_origin()).transpose()?;
        // C-contiguous gradients are copied once, with the GIL released; others (a
        // transposed view, say) are read in their logical order first.
        let mut owned: Vec<Option<Vec<f32>>> = Vec::with_capacity(arrays.len());
        for a in &arrays {
            owned.push(match a.as_slice() {
                Ok(_) if a.is_c_contiguous() => None,
                _ => Some(a.as_array().iter().copied().collect()),
            });
        }
        let slices: Vec<&[f32]> = arrays
            .iter()
            .zip(&owned)
            .map(|(a, o)| match o {
                Some(v) => v.as_slice(),
                None => a.as_slice().unwrap_or_default(),
            })
            .collect();
        let inner = self.trainer.clone();
        let step = inner.steps().steps;
        let pushed = block_on(py, async move {
            let grads = StepOutput {
                loss: loss.unwrap_or(f32::NAN),
                examples: 0,
                dense: slices.iter().map(|s| s.to_vec()).collect(),
                sparse: sparse_grads,
            };
            if !grads.gradients_finite() {
                return Err(value_error(
                    "the gradients have a NaN or infinite value: not pushed (lower the \
                     learning rate, or skip the batch)",
                ));
            }
            inner
                .store
                .push_owned(inner.id(), step, origin, grads)
                .await
                .map_err(store_error)
        })?;
        drop(arrays);
        pushed?;
        self.trainer.steps().pushed(loss);
        Ok(())
    }

    /// Waits until every push made so far is applied (the next pull is then fresh).
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let store = self.trainer.store.clone();
        block_on(py, async move { store.flush().await })?.map_err(store_error)
    }
}

/// A new float32 array of zeros of `shape`.
fn zeros<'py>(py: Python<'py>, shape: &[usize]) -> PyResult<Bound<'py, PyAny>> {
    let n: usize = shape.iter().product();
    Ok(PyArray1::from_vec(py, vec![0f32; n])
        .reshape(shape.to_vec())?
        .into_any())
}

/// Declares a model's parameters (`dense`: name -> float32 array of initial values;
/// `sparse`: name -> `(rows, dim, init_bound)`, rows starting uniform in
/// `[-init_bound, init_bound)`, or zeros for 0) and makes sure the job's pservers hold
/// them: the one-trainer initialisation. The order of `dense` is the parameters' order.
/// In evaluate mode the declaration is only checked.
pub(crate) fn declare(
    trainer: &Trainer,
    py: Python<'_>,
    dense: Bound<'_, PyDict>,
    sparse: Option<Bound<'_, PyDict>>,
) -> PyResult<Params> {
    let mut init = ParamInit::default();
    for (name, value) in dense.iter() {
        let name: String = name.extract()?;
        let a = f32_values(&format!("the initial value of {name:?}"), &value)?;
        let shape = a.shape().to_vec();
        let values: Vec<f32> = a.readonly().as_array().iter().copied().collect();
        if values.iter().any(|v| !v.is_finite()) {
            return Err(value_error(format!(
                "the initial value of {name:?} has a NaN or infinite value"
            )));
        }
        init.dense.push(DenseParam { name, shape });
        init.values.push(values);
    }
    if let Some(sparse) = sparse {
        for (name, spec) in sparse.iter() {
            let name: String = name.extract()?;
            let (rows, dim, bound): (u64, usize, f32) = spec.extract().map_err(|_| {
                PyTypeError::new_err(format!("sparse[{name:?}] must be (rows, dim, init_bound)"))
            })?;
            if dim == 0 || !bound.is_finite() || bound < 0.0 {
                return Err(value_error(format!(
                    "sparse[{name:?}]: dim must be positive and init_bound a finite \
                         number >= 0"
                )));
            }
            let init_rows = if bound == 0.0 {
                SparseInit::Zeros
            } else {
                SparseInit::Uniform { bound }
            };
            init.sparse.push(SparseTable {
                name,
                rows,
                dim,
                init: init_rows,
            });
        }
    }
    if init.dense.is_empty() && init.sparse.is_empty() {
        return Err(value_error("declare at least one parameter"));
    }
    let inner = trainer.inner.clone();
    let evaluate = inner.evaluating();
    let decl = init.clone();
    let (outcome, layout) = block_on(py, async move {
        let outcome = if evaluate {
            // The parameters exist (the job trained); the first pull learns them.
            inner.store.pull_dense_with(|_, _| {}).await?;
            InitOutcome::AlreadyInitialised
        } else {
            let outcome = inner.store.init(inner.id(), &decl).await?;
            // Sync mode: not taking part in steps until the first push.
            if let Err(e) = inner.store.idle(inner.id()).await {
                tracing::warn!(error = %e, "could not leave the sync steps");
            }
            outcome
        };
        Ok::<_, edl_trainer::StoreError>((outcome, inner.store.dense_layout().await))
    })?
    .map_err(store_error)?;
    let declared: Vec<(String, Vec<usize>)> = init
        .dense
        .iter()
        .map(|p| (p.name.clone(), p.shape.clone()))
        .collect();
    if !declared.is_empty() && layout != declared {
        return Err(value_error(format!(
            "declared dense parameters {declared:?}, but the job's pservers hold \
                 {layout:?}: every trainer of a job declares the same parameters in the same \
                 order"
        )));
    }
    if outcome == InitOutcome::Initialised {
        trainer.inner.steps().initialised = true;
    }
    Ok(Params {
        trainer: trainer.inner.clone(),
        index: init
            .dense
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.clone(), i))
            .collect(),
        names: init.dense.iter().map(|p| p.name.clone()).collect(),
        shapes: init.dense.iter().map(|p| p.shape.clone()).collect(),
        tables: init
            .sparse
            .iter()
            .map(|t| (t.name.clone(), t.dim))
            .collect(),
        initialised: outcome == InitOutcome::Initialised,
    })
}
