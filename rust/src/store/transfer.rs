//! What one operation's transfers share and how they are cut into segments
//! for the backend: a get's read, a put's write and its header, a rewrite
//! after ENOSPC. The submission helpers of both paths; no state of their own.

use crate::backend::{Backend, Segment};
use crate::disk::format::HEADER_BYTES;
use crate::ops::OpId;
use crate::staging::StagingPool;

/// Transfers `[from, to)` takes at `seg_bytes` a piece (0: one transfer).
pub(super) fn segment_count(from: usize, to: usize, seg_bytes: usize) -> usize {
    match (to > from, seg_bytes) {
        (false, _) => 0,
        (true, 0) => 1,
        (true, s) => (to - from).div_ceil(s),
    }
}

/// What the segments of one operation share: `base` is the memory of file
/// offset 0 (offset `o` of the file moves from or to `base + o`).
#[derive(Clone, Copy)]
pub(super) struct Transfer {
    op: u32,
    /// Registered-buffer index: staging slots only (regions are not registered).
    buf_index: Option<u16>,
    base: *mut u8,
    fd: i32,
    /// Where the chunk image starts in the file (`Segment::file_base`).
    file_base: u64,
    write: bool,
    background: bool,
    root: usize,
}

// SAFETY: `base` is only an address, handed to the backend in segments; the memory it names (a
// staging slot, a header block, a pinned region) is held by the operation the transfer belongs to
// until `finish`, after its last segment completed.
unsafe impl Send for Transfer {}

impl Transfer {
    pub(super) fn of_slot(pool: &StagingPool, id: OpId, slot: usize, fd: i32, write: bool, background: bool, root: usize) -> Self {
        Transfer { op: id.index, buf_index: Some(slot as u16), base: pool.slot_ptr(slot), fd, file_base: 0, write, background, root }
    }

    pub(super) fn base(&self) -> *mut u8 {
        self.base
    }

    /// The same transfer into a chunk image that starts at `file_base` in its file (a slot).
    pub(super) fn at(self, file_base: u64) -> Self {
        Transfer { file_base, ..self }
    }

    /// A prefetch's transfer (background priority in the backend).
    pub(super) fn background(&self) -> bool {
        self.background
    }

    /// Memory at `base` for file offset 0, registered buffer `buf_index` if any (a seal buffer).
    pub(super) fn of_registered(
        id: OpId,
        base: *mut u8,
        buf_index: Option<u16>,
        fd: i32,
        write: bool,
        background: bool,
        root: usize,
    ) -> Self {
        Transfer { op: id.index, buf_index, base, fd, file_base: 0, write, background, root }
    }

    /// Memory at `base` for file offset 0, not a registered buffer.
    pub(super) fn of_memory(id: OpId, base: *mut u8, fd: i32, write: bool, background: bool, root: usize) -> Self {
        Transfer { op: id.index, buf_index: None, base, fd, file_base: 0, write, background, root }
    }
}

/// Where a chunk file's bytes live in memory: one staging slot for the whole
/// file, or (a region operation) the header block for `[0, HEADER_BYTES)`
/// and the caller's region for the payload.
#[derive(Clone, Copy)]
pub(super) struct FileMemory {
    pub header: Transfer,
    /// None: the payload follows the header in the same memory (a slot).
    pub payload: Option<Transfer>,
}

impl FileMemory {
    /// Both parts at `file_base` (see `Transfer::at`).
    pub(super) fn at(self, file_base: u64) -> Self {
        FileMemory { header: self.header.at(file_base), payload: self.payload.map(|p| p.at(file_base)) }
    }

    pub(super) fn set_background(&mut self, background: bool) {
        self.header.background = background;
        if let Some(p) = &mut self.payload {
            p.background = background;
        }
    }

    /// Transfers `[from, to)` takes: a region operation's header block is
    /// one transfer of its own, its payload is cut from `HEADER_BYTES`.
    pub(super) fn segment_count(&self, from: usize, to: usize, seg_bytes: usize) -> usize {
        match self.payload {
            None => segment_count(from, to, seg_bytes),
            Some(_) => segment_count(from, to.min(HEADER_BYTES), 0) + segment_count(from.max(HEADER_BYTES), to, seg_bytes),
        }
    }

    pub(super) fn submit(&self, backend: &dyn Backend, from: usize, to: usize, seg_bytes: usize) {
        match self.payload {
            None => submit_range(backend, self.header, from, to, seg_bytes),
            Some(payload) => {
                if from < HEADER_BYTES {
                    submit_range(backend, self.header, from, to.min(HEADER_BYTES), 0);
                }
                submit_range(backend, payload, from.max(HEADER_BYTES), to, seg_bytes);
            }
        }
    }
}

/// Hands bytes `[from, to)` of a file, from the same offsets of the memory at
/// `base`, to the backend in segments that start at multiples of `seg_bytes`
/// from `from` (reads number their checksum pieces by it).
pub(super) fn submit_range(backend: &dyn Backend, t: Transfer, from: usize, to: usize, seg_bytes: usize) {
    let seg_bytes = if seg_bytes == 0 { to.saturating_sub(from).max(1) } else { seg_bytes };
    let blank = Segment {
        op: t.op,
        fd: t.fd,
        buf: std::ptr::null_mut(),
        len: 0,
        offset: 0,
        file_base: t.file_base,
        write: t.write,
        buf_index: t.buf_index,
        background: t.background,
        root: t.root as u32,
    };
    // Small fixed batch on the stack: no per-I/O heap allocation.
    let mut batch = [blank; 16];
    let mut filled = 0;
    let mut offset = from;
    while offset < to {
        let len = seg_bytes.min(to - offset);
        // wrapping: a region's `base` lies before its memory (offset 0 is the header's).
        batch[filled] = Segment { buf: t.base.wrapping_add(offset), len, offset: offset as u64, ..blank };
        filled += 1;
        offset += len;
        if filled == batch.len() {
            backend.submit(&batch[..filled]);
            filled = 0;
        }
    }
    if filled > 0 {
        backend.submit(&batch[..filled]);
    }
}
