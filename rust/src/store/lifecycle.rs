//! The end of a store (`close`, bounded by the deadline) and the threads that
//! guard it meanwhile: the directory workers and the deadline watchdog.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::health;
use super::jobs::DirJob;
use super::{completion, BlockStore, Core};
use crate::error::{EngineError, Result};
use crate::ops::{MissKind, Outcome, Status};
use crate::stats::Stats;

impl BlockStore {
    /// Waits for in-flight I/O, then stops the backend. Idempotent.
    ///
    /// Bounded: operations that do not finish are abandoned by the deadline
    /// watchdog (still running here); what is then still stuck in the kernel
    /// is waited for `CLOSE_GRACE` more. After that the store's threads
    /// are left to end by themselves when the kernel lets go of their work:
    /// they, the staging mapping the kernel may still write (kept by them,
    /// never unmapped under it) and the ring stay until then, or until the
    /// process exits. `stats()["stuck_ops"]` counts such operations.
    pub fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        // First: callers waiting for an op entry fail now instead of taking
        // one after the drain and submitting to a stopped backend.
        self.core.ops.close();
        self.core.scan.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.scanner.lock().unwrap().take() {
            let _ = h.join();
        }
        if let Some(h) = self.refresher.lock().unwrap().take() {
            // A walk blocked on a dead mount must not hold close: the thread
            // sees the stop flag when its syscall returns and exits by itself.
            let until = std::time::Instant::now() + CLOSE_GRACE.min(self.core.health.deadline);
            while !h.is_finished() && std::time::Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            if h.is_finished() {
                let _ = h.join();
            }
        }
        // Others stop counting this store as a writer. The lease files are
        // closed and unlinked by a helper thread, waited for as the refresher
        // is: at once on a working directory (so none of its files stays open
        // after close: an unmount right after succeeds), never longer than the
        // grace on a stalled one (an unlink there can block).
        if let Some(lease) = self.core.lease.lock().unwrap().take() {
            if let Ok(h) = std::thread::Builder::new().name("pykvcache-lease".into()).spawn(move || drop(lease)) {
                let until = std::time::Instant::now() + CLOSE_GRACE.min(self.core.health.deadline);
                while !h.is_finished() && std::time::Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
        let grace = crate::wait::deadline_after(Some(CLOSE_GRACE.min(self.core.health.deadline)));
        let all_ended = self.core.ops.drain(grace);
        if all_ended {
            // No put in flight: this store's record leaves the capacity
            // ledgers. On a helper thread, waited for as the lease's removal.
            let core = self.core.clone();
            // Its segments are sealed there too: nothing more goes into them.
            let work = move || {
                core.seal_segments();
                core.close_ledgers();
            };
            if let Ok(h) = std::thread::Builder::new().name("pykvcache-ledger".into()).spawn(work) {
                let until = std::time::Instant::now() + CLOSE_GRACE.min(self.core.health.deadline);
                while !h.is_finished() && std::time::Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
        self.core.watchdog_stop.store(true, Ordering::Release);
        if let Some(h) = self.watchdog.lock().unwrap().take() {
            let _ = h.join();
        }
        self.core.jobs.stop();
        for q in &self.core.dirs {
            q.stop();
        }
        if !all_ended {
            let stuck = self.core.ops.stuck();
            self.core.stats.record_fallback(format!(
                "closed with {stuck} operation(s) still stuck in the kernel: their threads and staging slots are released when it lets go"
            ));
            self.workers.lock().unwrap().clear();
            self.dir_workers.lock().unwrap().clear();
            self.backend.detach();
            return;
        }
        for w in self.workers.lock().unwrap().drain(..) {
            let _ = w.join();
        }
        for w in self.dir_workers.lock().unwrap().drain(..) {
            let _ = w.join();
        }
        self.backend.shutdown();
    }

    /// The directory workers and the deadline watchdog.
    pub(super) fn start_guards(&self) -> Result<()> {
        let mut dir_workers = self.dir_workers.lock().unwrap();
        for root in 0..self.core.dirs.len() {
            for i in 0..health::DIR_WORKERS {
                let (c, b) = (self.core.clone(), self.backend.clone());
                let h = std::thread::Builder::new()
                    .name(format!("pykvcache-dir{root}-{i}"))
                    .spawn(move || completion::dir_worker(&c, &*b, root))
                    .map_err(|e| EngineError::io("starting directory workers", e))?;
                dir_workers.push(h);
            }
        }
        let c = self.core.clone();
        let h = std::thread::Builder::new()
            .name("pykvcache-deadline".into())
            .spawn(move || c.watchdog())
            .map_err(|e| EngineError::io("starting the deadline watchdog", e))?;
        *self.watchdog.lock().unwrap() = Some(h);
        Ok(())
    }
}

/// How long `close` waits for operations stuck in the kernel once they were
/// abandoned (at most the deadline).
const CLOSE_GRACE: Duration = Duration::from_secs(2);

impl Core {
    /// The deadline watchdog: abandons overdue operations (a miss / a skipped
    /// put for the caller, the slot quarantined), feeds the breakers and
    /// queues their probes. It only takes locks, never touches a file.
    fn watchdog(&self) {
        let tick = (self.health.deadline / 8).clamp(Duration::from_millis(5), Duration::from_millis(100));
        let mut abandoned = Vec::with_capacity(64);
        while !self.watchdog_stop.load(Ordering::Acquire) {
            let now = Instant::now();
            let deadline = self.health.deadline;
            self.ops.abandon_overdue(
                |w| self.health.overdue(w.root as usize, w.since, now),
                |w| {
                    // Under the op table's lock, before the caller can see the
                    // outcome and release the slot: quarantined first.
                    // A region operation keeps its region pinned until its
                    // late `finish`; it has no slot nor ready word.
                    if w.slot != completion::NO_SLOT {
                        self.pool.quarantine(w.slot as usize);
                        // A worker waiting on this read learns it failed now.
                        self.pool.settle_ready(w.slot as usize, w.ready_gen, false);
                    }
                    self.health.dirs[w.root as usize].stuck.fetch_add(1, Ordering::Relaxed);
                    self.health.failure(w.root as usize, true, now);
                    let dir = self.health.dirs[w.root as usize].path.display();
                    let msg = format!("no answer from {dir} within the {:.1} s I/O deadline", deadline.as_secs_f64());
                    if w.put {
                        Stats::add(&self.stats.write_errors, 1);
                        Outcome::new(Status::Error, 0, Some(libc::ETIMEDOUT), format!("{msg}: put skipped"))
                    } else {
                        Stats::add(&self.stats.read_misses, 1);
                        Outcome::miss(MissKind::Unavailable, Some(libc::ETIMEDOUT), format!("{msg}: a miss"))
                    }
                },
                &mut abandoned,
            );
            for root in 0..self.dirs.len() {
                if let health::Due::Probe(number) = self.health.tick(root, now) {
                    self.dirs[root].push(DirJob::Probe { number });
                }
            }
            std::thread::sleep(tick);
        }
    }
}

impl Drop for BlockStore {
    fn drop(&mut self) {
        self.close();
    }
}
