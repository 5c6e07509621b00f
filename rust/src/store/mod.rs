//! The chunk store: turns put/get of keyed chunks into segment transfers on a
//! backend, verifies what it reads, publishes what it writes atomically, and
//! keeps the on-disk index within its capacity. Split by stage: `read` (get,
//! prefetch and their verification), `write` (put: seal, publish),
//! `capacity` (reservation, eviction, ENOSPC, the free-space reserve),
//! `completion` (segment hand-off, chunk workers, the single exit `finish`),
//! `refresh` (walks for what other writers did, the writer lease),
//! `config` (options, defaults, choices).
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

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::threads::ThreadBackend;
use crate::backend::uring::UringBackend;
use crate::backend::{Backend, SegmentSink};
use jobs::{DirJob, DirQueue, JobQueue, LstatReply};
use health::Health;
use crate::disk::files::{self, DirectIoPolicy, FsSupport, PendingFile};
use crate::disk::format::{self, Fingerprint, HEADER_BYTES, IO_ALIGN, MAX_KEY_BYTES};
use crate::disk::index::ChunkIndex;
use crate::disk::layout::Layout;
use crate::disk::scan::{self, ScanProgress, ScanReport};
use crate::disk::writers::WriterLease;
use crate::error::{EngineError, Result};
use crate::ops::{MissKind, OpId, OpTable, Outcome, Status};
use crate::staging::StagingPool;
use crate::stats::Stats;

mod capacity;
pub mod health;
mod jobs;
mod completion;
pub mod config;
mod read;
mod refresh;
mod write;

pub use config::{BackendChoice, FreeSpaceReserve, RefreshPolicy, StoreConfig, VerifyPolicy, MAX_INFLIGHT, MAX_THREADS};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    Put,
    Get,
}

