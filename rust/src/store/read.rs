//! The read path: `get`/`prefetch` on the caller's thread, checksumming of
//! each landed segment and the verdict on a chunk on a chunk worker (a
//! header-only verdict on a chunk the index holds also on the backend
//! thread). See the module docs of `store` for the whole life of a get.

use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Duration;

use super::jobs::{DirJob, Job};
use crate::backend::{Backend, Segment, SegmentError};
use crate::checksum::{crc32c, crc32c_combine};
use crate::disk::files;
use crate::disk::format::{self, FormatError, HEADER_BYTES, IO_ALIGN};
use crate::error::Result;
use crate::ops::{Finished, MissKind, OpId, Outcome, Promotion, Status};
use crate::stats::Stats;

use super::completion;
use super::transfer;
use super::{BlockStore, Core, OpContext, OpKind, VerifyPolicy};

impl BlockStore {
    /// Reads chunk `key` into `slot` and verifies it.
    pub fn get(&self, key: &[u8], slot: usize, timeout: Option<Duration>) -> Result<OpId> {
        self.read(key, b"", slot, timeout, false)
    }

    /// `get` of a chunk sealed for `tenant` (a store without a key ignores it):
    /// a chunk of another tenant or key is a miss of kind `Kept`.
    pub fn get_for(&self, tenant: &[u8], key: &[u8], slot: usize, timeout: Option<Duration>) -> Result<OpId> {
        self.read(key, tenant, slot, timeout, false)
    }

    /// `get` at background priority: its transfers start only when no demand
    /// transfer waits, and take at most half of the queue depth, so reads
    /// for what is needed now overtake reads for what may be needed soon.
    pub fn prefetch(&self, key: &[u8], slot: usize, timeout: Option<Duration>) -> Result<OpId> {
        self.read(key, b"", slot, timeout, true)
    }

    /// `prefetch` of a chunk sealed for `tenant` (see `get_for`).
    pub fn prefetch_for(&self, tenant: &[u8], key: &[u8], slot: usize, timeout: Option<Duration>) -> Result<OpId> {
        self.read(key, tenant, slot, timeout, true)
    }

    /// Raises the prefetch `id` to demand priority: its transfers not
    /// started yet (its open may still be queued) go with demand ones, behind
    /// those queued before. True when something moved; false when it is not
    /// a prefetch, done, promoted already, or all its transfers started
    /// (nothing to do: a read in flight is not recalled). A promotion racing
    /// the prefetch's own queueing may answer false and still move it.
    pub fn promote(&self, id: OpId) -> bool {
        let moved = match self.core.ops.promote(id) {
            Promotion::No => false,
            Promotion::BeforeStart => true,
            Promotion::Started => self.backend.promote(id.index) > 0,
        };
        if moved {
            Stats::add(&self.core.stats.promotions, 1);
        }
        moved
    }

    /// Bounds the bytes prefetches have in flight (at least one transfer
    /// always may): a demand read then waits behind at most that much
    /// background work at the device. None: only half of the queue depth
    /// bounds them (the default). Takes effect for transfers started from
    /// now on.
    pub fn set_background_budget(&self, bytes: Option<usize>) {
        // 0 is no budget (never set); a budget of 0 bytes still lets one transfer run.
        self.background_budget.store(bytes.map_or(0, |b| b.max(1)) as u64, Ordering::Relaxed);
        self.backend.set_background_budget(bytes);
    }

    /// What `set_background_budget` set last (None: never, or removed).
    pub fn background_budget(&self) -> Option<usize> {
        match self.background_budget.load(Ordering::Relaxed) {
            0 => None,
            b => Some(b as usize),
        }
    }

    fn read(&self, key: &[u8], tenant: &[u8], slot: usize, timeout: Option<Duration>, background: bool) -> Result<OpId> {
        self.check_open()?;
        self.check_args(key, slot)?;
        if background {
            Stats::add(&self.core.stats.prefetches, 1);
        }
        let (id, mut ctx) = self.begin(OpKind::Get, key, tenant, slot, timeout)?;
        ctx.background = background;
        // Armed before the get can end (a refusal ends it at once): a worker
        // may wait on this word from now on (`ready.rs`).
        ctx.ready_gen = self.core.pool.arm_ready(slot);
        if let Some(why) = self.core.health.refusal(ctx.root) {
            self.core.refuse(id, ctx, why);
            return Ok(id);
        }
        self.core.watch(id, &ctx);
        // A chunk in a segment this store knows the place of: nothing to open,
        // nothing that can block (the segment is held open): its transfer is
        // queued from here, without a directory worker's hand-off (decision 0086).
        if let Some(place) = self.core.segment_place(ctx.hash, false) {
            self.core.open_slot(id, ctx, place, &*self.backend);
            return Ok(id);
        }
        // The open (and the checks on the open file) can block for as long as
        // the directory is unreachable: on its own workers, never here.
        self.core.dirs[ctx.root].push(DirJob::OpenRead { id, ctx });
        Ok(id)
    }
}

