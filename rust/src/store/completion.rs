//! Where operations end: the backend's segment completions are handed on
//! (never worked on in the reaping loop: checksums, publication, unlinks and
//! evictions go to a chunk worker), the chunk workers' loop, and `finish`,
//! the single exit of every operation.

use super::health;
use super::jobs::{DirJob, Job};
use super::transfer::{submit_range, FileMemory, Transfer};
use crate::backend::{clock_ns, thread_cpu_clock, Backend, Segment, SegmentError, SegmentSink};
use crate::disk::files;
use crate::disk::format::HEADER_BYTES;
use crate::ops::{Finished, MissKind, OpId, Outcome, Status, Watch};
use crate::stats::Stats;

use super::{Core, OpContext, OpKind, VerifyPolicy};

/// `Watch::slot` of a region operation: it has no staging slot.
pub(super) const NO_SLOT: u32 = u32::MAX;

impl Core {
    pub(super) fn fail_early(&self, id: OpId, ctx: OpContext, errno: Option<i32>, message: String) {
        if ctx.kind == OpKind::Put && errno == Some(libc::ENOSPC) {
            Stats::add(&self.stats.write_enospc, 1);
        }
        self.finish(id, ctx, Outcome::new(Status::Error, 0, errno, message));
    }

    /// A sound chunk file this store does not serve (another writer's): a
    /// miss. Not this store's to delete: file and index entry stay as they are.
    pub(super) fn keep(&self, id: OpId, ctx: OpContext, reason: String) {
        self.finish(id, ctx, Outcome::miss(MissKind::Kept, None, reason));
    }

    pub(super) fn corrupt(&self, id: OpId, ctx: OpContext, reason: String) {
        let path = self.layout.chunk_path(ctx.hash);
        if ctx.read_fd >= 0 && !files::still_at(&self.held, ctx.read_fd, &path) {
            // Recycled or replaced between the open and the lock
            // (`files::open_for_read`): what was read is not the file at the
            // path now, so nothing is judged (or deleted) by it. A miss.
            self.index.lock().unwrap().remove(ctx.hash);
            return self.finish(id, ctx, Outcome::miss(MissKind::Absent, None, "chunk file moved away while it was opened"));
        }
        if ctx.read_place.is_some() {
            return self.slot_unreadable(id, ctx, reason);
        }
        // A chunk that fails verification is removed so it is never tried again.
        self.remove_chunk(ctx.hash);
        let msg = format!("corrupt chunk {}: {reason}", path.display());
        self.finish(id, ctx, Outcome::new(Status::Corrupt, 0, None, msg));
    }

    /// A new operation refused because its directory is unavailable (open
    /// breaker, too much stuck work): a miss or a skipped put, at once,
    /// without touching the directory.
    pub(super) fn refuse(&self, id: OpId, ctx: OpContext, why: String) {
        self.unpin_memory(&ctx);
        if ctx.region.is_none() {
            self.pool.settle_ready(ctx.slot, ctx.ready_gen, false);
        }
        let c = &self.health.counters;
        let outcome = match ctx.kind {
            OpKind::Get => {
                Stats::add(&c.skipped_gets, 1);
                Stats::add(&self.stats.read_misses, 1);
                Outcome::miss(MissKind::Unavailable, Some(libc::EAGAIN), format!("{why}: a miss"))
            }
            OpKind::Put => {
                Stats::add(&c.skipped_puts, 1);
                Outcome::new(Status::Error, 0, Some(libc::EAGAIN), format!("{why}: put skipped"))
            }
        };
        self.ops.complete(id, outcome);
    }

    /// Starts the deadline clock of an operation about to be queued.
    pub(super) fn watch(&self, id: OpId, ctx: &OpContext) {
        let w = Watch {
            root: ctx.root as u32,
            // No slot to quarantine: a region stays pinned until `finish`.
            slot: if ctx.region.is_some() { NO_SLOT } else { ctx.slot as u32 },
            put: ctx.kind == OpKind::Put,
            since: ctx.started,
            ready_gen: ctx.ready_gen,
            background: ctx.background,
        };
        self.ops.watch(id, w);
    }

