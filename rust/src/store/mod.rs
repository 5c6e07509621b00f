//! The chunk store: turns put/get of keyed chunks into segment transfers on a
//! backend, verifies what it reads, publishes what it writes atomically, and
//! keeps the on-disk index within its capacity. Split by stage: `read` (get,
//! prefetch and their verification), `write` (put: seal, publish),
//! `capacity` (reservation, eviction, ENOSPC, the free-space reserve),
//! `completion` (segment hand-off, chunk workers, the single exit `finish`),
//! `refresh` (walks for what other writers did, the writer lease),
//! `config` (options, defaults, choices), `open` (checks, probes, threads),
//! `lifecycle` (close, the deadline watchdog), `snapshot` (what `stats()`
//! shows, read once; the notices for the caller's log).
//!
//! # Threads
//! - the **caller** (vLLM's scheduler, a Python thread): `put`/`get`/`wait`;
//! - the **backend thread(s)**: the io_uring ring thread (or the pread/pwrite
//!   pool) only moves bytes between staging and files and reports each
//!   segment to `Core::segment_done`. It never unlinks, evicts or publishes,
//!   and never panics (a fatal ring error fails what is pending and marks
//!   the backend dead: `Backend::failure`, new work gets `BackendUnavailable`);
//! - the **chunk workers** (`chunk_workers`, default 2): checksums, header
//!   checks, publication, eviction, the completion of every operation that
//!   needs more than a header check.
//!
//! # The life of a `get(key, slot)`
//! The caller owns `slot` (acquired from the `StagingPool`) before and after.
//! 1. caller: `ops.allocate` reserves an entry (waits up to the submit
//!    timeout: the backpressure bound); `pool.pin_io(slot)` pins the slot, so
//!    it cannot be released while bytes may land in it. From here until
//!    `finish` the slot belongs to the operation.
//! 2. caller: opens the file and checks its size; an absent, foreign or
//!    misshapen file finishes right there (miss / corrupt, on the caller).
//! 3. caller: `ops.start` hands the entry to the backend's accounting with its
//!    segment count, then `submit_range` queues the segments (`read.rs`).
//! 4. backend thread: reads each segment into the slot; `segment_done` passes
//!    it on: with `verify="full"` as a `VerifyPiece` job (a chunk worker
//!    checksums the piece while later segments still land, `read::Pieces`),
//!    with `verify="header"` straight to `ops.segment_done`.
//! 5. the last segment: a chunk worker (or, for a header-only check of a
//!    chunk the index holds, the backend thread: a wake-up costs more than the
//!    check) judges header and CRC. Corrupt chunks are unlinked and chunks
//!    another process wrote are adopted (eviction may follow): always on a
//!    chunk worker.
//! 6. `finish` (completion.rs): closes the file, unpins the slot (it is the
//!    caller's again), counts, `ops.complete` (the outcome is visible to
//!    `wait`, the eventfd fires). The caller's `release_op` frees the entry.
//!
//! # The life of a `put(key, slot, length)`
//! 1. caller: allocate + pin as for a get; `reserve_room` counts the bytes
//!    against the capacity and evicts least recently used chunks (capacity.rs),
//!    keeping one victim's file to overwrite; `open_chunk_file` claims it or
//!    opens a fresh O_TMPFILE (preallocated).
//! 2. caller: zeroes the padding, `ops.start`, queues the payload segments
//!    and a `Seal` job (write.rs); with `verify="header"` the header is
//!    written into the slot first and the whole file leaves at once.
//! 3. chunk worker (`Seal`): checksums the payload (overlapping its transfer),
//!    writes the header into the slot's first 4 KiB, queues the header segment.
//! 4. backend thread: writes the segments; the last one's completion goes to
//!    a chunk worker as a `Finish` job.
//! 5. chunk worker: on the first ENOSPC, evicts and resubmits the whole
//!    (sealed) slot; otherwise publishes the file under its name, indexes it,
//!    trims any overshoot, and `finish`es (the slot is unpinned, the caller's
//!    again).
//!
//! # Sealed chunks (an encryption key configured)
//! A put's caller also takes a seal buffer (step 1; the slot is never
//! written), the chunk workers seal the frames into it together and write it
//! in three transfers, the header last; a get's frames are opened in place as
//! they land, on the chunk workers, before `finish`. See `sealing`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::disk::dirfds::HeldDirs;
use crate::disk::files::{self, FsSupport, PendingFile};
use crate::disk::format::{self, Fingerprint, HEADER_BYTES, MAX_KEY_BYTES};
use crate::disk::index::{ChunkIndex, ChunkRef};
use crate::disk::layout::{Layout, Permissions};
use crate::disk::roots::RootIdentity;
use crate::disk::scan::{self, ScanProgress, ScanReport};
use crate::disk::writers::WriterLease;
use crate::error::{EngineError, Result};
use crate::notice::Notice;
use crate::ops::{OpId, OpTable, Outcome};
use crate::staging::StagingPool;
use crate::stats::Stats;
use health::Health;
use jobs::{DirJob, DirQueue, JobQueue, LstatReply};