impl Core {
    /// Step 2 and 3 of a get, on a worker of the chunk's directory.
    pub(super) fn open_read(&self, id: OpId, mut ctx: OpContext, backend: &dyn Backend) {
        if self.ops.is_abandoned(id) {
            // Timed out while queued behind stuck work: the caller has its miss.
            return self.finish(id, ctx, Outcome::miss(MissKind::Unavailable, None, "abandoned before it started"));
        }
        let hash = ctx.hash;
        if let Some(place) = self.segment_place(hash, false) {
            return self.open_slot(id, ctx, place, backend);
        }
        let path = self.layout.chunk_path(hash);
        let (fd, size) = match files::open_for_read(&self.held, &path, ctx.direct) {
            Ok(opened) => opened,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                // Not a chunk file: in a segment another writer published since the last look?
                if let Some(place) = self.segment_place(hash, true) {
                    return self.open_slot(id, ctx, place, backend);
                }
                // Absent (or deleted by another process sharing the directory): a miss.
                self.index.lock().unwrap().remove(hash);
                return self.finish(id, ctx, Outcome::miss(MissKind::Absent, None, "chunk not on disk"));
            }
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                // O_NOFOLLOW refused a symlink planted at a chunk path: never
                // followed, and removed like any other foreign file.
                return self.corrupt(id, ctx, "a symbolic link, not a chunk file (not followed)".into());
            }
            Err(e) => {
                let msg = format!("opening {}: {e}", path.display());
                return self.fail_early(id, ctx, e.raw_os_error(), msg);
            }
        };
        ctx.read_fd = fd;
        let Some(size) = size.map(|s| s as usize) else {
            return self.corrupt(id, ctx, "not a regular file".into());
        };
        self.read_image(id, ctx, fd, size, backend)
    }

    /// A get of a chunk in a segment: its slot, through the segment's held descriptor.
    fn open_slot(&self, id: OpId, mut ctx: OpContext, place: super::segments::Place, backend: &dyn Backend) {
        let (fd, size) = (place.file.fd(), place.file.name.slot_bytes as usize);
        ctx.file_base = place.file_base();
        ctx.read_place = Some(place);
        self.read_image(id, ctx, fd, size, backend)
    }

    /// Steps 2 and 3 of a get once its chunk image (`size` bytes at
    /// `ctx.file_base` of `fd`) is found: the size checks, then the transfer.
    fn read_image(&self, id: OpId, mut ctx: OpContext, fd: i32, size: usize, backend: &dyn Backend) {
        let pool = &self.pool;
        // A region get's room is its row (`payload_len`, whole blocks), a slot's its payload size.
        let room = if ctx.region.is_some() { ctx.payload_len } else { pool.slot_bytes() };
        let max_len = HEADER_BYTES + format::round_up(room, IO_ALIGN);
        if size > max_len && size.is_multiple_of(IO_ALIGN) {
            // Possibly a valid chunk from a process with larger slots sharing
            // the directory: not ours to judge or delete, just not loadable here.
            // Named by the payload room (what the user configured), not by
            // `max_len`, the largest chunk file such room takes.
            let into = if ctx.region.is_some() { "region row" } else { "slot" };
            let msg =
                format!("chunk file of {size} bytes (up to {} bytes of payload) does not fit a {room}-byte {into}", size - HEADER_BYTES);
            return self.keep(id, ctx, msg);
        }
        if size < HEADER_BYTES || !size.is_multiple_of(IO_ALIGN) {
            let reason = format!("file is {size} bytes (expected a multiple of {IO_ALIGN} in {HEADER_BYTES}..={max_len})");
            return self.corrupt(id, ctx, reason);
        }
        if self.ops.is_abandoned(id) {
            // The open answered after the deadline: nothing is read into the slot.
            return self.finish(id, ctx, Outcome::miss(MissKind::Unavailable, None, "opened after the deadline"));
        }
        ctx.file_len = size;
        if let (Some(sealing), Some(seal)) = (&self.sealing, &ctx.seal) {
            let (header, payload) = (self.header_ptr(id, &ctx), self.payload_ptr(&ctx));
            sealing.opens.reset(id.index, seal.keys.clone(), &ctx.key, header, payload, size);
        }
        // One more piece than segments: a region read's payload segments are
        // cut from `HEADER_BYTES`, so with 4 KiB segments they number from 1.
        self.pieces.reset(id.index, transfer::segment_count(0, size, self.segment_bytes) + 1);
        completion::submit(self, backend, id, ctx, fd, false);
    }
}