    /// Single exit of every operation: closes files, unpins the slot, counts, signals.
    pub(super) fn finish(&self, id: OpId, mut ctx: OpContext, mut outcome: Outcome) {
        self.release_reservation(&mut ctx);
        if ctx.read_fd >= 0 {
            if ctx.close_elsewhere {
                // On the ring thread: a close can wait on the filesystem (a
                // FUSE flush), so the directory's worker does it.
                self.dirs[ctx.root].push(DirJob::Close { fd: ctx.read_fd, direct: ctx.direct });
            } else {
                if !ctx.direct {
                    files::drop_cached_pages(ctx.read_fd, false);
                }
                files::close(ctx.read_fd);
            }
        }
        if let Some(f) = ctx.write_file.take() {
            files::discard(&self.held, &f);
        }
        if let Some(temp) = ctx.claimed.take() {
            let _ = self.held.unlink(&temp);
        }
        self.unpin_memory(&ctx);
        outcome.latency = ctx.started.elapsed();
        if self.ops.is_abandoned(id) {
            // Past its deadline the caller got a miss / a skipped put; the
            // work ended now: the slot left quarantine above, nothing else counts.
            Stats::add(&self.health.counters.late_completions, 1);
            self.health.dirs[ctx.root].stuck.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            self.health.progress(ctx.root);
            return self.ops.complete(id, outcome);
        }
        if ctx.kind == OpKind::Get && outcome.status == Status::Error {
            // The file could not be read, so it was not judged: it stays, indexed.
            outcome.miss_kind = Some(MissKind::Unavailable);
        }
        match outcome.errno {
            Some(e) if health::is_storage_failure(e) => {
                self.health.failure(ctx.root, false, std::time::Instant::now());
                if ctx.kind == OpKind::Get && outcome.status == Status::Error {
                    // Unreachable storage, not a bad chunk: for serving, a miss
                    // (errno kept: the chunk may well be there, nothing evicts it).
                    outcome.status = Status::Miss;
                }
            }
            _ => self.health.success(ctx.root),
        }
        let s = &self.stats;
        match (ctx.kind, outcome.status) {
            (OpKind::Get, Status::Ok) => {
                Stats::add(&s.reads, 1);
                Stats::add(&s.read_hits, 1);
                Stats::add(&s.bytes_read, ctx.file_len as u64);
                Stats::observe(&s.read_latency_us, &s.read_latency_sum_us, outcome.latency);
            }
            (OpKind::Get, Status::Miss) => Stats::add(&s.read_misses, 1),
            (OpKind::Get, Status::Corrupt) => Stats::add(&s.corrupt, 1),
            (OpKind::Get, Status::Error) => Stats::add(&s.read_errors, 1),
            (OpKind::Put, Status::Ok) => {
                Stats::add(&s.writes, 1);
                Stats::add(&s.bytes_written, ctx.file_len as u64);
                Stats::observe(&s.write_latency_us, &s.write_latency_sum_us, outcome.latency);
            }
            (OpKind::Put, _) => Stats::add(&s.write_errors, 1),
        }
        // Before the caller can see the outcome; a no-op when the watchdog
        // settled it already (abandoned between the check above and here).
        if ctx.region.is_none() {
            self.pool.settle_ready(ctx.slot, ctx.ready_gen, outcome.status == Status::Ok);
        }
        self.ops.complete(id, outcome);
    }

    fn finish_op(&self, done: Finished<OpContext>, backend: &dyn Backend) {
        let Finished { id, ctx, error } = done;
        match ctx.kind {
            OpKind::Get => self.finish_get(id, ctx, error, false),
            OpKind::Put => self.finish_put(id, ctx, error, backend),
        }
    }

    /// A segment completion the op table could not place (no backend sends
    /// one): logged, never a panic on the backend thread.
    pub(super) fn stray_completion(&self, what: String) {
        self.stats.record_error(what);
    }
}

impl SegmentSink for Core {
    /// Runs on the backend thread, for every segment: hands the work on and
    /// returns. The one exception is the header-only verdict of a read (see
    /// `finish_get`'s `on_backend_thread`).
    fn segment_done(&self, seg: &Segment, result: std::result::Result<(), SegmentError>) {
        // Bytes moved there: the directory is slow at worst, not stalled.
        if (seg.root as usize) < self.health.dirs.len() {
            self.health.progress(seg.root as usize);
        }
        if !seg.write && result.is_ok() && (self.verify == VerifyPolicy::Full || self.sealing.is_some()) {
            return self.jobs.push(Job::VerifyPiece { seg: *seg });
        }
        let done = match self.ops.segment_done(seg.op, result) {
            Ok(Some(done)) => done,
            Ok(None) => return,
            Err(stray) => return self.stray_completion(stray),
        };
        if done.ctx.kind == OpKind::Get && self.verify == VerifyPolicy::Header && self.sealing.is_none() {
            // A 4 KiB header check: cheaper here than waking a chunk
            // worker for it (a wake-up costs more CPU than the check, and
            // at queue depth 1 every operation pays one).
            let Finished { id, ctx, error } = done;
            return self.finish_get(id, ctx, error, true);
        }
        self.jobs.push(Job::Finish(done));
    }

