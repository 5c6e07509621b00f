//! The table of operations in flight: fixed capacity (the backpressure
//! bound), generation-checked handles, one condition variable for waiters and
//! an eventfd for event loops. Generic over what an operation carries (`C`,
//! the store's `OpContext`): it counts segments and keeps the first error,
//! and knows nothing of files, checksums or staging.
//!
//! An entry's life: `allocate` (reserved, owned by the submitting thread) →
//! `start` (handed to the backend with its segment count; or `cancel`) →
//! `segment_done` for each segment, the last returns the context →
//! `complete` (the outcome is visible to `wait`/`is_done`, the eventfd
//! fires) → `release` by the handle (free; or at `complete` when the handle
//! was released first).

use std::os::fd::RawFd;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::backend::SegmentError;
use crate::error::{EngineError, Result};
use crate::wait::{deadline_after, wait_until, TimedOut};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ok,
    Miss,
    Corrupt,
    Error,
}

impl Status {
    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Miss => "miss",
            Status::Corrupt => "corrupt",
            Status::Error => "error",
        }
    }
}

/// What became of the chunk file of a get that served nothing, as the store
/// judged it where it found out. The one verdict on a file: nothing above the
/// store deletes a chunk file after a failed read (decision 0050).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MissKind {
    /// No chunk file under the key's name; the index forgot the key.
    Absent,
    /// A sound file this store does not serve and leaves in place, indexed:
    /// another writer's (no payload checksum to verify, unknown header flags,
    /// larger than a slot). Reading it again soon would end the same way.
    Kept,
    /// The file could not be read, so it was not judged: the directory did
    /// not answer (deadline, storage errno, open breaker) or the read failed
    /// (status `Error`). The file is untouched and stays indexed.
    Unavailable,
    /// It failed verification: the store removed it.
    Corrupt,
}