/// CRC-32C of the first `len` payload bytes of a chunk, from the pieces
/// checksummed while the rest of the chunk was still being read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct PrefixCrc {
    pub crc: u32,
    pub len: u64,
}

/// Per op-table entry: CRC-32C and length of the payload bytes of each read
/// segment, filled as segments are verified (any order), combined when the
/// last one landed. Each list grows to the most segments its entry has
/// carried and never shrinks: allocation stops once warm, and memory follows
/// the operations really in flight, not the configured maximum.
pub(super) struct Pieces {
    entries: Vec<Mutex<PieceList>>,
}

#[derive(Default)]
struct PieceList {
    crcs: Vec<(u32, u64)>,
    /// A piece numbered beyond the segments (cannot happen): not served.
    stray: bool,
}

impl Pieces {
    pub(super) fn new(max_inflight: usize) -> Self {
        Pieces { entries: (0..max_inflight.max(1)).map(|_| Mutex::default()).collect() }
    }

    fn list(&self, op: u32) -> Option<std::sync::MutexGuard<'_, PieceList>> {
        self.entries.get(op as usize).map(|m| m.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Before a read of `segments` segments starts on entry `op`.
    pub(super) fn reset(&self, op: u32, segments: usize) {
        if let Some(mut l) = self.list(op) {
            l.crcs.clear();
            l.crcs.resize(segments, (0, 0));
            l.stray = false;
        }
    }

    pub(super) fn record(&self, op: u32, piece: usize, crc: u32, len: u64) {
        if let Some(mut l) = self.list(op) {
            match l.crcs.get_mut(piece) {
                Some(p) => *p = (crc, len),
                None => l.stray = true,
            }
        }
    }

    /// The pieces combined in order; None after a stray piece.
    pub(super) fn prefix(&self, op: u32) -> Option<PrefixCrc> {
        let l = self.list(op)?;
        if l.stray {
            return None;
        }
        Some(
            l.crcs
                .iter()
                .fold(PrefixCrc::default(), |acc, &(crc, len)| PrefixCrc { crc: crc32c_combine(acc.crc, crc, len), len: acc.len + len }),
        )
    }
}

impl Core {
    /// Checksums the payload bytes of one landed read segment that are
    /// payload whatever the header says: those before the file's last 4 KiB
    /// (padding is shorter than that). The rest is checked in `finish_get`.
    pub(super) fn verify_piece(&self, seg: &Segment) -> Option<Finished<OpContext>> {
        if let Some(sealing) = &self.sealing {
            return self.open_piece(sealing, seg);
        }
        let Some(file_len) = self.ops.with_context(seg.op, |ctx| ctx.file_len) else {
            self.stray_completion(format!("read segment of operation {} without context", seg.op));
            return None;
        };
        let offset = seg.offset as usize;
        let start = offset.max(HEADER_BYTES);
        let end = (offset + seg.len).min(file_len.saturating_sub(IO_ALIGN));
        let piece = offset / self.segment_bytes;
        let (crc, len) = if end > start {
            // SAFETY: `offset <= start < end <= offset + seg.len`, so the bytes lie within the
            // segment, which has landed: the kernel is done with them, and the operation, still in
            // flight, holds the memory until `finish`.
            let bytes = unsafe { std::slice::from_raw_parts(seg.buf.add(start - offset), end - start) };
            (crc32c(bytes), (end - start) as u64)
        } else {
            (0, 0)
        };
        // A piece without payload bytes (a region read's header block) keeps
        // the (0, 0) `reset` gave it: never overwrites a payload piece's number.
        if len > 0 {
            self.pieces.record(seg.op, piece, crc, len);
        }
        self.ops.segment_done(seg.op, Ok(())).unwrap_or_else(|e| {
            self.stray_completion(e);
            None
        })
    }

