//! The table of operations in flight: fixed capacity (the backpressure
//! bound), generation-checked handles, one condition variable for waiters and
//! an eventfd for event loops.

use std::os::fd::RawFd;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::backend::SegmentError;
use crate::checksum::crc32c_combine;
use crate::error::{EngineError, Result};
use crate::files::PendingFile;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    Put,
    Get,
}

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

#[derive(Clone, Debug)]
pub struct Outcome {
    pub status: Status,
    pub length: u64,
    pub errno: Option<i32>,
    pub message: String,
    pub latency: Duration,
}

impl Outcome {
    pub fn new(status: Status, length: u64, errno: Option<i32>, message: impl Into<String>) -> Self {
        Outcome { status, length, errno, message: message.into(), latency: Duration::ZERO }
    }
}

/// Everything the completion path needs to finish an operation.
pub struct OpContext {
    pub kind: OpKind,
    pub key: Vec<u8>,
    pub hash: u128,
    pub slot: usize,
    pub root: usize,
    pub direct: bool,
    pub read_fd: RawFd,
    pub write_file: Option<PendingFile>,
    pub file_len: usize,
    pub payload_len: usize,
    pub started: Instant,
    /// A prefetch: its transfers yield to demand ones (see backend::classes).
    pub background: bool,
    /// A put that hit ENOSPC evicts and retries once.
    pub enospc_retried: bool,
    /// Bytes this put reserved against the capacity (0 once released).
    pub reserved: u64,
}

struct OpEntry {
    generation: u32,
    busy: bool,
    /// Handed to the backend (`start`): it completes by itself, and closing
    /// waits for it. An entry reserved but not started belongs to the thread
    /// submitting it, which either starts, fails or cancels it.
    started: bool,
    segs_left: u32,
    error: Option<SegmentError>,
    ctx: Option<OpContext>,
    outcome: Option<Outcome>,
    /// The handle was dropped before completion: free the entry when done.
    detached: bool,
    /// CRC-32C and length of the payload bytes of each read segment, filled
    /// as segments are verified (any order). Grown to the most segments this
    /// entry has carried, never shrunk: allocation stops once warm, and memory
    /// follows the operations really in flight, not the configured maximum.
    piece_crcs: Vec<(u32, u64)>,
}

/// CRC-32C of the first `len` payload bytes of a chunk, from the pieces
/// checksummed while the rest of the chunk was still being read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCrc {
    pub crc: u32,
    pub len: u64,
}

/// An operation whose last segment completed.
pub struct Finished {
    pub id: OpId,
    pub ctx: OpContext,
    pub error: Option<SegmentError>,
    pub prefix_crc: PrefixCrc,
}

struct Table {
    entries: Vec<OpEntry>,
    free: Vec<u32>,
    /// Set by `close`: nothing is reserved or started from then on.
    closed: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpId {
    pub index: u32,
    pub generation: u32,
}

pub struct OpTable {
    table: Mutex<Table>,
    completed: Condvar,
    freed: Condvar,
    capacity: usize,
    event_fd: RawFd,
}

impl OpTable {
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
                piece_crcs: Vec::new(),
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

    pub fn event_fd(&self) -> RawFd {
        self.event_fd
    }

    pub fn in_flight(&self) -> usize {
        let t = self.table.lock().unwrap();
        t.entries.iter().filter(|e| e.busy && e.outcome.is_none()).count()
    }

    /// Reserves an entry, waiting up to `timeout` for one to free up.
    pub fn allocate(&self, timeout: Option<Duration>) -> Result<OpId> {
        let start = Instant::now();
        let mut t = self.table.lock().unwrap();
        loop {
            if t.closed {
                // Also wakes a caller that waited here while the store closed:
                // it gets this error, not an entry nobody would ever complete.
                return Err(EngineError::State("store is closed".into()));
            }
            if let Some(index) = t.free.pop() {
                let e = &mut t.entries[index as usize];
                e.busy = true;
                e.started = false;
                e.generation = e.generation.wrapping_add(1);
                e.segs_left = 0;
                e.error = None;
                e.ctx = None;
                e.outcome = None;
                e.detached = false;
                return Ok(OpId { index, generation: e.generation });
            }
            let waited = start.elapsed();
            let remaining = match timeout {
                None => Duration::from_secs(3600),
                Some(limit) if waited >= limit => {
                    return Err(EngineError::QueueFull { waited_ms: waited.as_millis() as u64, max_inflight: self.capacity })
                }
                Some(limit) => limit - waited,
            };
            t = self.freed.wait_timeout(t, remaining).unwrap().0;
        }
    }

