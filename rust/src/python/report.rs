//! What the store reports to Python: `stats()` as a dict built from one
//! `StoreSnapshot`, and the engine's messages on the `pykvcache` logger.
//! The one place the glue logs; never called from put, get or wait.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::disk::files::FsSupport;
use crate::notice::Notice;
use crate::stats::LATENCY_BUCKETS_US;
use crate::store::{OpenReport, StoreSnapshot};

fn logger(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    py.import("logging")?.call_method1("getLogger", ("pykvcache",))
}

/// Logs each notice once, at the level the engine gave it.
pub(super) fn log_notices(py: Python<'_>, notices: Vec<Notice>) -> PyResult<()> {
    if notices.is_empty() {
        return Ok(());
    }
    let logger = logger(py)?;
    for n in notices {
        logger.call_method1(n.level.name(), ("pykvcache: %s", n.text))?;
    }
    Ok(())
}

/// What opening the store found: fallbacks and warnings, notes (other
/// namespaces found) and each directory's probe at info.
pub(super) fn log_open(py: Python<'_>, report: &OpenReport, snapshot: &StoreSnapshot) -> PyResult<()> {
    let logger = logger(py)?;
    for f in &report.fallbacks {
        logger.call_method1("warning", ("pykvcache fallback: %s", f))?;
    }
    for w in &report.warnings {
        logger.call_method1("warning", ("pykvcache: %s", w))?;
    }
    for n in &report.notes {
        logger.call_method1("info", ("pykvcache: %s", n))?;
    }
    for (dir, s) in &snapshot.storage_support {
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
                deadline_s(snapshot.io_deadline),
            ),
        )?;
    }
    Ok(())
}

/// A deadline in seconds, `inf` for none (`IoDeadline::Never`).
fn deadline_s(d: std::time::Duration) -> f64 {
    if d >= crate::store::config::NO_DEADLINE {
        f64::INFINITY
    } else {
        d.as_secs_f64()
    }
}

pub(super) fn support_dict<'py>(py: Python<'py>, s: &FsSupport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("o_direct", s.direct)?;
    d.set_item("o_tmpfile", s.tmpfile)?;
    d.set_item("fallocate", s.fallocate)?;
    d.set_item("unaligned_o_direct_accepted", s.direct_unaligned)?;
    d.set_item("o_direct_settable_after_open", s.direct_set_after_open)?;
    d.set_item("rename_noreplace", s.rename_noreplace)?;
    d.set_item("punch_hole", s.punch_hole)?;
    Ok(d)
}

/// `BlockStore.stats()`: every key of `StoreStats` (`_core.pyi`), in the order it always had.
pub(super) fn stats_dict(py: Python<'_>, s: StoreSnapshot) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for (name, v) in &s.health {
        d.set_item(name, v)?;
    }
    d.set_item("stuck_ops", s.stuck_ops)?;
    d.set_item("quarantined_slots", s.quarantined_slots)?;
    d.set_item("quarantine_releases", s.quarantine_releases)?;
    d.set_item("breaker_open_dirs", s.dir_states.iter().filter(|st| **st != "closed").count())?;
    d.set_item("dir_states", &s.dir_states)?;
    d.set_item("io_deadline_s", deadline_s(s.io_deadline))?;
    // By when the watchdog has settled any operation it started: a waiter in
    // another process (vLLM's worker) gives up only after this (decision 0065).
    let factor = crate::store::health::HARD_DEADLINE_FACTOR + 1;
    d.set_item("io_verdict_bound_s", deadline_s(s.io_deadline.saturating_mul(factor)))?;
    let probes = PyDict::new(py);
    for (dir, sup) in &s.storage_support {
        probes.set_item(dir.display().to_string(), support_dict(py, sup)?)?;
    }
    d.set_item("storage_probes", probes)?;
    for (name, v) in &s.counters {
        d.set_item(name, v)?;
    }
    d.set_item("read_latency_hist", s.read_latency_hist)?;
    d.set_item("write_latency_hist", s.write_latency_hist)?;
    let bounds: Vec<f64> = LATENCY_BUCKETS_US.iter().map(|&b| if b == u64::MAX { f64::INFINITY } else { b as f64 }).collect();
    d.set_item("latency_bucket_bounds_us", bounds)?;
    d.set_item("backend", s.backend)?;
    d.set_item("backend_error", s.backend_error.unwrap_or_default())?;
    d.set_item("fixed_buffers", s.fixed_buffers)?;
    d.set_item("direct_io", s.direct_io)?;
    d.set_item("fallbacks", s.fallbacks)?;
    d.set_item("inflight", s.inflight)?;
    d.set_item("chunks", s.chunks)?;
    d.set_item("filler_chunks", s.filler_chunks)?;
    d.set_item("used_bytes", s.used_bytes)?;
    d.set_item("other_namespace_chunks", s.other_namespace_chunks)?;
    d.set_item("other_namespace_bytes", s.other_namespace_bytes)?;
    d.set_item("other_writers", s.other_writers)?;
    d.set_item("refresh_mode", super::args::refresh_name(s.refresh_policy))?;
    d.set_item("capacity_bytes", s.capacity_bytes)?;
    d.set_item("configured_capacity_bytes", s.configured_capacity_bytes)?;
    d.set_item("min_free_bytes", s.min_free_bytes)?;
    d.set_item("backend_cpu_s", s.backend_cpu.as_nanos() as f64 / 1e9)?;
    d.set_item("chunk_worker_cpu_s", s.chunk_worker_cpu.as_nanos() as f64 / 1e9)?;
    d.set_item("scan_complete", s.scan.done)?;
    d.set_item("open_scan_chunks", s.scan.chunks)?;
    d.set_item("open_scan_s", s.scan.time.as_secs_f64())?;
    d.set_item("open_scan_error", s.scan.error.unwrap_or_default())?;
    d.set_item("staging_free_slots", s.staging_free_slots)?;
    // Sealing (decision 0083): ids derived from the keys, never key bytes.
    let sealing = s.sealing.as_ref();
    d.set_item("sealing", sealing.is_some())?;
    d.set_item("encryption_key_id", sealing.map(|x| x.key_id.clone()).unwrap_or_default())?;
    d.set_item("encryption_previous_key_id", sealing.map(|x| x.previous_key_id.clone()).unwrap_or_default())?;
    d.set_item("seal_buffers", sealing.map_or(0, |x| x.seal_buffers))?;
    d.set_item("seal_buffers_free", sealing.map_or(0, |x| x.seal_buffers_free))?;
    d.set_item("sealed_tenants_cached", sealing.map_or(0, |x| x.tenants_cached))?;
    Ok(d)
}