    /// A read piece to verify with nothing else in flight (queue depth 1, or
    /// a chunk's last piece): checksummed here rather than by a chunk worker
    /// woken for it. At queue depth 1 that wake-up cost more than the CRC of
    /// the piece (2 MiB gets on the VM's disk at 0.66x of `verify="header"`).
    fn segment_done_alone(&self, seg: &Segment, result: std::result::Result<(), SegmentError>) {
        if seg.write || result.is_err() || self.verify != VerifyPolicy::Full || self.sealing.is_some() {
            return self.segment_done(seg, result);
        }
        if (seg.root as usize) < self.health.dirs.len() {
            self.health.progress(seg.root as usize);
        }
        let Some(done) = self.verify_piece(seg) else { return };
        match done.ctx.kind {
            // Whatever may block or delete (a corrupt chunk, one to adopt) goes on to a chunk worker.
            OpKind::Get => self.finish_get(done.id, done.ctx, done.error, true),
            OpKind::Put => self.jobs.push(Job::Finish(done)),
        }
    }

    fn moved(&self, seg: &Segment) {
        if (seg.root as usize) < self.health.dirs.len() {
            self.health.progress(seg.root as usize);
        }
    }

    fn anomaly(&self, what: String) {
        self.stray_completion(what);
    }
}

/// The message of an operation the failed backend could not carry out.
pub(super) fn backend_failed(doing: &str, errno: i32) -> String {
    format!(
        "{doing} chunk: the I/O backend failed ({}) and accepts no more work; reopen the store",
        std::io::Error::from_raw_os_error(errno)
    )
}

pub(super) const CLOSED_WHILE_SUBMITTING: &str = "store closed while the operation was being submitted";

/// Hands an operation's whole file to the backend: reads, and a put's
/// rewrite after ENOSPC (its slot, or header block and region, sealed by then).
pub(super) fn submit(core: &Core, backend: &dyn Backend, id: OpId, ctx: OpContext, fd: i32, write: bool) {
    let seg_bytes = match (write, &core.sealing) {
        (true, _) => core.write_segment_bytes,
        (false, None) => core.segment_bytes,
        // A sealed read lands frame by frame: each is opened by whichever chunk worker is free
        // as soon as it landed, so opening a chunk runs on every worker and ends a frame after
        // the transfer, not a segment after.
        (false, Some(_)) => {
            let frame = crate::disk::format::frame_bytes_for(ctx.file_len.saturating_sub(HEADER_BYTES) as u64) as usize;
            core.segment_bytes.min(frame)
        }
    };
    let (file_len, mut mem) = (ctx.file_len, core.file_memory(id, &ctx, fd, write));
    match core.ops.start(id, ctx, mem.segment_count(0, file_len, seg_bytes) as u32) {
        Err(ctx) => return core.fail_early(id, ctx, None, CLOSED_WHILE_SUBMITTING.into()),
        // Promoted while its open was queued: it starts as demand work.
        Ok(promoted) => mem.set_background(mem.header.background() & !promoted),
    }
    mem.submit(backend, 0, file_len, seg_bytes);
    // A promotion between `start` and the queueing above found nothing to
    // move (`BlockStore::promote`): its segments are queued now.
    if mem.header.background() && core.ops.is_promoted(id) && backend.promote(id.index) > 0 {
        Stats::add(&core.stats.promotions, 1);
    }
}

impl Core {
    /// The memory of operation `id`'s file (see `FileMemory`).
    pub(super) fn file_memory(&self, id: OpId, ctx: &OpContext, fd: i32, write: bool) -> FileMemory {
        self.file_memory_at_zero(id, ctx, fd, write).at(ctx.file_base)
    }

