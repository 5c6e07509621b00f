//! External memory regions: chunk payloads moved straight between a file and
//! memory the caller owns (vLLM's CPU-tier region), with no staging slot and
//! no copy. Decision 0062.
//!
//! A region is registered once (`register_region`: base, length) and named
//! by a `RegionId` from then on; `put_region` / `get_region` name a byte
//! range of it. The on-disk format is the slot path's: the 4 KiB header
//! block (checksums, namespace fingerprint) lives in an engine-owned aligned
//! block, one per op-table entry (`HeaderBlocks`), and travels as its own
//! aligned transfer at file offset 0; the payload goes to or from the region
//! at `HEADER_BYTES`. Writes still send the payload first and the header
//! last, after the pipelined CRC (`Job::Seal`).
//!
//! Checked at submission, each an `EngineError`, never a fault: a region not
//! registered (or being unregistered), a range outside it, a length that is
//! not a whole number of 4 KiB blocks, an address not 4 KiB aligned. The
//! alignment rules hold whether or not O_DIRECT is active: a chunk's payload
//! occupies whole 4 KiB blocks on disk, so a row of another length would
//! need padding written from, or read into, the caller's neighbouring bytes;
//! the caller copies such rows through a staging slot instead.
//!
//! Lifetime: every operation pins its region until `finish`, even one the
//! deadline watchdog abandoned (the kernel may still move its bytes);
//! `unregister_region` refuses new operations at once and returns only when
//! none is left, or fails after its timeout with the region still retired
//! (the caller keeps the memory alive and tries again). The store never
//! maps, unmaps or frees a region: closing it only ends the operations.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use super::jobs::DirJob;
use super::{Memory, OpKind};
use crate::disk::format::{self, HEADER_BYTES, IO_ALIGN};
use crate::error::{EngineError, Result};
use crate::ops::OpId;
use crate::wait::{deadline_after, wait_until, TimedOut};

/// A registered region, generation-checked: an id kept after its
/// unregistration never names a later region that took its place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionId {
    pub index: u32,
    pub generation: u32,
}

impl RegionId {
    /// One integer for callers that hand ids around (Python): generation high, index low.
    pub fn to_u64(self) -> u64 {
        (u64::from(self.generation) << 32) | u64::from(self.index)
    }

    pub fn from_u64(v: u64) -> Self {
        RegionId { index: v as u32, generation: (v >> 32) as u32 }
    }
}

struct Entry {
    generation: u32,
    base: usize,
    len: usize,
    /// Registered and not being unregistered: takes new operations.
    open: bool,
    /// Operations between their pin and their `finish`.
    pinned: u32,
}

/// The regions of one store.
#[derive(Default)]
pub(super) struct Regions {
    entries: Mutex<Vec<Entry>>,
    unpinned: Condvar,
}

/// The payload memory of one region operation (an address: contexts cross threads).
#[derive(Clone, Copy, Debug)]
pub(super) struct RegionPin {
    pub index: u32,
    pub payload: usize,
}

impl Regions {
    pub(super) fn register(&self, base: *mut u8, len: usize) -> Result<RegionId> {
        if base.is_null() || len == 0 {
            return Err(EngineError::invalid("a region needs a non-null base and a positive length"));
        }
        if (base as usize).checked_add(len).is_none() {
            return Err(EngineError::invalid("region wraps around the address space"));
        }
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let free = entries.iter().position(|e| !e.open && e.pinned == 0 && e.len == 0);
        let index = free.unwrap_or_else(|| {
            entries.push(Entry { generation: 0, base: 0, len: 0, open: false, pinned: 0 });
            entries.len() - 1
        });
        let e = &mut entries[index];
        e.generation = e.generation.wrapping_add(1);
        (e.base, e.len, e.open, e.pinned) = (base as usize, len, true, 0);
        Ok(RegionId { index: index as u32, generation: e.generation })
    }

    /// Pins `[offset, offset + length)` of region `id` for one operation.
    pub(super) fn pin(&self, id: RegionId, offset: usize, length: usize) -> Result<RegionPin> {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let e = match entries.get_mut(id.index as usize) {
            Some(e) if e.open && e.generation == id.generation => e,
            _ => return Err(EngineError::State(format!("region {} is not registered", id.to_u64()))),
        };
        let end = offset.checked_add(length).filter(|&end| end <= e.len);
        if end.is_none() {
            return Err(EngineError::invalid(format!("bytes {offset}..+{length} lie outside the region of {} bytes", e.len)));
        }
        if length == 0 || !length.is_multiple_of(IO_ALIGN) {
            return Err(EngineError::invalid(format!(
                "region length {length} is not a positive multiple of {IO_ALIGN} (a chunk's payload fills whole blocks on disk)"
            )));
        }
        let payload = e.base + offset;
        if !payload.is_multiple_of(IO_ALIGN) {
            return Err(EngineError::invalid(format!("region address {payload:#x} is not {IO_ALIGN}-byte aligned")));
        }
        e.pinned += 1;
        Ok(RegionPin { index: id.index, payload })
    }

