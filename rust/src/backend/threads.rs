//! Fallback backend: a fixed pool of threads doing blocking pread/pwrite.
//! Used when io_uring setup is refused (kernel.io_uring_disabled, seccomp
//! profiles of container runtimes, old kernels) or when configured.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use super::classes::ClassQueue;
use super::{clock_ns, thread_cpu_clock, Backend, BackendKind, Segment, SegmentError, SegmentSink};
use crate::faults::SharedFaults;

pub struct ThreadBackend {
    shared: Arc<Shared>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
    sink: Arc<dyn SegmentSink>,
    faults: SharedFaults,
    cpu_ns: Vec<AtomicU64>,
}

struct Queue {
    segments: ClassQueue<Segment>,
    stop: bool,
}

impl ThreadBackend {
    pub fn new(threads: usize, capacity: usize, sink: Arc<dyn SegmentSink>, faults: SharedFaults) -> std::io::Result<Self> {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue { segments: ClassQueue::new(capacity, threads / 2), stop: false }),
            ready: Condvar::new(),
            sink,
            faults,
            cpu_ns: (0..threads).map(|_| AtomicU64::new(0)).collect(),
        });
        let mut workers = Vec::with_capacity(threads);
        for i in 0..threads {
            let shared = shared.clone();
            workers.push(std::thread::Builder::new().name(format!("pykvcache-io-{i}")).spawn(move || worker_loop(&shared, i))?);
        }
        Ok(ThreadBackend { shared, workers: Mutex::new(workers) })
    }
}

fn worker_loop(shared: &Shared, index: usize) {
    let clock = thread_cpu_clock();
    loop {
        let seg = {
            let mut q = shared.queue.lock().unwrap();
            loop {
                if let Some(seg) = q.segments.pop() {
                    break seg;
                }
                if q.stop {
                    return;
                }
                q = shared.ready.wait(q).unwrap();
            }
        };
        let result = transfer(&seg, &shared.faults, &*shared.sink);
        if seg.background {
            shared.queue.lock().unwrap().segments.finished(&seg);
            // A worker may be asleep with background work it was not allowed to take.
            shared.ready.notify_one();
        }
        shared.sink.segment_done(&seg, result);
        shared.cpu_ns[index].store(clock_ns(clock), Ordering::Relaxed);
    }
}

fn transfer(seg: &Segment, faults: &SharedFaults, sink: &dyn SegmentSink) -> Result<(), SegmentError> {
    if let Some(errno) = faults.as_ref().and_then(|f| f.injected_errno()) {
        return Err(SegmentError::Errno(errno));
    }
    let mut done = 0usize;
    while done < seg.len {
        let want = faults.as_ref().map_or(seg.len - done, |f| f.cap(seg.len - done));
        // SAFETY: `done < seg.len` and the segment's memory spans `seg.len` bytes from `seg.buf`
        // (one slot, header block or region), so the pointer stays inside it.
        let buf = unsafe { seg.buf.add(done) };
        let off = (seg.file_base + seg.offset + done as u64) as libc::off_t;
        // SAFETY: `buf` is valid for `want <= seg.len - done` bytes (`cap` only lowers a length);
        // the operation owning the segment keeps that memory alive and leaves its bytes alone until
        // `segment_done` is called, after this loop. pread writes, pwrite reads at most `want`
        // bytes.
        let n = unsafe {
            if seg.write {
                libc::pwrite(seg.fd, buf as *const _, want, off)
            } else {
                libc::pread(seg.fd, buf as *mut _, want, off)
            }
        };
        if n < 0 {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
            if errno == libc::EINTR || errno == libc::EAGAIN {
                continue;
            }
            return Err(SegmentError::Errno(errno));
        }
        if n == 0 {
            return Err(if seg.write { SegmentError::Errno(libc::EIO) } else { SegmentError::Eof });
        }
        done += n as usize;
        if done < seg.len {
            sink.moved(seg);
        }
    }
    Ok(())
}

impl Backend for ThreadBackend {
    fn submit(&self, segs: &[Segment]) {
        Segment::assert_submittable(segs);
        let mut q = self.shared.queue.lock().unwrap();
        for seg in segs {
            q.segments.push_back(*seg);
        }
        drop(q);
        if segs.len() == 1 {
            self.shared.ready.notify_one();
        } else {
            self.shared.ready.notify_all();
        }
    }

    fn shutdown(&self) {
        self.shared.queue.lock().unwrap().stop = true;
        self.shared.ready.notify_all();
        for w in self.workers.lock().unwrap().drain(..) {
            let _ = w.join();
        }
    }

    fn detach(&self) {
        self.shared.queue.lock().unwrap().stop = true;
        self.shared.ready.notify_all();
        self.workers.lock().unwrap().clear();
    }

    fn promote(&self, op: u32) -> usize {
        let moved = self.shared.queue.lock().unwrap().segments.promote(op);
        if moved > 0 {
            // A worker may be asleep with background work it was not allowed to take.
            self.shared.ready.notify_all();
        }
        moved
    }

    fn set_background_budget(&self, bytes: Option<usize>) {
        self.shared.queue.lock().unwrap().segments.set_background_budget(bytes);
        self.shared.ready.notify_all();
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Threads
    }

    fn fixed_buffers(&self) -> bool {
        false
    }

    fn cpu_time_ns(&self) -> u64 {
        self.shared.cpu_ns.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }
}

impl Drop for ThreadBackend {
    fn drop(&mut self) {
        self.shutdown();
    }
}
