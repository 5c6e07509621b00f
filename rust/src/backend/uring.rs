//! io_uring backend: one dedicated thread owns the ring (one ring per thread,
//! as TigerBeetle does). Submitters queue segments in the shared class queue
//! (`classes.rs`: demand first, background bounded) and wake the thread with
//! an eventfd whose read is itself armed in the ring, so the thread sleeps in
//! exactly one place (`submit_and_wait`). Segments beyond the queue depth
//! wait in that queue, where a promotion or a new background budget still
//! reaches them; the in-flight table is allocated once, so steady state
//! allocates nothing per I/O.
//!
//! The ring thread only moves bytes: every completion goes to the sink, which
//! hands it on (see `store::completion`). It never panics: a fatal
//! `io_uring_enter` error fails every pending segment (queued, in the
//! overflow, pushed but not submitted, and — after a bounded wait for the
//! kernel to finish them — in flight) with `SegmentError::BackendFailed`,
//! marks the backend dead (`Backend::failure`) and ends the thread; segments
//! submitted after that fail at once, on the submitter's thread.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types, IoUring};

use super::classes::{ClassQueue, Queued};
use super::inflight::{InFlight, Pending};
use super::{clock_ns, thread_cpu_clock, Backend, BackendKind, Segment, SegmentError, SegmentSink};
use crate::faults::SharedFaults;

/// The submission queue depths a ring is built with (inclusive; the store's
/// `limits::QUEUE_DEPTH`): others are clamped to them.
pub const DEPTH_LIMITS: (usize, usize) = (1, 4096);
const WAKE_TOKEN: u64 = u64::MAX;
/// Largest transfer one SQE carries (the kernel's length field is 32-bit).
const MAX_SQE_BYTES: usize = 1 << 30;
/// After a fatal ring error, how long the thread waits for transfers the
/// kernel already has to complete before failing them anyway (regular-file
/// I/O takes milliseconds; the staging slots they target stay mapped).
const REAP_BUDGET: Duration = Duration::from_secs(2);

pub struct UringBackend {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    fixed: bool,
}

struct Shared {
    /// Segments not started yet (submitted, or a short transfer's remainder).
    queue: Mutex<ClassQueue<Pending>>,
    /// Set (under the `queue` lock) when the ring failed: why, and the errno.
    failure: Mutex<Option<(String, i32)>>,
    dead: AtomicBool,
    sink: Arc<dyn SegmentSink>,
    stop: AtomicBool,
    wake_fd: RawFd,
    cpu_ns: AtomicU64,
    /// Target of the armed eventfd read; lives as long as the ring can write it.
    wake_buf: AtomicU64,
}

/// Why fixed buffers could not be used, when they were asked for.
pub struct UringSetup {
    pub backend: UringBackend,
    pub fixed_buffer_error: Option<std::io::Error>,
}

impl UringBackend {
    /// Fails with the kernel's error when io_uring itself is unavailable.
    /// Buffer registration failure (RLIMIT_MEMLOCK) is not fatal: the backend
    /// then uses non-fixed reads/writes and reports why.
    // Returns the backend with why fixed buffers were refused, if they were.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(
        queue_depth: usize,
        buffers: Option<&[libc::iovec]>,
        sink: Arc<dyn SegmentSink>,
        faults: SharedFaults,
    ) -> std::io::Result<UringSetup> {
        let queue_depth = queue_depth.clamp(DEPTH_LIMITS.0, DEPTH_LIMITS.1);
        let entries = (queue_depth as u32 + 1).next_power_of_two();
        let ring = IoUring::builder().build(entries)?;
        let mut fixed_buffer_error = None;
        let mut fixed = false;
        if let Some(iovecs) = buffers {
            // SAFETY: the iovecs cover the staging mapping and the store's seal buffers, which
            // outlive the ring: the ring lives on the ring thread, and that thread holds the store's
            // core (the sink), which owns the seal buffers and an `Arc` of the pool, until the ring
            // is dropped.
            match unsafe { ring.submitter().register_buffers(iovecs) } {
                Ok(()) => fixed = true,
                Err(e) => fixed_buffer_error = Some(e),
            }
        }
        // SAFETY: eventfd takes no pointer; the descriptor is owned by `Shared` and closed once, in
        // its `Drop`.
        let wake_fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if wake_fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let shared = Arc::new(Shared {
            queue: Mutex::new(ClassQueue::new(queue_depth * 4, queue_depth / 2)),
            failure: Mutex::new(None),
            dead: AtomicBool::new(false),
            sink,
            stop: AtomicBool::new(false),
            wake_fd,
            cpu_ns: AtomicU64::new(0),
            wake_buf: AtomicU64::new(0),
        });
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("pykvcache-uring".into())
            .spawn(move || ring_loop(ring, queue_depth, fixed, &thread_shared, &faults))?;
        Ok(UringSetup { backend: UringBackend { shared, thread: Mutex::new(Some(thread)), fixed }, fixed_buffer_error })
    }

    fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes the 8 bytes of `one`, a live u64 (the size an eventfd takes); `wake_fd`
        // stays open while `self.shared` lives.
        unsafe { libc::write(self.shared.wake_fd, &one as *const u64 as *const _, 8) };
    }
}

