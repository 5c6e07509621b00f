//! Sealed chunks in the store (decision 0083): where the AES-GCM work runs
//! and in which memory.
//!
//! - **Puts** never write the caller's memory (the vLLM integration serves
//!   hits from a slot while its write is in flight): the put's caller takes
//!   one of the `SealBuffers` (allocated and touched at open, each the size of
//!   a slot's file; waiting at most the submit timeout: backpressure, never on
//!   a chunk worker, which would wait for a buffer only a worker frees). The
//!   directory worker writes the header fields into it; the chunk workers
//!   (`Job::SealFrames`, one job each) seal the frames from the slot or region
//!   into it together, the file's sealed start written in pieces as it grows
//!   (`SealPlan`), the header (tags, CRC) last. The buffer is released at `finish`. The buffers are registered with
//!   io_uring beside the slots (`BlockStore::open`); the thread backend writes
//!   from them as from any memory.
//! - **Gets** read the ciphertext into the caller's slot or region (the
//!   header as its own transfer, then one frame per transfer) and open each
//!   frame in place on the chunk worker that sees its last byte land
//!   (`open_piece`; a frame complete before the header waits for it), so
//!   opening overlaps the transfer, on every worker. `finish_get` judges the header (`judge_sealed`): another
//!   key's or tenant's chunk, or a plaintext chunk, is "not ours" (a miss of
//!   kind `kept`, never deleted); a frame that failed to open is corrupt.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::transfer::{submit_range, Transfer};
use super::Core;
use crate::backend::{Backend, Segment};
use crate::disk::format::{self, ChunkHeader, HEADER_BYTES};
use crate::disk::seal::{KeyRing, TenantKeys};
use crate::error::{EngineError, Result};
use crate::ops::{Finished, OpId};
use crate::stats::Stats;
use crate::wait::{deadline_after, wait_until};

/// What a store that seals holds: its keys, its buffers, the reads' state.
pub(super) struct Sealing {
    pub keys: KeyRing,
    pub buffers: SealBuffers,
    pub opens: OpenStates,
    /// Chunk workers: a put's frames are sealed by up to this many jobs (`SealPlan`).
    pub workers: usize,
}

/// The sealing part of an operation's context.
#[derive(Clone)]
pub struct OpSeal {
    pub keys: Arc<TenantKeys>,
    /// A put's seal buffer (None for a get).
    pub buffer: Option<usize>,
}

/// Alignment of the seal buffers (a huge page).
const HUGE_PAGE: usize = 2 << 20;

/// The put buffers: `count` blocks of `bytes` each, mapped and touched at
/// open, never grown.
pub(super) struct SealBuffers {
    base: *mut u8,
    /// Bytes of a buffer, and between two buffers' starts (2 MiB aligned).
    bytes: usize,
    stride: usize,
    count: usize,
    /// Free buffer numbers.
    free: Mutex<Vec<usize>>,
    freed: Condvar,
    /// Fixed-buffer index of buffer 0 when registered with io_uring.
    first_index: Option<u16>,
}

// SAFETY: `base` names a mapping owned by this struct, unmapped only in `Drop`; buffers are handed
// out one operation at a time (`acquire`/`release`), and only that operation's threads touch one.
unsafe impl Send for SealBuffers {}
// SAFETY: as for `Send`: `&self` gives out addresses, never references to the bytes.
unsafe impl Sync for SealBuffers {}