impl MissKind {
    pub fn name(self) -> &'static str {
        match self {
            MissKind::Absent => "absent",
            MissKind::Kept => "kept",
            MissKind::Unavailable => "unavailable",
            MissKind::Corrupt => "corrupt",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Outcome {
    pub status: Status,
    pub length: u64,
    pub errno: Option<i32>,
    pub message: String,
    pub latency: Duration,
    /// Gets that served nothing: the file's fate. None for puts and hits.
    pub miss_kind: Option<MissKind>,
}

impl Outcome {
    /// An outcome of status `status`; a `Corrupt` one is of kind `Corrupt`
    /// (the store removes what it finds corrupt), any other of no kind.
    pub fn new(status: Status, length: u64, errno: Option<i32>, message: impl Into<String>) -> Self {
        let miss_kind = (status == Status::Corrupt).then_some(MissKind::Corrupt);
        Outcome { status, length, errno, message: message.into(), latency: Duration::ZERO, miss_kind }
    }

    /// A get that served nothing, of kind `kind` (status `miss`).
    pub fn miss(kind: MissKind, errno: Option<i32>, message: impl Into<String>) -> Self {
        Outcome { miss_kind: Some(kind), ..Outcome::new(Status::Miss, 0, errno, message) }
    }
}

struct OpEntry<C> {
    generation: u32,
    busy: bool,
    /// Handed to the backend (`start`): it completes by itself, and closing
    /// waits for it. An entry reserved but not started belongs to the thread
    /// submitting it, which either starts, fails or cancels it.
    started: bool,
    segs_left: u32,
    error: Option<SegmentError>,
    ctx: Option<C>,
    outcome: Option<Outcome>,
    /// The handle was dropped before completion: free the entry when done.
    detached: bool,
    /// What the deadline watchdog needs: where and since when.
    watch: Option<Watch>,
    /// Past its deadline: the outcome (a miss / a skipped put) was given to
    /// the caller, but the kernel may still be working on it. The entry stays
    /// busy until that work really ends (`complete`), then frees.
    abandoned: bool,
}

/// Where an operation runs and since when, for the deadline watchdog.
#[derive(Clone, Copy, Debug)]
pub struct Watch {
    pub root: u32,
    pub slot: u32,
    pub put: bool,
    pub since: Instant,
}

/// An operation the watchdog just abandoned.
#[derive(Clone, Copy, Debug)]
pub struct Abandoned {
    /// Its watch: where and since when (the caller's side effects were done under the lock).
    #[allow(dead_code)]
    pub watch: Watch,
}

/// An operation whose last segment completed.
#[derive(Debug)]
pub struct Finished<C> {
    pub id: OpId,
    pub ctx: C,
    pub error: Option<SegmentError>,
}

struct Table<C> {
    entries: Vec<OpEntry<C>>,
    free: Vec<u32>,
    /// Set by `close`: nothing is reserved or started from then on.
    closed: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpId {
    pub index: u32,
    pub generation: u32,
}

pub struct OpTable<C> {
    table: Mutex<Table<C>>,
    completed: Condvar,
    freed: Condvar,
    capacity: usize,
    event_fd: RawFd,
}

impl<C> OpTable<C> {
    pub fn new(capacity: usize) -> Result<Self> {
        // u32 indices: the store bounds `max_inflight` far below this.
        let capacity = capacity.clamp(1, u32::MAX as usize);
        let event_fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if event_fd < 0 {
            return Err(EngineError::last_os("creating completion eventfd"));
        }
        let entries = (0..capacity)
            .map(|_| OpEntry {
                generation: 0,
                busy: false,
                started: false,
                segs_left: 0,
                error: None,
                ctx: None,
                outcome: None,
                detached: false,
                watch: None,
                abandoned: false,
            })
            .collect();
        Ok(OpTable {
            table: Mutex::new(Table { entries, free: (0..capacity as u32).rev().collect(), closed: false }),
            completed: Condvar::new(),
            freed: Condvar::new(),
            capacity,
            event_fd,
        })
    }

    /// The table, also after a panic elsewhere poisoned the lock: its state is
    /// updated in single steps, and the ring thread must not panic on it.
    fn lock(&self) -> MutexGuard<'_, Table<C>> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn event_fd(&self) -> RawFd {
        self.event_fd
    }

    pub fn in_flight(&self) -> usize {
        let t = self.lock();
        t.entries.iter().filter(|e| e.busy && e.outcome.is_none()).count()
    }

    /// Reserves an entry, waiting up to `timeout` for one to free up.
    pub fn allocate(&self, timeout: Option<Duration>) -> Result<OpId> {
        let start = Instant::now();
        let reserved = wait_until(&self.table, &self.freed, deadline_after(timeout), |t| {
            if t.closed {
                // Also wakes a caller that waited here while the store closed:
                // it gets this error, not an entry nobody would ever complete.
                return Some(Err(EngineError::State("store is closed".into())));
            }
            let index = t.free.pop()?;
            let e = &mut t.entries[index as usize];
            e.busy = true;
            e.started = false;
            e.generation = e.generation.wrapping_add(1);
            e.segs_left = 0;
            e.error = None;
            e.ctx = None;
            e.outcome = None;
            e.detached = false;
            e.watch = None;
            e.abandoned = false;
            Some(Ok(OpId { index, generation: e.generation }))
        });
        reserved.unwrap_or_else(|TimedOut| {
            Err(EngineError::QueueFull { waited_ms: start.elapsed().as_millis() as u64, max_inflight: self.capacity })
        })
    }

    /// Hands the operation to the backend's accounting. Refused (the context
    /// given back) when the store closed since `allocate`: the backend may be
    /// gone, so the caller fails the operation instead of submitting it. A
    /// restart (a put's rewrite after ENOSPC) is always accepted: closing
    /// waits for it.
    // The context moves back by value on refusal (rare); boxing it would cost
    // an allocation on every operation.
    #[allow(clippy::result_large_err)]
    pub fn start(&self, id: OpId, ctx: C, segments: u32) -> std::result::Result<(), C> {
        let mut t = self.lock();
        let closed = t.closed;
        let e = &mut t.entries[id.index as usize];
        if closed && !e.started {
            return Err(ctx);
        }
        e.started = true;
        e.ctx = Some(ctx);
        e.segs_left = segments;
        Ok(())
    }

    /// Gives back an entry that was reserved but never started (the
    /// submission was refused): no completion will ever free it otherwise.
    pub fn cancel(&self, id: OpId) {
        let mut t = self.lock();
        let e = &t.entries[id.index as usize];
        if !e.busy || e.generation != id.generation || e.started {
            debug_assert!(false, "cancel of an operation that is not reserved");
            return;
        }
        Self::free_entry(&mut t, id.index);
        drop(t);
        self.freed.notify_one();
    }

    /// Refuses new operations from now on and wakes every caller waiting for
    /// an entry (they fail with "store is closed").
    pub fn close(&self) {
        self.lock().closed = true;
        self.freed.notify_all();
    }

    /// Runs `f` on the context of an operation in flight; None when the
    /// entry holds none (a stray completion: the caller logs it).
    pub fn with_context<R>(&self, index: u32, f: impl FnOnce(&C) -> R) -> Option<R> {
        let t = self.lock();
        t.entries.get(index as usize)?.ctx.as_ref().map(f)
    }

    /// Records one segment's result; returns the operation when it was the
    /// last segment. A completion for an entry with no segments left (which
    /// no backend sends) is an `Err` for the caller to log: it runs on the
    /// ring thread, which must not panic.
    pub fn segment_done(&self, index: u32, result: std::result::Result<(), SegmentError>) -> std::result::Result<Option<Finished<C>>, String> {
        let mut t = self.lock();
        let Some(e) = t.entries.get_mut(index as usize) else {
            return Err(format!("segment completion for operation {index}, beyond the table"));
        };
        if e.segs_left == 0 || e.ctx.is_none() {
            return Err(format!("segment completion for operation {index}, which has no segment in flight"));
        }
        if let Err(err) = result {
            e.error.get_or_insert(err);
        }
        e.segs_left -= 1;
        if e.segs_left > 0 {
            return Ok(None);
        }
        let ctx = e.ctx.take().expect("checked above");
        Ok(Some(Finished { id: OpId { index, generation: e.generation }, ctx, error: e.error.take() }))
    }

    pub fn complete(&self, id: OpId, outcome: Outcome) {
        let mut t = self.lock();
        let e = &mut t.entries[id.index as usize];
        debug_assert_eq!(e.generation, id.generation);
        if e.abandoned {
            // The caller has its outcome already (the time-out); the work
            // that ended late only frees the entry.
            e.abandoned = false;
            if e.detached {
                Self::free_entry(&mut t, id.index);
            }
            drop(t);
            self.freed.notify_one();
            self.completed.notify_all();
            return;
        }
        if e.detached {
            Self::free_entry(&mut t, id.index);
            drop(t);
            self.freed.notify_one();
        } else {
            e.outcome = Some(outcome);
            drop(t);
        }
        self.completed.notify_all();
        let one: u64 = 1;
        unsafe { libc::write(self.event_fd, &one as *const u64 as *const _, 8) };
    }

    fn entry<'a>(t: &'a mut MutexGuard<'_, Table<C>>, id: OpId) -> Result<&'a mut OpEntry<C>> {
        let e = &mut t.entries[id.index as usize];
        if !e.busy || e.generation != id.generation {
            return Err(EngineError::State("stale operation handle".into()));
        }
        Ok(e)
    }

    pub fn is_done(&self, id: OpId) -> Result<bool> {
        let mut t = self.lock();
        Ok(Self::entry(&mut t, id)?.outcome.is_some())
    }

    /// Waits for completion; `Ok(None)` on timeout. The entry stays reserved
    /// until `release` so that repeated waits see the same outcome.
    pub fn wait(&self, id: OpId, timeout: Option<Duration>) -> Result<Option<Outcome>> {
        let waited = wait_until(&self.table, &self.completed, deadline_after(timeout), |t| {
            let e = &t.entries[id.index as usize];
            if !e.busy || e.generation != id.generation {
                return Some(Err(EngineError::State("stale operation handle".into())));
            }
            e.outcome.clone().map(Ok)
        });
        match waited {
            Ok(outcome) => outcome.map(Some),
            Err(TimedOut) => Ok(None),
        }
    }

    /// The handle is gone: free now if complete, else when it completes.
    pub fn release(&self, id: OpId) {
        let mut t = self.lock();
        let Ok(e) = Self::entry(&mut t, id) else { return };
        if e.outcome.is_some() && !e.abandoned {
            Self::free_entry(&mut t, id.index);
            drop(t);
            self.freed.notify_one();
        } else {
            e.detached = true;
        }
    }

    fn free_entry(t: &mut Table<C>, index: u32) {
        let e = &mut t.entries[index as usize];
        e.busy = false;
        e.started = false;
        e.outcome = None;
        e.detached = false;
        e.watch = None;
        e.abandoned = false;
        t.free.push(index);
    }

    /// Starts the deadline clock of a reserved operation.
    pub fn watch(&self, id: OpId, watch: Watch) {
        let mut t = self.lock();
        if let Ok(e) = Self::entry(&mut t, id) {
            e.watch = Some(watch);
        }
    }

    /// Whether the watchdog gave up on this operation (its late work only cleans up).
    pub fn is_abandoned(&self, id: OpId) -> bool {
        let t = self.lock();
        let e = &t.entries[id.index as usize];
        e.busy && e.generation == id.generation && e.abandoned
    }

    /// Abandons every unfinished operation `overdue` picks: each gets the
    /// outcome `outcome` gives it (visible to `wait`, the eventfd fires) and
    /// stays busy until its late work completes. Returns what it abandoned.
    pub fn abandon_overdue(
        &self,
        mut overdue: impl FnMut(&Watch) -> bool,
        mut outcome: impl FnMut(&Watch) -> Outcome,
        into: &mut Vec<Abandoned>,
    ) {
        into.clear();
        let mut t = self.lock();
        for e in t.entries.iter_mut() {
            let Some(w) = e.watch else { continue };
            if !e.busy || e.abandoned || e.outcome.is_some() || !overdue(&w) {
                continue;
            }
            e.abandoned = true;
            e.outcome = Some(outcome(&w));
            into.push(Abandoned { watch: w });
        }
        drop(t);
        if !into.is_empty() {
            self.completed.notify_all();
            let one: u64 = 1;
            unsafe { libc::write(self.event_fd, &one as *const u64 as *const _, 8) };
        }
    }

    /// Operations abandoned whose work has not ended yet, per root.
    pub fn stuck(&self) -> usize {
        self.lock().entries.iter().filter(|e| e.busy && e.abandoned).count()
    }

    /// Waits until nothing handed to the backend is in flight (used when
    /// closing, after `close`). Entries only reserved are not waited for:
    /// their submitter fails or cancels them (`start` refuses once closed),
    /// so a submission that never started cannot hang the close.
    ///
    /// Abandoned operations (their work stuck in the kernel) are waited for
    /// until `deadline` only; false when some were still stuck then.
    pub fn drain(&self, deadline: Option<Instant>) -> bool {
        let live = wait_until(&self.table, &self.completed, None, |t| {
            // Watched but not started: queued on a directory worker, which
            // starts it (refused once closed) or the watchdog abandons it.
            let live = |e: &OpEntry<C>| e.busy && (e.started || e.watch.is_some()) && e.outcome.is_none() && !e.abandoned;
            (!t.entries.iter().any(live)).then_some(())
        });
        debug_assert!(live.is_ok(), "no deadline, no time-out");
        wait_until(&self.table, &self.completed, deadline, |t| (!t.entries.iter().any(|e| e.busy && e.abandoned)).then_some(())).is_ok()
    }
}

impl<C> Drop for OpTable<C> {
    fn drop(&mut self) {
        unsafe { libc::close(self.event_fd) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// What an operation carries does not matter to the table: a label here.
    type Table = OpTable<&'static str>;

    fn ok() -> Outcome {
        Outcome::new(Status::Ok, 0, None, "")
    }

    #[test]
    fn a_refused_submission_gives_its_entry_back() {
        // issue 14 item 6: `release` of an entry that was never started
        // marked it detached and it stayed busy for good.
        let ops = Table::new(2).unwrap();
        for _ in 0..10 {
            let id = ops.allocate(Some(Duration::ZERO)).unwrap();
            ops.cancel(id);
        }
        assert_eq!(ops.in_flight(), 0);
        let a = ops.allocate(Some(Duration::ZERO)).unwrap();
        let b = ops.allocate(Some(Duration::ZERO)).unwrap();
        assert_ne!(a.index, b.index, "both entries are free again");
        assert!(matches!(ops.allocate(Some(Duration::ZERO)), Err(EngineError::QueueFull { .. })));
        assert!(ops.is_done(OpId { index: a.index, generation: a.generation.wrapping_sub(1) }).is_err(), "old handles stay stale");
    }

    #[test]
    fn close_wakes_waiters_and_refuses_unstarted_operations() {
        // issue 14 item 8: a caller waiting for an entry while the store
        // closes must fail, not take an entry after the drain.
        let ops = Arc::new(Table::new(1).unwrap());
        let held = ops.allocate(None).unwrap();
        let o = ops.clone();
        let waiter = std::thread::spawn(move || o.allocate(Some(Duration::from_secs(30))));
        std::thread::sleep(Duration::from_millis(100));
        let t0 = Instant::now();
        ops.close();
        let err = waiter.join().unwrap().unwrap_err();
        assert!(err.to_string().contains("closed"), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(5));
        // Reserved before the close, started after it: refused, context given back.
        assert_eq!(ops.start(held, "get", 1), Err("get"));
        // Not started, so the drain does not wait for it (it would hang).
        assert!(ops.drain(None));
        ops.complete(held, Outcome::new(Status::Error, 0, None, "closed"));
        ops.release(held);
        assert_eq!(ops.in_flight(), 0);
        assert!(ops.allocate(Some(Duration::ZERO)).is_err(), "closed tables reserve nothing");
    }

    #[test]
    fn started_operations_are_drained_and_may_restart_while_closing() {
        let ops = Arc::new(Table::new(1).unwrap());
        let id = ops.allocate(None).unwrap();
        assert!(ops.start(id, "put", 1).is_ok());
        ops.close();
        // A put's rewrite after ENOSPC restarts a started operation: accepted.
        let done = ops.segment_done(id.index, Ok(())).unwrap().unwrap();
        assert!(ops.start(id, done.ctx, 1).is_ok());
        let o = ops.clone();
        let finisher = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            o.segment_done(id.index, Ok(())).unwrap().unwrap();
            o.complete(id, ok());
        });
        assert!(ops.drain(None));
        assert!(ops.is_done(id).unwrap(), "drain returned before the started operation completed");
        finisher.join().unwrap();
    }

    #[test]
    fn huge_wait_timeouts_do_not_overflow_the_clock() {
        let ops = Table::new(1).unwrap();
        let id = ops.allocate(None).unwrap();
        assert!(ops.start(id, "get", 1).is_ok());
        ops.segment_done(id.index, Ok(())).unwrap().unwrap();
        ops.complete(id, ok());
        // `Instant::now() + Duration::MAX` panics; a deadline past the clock is none.
        assert!(ops.wait(id, Some(Duration::MAX)).unwrap().is_some());
    }

    #[test]
    fn the_last_segment_returns_the_context_with_the_first_error() {
        let ops = Table::new(1).unwrap();
        let id = ops.allocate(None).unwrap();
        ops.start(id, "get", 3).unwrap();
        assert!(ops.segment_done(id.index, Ok(())).unwrap().is_none());
        assert!(ops.segment_done(id.index, Err(SegmentError::Errno(libc::EIO))).unwrap().is_none());
        assert_eq!(ops.in_flight(), 1);
        let done = ops.segment_done(id.index, Err(SegmentError::Eof)).unwrap().expect("last segment");
        assert_eq!((done.id, done.ctx, done.error), (id, "get", Some(SegmentError::Errno(libc::EIO))), "the first error is kept");
        // A stray completion (no segment left) is reported, not a panic or an underflow.
        assert!(ops.segment_done(id.index, Ok(())).unwrap_err().contains("no segment in flight"));
        assert!(ops.segment_done(99, Ok(())).unwrap_err().contains("beyond the table"));
        assert_eq!(ops.with_context(id.index, |c| *c), None, "the context left with the last segment");
    }

    #[test]
    fn wait_times_out_then_sees_the_outcome_until_release() {
        let ops = Arc::new(Table::new(1).unwrap());
        let id = ops.allocate(None).unwrap();
        ops.start(id, "get", 1).unwrap();
        assert!(!ops.is_done(id).unwrap());
        let t0 = Instant::now();
        assert!(ops.wait(id, Some(Duration::from_millis(30))).unwrap().is_none(), "time-out is Ok(None)");
        assert!(t0.elapsed() >= Duration::from_millis(30));
        let o = ops.clone();
        let completer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            o.segment_done(id.index, Ok(())).unwrap().unwrap();
            o.complete(id, Outcome::new(Status::Miss, 0, None, "absent"));
        });
        assert_eq!(ops.wait(id, None).unwrap().unwrap().status, Status::Miss);
        completer.join().unwrap();
        assert_eq!(ops.wait(id, Some(Duration::ZERO)).unwrap().unwrap().message, "absent", "repeated waits see the same outcome");
        ops.release(id);
        assert!(ops.wait(id, None).is_err(), "a released handle is stale");
        assert!(ops.allocate(Some(Duration::ZERO)).is_ok(), "release freed the entry");
    }