mod capacity;
mod completion;
pub mod config;
pub mod health;
mod jobs;
mod ledger;
mod lifecycle;
mod open;
mod read;
mod recovery;
mod refresh;
mod region;
mod sealing;
mod segment_ops;
mod segment_scan;
mod segments;
mod snapshot;
mod transfer;
mod write;

pub use config::{BackendChoice, FreeSpaceReserve, RefreshPolicy, SegmentFiles, StoreConfig, VerifyPolicy};
pub use region::RegionId;
pub use snapshot::{SealingSnapshot, StoreSnapshot};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    Put,
    Get,
}

/// Everything the completion path needs to finish an operation (what the
/// generic op table carries for the store).
impl OpContext {
    /// The descriptor a put writes: its slot's segment, or its chunk file.
    fn write_fd(&self) -> i32 {
        match (&self.put_slot, &self.write_file) {
            (Some(slot), _) => slot.segment.file.fd(),
            (None, Some(f)) => f.fd,
            (None, None) => panic!("a put without a file or a slot"),
        }
    }
}

pub struct OpContext {
    pub kind: OpKind,
    pub key: Vec<u8>,
    pub hash: u128,
    pub slot: usize,
    pub root: usize,
    pub direct: bool,
    pub read_fd: i32,
    pub write_file: Option<PendingFile>,
    /// An evicted file renamed to a temp name of this put's, to overwrite
    /// (`Core::take_victim`); opened by `open_chunk_file`.
    pub claimed: Option<std::path::PathBuf>,
    pub file_len: usize,
    /// Where the chunk image starts in its file: 0 for a chunk file, the
    /// slot's offset in a segment file (`disk::segment`).
    pub file_base: u64,
    /// A put into a segment: the slot it writes (`segments`).
    put_slot: Option<segments::Slot>,
    /// A get from a segment: where the chunk lies (holds the descriptor).
    read_place: Option<segments::Place>,
    pub payload_len: usize,
    pub started: Instant,
    /// A prefetch: its transfers yield to demand ones (see backend::classes).
    pub background: bool,
    /// A put that hit ENOSPC evicts and retries once.
    pub enospc_retried: bool,
    /// Bytes this put reserved against the capacity (0 once released).
    pub reserved: u64,
    /// Finished on the ring thread: the file is closed by a directory
    /// worker (a close can wait on the filesystem).
    pub close_elsewhere: bool,
    /// A get's generation of its slot's ready word (`ready.rs`), settled
    /// with its verdict; 0 for a put.
    pub ready_gen: u32,
    /// In a store that seals: the tenant's keys, and a put's seal buffer.
    pub seal: Option<sealing::OpSeal>,
    /// A region operation (`region.rs`): its pinned payload memory; `slot`
    /// is unused then.
    region: Option<region::RegionPin>,
}