impl SealBuffers {
    pub(super) fn new(count: usize, bytes: usize) -> Result<Self> {
        let count = count.max(1);
        // Each buffer starts on a 2 MiB boundary, in huge pages where the kernel has them: a
        // write from 4 KiB pages is cut into more device requests (a request holds a bounded
        // number of memory segments), as the staging slots are not (`staging::mapping`).
        let stride = bytes.checked_next_multiple_of(HUGE_PAGE);
        let total = stride.and_then(|s| s.checked_mul(count)).filter(|t| t.checked_add(HUGE_PAGE).is_some());
        let Some(total) = total else { return Err(EngineError::invalid("seal_buffers x slot size is too large")) };
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing; the result
        // is checked below.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total + HUGE_PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(EngineError::last_os(format!("allocating {count} seal buffers of {bytes} bytes")));
        }
        let (raw, base) = (raw as usize, (raw as usize).next_multiple_of(HUGE_PAGE));
        // SAFETY: the head before `base` and the tail after `base + total` lie in the mapping just
        // made (it is `total + HUGE_PAGE` long and `base - raw < HUGE_PAGE`); nothing uses them.
        unsafe {
            if base > raw {
                libc::munmap(raw as *mut _, base - raw);
            }
            if raw + HUGE_PAGE > base {
                libc::munmap((base + total) as *mut _, raw + HUGE_PAGE - base);
            }
            libc::madvise(base as *mut _, total, libc::MADV_HUGEPAGE);
        }
        // Touched now: the memory is the store's from open on, not taken at the first put.
        // SAFETY: `[base, base + total)` is the mapping kept above, readable and writable.
        unsafe { std::ptr::write_bytes(base as *mut u8, 0, total) };
        Ok(SealBuffers {
            base: base as *mut u8,
            bytes,
            stride: stride.unwrap_or(bytes),
            count,
            free: Mutex::new((0..count).rev().collect()),
            freed: Condvar::new(),
            first_index: None,
        })
    }

    /// Numbers the buffers as io_uring fixed buffers after the `slots`
    /// staging slots (not when the numbers would not fit a u16).
    pub(super) fn number_after(&mut self, slots: usize) {
        if slots + self.count <= u16::MAX as usize {
            self.first_index = Some(slots as u16);
        }
    }

    /// The iovecs to register after the slots' (none when not numbered).
    pub(super) fn registered(&self) -> Vec<libc::iovec> {
        match self.first_index {
            Some(_) => (0..self.count).map(|b| libc::iovec { iov_base: self.ptr(b) as *mut _, iov_len: self.bytes }).collect(),
            None => Vec::new(),
        }
    }

    pub(super) fn count(&self) -> usize {
        self.count
    }

    /// Payload bytes a buffer holds after its header.
    pub(super) fn payload_room(&self) -> usize {
        self.bytes - HEADER_BYTES
    }

    pub(super) fn ptr(&self, buffer: usize) -> *mut u8 {
        assert!(buffer < self.count, "seal buffer {buffer} of {}", self.count);
        // SAFETY: `buffer < count` (asserted), so the block lies inside the mapping.
        unsafe { self.base.add(buffer * self.stride) }
    }

    pub(super) fn transfer(&self, id: OpId, buffer: usize, fd: i32, background: bool, root: usize) -> Transfer {
        let index = self.first_index.map(|first| first + buffer as u16);
        Transfer::of_registered(id, self.ptr(buffer), index, fd, true, background, root)
    }

    /// A free buffer, waiting up to `timeout`; the error is the submit timeout's.
    pub(super) fn acquire(&self, timeout: Option<Duration>) -> Result<usize> {
        let start = std::time::Instant::now();
        wait_until(&self.free, &self.freed, deadline_after(timeout), |free| free.pop())
            .map_err(|_| EngineError::SealBuffersBusy { waited_ms: start.elapsed().as_millis() as u64, buffers: self.count })
    }

    pub(super) fn release(&self, buffer: usize) {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).push(buffer);
        self.freed.notify_one();
    }

    /// Buffers not held by a put.
    pub(super) fn available(&self) -> usize {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl Drop for SealBuffers {
    fn drop(&mut self) {
        // SAFETY: `base` and this length are the mapping made in `new`, unmapped once; the core
        // that owns the buffers is dropped after every transfer ended.
        unsafe { libc::munmap(self.base as *mut _, self.count * self.stride) };
    }
}

/// The state of one sealed read (per op-table entry): which frames landed,
/// which were opened, and the header once it landed.
#[derive(Default)]
struct OpenState {
    keys: Option<Arc<TenantKeys>>,
    key: Vec<u8>,
    header: usize,
    payload: usize,
    file_len: u64,
    frame_bytes: u64,
    /// File bytes landed per frame (its padding included).
    landed: Vec<u64>,
    opened: Vec<bool>,
    /// None: header not landed; Some(None): not to be opened here; Some(Some(..)): open with.
    plan: Option<Option<Plan>>,
    failed: u32,
}

#[derive(Clone, Copy)]
struct Plan {
    previous: bool,
    nonce: [u8; 12],
    payload_len: u64,
}

/// How a sealed read's frames came out (`OpenStates::verdict`).
pub(super) enum Opened {
    All,
    /// Frames whose tag did not verify.
    Failed(u32),
    /// Frames never opened (cannot happen once every segment landed).
    Missing,
}

pub(super) struct OpenStates {
    entries: Vec<Mutex<OpenState>>,
}

impl OpenStates {
    pub(super) fn new(max_inflight: usize) -> Self {
        OpenStates { entries: (0..max_inflight.max(1)).map(|_| Mutex::default()).collect() }
    }

    fn entry(&self, op: u32) -> Option<std::sync::MutexGuard<'_, OpenState>> {
        self.entries.get(op as usize).map(|m| m.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Before a sealed read of a `file_len`-byte file starts on entry `op`.
    pub(super) fn reset(&self, op: u32, keys: Arc<TenantKeys>, key: &[u8], header: *mut u8, payload: *mut u8, file_len: usize) {
        let Some(mut s) = self.entry(op) else { return };
        let padded = (file_len - HEADER_BYTES) as u64;
        // The frames as the file's size implies them (`format::frame_bytes_for`
        // is a function of the padded length): known before the header lands.
        let frame_bytes = format::frame_bytes_for(padded);
        let frames = (padded.div_ceil(frame_bytes) as usize).max(1);
        s.keys = Some(keys);
        s.key.clear();
        s.key.extend_from_slice(key);
        (s.header, s.payload, s.file_len, s.frame_bytes) = (header as usize, payload as usize, file_len as u64, frame_bytes);
        (s.plan, s.failed) = (None, 0);
        s.landed.clear();
        s.landed.resize(frames, 0);
        s.opened.clear();
        s.opened.resize(frames, false);
    }

    pub(super) fn verdict(&self, op: u32) -> Opened {
        let Some(s) = self.entry(op) else { return Opened::Missing };
        match () {
            _ if s.failed > 0 => Opened::Failed(s.failed),
            _ if s.opened.iter().all(|o| *o) => Opened::All,
            _ => Opened::Missing,
        }
    }
}

impl Core {
    /// A landed segment of a sealed read: counts its bytes to their frames,
    /// judges the header when it is this one, opens every frame now complete,
    /// and only then passes the segment on (so the last segment's completion
    /// finds every frame opened).
    pub(super) fn open_piece(&self, sealing: &Sealing, seg: &Segment) -> Option<Finished<crate::store::OpContext>> {
        let mut work = Vec::new();
        let (plan, keys, header, payload, frame_bytes) = {
            let Some(mut s) = sealing.opens.entry(seg.op) else { return self.pass_on(seg) };
            let (start, end) = (seg.offset, seg.offset + seg.len as u64);
            if start == 0 && end >= HEADER_BYTES as u64 {
                let plan = self.plan_of(&s, seg.buf);
                s.plan = Some(plan);
            }
            let (frame_bytes, file_len) = (s.frame_bytes, s.file_len);
            // Frame `f`'s bytes in the file, its padding included.
            let range = |f: usize| {
                let lo = HEADER_BYTES as u64 + f as u64 * frame_bytes;
                (lo, (lo + frame_bytes).min(file_len))
            };
            for (f, landed) in s.landed.iter_mut().enumerate() {
                let (lo, hi) = range(f);
                *landed += end.min(hi).saturating_sub(start.max(lo));
            }
            if let Some(Some(_)) = s.plan {
                for f in 0..s.landed.len() {
                    let (lo, hi) = range(f);
                    if !s.opened[f] && s.landed[f] >= hi.saturating_sub(lo) {
                        s.opened[f] = true;
                        work.push(f);
                    }
                }
            }
            (s.plan.flatten(), s.keys.clone(), s.header, s.payload, s.frame_bytes)
        };
        if let (Some(plan), Some(keys), false) = (plan, keys, work.is_empty()) {
            let key = if plan.previous { keys.previous.as_ref() } else { Some(&keys.current) };
            let mut failed = 0;
            for f in work {
                let from = f as u64 * frame_bytes;
                let len = (from + frame_bytes).min(plan.payload_len).saturating_sub(from) as usize;
                // SAFETY: the header block landed (the plan exists only then) and is written by
                // nobody until `finish`; HEADER_BYTES long.
                let block = unsafe { std::slice::from_raw_parts(header as *const u8, HEADER_BYTES) };
                // SAFETY: `plan.payload_len` was checked against the file's size (`decode_header`)
                // and the file fit the operation's room (`open_read`); every byte of this frame
                // has landed, and this worker alone claimed the frame (`opened`), so nothing else
                // touches these bytes until `finish`.
                let bytes = unsafe { std::slice::from_raw_parts_mut((payload as *mut u8).add(from as usize), len) };
                let aad = format::frame_aad(block, f as u32);
                let ok = key.is_some_and(|k| k.open_frame(&plan.nonce, f as u32, &aad, &format::tag(block, f), bytes));
                failed += u32::from(!ok);
            }
            if failed > 0 {
                if let Some(mut s) = sealing.opens.entry(seg.op) {
                    s.failed += failed;
                }
            }
        }
        self.pass_on(seg)
    }

    fn pass_on(&self, seg: &Segment) -> Option<Finished<crate::store::OpContext>> {
        self.ops.segment_done(seg.op, Ok(())).unwrap_or_else(|e| {
            self.stray_completion(e);
            None
        })
    }

    /// The header of a sealed read, just landed at `block`: which key opens
    /// its frames, or None (not sealed for this reader, or unsound: judged
    /// again, and told, by `finish_get`).
    fn plan_of(&self, s: &OpenState, block: *mut u8) -> Option<Plan> {
        // SAFETY: the header segment landed into this block (a slot's first 4 KiB or the
        // operation's header block), HEADER_BYTES long, written by nobody until `finish`.
        let block = unsafe { std::slice::from_raw_parts(block as *const u8, HEADER_BYTES) };
        let header = format::decode_header(block, &self.namespace, &s.key, s.file_len).ok()?;
        let fields = header.sealed?;
        let keys = s.keys.as_ref()?;
        let key = keys.for_header(&fields.key_id, &fields.tenant_id)?;
        let previous = !std::ptr::eq(key, &keys.current);
        Some(Plan { previous, nonce: fields.nonce, payload_len: header.payload_len })
    }

    /// The verdict on a sealed read whose header decoded as `header`: Ok(()) to
    /// serve it, Err((corrupt, why)) otherwise: corrupt (removed) or not ours (kept).
    pub(super) fn judge_sealed(
        &self,
        sealing: &Sealing,
        id: OpId,
        keys: &TenantKeys,
        header: &ChunkHeader,
    ) -> std::result::Result<(), (bool, String)> {
        let Some(fields) = header.sealed else {
            Stats::add(&self.stats.not_ours_misses, 1);
            return Err((false, "a plaintext chunk in a store that seals: not loaded (written without the key, or planted)".into()));
        };
        if keys.for_header(&fields.key_id, &fields.tenant_id).is_none() {
            Stats::add(&self.stats.not_ours_misses, 1);
            let ours = fields.key_id == keys.current.key_id || keys.previous.as_ref().is_some_and(|p| p.key_id == fields.key_id);
            let why = if ours { "sealed for another tenant" } else { "sealed with another key" };
            return Err((false, format!("chunk {why}: not ours, kept")));
        }
        match sealing.opens.verdict(id.index) {
            Opened::All => {
                Stats::add(&self.stats.opened_gets, 1);
                Ok(())
            }
            Opened::Failed(n) => {
                Stats::add(&self.stats.auth_failures, 1);
                Err((true, format!("{n} of {} frames failed authentication", format::frame_count(header.payload_len))))
            }
            Opened::Missing => Err((true, "frames not opened (truncated while reading)".into())),
        }
    }
}

/// A sealed put's seal job, one of `SealPlan::jobs`: what `Job::SealFrames` carries.
pub struct SealJob {
    pub keys: Arc<TenantKeys>,
    /// The caller's payload (a slot's or a region's), read only.
    pub src: usize,
    pub payload_len: usize,
    /// The seal buffer's file image; its header fields are written already.
    pub dst: Transfer,
    pub nonce: [u8; 12],
    /// Which job of the put this is: it seals frames `job`, `job + jobs`, ...
    pub job: usize,
    pub progress: Arc<SealProgress>,
}

// SAFETY: the addresses name memory the put holds until `finish` (its pinned slot or region, its
// seal buffer); each job writes only its own frames and tags until the writes are queued.
unsafe impl Send for SealJob {}

/// What the jobs of one put share.
pub struct SealProgress {
    /// Which frames are sealed, and the first frame not queued for writing yet.
    sealed: Mutex<(Vec<bool>, usize)>,
    /// Jobs not done yet: the last one writes the header.
    left: AtomicUsize,
}

/// Bytes of a put's first write, and of each one after it (at most: the
/// device's largest request here, `max_sectors_kb`).
const FIRST_WRITE_BYTES: usize = 2 << 20;
const WRITE_BYTES: usize = 4 << 20;

/// How a sealed put's frames are sealed and written. The chunk workers seal
/// it together (job `j` of `J` takes frames `j`, `j + J`, ...: the file's
/// start first), so sealing at queue depth 1 takes 1/J of the time, and the
/// sealed start of the file is written in pieces as it grows: 2 MiB as soon
/// as they are sealed, then 4 MiB at a time, the header (tags, CRC) last.
/// A piece per frame kept the device at a shallow queue of small requests
/// and one write of the whole sealed file idled it during the sealing
/// (decision 0083).
pub(super) struct SealPlan {
    frames: usize,
    frame_bytes: usize,
    jobs: usize,
    /// Whether the payload has bytes (an empty one has a frame, nothing to write).
    writes: bool,
}

impl SealPlan {
    pub(super) fn new(payload_len: usize, workers: usize) -> Self {
        let frames = format::frame_count(payload_len as u64);
        let frame_bytes = format::frame_bytes_for(payload_len as u64) as usize;
        SealPlan { frames, frame_bytes, jobs: workers.clamp(1, frames), writes: payload_len > 0 }
    }

    pub(super) fn jobs(&self) -> usize {
        self.jobs
    }

    pub(super) fn progress(&self) -> Arc<SealProgress> {
        Arc::new(SealProgress { sealed: Mutex::new((vec![false; self.frames], 0)), left: AtomicUsize::new(self.jobs) })
    }

    /// The frames job `j` seals, in order.
    fn frames_of(&self, j: usize) -> impl Iterator<Item = usize> {
        (j..self.frames).step_by(self.jobs)
    }

    /// The frame after the write that starts at frame `start`.
    fn piece_end(&self, start: usize) -> usize {
        let bytes = if start == 0 { FIRST_WRITE_BYTES } else { WRITE_BYTES };
        (start + (bytes / self.frame_bytes).max(1)).min(self.frames)
    }

    /// Every transfer of the put: its writes, and the header.
    pub(super) fn segments(&self) -> u32 {
        let (mut writes, mut at) = (0, 0);
        while self.writes && at < self.frames {
            at = self.piece_end(at);
            writes += 1;
        }
        writes + 1
    }
}

impl Core {
    /// Seals job `job.job`'s frames into the buffer; whichever job completes
    /// a piece of the file's sealed start queues its write, and the last job
    /// to end queues the header (tags, CRC).
    pub(super) fn seal_frames(&self, job: SealJob, backend: &dyn Backend, workers: usize) {
        let len = job.payload_len;
        let plan = SealPlan::new(len, workers);
        let (frame_bytes, file_len) = (plan.frame_bytes, format::file_len(len));
        let base = job.dst.base();
        // SAFETY: the seal buffer holds a whole file of this length (`put` checked `payload_room`);
        // the header's fields before the tags were written before the jobs were queued and are
        // only read until the last job seals the header.
        let fields = unsafe { std::slice::from_raw_parts(base as *const u8, format::SEALED_FIELDS_END) };
        // SAFETY: `src`/`payload_len` name the payload the put pinned; nothing writes it meanwhile
        // (the caller's contract with a slot or region in flight), and it is only read here.
        let src = unsafe { std::slice::from_raw_parts(job.src as *const u8, len) };
        let key = &job.keys.current;
        for f in plan.frames_of(job.job) {
            let from = f * frame_bytes;
            let to = (from + frame_bytes).min(len);
            let aad = format::frame_aad(fields, f as u32);
            // SAFETY: `HEADER_BYTES + to <= file_len`, inside the seal buffer; frame `f` is this
            // job's alone, and no write covers it before it is marked sealed below.
            let dst = unsafe { std::slice::from_raw_parts_mut(base.add(HEADER_BYTES + from), to - from) };
            let tag = key.seal_frame(&job.nonce, f as u32, &aad, &src[from..to], dst);
            // SAFETY: the tag of frame `f` (< MAX_FRAMES) lies in the header block, past the
            // fields read above; only this job writes it.
            unsafe { std::ptr::copy_nonoverlapping(tag.as_ptr(), base.add(format::tag_offset(f)), tag.len()) };
            // The lock orders every job's sealing before the write that covers it.
            let mut sealed = job.progress.sealed.lock().unwrap_or_else(|e| e.into_inner());
            sealed.0[f] = true;
            while plan.writes && sealed.1 < plan.frames {
                let (start, end) = (sealed.1, plan.piece_end(sealed.1));
                if !sealed.0[start..end].iter().all(|s| *s) {
                    break;
                }
                sealed.1 = end;
                // The piece's bytes in the file, the padding after the last frame included.
                submit_range(backend, job.dst, HEADER_BYTES + start * frame_bytes, (HEADER_BYTES + end * frame_bytes).min(file_len), 0);
            }
        }
        // AcqRel: the last job sees every other job's tags.
        if job.progress.left.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        // SAFETY: every job of the put is done with the buffer's header block (the count above);
        // no transfer of it is queued yet.
        let block = unsafe { std::slice::from_raw_parts_mut(base, HEADER_BYTES) };
        format::seal_header_crc(block);
        Stats::add(&self.stats.sealed_puts, 1);
        submit_range(backend, job.dst, 0, HEADER_BYTES, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::SealPlan;

    #[test]
    fn the_jobs_cover_every_frame_once_and_the_writes_every_byte() {
        for (len, workers) in [(0, 2), (1, 2), (3 << 20, 2), (8 << 20, 2), ((28 << 20) + 5, 2), (28 << 20, 3), (400 << 20, 16)] {
            let plan = SealPlan::new(len, workers);
            let mut frames: Vec<usize> = (0..plan.jobs()).flat_map(|j| plan.frames_of(j)).collect();
            frames.sort_unstable();
            assert_eq!(frames, (0..crate::disk::format::frame_count(len as u64)).collect::<Vec<_>>(), "{len}");
            assert!(plan.jobs() <= workers.max(1));
        }
        let plan = SealPlan::new(28 << 20, 2);
        let mut ends = vec![];
        let mut at = 0;
        while at < plan.frames {
            at = plan.piece_end(at);
            ends.push(at);
        }
        assert_eq!(ends, [2, 6, 10, 14, 18, 22, 26, 28]);
        assert_eq!((plan.jobs(), plan.segments()), (2, 9));
        assert_eq!(plan.frames_of(1).take(3).collect::<Vec<_>>(), [1, 3, 5]);
        assert_eq!(SealPlan::new(8 << 20, 2).segments(), 4, "2 + 4 + 2 MiB, the header");
        assert_eq!(SealPlan::new(1 << 20, 2).segments(), 2, "one frame: one write and the header");
        assert_eq!(SealPlan::new(0, 2).segments(), 1, "an empty payload: the header alone");
        assert_eq!(SealPlan::new(400 << 20, 2).piece_end(0), 1, "frames over 2 MiB: a write each");
    }
}