    /// Hands the operation to the backend's accounting. Refused (the context
    /// given back) when the store closed since `allocate`: the backend may be
    /// gone, so the caller fails the operation instead of submitting it. A
    /// restart (a put's rewrite after ENOSPC) is always accepted: closing
    /// waits for it.
    // The context moves back by value on refusal (rare); boxing it would cost
    // an allocation on every operation.
    #[allow(clippy::result_large_err)]
    pub fn start(&self, id: OpId, ctx: OpContext, segments: u32) -> std::result::Result<(), OpContext> {
        let mut t = self.table.lock().unwrap();
        let closed = t.closed;
        let e = &mut t.entries[id.index as usize];
        if closed && !e.started {
            return Err(ctx);
        }
        e.started = true;
        e.ctx = Some(ctx);
        e.segs_left = segments;
        e.piece_crcs.clear();
        e.piece_crcs.resize(segments as usize, (0, 0));
        Ok(())
    }

    /// Gives back an entry that was reserved but never started (the
    /// submission was refused): no completion will ever free it otherwise.
    pub fn cancel(&self, id: OpId) {
        let mut t = self.table.lock().unwrap();
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
        self.table.lock().unwrap().closed = true;
        self.freed.notify_all();
    }

    /// Runs `f` on the context of an operation in flight.
    pub fn with_context<R>(&self, index: u32, f: impl FnOnce(&OpContext) -> R) -> R {
        let t = self.table.lock().unwrap();
        f(t.entries[index as usize].ctx.as_ref().expect("operation without context"))
    }

    /// Records one segment's result and, for a verified read segment, the
    /// CRC of its payload piece (`(piece number, crc, length)`); returns the
    /// operation when it was the last segment, with the pieces combined.
    pub fn segment_done(&self, index: u32, result: std::result::Result<(), SegmentError>, piece: Option<(usize, u32, u64)>) -> Option<Finished> {
        let mut t = self.table.lock().unwrap();
        let e = &mut t.entries[index as usize];
        if let Err(err) = result {
            e.error.get_or_insert(err);
        }
        if let Some((n, crc, len)) = piece {
            match e.piece_crcs.get_mut(n) {
                Some(p) => *p = (crc, len),
                // Cannot happen (pieces are numbered by segment); if it did,
                // the combined CRC would not match: corrupt, not served.
                None => {
                    e.error.get_or_insert(SegmentError::Eof);
                }
            }
        }
        e.segs_left -= 1;
        if e.segs_left > 0 {
            return None;
        }
        let ctx = e.ctx.take().expect("operation without context");
        let prefix_crc = e.piece_crcs.iter().fold(PrefixCrc::default(), |acc, &(crc, len)| PrefixCrc {
            crc: crc32c_combine(acc.crc, crc, len),
            len: acc.len + len,
        });
        Some(Finished { id: OpId { index, generation: e.generation }, ctx, error: e.error.take(), prefix_crc })
    }

    pub fn complete(&self, id: OpId, outcome: Outcome) {
        let mut t = self.table.lock().unwrap();
        let e = &mut t.entries[id.index as usize];
        debug_assert_eq!(e.generation, id.generation);
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

    fn entry<'a>(t: &'a mut MutexGuard<'_, Table>, id: OpId) -> Result<&'a mut OpEntry> {
        let e = &mut t.entries[id.index as usize];
        if !e.busy || e.generation != id.generation {
            return Err(EngineError::State("stale operation handle".into()));
        }
        Ok(e)
    }

    pub fn is_done(&self, id: OpId) -> Result<bool> {
        let mut t = self.table.lock().unwrap();
        Ok(Self::entry(&mut t, id)?.outcome.is_some())
    }

    /// Waits for completion; `Ok(None)` on timeout. The entry stays reserved
    /// until `release` so that repeated waits see the same outcome.
    pub fn wait(&self, id: OpId, timeout: Option<Duration>) -> Result<Option<Outcome>> {
        // A deadline past what Instant can hold is no deadline.
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut t = self.table.lock().unwrap();
        loop {
            if let Some(o) = &Self::entry(&mut t, id)?.outcome {
                return Ok(Some(o.clone()));
            }
            let remaining = match deadline {
                None => Duration::from_secs(3600),
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(r) if !r.is_zero() => r,
                    _ => return Ok(None),
                },
            };
            t = self.completed.wait_timeout(t, remaining).unwrap().0;
        }
    }

