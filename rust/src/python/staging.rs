//! `StagingPool` and the buffer exporter of its slots (`SlotBuffer`).

use std::ffi::c_int;
use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyMemoryView;

use super::args::{num_slots_arg, slot_arg, slot_bytes_arg, timeout_of};
use super::errors::to_py;
use crate::error::EngineError;
use crate::staging;

// ---- staging

#[pyclass(name = "StagingPool", module = "pykvcache._core", frozen)]
pub(super) struct PyStagingPool {
    pub(super) inner: Arc<staging::StagingPool>,
}

/// A buffer exporter for one slot payload (or the whole region when `slot` is None).
#[pyclass(module = "pykvcache._core", frozen)]
pub(super) struct SlotBuffer {
    pool: Arc<staging::StagingPool>,
    slot: Option<usize>,
    ptr: usize,
    len: usize,
}

#[pymethods]
impl SlotBuffer {
    /// Exports the slot's bytes (counted: the slot cannot be released while viewed).
    ///
    /// # Safety
    /// CPython's buffer protocol calls this with the GIL held and `view` a valid,
    /// writable `Py_buffer`, and pairs every successful call with one `__releasebuffer__`.
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let me = slf.get();
        if let Some(slot) = me.slot {
            me.pool.export_begin(slot).map_err(to_py)?;
        }
        // SAFETY: `view` is valid (this method's contract). `me.ptr`/`me.len` name a slot's payload
        // (or the slots' region) in `me.pool`'s mapping, which the `Arc` this object holds keeps
        // mapped for as long as the view, which holds this object, lives.
        let rc = unsafe { ffi::PyBuffer_FillInfo(view, slf.as_ptr(), me.ptr as *mut _, me.len as ffi::Py_ssize_t, 0, flags) };
        if rc != 0 {
            if let Some(slot) = me.slot {
                me.pool.export_end(slot);
            }
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// Ends one export begun by `__getbuffer__`.
    ///
    /// # Safety
    /// Called by CPython once for each successful `__getbuffer__` of this object.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        if let Some(slot) = self.slot {
            self.pool.export_end(slot);
        }
    }
}

#[pymethods]
impl PyStagingPool {
    #[new]
    #[pyo3(signature = (slot_bytes, num_slots, *, shm_name=None, memfd=false))]
    fn new(
        py: Python<'_>,
        #[pyo3(from_py_with = slot_bytes_arg)] slot_bytes: usize,
        #[pyo3(from_py_with = num_slots_arg)] num_slots: usize,
        shm_name: Option<String>,
        memfd: bool,
    ) -> PyResult<Self> {
        let backing = match (&shm_name, memfd) {
            (None, false) => staging::Backing::Private,
            (Some(name), false) => staging::Backing::Named(name),
            (Some(name), true) => staging::Backing::Memfd(name),
            (None, true) => return Err(PyValueError::new_err("memfd=True needs shm_name (the name attach_memfd finds it by)")),
        };
        let inner = py.detach(|| staging::StagingPool::create_backed(slot_bytes, num_slots, backing)).map_err(to_py)?;
        Ok(PyStagingPool { inner: Arc::new(inner) })
    }

    #[staticmethod]
    fn attach(py: Python<'_>, shm_name: String) -> PyResult<Self> {
        let inner = py.detach(|| staging::StagingPool::attach(&shm_name)).map_err(to_py)?;
        Ok(PyStagingPool { inner: Arc::new(inner) })
    }

    #[staticmethod]
    fn attach_memfd(py: Python<'_>, shm_name: String) -> PyResult<Self> {
        let inner = py.detach(|| staging::StagingPool::attach_memfd(&shm_name)).map_err(to_py)?;
        Ok(PyStagingPool { inner: Arc::new(inner) })
    }

    #[getter]
    fn slot_bytes(&self) -> usize {
        self.inner.slot_bytes()
    }
    #[getter]
    fn slot_stride(&self) -> usize {
        self.inner.stride()
    }
    #[getter]
    fn num_slots(&self) -> usize {
        self.inner.num_slots()
    }
    #[getter]
    fn total_bytes(&self) -> usize {
        self.inner.total_bytes()
    }
    #[getter]
    fn base_address(&self) -> usize {
        self.inner.base_address()
    }
    #[getter]
    fn shm_name(&self) -> Option<String> {
        self.inner.shm_name().map(str::to_owned)
    }
    #[getter]
    fn is_owner(&self) -> bool {
        self.inner.is_owner()
    }
    #[getter]
    fn is_memfd(&self) -> bool {
        self.inner.is_memfd()
    }
    #[getter]
    fn free_slots(&self) -> usize {
        self.inner.free_slots()
    }
    /// Slots released while quarantined (abandoned I/O may still touch them):
    /// free once that I/O ends.
    #[getter]
    fn deferred_releases(&self) -> usize {
        self.inner.deferred_releases()
    }

