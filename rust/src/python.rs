//! The PyO3 glue, and the only place that knows about Python: wraps the
//! engine types, releases the GIL around every blocking call, and converts
//! `EngineError` into Python exceptions in one function (`errors::to_py`).
//! This file holds `BlockStore` and the module; the other classes, the
//! argument conversions, the errors and what is reported (stats, log lines)
//! are in `python/`. Nothing here logs on the I/O path (put, get, wait): the
//! engine's notices wait in its queue until `stats()`, `log_notices()` or
//! `close()` logs them (`report.rs`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::{PyOverflowError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::disk::files::DirectIoPolicy;
use crate::disk::format::{self, FORMAT_VERSION, HEADER_BYTES, IO_ALIGN};
use crate::disk::layout::{self, Permissions};
use crate::store::config::{defaults, limits};
use crate::store::{self, BackendChoice, StoreConfig, VerifyPolicy};

mod args;
mod errors;
mod io;
mod region;
mod report;
mod staging;

use args::*;
use errors::to_py;
use io::{PyIoHandle, PyIoResult};
use staging::{PyStagingPool, SlotBuffer};

// ---- store

// weakref: `pykvcache.aio` ties its per-loop reader to the store object,
// not to its id() or fd number (both are reused after a store is gone).
#[pyclass(name = "BlockStore", module = "pykvcache._core", frozen, weakref)]
struct PyBlockStore {
    inner: Arc<store::BlockStore>,
    submit_timeout: Option<Duration>,
    /// The buffers of the registered regions (`register_region`).
    regions: region::Exports,
}

