//! Segment files on a store's roots (decision 0086, `disk::segment`): which
//! segment this store appends to, where each chunk it knows of lies (every
//! namespace's: their slots count against the capacity, decision 0053), the
//! descriptors it holds, and the publication of written slots by group
//! commit, the last of which seals a segment. Every store reads segments;
//! only one opened with `segment_files` writes them (`writes`). Reading other
//! writers' indexes is in `segment_scan`; what the put and get paths do with
//! a slot is in `write`/`read`.
//!
//! Locks: `places` and each open segment's state are leaves (no other lock
//! is taken while one is held, no I/O under `places`); the index write of a
//! publication runs with no lock held (its state says one is in flight).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::disk::dirfds::HeldDirs;
use crate::disk::index::{ChunkRef, NsId, OWN};
use crate::disk::segment::{self, SegmentIndex, SegmentName, INDEX_BYTES, LOG_DIR};
use crate::ops::OpId;

use super::OpContext;

/// About this many bytes of slots per segment (`segment::slots_for`).
pub(super) const SEGMENT_TARGET_BYTES: u64 = 1 << 30;
/// A lookup that misses reads other writers' indexes at most this often.
pub(super) const REFRESH_EVERY: Duration = Duration::from_millis(25);
/// How long a segment store trusts a root's free space (`statvfs`, a round
/// trip on a network filesystem: the only operation left in a put), less what
/// it wrote since. Other writers' bytes meanwhile are ENOSPC's to catch.
pub(super) const SPACE_FRESH: Duration = Duration::from_millis(100);
/// Slots allocated (`fallocate`) ahead of the writes, this many bytes of
/// them at a time (at most 1/32 of the capacity, at least one slot): a write
/// into allocated space is no extending write on the brick's filesystem
/// (decision 0013), and one allocation serves several puts. Allocated slots
/// not written yet are the only bytes on disk the capacity ledger does not
/// count: at most this much per writer and chunk size.
pub(super) const ALLOCATE_AHEAD_BYTES: u64 = 64 << 20;
/// Segment descriptors held per root; beyond it the table starts again.
pub(super) const MAX_FILES: usize = 1024;

/// One segment file, open for reading and writing (a reader punches evicted slots).
pub(super) struct SegmentFile {
    /// The namespace whose `log` directory holds it.
    pub ns: NsId,
    pub name: SegmentName,
    pub(super) fd: OwnedFd,
}

impl SegmentFile {
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Where a chunk of a segment lies.
#[derive(Clone)]
pub(super) struct Place {
    pub root: usize,
    pub file: Arc<SegmentFile>,
    pub slot: usize,
}

impl Place {
    pub fn file_base(&self) -> u64 {
        segment::slot_offset(self.slot, self.file.name.slot_bytes)
    }
}

/// A 4 KiB-aligned buffer of `len` bytes (O_DIRECT transfers of index blocks).
pub(super) struct Aligned {
    pub(super) ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is owned memory with no thread affinity; access goes through `&`/`&mut self`.
unsafe impl Send for Aligned {}

impl Aligned {
    pub(super) fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len, 4096).expect("an aligned layout");
        // SAFETY: `len` is non-zero (index blocks), so the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "out of memory for a {len}-byte index buffer");
        Aligned { ptr, len }
    }

