//! Deterministic fault injection for tests: exercises the real resubmission
//! and error paths of the backends and the store without a faulty device.
//!
//! Compiled in with the `fault-injection` feature only (`cargo test` turns it
//! on through the crate's dev-dependency on itself; `make develop` builds the
//! extension the tests use with it, for the `_fault_*` keywords; the release
//! wheel is built without it, and refuses those keywords). Without
//! it `FaultPlan` has no knobs and cannot be built: every hook below is a
//! no-op the compiler removes, and `SharedFaults` is always `None`.

use std::sync::Arc;

#[cfg(feature = "fault-injection")]
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

#[cfg(feature = "fault-injection")]
#[derive(Default, Debug)]
pub struct FaultPlan {
    /// Cap every transfer at this many bytes, forcing short-I/O handling.
    pub max_transfer: Option<usize>,
    /// Fail the n-th submitted transfer (1-based) with this errno.
    pub fail_nth: Option<(u64, i32)>,
    pub counter: AtomicU64,
    /// A background index scan takes this lock between walking the tree and
    /// merging what it found: a test holding it observes the store mid-scan.
    pub scan_hold: Option<Arc<std::sync::Mutex<()>>>,
    /// When non-zero: the io_uring thread's next `io_uring_enter` fails with
    /// this errno (taken once), as a fatal kernel error would.
    pub enter_errno: AtomicI32,
}

#[cfg(not(feature = "fault-injection"))]
#[derive(Debug)]
pub struct FaultPlan {
    _none: (),
}

pub type SharedFaults = Option<Arc<FaultPlan>>;

#[cfg(feature = "fault-injection")]
impl FaultPlan {
    pub fn cap(&self, len: usize) -> usize {
        self.max_transfer.map_or(len, |m| len.min(m))
    }

    pub fn injected_errno(&self) -> Option<i32> {
        let (n, errno) = self.fail_nth?;
        let seen = self.counter.fetch_add(1, Ordering::Relaxed) + 1;
        (seen == n).then_some(errno)
    }

    /// Makes the next `io_uring_enter` fail with `errno`.
    pub fn fail_next_enter(&self, errno: i32) {
        self.enter_errno.store(errno, Ordering::Release);
    }

    pub fn injected_enter_errno(&self) -> Option<i32> {
        match self.enter_errno.swap(0, Ordering::AcqRel) {
            0 => None,
            e => Some(e),
        }
    }

    pub fn scan_hold(&self) -> Option<std::sync::MutexGuard<'_, ()>> {
        self.scan_hold.as_ref().map(|m| m.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

#[cfg(not(feature = "fault-injection"))]
impl FaultPlan {
    #[inline(always)]
    pub fn cap(&self, len: usize) -> usize {
        len
    }

    #[inline(always)]
    pub fn injected_errno(&self) -> Option<i32> {
        None
    }

    #[inline(always)]
    pub fn injected_enter_errno(&self) -> Option<i32> {
        None
    }

    #[inline(always)]
    pub fn scan_hold(&self) -> Option<std::sync::MutexGuard<'_, ()>> {
        None
    }
}