    /// The verdict on a landed read, and its completion. `on_backend_thread`:
    /// called from the reaping loop (header-only checks), where nothing may
    /// unlink or evict: a corrupt chunk, or one to adopt, is handed to a
    /// chunk worker (which judges it again) instead.
    pub(super) fn finish_get(&self, id: OpId, mut ctx: OpContext, error: Option<SegmentError>, on_backend_thread: bool) {
        ctx.close_elsewhere = on_backend_thread;
        let to_worker = |mut ctx: OpContext| {
            ctx.close_elsewhere = false;
            self.jobs.push(Job::Finish(Finished { id, ctx, error }))
        };
        match error {
            Some(SegmentError::Eof) if on_backend_thread => return to_worker(ctx),
            Some(SegmentError::Eof) => return self.corrupt(id, ctx, "file shorter than its size (truncated while reading)".into()),
            Some(SegmentError::Errno(errno)) => {
                let msg = format!("reading chunk: {}", std::io::Error::from_raw_os_error(errno));
                return self.finish(id, ctx, Outcome::new(Status::Error, 0, Some(errno), msg));
            }
            Some(SegmentError::BackendFailed(errno)) => {
                return self.finish(id, ctx, Outcome::new(Status::Error, 0, Some(errno), completion::backend_failed("reading", errno)));
            }
            None => {}
        }
        // SAFETY: every transfer of this get has completed (this is its verdict); its header block
        // (a slot's first HEADER_BYTES, or the operation's own block) is HEADER_BYTES long and
        // written by nobody until `finish`.
        let block = unsafe { std::slice::from_raw_parts(self.header_ptr(id, &ctx), HEADER_BYTES) };
        let header = match format::decode_header(block, &self.namespace, &ctx.key, ctx.file_len as u64) {
            Ok(h) => h,
            // A sound header this build cannot interpret: not ours to delete.
            Err(e @ FormatError::Flags(_)) => return self.keep(id, ctx, e.to_string()),
            Err(_) if on_backend_thread => return to_worker(ctx),
            Err(e) => return self.corrupt(id, ctx, e.to_string()),
        };
        if let Some(sealing) = &self.sealing {
            let Some(keys) = ctx.seal.as_ref().map(|s| s.keys.clone()) else {
                return self.corrupt(id, ctx, "a sealed read without its tenant's keys".into());
            };
            match self.judge_sealed(sealing, id, &keys, &header) {
                Ok(()) => return self.serve(id, ctx, header.payload_len, on_backend_thread),
                Err((true, why)) => return self.corrupt(id, ctx, why),
                Err((false, why)) => return self.keep(id, ctx, why),
            }
        }
        if header.sealed.is_some() {
            // Another store's sealed chunk: sound for all this store can tell, not openable here.
            Stats::add(&self.stats.not_ours_misses, 1);
            return self.keep(id, ctx, "a sealed chunk, and this store has no encryption key: not ours, kept".into());
        }
        // SAFETY: `decode_header` checked that `payload_len` fits the file after its header, and
        // the file fit the operation's room (`open_read`: the slot's payload, or the region's
        // pinned range), so the bytes lie in memory the operation holds, where every transfer has
        // completed.
        let payload = unsafe { std::slice::from_raw_parts(self.payload_ptr(&ctx), header.payload_len as usize) };
        if self.verify == VerifyPolicy::Full {
            // `decode_header` checked that the payload fills the file to its
            // last 4 KiB, so the verified prefix never exceeds it.
            let Some(expected) = header.payload_crc else {
                // Written by a verify="header" store: sound, but nothing to
                // check the payload against. Never served here, never deleted.
                let msg = "chunk written without a payload checksum (verify=\"header\" writer); this store verifies payloads";
                return self.keep(id, ctx, msg.into());
            };
            let Some(prefix_crc) = self.pieces.prefix(id.index) else {
                // Cannot happen (pieces are numbered by segment); if it did,
                // the combined CRC would not match: corrupt, not served.
                if on_backend_thread {
                    return to_worker(ctx);
                }
                return self.corrupt(id, ctx, "file shorter than its size (truncated while reading)".into());
            };
            let rest = &payload[prefix_crc.len as usize..];
            let crc = crc32c_combine(prefix_crc.crc, crc32c(rest), rest.len() as u64);
            if crc != expected {
                // Judged again on a chunk worker, which may delete it.
                if on_backend_thread {
                    return to_worker(ctx);
                }
                return self.corrupt(id, ctx, FormatError::PayloadCrc.to_string());
            }
        }
        self.serve(id, ctx, header.payload_len, on_backend_thread)
    }

    /// A verified read: the chunk is indexed (adopted when another process
    /// wrote it: then, on a chunk worker, within capacity) and the get is Ok.
    fn serve(&self, id: OpId, ctx: OpContext, payload_len: u64, on_backend_thread: bool) {
        let adopted = {
            let mut index = self.index.lock().unwrap();
            if index.contains(ctx.hash) {
                index.touch(ctx.hash);
                false
            } else if on_backend_thread {
                drop(index);
                let mut ctx = ctx;
                ctx.close_elsewhere = false;
                return self.jobs.push(Job::Finish(Finished { id, ctx, error: None }));
            } else {
                index.insert(ctx.hash, ctx.file_len as u64);
                true
            }
        };
        if adopted {
            // A chunk another process wrote now counts here too: stay within capacity.
            self.make_room(0, ctx.hash, None, None);
        }
        self.finish(id, ctx, Outcome::new(Status::Ok, payload_len, None, ""));
    }
}