/// Everything the completion path needs to finish an operation (what the
/// generic op table carries for the store).
pub struct OpContext {
    pub kind: OpKind,
    pub key: Vec<u8>,
    pub hash: u128,
    pub slot: usize,
    pub root: usize,
    pub direct: bool,
    pub read_fd: i32,
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
    /// Finished on the ring thread: the file is closed by a directory
    /// worker (a close can wait on the filesystem).
    pub close_elsewhere: bool,
    /// A get's generation of its slot's ready word (`ready.rs`), settled
    /// with its verdict; 0 for a put.
    pub ready_gen: u32,
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
    /// logger): the capacity lowered by ENOSPC, the first eviction of another
    /// namespace's chunk, the first refused put, another writer found.
    notices: Mutex<Vec<String>>,
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
    support: Vec<FsSupport>,
    direct_active: Vec<bool>,
    index: Mutex<ChunkIndex>,
    ops: OpTable<OpContext>,
    /// Payload CRCs of the read segments checksummed so far (read path).
    pieces: read::Pieces,
    stats: Stats,
    verify: VerifyPolicy,
    jobs: JobQueue,
    health: Health,
    /// One queue of blocking directory work per root (`health::DIR_WORKERS` threads each).
    dirs: Vec<DirQueue>,
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
    pub fn open(config: StoreConfig, pool: Arc<StagingPool>) -> Result<(Self, OpenReport)> {
        if !pool.is_owner() {
            return Err(EngineError::invalid("a store needs the staging pool's owner (not an attached mapping)"));
        }
        if config.segment_bytes < IO_ALIGN || !config.segment_bytes.is_multiple_of(IO_ALIGN) {
            return Err(EngineError::invalid(format!("segment_bytes must be a positive multiple of {IO_ALIGN}")));
        }
        if !config.write_segment_bytes.is_multiple_of(IO_ALIGN) {
            return Err(EngineError::invalid(format!("write_segment_bytes must be 0 (whole chunk) or a multiple of {IO_ALIGN}")));
        }
        if config.queue_depth == 0 || config.queue_depth > 4096 {
            return Err(EngineError::invalid("queue_depth must be in 1..=4096"));
        }
        // Counts become table sizes and thread counts: bounded, so a typo is
        // an error and not an allocation failure (abort) or a thread storm.
        if config.max_inflight == 0 || config.max_inflight > MAX_INFLIGHT {
            return Err(EngineError::invalid(format!("max_inflight must be in 1..={MAX_INFLIGHT}, got {}", config.max_inflight)));
        }
        if config.io_threads > MAX_THREADS {
            return Err(EngineError::invalid(format!("io_threads must be in 0..={MAX_THREADS} (0 = auto), got {}", config.io_threads)));
        }
        if config.chunk_workers > MAX_THREADS {
            return Err(EngineError::invalid(format!("chunk_workers must be at most {MAX_THREADS}, got {}", config.chunk_workers)));
        }
        // Segments of one operation are counted in a u32.
        let smallest = config.segment_bytes.min(if config.write_segment_bytes == 0 { usize::MAX } else { config.write_segment_bytes });
        if pool.stride() / smallest >= u32::MAX as usize {
            return Err(EngineError::invalid(format!(
                "segment_bytes/write_segment_bytes of {smallest} cut a {}-byte slot (a chunk file of up to {} bytes) into too many segments",
                pool.slot_bytes(),
                pool.stride()
            )));
        }
        if config.capacity_bytes < format::file_len(1) as u64 {
            return Err(EngineError::invalid("capacity_bytes is too small to hold one chunk"));
        }
        if let FreeSpaceReserve::AtLeast { fraction, .. } = config.min_free {
            if !(0.0..1.0).contains(&fraction) {
                return Err(EngineError::invalid(format!("min_free_fraction must be in [0, 1), not {fraction}")));
            }
        }
        let namespace = format::namespace_fingerprint(&config.namespace);
        let layout = Layout::open(&config.dirs, &namespace, &config.namespace, &config.permissions)?;
        let stats = Stats::default();

        let mut support = Vec::new();
        let mut direct_active = Vec::new();
        for dir in layout.ns_dirs() {
            let s = files::probe(dir, config.permissions.file_mode);
            if !s.tmpfile {
                stats.record_fallback(format!("O_TMPFILE unsupported in {}: using temp file + rename", dir.display()));
            }
            if config.preallocate && !s.fallocate {
                stats.record_fallback(format!("fallocate unsupported in {}: blocks are allocated by the writes", dir.display()));
            }
            let direct = match (config.direct_io, s.direct) {
                (DirectIoPolicy::Disabled, _) => false,
                (_, true) => true,
                (DirectIoPolicy::Required, false) => {
                    return Err(EngineError::BackendUnavailable(format!(
                        "{} refuses O_DIRECT and direct_io=required",
                        dir.display()
                    )))
                }
                (DirectIoPolicy::Optional, false) => {
                    stats.record_fallback(format!("O_DIRECT refused in {}: buffered I/O with page-cache drop", dir.display()));
                    false
                }
            };
            support.push(s);
            direct_active.push(direct);
        }

        let (min_free, mut warnings) = capacity::free_space_plan(&layout, &config)?;
        let (lease, lease_notes) = WriterLease::take(layout.roots(), config.permissions.dir_mode, config.permissions.file_mode);
        warnings.extend(lease_notes);

        let (index, scan_progress) = if config.background_scan {
            let mut index = ChunkIndex::default();
            index.begin_scan();
            (index, ScanProgress::default())
        } else {
            let start = Instant::now();
            let index = scan::build_index(&scan::collect(&layout, &AtomicBool::new(false))?);
            let report = ScanReport { chunks: index.len(), time: start.elapsed(), ..Default::default() };
            (index, ScanProgress::completed(report))
        };

        let deadline = config.io_deadline.unwrap_or_else(|| health::default_deadline(pool.stride()));
        if deadline.is_zero() {
            return Err(EngineError::invalid("io_deadline must be positive (None: derived from the chunk size)"));
        }
        let health = Health::new(layout.ns_dirs(), deadline);
        let dirs = layout.ns_dirs().iter().map(|_| DirQueue::default()).collect();
        let core = Arc::new(Core {
            health,
            dirs,
            watchdog_stop: AtomicBool::new(false),
            pool: pool.clone(),
            layout,
            namespace,
            configured_capacity: config.capacity_bytes,
            capacity: AtomicU64::new(config.capacity_bytes),
            notices: Mutex::new(Vec::new()),
            other_ns_noticed: AtomicBool::new(false),
            lease: Mutex::new(Some(Arc::new(lease))),
            other_writers: AtomicU64::new(0),
            refresh_policy: config.refresh,
            min_free,
            reserved: AtomicU64::new(0),
            recycle_files: config.recycle_files,
            preallocate: config.preallocate,
            scan: scan_progress,
            segment_bytes: config.segment_bytes,
            write_segment_bytes: config.write_segment_bytes,
            file_mode: config.permissions.file_mode,
            support,
            direct_active,
            index: Mutex::new(index),
            ops: OpTable::new(config.max_inflight)?,
            pieces: read::Pieces::new(config.max_inflight),
            stats,
            verify: config.verify,
            jobs: JobQueue::default(),
        });
        let backend: Arc<dyn Backend> = Arc::from(make_backend(&config, &core)?);
        let mut workers = Vec::new();
        for i in 0..config.chunk_workers.max(1) {
            let (c, b) = (core.clone(), backend.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("pykvcache-chunk-{i}"))
                .spawn(move || completion::chunk_worker(&c, &*b));
            match spawned {
                Ok(h) => workers.push(h),
                Err(e) => {
                    core.jobs.stop();
                    backend.shutdown();
                    return Err(EngineError::io("starting chunk workers", e));
                }
            }
        }
        let mut scanner = None;
        if config.background_scan {
            let (c, faults) = (core.clone(), config.faults.clone());
            let spawned = std::thread::Builder::new()
                .name("pykvcache-scan".into())
                .spawn(move || c.scan.run(&c.layout, &c.index, &faults));
            match spawned {
                Ok(h) => scanner = Some(h),
                Err(e) => {
                    core.jobs.stop();
                    for w in workers {
                        let _ = w.join();
                    }
                    backend.shutdown();
                    return Err(EngineError::io("starting the index scan", e));
                }
            }
        }
        let done = core.scan.report();
        let mut notes = Vec::new();
        if core.scan.report().done && !core.index.lock().unwrap().other_namespaces().is_empty() {
            notes.push(format!(
                "other namespaces' chunks under the storage directories count against capacity_bytes and are evicted \
                 when stalest (decision 0053): {}",
                core.space_holders()
            ));
        }
        let report = OpenReport { fallbacks: core.stats.fallbacks(), warnings, notes, scanned_chunks: done.chunks, scan_time: done.time };
        // Always started: it renews this store's writer lease, which other
        // stores look for, whatever this one's policy.
        let refresher = {
            let (c, policy) = (core.clone(), config.refresh);
            match std::thread::Builder::new().name("pykvcache-refresh".into()).spawn(move || c.refresh_loop(policy)) {
                Ok(h) => Some(h),
                Err(e) => {
                    core.scan.stop.store(true, Ordering::Relaxed);
                    core.jobs.stop();
                    for w in workers {
                        let _ = w.join();
                    }
                    backend.shutdown();
                    return Err(EngineError::io("starting the refresh thread", e));
                }
            }
        };
        let store = BlockStore {
            core,
            backend,
            workers: Mutex::new(workers),
            dir_workers: Mutex::new(Vec::new()),
            watchdog: Mutex::new(None),
            scanner: Mutex::new(scanner),
            refresher: Mutex::new(refresher),
            closed: AtomicBool::new(false),
        };
        if let Err(e) = store.start_guards() {
            store.close();
            return Err(e);
        }
        Ok((store, report))
    }

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
    fn begin(&self, kind: OpKind, key: &[u8], slot: usize, timeout: Option<Duration>) -> Result<(OpId, OpContext)> {
        let pool = &self.core.pool;
        let id = self.core.ops.allocate(timeout)?;
        if let Err(e) = pool.pin_io(slot) {
            // Never started: `release` would wait for a completion that never comes.
            self.core.ops.cancel(id);
            return Err(e);
        }
        let hash = format::key_hash(key);
        let root = self.core.layout.root_of(hash);
        let ctx = OpContext {
            kind,
            key: key.to_vec(),
            hash,
            slot,
            root,
            direct: self.core.direct_active[root],
            read_fd: -1,
            write_file: None,
            file_len: 0,
            payload_len: 0,
            started: Instant::now(),
            background: false,
            enospc_retried: false,
            reserved: 0,
            close_elsewhere: false,
            ready_gen: 0,
        };
        Ok((id, ctx))
    }