impl Drop for PyBlockStore {
    fn drop(&mut self) {
        self.regions.release_all(&self.inner);
    }
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
                        preallocate=true, segment_files=defaults::SEGMENT_FILES, dir_mode=defaults::DIR_MODE, file_mode=defaults::FILE_MODE, allow_insecure_root=false,
                        min_free_bytes=None, min_free_fraction=None, io_deadline=None, refresh_interval_s=defaults::REFRESH_INTERVAL_S,
                        encryption_key_file=None, encryption_previous_key_file=None, seal_buffers=defaults::SEAL_BUFFERS,
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
        #[pyo3(from_py_with = segment_files_arg)] segment_files: store::SegmentFiles,
        dir_mode: u32,
        file_mode: u32,
        allow_insecure_root: bool,
        min_free_bytes: Option<u64>,
        min_free_fraction: Option<f64>,
        io_deadline: Option<f64>,
        #[pyo3(from_py_with = refresh_arg)] refresh_interval_s: store::RefreshPolicy,
        encryption_key_file: Option<PathBuf>,
        encryption_previous_key_file: Option<PathBuf>,
        #[pyo3(from_py_with = seal_buffers_arg)] seal_buffers: usize,
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
        config.segment_files = segment_files;
        config.permissions = Permissions { dir_mode, file_mode, allow_insecure_root };
        if min_free_bytes.is_some() || min_free_fraction.is_some() {
            config.min_free =
                store::FreeSpaceReserve::AtLeast { bytes: min_free_bytes.unwrap_or(0), fraction: min_free_fraction.unwrap_or(0.0) };
        }
        config.refresh = refresh_interval_s;
        config.encryption_key_file = encryption_key_file;
        config.encryption_previous_key_file = encryption_previous_key_file;
        config.seal_buffers = seal_buffers;
        config.faults = args::fault_plan(_fault_max_transfer, _fault_fail_nth)?;
        config.io_deadline = io_deadline_of(io_deadline)?;
        let submit_timeout = timeout_of("submit_timeout", submit_timeout)?;
        let pool = pool.inner.clone();
        let (store, report) = py.detach(move || store::BlockStore::open(config, pool)).map_err(to_py)?;
        report::log_open(py, &report, &store.snapshot())?;
        Ok(PyBlockStore { inner: Arc::new(store), submit_timeout, regions: region::Exports::default() })
    }

    /// Logs the engine's notices since the last call, each once at the level
    /// the engine gave it (a circuit breaker's state change; about space:
    /// ENOSPC lowered the capacity, another namespace's chunks evicted, a put
    /// refused for the reserve, another writer found). `stats()` and
    /// `close()` call it too; put, get and wait never log.
    fn log_notices(&self, py: Python<'_>) -> PyResult<()> {
        report::log_notices(py, self.inner.take_notices())
    }

    // `tenant`: whose key seals or opens the chunk (a store without an encryption key ignores it).
    #[pyo3(signature = (key, slot, length, *, tenant=Vec::new()), text_signature = "($self, key, slot, length, *, tenant=b'')")]
    fn put(
        &self,
        py: Python<'_>,
        key: Vec<u8>,
        #[pyo3(from_py_with = slot_arg)] slot: usize,
        #[pyo3(from_py_with = length_arg)] length: usize,
        tenant: Vec<u8>,
    ) -> PyResult<PyIoHandle> {
        let (store, t) = (self.inner.clone(), self.submit_timeout);
        let k = key.clone();
        let id = py.detach(move || store.put_for(&tenant, &k, slot, length, t)).map_err(to_py)?;
        Ok(PyIoHandle::new(&self.inner, id, "put", key, Some(slot)))
    }

    #[pyo3(signature = (key, slot, *, tenant=Vec::new()), text_signature = "($self, key, slot, *, tenant=b'')")]
    fn get(&self, py: Python<'_>, key: Vec<u8>, #[pyo3(from_py_with = slot_arg)] slot: usize, tenant: Vec<u8>) -> PyResult<PyIoHandle> {
        let (store, t) = (self.inner.clone(), self.submit_timeout);
        let k = key.clone();
        let id = py.detach(move || store.get_for(&tenant, &k, slot, t)).map_err(to_py)?;
        Ok(PyIoHandle::new(&self.inner, id, "get", key, Some(slot)))
    }

    #[pyo3(signature = (key, slot, *, tenant=Vec::new()), text_signature = "($self, key, slot, *, tenant=b'')")]
    fn prefetch(
        &self,
        py: Python<'_>,
        key: Vec<u8>,
        #[pyo3(from_py_with = slot_arg)] slot: usize,
        tenant: Vec<u8>,
    ) -> PyResult<PyIoHandle> {
        let (store, t) = (self.inner.clone(), self.submit_timeout);
        let k = key.clone();
        let id = py.detach(move || store.prefetch_for(&tenant, &k, slot, t)).map_err(to_py)?;
        Ok(PyIoHandle::new(&self.inner, id, "prefetch", key, Some(slot)))
    }

    /// Registers `buffer` (writable, C-contiguous bytes: a numpy array, a
    /// memoryview of shared memory) for `put_region` / `get_region`; returns
    /// its id. The store holds the buffer export until `unregister_region`.
    fn register_region(&self, buffer: &Bound<'_, PyAny>) -> PyResult<u64> {
        self.regions.register(&self.inner, buffer)
    }

    /// New operations on `region` are refused at once; returns when none is
    /// left in flight (its buffer is released then). Raises after `timeout`
    /// seconds with some left (the region stays retired: call again).
    #[pyo3(signature = (region, timeout=None))]
    fn unregister_region(&self, py: Python<'_>, region: u64, timeout: Option<f64>) -> PyResult<()> {
        let t = timeout_of("timeout", timeout)?;
        self.regions.unregister(py, &self.inner, region, t).map_err(to_py)
    }

    /// Regions registered (or retired with operations left).
    #[getter]
    fn region_count(&self) -> usize {
        self.regions.count()
    }

    /// Writes chunk `key` from bytes `[offset, offset + length)` of `region`
    /// (`length` a multiple of 4096, the address 4096-aligned).
    #[pyo3(signature = (key, region, offset, length, *, tenant=Vec::new()),
           text_signature = "($self, key, region, offset, length, *, tenant=b'')")]
    fn put_region(&self, py: Python<'_>, key: Vec<u8>, region: u64, offset: usize, length: usize, tenant: Vec<u8>) -> PyResult<PyIoHandle> {
        let (store, t, r) = (self.inner.clone(), self.submit_timeout, store::RegionId::from_u64(region));
        let k = key.clone();
        let id = py.detach(move || store.put_region_for(&tenant, &k, r, offset, length, t)).map_err(to_py)?;
        Ok(PyIoHandle::new(&self.inner, id, "put", key, None))
    }

    /// Reads chunk `key` into bytes `[offset, offset + length)` of `region`
    /// (a larger chunk is a miss); verified in place before it is ok.
    #[pyo3(signature = (key, region, offset, length, *, tenant=Vec::new()),
           text_signature = "($self, key, region, offset, length, *, tenant=b'')")]
    fn get_region(&self, py: Python<'_>, key: Vec<u8>, region: u64, offset: usize, length: usize, tenant: Vec<u8>) -> PyResult<PyIoHandle> {
        let (store, t, r) = (self.inner.clone(), self.submit_timeout, store::RegionId::from_u64(region));
        let k = key.clone();
        let id = py.detach(move || store.get_region_for(&tenant, &k, r, offset, length, t)).map_err(to_py)?;
        Ok(PyIoHandle::new(&self.inner, id, "get", key, None))
    }

    /// Bounds the bytes prefetches have in flight (one transfer always may):
    /// a get then waits at the device behind at most that much background
    /// work. None: half of the queue depth bounds them (the default).
    #[pyo3(signature = (nbytes))]
    fn set_background_budget(&self, nbytes: Option<usize>) {
        self.inner.set_background_budget(nbytes);
    }

    /// What `set_background_budget` set last (None: never, or removed).
    #[getter]
    fn background_budget(&self) -> Option<usize> {
        self.inner.background_budget()
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
    fn used_bytes(&self) -> u64 {
        self.inner.used_bytes()
    }

    #[getter]
    fn committed_bytes(&self) -> u64 {
        self.inner.committed_bytes()
    }
    #[getter]
    fn capacity_bytes(&self) -> u64 {
        self.inner.capacity_bytes()
    }
    #[getter]
    fn backend(&self) -> &'static str {
        self.inner.backend_name()
    }
    /// Why the backend moves no more bytes (a fatal io_uring error), or None
    /// while it works; new operations then raise `BackendUnavailable`.
    #[getter]
    fn backend_error(&self) -> Option<String> {
        self.inner.backend_failure()
    }
    #[getter]
    fn fixed_buffers(&self) -> bool {
        self.inner.fixed_buffers()
    }
    #[getter]
    fn direct_io(&self) -> bool {
        self.inner.direct_io()
    }
    #[getter]
    fn segment_files(&self) -> bool {
        self.inner.segment_files()
    }
    #[getter]
    fn namespace_dir(&self) -> Vec<String> {
        self.inner.namespace_dirs().iter().map(|p| p.display().to_string()).collect()
    }
    #[getter]
    fn completion_fd(&self) -> i32 {
        self.inner.completion_fd()
    }

    /// `(breaker_opens, breaker_closes, open_dirs)`: what `stats()` says of
    /// the circuit breakers, without the rest of it (a few atomic loads and one
    /// lock per directory; the gate asks once per request).
    fn breaker_health(&self) -> (u64, u64, usize) {
        self.inner.breaker_health()
    }

    fn inflight(&self) -> usize {
        self.inner.in_flight()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.log_notices(py)?;
        report::stats_dict(py, self.inner.snapshot())
    }

    /// Closes the store, then logs what it noticed meanwhile (`log_notices`).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let store = self.inner.clone();
        py.detach(move || store.close());
        self.log_notices(py)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _a: Py<PyAny>, _b: Py<PyAny>, _c: Py<PyAny>) -> PyResult<()> {
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
    d.set_item("seal_buffers", defaults::SEAL_BUFFERS)?;
    d.set_item("submit_timeout", defaults::SUBMIT_TIMEOUT_S)?;
    d.set_item("backend", defaults::BACKEND)?;
    d.set_item("direct_io", defaults::DIRECT_IO)?;
    d.set_item("segment_files", segment_files_name(py, defaults::SEGMENT_FILES))?;
    d.set_item("verify", defaults::VERIFY)?;
    d.set_item("dir_mode", defaults::DIR_MODE)?;
    d.set_item("file_mode", defaults::FILE_MODE)?;
    // None: derived from the slot size (`store::config::default_deadline`).
    d.set_item("io_deadline", py.None())?;
    d.set_item("refresh_interval_s", refresh_name(defaults::REFRESH_INTERVAL_S))?;
    Ok(d)
}