impl Queued for Pending {
    fn background(&self) -> bool {
        self.seg.background
    }
    fn make_demand(&mut self) {
        self.seg.background = false;
    }
    fn op(&self) -> u32 {
        self.seg.op
    }
    /// What is left to transfer: unchanged between its start and its completion.
    fn bytes(&self) -> usize {
        self.seg.len - self.done
    }
}

/// A lock the ring thread takes: also after a panic elsewhere poisoned it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn ring_loop(mut ring: IoUring, depth: usize, fixed: bool, shared: &Shared, faults: &SharedFaults) {
    let sink = &*shared.sink;
    let clock = thread_cpu_clock();
    let mut in_flight = InFlight::new(depth);
    let mut wake_armed = false;
    // Segments failed by an injected fault, reported once the queue's lock is let go.
    let mut injected: Vec<(Segment, i32)> = Vec::new();
    // Slots whose SQEs were pushed since the last successful enter: an enter
    // that fails submits nothing, so the kernel never saw these.
    let mut unsubmitted: Vec<usize> = Vec::with_capacity(depth);

    loop {
        if !wake_armed {
            let sqe = opcode::Read::new(types::Fd(shared.wake_fd), shared.wake_buf.as_ptr() as *mut u8, 8).build().user_data(WAKE_TOKEN);
            // SAFETY: the read targets `shared.wake_buf` (8 bytes) from `wake_fd`, both owned by
            // `Shared`, which this thread holds an `Arc` of for as long as the ring exists: the
            // kernel never writes freed memory.
            if unsafe { ring.submission().push(&sqe) }.is_ok() {
                wake_armed = true;
            }
        }
        {
            let mut queue = lock(&shared.queue);
            while let Some(idx) = in_flight.next_free() {
                let Some(p) = queue.pop() else { break };
                if let Some(errno) = faults.as_ref().and_then(|f| f.injected_errno()) {
                    queue.finished(&p);
                    injected.push((p.seg, errno));
                    continue;
                }
                let sqe = build_sqe(&p, fixed, faults, idx as u64);
                // SAFETY: the entry moves the bytes of `p`'s segment, memory its operation keeps
                // alive until `segment_done`, which this thread calls only once the completion for
                // token `idx` arrived (or `fail_everything` gave up on it). `idx` is a free place of
                // `in_flight`, so no other entry in flight carries that token, and `p`, just taken
                // off the queue, is in flight in no other entry.
                if unsafe { ring.submission().push(&sqe) }.is_err() {
                    queue.unpop(p);
                    break;
                }
                in_flight.occupy(idx, p);
                unsubmitted.push(idx);
            }
        }
        for (seg, errno) in injected.drain(..) {
            sink.segment_done(&seg, Err(SegmentError::Errno(errno)));
        }
        if shared.stop.load(Ordering::Acquire) && in_flight.is_empty() && lock(&shared.queue).is_empty() {
            break;
        }
        let entered = match faults.as_ref().and_then(|f| f.injected_enter_errno()) {
            Some(errno) => Err(std::io::Error::from_raw_os_error(errno)),
            None => ring.submit_and_wait(1),
        };
        match entered {
            Ok(_) => unsubmitted.clear(),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EBUSY) | Some(libc::EAGAIN)) => {}
            Err(e) => {
                let failed = Failed { errno: e.raw_os_error().unwrap_or(libc::EIO), reason: format!("io_uring_enter failed: {e}") };
                return fail_everything(&mut ring, shared, in_flight, &unsubmitted, failed);
            }
        }
        let mut cq = ring.completion();
        cq.sync();
        for cqe in &mut cq {
            let token = cqe.user_data();
            let res = cqe.result();
            if token == WAKE_TOKEN {
                wake_armed = false;
                continue;
            }
            let Some(mut p) = in_flight.complete(token) else {
                sink.anomaly(format!("io_uring completion for ring slot {token}, which holds no transfer (result {res})"));
                continue;
            };
            // Before `done` moves: the bytes it held of the background budget.
            lock(&shared.queue).finished(&p);
            if res == -libc::EINTR || res == -libc::EAGAIN {
                lock(&shared.queue).push_front(p);
            } else if res < 0 {
                sink.segment_done(&p.seg, Err(SegmentError::Errno(-res)));
            } else if res == 0 {
                let err = if p.seg.write { SegmentError::Errno(libc::EIO) } else { SegmentError::Eof };
                sink.segment_done(&p.seg, Err(err));
            } else {
                p.done += res as usize;
                if p.done < p.seg.len {
                    // Short transfer: resubmit the remainder first, ahead of newer work.
                    sink.moved(&p.seg);
                    lock(&shared.queue).push_front(p);
                } else if in_flight.is_empty() && lock(&shared.queue).is_empty() {
                    sink.segment_done_alone(&p.seg, Ok(()));
                } else {
                    sink.segment_done(&p.seg, Ok(()));
                }
            }
        }
        shared.cpu_ns.store(clock_ns(clock), Ordering::Relaxed);
    }
    drop(ring);
}

