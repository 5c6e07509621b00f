//! I/O backends: both move whole segments between staging and files and hide
//! short transfers (they resubmit the remainder). The store never sees a
//! partial segment: only success, end-of-file or an errno.

use std::os::fd::RawFd;

pub mod classes;
mod inflight;
pub mod threads;
pub mod uring;

/// One contiguous transfer. `buf` points into the staging mapping, which
/// outlives every in-flight segment (the store holds an `Arc` of the pool).
#[derive(Clone, Copy, Debug)]
pub struct Segment {
    pub op: u32,
    pub fd: RawFd,
    pub buf: *mut u8,
    pub len: usize,
    /// Offset in the chunk image (a chunk file's bytes, or a slot's): what
    /// the store counts pieces and payload by.
    pub offset: u64,
    /// Where the chunk image starts in the file: 0 for a chunk file, the
    /// slot's offset in a segment file (`disk::segment`). The transfer moves
    /// file bytes from `file_base + offset`.
    pub file_base: u64,
    pub write: bool,
    /// Registered-buffer index (the staging slot) when fixed buffers are in use.
    pub buf_index: Option<u16>,
    /// A prefetch: served after demand transfers, on at most half the places
    /// and within the background byte budget (`classes.rs`).
    pub background: bool,
    /// The storage root of its file (each landed segment is progress there).
    pub root: u32,
}

// SAFETY: a segment carries `buf` as an address and never dereferences it; the thread it is sent to
// hands it to the kernel (or to pread/pwrite). The memory it names (a staging slot, a header block,
// a pinned region) belongs to the operation `op`, which keeps it alive and touches none of the
// segment's bytes until the backend reports the segment through `SegmentSink::segment_done`.
unsafe impl Send for Segment {}

impl Segment {
    /// What a backend relies on for each segment it is handed, checked on the
    /// submitter's thread (the ring thread must not panic): bytes to move, in
    /// memory that does not wrap around the address space.
    pub(crate) fn assert_submittable(segs: &[Segment]) {
        for s in segs {
            assert!(s.len > 0, "empty segment submitted for operation {}", s.op);
            assert!((s.buf as usize).checked_add(s.len).is_some(), "segment of operation {} wraps around the address space", s.op);
        }
    }
}

impl classes::Queued for Segment {
    fn background(&self) -> bool {
        self.background
    }
    fn make_demand(&mut self) {
        self.background = false;
    }
    fn op(&self) -> u32 {
        self.op
    }
    fn bytes(&self) -> usize {
        self.len
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegmentError {
    /// A read hit end-of-file before the segment was full (truncated file).
    Eof,
    Errno(i32),
    /// The backend failed as a whole (this errno from `io_uring_enter`):
    /// the segment was not, or not entirely, transferred.
    BackendFailed(i32),
}

/// Receives segment completions (the store's operation table). Called on the
/// backend's own thread(s): implementations hand work on and return.
pub trait SegmentSink: Send + Sync {
    fn segment_done(&self, seg: &Segment, result: Result<(), SegmentError>);
    /// `segment_done` of a transfer that left the backend with nothing else
    /// in flight or queued: its thread would wait idle, so work the sink
    /// would hand to another thread may run here instead.
    fn segment_done_alone(&self, seg: &Segment, result: Result<(), SegmentError>) {
        self.segment_done(seg, result)
    }
    /// Part of `seg` was transferred (a short transfer, resubmitted): the
    /// storage is moving bytes, however slowly.
    fn moved(&self, _seg: &Segment) {}
    /// Something that cannot happen did (a completion for an empty ring
    /// slot, ...): the backend goes on and reports it here instead of panicking.
    fn anomaly(&self, what: String);
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    IoUring,
    Threads,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::IoUring => "io_uring",
            BackendKind::Threads => "threads",
        }
    }
}

pub trait Backend: Send + Sync {
    fn submit(&self, segs: &[Segment]);
    /// Completes everything already submitted, then stops the worker thread(s).
    fn shutdown(&self);
    /// Like `shutdown`, without waiting: transfers stuck in the kernel keep
    /// their thread(s), which end by themselves once those transfers do.
    fn detach(&self);
    fn kind(&self) -> BackendKind;
    fn fixed_buffers(&self) -> bool;
    /// CPU time (user+sys) spent by the backend's own threads so far.
    fn cpu_time_ns(&self) -> u64;
    /// Why the backend can move no more bytes (a fatal kernel error), once
    /// that happened: every pending segment was failed, and segments
    /// submitted from then on fail at once. None while it works.
    fn failure(&self) -> Option<String> {
        None
    }
    /// Moves the queued background segments of operation `op` (its op-table
    /// index) to the demand queue; returns how many moved (0: all started).
    fn promote(&self, op: u32) -> usize;
    /// Bounds the bytes background segments have in flight (None: only the
    /// count cap, the default). Takes effect for segments started from now on.
    fn set_background_budget(&self, bytes: Option<usize>);
}

/// CPU time of one thread, from its own clock.
pub fn thread_cpu_clock() -> libc::clockid_t {
    let mut clock: libc::clockid_t = 0;
    // SAFETY: `pthread_self()` is the calling thread, alive during the call, and `clock` a writable
    // clockid_t.
    unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut clock) };
    clock
}

pub fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a writable timespec; an invalid clock only fails the call (EINVAL), handled
    // here.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
