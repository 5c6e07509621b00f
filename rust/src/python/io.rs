//! What an operation gives back: `IoHandle` (wait for it, from any number of
//! threads) and `IoResult` (its outcome).

use std::sync::{Arc, OnceLock};

use pyo3::exceptions::PyTimeoutError;
use pyo3::prelude::*;

use super::args::timeout_of;
use super::errors::to_py;
use crate::error::EngineError;
use crate::ops::{OpId, Outcome, Status};
use crate::store;

// ---- results and handles

#[pyclass(name = "IoResult", module = "pykvcache._core", frozen)]
pub(super) struct PyIoResult {
    outcome: Outcome,
}

#[pymethods]
impl PyIoResult {
    #[getter]
    fn status(&self) -> &'static str {
        self.outcome.status.name()
    }
    #[getter]
    fn length(&self) -> u64 {
        self.outcome.length
    }
    #[getter]
    fn errno(&self) -> Option<i32> {
        self.outcome.errno
    }
    #[getter]
    fn message(&self) -> &str {
        &self.outcome.message
    }
    #[getter]
    fn latency_s(&self) -> f64 {
        self.outcome.latency.as_secs_f64()
    }
    #[getter]
    fn ok(&self) -> bool {
        self.outcome.status == Status::Ok
    }
    /// A get that served nothing: what became of its chunk file, as the
    /// engine judged it ("absent", "kept", "unavailable", "corrupt").
    #[getter]
    fn miss_kind(&self) -> Option<&'static str> {
        self.outcome.miss_kind.map(|k| k.name())
    }

    fn raise_for_status(&self) -> PyResult<()> {
        let o = &self.outcome;
        match o.status {
            Status::Ok => Ok(()),
            Status::Miss => Err(pyo3::exceptions::PyKeyError::new_err(o.message.clone())),
            Status::Corrupt => Err(to_py(EngineError::Corrupt { path: String::new(), reason: o.message.clone() })),
            Status::Error => {
                Err(to_py(EngineError::io(o.message.clone(), std::io::Error::from_raw_os_error(o.errno.unwrap_or(libc::EIO)))))
            }
        }
    }

    fn __repr__(&self) -> String {
        let kind = self.miss_kind().map_or("None".to_owned(), |k| format!("{k:?}"));
        let (status, length, message) = (self.status(), self.outcome.length, &self.outcome.message);
        format!("IoResult(status={status:?}, miss_kind={kind}, length={length}, latency_s={:.6}, message={message:?})", self.latency_s())
    }
}

// frozen: a handle is shared by every thread that waits for it (a mutable
// borrow held across the GIL-free wait made the others fail "Already
// borrowed"); the result is cached in a `OnceLock`, set once by the first
// waiter that sees the outcome.
#[pyclass(name = "IoHandle", module = "pykvcache._core", frozen)]
pub(super) struct PyIoHandle {
    store: Arc<store::BlockStore>,
    id: OpId,
    /// "put", "get" or "prefetch".
    op: &'static str,
    key: Vec<u8>,
    /// None for a region operation.
    slot: Option<usize>,
    result: OnceLock<Py<PyIoResult>>,
}

impl PyIoHandle {
    pub(super) fn new(store: &Arc<store::BlockStore>, id: OpId, op: &'static str, key: Vec<u8>, slot: Option<usize>) -> Self {
        PyIoHandle { store: store.clone(), id, op, key, slot, result: OnceLock::new() }
    }
}

#[pymethods]
impl PyIoHandle {
    #[getter]
    fn op(&self) -> &'static str {
        self.op
    }
    #[getter]
    fn key<'py>(&self, py: Python<'py>) -> Bound<'py, pyo3::types::PyBytes> {
        pyo3::types::PyBytes::new(py, &self.key)
    }
    #[getter]
    fn slot(&self) -> Option<usize> {
        self.slot
    }

    /// A prefetch still waiting to start: raise it to demand priority (its
    /// transfers not started yet go with gets and puts, behind those queued
    /// before). True when something moved; False for a get or put, a
    /// prefetch done or promoted already, or one whose transfers all started.
    fn promote(&self) -> bool {
        self.result.get().is_none() && self.op == "prefetch" && self.store.promote(self.id)
    }

    fn done(&self) -> PyResult<bool> {
        if self.result.get().is_some() {
            return Ok(true);
        }
        self.store.is_done(self.id).map_err(to_py)
    }

    /// Whether the operation's work really ended, so no transfer of it touches
    /// its memory any more. Differs from `done()` only for an operation the
    /// I/O deadline abandoned: done (its result is a time-out) but not settled
    /// while the kernel still works on it (a stalled directory that answers
    /// later lands the bytes then). A region read's row is the caller's to
    /// reuse only once settled (decision 0062).
    fn settled(&self) -> bool {
        self.store.is_settled(self.id)
    }

    /// Any number of threads may wait at once; each gets the same result.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyIoResult>> {
        if let Some(r) = self.result.get() {
            return Ok(r.clone_ref(py));
        }
        let t = timeout_of("timeout", timeout)?;
        let (store, id) = (self.store.clone(), self.id);
        let waited = py.detach(move || store.wait(id, t));
        // Another waiter may have taken the outcome first and given the
        // table entry back (this wait then finds the entry stale): its cached
        // result is the answer. It caches before it releases the entry, and
        // both go through the table's lock, so the result is visible here.
        if let Some(r) = self.result.get() {
            return Ok(r.clone_ref(py));
        }
        let Some(outcome) = waited.map_err(to_py)? else {
            return Err(PyTimeoutError::new_err(format!("{} still in flight after {:?} s", self.op(), timeout.unwrap_or(0.0))));
        };
        let r = Py::new(py, PyIoResult { outcome })?;
        match self.result.set(r.clone_ref(py)) {
            Ok(()) => {
                // The outcome is now cached here: give the table entry back right away.
                self.store.release_op(self.id);
                Ok(r)
            }
            // A concurrent waiter cached it first (and released the entry).
            Err(_) => Ok(self.result.get().expect("set by the other waiter").clone_ref(py)),
        }
    }

    fn __repr__(&self) -> String {
        let slot = self.slot.map_or("None".to_string(), |s| s.to_string());
        format!("IoHandle(op={}, slot={slot}, done={})", self.op(), self.done().unwrap_or(false))
    }
}

impl Drop for PyIoHandle {
    fn drop(&mut self) {
        if self.result.get().is_none() {
            self.store.release_op(self.id);
        }
    }
}