    /// The handle is gone: free now if complete, else when it completes.
    pub fn release(&self, id: OpId) {
        let mut t = self.table.lock().unwrap();
        let Ok(e) = Self::entry(&mut t, id) else { return };
        if e.outcome.is_some() {
            Self::free_entry(&mut t, id.index);
            drop(t);
            self.freed.notify_one();
        } else {
            e.detached = true;
        }
    }

    fn free_entry(t: &mut Table, index: u32) {
        let e = &mut t.entries[index as usize];
        e.busy = false;
        e.started = false;
        e.outcome = None;
        e.detached = false;
        t.free.push(index);
    }

    /// Waits until nothing handed to the backend is in flight (used when
    /// closing, after `close`). Entries only reserved are not waited for:
    /// their submitter fails or cancels them (`start` refuses once closed),
    /// so a submission that never started cannot hang the close.
    pub fn drain(&self) {
        let mut t = self.table.lock().unwrap();
        while t.entries.iter().any(|e| e.busy && e.started && e.outcome.is_none()) {
            t = self.completed.wait_timeout(t, Duration::from_millis(100)).unwrap().0;
        }
    }
}

impl Drop for OpTable {
    fn drop(&mut self) {
        unsafe { libc::close(self.event_fd) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn ctx() -> OpContext {
        OpContext {
            kind: OpKind::Get,
            key: b"k".to_vec(),
            hash: 1,
            slot: 0,
            root: 0,
            direct: false,
            read_fd: -1,
            write_file: None,
            file_len: 4096,
            payload_len: 0,
            started: Instant::now(),
            background: false,
            enospc_retried: false,
            reserved: 0,
        }
    }

    #[test]
    fn a_refused_submission_gives_its_entry_back() {
        // issue 14 item 6: `release` of an entry that was never started
        // marked it detached and it stayed busy for good.
        let ops = OpTable::new(2).unwrap();
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
        let ops = Arc::new(OpTable::new(1).unwrap());
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
        assert!(ops.start(held, ctx(), 1).is_err());
        // Not started, so the drain does not wait for it (it would hang).
        ops.drain();
        ops.complete(held, Outcome::new(Status::Error, 0, None, "closed"));
        ops.release(held);
        assert_eq!(ops.in_flight(), 0);
        assert!(ops.allocate(Some(Duration::ZERO)).is_err(), "closed tables reserve nothing");
    }

    #[test]
    fn started_operations_are_drained_and_may_restart_while_closing() {
        let ops = Arc::new(OpTable::new(1).unwrap());
        let id = ops.allocate(None).unwrap();
        assert!(ops.start(id, ctx(), 1).is_ok());
        ops.close();
        // A put's rewrite after ENOSPC restarts a started operation: accepted.
        let done = ops.segment_done(id.index, Ok(()), None).unwrap();
        assert!(ops.start(id, done.ctx, 1).is_ok());
        let o = ops.clone();
        let finisher = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            o.segment_done(id.index, Ok(()), None).unwrap();
            o.complete(id, Outcome::new(Status::Ok, 0, None, ""));
        });
        ops.drain();
        assert!(ops.is_done(id).unwrap(), "drain returned before the started operation completed");
        finisher.join().unwrap();
    }

    #[test]
    fn huge_wait_timeouts_do_not_overflow_the_clock() {
        let ops = OpTable::new(1).unwrap();
        let id = ops.allocate(None).unwrap();
        assert!(ops.start(id, ctx(), 1).is_ok());
        ops.segment_done(id.index, Ok(()), None).unwrap();
        ops.complete(id, Outcome::new(Status::Ok, 0, None, ""));
        // `Instant::now() + Duration::MAX` panics; a deadline past the clock is none.
        assert!(ops.wait(id, Some(Duration::MAX)).unwrap().is_some());
    }
}