struct Core {
    pool: Arc<StagingPool>,
    layout: Layout,
    namespace: Fingerprint,
    /// `capacity_bytes` as configured: the bound on a single chunk.
    configured_capacity: u64,
    /// What eviction keeps the index within: the configured capacity, lowered
    /// when the filesystem fills up first (ENOSPC). Never raised again.
    capacity: AtomicU64,
    /// Messages about space for the caller to log (the engine has no
    /// logger), each with its level, taken by `take_notices`: the capacity
    /// lowered by ENOSPC, the first eviction of another namespace's chunk,
    /// the first refused put, another writer found.
    notices: Mutex<Vec<Notice>>,
    other_ns_noticed: AtomicBool,
    /// This store's writer lease in each root (`disk::writers`); taken at
    /// close. Shared so that no lock is held across its file operations,
    /// which can block on a stalled directory.
    lease: Mutex<Option<Arc<WriterLease>>>,
    /// Other writers' live leases, as last checked by the refresh thread.
    other_writers: AtomicU64,
    refresh_policy: RefreshPolicy,
    /// Bytes kept free on each root's filesystem (`FreeSpaceReserve`); 0 = none.
    min_free: Vec<u64>,
    /// Bytes of puts between eviction and publication: they count against the
    /// capacity, so that each of several concurrent puts evicts (and can
    /// recycle) its own victim instead of all seeing the same free space.
    reserved: AtomicU64,
    recycle_files: bool,
    preallocate: bool,
    scan: ScanProgress,
    segment_bytes: usize,
    write_segment_bytes: usize,
    file_mode: u32,
    /// Modes and root checks, for a directory made again after it went (`recovery`).
    permissions: Permissions,
    /// Each root's identity as last seen usable (None: unknown at open).
    root_ids: Mutex<Vec<Option<RootIdentity>>>,
    /// A directory came back: the refresh thread rebuilds the index (`recovery`).
    rebuild: AtomicBool,
    /// The capacity ledgers of the roots and this store's part in them.
    ledgers: ledger::Ledgers,
    /// A put found the capacity held by chunks this store does not know:
    /// the refresh thread walks at once.
    walk_now: AtomicBool,
    support: Vec<FsSupport>,
    direct_active: Vec<bool>,
    index: Mutex<ChunkIndex>,
    ops: OpTable<OpContext>,
    /// Payload CRCs of the read segments checksummed so far (read path).
    pieces: read::Pieces,
    /// External memory regions (`region.rs`) and the header blocks of their operations.
    regions: region::Regions,
    headers: region::HeaderBlocks,
    stats: Stats,
    verify: VerifyPolicy,
    /// Some: an encryption key is configured, every chunk is sealed (`sealing`).
    sealing: Option<sealing::Sealing>,
    jobs: JobQueue,
    health: Health,
    /// One queue of blocking directory work per root (`health::DIR_WORKERS` threads each).
    dirs: Vec<DirQueue>,
    /// Shard directories held open: chunk files are reached by name from them (`disk::dirfds`).
    held: HeldDirs,
    /// Segment files (decision 0086): read by every store; new chunks go
    /// into them where `segments.writes` (`segment_files`).
    segments: segments::Segments,
    watchdog_stop: AtomicBool,
}

pub struct BlockStore {
    core: Arc<Core>,
    backend: Arc<dyn Backend>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    dir_workers: Mutex<Vec<JoinHandle<()>>>,
    watchdog: Mutex<Option<JoinHandle<()>>>,
    scanner: Mutex<Option<JoinHandle<()>>>,
    refresher: Mutex<Option<JoinHandle<()>>>,
    closed: AtomicBool,
    /// The background byte budget last set (0: none; `set_background_budget`).
    background_budget: AtomicU64,
}

/// The memory an operation moves a chunk from or to.
#[derive(Clone, Copy)]
enum Memory {
    Slot(usize),
    /// Bytes `[offset, offset + length)` of a registered region.
    Region {
        id: RegionId,
        offset: usize,
        length: usize,
    },
}

/// What an opened store reports about the paths it took.
pub struct OpenReport {
    pub fallbacks: Vec<String>,
    /// Configuration that works but is probably not what was meant (the
    /// capacity exceeds the filesystems): for the caller to log.
    pub warnings: Vec<String>,
    /// What the caller may log at info level (other namespaces found).
    pub notes: Vec<String>,
    pub scanned_chunks: usize,
    pub scan_time: Duration,
}