    #[test]
    fn a_released_handle_frees_its_entry_on_completion_and_wakes_a_waiter() {
        let ops = Arc::new(Table::new(1).unwrap());
        let id = ops.allocate(None).unwrap();
        ops.start(id, "put", 1).unwrap();
        ops.release(id); // detached: still in flight
        assert_eq!(ops.in_flight(), 1);
        assert!(matches!(ops.allocate(Some(Duration::from_millis(20))), Err(EngineError::QueueFull { max_inflight: 1, .. })));
        let o = ops.clone();
        let waiter = std::thread::spawn(move || o.allocate(Some(Duration::from_secs(30))));
        std::thread::sleep(Duration::from_millis(50));
        ops.segment_done(id.index, Ok(())).unwrap().unwrap();
        ops.complete(id, ok());
        let next = waiter.join().unwrap().expect("the completion freed the entry");
        assert_eq!(next.index, id.index);
        assert_ne!(next.generation, id.generation);
        assert!(ops.is_done(id).is_err(), "the old handle is stale");
    }

    #[test]
    fn an_abandoned_operation_answers_at_once_and_frees_only_when_its_work_ends() {
        let ops = Table::new(1).unwrap();
        let id = ops.allocate(None).unwrap();
        let since = Instant::now();
        ops.watch(id, Watch { root: 0, slot: 3, put: false, since });
        ops.start(id, "get", 1).unwrap();
        let mut out = Vec::new();
        ops.abandon_overdue(|w| w.since <= Instant::now(), |_| Outcome::new(Status::Miss, 0, Some(libc::ETIMEDOUT), "timed out"), &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].watch.slot, 3);
        let o = ops.wait(id, Some(Duration::ZERO)).unwrap().expect("the caller has its outcome");
        assert_eq!((o.status, o.errno), (Status::Miss, Some(libc::ETIMEDOUT)));
        assert!(ops.is_abandoned(id) && ops.stuck() == 1);
        ops.abandon_overdue(|_| true, |_| unreachable!("abandoned once"), &mut out);
        assert!(out.is_empty());
        ops.release(id); // the handle is gone, the kernel is not done: still busy
        assert!(ops.allocate(Some(Duration::ZERO)).is_err());
        assert!(!ops.drain(Some(Instant::now() + Duration::from_millis(20))), "close gives up on stuck work");
        let done = ops.segment_done(id.index, Ok(())).unwrap().unwrap();
        ops.complete(done.id, ok());
        assert_eq!(ops.stuck(), 0);
        assert!(ops.drain(Some(Instant::now())));
        assert!(ops.allocate(Some(Duration::ZERO)).is_ok(), "freed when its work ended");
    }

    #[test]
    fn completions_signal_the_eventfd() {
        let ops = Table::new(1).unwrap();
        let id = ops.allocate(None).unwrap();
        ops.start(id, "get", 1).unwrap();
        let mut n: u64 = 0;
        let read = |n: &mut u64| unsafe { libc::read(ops.event_fd(), n as *mut u64 as *mut _, 8) };
        assert_eq!(read(&mut n), -1, "nothing completed yet (non-blocking)");
        ops.segment_done(id.index, Ok(())).unwrap().unwrap();
        ops.complete(id, ok());
        assert_eq!(read(&mut n), 8);
        assert_eq!(n, 1);
    }
}
