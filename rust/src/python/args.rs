//! The conversions of Python arguments the engine checks further: timeouts
//! in seconds and sizes or counts, each error naming its argument.

use std::time::Duration;

use pyo3::exceptions::{PyOverflowError, PyValueError};
use pyo3::prelude::*;

use crate::faults::SharedFaults;
use crate::store::config::limits::FOREVER_S;
use crate::store::config::IoDeadline;
use crate::store::{RefreshPolicy, SegmentFiles};

/// The one conversion of every timeout argument: seconds, None = forever.
pub(super) fn timeout_of(name: &str, seconds: Option<f64>) -> PyResult<Option<Duration>> {
    match seconds {
        None => Ok(None),
        Some(s) if s.is_nan() || s < 0.0 => Err(PyValueError::new_err(format!("{name} must be >= 0 seconds or None, got {s}"))),
        Some(s) if s > FOREVER_S => Ok(None),
        Some(s) => Duration::try_from_secs_f64(s).map(Some).map_err(|e| PyValueError::new_err(format!("{name}: {e}"))),
    }
}

/// `io_deadline`: None = the engine's default (from the slot size), seconds
/// otherwise, "forever" (above `FOREVER_S`) = no deadline; 0 is refused by
/// `StoreConfig::validate`.
pub(super) fn io_deadline_of(seconds: Option<f64>) -> PyResult<IoDeadline> {
    Ok(match seconds {
        None => IoDeadline::Default,
        Some(_) => timeout_of("io_deadline", seconds)?.map_or(IoDeadline::Never, IoDeadline::After),
    })
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
        $(pub(super) fn $f(ob: &Bound<'_, PyAny>) -> PyResult<$t> { int_arg(ob, $name) })*
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
    seal_buffers_arg: usize = "seal_buffers";
    length_arg: usize = "length";
    payload_bytes_arg: usize = "payload_bytes";
    slot_arg: usize = "slot";
}

/// `refresh_interval_s`: "auto" (walk while another writer's lease is live,
/// decision 0053), a positive number of seconds, or None / 0 (never).
pub(super) fn refresh_arg(ob: &Bound<'_, PyAny>) -> PyResult<RefreshPolicy> {
    if ob.is_none() {
        return Ok(RefreshPolicy::Off);
    }
    if let Ok(text) = ob.extract::<String>() {
        if text == "auto" {
            return Ok(RefreshPolicy::Auto);
        }
    } else if let Ok(s) = ob.extract::<f64>() {
        if s == 0.0 {
            return Ok(RefreshPolicy::Off);
        }
        if s.is_finite() && s > 0.0 {
            return Ok(RefreshPolicy::Every(Duration::from_secs_f64(s.min(FOREVER_S))));
        }
    }
    Err(PyValueError::new_err(format!("refresh_interval_s must be \"auto\", a positive number of seconds, or None/0 (never), not {ob}")))
}

/// `segment_files`: True, False or "auto" (decision 0086).
pub(super) fn segment_files_arg(ob: &Bound<'_, PyAny>) -> PyResult<SegmentFiles> {
    if let Ok(on) = ob.extract::<bool>() {
        return Ok(if on { SegmentFiles::On } else { SegmentFiles::Off });
    }
    match ob.extract::<String>() {
        Ok(text) if text == "auto" => Ok(SegmentFiles::Auto),
        _ => Err(PyValueError::new_err(format!("segment_files must be True, False or \"auto\", not {ob}"))),
    }
}

/// `segment_files` as Python names it: True, False or "auto".
pub(super) fn segment_files_name(py: Python<'_>, s: SegmentFiles) -> Bound<'_, PyAny> {
    match s {
        SegmentFiles::On => pyo3::types::PyBool::new(py, true).to_owned().into_any(),
        SegmentFiles::Off => pyo3::types::PyBool::new(py, false).to_owned().into_any(),
        SegmentFiles::Auto => pyo3::types::PyString::new(py, "auto").into_any(),
    }
}

/// A refresh policy as Python names it: "auto", "off", "every <s> s".
pub(super) fn refresh_name(p: RefreshPolicy) -> String {
    match p {
        RefreshPolicy::Off => "off".to_string(),
        RefreshPolicy::Auto => "auto".to_string(),
        RefreshPolicy::Every(d) => format!("every {:.3} s", d.as_secs_f64()),
    }
}

/// The test hooks of `BlockStore(_fault_max_transfer=, _fault_fail_nth=)`,
/// in a build with the `fault-injection` feature (`make develop`).
#[cfg(feature = "fault-injection")]
pub(super) fn fault_plan(max_transfer: Option<usize>, fail_nth: Option<(u64, i32)>) -> PyResult<SharedFaults> {
    if max_transfer.is_none() && fail_nth.is_none() {
        return Ok(None);
    }
    Ok(Some(std::sync::Arc::new(crate::faults::FaultPlan { max_transfer, fail_nth, ..Default::default() })))
}

/// A build without fault injection (the release wheel) refuses the test
/// hooks, naming them, instead of running without the faults asked for.
#[cfg(not(feature = "fault-injection"))]
pub(super) fn fault_plan(max_transfer: Option<usize>, fail_nth: Option<(u64, i32)>) -> PyResult<SharedFaults> {
    let given: Vec<&str> = [("_fault_max_transfer", max_transfer.is_some()), ("_fault_fail_nth", fail_nth.is_some())]
        .into_iter()
        .filter_map(|(name, set)| set.then_some(name))
        .collect();
    if given.is_empty() {
        return Ok(None);
    }
    Err(pyo3::exceptions::PyTypeError::new_err(format!(
        "{}: test hooks this build of pykvcache does not have (it was built without the fault-injection \
         feature, as release wheels are; `make develop` builds the engine the tests use with it)",
        given.join(", ")
    )))
}
