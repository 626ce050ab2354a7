//! `Task`: a task leased to a Python trainer — its records (as `bytes`, or decoded into
//! NumPy arrays), the origin of each push made for it, and how its training went (`done`,
//! `hand_back`, `fail`), said through the trainer's [`edl_trainer::Tasks`].

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use edl_master_client::task::LeasedTask;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::trainer::{Inner, runtime_error};
use crate::{EdlError, block_on, value_error};

/// A leased task: its records, and how its training went.
#[pyclass(module = "edl._edl", frozen)]
#[derive(Debug)]
pub struct Task {
    trainer: Arc<Inner>,
    task: LeasedTask,
    records: Arc<Vec<Vec<u8>>>,
    started: Instant,
    /// The next push's number within the task (its ledger origin).
    seq: AtomicU32,
    /// Records trained so far (`mark_trained`).
    trained: AtomicU64,
    ended: Mutex<Option<&'static str>>,
}

impl Task {
    /// Task `task` with its `records`, leased to `trainer` now.
    pub(crate) fn new(trainer: Arc<Inner>, task: LeasedTask, records: Vec<Vec<u8>>) -> Task {
        trainer.in_hand.fetch_add(1, Ordering::SeqCst);
        Task {
            trainer,
            task,
            records: Arc::new(records),
            started: Instant::now(),
            seq: AtomicU32::new(0),
            trained: AtomicU64::new(0),
            ended: Mutex::new(None),
        }
    }

    /// The origin of the task's next push: (pass, task index, push number).
    pub(crate) fn next_origin(&self) -> PyResult<edl_pserver_client::Origin> {
        if let Some(how) = *self.ended.lock().unwrap_or_else(PoisonError::into_inner) {
            return Err(value_error(format!(
                "task {} was already {how}: push with the task being trained",
                self.task.id
            )));
        }
        Ok(edl_pserver_client::Origin {
            pass: self.task.pass,
            task: self.task.index,
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
            count: 1,
        })
    }

    /// Marks the task ended `how`, or says it already was.
    fn end(&self, how: &'static str) -> PyResult<()> {
        let mut ended = self.ended.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(before) = *ended {
            return Err(value_error(format!(
                "task {} was already {before}",
                self.task.id
            )));
        }
        *ended = Some(how);
        self.trainer.in_hand.fetch_sub(1, Ordering::SeqCst);
        Ok(())
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        // A task dropped unended (the program lost it) is not being trained any more;
        // the master requeues it when this trainer's registration ends.
        let ended = self.ended.get_mut().unwrap_or_else(PoisonError::into_inner);
        if ended.is_none() {
            self.trainer.in_hand.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

#[pymethods]
impl Task {
    /// The task's id (`<file>-<first chunk>-<end chunk>`: the same in every pass).
    #[getter]
    fn id(&self) -> String {
        self.task.id.to_string()
    }

    /// The pass it belongs to.
    #[getter]
    fn pass_(&self) -> u32 {
        self.task.pass
    }

    /// Its index among the pass's tasks.
    #[getter]
    fn index(&self) -> u32 {
        self.task.index
    }

    /// The RecordIO file its chunks are in.
    #[getter]
    fn path(&self) -> &str {
        &self.task.path
    }

    /// Records trained so far (`mark_trained`).
    #[getter]
    fn trained(&self) -> u64 {
        self.trained.load(Ordering::Relaxed)
    }

    /// `None` while it is being trained; then `done`, `handed back` or `failed`.
    #[getter]
    fn ended(&self) -> Option<&'static str> {
        *self.ended.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn __len__(&self) -> usize {
        self.records.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "<edl.Task {} pass {} index {}: {} records of {}>",
            self.task.id,
            self.task.pass,
            self.task.index,
            self.records.len(),
            self.task.path
        )
    }

    /// The records, in file order, as `bytes`; `start`/`stop` select a slice.
    #[pyo3(signature = (start=0, stop=None))]
    fn records<'py>(
        &self,
        py: Python<'py>,
        start: usize,
        stop: Option<usize>,
    ) -> PyResult<Bound<'py, PyList>> {
        let n = self.records.len();
        let stop = stop.unwrap_or(n).min(n);
        let start = start.min(stop);
        PyList::new(
            py,
            self.records[start..stop]
                .iter()
                .map(|r| PyBytes::new(py, r)),
        )
    }

    /// The records `start..stop` decoded as edl `Sample`s into NumPy arrays (see
    /// `edl.decode_samples`).
    #[pyo3(signature = (start=0, stop=None))]
    fn samples<'py>(
        &self,
        py: Python<'py>,
        start: usize,
        stop: Option<usize>,
    ) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let n = self.records.len();
        let stop = stop.unwrap_or(n).min(n);
        let start = start.min(stop);
        crate::samples::decode(py, &self.records[start..stop])
    }

    /// Counts `n` more records as trained (what a hand-back reports).
    fn mark_trained(&self, n: u64) {
        self.trained.fetch_add(n, Ordering::Relaxed);
    }

    /// Every record was trained: acknowledged once its pushes are applied (in the
    /// background, while the next task trains).
    fn done(&self, py: Python<'_>) -> PyResult<()> {
        self.end("done")?;
        let (inner, task, n, started) = (
            self.trainer.clone(),
            self.task.clone(),
            self.records.len() as u64,
            self.started,
        );
        block_on(py, async move {
            let mut st = inner.lock_state().await;
            let Some(tasks) = st.tasks.as_mut() else {
                return Err(EdlError::new_err("the trainer was closed"));
            };
            tasks
                .trained(task, n, started)
                .await
                .map_err(runtime_error)?;
            let mut p = tasks.progress().clone();
            inner.steps().merge_into(&mut p);
            if let Some(m) = &st.member {
                m.progress().send_replace(p);
            }
            Ok(())
        })?
    }

    /// Hands the task back (a drain): whoever gets it trains it from where this attempt
    /// started (the batches of a program's own loop are its own, so which were applied
    /// cannot be said; those already applied count nothing again on the shards).
    fn hand_back(&self, py: Python<'_>) -> PyResult<()> {
        self.end("handed back")?;
        let (inner, task, n) = (
            self.trainer.clone(),
            self.task.clone(),
            self.trained.load(Ordering::Relaxed),
        );
        block_on(py, async move {
            let mut st = inner.lock_state().await;
            let Some(tasks) = st.tasks.as_mut() else {
                return Err(EdlError::new_err("the trainer was closed"));
            };
            tasks.hand_back(&task, n, None).await.map_err(runtime_error)
        })?
    }

    /// Fails the task for `reason` (its data cannot be trained); the master retries it
    /// up to the job's `max_failures`.
    fn fail(&self, py: Python<'_>, reason: &str) -> PyResult<()> {
        self.end("failed")?;
        let (inner, task, n, reason) = (
            self.trainer.clone(),
            self.task.clone(),
            self.trained.load(Ordering::Relaxed),
            reason.to_owned(),
        );
        block_on(py, async move {
            let mut st = inner.lock_state().await;
            let Some(tasks) = st.tasks.as_mut() else {
                return Err(EdlError::new_err("the trainer was closed"));
            };
            tasks.fail(&task, &reason, n).await.map_err(runtime_error)
        })?
    }
}
