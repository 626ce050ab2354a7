//! `edl._edl`: the native module of the `edl` Python package, on the Rust core.
//!
//! - `trainer.rs`: `Trainer` (joining a job under a lease, its task stream, draining on
//!   SIGTERM, leaving with the report; the evaluation mode of `edl run`), over
//!   [`edl_trainer::process::Member`] and [`edl_trainer::Tasks`]: the same code paths as
//!   the Rust trainers.
//! - `task.rs`: `Task`, a leased task's records, acknowledged only when the training loop
//!   says so.
//! - `params.rs`: `Params`, the pserver client for NumPy float32 arrays, over
//!   [`edl_trainer::PsStore`].
//! - `samples.rs`: records decoded as edl `Sample`s into NumPy arrays.
//!
//! Every call that waits (on etcd, the master, the pservers) releases the GIL and runs on
//! one tokio runtime of the module's own. The pure-Python part of the package (the
//! iterators, the PyTorch adapter) is `python/edl/`; the stubs are `edl/_edl.pyi`.

use std::future::Future;
use std::sync::OnceLock;

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

mod params;
mod samples;
mod task;
mod trainer;

create_exception!(
    edl,
    EdlError,
    PyException,
    "An edl operation failed: the job, etcd, the master or the pservers."
);
create_exception!(
    edl,
    ConnectError,
    EdlError,
    "etcd, the master or the pservers could not be reached."
);
create_exception!(
    edl,
    LeaseLostError,
    EdlError,
    "etcd ended this trainer's lease; the master gave its tasks to others."
);

/// The module's runtime, and the process that made it.
struct Runtime {
    rt: tokio::runtime::Runtime,
    pid: u32,
}

static RUNTIME: OnceLock<Result<Runtime, String>> = OnceLock::new();

/// The module's tokio runtime (two worker threads: the waits and the background pushes
/// and acknowledgements; the math is the caller's). A forked child (a DataLoader
/// worker started by fork) cannot use the parent's runtime: that is a clear error.
fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    let made = RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("edl")
            .enable_all()
            .build()
            .map(|rt| Runtime {
                rt,
                pid: std::process::id(),
            })
            .map_err(|e| e.to_string())
    });
    match made {
        Ok(r) if r.pid == std::process::id() => Ok(&r.rt),
        Ok(_) => Err(PyRuntimeError::new_err(
            "edl was started in a parent process and cannot be used in a forked child \
             (a DataLoader worker started by fork): use edl objects in the process that \
             made them (edl.torch.TaskDataset hands the records to its workers)",
        )),
        Err(e) => Err(PyRuntimeError::new_err(format!("start edl's runtime: {e}"))),
    }
}

/// Runs `fut` to completion on the module's runtime with the GIL released.
fn block_on<F>(py: Python<'_>, fut: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let rt = runtime()?;
    Ok(py.detach(|| rt.block_on(fut)))
}

/// A bad argument: `ValueError` with the message.
fn value_error(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}

#[pymodule]
fn _edl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("EdlError", py.get_type::<EdlError>())?;
    m.add("ConnectError", py.get_type::<ConnectError>())?;
    m.add("LeaseLostError", py.get_type::<LeaseLostError>())?;
    m.add_class::<trainer::Trainer>()?;
    m.add_class::<task::Task>()?;
    m.add_class::<params::Params>()?;
    m.add_function(wrap_pyfunction!(samples::decode_samples, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