    fn payload_offset(&self, #[pyo3(from_py_with = slot_arg)] slot: usize) -> PyResult<usize> {
        self.inner.payload_offset(slot).map_err(to_py)
    }

    // text_signature: PyO3 renders `Some(0.0)` as `...` (stubtest checks the stub against it).
    #[pyo3(signature = (timeout=Some(0.0)), text_signature = "($self, timeout=0.0)")]
    fn acquire(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<usize> {
        let t = timeout_of("timeout", timeout)?;
        let pool = self.inner.clone();
        py.detach(move || pool.acquire(t)).map_err(to_py)
    }

    fn try_acquire(&self) -> PyResult<Option<usize>> {
        match self.inner.acquire(Some(Duration::ZERO)) {
            Ok(s) => Ok(Some(s)),
            Err(EngineError::PoolExhausted { .. }) => Ok(None),
            Err(e) => Err(to_py(e)),
        }
    }

    fn release(&self, #[pyo3(from_py_with = slot_arg)] slot: usize) -> PyResult<()> {
        self.inner.release(slot).map_err(to_py)
    }

    fn view<'py>(&self, py: Python<'py>, #[pyo3(from_py_with = slot_arg)] slot: usize) -> PyResult<Bound<'py, PyMemoryView>> {
        let ptr = self.inner.payload_offset(slot).map_err(to_py)? + self.inner.base_address();
        let exporter = Bound::new(py, SlotBuffer { pool: self.inner.clone(), slot: Some(slot), ptr, len: self.inner.slot_bytes() })?;
        PyMemoryView::from(exporter.as_any())
    }

    fn region<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyMemoryView>> {
        let exporter = Bound::new(
            py,
            SlotBuffer { pool: self.inner.clone(), slot: None, ptr: self.inner.base_address(), len: self.inner.region_len() },
        )?;
        PyMemoryView::from(exporter.as_any())
    }

    fn exports(&self, #[pyo3(from_py_with = slot_arg)] slot: usize) -> u32 {
        self.inner.exports(slot)
    }

    /// `(generation, state)` of the slot's ready word: "idle", "pending",
    /// "ready" or "failed" (see the engine's `ready.rs`).
    fn ready_state(&self, #[pyo3(from_py_with = slot_arg)] slot: usize) -> PyResult<(u32, &'static str)> {
        self.inner.payload_offset(slot).map_err(to_py)?;
        Ok(self.inner.ready_state(slot))
    }

    /// Waits (GIL released) until the reads of `generations[i]` into
    /// `slots[i]` have ended, all within `timeout` seconds; one of "ready",
    /// "failed", "recycled", "timed_out" per slot.
    fn wait_ready(&self, py: Python<'_>, slots: Vec<usize>, generations: Vec<u32>, timeout: f64) -> PyResult<Vec<&'static str>> {
        if slots.len() != generations.len() {
            return Err(PyValueError::new_err("slots and generations differ in length"));
        }
        for &slot in &slots {
            self.inner.payload_offset(slot).map_err(to_py)?;
        }
        let t = timeout_of("timeout", Some(timeout))?.unwrap_or(Duration::MAX);
        let pairs: Vec<(usize, u32)> = slots.into_iter().zip(generations).collect();
        let pool = self.inner.clone();
        let verdicts = py.detach(move || {
            let deadline =
                crate::wait::deadline_after(Some(t)).unwrap_or_else(|| std::time::Instant::now() + Duration::from_secs(86400 * 365));
            pool.wait_ready_all(&pairs, deadline)
        });
        Ok(verdicts.into_iter().map(|v| v.name()).collect())
    }

    fn close(&self) -> PyResult<()> {
        self.inner.close().map_err(to_py)
    }

    fn __repr__(&self) -> String {
        format!(
            "StagingPool(slot_bytes={}, num_slots={}, free={}, shm_name={:?})",
            self.inner.slot_bytes(),
            self.inner.num_slots(),
            self.inner.free_slots(),
            self.inner.shm_name()
        )
    }
}
