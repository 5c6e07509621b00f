//! Bounded staging memory: one mapping, fixed-size slots, a hard byte budget.
//!
//! Every slot is `HEADER_BYTES` of header space followed by the payload, so a
//! chunk moves between disk and staging in one aligned transfer and the header
//! is built and verified in place. The mapping is 2 MiB aligned (huge-page
//! friendly) and can live in a named shared-memory file so that vLLM worker
//! processes map the very same bytes. Acquiring a slot blocks up to a timeout
//! and then fails: memory never grows past the budget.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::disk::format::{round_up, HEADER_BYTES, IO_ALIGN};
use crate::error::{EngineError, Result};
use crate::wait::{deadline_after, wait_until, TimedOut};

mod mapping;
mod slots;
use mapping::{check_shm_name, find_memfd, map_anonymous, map_fd, map_memfd, map_shm, reserve_aligned, shm_path};
use slots::{Released, SlotTable};

const MAP_ALIGN: usize = 2 << 20;
const TRAILER_BYTES: usize = 4096;
// "PYKVSTG2": version 2 added the ready words between the slots and the trailer
// (a version-1 attacher would read the sizes wrong, so it refuses the pool).
const TRAILER_MAGIC: u64 = 0x5059_4b56_5354_4732;

/// Most slots of one pool: segments name their slot in a u16 (fixed-buffer index).
pub const MAX_SLOTS: usize = u16::MAX as usize;

/// The slot stride and data length of a pool, every step checked: the sizes
/// come from users (or, on attach, from a file), and a stride that wrapped
/// around would alias slots or point outside the mapping. The whole
/// reservation must also stay within `isize::MAX`, the bound on pointer
/// offsets and buffer lengths (a Python buffer's length is signed).
fn layout(slot_bytes: usize, num_slots: usize) -> Result<(usize, usize)> {
    if slot_bytes == 0 {
        return Err(EngineError::invalid("slot_bytes must be positive, got 0"));
    }
    if num_slots == 0 || num_slots > MAX_SLOTS {
        return Err(EngineError::invalid(format!("num_slots must be in 1..={MAX_SLOTS}, got {num_slots}")));
    }
    let too_big = || {
        EngineError::invalid(format!(
            "slot_bytes={slot_bytes} with num_slots={num_slots} is too large: the pool would not fit the address space"
        ))
    };
    let stride = slot_bytes.checked_next_multiple_of(IO_ALIGN).and_then(|p| p.checked_add(HEADER_BYTES)).ok_or_else(too_big)?;
    let data_len = stride.checked_mul(num_slots).ok_or_else(too_big)?;
    match data_len.checked_add(ready_table_bytes(num_slots) + TRAILER_BYTES + MAP_ALIGN) {
        Some(total) if total <= isize::MAX as usize => Ok((stride, data_len)),
        _ => Err(too_big()),
    }
}

/// Bytes of the ready-word table (one `u32` per slot, `ready.rs`), whole pages
/// so the trailer stays page-aligned; it lies between the slots and the
/// trailer, outside the region registered for I/O or with CUDA.
fn ready_table_bytes(num_slots: usize) -> usize {
    round_up(num_slots * 4, IO_ALIGN)
}

pub struct StagingPool {
    base: *mut u8,
    reserved: *mut u8,
    reserved_len: usize,
    mapped_len: usize,
    slot_bytes: usize,
    stride: usize,
    num_slots: usize,
    shm_name: Option<String>,
    owner: bool,
    /// The creator's memfd (`Backing::Memfd`): kept open for the pool's life so
    /// that other processes can open it through `/proc/<pid>/fd`.
    memfd: Option<OwnedFd>,
    slots: Mutex<SlotTable>,
    freed: Condvar,
}

// SAFETY: `base` and `reserved` point into a mapping this struct owns and unmaps only in `Drop`.
// Shared state is behind `slots`' mutex or atomic (the ready words); slot bytes are only ever
// reached through raw pointers, by whoever leased the slot (an operation of the store, or the
// caller), never through a reference the pool hands out.
unsafe impl Send for StagingPool {}
// SAFETY: as for `Send`: no method gives shared access to slot bytes, and the rest is synchronized.
unsafe impl Sync for StagingPool {}