    fn file_memory_at_zero(&self, id: OpId, ctx: &OpContext, fd: i32, write: bool) -> FileMemory {
        if let (Some(sealing), Some(buffer)) = (&self.sealing, ctx.seal.as_ref().and_then(|s| s.buffer)) {
            // A sealed put: the whole file is in its seal buffer.
            return FileMemory { header: sealing.buffers.transfer(id, buffer, fd, ctx.background, ctx.root), payload: None };
        }
        match ctx.region {
            None if self.sealing.is_some() && !write => {
                // A sealed read: the header lands as a transfer of its own and the payload
                // segments are cut from `HEADER_BYTES`, so frames land whole (`sealing`).
                let slot = Transfer::of_slot(&self.pool, id, ctx.slot, fd, write, ctx.background, ctx.root);
                FileMemory { header: slot, payload: Some(slot) }
            }
            None => FileMemory { header: Transfer::of_slot(&self.pool, id, ctx.slot, fd, write, ctx.background, ctx.root), payload: None },
            Some(pin) => {
                let header = Transfer::of_memory(id, self.headers.block(id.index), fd, write, ctx.background, ctx.root);
                // File offset `HEADER_BYTES` is the region's byte `pin.payload`.
                let base = (pin.payload as *mut u8).wrapping_sub(HEADER_BYTES);
                FileMemory { header, payload: Some(Transfer::of_memory(id, base, fd, write, ctx.background, ctx.root)) }
            }
        }
    }

    /// The header block of an operation: its slot's first 4 KiB, or its own block.
    pub(super) fn header_ptr(&self, id: OpId, ctx: &OpContext) -> *mut u8 {
        match ctx.region {
            None => self.pool.slot_ptr(ctx.slot),
            Some(_) => self.headers.block(id.index),
        }
    }

    /// The first payload byte of an operation: in its slot, or in its region.
    pub(super) fn payload_ptr(&self, ctx: &OpContext) -> *mut u8 {
        match ctx.region {
            None => self.pool.payload_ptr(ctx.slot),
            Some(pin) => pin.payload as *mut u8,
        }
    }

    /// The operation's memory is the caller's again: its slot unpinned, or its
    /// region; a sealed put's seal buffer is free again.
    pub(super) fn unpin_memory(&self, ctx: &OpContext) {
        if let (Some(sealing), Some(buffer)) = (&self.sealing, ctx.seal.as_ref().and_then(|s| s.buffer)) {
            sealing.buffers.release(buffer);
        }
        let unpinned = match ctx.region {
            None => self.pool.unpin_io(ctx.slot),
            Some(pin) => self.regions.unpin(pin),
        };
        if let Err(e) = unpinned {
            // A pin count below zero: a bug, reported (this may be the ring
            // thread, which must not panic) and fatal in debug builds.
            self.stats.record_error(&e);
            debug_assert!(false, "{e}");
        }
    }
}

pub(super) fn chunk_worker(core: &Core, backend: &dyn Backend) {
    let me = core.jobs.register_worker();
    let clock = thread_cpu_clock();
    while let Some(job) = core.jobs.pop() {
        match job {
            Job::Seal { id, header, payload, payload_len } => {
                core.seal(id, header, payload as *const u8, payload_len);
                submit_range(backend, header, 0, HEADER_BYTES, 0);
            }
            Job::SealFrames(job) => core.seal_frames(job, backend, core.sealing.as_ref().map_or(1, |s| s.workers)),
            Job::VerifyPiece { seg } => {
                if let Some(done) = core.verify_piece(&seg) {
                    core.finish_op(done, backend);
                }
            }
            Job::Finish(done) => core.finish_op(done, backend),
        }
        core.jobs.record_cpu(me, clock_ns(clock));
    }
}

/// A directory worker: the blocking syscalls of one storage directory.
pub(super) fn dir_worker(core: &Core, backend: &dyn Backend, root: usize) {
    while let Some(job) = core.dirs[root].pop() {
        match job {
            DirJob::OpenRead { id, ctx } => core.open_read(id, ctx, backend),
            DirJob::OpenWrite { id, ctx } => core.open_write(id, ctx, backend),
            DirJob::Close { fd, direct } => {
                if !direct {
                    files::drop_cached_pages(fd, false);
                }
                files::close(fd);
            }
            DirJob::Lstat { hash, reply } => {
                let found = core.lstat_chunk(hash);
                *reply.found.lock().unwrap_or_else(|e| e.into_inner()) = Some(found);
                reply.ready.notify_all();
            }
            DirJob::Unlink { hash, len, reply } => {
                let unlinked = core.drop_chunk_bytes(crate::disk::index::ChunkRef::own(hash)).is_ok();
                if let (true, Some(len)) = (unlinked, len) {
                    core.ledgers.published(root, -(len as i64));
                }
                *reply.found.lock().unwrap_or_else(|e| e.into_inner()) = Some(unlinked);
                reply.ready.notify_all();
            }
            DirJob::Probe { number } => core.probe_dir(root, number),
        }
    }
}
