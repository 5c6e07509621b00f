//! The Python exceptions and the one conversion point from `EngineError`
//! to them (`to_py`), as polars' `error.rs` does it.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use crate::error::EngineError;

// ---- exceptions: built at import with multiple bases (OSError, TimeoutError).

static BASE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static POOL_EXHAUSTED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static CORRUPT_CHUNK: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static STORE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static BACKEND_UNAVAILABLE: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn make_type(py: Python<'_>, name: &str, bases: Vec<Bound<'_, PyAny>>, doc: &str) -> PyResult<Py<PyType>> {
    let builtins = py.import("builtins")?;
    let dict = PyDict::new(py);
    dict.set_item("__module__", "pykvcache._core")?;
    dict.set_item("__doc__", doc)?;
    let t = builtins.getattr("type")?.call1((name, PyTuple::new(py, bases)?, dict))?;
    Ok(t.cast_into::<PyType>()?.unbind())
}

fn exc<'py>(py: Python<'py>, cell: &PyOnceLock<Py<PyType>>) -> Bound<'py, PyType> {
    cell.get(py).expect("pykvcache._core exceptions not initialised").bind(py).clone()
}

/// The one conversion point from engine errors to Python exceptions.
pub(super) fn to_py(err: EngineError) -> PyErr {
    Python::attach(|py| {
        let msg = err.to_string();
        let build = |t: Bound<'_, PyType>, args: Bound<'_, PyTuple>| match t.call1(args) {
            Ok(v) => PyErr::from_value(v),
            Err(e) => e,
        };
        match &err {
            EngineError::PoolExhausted { .. } | EngineError::QueueFull { .. } | EngineError::SealBuffersBusy { .. } => {
                build(exc(py, &POOL_EXHAUSTED), PyTuple::new(py, [msg]).unwrap())
            }
            EngineError::Corrupt { .. } => build(exc(py, &CORRUPT_CHUNK), PyTuple::new(py, [msg]).unwrap()),
            EngineError::Io { source, .. } => {
                let errno = source.raw_os_error().unwrap_or(0);
                build(exc(py, &STORE_ERROR), (errno, msg).into_pyobject(py).unwrap())
            }
            EngineError::BackendUnavailable(_) => build(exc(py, &BACKEND_UNAVAILABLE), PyTuple::new(py, [msg]).unwrap()),
            EngineError::InvalidArgument(_) => PyValueError::new_err(msg),
            EngineError::State(_) => build(exc(py, &BASE_ERROR), PyTuple::new(py, [msg]).unwrap()),
        }
    })
}

/// Builds the exception types (several have two bases, which `create_exception!`
/// cannot express) and adds them to the module.
pub(super) fn add_exceptions(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let builtins = py.import("builtins")?;
    let exception = builtins.getattr("Exception")?;
    let base = make_type(py, "PykvcacheError", vec![exception], "Base class of every error raised by the engine.")?;
    let b = base.bind(py).clone().into_any();
    let pool_exhausted = make_type(
        py,
        "PoolExhausted",
        vec![b.clone(), builtins.getattr("TimeoutError")?],
        "No staging slot or operation slot became free within the timeout (backpressure).",
    )?;
    let corrupt = make_type(py, "CorruptChunk", vec![b.clone()], "A chunk failed verification.")?;
    let store_error =
        make_type(py, "StoreError", vec![b.clone(), builtins.getattr("OSError")?], "An OS-level failure; errno is set where one applies.")?;
    let unavailable = make_type(
        py,
        "BackendUnavailable",
        vec![store_error.bind(py).clone().into_any()],
        "A requested backend or direct-I/O mode cannot be used here.",
    )?;
    for (name, t, cell) in [
        ("PykvcacheError", base, &BASE_ERROR),
        ("PoolExhausted", pool_exhausted, &POOL_EXHAUSTED),
        ("CorruptChunk", corrupt, &CORRUPT_CHUNK),
        ("StoreError", store_error, &STORE_ERROR),
        ("BackendUnavailable", unavailable, &BACKEND_UNAVAILABLE),
    ] {
        m.add(name, t.bind(py))?;
        let _ = cell.set(py, t);
    }
    Ok(())
}