/// Where a pool's memory lives.
#[derive(Clone, Copy, Debug)]
pub enum Backing<'a> {
    /// Private anonymous memory: this process only.
    Private,
    /// `/dev/shm/<name>`, created exclusively; others `attach` it by name. The
    /// owner unlinks the name when it closes, so a killed owner leaves it behind.
    Named(&'a str),
    /// An unnamed memfd labelled `<name>`: never in /dev/shm (nor limited by its
    /// size), freed by the kernel when the last process holding it exits, however
    /// it exits. Others `attach_memfd` it through the owner's `/proc/<pid>/fd`.
    Memfd(&'a str),
}

impl StagingPool {
    /// Creates a pool of `num_slots` slots of `slot_bytes` payload each.
    /// With `shm_name`, backs it by `/dev/shm/<shm_name>` (created exclusively).
    pub fn create(slot_bytes: usize, num_slots: usize, shm_name: Option<&str>) -> Result<Self> {
        Self::create_backed(slot_bytes, num_slots, shm_name.map_or(Backing::Private, Backing::Named))
    }

    /// Creates a pool in `backing`. Shared memory is reserved in full here
    /// (`posix_fallocate`): a region larger than what the system can give fails
    /// now, with an error, instead of a SIGBUS when a slot is first touched.
    pub fn create_backed(slot_bytes: usize, num_slots: usize, backing: Backing<'_>) -> Result<Self> {
        let (stride, data_len) = layout(slot_bytes, num_slots)?;
        let mapped_len = data_len + ready_table_bytes(num_slots) + TRAILER_BYTES;
        let (reserved, reserved_len, base) = reserve_aligned(mapped_len)?;
        let (result, shm_name) = match backing {
            Backing::Private => (map_anonymous(base, mapped_len).map(|()| None), None),
            Backing::Named(name) => (map_shm(base, mapped_len, name).map(|()| None), Some(name)),
            Backing::Memfd(name) => (map_memfd(base, mapped_len, name).map(Some), Some(name)),
        };
        let memfd = match result {
            Ok(memfd) => memfd,
            Err(e) => {
                // SAFETY: `reserved`/`reserved_len` is the reservation `reserve_aligned` made
                // above; nothing refers to it yet.
                unsafe { libc::munmap(reserved as *mut _, reserved_len) };
                return Err(e);
            }
        };
        // SAFETY: `[base, base + mapped_len)` is mapped readable and writable and `mapped_len >
        // TRAILER_BYTES`; no other reference to the trailer exists yet.
        let trailer = unsafe { std::slice::from_raw_parts_mut(base.add(mapped_len - TRAILER_BYTES), TRAILER_BYTES) };
        trailer[0..8].copy_from_slice(&TRAILER_MAGIC.to_le_bytes());
        trailer[8..16].copy_from_slice(&(slot_bytes as u64).to_le_bytes());
        trailer[16..24].copy_from_slice(&(stride as u64).to_le_bytes());
        trailer[24..32].copy_from_slice(&(num_slots as u64).to_le_bytes());
        let mut pool = Self::new(base, reserved, reserved_len, mapped_len, slot_bytes, stride, num_slots, shm_name, true);
        pool.memfd = memfd;
        Ok(pool)
    }

    /// Maps a pool that another process created in `/dev/shm/<shm_name>`.
    /// Slot accounting stays with the creator.
    pub fn attach(shm_name: &str) -> Result<Self> {
        let path = shm_path(shm_name)?;
        let file =
            File::options().read(true).write(true).open(&path).map_err(|e| EngineError::io(format!("opening shared staging {path}"), e))?;
        Self::attach_file(&file, shm_name, &path)
    }

    /// Maps a pool another process created as `Backing::Memfd(name)`. The
    /// owner is looked for in this process and its parent (vLLM's scheduler
    /// is one or the other for every local worker), then in every process,
    /// where the name must be unambiguous.
    pub fn attach_memfd(name: &str) -> Result<Self> {
        check_shm_name(name)?;
        let path = find_memfd(name)?;
        let file = File::options()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| EngineError::io(format!("opening shared staging memfd {name} at {path}"), e))?;
        Self::attach_file(&file, name, &format!("memfd {name} ({path})"))
    }

    fn attach_file(file: &File, shm_name: &str, path: &str) -> Result<Self> {
        let meta = file.metadata().map_err(|e| EngineError::io(format!("staging pool {path}"), e))?;
        let mapped_len = meta.len() as usize;
        if mapped_len < TRAILER_BYTES {
            return Err(EngineError::invalid(format!("{path} is not a pykvcache staging pool")));
        }
        let (reserved, reserved_len, base) = reserve_aligned(mapped_len)?;
        if let Err(e) = map_fd(base, mapped_len, file.as_raw_fd(), path) {
            // SAFETY: `reserved`/`reserved_len` is the reservation `reserve_aligned` made above;
            // nothing refers to it yet.
            unsafe { libc::munmap(reserved as *mut _, reserved_len) };
            return Err(e);
        }
        // SAFETY: `mapped_len >= TRAILER_BYTES` (checked above) and `[base, base + mapped_len)` is
        // mapped readable; only the creator writes the trailer, once, before any process attaches.
        let trailer = unsafe { std::slice::from_raw_parts(base.add(mapped_len - TRAILER_BYTES), 32) };
        let word = |i: usize| u64::from_le_bytes(trailer[i * 8..i * 8 + 8].try_into().unwrap()) as usize;
        let (magic, slot_bytes, stride, num_slots) = (word(0) as u64, word(1), word(2), word(3));
        // The trailer is file content: its sizes must be the ones `create`
        // derives, or slot pointers (and views) could reach past the mapping.
        let consistent = layout(slot_bytes, num_slots)
            .is_ok_and(|(s, d)| s == stride && d.checked_add(ready_table_bytes(num_slots) + TRAILER_BYTES) == Some(mapped_len));
        if magic != TRAILER_MAGIC || !consistent {
            // SAFETY: the reservation made above, whose mapping nothing refers to yet (the trailer
            // slice is dead).
            unsafe { libc::munmap(reserved as *mut _, reserved_len) };
            return Err(EngineError::invalid(format!("{path} is not a pykvcache staging pool")));
        }
        Ok(Self::new(base, reserved, reserved_len, mapped_len, slot_bytes, stride, num_slots, Some(shm_name), false))
    }

    #[allow(clippy::too_many_arguments)]
    fn new(
        base: *mut u8,
        reserved: *mut u8,
        reserved_len: usize,
        mapped_len: usize,
        slot_bytes: usize,
        stride: usize,
        num_slots: usize,
        shm_name: Option<&str>,
        owner: bool,
    ) -> Self {
        StagingPool {
            base,
            reserved,
            reserved_len,
            mapped_len,
            slot_bytes,
            stride,
            num_slots,
            shm_name: shm_name.map(str::to_owned),
            owner,
            memfd: None,
            slots: Mutex::new(SlotTable::new(num_slots, owner)),
            freed: Condvar::new(),
        }
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }
    pub fn stride(&self) -> usize {
        self.stride
    }
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }
    pub fn total_bytes(&self) -> usize {
        self.mapped_len
    }
    pub fn base_address(&self) -> usize {
        self.base as usize
    }
    pub fn shm_name(&self) -> Option<&str> {
        self.shm_name.as_deref()
    }
    pub fn is_owner(&self) -> bool {
        self.owner
    }
    /// Created as `Backing::Memfd` (by this process).
    pub fn is_memfd(&self) -> bool {
        self.memfd.is_some()
    }

    /// The slot table, also after a panic elsewhere poisoned its lock: every
    /// change to it checks before it writes, so a failed assertion leaves it whole.
    fn table(&self) -> MutexGuard<'_, SlotTable> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn free_slots(&self) -> usize {
        self.table().free_count()
    }

    pub fn payload_offset(&self, slot: usize) -> Result<usize> {
        self.check_slot(slot)?;
        Ok(slot * self.stride + HEADER_BYTES)
    }

    /// Start of the slot (its header space); transfers begin here.
    pub fn slot_ptr(&self, slot: usize) -> *mut u8 {
        assert!(slot < self.num_slots, "slot {slot} out of range (pool has {})", self.num_slots);
        // SAFETY: `slot < num_slots` (asserted), so the offset lies within the slots' part of the
        // mapping, whose length `layout` keeps below `isize::MAX`.
        unsafe { self.base.add(slot * self.stride) }
    }

    pub fn payload_ptr(&self, slot: usize) -> *mut u8 {
        // SAFETY: every slot is `stride >= HEADER_BYTES + slot_bytes` long, so its payload start
        // lies inside it.
        unsafe { self.slot_ptr(slot).add(HEADER_BYTES) }
    }

    pub fn region_ptr(&self) -> *mut u8 {
        self.base
    }
    pub fn region_len(&self) -> usize {
        self.stride * self.num_slots
    }

    /// The ready word of `slot` (see `ready.rs`): in the shared mapping, so
    /// every process that maps the pool sees the same word.
    pub(crate) fn ready_word(&self, slot: usize) -> &std::sync::atomic::AtomicU32 {
        assert!(slot < self.num_slots, "slot {slot} out of range");
        // SAFETY: the ready table starts page-aligned right after the slots and holds one u32 per
        // slot, so the word is in the mapping and 4-byte aligned; the mapping outlives `&self`, and
        // the word is only accessed atomically (by every process that maps the pool). 4-byte
        // aligned (page-aligned table); lives as long as the mapping.
        unsafe { &*(self.base.add(self.region_len() + slot * 4) as *const std::sync::atomic::AtomicU32) }
    }

    fn check_slot(&self, slot: usize) -> Result<()> {
        if slot >= self.num_slots {
            return Err(EngineError::invalid(format!("slot {slot} out of range (pool has {})", self.num_slots)));
        }
        Ok(())
    }

    fn require_owner(&self) -> Result<()> {
        if !self.owner {
            return Err(EngineError::State("slot accounting belongs to the process that created the pool".into()));
        }
        Ok(())
    }

    /// Takes a free slot, waiting up to `timeout` (None = forever).
    pub fn acquire(&self, timeout: Option<Duration>) -> Result<usize> {
        self.require_owner()?;
        let start = Instant::now();
        let taken = wait_until(&self.slots, &self.freed, deadline_after(timeout), |t| {
            if t.closed {
                return Some(Err(EngineError::State("staging pool is closed".into())));
            }
            t.lease().map(Ok)
        });
        taken.unwrap_or_else(|TimedOut| {
            Err(EngineError::PoolExhausted {
                waited_ms: start.elapsed().as_millis() as u64,
                num_slots: self.num_slots,
                slot_bytes: self.slot_bytes,
            })
        })
    }

    pub fn release(&self, slot: usize) -> Result<()> {
        self.require_owner()?;
        self.check_slot(slot)?;
        if self.table().release(slot)? == Released::Freed {
            self.freed.notify_one();
        }
        Ok(())
    }

    pub fn is_acquired(&self, slot: usize) -> bool {
        slot < self.num_slots && self.table().is_acquired(slot)
    }

    pub fn export_begin(&self, slot: usize) -> Result<()> {
        self.check_slot(slot)?;
        self.table().export_begin(slot)
    }

    /// Ends a view counted by `export_begin`; one that was never begun is a
    /// bug (a panic).
    pub fn export_end(&self, slot: usize) {
        assert!(slot < self.num_slots, "slot {slot} out of range (pool has {})", self.num_slots);
        self.table().export_end(slot);
    }

    pub fn exports(&self, slot: usize) -> u32 {
        if slot >= self.num_slots {
            0
        } else {
            self.table().exports(slot)
        }
    }

    /// Pins a slot for I/O: it cannot be released until the I/O completes.
    pub fn pin_io(&self, slot: usize) -> Result<()> {
        self.check_slot(slot)?;
        self.table().pin_io(slot)
    }

    /// Ends the I/O `pin_io` began. Err (nothing changed) when the slot has
    /// none: a bug the caller reports (it may be the ring thread, which must
    /// not panic).
    pub fn unpin_io(&self, slot: usize) -> std::result::Result<(), String> {
        if slot >= self.num_slots {
            return Err(format!("I/O on staging slot {slot} ended: out of range (pool has {})", self.num_slots));
        }
        if self.table().unpin_io(slot)? {
            self.freed.notify_one();
        }
        Ok(())
    }

    /// The I/O pinning `slot` was abandoned: keep the slot out of use until
    /// it really ends. A slot whose I/O already ended is left alone.
    pub fn quarantine(&self, slot: usize) {
        if slot < self.num_slots {
            self.table().quarantine(slot);
        }
    }

    /// Slots held back because abandoned I/O may still touch them.
    pub fn quarantined_slots(&self) -> usize {
        self.table().quarantined_count()
    }

    /// Slots their owner released while quarantined: neither the owner's nor
    /// free until their abandoned I/O ends.
    pub fn deferred_releases(&self) -> usize {
        self.table().deferred_count()
    }

    /// Quarantined slots whose I/O has since ended (and that were freed or
    /// given back to their owner).
    pub fn quarantine_releases(&self) -> u64 {
        self.table().quarantine_releases
    }

    /// Marks the pool closed (acquire fails from now on) and removes the shared
    /// memory name (a memfd has none). The mapping itself goes away when the
    /// last user drops it.
    pub fn close(&self) -> Result<()> {
        let mut st = self.table();
        if let Some(slot) = st.first_exported() {
            return Err(EngineError::State(format!("slot {slot} still has exported views")));
        }
        if !st.closed && self.owner && self.memfd.is_none() {
            if let Some(name) = &self.shm_name {
                let _ = std::fs::remove_file(format!("/dev/shm/{name}"));
            }
        }
        st.closed = true;
        drop(st);
        self.freed.notify_all();
        Ok(())
    }
}

impl Drop for StagingPool {
    fn drop(&mut self) {
        let _ = self.close();
        // SAFETY: the pool's own reservation, unmapped once. Nothing in this process uses the
        // mapping any more: the store holds an `Arc` of the pool while any transfer into it may
        // run, and views exported to Python hold one too.
        unsafe { libc::munmap(self.reserved as *mut _, self.reserved_len) };
    }
}

#[cfg(test)]
mod tests;