    /// Ends the pin of one operation. Err (nothing changed) when the region
    /// has no pin: a bug the caller reports (it may be the ring thread).
    pub(super) fn unpin(&self, pin: RegionPin) -> std::result::Result<(), String> {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let e = match entries.get_mut(pin.index as usize) {
            Some(e) if e.pinned > 0 => e,
            _ => return Err(format!("an operation on region index {} ended, none was pinned", pin.index)),
        };
        e.pinned -= 1;
        if e.pinned == 0 {
            drop(entries);
            self.unpinned.notify_all();
        }
        Ok(())
    }

    /// Refuses new operations on `id` at once, then waits up to `timeout`
    /// for the pinned ones. Err while some remain (the region stays retired:
    /// call again) or when `id` is not registered.
    pub(super) fn unregister(&self, id: RegionId, timeout: Option<Duration>) -> Result<()> {
        let start = Instant::now();
        {
            let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
            match entries.get_mut(id.index as usize) {
                Some(e) if e.generation == id.generation && (e.open || e.len != 0) => e.open = false,
                _ => return Err(EngineError::State(format!("region {} is not registered", id.to_u64()))),
            }
        }
        let drained = wait_until(&self.entries, &self.unpinned, deadline_after(timeout), |entries| {
            let e = &mut entries[id.index as usize];
            (e.pinned == 0).then(|| e.len = 0)
        });
        drained.map_err(|TimedOut| {
            let ms = start.elapsed().as_millis();
            EngineError::State(format!("region {} still has operations in flight after {ms} ms; unregister it again later", id.to_u64()))
        })
    }

    /// Regions registered (or retired with operations left).
    pub(super) fn count(&self) -> usize {
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).iter().filter(|e| e.len != 0).count()
    }
}

/// One 4 KiB aligned header block per op-table entry: where a region
/// operation's header is built (put) or lands (get). Owned by the store's
/// core, which outlives every transfer.
pub(super) struct HeaderBlocks {
    base: *mut u8,
    layout: std::alloc::Layout,
}

// The blocks are only touched by the operation that owns the entry.
// SAFETY: the allocation is owned by this struct and freed only in `Drop`; `block(op)` hands out
// raw pointers, and only the operation holding op-table entry `op` reads or writes that block.
unsafe impl Send for HeaderBlocks {}
// SAFETY: as for `Send`: `&self` gives out addresses, never references to the bytes, and one block
// has one user at a time.
unsafe impl Sync for HeaderBlocks {}

impl HeaderBlocks {
    pub(super) fn new(entries: usize) -> Result<Self> {
        let bytes = entries.max(1).checked_mul(HEADER_BYTES).ok_or_else(|| EngineError::invalid("max_inflight too large"))?;
        let layout = std::alloc::Layout::from_size_align(bytes, IO_ALIGN).map_err(|e| EngineError::invalid(e.to_string()))?;
        // SAFETY: `layout` has a non-zero size (at least one block); a null result is handled
        // below.
        let base = unsafe { std::alloc::alloc_zeroed(layout) };
        if base.is_null() {
            return Err(EngineError::State(format!("cannot allocate {bytes} bytes of header blocks")));
        }
        Ok(HeaderBlocks { base, layout })
    }

    pub(super) fn block(&self, op: u32) -> *mut u8 {
        assert!(
            (op as usize + 1) * HEADER_BYTES <= self.layout.size(),
            "header block {op} past the {} allocated",
            self.layout.size() / HEADER_BYTES
        );
        // SAFETY: `op` is below the number of blocks allocated (asserted), so the block lies inside
        // the allocation.
        unsafe { self.base.add(op as usize * HEADER_BYTES) }
    }
}

impl Drop for HeaderBlocks {
    fn drop(&mut self) {
        // SAFETY: `base` came from `alloc_zeroed` with this very layout and is freed once; the core
        // that owns the blocks is dropped after every transfer ended.
        unsafe { std::alloc::dealloc(self.base, self.layout) };
    }
}