/// The engine's bounds of the `BlockStore`/`StagingPool` counts, inclusive
/// (`store::config::limits`; `StoreConfig::validate` enforces them).
fn engine_limits(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("queue_depth", limits::QUEUE_DEPTH)?;
    d.set_item("max_inflight", limits::MAX_INFLIGHT)?;
    d.set_item("io_threads", limits::IO_THREADS)?;
    d.set_item("chunk_workers", limits::CHUNK_WORKERS)?;
    d.set_item("seal_buffers", limits::SEAL_BUFFERS)?;
    d.set_item("num_slots", limits::NUM_SLOTS)?;
    Ok(d)
}

/// What the existing directory `path`'s filesystem supports, found by
/// trying it (the probe a store runs at open on each storage directory):
/// O_DIRECT (an aligned write and read), O_TMPFILE, fallocate, whether
/// unaligned O_DIRECT is accepted and whether O_DIRECT set after open shows.
#[pyfunction]
// text_signature: PyO3 renders a default it cannot evaluate as `...` (stubtest checks the stub against it).
#[pyo3(signature = (path, *, file_mode=defaults::FILE_MODE), text_signature = "(path, *, file_mode=0o600)")]
fn probe_storage_dir<'py>(py: Python<'py>, path: PathBuf, file_mode: u32) -> PyResult<Bound<'py, PyDict>> {
    if !path.is_dir() {
        return Err(PyValueError::new_err(format!("{} is not a directory", path.display())));
    }
    let s = py.detach(|| crate::disk::files::probe(&path, file_mode));
    report::support_dict(py, &s)
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

