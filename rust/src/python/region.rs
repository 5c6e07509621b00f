//! The Python buffers behind a store's registered regions (`store::region`):
//! each registration holds its buffer export (`PyBuffer`), so the exporter
//! cannot free or resize the memory while the engine may move bytes in it.
//! The export is released only once the engine says no operation is left.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use crate::error::{EngineError, Result};
use crate::store::{self, RegionId};

/// How long dropping a store object waits for a region's operations before
/// it leaks the buffer export instead (memory kept, never a fault).
const DROP_WAIT: Duration = Duration::from_secs(5);

#[derive(Default)]
pub(super) struct Exports {
    held: Mutex<HashMap<u64, PyBuffer<u8>>>,
}

impl Exports {
    /// Registers the memory of `buffer` (writable, C-contiguous bytes) with `store`.
    pub(super) fn register(&self, store: &store::BlockStore, buffer: &Bound<'_, PyAny>) -> PyResult<u64> {
        let buf = PyBuffer::<u8>::get(buffer)?;
        let refused = if buf.readonly() {
            Some("a region must be writable (gets land in it)")
        } else if !buf.is_c_contiguous() {
            Some("a region must be C-contiguous")
        } else {
            None
        };
        if let Some(why) = refused {
            return Err(super::errors::to_py(EngineError::invalid(why)));
        }
        // SAFETY: `buf` keeps the export (and so the memory) alive until `unregister` saw the
        // engine let go of it.
        let id = unsafe { store.register_region(buf.buf_ptr() as *mut u8, buf.len_bytes()) }.map_err(super::errors::to_py)?;
        self.held.lock().unwrap().insert(id.to_u64(), buf);
        Ok(id.to_u64())
    }

    /// Unregisters `id` in the engine (without the GIL: it waits for the
    /// region's operations), then releases its buffer export.
    pub(super) fn unregister(&self, py: Python<'_>, store: &Arc<store::BlockStore>, id: u64, timeout: Option<Duration>) -> Result<()> {
        let s = store.clone();
        py.detach(move || s.unregister_region(RegionId::from_u64(id), timeout))?;
        let released = self.held.lock().unwrap().remove(&id);
        drop(released);
        Ok(())
    }

    /// Regions still held (registered, or retired with operations left).
    pub(super) fn count(&self) -> usize {
        self.held.lock().unwrap().len()
    }

    /// The store object is going away: each export is released once its
    /// region has no operation left (handles may outlive the object), or
    /// leaked when operations stay stuck past `DROP_WAIT`.
    pub(super) fn release_all(&self, store: &store::BlockStore) {
        let held: Vec<_> = self.held.lock().unwrap().drain().collect();
        for (id, buf) in held {
            match store.unregister_region(RegionId::from_u64(id), Some(DROP_WAIT)) {
                Ok(()) => drop(buf),
                Err(_) => std::mem::forget(buf),
            }
        }
    }
}