impl super::BlockStore {
    /// Registers `len` bytes at `base` for `put_region` / `get_region`.
    ///
    /// # Safety
    /// The memory must stay mapped, writable and unmoved until
    /// `unregister_region` returns Ok (or this store is dropped): the kernel
    /// reads and writes it while operations run. The store never frees it.
    pub unsafe fn register_region(&self, base: *mut u8, len: usize) -> Result<RegionId> {
        self.check_open()?;
        self.core.regions.register(base, len)
    }

    /// Refuses new operations on `id`, then waits up to `timeout` for those
    /// in flight; Ok once none is left (the memory is the caller's alone),
    /// Err while some remain (call again; keep the memory alive meanwhile).
    /// Works on a closed store too.
    pub fn unregister_region(&self, id: RegionId, timeout: Option<Duration>) -> Result<()> {
        self.core.regions.unregister(id, timeout)
    }

    /// Regions registered, counting retired ones with operations left.
    pub fn region_count(&self) -> usize {
        self.core.regions.count()
    }

    /// `put` of the `length` bytes at `offset` of region `id`: the payload is
    /// written from there, the header from the operation's own block.
    pub fn put_region(&self, key: &[u8], id: RegionId, offset: usize, length: usize, timeout: Option<Duration>) -> Result<OpId> {
        self.put_region_for(b"", key, id, offset, length, timeout)
    }

    /// `put_region` sealed for `tenant` (see `put_for`). In a store that
    /// seals, a chunk is sealed into a seal buffer the size of a slot's
    /// file: a longer range is refused.
    pub fn put_region_for(
        &self,
        tenant: &[u8],
        key: &[u8],
        id: RegionId,
        offset: usize,
        length: usize,
        timeout: Option<Duration>,
    ) -> Result<OpId> {
        self.check_open()?;
        Self::check_key(key)?;
        let file_len = format::file_len(length);
        if file_len as u64 > self.core.configured_capacity {
            let cap = self.core.configured_capacity;
            return Err(EngineError::invalid(format!("a {file_len}-byte chunk cannot fit the capacity of {cap} bytes")));
        }
        if let Some(room) = self.core.sealing.as_ref().map(|s| s.buffers.payload_room()).filter(|&room| length > room) {
            return Err(EngineError::invalid(format!("a sealed chunk of {length} bytes exceeds the seal buffers' {room} (the slot size)")));
        }
        let (op, mut ctx) = self.begin_on(OpKind::Put, key, tenant, Memory::Region { id, offset, length }, timeout)?;
        (ctx.file_len, ctx.payload_len) = (file_len, length);
        self.queue(DirJobKind::Write, op, ctx);
        Ok(op)
    }

    /// `get` into the `length` bytes at `offset` of region `id` (the room: a
    /// larger chunk is a miss, kept on disk). Only the chunk's payload blocks
    /// are written there; with verify="full" its CRC is checked in place
    /// before the get is Ok (a bad chunk is removed, the bytes left in the
    /// region are then the caller's to ignore).
    pub fn get_region(&self, key: &[u8], id: RegionId, offset: usize, length: usize, timeout: Option<Duration>) -> Result<OpId> {
        self.get_region_for(b"", key, id, offset, length, timeout)
    }

    /// `get_region` of a chunk sealed for `tenant` (see `get_for`).
    pub fn get_region_for(
        &self,
        tenant: &[u8],
        key: &[u8],
        id: RegionId,
        offset: usize,
        length: usize,
        timeout: Option<Duration>,
    ) -> Result<OpId> {
        self.check_open()?;
        Self::check_key(key)?;
        let (op, mut ctx) = self.begin_on(OpKind::Get, key, tenant, Memory::Region { id, offset, length }, timeout)?;
        ctx.payload_len = length;
        self.queue(DirJobKind::Read, op, ctx);
        Ok(op)
    }

    /// Refused at once while the directory is unavailable, else queued on its workers.
    fn queue(&self, kind: DirJobKind, op: OpId, ctx: super::OpContext) {
        if let Some(why) = self.core.health.refusal(ctx.root) {
            return self.core.refuse(op, ctx, why);
        }
        self.core.watch(op, &ctx);
        let root = ctx.root;
        let job = match kind {
            DirJobKind::Read => DirJob::OpenRead { id: op, ctx },
            DirJobKind::Write => DirJob::OpenWrite { id: op, ctx },
        };
        self.core.dirs[root].push(job);
    }
}

enum DirJobKind {
    Read,
    Write,
}