/// Reads the key file `path` as a store with `encryption_key_file` would,
/// refusing what it refuses (not a regular file, readable or writable by
/// group or others, not 32 bytes) with the same message, `what` naming the
/// setting; returns the key's id (hex), never a byte of the key.
#[pyfunction]
#[pyo3(signature = (path, *, what="encryption_key_file"))]
fn check_key_file(py: Python<'_>, path: PathBuf, what: &str) -> PyResult<String> {
    let key = py.detach(|| crate::disk::seal::MasterKey::load(&path, what)).map_err(to_py)?;
    Ok(crate::disk::layout::hex(&key.id()))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    errors::add_exceptions(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("HEADER_BYTES", HEADER_BYTES)?;
    m.add("IO_ALIGN", IO_ALIGN)?;
    m.add("BACKENDS", PyTuple::new(py, BackendChoice::CHOICES)?)?;
    m.add("DIRECT_IO_POLICIES", PyTuple::new(py, DirectIoPolicy::CHOICES)?)?;
    m.add("VERIFY_MODES", PyTuple::new(py, VerifyPolicy::CHOICES)?)?;
    m.add("ENGINE_DEFAULTS", engine_defaults(py)?)?;
    m.add("ENGINE_LIMITS", engine_limits(py)?)?;
    m.add("FOREVER_S", limits::FOREVER_S)?;
    m.add("FAULT_INJECTION", cfg!(feature = "fault-injection"))?;
    m.add_function(wrap_pyfunction!(key_hash, m)?)?;
    m.add_function(wrap_pyfunction!(chunk_file_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(digest_range, m)?)?;
    m.add_function(wrap_pyfunction!(check_storage_dir, m)?)?;
    m.add_function(wrap_pyfunction!(check_key_file, m)?)?;
    m.add_function(wrap_pyfunction!(probe_storage_dir, m)?)?;
    m.add("FORMAT_VERSION", FORMAT_VERSION)?;
    m.add_class::<PyStagingPool>()?;
    m.add_class::<SlotBuffer>()?;
    m.add_class::<PyIoResult>()?;
    m.add_class::<PyIoHandle>()?;
    m.add_class::<PyBlockStore>()?;
    Ok(())
}