/// Why the ring failed, for the segments failed because of it.
struct Failed {
    errno: i32,
    reason: String,
}

/// The ring cannot be entered any more: marks the backend dead and fails
/// every segment it holds. Segments in flight in the kernel are waited for
/// (at most `REAP_BUDGET`) so that a transfer still landing in a staging slot
/// is not reported done while it runs; what completes in time reports its
/// real result.
fn fail_everything(ring: &mut IoUring, shared: &Shared, mut in_flight: InFlight, unsubmitted: &[usize], failed: Failed) {
    let sink = &*shared.sink;
    let err = SegmentError::BackendFailed(failed.errno);
    let queued: Vec<Pending> = {
        // Under the `queue` lock: a submitter either queued before this
        // (drained here) or sees `dead` and fails its segments itself.
        let mut queue = lock(&shared.queue);
        *lock(&shared.failure) = Some((failed.reason, failed.errno));
        shared.dead.store(true, Ordering::Release);
        queue.take_all().collect()
    };
    for p in &queued {
        sink.segment_done(&p.seg, Err(err));
    }
    for &idx in unsubmitted {
        if let Some(p) = in_flight.complete(idx as u64) {
            sink.segment_done(&p.seg, Err(err));
        }
    }
    let deadline = Instant::now() + REAP_BUDGET;
    while !in_flight.is_empty() && Instant::now() < deadline {
        let mut cq = ring.completion();
        cq.sync();
        let mut reaped = 0;
        for cqe in &mut cq {
            reaped += 1;
            let (token, res) = (cqe.user_data(), cqe.result());
            let Some(p) = in_flight.complete(token) else { continue };
            let result = if res >= 0 && p.done + res as usize >= p.seg.len {
                Ok(())
            } else if res < 0 && res != -libc::EINTR && res != -libc::EAGAIN {
                Err(SegmentError::Errno(-res))
            } else {
                // Short, or to be retried: there is no ring to resubmit it on.
                Err(err)
            };
            sink.segment_done(&p.seg, result);
        }
        drop(cq);
        if reaped == 0 {
            // A syscall also runs the task work that posts completions.
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    for p in in_flight.drain() {
        sink.anomaly(format!(
            "io_uring transfer still in flight {REAP_BUDGET:?} after the ring failed: failed anyway (offset {}, {} bytes)",
            p.seg.offset, p.seg.len
        ));
        sink.segment_done(&p.seg, Err(err));
    }
}

fn build_sqe(p: &Pending, fixed: bool, faults: &SharedFaults, token: u64) -> squeue::Entry {
    // Segments are submitted non-empty (asserted in `submit`) and a finished one is reported,
    // never queued again: something is always left. (Checked in debug builds only: this is the
    // ring thread, which must not panic.)
    debug_assert!(p.done < p.seg.len, "segment of operation {} queued with nothing left ({} of {} bytes)", p.seg.op, p.done, p.seg.len);
    let remaining = p.seg.len - p.done;
    let len = faults.as_ref().map_or(remaining, |f| f.cap(remaining)).min(MAX_SQE_BYTES) as u32;
    // SAFETY: `p.done < p.seg.len` (see above), so the pointer stays inside the segment's memory.
    let buf = unsafe { p.seg.buf.add(p.done) };
    let offset = p.seg.file_base + p.seg.offset + p.done as u64;
    let fd = types::Fd(p.seg.fd);
    let entry = match (p.seg.write, fixed.then_some(p.seg.buf_index).flatten()) {
        (false, Some(i)) => opcode::ReadFixed::new(fd, buf, len, i).offset(offset).build(),
        (true, Some(i)) => opcode::WriteFixed::new(fd, buf, len, i).offset(offset).build(),
        (false, None) => opcode::Read::new(fd, buf, len).offset(offset).build(),
        (true, None) => opcode::Write::new(fd, buf, len).offset(offset).build(),
    };
    entry.user_data(token)
}

impl Backend for UringBackend {
    fn submit(&self, segs: &[Segment]) {
        Segment::assert_submittable(segs);
        let mut queue = lock(&self.shared.queue);
        if self.shared.dead.load(Ordering::Acquire) {
            drop(queue);
            let errno = lock(&self.shared.failure).as_ref().map_or(libc::EIO, |f| f.1);
            for seg in segs {
                self.shared.sink.segment_done(seg, Err(SegmentError::BackendFailed(errno)));
            }
            return;
        }
        for seg in segs {
            queue.push_back(Pending { seg: *seg, done: 0 });
        }
        drop(queue);
        self.wake();
    }

    fn promote(&self, op: u32) -> usize {
        let moved = lock(&self.shared.queue).promote(op);
        if moved > 0 {
            // The ring thread may sleep with free places it kept from background work.
            self.wake();
        }
        moved
    }

    fn set_background_budget(&self, bytes: Option<usize>) {
        lock(&self.shared.queue).set_background_budget(bytes);
        self.wake();
    }

    fn failure(&self) -> Option<String> {
        lock(&self.shared.failure).as_ref().map(|f| f.0.clone())
    }

    fn shutdown(&self) {
        self.shared.stop.store(true, Ordering::Release);
        self.wake();
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }

    fn detach(&self) {
        self.shared.stop.store(true, Ordering::Release);
        self.wake();
        // The thread keeps the ring, its wake-up eventfd and (through the
        // sink) the staging mapping until the kernel ends what it holds.
        drop(lock(&self.thread).take());
    }

    fn kind(&self) -> BackendKind {
        BackendKind::IoUring
    }

    fn fixed_buffers(&self) -> bool {
        self.fixed
    }

    fn cpu_time_ns(&self) -> u64 {
        self.shared.cpu_ns.load(Ordering::Relaxed)
    }
}

impl Drop for UringBackend {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Here, not in the backend's drop: a detached ring thread still arms reads of it.
        // SAFETY: `wake_fd` is this `Shared`'s own (opened in `UringBackend::new`) and closed only
        // here, once; the ring that armed reads of it lived on the ring thread, which held this
        // `Arc` until the ring was gone.
        unsafe { libc::close(self.wake_fd) };
    }
}