    pub(super) fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `len` bytes this value owns; `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this size and alignment, freed once.
        unsafe { std::alloc::dealloc(self.ptr, std::alloc::Layout::from_size_align(self.len, 4096).unwrap()) };
    }
}

/// The segment a writer appends to, and its publications.
pub(super) struct OpenSegment {
    pub file: Arc<SegmentFile>,
    state: Mutex<WriterState>,
}

struct WriterState {
    /// What the next publication writes: every slot written so far.
    index: SegmentIndex,
    next_slot: usize,
    /// Slots `[0, allocated)` are allocated on disk.
    allocated: usize,
    /// Puts whose slot is written, waiting for an index that lists it.
    waiting: Vec<(OpId, OpContext)>,
    publishing: bool,
    /// Slots taken whose put has not ended (`Slot` lives as long as its put).
    outstanding: usize,
}

impl WriterState {
    /// Full, and every put of it ended: the next publication seals it.
    fn due_for_seal(&self) -> bool {
        !self.index.sealed && self.next_slot == self.index.slots && self.outstanding == 0 && self.waiting.is_empty()
    }
}

/// Puts waiting for their publication.
pub(super) type Puts = Vec<(OpId, OpContext)>;

/// What a publication found to do.
pub(super) enum Publication {
    /// Another thread publishes (the caller's put waits in its queue).
    Queued,
    /// Write `seq`'s index (sealed with `seal`) and then finish these puts.
    Write { seq: u64, puts: Vec<(OpId, OpContext)>, seal: bool },
}

/// A taken slot: where to write.
pub(super) struct Slot {
    pub segment: Arc<OpenSegment>,
    pub slot: usize,
}

impl Slot {
    pub fn file_base(&self) -> u64 {
        segment::slot_offset(self.slot, self.segment.file.name.slot_bytes)
    }
}

impl Drop for Slot {
    /// Its put ended (published, failed or abandoned): the segment can be
    /// sealed once it is full and none is left. No I/O here: the seal is
    /// the next publication's, or the close's.
    fn drop(&mut self) {
        self.segment.state.lock().unwrap().outstanding -= 1;
    }
}

/// What this store last read of a segment's index.
#[derive(Clone, Copy, Default)]
pub(super) struct Seen {
    pub seq: u64,
    pub sealed: bool,
    /// Slots listed in the indexes read so far: a slot is placed once, when
    /// first seen listed, so one evicted since is never found again.
    pub listed: [u64; 4],
}

impl Seen {
    pub fn has(&self, slot: usize) -> bool {
        self.listed[slot / 64] & (1 << (slot % 64)) != 0
    }

    pub fn mark(&mut self, slot: usize) {
        self.listed[slot / 64] |= 1 << (slot % 64);
    }
}

pub(super) struct RootSegments {
    /// The root itself, and this store's namespace's `log` directory on it.
    pub root_dir: PathBuf,
    pub dir: PathBuf,
    writing: Mutex<HashMap<u64, Arc<OpenSegment>>>,
    /// Segments this store wrote and has not sealed yet (`seal_all` at close).
    mine: Mutex<Vec<Arc<OpenSegment>>>,
    pub(super) files: Mutex<HashMap<(NsId, SegmentName), Arc<SegmentFile>>>,
    pub(super) seen: Mutex<HashMap<(NsId, SegmentName), Seen>>,
    /// When a miss last asked for a look.
    pub(super) last_refresh: Mutex<Option<Instant>>,
    /// Bytes of chunks this store wrote here, and the last free-space sample
    /// (when, bytes available, what `written` was then).
    written: std::sync::atomic::AtomicU64,
    space: Mutex<Option<(Instant, u64, u64)>>,
}

pub(super) struct Segments {
    pub roots: Vec<RootSegments>,
    /// New chunks go into segments (`segment_files`); else this store only reads them.
    pub writes: bool,
    pub(super) lease: u64,
    next_seq: AtomicU32,
    pub(super) places: Mutex<HashMap<ChunkRef, Place>>,
    direct: Vec<bool>,
    mode: u32,
    dir_mode: u32,
    ahead_bytes: u64,
}

/// Allocates slots from `from` on (the index copies too, with slot 0), at
/// least `ahead_bytes` of them (one slot at least), at most to the segment's end.
/// Returns the first slot not allocated. Where `fallocate` is refused, the
/// writes allocate: every slot counts as allocated.
fn allocate_ahead(file: &SegmentFile, from: usize, slots: usize, ahead_bytes: u64) -> std::io::Result<usize> {
    let slot_bytes = file.name.slot_bytes;
    let upto = (from + ((ahead_bytes / slot_bytes) as usize).max(1)).min(slots);
    let start = if from == 0 { 0 } else { segment::slot_offset(from, slot_bytes) };
    let end = segment::slot_offset(upto, slot_bytes);
    // SAFETY: fallocate takes no pointer; the descriptor is open while `file` is borrowed.
    match cvt(unsafe { libc::fallocate(file.fd(), 0, start as libc::off_t, (end - start) as libc::off_t) }) {
        Ok(()) => Ok(upto),
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(slots),
        Err(e) => Err(e),
    }
}

fn cvt(r: libc::c_int) -> std::io::Result<()> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

impl Segments {
    pub fn new(
        roots_and_ns: (&[PathBuf], &[PathBuf]),
        writes: bool,
        lease: u64,
        direct: Vec<bool>,
        (mode, dir_mode): (u32, u32),
        capacity: u64,
    ) -> Self {
        let roots = roots_and_ns
            .0
            .iter()
            .zip(roots_and_ns.1)
            .map(|(root, ns)| RootSegments {
                root_dir: root.clone(),
                dir: ns.join(LOG_DIR),
                writing: Mutex::default(),
                mine: Mutex::default(),
                files: Mutex::default(),
                seen: Mutex::default(),
                last_refresh: Mutex::default(),
                written: std::sync::atomic::AtomicU64::new(0),
                space: Mutex::default(),
            })
            .collect();
        let ahead_bytes = ALLOCATE_AHEAD_BYTES.min(capacity / 32);
        Segments { roots, writes, lease, next_seq: AtomicU32::new(0), places: Mutex::default(), direct, mode, dir_mode, ahead_bytes }
    }

    pub(super) fn flags(&self, root: usize) -> i32 {
        libc::O_RDWR | libc::O_CLOEXEC | if self.direct[root] { libc::O_DIRECT } else { 0 }
    }

    /// The next free slot of this writer's segment of `slot_bytes` slots on
    /// `root`; a full segment is replaced by a new one (created here: the
    /// caller is a directory worker).
    pub fn take_slot(&self, held: &HeldDirs, root: usize, slot_bytes: u64) -> std::io::Result<Slot> {
        let r = &self.roots[root];
        let mut writing = r.writing.lock().unwrap();
        if let Some(open) = writing.get(&slot_bytes) {
            let mut st = open.state.lock().unwrap();
            if st.next_slot < st.index.slots {
                let slot = st.next_slot;
                if slot >= st.allocated {
                    st.allocated = allocate_ahead(&open.file, slot, st.index.slots, self.ahead_bytes)?;
                }
                st.next_slot += 1;
                st.outstanding += 1;
                return Ok(Slot { segment: open.clone(), slot });
            }
        }
        if !r.dir.is_dir() {
            crate::disk::layout::create_dir_in(&r.dir, self.dir_mode)?;
        }
        // A name of this lease taken already (the same lease after its root came back): the next.
        let (name, fd) = loop {
            let name = SegmentName { lease: self.lease, seq: self.next_seq.fetch_add(1, Ordering::Relaxed), slot_bytes };
            match held.open(&r.dir.join(name.file_name()), self.flags(root) | libc::O_CREAT | libc::O_EXCL, self.mode) {
                Ok(fd) => break (name, fd),
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) && name.seq < u32::MAX => continue,
                Err(e) => return Err(e),
            }
        };
        // SAFETY: `open` returned a descriptor this function owns from here on.
        let file = Arc::new(SegmentFile { ns: OWN, name, fd: unsafe { OwnedFd::from_raw_fd(fd) } });
        self.remember_file(root, file.clone());
        let slots = segment::slots_for(slot_bytes, SEGMENT_TARGET_BYTES);
        let allocated = match allocate_ahead(&file, 0, slots, self.ahead_bytes) {
            Ok(upto) => upto,
            Err(e) => {
                // Nothing is in it yet: not left behind.
                let _ = held.unlink(&r.dir.join(name.file_name()));
                return Err(e);
            }
        };
        let state = WriterState {
            index: SegmentIndex::new(slot_bytes, slots),
            next_slot: 1,
            allocated,
            waiting: Vec::new(),
            publishing: false,
            outstanding: 1,
        };
        let open = Arc::new(OpenSegment { file, state: Mutex::new(state) });
        writing.insert(slot_bytes, open.clone());
        let mut mine = r.mine.lock().unwrap();
        mine.retain(|s| !s.state.lock().unwrap().index.sealed);
        mine.push(open.clone());
        Ok(Slot { segment: open, slot: 0 })
    }

    pub(super) fn remember_file(&self, root: usize, file: Arc<SegmentFile>) {
        let mut files = self.roots[root].files.lock().unwrap();
        if files.len() >= MAX_FILES {
            files.clear();
        }
        files.insert((file.ns, file.name), file);
    }

    /// A written slot's put joins the next publication of its segment.
    pub fn written(&self, segment: &OpenSegment, slot: usize, hash: u128, id: OpId, ctx: OpContext) -> Publication {
        let mut st = segment.state.lock().unwrap();
        st.index.entries[slot] = Some(hash);
        st.waiting.push((id, ctx));
        if st.publishing {
            return Publication::Queued;
        }
        st.publishing = true;
        Publication::Write { seq: st.index.seq + 1, puts: std::mem::take(&mut st.waiting), seal: false }
    }

    /// Writes publication `seq` of `segment` (no lock held meanwhile): the
    /// index as it stands now, into copy `seq % 2`, sealed with `seal`. On
    /// success the index's number moves to `seq`; on failure it stays (the
    /// next attempt rewrites the same copy, never the one in force).
    pub fn write_index(&self, segment: &OpenSegment, seq: u64, seal: bool) -> std::io::Result<()> {
        let mut block = Aligned::new(INDEX_BYTES);
        {
            let st = segment.state.lock().unwrap();
            let mut index = st.index.clone();
            index.seq = seq;
            index.sealed |= seal;
            index.encode(block.bytes());
        }
        let offset = (SegmentIndex::copy_of(seq) * INDEX_BYTES) as libc::off_t;
        // SAFETY: `block` holds INDEX_BYTES bytes and lives until the call returns.
        let n = unsafe { libc::pwrite(segment.file.fd(), block.ptr as *const libc::c_void, INDEX_BYTES, offset) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if n as usize != INDEX_BYTES {
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        let mut st = segment.state.lock().unwrap();
        st.index.seq = seq;
        st.index.sealed |= seal;
        Ok(())
    }

    /// After a publication (its puts finished, their slots dropped): the puts
    /// that completed meanwhile, to publish next (the caller loops); else the
    /// seal when the segment is full and its last put ended; else None and
    /// the segment is idle.
    pub fn next_publication(&self, segment: &OpenSegment) -> Option<(u64, Puts, bool)> {
        let mut st = segment.state.lock().unwrap();
        if st.waiting.is_empty() {
            if st.due_for_seal() {
                // Marked before the write: a failed seal is not tried again but at close.
                st.index.sealed = true;
                return Some((st.index.seq + 1, Vec::new(), true));
            }
            st.publishing = false;
            return None;
        }
        Some((st.index.seq + 1, std::mem::take(&mut st.waiting), false))
    }

    /// At close, once no put is in flight: every segment this store wrote
    /// is sealed (its writer adds no slot), so that whoever finds all its
    /// listed slots punched may unlink it (`segment_scan`), and the slots
    /// allocated ahead that no put took are given back (punched). Errors are
    /// left to the lease: a dead writer's segments are judged as sealed ones.
    pub fn seal_all(&self) {
        for r in &self.roots {
            let mine = std::mem::take(&mut *r.mine.lock().unwrap());
            for open in mine {
                let (seq, unused) = {
                    let st = open.state.lock().unwrap();
                    if st.index.sealed || st.publishing || st.outstanding > 0 {
                        continue;
                    }
                    (st.index.seq + 1, st.next_slot..st.allocated.max(st.next_slot))
                };
                if !unused.is_empty() {
                    let slot_bytes = open.file.name.slot_bytes;
                    let (from, to) = (segment::slot_offset(unused.start, slot_bytes), segment::slot_offset(unused.end, slot_bytes));
                    let flags = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                    // SAFETY: fallocate takes no pointer; the descriptor is open while `open` holds it.
                    let _ = unsafe { libc::fallocate(open.file.fd(), flags, from as libc::off_t, (to - from) as libc::off_t) };
                }
                let _ = self.write_index(&open, seq, true);
            }
        }
    }

    /// A put whose publication failed: its slot is no longer listed.
    pub fn unlist(&self, segment: &OpenSegment, slot: usize) {
        segment.state.lock().unwrap().index.entries[slot] = None;
    }

    pub fn place(&self, chunk: ChunkRef) -> Option<Place> {
        self.places.lock().unwrap().get(&chunk).cloned()
    }

    pub fn set_place(&self, chunk: ChunkRef, place: Place) {
        self.places.lock().unwrap().insert(chunk, place);
    }

    /// Counts bytes written into `root`'s segments (for `available`).
    pub fn wrote(&self, root: usize, bytes: u64) {
        self.roots[root].written.fetch_add(bytes, Ordering::Relaxed);
    }

    /// `root`'s free bytes: the last sample less what this store wrote since,
    /// while the sample is fresher than `SPACE_FRESH`; else `sample()`'s, kept.
    pub fn available(&self, root: usize, sample: impl FnOnce() -> Option<u64>) -> Option<u64> {
        let r = &self.roots[root];
        let written = r.written.load(Ordering::Relaxed);
        if let Some((at, available, then)) = *r.space.lock().unwrap() {
            if at.elapsed() < SPACE_FRESH {
                return Some(available.saturating_sub(written.saturating_sub(then)));
            }
        }
        let available = sample()?;
        *r.space.lock().unwrap() = Some((Instant::now(), available, written));
        Some(available)
    }

    /// Every chunk with a place: (chunk, chunk file length).
    pub fn known(&self) -> Vec<(ChunkRef, u64)> {
        self.places.lock().unwrap().iter().map(|(&c, p)| (c, p.file.name.slot_bytes)).collect()
    }

    pub fn forget(&self, chunk: ChunkRef) -> Option<Place> {
        self.places.lock().unwrap().remove(&chunk)
    }

    /// Forgets every descriptor of `root` (its breaker opened, or it came back).
    pub fn forget_root(&self, root: usize) {
        self.roots[root].files.lock().unwrap().clear();
        self.roots[root].writing.lock().unwrap().clear();
        self.roots[root].seen.lock().unwrap().clear();
        self.places.lock().unwrap().retain(|_, p| p.root != root);
    }
}
