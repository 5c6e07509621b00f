//! The PyO3 glue, and the only place that knows about Python: wraps the
//! engine types, releases the GIL around every blocking call, and converts
//! `EngineError` into Python exceptions in one function (`to_py`).

use std::ffi::c_int;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use pyo3::exceptions::{PyOverflowError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyMemoryView, PyTuple, PyType};
use pyo3::ffi;

use crate::disk::files::DirectIoPolicy;
use crate::disk::format::{self, FORMAT_VERSION, HEADER_BYTES, IO_ALIGN};
use crate::disk::layout::{self, Permissions};
use crate::error::EngineError;
use crate::ops::{OpId, Outcome, Status};
use crate::staging;
use crate::stats::{Stats, LATENCY_BUCKETS_US};
use crate::store::config::defaults;
use crate::store::{self, BackendChoice, StoreConfig, VerifyPolicy};

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
fn to_py(err: EngineError) -> PyErr {
    Python::attach(|py| {
        let msg = err.to_string();
        let build = |t: Bound<'_, PyType>, args: Bound<'_, PyTuple>| match t.call1(args) {
            Ok(v) => PyErr::from_value(v),
            Err(e) => e,
        };
        match &err {
            EngineError::PoolExhausted { .. } | EngineError::QueueFull { .. } => {
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

/// Timeouts longer than this (about 31.7 years, `inf` included) mean "wait
/// forever", like None: `Duration::from_secs_f64` panics past its range and
/// `Instant + Duration` past the clock's, so huge values never reach them.
const FOREVER_S: f64 = 1e9;

/// The one conversion of every timeout argument: seconds, None = forever.
fn timeout_of(name: &str, seconds: Option<f64>) -> PyResult<Option<Duration>> {
    match seconds {
        None => Ok(None),
        Some(s) if s.is_nan() || s < 0.0 => Err(PyValueError::new_err(format!("{name} must be >= 0 seconds or None, got {s}"))),
        Some(s) if s > FOREVER_S => Ok(None),
        Some(s) => Duration::try_from_secs_f64(s).map(Some).map_err(|e| PyValueError::new_err(format!("{name}: {e}"))),
    }
}

/// A size or count from Python: an int that fits the engine's type, else a
/// ValueError naming the argument (PyO3's own conversion raises a bare
/// OverflowError). The engine then checks the real bounds, naming them too.
fn int_arg<T: TryFrom<u64>>(ob: &Bound<'_, PyAny>, name: &str) -> PyResult<T> {
    match ob.extract::<u64>() {
        Ok(v) => T::try_from(v).map_err(|_| PyValueError::new_err(format!("{name} is too large, got {v}"))),
        Err(e) if e.is_instance_of::<PyOverflowError>(ob.py()) => {
            let what = if ob.lt(0)? { "must be >= 0" } else { "is too large" };
            Err(PyValueError::new_err(format!("{name} {what}, got {ob}")))
        }
        Err(e) => Err(e),
    }
}

/// One `from_py_with` converter per argument: PyO3 passes no name to it.
macro_rules! int_args {
    ($($f:ident: $t:ty = $name:literal;)*) => {
        $(fn $f(ob: &Bound<'_, PyAny>) -> PyResult<$t> { int_arg(ob, $name) })*
    };
}
int_args! {
    slot_bytes_arg: usize = "slot_bytes";
    num_slots_arg: usize = "num_slots";
    capacity_bytes_arg: u64 = "capacity_bytes";
    queue_depth_arg: usize = "queue_depth";
    segment_bytes_arg: usize = "segment_bytes";
    write_segment_bytes_arg: usize = "write_segment_bytes";
    max_inflight_arg: usize = "max_inflight";
    io_threads_arg: usize = "io_threads";
    chunk_workers_arg: usize = "chunk_workers";
    length_arg: usize = "length";
    payload_bytes_arg: usize = "payload_bytes";
    slot_arg: usize = "slot";
}

/// `refresh_interval_s`: "auto" (walk while another writer's lease is live,
/// decision 0053), a positive number of seconds, or None / 0 (never).
fn refresh_arg(ob: &Bound<'_, PyAny>) -> PyResult<store::RefreshPolicy> {
    if ob.is_none() {
        return Ok(store::RefreshPolicy::Off);
    }
    if let Ok(text) = ob.extract::<String>() {
        if text == "auto" {
            return Ok(store::RefreshPolicy::Auto);
        }
    } else if let Ok(s) = ob.extract::<f64>() {
        if s == 0.0 {
            return Ok(store::RefreshPolicy::Off);
        }
        if s.is_finite() && s > 0.0 {
            return Ok(store::RefreshPolicy::Every(Duration::from_secs_f64(s.min(1e9))));
        }
    }
    Err(PyValueError::new_err(format!("refresh_interval_s must be \"auto\", a positive number of seconds, or None/0 (never), not {ob}")))
}

/// A refresh policy as Python names it: "auto", "off", "every <s> s".
fn refresh_name(p: store::RefreshPolicy) -> String {
    match p {
        store::RefreshPolicy::Off => "off".to_string(),
        store::RefreshPolicy::Auto => "auto".to_string(),
        store::RefreshPolicy::Every(d) => format!("every {:.3} s", d.as_secs_f64()),
    }
}

// ---- staging

#[pyclass(name = "StagingPool", module = "pykvcache._core", frozen)]
struct PyStagingPool {
    inner: Arc<staging::StagingPool>,
}

/// A buffer exporter for one slot payload (or the whole region when `slot` is None).
#[pyclass(module = "pykvcache._core", frozen)]
struct SlotBuffer {
    pool: Arc<staging::StagingPool>,
    slot: Option<usize>,
    ptr: usize,
    len: usize,
}

#[pymethods]
impl SlotBuffer {
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let me = slf.get();
        if let Some(slot) = me.slot {
            me.pool.export_begin(slot).map_err(to_py)?;
        }
        let rc = unsafe { ffi::PyBuffer_FillInfo(view, slf.as_ptr(), me.ptr as *mut _, me.len as ffi::Py_ssize_t, 0, flags) };
        if rc != 0 {
            if let Some(slot) = me.slot {
                me.pool.export_end(slot);
            }
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

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
    fn slot_bytes(&self) -> usize { self.inner.slot_bytes() }
    #[getter]
    fn slot_stride(&self) -> usize { self.inner.stride() }
    #[getter]
    fn num_slots(&self) -> usize { self.inner.num_slots() }
    #[getter]
    fn total_bytes(&self) -> usize { self.inner.total_bytes() }
    #[getter]
    fn base_address(&self) -> usize { self.inner.base_address() }
    #[getter]
    fn shm_name(&self) -> Option<String> { self.inner.shm_name().map(str::to_owned) }
    #[getter]
    fn is_owner(&self) -> bool { self.inner.is_owner() }
    #[getter]
    fn is_memfd(&self) -> bool { self.inner.is_memfd() }
    #[getter]
    fn free_slots(&self) -> usize { self.inner.free_slots() }
    /// Slots released while quarantined (abandoned I/O may still touch them):
    /// free once that I/O ends.
    #[getter]
    fn deferred_releases(&self) -> usize { self.inner.deferred_releases() }

    fn payload_offset(&self, #[pyo3(from_py_with = slot_arg)] slot: usize) -> PyResult<usize> {
        self.inner.payload_offset(slot).map_err(to_py)
    }

    #[pyo3(signature = (timeout=Some(0.0)))]
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
            let deadline = crate::wait::deadline_after(Some(t)).unwrap_or_else(|| std::time::Instant::now() + Duration::from_secs(86400 * 365));
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

// ---- results and handles

#[pyclass(name = "IoResult", module = "pykvcache._core", frozen)]
struct PyIoResult {
    outcome: Outcome,
}

#[pymethods]
impl PyIoResult {
    #[getter]
    fn status(&self) -> &'static str { self.outcome.status.name() }
    #[getter]
    fn length(&self) -> u64 { self.outcome.length }
    #[getter]
    fn errno(&self) -> Option<i32> { self.outcome.errno }
    #[getter]
    fn message(&self) -> &str { &self.outcome.message }
    #[getter]
    fn latency_s(&self) -> f64 { self.outcome.latency.as_secs_f64() }
    #[getter]
    fn ok(&self) -> bool { self.outcome.status == Status::Ok }
    /// A get that served nothing: what became of its chunk file, as the
    /// engine judged it ("absent", "kept", "unavailable", "corrupt").
    #[getter]
    fn miss_kind(&self) -> Option<&'static str> { self.outcome.miss_kind.map(|k| k.name()) }

    fn raise_for_status(&self) -> PyResult<()> {
        let o = &self.outcome;
        match o.status {
            Status::Ok => Ok(()),
            Status::Miss => Err(pyo3::exceptions::PyKeyError::new_err(o.message.clone())),
            Status::Corrupt => Err(to_py(EngineError::Corrupt { path: String::new(), reason: o.message.clone() })),
            Status::Error => Err(to_py(EngineError::io(
                o.message.clone(),
                std::io::Error::from_raw_os_error(o.errno.unwrap_or(libc::EIO)),
            ))),
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
struct PyIoHandle {
    store: Arc<store::BlockStore>,
    id: OpId,
    /// "put", "get" or "prefetch".
    op: &'static str,
    key: Vec<u8>,
    slot: usize,
    result: OnceLock<Py<PyIoResult>>,
}

impl PyIoHandle {
    fn new(store: &Arc<store::BlockStore>, id: OpId, op: &'static str, key: Vec<u8>, slot: usize) -> Self {
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
    fn slot(&self) -> usize { self.slot }

    fn done(&self) -> PyResult<bool> {
        if self.result.get().is_some() {
            return Ok(true);
        }
        self.store.is_done(self.id).map_err(to_py)
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
        format!("IoHandle(op={}, slot={}, done={})", self.op(), self.slot, self.done().unwrap_or(false))
    }
}

impl Drop for PyIoHandle {
    fn drop(&mut self) {
        if self.result.get().is_none() {
            self.store.release_op(self.id);
        }
    }
}

// ---- store

// weakref: `pykvcache.aio` ties its per-loop reader to the store object,
// not to its id() or fd number (both are reused after a store is gone).
#[pyclass(name = "BlockStore", module = "pykvcache._core", frozen, weakref)]
struct PyBlockStore {
    inner: Arc<store::BlockStore>,
    submit_timeout: Option<Duration>,
}

#[pymethods]
impl PyBlockStore {
    #[new]
    // Defaults: `store::config::defaults`, the one place they are defined
    // (exported as `ENGINE_DEFAULTS`).
    #[pyo3(signature = (dirs, pool, *, namespace, capacity_bytes, queue_depth=defaults::QUEUE_DEPTH, backend=defaults::BACKEND,
                        direct_io=defaults::DIRECT_IO, register_buffers=true, segment_bytes=defaults::SEGMENT_BYTES,
                        write_segment_bytes=defaults::WRITE_SEGMENT_BYTES, max_inflight=defaults::MAX_INFLIGHT,
                        submit_timeout=Some(defaults::SUBMIT_TIMEOUT_S), io_threads=defaults::IO_THREADS,
                        chunk_workers=defaults::CHUNK_WORKERS, verify=defaults::VERIFY, recycle_files=true, background_scan=false,
                        preallocate=true, dir_mode=defaults::DIR_MODE, file_mode=defaults::FILE_MODE, allow_insecure_root=false,
                        min_free_bytes=None, min_free_fraction=None, io_deadline=None, refresh_interval_s=defaults::REFRESH_INTERVAL_S,
                        _fault_max_transfer=None, _fault_fail_nth=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        dirs: Vec<PathBuf>,
        pool: &PyStagingPool,
        namespace: String,
        #[pyo3(from_py_with = capacity_bytes_arg)] capacity_bytes: u64,
        #[pyo3(from_py_with = queue_depth_arg)] queue_depth: usize,
        backend: &str,
        direct_io: &str,
        register_buffers: bool,
        #[pyo3(from_py_with = segment_bytes_arg)] segment_bytes: usize,
        #[pyo3(from_py_with = write_segment_bytes_arg)] write_segment_bytes: usize,
        #[pyo3(from_py_with = max_inflight_arg)] max_inflight: usize,
        submit_timeout: Option<f64>,
        #[pyo3(from_py_with = io_threads_arg)] io_threads: usize,
        #[pyo3(from_py_with = chunk_workers_arg)] chunk_workers: usize,
        verify: &str,
        recycle_files: bool,
        background_scan: bool,
        preallocate: bool,
        dir_mode: u32,
        file_mode: u32,
        allow_insecure_root: bool,
        min_free_bytes: Option<u64>,
        min_free_fraction: Option<f64>,
        io_deadline: Option<f64>,
        #[pyo3(from_py_with = refresh_arg)] refresh_interval_s: store::RefreshPolicy,
        _fault_max_transfer: Option<usize>,
        _fault_fail_nth: Option<(u64, i32)>,
    ) -> PyResult<Self> {
        let mut config = StoreConfig::new(dirs, namespace, capacity_bytes);
        config.queue_depth = queue_depth;
        config.backend = BackendChoice::parse(backend).map_err(to_py)?;
        config.direct_io = DirectIoPolicy::parse(direct_io).map_err(to_py)?;
        config.register_buffers = register_buffers;
        config.segment_bytes = segment_bytes;
        config.write_segment_bytes = write_segment_bytes;
        config.max_inflight = max_inflight;
        config.io_threads = io_threads;
        config.chunk_workers = chunk_workers;
        config.verify = VerifyPolicy::parse(verify).map_err(to_py)?;
        config.recycle_files = recycle_files;
        config.background_scan = background_scan;
        config.preallocate = preallocate;
        config.permissions = Permissions { dir_mode, file_mode, allow_insecure_root };
        if min_free_bytes.is_some() || min_free_fraction.is_some() {
            config.min_free = store::FreeSpaceReserve::AtLeast {
                bytes: min_free_bytes.unwrap_or(0),
                fraction: min_free_fraction.unwrap_or(0.0),
            };
        }
        config.refresh = refresh_interval_s;
        if _fault_max_transfer.is_some() || _fault_fail_nth.is_some() {
            config.faults = Some(Arc::new(crate::faults::FaultPlan {
                max_transfer: _fault_max_transfer,
                fail_nth: _fault_fail_nth,
                ..Default::default()
            }));
        }
        config.io_deadline = timeout_of("io_deadline", io_deadline)?;
        if io_deadline == Some(0.0) {
            return Err(PyValueError::new_err("io_deadline must be > 0 seconds (None: derived from the chunk size)"));
        }
        let submit_timeout = timeout_of("submit_timeout", submit_timeout)?;
        let pool = pool.inner.clone();
        let (store, report) = py.detach(move || store::BlockStore::open(config, pool)).map_err(to_py)?;
        let logger = py.import("logging")?.call_method1("getLogger", ("pykvcache",))?;
        for f in &report.fallbacks {
            logger.call_method1("warning", ("pykvcache fallback: %s", f))?;
        }
        for w in &report.warnings {
            logger.call_method1("warning", ("pykvcache: %s", w))?;
        }
        for n in &report.notes {
            logger.call_method1("info", ("pykvcache: %s", n))?;
        }
        for (dir, s) in store.storage_support() {
            logger.call_method1(
                "info",
                (
                    "pykvcache: %s supports O_DIRECT=%s O_TMPFILE=%s fallocate=%s (unaligned O_DIRECT accepted=%s, O_DIRECT settable after open=%s); I/O deadline %.1f s",
                    dir.display().to_string(),
                    s.direct,
                    s.tmpfile,
                    s.fallocate,
                    s.direct_unaligned,
                    s.direct_set_after_open,
                    store.io_deadline().as_secs_f64(),
                ),
            )?;
        }
        Ok(PyBlockStore { inner: Arc::new(store), submit_timeout })
    }

    /// Logs the engine's messages about space since the last call (from
    /// worker threads, during earlier puts or walks), each once: ENOSPC
    /// lowered the capacity, another namespace's chunks evicted, a put refused
    /// for the reserve (what holds the space), another writer found.
    fn log_notices(&self, py: Python<'_>) -> PyResult<()> {
        let notices = self.inner.take_notices();
        if notices.is_empty() {
            return Ok(());
        }
        let logger = py.import("logging")?.call_method1("getLogger", ("pykvcache",))?;
        for n in notices {
            // Another writer found is news, not trouble.
            let level = if n.starts_with("another process writes") { "info" } else { "warning" };
            logger.call_method1(level, ("pykvcache: %s", n))?;
        }
        Ok(())
    }

    /// Logs the circuit breakers' state changes since the last call: one
    /// line per change (closed -> open at warning, the others at info).
    fn log_health(&self, py: Python<'_>) -> PyResult<()> {
        let notices = self.inner.take_health_notices();
        if notices.is_empty() {
            return Ok(());
        }
        let logger = py.import("logging")?.call_method1("getLogger", ("pykvcache",))?;
        for n in notices {
            let level = if n.contains("-> open") { "warning" } else { "info" };
            logger.call_method1(level, ("pykvcache: %s", n))?;
        }
        Ok(())
    }

    fn put(&self, py: Python<'_>, key: Vec<u8>, #[pyo3(from_py_with = slot_arg)] slot: usize, #[pyo3(from_py_with = length_arg)] length: usize) -> PyResult<PyIoHandle> {
        let (store, t) = (self.inner.clone(), self.submit_timeout);
        let k = key.clone();
        let id = py.detach(move || store.put(&k, slot, length, t)).map_err(to_py)?;
        self.log_health(py)?;
        self.log_notices(py)?;
        Ok(PyIoHandle::new(&self.inner, id, "put", key, slot))
    }

    fn get(&self, py: Python<'_>, key: Vec<u8>, #[pyo3(from_py_with = slot_arg)] slot: usize) -> PyResult<PyIoHandle> {
        let (store, t) = (self.inner.clone(), self.submit_timeout);
        let k = key.clone();
        let id = py.detach(move || store.get(&k, slot, t)).map_err(to_py)?;
        self.log_health(py)?;
        Ok(PyIoHandle::new(&self.inner, id, "get", key, slot))
    }

    fn prefetch(&self, py: Python<'_>, key: Vec<u8>, #[pyo3(from_py_with = slot_arg)] slot: usize) -> PyResult<PyIoHandle> {
        let (store, t) = (self.inner.clone(), self.submit_timeout);
        let k = key.clone();
        let id = py.detach(move || store.prefetch(&k, slot, t)).map_err(to_py)?;
        self.log_health(py)?;
        Ok(PyIoHandle::new(&self.inner, id, "prefetch", key, slot))
    }

    fn contains(&self, key: &[u8]) -> bool {
        self.inner.contains(key)
    }

    fn probe(&self, py: Python<'_>, key: Vec<u8>) -> bool {
        let store = self.inner.clone();
        py.detach(move || store.probe(&key))
    }

    fn chunk_length(&self, key: &[u8]) -> Option<u64> {
        self.inner.chunk_file_len(key).map(|l| l - HEADER_BYTES as u64)
    }

    fn evict(&self, key: &[u8]) -> bool {
        self.inner.evict(key)
    }

    fn mark_filler(&self, key: &[u8]) -> PyResult<bool> {
        self.inner.mark_filler(key).map_err(to_py)
    }

    /// Waits for the open-time index scan (background_scan=True); False on timeout.
    #[pyo3(signature = (timeout=None))]
    fn wait_scan(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let t = timeout_of("timeout", timeout)?;
        let store = self.inner.clone();
        Ok(py.detach(move || store.wait_scan(t)))
    }

    #[getter]
    fn scan_complete(&self) -> bool {
        self.inner.scan_report().done
    }

    fn rescan(&self, py: Python<'_>) -> PyResult<usize> {
        let store = self.inner.clone();
        py.detach(move || store.rescan()).map_err(to_py)
    }

    fn refresh(&self, py: Python<'_>) -> PyResult<(usize, usize)> {
        let store = self.inner.clone();
        py.detach(move || store.refresh()).map_err(to_py)
    }

    fn take_removed(&self) -> (Vec<u128>, u64) {
        self.inner.take_removed()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    #[getter]
    fn used_bytes(&self) -> u64 { self.inner.used_bytes() }

    #[getter]
    fn committed_bytes(&self) -> u64 { self.inner.committed_bytes() }
    #[getter]
    fn capacity_bytes(&self) -> u64 { self.inner.capacity_bytes() }
    #[getter]
    fn backend(&self) -> &'static str { self.inner.backend_name() }
    /// Why the backend moves no more bytes (a fatal io_uring error), or None
    /// while it works; new operations then raise `BackendUnavailable`.
    #[getter]
    fn backend_error(&self) -> Option<String> { self.inner.backend_failure() }
    #[getter]
    fn fixed_buffers(&self) -> bool { self.inner.fixed_buffers() }
    #[getter]
    fn direct_io(&self) -> bool { self.inner.direct_io() }
    #[getter]
    fn namespace_dir(&self) -> Vec<String> {
        self.inner.namespace_dirs().iter().map(|p| p.display().to_string()).collect()
    }
    #[getter]
    fn completion_fd(&self) -> i32 { self.inner.completion_fd() }

    /// `(breaker_opens, breaker_closes, open_dirs)`: what `stats()` says of
    /// the circuit breakers, without the rest of it (a few atomic loads and one
    /// lock per directory; the gate asks once per request).
    fn breaker_health(&self) -> (u64, u64, usize) {
        let c = &self.inner.health().counters;
        let g = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        let open = self.inner.dir_states().iter().filter(|(_, st)| *st != "closed").count();
        (g(&c.breaker_opens), g(&c.breaker_closes), open)
    }

    fn inflight(&self) -> usize {
        self.inner.in_flight()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.log_health(py)?;
        self.log_notices(py)?;
        let d = PyDict::new(py);
        let s = self.inner.stats();
        let h = self.inner.health();
        let c = &h.counters;
        let g = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        d.set_item("io_timeouts", g(&c.timeouts))?;
        d.set_item("storage_errors", g(&c.storage_errors))?;
        d.set_item("breaker_opens", g(&c.breaker_opens))?;
        d.set_item("breaker_skipped_gets", g(&c.skipped_gets))?;
        d.set_item("breaker_skipped_puts", g(&c.skipped_puts))?;
        d.set_item("breaker_probes", g(&c.probes))?;
        d.set_item("breaker_probe_failures", g(&c.probe_failures))?;
        d.set_item("breaker_closes", g(&c.breaker_closes))?;
        d.set_item("late_completions", g(&c.late_completions))?;
        d.set_item("stuck_ops", self.inner.stuck_ops())?;
        d.set_item("quarantined_slots", self.inner.pool().quarantined_slots())?;
        d.set_item("quarantine_releases", self.inner.pool().quarantine_releases())?;
        let states = self.inner.dir_states();
        d.set_item("breaker_open_dirs", states.iter().filter(|(_, st)| *st != "closed").count())?;
        d.set_item("dir_states", states.iter().map(|(_, st)| *st).collect::<Vec<_>>())?;
        d.set_item("io_deadline_s", self.inner.io_deadline().as_secs_f64())?;
        let probes = PyDict::new(py);
        for (dir, sup) in self.inner.storage_support() {
            probes.set_item(dir.display().to_string(), support_dict(py, &sup)?)?;
        }
        d.set_item("storage_probes", probes)?;
        for (name, v) in s.counters() {
            d.set_item(name, v)?;
        }
        d.set_item("read_latency_hist", Stats::histogram(&s.read_latency_us))?;
        d.set_item("write_latency_hist", Stats::histogram(&s.write_latency_us))?;
        let bounds: Vec<f64> = LATENCY_BUCKETS_US.iter().map(|&b| if b == u64::MAX { f64::INFINITY } else { b as f64 }).collect();
        d.set_item("latency_bucket_bounds_us", bounds)?;
        d.set_item("backend", self.inner.backend_name())?;
        d.set_item("backend_error", self.inner.backend_failure().unwrap_or_default())?;
        d.set_item("fixed_buffers", self.inner.fixed_buffers())?;
        d.set_item("direct_io", self.inner.direct_io())?;
        d.set_item("fallbacks", s.fallbacks())?;
        d.set_item("inflight", self.inner.in_flight())?;
        d.set_item("chunks", self.inner.len())?;
        d.set_item("filler_chunks", self.inner.filler_count())?;
        d.set_item("used_bytes", self.inner.used_bytes())?;
        let (other_chunks, other_bytes) = self.inner.other_namespace_usage();
        d.set_item("other_namespace_chunks", other_chunks)?;
        d.set_item("other_namespace_bytes", other_bytes)?;
        d.set_item("other_writers", self.inner.other_writers())?;
        d.set_item("refresh_mode", refresh_name(self.inner.refresh_policy()))?;
        d.set_item("capacity_bytes", self.inner.capacity_bytes())?;
        d.set_item("configured_capacity_bytes", self.inner.configured_capacity_bytes())?;
        d.set_item("min_free_bytes", self.inner.min_free_bytes())?;
        d.set_item("backend_cpu_s", self.inner.backend_cpu_ns() as f64 / 1e9)?;
        d.set_item("chunk_worker_cpu_s", self.inner.chunk_worker_cpu_ns() as f64 / 1e9)?;
        let scan = self.inner.scan_report();
        d.set_item("scan_complete", scan.done)?;
        d.set_item("open_scan_chunks", scan.chunks)?;
        d.set_item("open_scan_s", scan.time.as_secs_f64())?;
        d.set_item("open_scan_error", scan.error.unwrap_or_default())?;
        d.set_item("staging_free_slots", self.inner.pool().free_slots())?;
        Ok(d)
    }

    fn close(&self, py: Python<'_>) {
        let store = self.inner.clone();
        py.detach(move || store.close());
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _a: Py<PyAny>, _b: Py<PyAny>, _c: Py<PyAny>) {
        self.close(py)
    }
}

/// The engine's defaults of the `BlockStore` keywords (`store::config::defaults`).
fn engine_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("queue_depth", defaults::QUEUE_DEPTH)?;
    d.set_item("max_inflight", defaults::MAX_INFLIGHT)?;
    d.set_item("segment_bytes", defaults::SEGMENT_BYTES)?;
    d.set_item("write_segment_bytes", defaults::WRITE_SEGMENT_BYTES)?;
    d.set_item("io_threads", defaults::IO_THREADS)?;
    d.set_item("chunk_workers", defaults::CHUNK_WORKERS)?;
    d.set_item("submit_timeout", defaults::SUBMIT_TIMEOUT_S)?;
    d.set_item("backend", defaults::BACKEND)?;
    d.set_item("direct_io", defaults::DIRECT_IO)?;
    d.set_item("verify", defaults::VERIFY)?;
    d.set_item("dir_mode", defaults::DIR_MODE)?;
    d.set_item("file_mode", defaults::FILE_MODE)?;
    // None: derived from the slot size (`store::health::default_deadline`).
    d.set_item("io_deadline", py.None())?;
    d.set_item("refresh_interval_s", refresh_name(defaults::REFRESH_INTERVAL_S))?;
    Ok(d)
}

fn support_dict<'py>(py: Python<'py>, s: &crate::disk::files::FsSupport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("o_direct", s.direct)?;
    d.set_item("o_tmpfile", s.tmpfile)?;
    d.set_item("fallocate", s.fallocate)?;
    d.set_item("unaligned_o_direct_accepted", s.direct_unaligned)?;
    d.set_item("o_direct_settable_after_open", s.direct_set_after_open)?;
    Ok(d)
}

/// What the existing directory `path`'s filesystem supports, found by
/// trying it (the probe a store runs at open on each storage directory):
/// O_DIRECT (an aligned write and read), O_TMPFILE, fallocate, whether
/// unaligned O_DIRECT is accepted and whether O_DIRECT set after open shows.
#[pyfunction]
#[pyo3(signature = (path, *, file_mode=defaults::FILE_MODE))]
fn probe_storage_dir<'py>(py: Python<'py>, path: PathBuf, file_mode: u32) -> PyResult<Bound<'py, PyDict>> {
    if !path.is_dir() {
        return Err(PyValueError::new_err(format!("{} is not a directory", path.display())));
    }
    let s = py.detach(|| crate::disk::files::probe(&path, file_mode));
    support_dict(py, &s)
}

/// The 128-bit hash a chunk's file is named by (``take_removed`` reports these).
#[pyfunction]
fn key_hash(key: &[u8]) -> u128 {
    crate::disk::format::key_hash(key)
}

/// xxh3-128 of the `length` bytes of the open file `fd` from `offset`, read
/// without the GIL (threads digest pieces of one file in parallel).
#[pyfunction]
fn digest_range(py: Python<'_>, fd: i32, offset: u64, length: u64) -> PyResult<u128> {
    py.detach(|| crate::digest::xxh3_128_range(fd, offset, length)).map_err(PyErr::from)
}

/// Bytes of the chunk file (header + payload padded to `IO_ALIGN`) that
/// holds `payload_bytes`: what a chunk costs on disk and in a staging slot.
#[pyfunction]
fn chunk_file_bytes(#[pyo3(from_py_with = payload_bytes_arg)] payload_bytes: usize) -> PyResult<usize> {
    if payload_bytes > usize::MAX - 2 * IO_ALIGN - HEADER_BYTES {
        return Err(PyOverflowError::new_err(format!("payload_bytes {payload_bytes} is too large")));
    }
    Ok(format::file_len(payload_bytes))
}

/// Raises what opening a store on the existing directory `path` would raise
/// about it (not a directory, owned by another user, world-writable), creating
/// nothing: the engine's own check, for validation before a store exists.
#[pyfunction]
#[pyo3(signature = (path, *, allow_insecure_root=false))]
fn check_storage_dir(py: Python<'_>, path: PathBuf, allow_insecure_root: bool) -> PyResult<()> {
    let perms = Permissions { allow_insecure_root, ..Permissions::default() };
    py.detach(|| layout::check_root(&path, &perms)).map_err(to_py)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let builtins = py.import("builtins")?;
    let exception = builtins.getattr("Exception")?;
    let base = make_type(py, "PykvcacheError", vec![exception], "Base class of every error raised by the engine.")?;
    let b = base.bind(py).clone().into_any();
    let pool_exhausted = make_type(py, "PoolExhausted", vec![b.clone(), builtins.getattr("TimeoutError")?], "No staging slot or operation slot became free within the timeout (backpressure).")?;
    let corrupt = make_type(py, "CorruptChunk", vec![b.clone()], "A chunk failed verification.")?;
    let store_error = make_type(py, "StoreError", vec![b.clone(), builtins.getattr("OSError")?], "An OS-level failure; errno is set where one applies.")?;
    let unavailable = make_type(py, "BackendUnavailable", vec![store_error.bind(py).clone().into_any()], "A requested backend or direct-I/O mode cannot be used here.")?;
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
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("HEADER_BYTES", HEADER_BYTES)?;
    m.add("IO_ALIGN", IO_ALIGN)?;
    m.add("BACKENDS", PyTuple::new(py, BackendChoice::CHOICES)?)?;
    m.add("DIRECT_IO_POLICIES", PyTuple::new(py, DirectIoPolicy::CHOICES)?)?;
    m.add("VERIFY_MODES", PyTuple::new(py, VerifyPolicy::CHOICES)?)?;
    m.add("ENGINE_DEFAULTS", engine_defaults(py)?)?;
    m.add_function(wrap_pyfunction!(key_hash, m)?)?;
    m.add_function(wrap_pyfunction!(chunk_file_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(digest_range, m)?)?;
    m.add_function(wrap_pyfunction!(check_storage_dir, m)?)?;
    m.add_function(wrap_pyfunction!(probe_storage_dir, m)?)?;
    m.add("FORMAT_VERSION", FORMAT_VERSION)?;
    m.add_class::<PyStagingPool>()?;
    m.add_class::<SlotBuffer>()?;
    m.add_class::<PyIoResult>()?;
    m.add_class::<PyIoHandle>()?;
    m.add_class::<PyBlockStore>()?;
    Ok(())
}
