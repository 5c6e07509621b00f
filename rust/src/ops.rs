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
    /// larger than a slot; sealed with another key or for another tenant, a
    /// plaintext chunk where chunks are sealed, a sealed one where they are
    /// not: "not ours", decision 0083). Reading it again soon would end the same way.
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
    /// A background operation raised to demand priority (`promote`): its
    /// transfers not started yet go with demand ones.
    promoted: bool,
}

/// Where an operation runs and since when, for the deadline watchdog.
#[derive(Clone, Copy, Debug)]
pub struct Watch {
    pub root: u32,
    pub slot: u32,
    pub put: bool,
    pub since: Instant,
    /// A get's ready-word generation (0 for a put): settled failed when abandoned.
    pub ready_gen: u32,
    /// A prefetch (background priority): what `promote` may raise.
    pub background: bool,
}

/// What `OpTable::promote` found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Promotion {
    /// Nothing to do: done, not a background operation, or promoted already.
    No,
    /// Not handed to the backend yet: it will start at demand priority.
    BeforeStart,
    /// Handed to the backend: its queued transfers are the caller's to move.
    Started,
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
        // SAFETY: eventfd takes no pointer; the descriptor is this table's, closed once, in `Drop`.
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
                promoted: false,
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
            e.promoted = false;
            Some(Ok(OpId { index, generation: e.generation }))
        });
        reserved.unwrap_or_else(|TimedOut| {
            Err(EngineError::QueueFull { waited_ms: start.elapsed().as_millis() as u64, max_inflight: self.capacity })
        })
    }

    /// Hands the operation to the backend's accounting; Ok(whether it was
    /// promoted meanwhile: its transfers go at demand priority). Refused
    /// (the context given back) when the store closed since `allocate`: the
    /// backend may be gone, so the caller fails the operation instead of
    /// submitting it. A restart (a put's rewrite after ENOSPC) is always
    /// accepted: closing waits for it.
    // The context moves back by value on refusal (rare); boxing it would cost
    // an allocation on every operation.
    #[allow(clippy::result_large_err)]
    pub fn start(&self, id: OpId, ctx: C, segments: u32) -> std::result::Result<bool, C> {
        let mut t = self.lock();
        let closed = t.closed;
        let e = &mut t.entries[id.index as usize];
        if closed && !e.started {
            return Err(ctx);
        }
        e.started = true;
        e.ctx = Some(ctx);
        e.segs_left = segments;
        Ok(e.promoted)
    }

    /// Raises a background operation still in flight to demand priority
    /// (once; see `Promotion` for what the caller does next).
    pub fn promote(&self, id: OpId) -> Promotion {
        let mut t = self.lock();
        let Ok(e) = Self::entry(&mut t, id) else { return Promotion::No };
        let background = e.watch.is_some_and(|w| w.background);
        if !background || e.promoted || e.outcome.is_some() || e.abandoned {
            return Promotion::No;
        }
        e.promoted = true;
        if e.started {
            Promotion::Started
        } else {
            Promotion::BeforeStart
        }
    }

    /// Whether `promote` raised this operation (false once it is freed).
    pub fn is_promoted(&self, id: OpId) -> bool {
        let mut t = self.lock();
        Self::entry(&mut t, id).is_ok_and(|e| e.promoted)
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
    pub fn segment_done(
        &self,
        index: u32,
        result: std::result::Result<(), SegmentError>,
    ) -> std::result::Result<Option<Finished<C>>, String> {
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
        // SAFETY: writes the 8 bytes of `one`, a live u64 (the size an eventfd takes); `event_fd`
        // is open while `self` lives.
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
        e.promoted = false;
        t.free.push(index);
    }

    /// Starts the deadline clock of a reserved operation.
    pub fn watch(&self, id: OpId, watch: Watch) {
        let mut t = self.lock();
        if let Ok(e) = Self::entry(&mut t, id) {
            e.watch = Some(watch);
        }
    }

    /// Whether the operation's work really ended: no transfer of it will touch
    /// its memory any more. Unlike `is_done`, false for one the watchdog
    /// abandoned (its caller has a time-out, the kernel may still move bytes)
    /// until that work completes. A stale id is settled: an entry is freed,
    /// or reused, only once its work ended (an abandoned one stays busy).
    pub fn is_settled(&self, id: OpId) -> bool {
        let t = self.lock();
        let e = &t.entries[id.index as usize];
        if !e.busy || e.generation != id.generation {
            return true;
        }
        e.outcome.is_some() && !e.abandoned
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
            // SAFETY: writes the 8 bytes of `one`, a live u64; `event_fd` is open while `self`
            // lives.
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
        // SAFETY: `event_fd` is this table's own and closed only here, once; `&mut self` means no
        // other use of it is running.
        unsafe { libc::close(self.event_fd) };
    }
}

#[cfg(test)]
mod tests;