    fn check_args(&self, key: &[u8], slot: usize) -> Result<()> {
        if key.is_empty() || key.len() > MAX_KEY_BYTES {
            return Err(EngineError::invalid(format!("key must be 1..={MAX_KEY_BYTES} bytes, got {}", key.len())));
        }
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
        self.core.dirs[root].push(DirJob::Unlink { hash, reply: reply.clone() });
        let wait = health::PROBE_WAIT.min(self.core.health.deadline);
        let unlinked = crate::wait::wait_until(&reply.found, &reply.ready, crate::wait::deadline_after(Some(wait)), |f| *f);
        removed.is_some() || unlinked.unwrap_or(false)
    }

    pub fn rescan(&self) -> Result<usize> {
        // A background scan still running would merge stale findings afterwards.
        self.core.scan.wait(None);
        let fresh = scan::build_index(&scan::collect(&self.core.layout, &AtomicBool::new(false))?);
        let n = fresh.len();
        *self.core.index.lock().unwrap() = fresh;
        Ok(n)
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

    /// Chunks indexed, fillers not counted (they hold space, not data).
    pub fn len(&self) -> usize {
        let index = self.core.index.lock().unwrap();
        index.len() - index.filler_count()
    }

    pub fn filler_count(&self) -> usize {
        self.core.index.lock().unwrap().filler_count()
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
        let path = self.core.layout.chunk_path(hash);
        match files::set_mtime_to_epoch(&path) {
            Ok(()) => Ok(self.core.index.lock().unwrap().demote_filler(hash)),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
            Err(e) => Err(EngineError::io(format!("marking {} as a filler", path.display()), e)),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn used_bytes(&self) -> u64 {
        self.core.index.lock().unwrap().used_bytes()
    }

    /// Bytes of every namespace's chunks under the roots plus the bytes
    /// puts in flight reserved: what eviction weighs against the capacity.
    /// Exact: a put's bytes move from reserved to used under the index lock.
    pub fn committed_bytes(&self) -> u64 {
        let index = self.core.index.lock().unwrap();
        index.total_bytes() + self.core.reserved.load(Ordering::Relaxed)
    }

    /// The capacity eviction enforces now: `capacity_bytes` as configured,
    /// or lower once the filesystem filled up before it (ENOSPC).
    pub fn capacity_bytes(&self) -> u64 {
        self.core.capacity.load(Ordering::Relaxed)
    }

    pub fn configured_capacity_bytes(&self) -> u64 {
        self.core.configured_capacity
    }

    /// Bytes kept free on each root's filesystem (`StoreConfig::min_free`).
    pub fn min_free_bytes(&self) -> Vec<u64> {
        self.core.min_free.clone()
    }

    /// Messages about space since the last call (ENOSPC lowered the
    /// capacity, another namespace's chunks evicted, a put refused for the
    /// reserve, another writer found), each once: for the caller to log (the
    /// engine has no logger).
    pub fn take_notices(&self) -> Vec<String> {
        std::mem::take(&mut *self.core.notices.lock().unwrap())
    }

    pub fn backend_name(&self) -> &'static str {
        self.backend.kind().name()
    }

    /// Why the backend moves no more bytes (a fatal kernel error); None while
    /// it works. New operations are refused with `BackendUnavailable` then.
    pub fn backend_failure(&self) -> Option<String> {
        self.backend.failure()
    }

    pub fn fixed_buffers(&self) -> bool {
        self.backend.fixed_buffers()
    }

    pub fn direct_io(&self) -> bool {
        self.core.direct_active.iter().all(|&d| d)
    }

    pub fn namespace_dirs(&self) -> Vec<PathBuf> {
        self.core.layout.ns_dirs().to_vec()
    }

    pub fn completion_fd(&self) -> i32 {
        self.core.ops.event_fd()
    }

    pub fn in_flight(&self) -> usize {
        self.core.ops.in_flight()
    }

    pub fn stats(&self) -> &Stats {
        &self.core.stats
    }

    pub fn backend_cpu_ns(&self) -> u64 {
        self.backend.cpu_time_ns()
    }

    /// CPU time of the chunk workers (checksums, verification, publication).
    pub fn chunk_worker_cpu_ns(&self) -> u64 {
        self.core.jobs.cpu_time_ns()
    }

    pub fn pool(&self) -> &Arc<StagingPool> {
        &self.core.pool
    }

    /// Waits for in-flight I/O, then stops the backend. Idempotent.
    ///
    /// Bounded: operations that do not finish are abandoned by the deadline
    /// watchdog (still running here); what is then still stuck in the kernel
    /// is waited for `CLOSE_GRACE` more. After that the store's threads
    /// are left to end by themselves when the kernel lets go of their work:
    /// they, the staging mapping the kernel may still write (kept by them,
    /// never unmapped under it) and the ring stay until then, or until the
    /// process exits. `stats()["stuck_ops"]` counts such operations.
    pub fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        // First: callers waiting for an op entry fail now instead of taking
        // one after the drain and submitting to a stopped backend.
        self.core.ops.close();
        self.core.scan.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.scanner.lock().unwrap().take() {
            let _ = h.join();
        }
        if let Some(h) = self.refresher.lock().unwrap().take() {
            // A walk blocked on a dead mount must not hold close: the thread
            // sees the stop flag when its syscall returns and exits by itself.
            let until = std::time::Instant::now() + CLOSE_GRACE.min(self.core.health.deadline);
            while !h.is_finished() && std::time::Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            if h.is_finished() {
                let _ = h.join();
            }
        }
        // Others stop counting this store as a writer. The lease files are
        // closed and unlinked by a helper thread, waited for as the refresher
        // is: at once on a working directory (so none of its files stays open
        // after close: an unmount right after succeeds), never longer than the
        // grace on a stalled one (an unlink there can block).
        if let Some(lease) = self.core.lease.lock().unwrap().take() {
            if let Ok(h) = std::thread::Builder::new().name("pykvcache-lease".into()).spawn(move || drop(lease)) {
                let until = std::time::Instant::now() + CLOSE_GRACE.min(self.core.health.deadline);
                while !h.is_finished() && std::time::Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
        let grace = crate::wait::deadline_after(Some(CLOSE_GRACE.min(self.core.health.deadline)));
        let all_ended = self.core.ops.drain(grace);
        self.core.watchdog_stop.store(true, Ordering::Release);
        if let Some(h) = self.watchdog.lock().unwrap().take() {
            let _ = h.join();
        }
        self.core.jobs.stop();
        for q in &self.core.dirs {
            q.stop();
        }
        if !all_ended {
            let stuck = self.core.ops.stuck();
            self.core.stats.record_fallback(format!(
                "closed with {stuck} operation(s) still stuck in the kernel: their threads and staging slots are released when it lets go"
            ));
            self.workers.lock().unwrap().clear();
            self.dir_workers.lock().unwrap().clear();
            self.backend.detach();
            return;
        }
        for w in self.workers.lock().unwrap().drain(..) {
            let _ = w.join();
        }
        for w in self.dir_workers.lock().unwrap().drain(..) {
            let _ = w.join();
        }
        self.backend.shutdown();
    }

    /// The directory workers and the deadline watchdog.
    fn start_guards(&self) -> Result<()> {
        let mut dir_workers = self.dir_workers.lock().unwrap();
        for root in 0..self.core.dirs.len() {
            for i in 0..health::DIR_WORKERS {
                let (c, b) = (self.core.clone(), self.backend.clone());
                let h = std::thread::Builder::new()
                    .name(format!("pykvcache-dir{root}-{i}"))
                    .spawn(move || completion::dir_worker(&c, &*b, root))
                    .map_err(|e| EngineError::io("starting directory workers", e))?;
                dir_workers.push(h);
            }
        }
        let c = self.core.clone();
        let h = std::thread::Builder::new()
            .name("pykvcache-deadline".into())
            .spawn(move || c.watchdog())
            .map_err(|e| EngineError::io("starting the deadline watchdog", e))?;
        *self.watchdog.lock().unwrap() = Some(h);
        Ok(())
    }

    /// The I/O deadline in force (configured or derived from the chunk size).
    pub fn io_deadline(&self) -> Duration {
        self.core.health.deadline
    }

    /// Per storage directory: its path and circuit-breaker state.
    pub fn dir_states(&self) -> Vec<(PathBuf, &'static str)> {
        self.core.health.dirs.iter().enumerate().map(|(i, d)| (d.path.clone(), self.core.health.state(i).name())).collect()
    }

    pub fn health(&self) -> &Health {
        &self.core.health
    }

    /// Breaker state changes since the last call, for the caller to log.
    pub fn take_health_notices(&self) -> Vec<String> {
        self.core.health.take_notices()
    }

    /// Operations abandoned past their deadline whose work the kernel has not ended.
    pub fn stuck_ops(&self) -> usize {
        self.core.ops.stuck()
    }

    /// What probing each storage directory found at open.
    pub fn storage_support(&self) -> Vec<(PathBuf, FsSupport)> {
        self.core.layout.ns_dirs().iter().cloned().zip(self.core.support.iter().copied()).collect()
    }
}

/// How long `close` waits for operations stuck in the kernel once they were
/// abandoned (at most the deadline).
const CLOSE_GRACE: Duration = Duration::from_secs(2);

impl Core {
    /// The deadline watchdog: abandons overdue operations (a miss / a skipped
    /// put for the caller, the slot quarantined), feeds the breakers and
    /// queues their probes. It only takes locks, never touches a file.
    fn watchdog(&self) {
        let tick = (self.health.deadline / 8).clamp(Duration::from_millis(5), Duration::from_millis(100));
        let mut abandoned = Vec::with_capacity(64);
        while !self.watchdog_stop.load(Ordering::Acquire) {
            let now = Instant::now();
            let deadline = self.health.deadline;
            self.ops.abandon_overdue(
                |w| self.health.overdue(w.root as usize, w.since, now),
                |w| {
                    // Under the op table's lock, before the caller can see the
                    // outcome and release the slot: quarantined first.
                    self.pool.quarantine(w.slot as usize);
                    // A worker waiting on this read learns it failed now.
                    self.pool.settle_ready(w.slot as usize, w.ready_gen, false);
                    self.health.dirs[w.root as usize].stuck.fetch_add(1, Ordering::Relaxed);
                    self.health.failure(w.root as usize, true, now);
                    let dir = self.health.dirs[w.root as usize].path.display();
                    let msg = format!("no answer from {dir} within the {:.1} s I/O deadline", deadline.as_secs_f64());
                    if w.put {
                        Stats::add(&self.stats.write_errors, 1);
                        Outcome::new(Status::Error, 0, Some(libc::ETIMEDOUT), format!("{msg}: put skipped"))
                    } else {
                        Stats::add(&self.stats.read_misses, 1);
                        Outcome::miss(MissKind::Unavailable, Some(libc::ETIMEDOUT), format!("{msg}: a miss"))
                    }
                },
                &mut abandoned,
            );
            for root in 0..self.dirs.len() {
                if let health::Due::Probe(number) = self.health.tick(root, now) {
                    self.dirs[root].push(DirJob::Probe { number });
                }
            }
            std::thread::sleep(tick);
        }
    }

    /// One lstat of a chunk path; a chunk found is indexed.
    fn lstat_chunk(&self, hash: u128) -> bool {
        match std::fs::symlink_metadata(self.layout.chunk_path(hash)) {
            Ok(meta) if meta.file_type().is_file() && meta.len() >= HEADER_BYTES as u64 => {
                self.index.lock().unwrap().insert(hash, meta.len());
                true
            }
            _ => false,
        }
    }
}

impl Drop for BlockStore {
    fn drop(&mut self) {
        self.close();
    }
}

fn make_backend(config: &StoreConfig, core: &Arc<Core>) -> Result<Box<dyn Backend>> {
    let sink: Arc<dyn SegmentSink> = core.clone();
    let threads = if config.io_threads > 0 { config.io_threads } else { config.queue_depth.clamp(1, 16) };
    let make_threads = |sink: Arc<dyn SegmentSink>| -> Result<Box<dyn Backend>> {
        ThreadBackend::new(threads, config.max_inflight * 4, sink, config.faults.clone())
            .map(|b| Box::new(b) as Box<dyn Backend>)
            .map_err(|e| EngineError::io("starting I/O threads", e))
    };
    if config.backend == BackendChoice::Threads {
        return make_threads(sink);
    }
    let pool = &core.pool;
    let iovecs: Vec<libc::iovec> = (0..pool.num_slots())
        .map(|s| libc::iovec { iov_base: pool.slot_ptr(s) as *mut _, iov_len: pool.stride() })
        .collect();
    let buffers = (config.register_buffers).then_some(&iovecs[..]);
    match UringBackend::new(config.queue_depth, buffers, sink.clone(), config.faults.clone()) {
        Ok(setup) => {
            if let Some(e) = setup.fixed_buffer_error {
                core.stats.record_fallback(format!("io_uring buffer registration failed ({e}): using non-fixed reads/writes"));
            } else if !config.register_buffers {
                core.stats.record_fallback("fixed buffers disabled by configuration".to_string());
            }
            Ok(Box::new(setup.backend))
        }
        Err(e) if config.backend == BackendChoice::Auto => {
            core.stats.record_fallback(format!("io_uring unavailable ({e}): using the pread/pwrite thread pool"));
            make_threads(sink)
        }
        Err(e) => Err(EngineError::BackendUnavailable(format!("io_uring unavailable: {e}"))),
    }
}
