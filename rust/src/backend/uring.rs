//! io_uring backend: one dedicated thread owns the ring (one ring per thread,
//! as TigerBeetle does). Submitters hand segments over through a queue and
//! wake the thread with an eventfd whose read is itself armed in the ring, so
//! the thread sleeps in exactly one place (`submit_and_wait`). Segments beyond
//! the queue depth wait in an explicit overflow queue; the in-flight table is
//! allocated once, so steady state allocates nothing per I/O.

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use io_uring::{opcode, squeue, types, IoUring};

use super::classes::ClassQueue;
use super::{clock_ns, thread_cpu_clock, Backend, BackendKind, Segment, SegmentError, SegmentSink, SharedFaults};

const WAKE_TOKEN: u64 = u64::MAX;
/// Largest transfer one SQE carries (the kernel's length field is 32-bit).
const MAX_SQE_BYTES: usize = 1 << 30;

pub struct UringBackend {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    fixed: bool,
}

struct Shared {
    incoming: Mutex<VecDeque<Segment>>,
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
    pub fn new(
        queue_depth: usize,
        buffers: Option<&[libc::iovec]>,
        sink: Arc<dyn SegmentSink>,
        faults: SharedFaults,
    ) -> std::io::Result<UringSetup> {
        let queue_depth = queue_depth.clamp(1, 4096);
        let entries = (queue_depth as u32 + 1).next_power_of_two();
        let ring = IoUring::builder().build(entries)?;
        let mut fixed_buffer_error = None;
        let mut fixed = false;
        if let Some(iovecs) = buffers {
            // Safety: the iovecs cover the staging mapping, which the store
            // keeps alive for longer than this backend.
            match unsafe { ring.submitter().register_buffers(iovecs) } {
                Ok(()) => fixed = true,
                Err(e) => fixed_buffer_error = Some(e),
            }
        }
        let wake_fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if wake_fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let shared = Arc::new(Shared {
            incoming: Mutex::new(VecDeque::with_capacity(queue_depth * 4)),
            stop: AtomicBool::new(false),
            wake_fd,
            cpu_ns: AtomicU64::new(0),
            wake_buf: AtomicU64::new(0),
        });
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("pykvcache-uring".into())
            .spawn(move || ring_loop(ring, queue_depth, fixed, &thread_shared, &*sink, &faults))?;
        Ok(UringSetup {
            backend: UringBackend { shared, thread: Mutex::new(Some(thread)), fixed },
            fixed_buffer_error,
        })
    }

    fn wake(&self) {
        let one: u64 = 1;
        unsafe { libc::write(self.shared.wake_fd, &one as *const u64 as *const _, 8) };
    }
}

struct Pending {
    seg: Segment,
    done: usize,
}

fn ring_loop(mut ring: IoUring, depth: usize, fixed: bool, shared: &Shared, sink: &dyn SegmentSink, faults: &SharedFaults) {
    let clock = thread_cpu_clock();
    let mut slots: Vec<Option<Pending>> = (0..depth).map(|_| None).collect();
    let mut free: Vec<usize> = (0..depth).rev().collect();
    let mut overflow: ClassQueue<Pending> = ClassQueue::new(depth * 4, depth / 2);
    let mut wake_armed = false;

    loop {
        {
            let mut incoming = shared.incoming.lock().unwrap();
            for seg in incoming.drain(..) {
                let background = seg.background;
                overflow.push_back(Pending { seg, done: 0 }, background);
            }
        }
        if !wake_armed {
            let sqe = opcode::Read::new(types::Fd(shared.wake_fd), shared.wake_buf.as_ptr() as *mut u8, 8)
                .build()
                .user_data(WAKE_TOKEN);
            if unsafe { ring.submission().push(&sqe) }.is_ok() {
                wake_armed = true;
            }
        }
        while let Some(&idx) = free.last() {
            let Some((p, background)) = overflow.pop() else { break };
            if let Some(errno) = faults.as_ref().and_then(|f| f.injected_errno()) {
                overflow.finished(background);
                sink.segment_done(&p.seg, Err(SegmentError::Errno(errno)));
                continue;
            }
            let sqe = build_sqe(&p, fixed, faults, idx as u64);
            if unsafe { ring.submission().push(&sqe) }.is_err() {
                overflow.unpop(p, background);
                break;
            }
            free.pop();
            slots[idx] = Some(p);
        }
        let in_flight = depth - free.len();
        if shared.stop.load(Ordering::Acquire) && in_flight == 0 && overflow.is_empty() && shared.incoming.lock().unwrap().is_empty() {
            break;
        }
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EBUSY) | Some(libc::EAGAIN)) => {}
            Err(e) => panic!("io_uring_enter failed: {e}"),
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
            let idx = token as usize;
            let mut p = slots[idx].take().expect("completion for an empty slot");
            free.push(idx);
            let background = p.seg.background;
            overflow.finished(background);
            if res == -libc::EINTR || res == -libc::EAGAIN {
                overflow.push_front(p, background);
            } else if res < 0 {
                sink.segment_done(&p.seg, Err(SegmentError::Errno(-res)));
            } else if res == 0 {
                let err = if p.seg.write { SegmentError::Errno(libc::EIO) } else { SegmentError::Eof };
                sink.segment_done(&p.seg, Err(err));
            } else {
                p.done += res as usize;
                if p.done < p.seg.len {
                    // Short transfer: resubmit the remainder first, ahead of newer work.
                    overflow.push_front(p, background);
                } else {
                    sink.segment_done(&p.seg, Ok(()));
                }
            }
        }
        shared.cpu_ns.store(clock_ns(clock), Ordering::Relaxed);
    }
    drop(ring);
}

fn build_sqe(p: &Pending, fixed: bool, faults: &SharedFaults, token: u64) -> squeue::Entry {
    let remaining = p.seg.len - p.done;
    let len = faults.as_ref().map_or(remaining, |f| f.cap(remaining)).min(MAX_SQE_BYTES) as u32;
    let buf = unsafe { p.seg.buf.add(p.done) };
    let offset = p.seg.offset + p.done as u64;
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
        self.shared.incoming.lock().unwrap().extend(segs.iter().copied());
        self.wake();
    }

    fn shutdown(&self) {
        self.shared.stop.store(true, Ordering::Release);
        self.wake();
        if let Some(t) = self.thread.lock().unwrap().take() {
            let _ = t.join();
        }
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
        unsafe { libc::close(self.shared.wake_fd) };
    }
}