impl BlockStore {
    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(EngineError::State("store is closed".into()));
        }
        if let Some(why) = self.backend.failure() {
            return Err(EngineError::BackendUnavailable(format!("the {} backend failed: {why}", self.backend.kind().name())));
        }
        Ok(())
    }

    /// Steps 1 of a put and a get: checks, an op entry, the slot pinned, the
    /// context. The entry is the caller's until `ops.start`.
    fn begin(&self, kind: OpKind, key: &[u8], tenant: &[u8], slot: usize, timeout: Option<Duration>) -> Result<(OpId, OpContext)> {
        self.begin_on(kind, key, tenant, Memory::Slot(slot), timeout)
    }

    /// `begin` for an operation on a slot or a region range (pinned, not the
    /// slot). In a store that seals, also the tenant's keys and, for a put, a
    /// seal buffer: all of it within `timeout`.
    fn begin_on(&self, kind: OpKind, key: &[u8], tenant: &[u8], memory: Memory, timeout: Option<Duration>) -> Result<(OpId, OpContext)> {
        if tenant.len() > crate::disk::seal::MAX_TENANT_BYTES {
            let max = crate::disk::seal::MAX_TENANT_BYTES;
            return Err(EngineError::invalid(format!("tenant must be at most {max} bytes, got {}", tenant.len())));
        }
        let started = Instant::now();
        let id = self.core.ops.allocate(timeout)?;
        let pinned = match memory {
            Memory::Slot(slot) => self.core.pool.pin_io(slot).map(|()| None),
            Memory::Region { id, offset, length } => self.core.regions.pin(id, offset, length).map(Some),
        };
        let region = match pinned {
            Ok(region) => region,
            Err(e) => {
                // Never started: `release` would wait for a completion that never comes.
                self.core.ops.cancel(id);
                return Err(e);
            }
        };
        let slot = match memory {
            Memory::Slot(slot) => slot,
            Memory::Region { .. } => usize::MAX,
        };
        let hash = format::key_hash(key);
        let root = self.core.layout.root_of(hash);
        let mut ctx = OpContext {
            kind,
            key: key.to_vec(),
            hash,
            slot,
            root,
            direct: self.core.direct_active[root],
            read_fd: -1,
            write_file: None,
            claimed: None,
            file_len: 0,
            file_base: 0,
            put_slot: None,
            read_place: None,
            payload_len: 0,
            started: Instant::now(),
            background: false,
            enospc_retried: false,
            reserved: 0,
            close_elsewhere: false,
            ready_gen: 0,
            seal: None,
            region,
        };
        if let Some(sealing) = &self.core.sealing {
            let buffer = match kind {
                OpKind::Get => None,
                OpKind::Put => match sealing.buffers.acquire(timeout.map(|t| t.saturating_sub(started.elapsed()))) {
                    Ok(b) => Some(b),
                    Err(e) => {
                        self.core.unpin_memory(&ctx);
                        self.core.ops.cancel(id);
                        return Err(e);
                    }
                },
            };
            ctx.seal = Some(sealing::OpSeal { keys: sealing.keys.tenant(tenant), buffer });
        }
        Ok((id, ctx))
    }

    fn check_key(key: &[u8]) -> Result<()> {
        if key.is_empty() || key.len() > MAX_KEY_BYTES {
            return Err(EngineError::invalid(format!("key must be 1..={MAX_KEY_BYTES} bytes, got {}", key.len())));
        }
        Ok(())
    }

    fn check_args(&self, key: &[u8], slot: usize) -> Result<()> {
        Self::check_key(key)?;
        if slot >= self.core.pool.num_slots() {
            return Err(EngineError::invalid(format!("slot {slot} out of range")));
        }
        if !self.core.pool.is_acquired(slot) {
            return Err(EngineError::State(format!("slot {slot} is not acquired from the staging pool")));
        }
        Ok(())
    }

    pub fn is_done(&self, id: OpId) -> Result<bool> {
        self.core.ops.is_done(id)
    }

    pub fn wait(&self, id: OpId, timeout: Option<Duration>) -> Result<Option<Outcome>> {
        self.core.ops.wait(id, timeout)
    }

    /// See `OpTable::is_settled`: the operation's memory is the caller's again.
    pub fn is_settled(&self, id: OpId) -> bool {
        self.core.ops.is_settled(id)
    }

    pub fn release_op(&self, id: OpId) {
        self.core.ops.release(id)
    }

    /// Indexed, and its directory available: while a directory's circuit
    /// breaker is open its chunks stay indexed but read as absent.
    pub fn contains(&self, key: &[u8]) -> bool {
        let hash = format::key_hash(key);
        self.core.index.lock().unwrap().contains(hash) && self.core.health.refusal(self.core.layout.root_of(hash)).is_none()
    }

    /// Index lookup, then the directory: finds chunks that another process
    /// sharing the directories published since this store scanned, and
    /// indexes them. One `lstat` when the index has no entry.
    pub fn probe(&self, key: &[u8]) -> bool {
        let hash = format::key_hash(key);
        if self.core.index.lock().unwrap().contains(hash) {
            return true;
        }
        // The lstat runs on the directory's worker: the caller (vLLM's
        // scheduler) waits for it at most `PROBE_WAIT`, and not at all while
        // the directory is known to be unavailable. A late answer is still indexed.
        let root = self.core.layout.root_of(hash);
        if self.closed.load(Ordering::Acquire) || self.core.health.refusal(root).is_some() {
            return false;
        }
        let reply = Arc::new(LstatReply::default());
        self.core.dirs[root].push(DirJob::Lstat { hash, reply: reply.clone() });
        let wait = health::PROBE_WAIT.min(self.core.health.deadline);
        let answered = crate::wait::wait_until(&reply.found, &reply.ready, crate::wait::deadline_after(Some(wait)), |f| *f);
        answered.unwrap_or(false)
    }

    /// Payload capacity needed to read a chunk (its file length minus the header).
    pub fn chunk_file_len(&self, key: &[u8]) -> Option<u64> {
        self.core.index.lock().unwrap().file_len(format::key_hash(key))
    }

    /// Drops `key` from the index at once; its file is unlinked by the
    /// directory's worker (an unlink can block on an unreachable directory),
    /// waited for at most `PROBE_WAIT`. True when it was indexed or unlinked in time.
    pub fn evict(&self, key: &[u8]) -> bool {
        let hash = format::key_hash(key);
        let root = self.core.layout.root_of(hash);
        let removed = self.core.index.lock().unwrap().remove(hash);
        if let Some(len) = removed {
            Stats::add(&self.core.stats.evicted_bytes, len);
        }
        if self.closed.load(Ordering::Acquire) || self.core.health.refusal(root).is_some() {
            return removed.is_some();
        }
        let reply = Arc::new(LstatReply::default());
        self.core.dirs[root].push(DirJob::Unlink { hash, len: removed, reply: reply.clone() });
        let wait = health::PROBE_WAIT.min(self.core.health.deadline);
        let unlinked = crate::wait::wait_until(&reply.found, &reply.ready, crate::wait::deadline_after(Some(wait)), |f| *f);
        removed.is_some() || unlinked.unwrap_or(false)
    }

    pub fn rescan(&self) -> Result<usize> {
        // A background scan still running would merge stale findings afterwards.
        self.core.scan.wait(None);
        let fresh = scan::build_index(&scan::collect(&self.core.layout, &AtomicBool::new(false))?);
        *self.core.index.lock().unwrap() = fresh;
        // The chunks in segments (decision 0086): their places are known; the index lost them.
        let mut index = self.core.index.lock().unwrap();
        index.add_found(&self.core.segment_chunks());
        Ok(index.len())
    }

    /// Chunks that left the index since the last call (evicted here, found
    /// removed by another process, corrupt), as key hashes (`format::key_hash`),
    /// and how many were not kept because the log was full.
    pub fn take_removed(&self) -> (Vec<u128>, u64) {
        self.core.index.lock().unwrap().take_removed()
    }

    /// The open-time scan: done or not, chunks it indexed, how long it took.
    pub fn scan_report(&self) -> ScanReport {
        self.core.scan.report()
    }

    /// Waits for the open-time scan; false on timeout.
    pub fn wait_scan(&self, timeout: Option<Duration>) -> bool {
        self.core.scan.wait(timeout)
    }

    /// Turns the chunk `key` (just written, by `preformat`) into a filler:
    /// its file's mtime becomes the Unix epoch (so every later scan, in any
    /// process, sees it as a filler and least recently used) and it moves to
    /// the front of the eviction order. A put that needs room then overwrites
    /// its allocated, already written blocks instead of making ext4 allocate
    /// a new file: the first fill of a preformatted store runs at the speed
    /// of the steady state. False when the chunk is not indexed here.
    pub fn mark_filler(&self, key: &[u8]) -> Result<bool> {
        let hash = format::key_hash(key);
        if self.core.segments.place(ChunkRef::own(hash)).is_some() {
            // A slot has no modification time of its own: stalest in the index until a restart.
            return Ok(self.core.index.lock().unwrap().demote_filler(hash));
        }
        let path = self.core.layout.chunk_path(hash);
        match files::set_mtime_to_epoch(&path) {
            Ok(()) => Ok(self.core.index.lock().unwrap().demote_filler(hash)),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
            Err(e) => Err(EngineError::io(format!("marking {} as a filler", path.display()), e)),
        }
    }
}

impl Core {
    /// Opens every shard directory of this namespace ahead of its first
    /// chunk (`disk::dirfds`), after the scan: on a network filesystem a
    /// first open costs a lookup, several milliseconds under load, which a
    /// restarted store's first reads and writes would otherwise each pay.
    fn hold_shard_dirs(&self) {
        for root in 0..self.layout.ns_dirs().len() {
            for shard_dir in self.layout.shard_dirs(root) {
                // The store closing (its scan told to stop), or the directory unavailable.
                if self.scan.stop.load(Ordering::Relaxed) || self.health.refusal(root).is_some() {
                    break;
                }
                self.held.hold(&shard_dir);
            }
        }
    }

    /// One lstat of a chunk path; a chunk found is indexed.
    fn lstat_chunk(&self, hash: u128) -> bool {
        match self.held.lstat(&self.layout.chunk_path(hash)) {
            Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFREG && st.st_size as u64 >= HEADER_BYTES as u64 => {
                self.index.lock().unwrap().insert(hash, st.st_size as u64);
                true
            }
            // Not a chunk file: in a segment another writer published since the last look?
            _ => self.segment_place(hash, true).is_some(),
        }
    }
}
