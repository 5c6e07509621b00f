//! The chunk store: turns put/get of keyed chunks into segment transfers on a
//! backend, verifies what it reads, publishes what it writes atomically, and
//! keeps the on-disk index within its capacity.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::threads::ThreadBackend;
use crate::backend::uring::UringBackend;
use crate::backend::{clock_ns, thread_cpu_clock, Backend, Segment, SegmentError, SegmentSink, SharedFaults};
use crate::chunk_workers::{Job, JobQueue};
use crate::error::{EngineError, Result};
use crate::files::{self, DirectIoPolicy, FsSupport};
use crate::checksum::{crc32c, crc32c_combine};
use crate::format::{self, Fingerprint, FormatError, HEADER_BYTES, IO_ALIGN, MAX_KEY_BYTES};
use crate::index::ChunkIndex;
use crate::layout::{Layout, Permissions};
use crate::scan::{self, ScanProgress, ScanReport};
use crate::ops::{Finished, OpContext, OpId, OpKind, OpTable, Outcome, PrefixCrc, Status};
use crate::staging::StagingPool;
use crate::stats::Stats;

/// Bound on `max_inflight` (the op table is allocated up front, ~200 bytes an entry).
pub const MAX_INFLIGHT: usize = 1 << 16;
/// Bound on `io_threads` and `chunk_workers`.
pub const MAX_THREADS: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    Auto,
    IoUring,
    Threads,
}

/// How much of a chunk is checksummed: verified by reads, computed by writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerifyPolicy {
    /// Header (magic, version, namespace, key, length, header CRC) and payload CRC.
    Full,
    /// Header only: for filesystems/devices that checksum data themselves
    /// (ZFS, btrfs, dm-integrity) when the payload pass costs too much CPU.
    /// Writes then compute no payload CRC either (flagged in the header): a
    /// `Full` reader sharing the directory treats such chunks as misses.
    Header,
}

impl VerifyPolicy {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "full" => Ok(Self::Full),
            "header" => Ok(Self::Header),
            other => Err(EngineError::invalid(format!("verify must be full|header, not {other:?}"))),
        }
    }
}

impl BackendChoice {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "io_uring" => Ok(Self::IoUring),
            "threads" => Ok(Self::Threads),
            other => Err(EngineError::invalid(format!("backend must be auto|io_uring|threads, not {other:?}"))),
        }
    }
}

pub struct StoreConfig {
    pub dirs: Vec<PathBuf>,
    pub namespace: String,
    pub capacity_bytes: u64,
    pub queue_depth: usize,
    pub backend: BackendChoice,
    pub direct_io: DirectIoPolicy,
    pub register_buffers: bool,
    pub segment_bytes: usize,
    /// Segment size of writes; 0 = the whole chunk in one transfer (measured
    /// faster on ext4: one direct write per file instead of several that
    /// contend for the inode; reads still gain from parallel segments).
    pub write_segment_bytes: usize,
    pub max_inflight: usize,
    pub io_threads: usize,
    /// Threads that checksum, verify and publish chunks.
    pub chunk_workers: usize,
    pub verify: VerifyPolicy,
    /// Overwrite the chunk file a write evicts instead of unlinking it and
    /// allocating a fresh one (see `files::claim_for_reuse`).
    pub recycle_files: bool,
    /// Rebuild the index in a background thread instead of before `open`
    /// returns (see `scan`): for stores of very many chunks.
    pub background_scan: bool,
    /// Allocate each chunk file (fallocate) before writing it (see `files::preallocate`).
    pub preallocate: bool,
    pub permissions: Permissions,
    /// Space kept free on each storage filesystem for other writers.
    pub min_free: FreeSpaceReserve,
    pub faults: SharedFaults,
}

/// How much of each storage filesystem eviction keeps free for other writers
/// (logs, downloads, a second store): a put first evicts until its bytes fit
/// *and* this much stays free, and is refused when even an empty store could
/// not keep it. Checked with one `statvfs` per put.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FreeSpaceReserve {
    /// `DEFAULT_RESERVE_FRACTION` of the filesystem, at most `DEFAULT_RESERVE_MAX` bytes.
    Default,
    /// At least these many bytes, and at least this fraction of the filesystem.
    AtLeast { bytes: u64, fraction: f64 },
}

pub const DEFAULT_RESERVE_FRACTION: f64 = 0.05;
pub const DEFAULT_RESERVE_MAX: u64 = 16 << 30;

impl FreeSpaceReserve {
    /// The reserve in bytes on a filesystem of `total` bytes.
    pub fn bytes_for(self, total: u64) -> u64 {
        match self {
            Self::Default => ((total as f64 * DEFAULT_RESERVE_FRACTION) as u64).min(DEFAULT_RESERVE_MAX),
            Self::AtLeast { bytes, fraction } => bytes.max((total as f64 * fraction) as u64),
        }
    }
}

impl StoreConfig {
    pub fn new(dirs: Vec<PathBuf>, namespace: impl Into<String>, capacity_bytes: u64) -> Self {
        StoreConfig {
            dirs,
            namespace: namespace.into(),
            capacity_bytes,
            queue_depth: 32,
            backend: BackendChoice::Auto,
            direct_io: DirectIoPolicy::Optional,
            register_buffers: true,
            segment_bytes: 4 << 20,
            write_segment_bytes: 0,
            max_inflight: 1024,
            io_threads: 0,
            chunk_workers: 2,
            verify: VerifyPolicy::Full,
            recycle_files: true,
            background_scan: false,
            preallocate: true,
            permissions: Permissions::default(),
            min_free: FreeSpaceReserve::Default,
            faults: None,
        }
    }
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
    /// Set when `capacity` was first lowered; taken once by whoever logs it.
    capacity_notice: Mutex<Option<String>>,
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
    ops: OpTable,
    stats: Stats,
    verify: VerifyPolicy,
    jobs: JobQueue,
}

pub struct BlockStore {
    core: Arc<Core>,
    backend: Arc<dyn Backend>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    scanner: Mutex<Option<JoinHandle<()>>>,
    closed: AtomicBool,
}

/// What an opened store reports about the paths it took.
pub struct OpenReport {
    pub fallbacks: Vec<String>,
    /// Configuration that works but is probably not what was meant (the
    /// capacity exceeds the filesystems): for the caller to log.
    pub warnings: Vec<String>,
    pub scanned_chunks: usize,
    pub scan_time: Duration,
}

impl BlockStore {
    pub fn open(config: StoreConfig, pool: Arc<StagingPool>) -> Result<(Self, OpenReport)> {
        if !pool.is_owner() {
            return Err(EngineError::invalid("a store needs the staging pool's owner (not an attached mapping)"));
        }
        if config.segment_bytes < IO_ALIGN || config.segment_bytes % IO_ALIGN != 0 {
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
                "segment_bytes/write_segment_bytes of {smallest} cut a {}-byte slot into too many segments",
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

        let (min_free, warnings) = free_space_plan(&layout, &config)?;

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

        let core = Arc::new(Core {
            pool: pool.clone(),
            layout,
            namespace,
            configured_capacity: config.capacity_bytes,
            capacity: AtomicU64::new(config.capacity_bytes),
            capacity_notice: Mutex::new(None),
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
                .spawn(move || chunk_worker(&c, &*b));
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
        let report = OpenReport { fallbacks: core.stats.fallbacks(), warnings, scanned_chunks: done.chunks, scan_time: done.time };
        let store = BlockStore { core, backend, workers: Mutex::new(workers), scanner: Mutex::new(scanner), closed: AtomicBool::new(false) };
        Ok((store, report))
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(EngineError::State("store is closed".into()));
        }
        Ok(())
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

    /// Writes `length` payload bytes of `slot` as chunk `key`.
    pub fn put(&self, key: &[u8], slot: usize, length: usize, timeout: Option<Duration>) -> Result<OpId> {
        self.check_open()?;
        self.check_args(key, slot)?;
        let pool = &self.core.pool;
        if length > pool.slot_bytes() {
            return Err(EngineError::invalid(format!("length {length} exceeds the slot size {}", pool.slot_bytes())));
        }
        let file_len = format::file_len(length);
        if file_len as u64 > self.core.configured_capacity {
            let cap = self.core.configured_capacity;
            return Err(EngineError::invalid(format!("a {file_len}-byte chunk cannot fit the capacity of {cap} bytes")));
        }
        let id = self.core.ops.allocate(timeout)?;
        if let Err(e) = pool.pin_io(slot) {
            // Never started: `release` would wait for a completion that never comes.
            self.core.ops.cancel(id);
            return Err(e);
        }
        let hash = format::key_hash(key);
        let root = self.core.layout.root_of(hash);
        let started = Instant::now();
        let mut ctx = OpContext {
            kind: OpKind::Put,
            key: key.to_vec(),
            hash,
            slot,
            root,
            direct: self.core.direct_active[root],
            read_fd: -1,
            write_file: None,
            file_len,
            payload_len: length,
            started,
            background: false,
            enospc_retried: false,
            reserved: 0,
        };
        let reuse = self.core.recycle_files.then_some(root);
        let victim = match self.core.reserve_room(&mut ctx, reuse) {
            Ok(victim) => victim,
            Err(refused) => {
                self.core.fail_early(id, ctx, Some(libc::ENOSPC), refused);
                return Ok(id);
            }
        };
        match self.core.open_chunk_file(&mut ctx, victim) {
            Ok(f) => ctx.write_file = Some(f),
            Err(e) => {
                let shard = self.core.layout.shard_dir(hash);
                let msg = format!("creating chunk file in {}: {e}", shard.display());
                self.core.fail_early(id, ctx, e.raw_os_error(), msg);
                return Ok(id);
            }
        }
        let fd = ctx.write_file.as_ref().unwrap().fd;
        // The payload leaves at once; its checksum (~1.5 ms for 28 MiB: not on
        // the caller's thread) is computed by a chunk worker meanwhile and the
        // header block written last, so the CRC pass overlaps the transfer.
        // The chunk becomes visible only after both writes (publish).
        let core = &self.core;
        unsafe {
            let pad = file_len - HEADER_BYTES - length;
            std::ptr::write_bytes(pool.payload_ptr(slot).add(length), 0, pad);
        }
        // verify="header": no payload checksum, so the header is ready now and
        // the whole file leaves in one go (storage that checksums data itself).
        let sealed_now = core.verify == VerifyPolicy::Header;
        if sealed_now {
            let header = unsafe { std::slice::from_raw_parts_mut(pool.slot_ptr(slot), HEADER_BYTES) };
            format::encode_header_for(header, &core.namespace, key, length as u64, None);
        }
        let from = if sealed_now { 0 } else { HEADER_BYTES };
        let header_write = u32::from(!sealed_now);
        if let Err(ctx) = core.ops.start(id, ctx, segment_count(from, file_len, core.write_segment_bytes) as u32 + header_write) {
            core.fail_early(id, ctx, None, CLOSED_WHILE_SUBMITTING.into());
            return Ok(id);
        }
        submit_range(&*self.backend, Transfer::of_slot(pool, id, slot, fd, true, false), from, file_len, core.write_segment_bytes);
        if !sealed_now {
            core.jobs.push(Job::Seal { id, transfer_fd: fd, slot, payload_len: length });
        }
        Ok(id)
    }

    /// Reads chunk `key` into `slot` and verifies it.
    pub fn get(&self, key: &[u8], slot: usize, timeout: Option<Duration>) -> Result<OpId> {
        self.read(key, slot, timeout, false)
    }

    /// `get` at background priority: its transfers start only when no demand
    /// transfer waits, and take at most half of the queue depth, so reads
    /// for what is needed now overtake reads for what may be needed soon.
    pub fn prefetch(&self, key: &[u8], slot: usize, timeout: Option<Duration>) -> Result<OpId> {
        self.read(key, slot, timeout, true)
    }

    fn read(&self, key: &[u8], slot: usize, timeout: Option<Duration>, background: bool) -> Result<OpId> {
        self.check_open()?;
        self.check_args(key, slot)?;
        if background {
            Stats::add(&self.core.stats.prefetches, 1);
        }
        let pool = &self.core.pool;
        let id = self.core.ops.allocate(timeout)?;
        if let Err(e) = pool.pin_io(slot) {
            // Never started: `release` would wait for a completion that never comes.
            self.core.ops.cancel(id);
            return Err(e);
        }
        let hash = format::key_hash(key);
        let root = self.core.layout.root_of(hash);
        let mut ctx = OpContext {
            kind: OpKind::Get,
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
            background,
            enospc_retried: false,
            reserved: 0,
        };
        let path = self.core.layout.chunk_path(hash);
        let (fd, size) = match files::open_for_read(&path, ctx.direct) {
            Ok(opened) => opened,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                // Absent (or deleted by another process sharing the directory): a miss.
                self.core.index.lock().unwrap().remove(hash);
                self.core.finish(id, ctx, Outcome::new(Status::Miss, 0, None, "chunk not on disk"));
                return Ok(id);
            }
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                // O_NOFOLLOW refused a symlink planted at a chunk path: never
                // followed, and removed like any other foreign file.
                self.core.corrupt(id, ctx, "a symbolic link, not a chunk file (not followed)".into());
                return Ok(id);
            }
            Err(e) => {
                let msg = format!("opening {}: {e}", path.display());
                self.core.fail_early(id, ctx, e.raw_os_error(), msg);
                return Ok(id);
            }
        };
        ctx.read_fd = fd;
        let Some(size) = size.map(|s| s as usize) else {
            self.core.corrupt(id, ctx, "not a regular file".into());
            return Ok(id);
        };
        let max_len = HEADER_BYTES + format::round_up(pool.slot_bytes(), IO_ALIGN);
        if size > max_len && size % IO_ALIGN == 0 {
            // Possibly a valid chunk from a process with larger slots sharing
            // the directory: not ours to judge or delete, just not loadable here.
            let msg = format!("chunk of {size} bytes does not fit a {max_len}-byte slot");
            self.core.finish(id, ctx, Outcome::new(Status::Miss, 0, None, msg));
            return Ok(id);
        }
        if size < HEADER_BYTES || size % IO_ALIGN != 0 {
            let reason = format!("file is {size} bytes (expected a multiple of {IO_ALIGN} in {HEADER_BYTES}..={max_len})");
            self.core.corrupt(id, ctx, reason);
            return Ok(id);
        }
        ctx.file_len = size;
        submit(&self.core, &*self.backend, id, ctx, fd, false);
        Ok(id)
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

    pub fn contains(&self, key: &[u8]) -> bool {
        self.core.index.lock().unwrap().contains(format::key_hash(key))
    }

    /// Index lookup, then the directory: finds chunks that another process
    /// sharing the directories published since this store scanned, and
    /// indexes them. One `lstat` when the index has no entry.
    pub fn probe(&self, key: &[u8]) -> bool {
        let hash = format::key_hash(key);
        if self.core.index.lock().unwrap().contains(hash) {
            return true;
        }
        match std::fs::symlink_metadata(self.core.layout.chunk_path(hash)) {
            Ok(meta) if meta.file_type().is_file() && meta.len() >= HEADER_BYTES as u64 => {
                self.core.index.lock().unwrap().insert(hash, meta.len());
                true
            }
            _ => false,
        }
    }

    /// Payload capacity needed to read a chunk (its file length minus the header).
    pub fn chunk_file_len(&self, key: &[u8]) -> Option<u64> {
        self.core.index.lock().unwrap().file_len(format::key_hash(key))
    }

    pub fn evict(&self, key: &[u8]) -> bool {
        let hash = format::key_hash(key);
        self.core.remove_chunk(hash)
    }

    pub fn rescan(&self) -> Result<usize> {
        // A background scan still running would merge stale findings afterwards.
        self.core.scan.wait(None);
        let fresh = scan::build_index(&scan::collect(&self.core.layout, &AtomicBool::new(false))?);
        let n = fresh.len();
        *self.core.index.lock().unwrap() = fresh;
        Ok(n)
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

    /// `used_bytes` plus the bytes puts in flight reserved: what eviction
    /// weighs against the capacity. Exact: a put's bytes move from reserved
    /// to used under the index lock.
    pub fn committed_bytes(&self) -> u64 {
        let index = self.core.index.lock().unwrap();
        index.used_bytes() + self.core.reserved.load(Ordering::Relaxed)
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

    /// A message the first time ENOSPC lowered the capacity, once: for the
    /// caller to log (the engine has no logger).
    pub fn take_capacity_notice(&self) -> Option<String> {
        self.core.capacity_notice.lock().unwrap().take()
    }

    pub fn backend_name(&self) -> &'static str {
        self.backend.kind().name()
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
        self.core.ops.drain();
        self.core.jobs.stop();
        for w in self.workers.lock().unwrap().drain(..) {
            let _ = w.join();
        }
        self.backend.shutdown();
    }
}

impl Drop for BlockStore {
    fn drop(&mut self) {
        self.close();
    }
}

/// The outcome of an operation that reserved its entry just before the store
/// closed: it fails (its slot unpinned) instead of going to a stopped backend.
const CLOSED_WHILE_SUBMITTING: &str = "store closed while the operation was being submitted";

/// Transfers `[from, to)` takes at `seg_bytes` a piece (0: one transfer).
fn segment_count(from: usize, to: usize, seg_bytes: usize) -> usize {
    match (to > from, seg_bytes) {
        (false, _) => 0,
        (true, 0) => 1,
        (true, s) => (to - from).div_ceil(s),
    }
}

/// Hands an operation's whole file to the backend: reads, and a put's
/// rewrite after ENOSPC (its slot is sealed by then).
fn submit(core: &Core, backend: &dyn Backend, id: OpId, ctx: OpContext, fd: i32, write: bool) {
    let seg_bytes = if write { core.write_segment_bytes } else { core.segment_bytes };
    let (file_len, t) = (ctx.file_len, Transfer::of_slot(&core.pool, id, ctx.slot, fd, write, ctx.background));
    if let Err(ctx) = core.ops.start(id, ctx, segment_count(0, file_len, seg_bytes) as u32) {
        return core.fail_early(id, ctx, None, CLOSED_WHILE_SUBMITTING.into());
    }
    submit_range(backend, t, 0, file_len, seg_bytes);
}

/// What the segments of one operation share.
#[derive(Clone, Copy)]
struct Transfer {
    op: u32,
    slot: usize,
    base: *mut u8,
    fd: i32,
    write: bool,
    background: bool,
}

impl Transfer {
    fn of_slot(pool: &StagingPool, id: OpId, slot: usize, fd: i32, write: bool, background: bool) -> Self {
        Transfer { op: id.index, slot, base: pool.slot_ptr(slot), fd, write, background }
    }
}

/// Hands bytes `[from, to)` of a file, from the same offsets of the slot at
/// `base`, to the backend in segments that start at multiples of `seg_bytes`
/// from `from` (reads number their checksum pieces by it).
fn submit_range(backend: &dyn Backend, t: Transfer, from: usize, to: usize, seg_bytes: usize) {
    let seg_bytes = if seg_bytes == 0 { to.saturating_sub(from).max(1) } else { seg_bytes };
    let blank = Segment {
        op: t.op,
        fd: t.fd,
        buf: std::ptr::null_mut(),
        len: 0,
        offset: 0,
        write: t.write,
        buf_index: Some(t.slot as u16),
        background: t.background,
    };
    // Small fixed batch on the stack: no per-I/O heap allocation.
    let mut batch = [blank; 16];
    let mut filled = 0;
    let mut offset = from;
    while offset < to {
        let len = seg_bytes.min(to - offset);
        batch[filled] = Segment { buf: unsafe { t.base.add(offset) }, len, offset: offset as u64, ..blank };
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

fn chunk_worker(core: &Core, backend: &dyn Backend) {
    let me = core.jobs.register_worker();
    let clock = thread_cpu_clock();
    while let Some(job) = core.jobs.pop() {
        match job {
            Job::Seal { id, transfer_fd, slot, payload_len } => {
                core.seal(id, slot, payload_len);
                submit_range(backend, Transfer::of_slot(&core.pool, id, slot, transfer_fd, true, false), 0, HEADER_BYTES, 0);
            }
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

/// The free-space reserve of each root, and warnings about the capacity:
/// above the filesystems' size, eviction (by the reserve) is what bounds the
/// store, not `capacity_bytes`.
fn free_space_plan(layout: &Layout, config: &StoreConfig) -> Result<(Vec<u64>, Vec<String>)> {
    let mut reserves = Vec::new();
    let mut seen = Vec::new();
    let (mut total, mut kept_free) = (0u64, 0u64);
    let mut warnings = Vec::new();
    for dir in layout.ns_dirs() {
        let space = files::fs_space(dir).map_err(|e| EngineError::io(format!("statvfs {}", dir.display()), e))?;
        let reserve = config.min_free.bytes_for(space.total);
        reserves.push(reserve);
        if seen.contains(&space.fsid) {
            continue;
        }
        seen.push(space.fsid);
        total = total.saturating_add(space.total);
        kept_free = kept_free.saturating_add(reserve);
        if reserve > 0 && space.available < reserve {
            warnings.push(format!(
                "only {} bytes free on the filesystem of {} ({} bytes), less than the {reserve} bytes pykvcache keeps free \
                 (min_free_bytes): puts evict this store's chunks there and are refused while that is not enough",
                space.available,
                dir.display(),
                space.total
            ));
        }
    }
    if config.capacity_bytes > total {
        warnings.push(format!(
            "capacity_bytes ({} bytes) exceeds the storage filesystem size ({total} bytes): the store grows until \
             {kept_free} bytes are left free (min_free_bytes) and evicts from there",
            config.capacity_bytes
        ));
    }
    Ok((reserves, warnings))
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

impl Core {
    /// Makes room for a put and reserves its bytes until it is published or
    /// fails: within the capacity, and keeping the free-space reserve on the
    /// put's filesystem. Refused (a message) when even evicting every chunk on
    /// that root could not keep the reserve: other writers' space comes first.
    fn reserve_room(&self, ctx: &mut OpContext, reuse: Option<usize>) -> std::result::Result<Option<u128>, String> {
        ctx.reserved = ctx.file_len as u64;
        let shortfall = self.free_space_shortfall(ctx.root, ctx.reserved);
        let (victim, unmet) = self.make_room(ctx.reserved, ctx.hash, reuse, shortfall.map(|s| (ctx.root, s)));
        if unmet > 0 {
            Stats::add(&self.stats.reserve_refused, 1);
            let dir = self.layout.ns_dirs()[ctx.root].display();
            return Err(format!(
                "not stored: keeping {} bytes free on the filesystem of {dir} (min_free_bytes) needs {unmet} bytes more \
                 than evicting every chunk there frees",
                self.min_free[ctx.root]
            ));
        }
        Ok(victim)
    }

    /// Bytes to free on `root`'s filesystem so that `incoming` more leaves
    /// its reserve free; None when there is no reserve or no shortfall.
    /// What other puts reserved counts as not yet allocated (they may have
    /// fallocated already: then this evicts a little early, never late).
    fn free_space_shortfall(&self, root: usize, incoming: u64) -> Option<u64> {
        let reserve = self.min_free[root];
        if reserve == 0 {
            return None;
        }
        let available = files::fs_space(&self.layout.ns_dirs()[root]).ok()?.available;
        let pending = self.reserved.load(Ordering::Relaxed);
        let short = reserve.saturating_add(incoming).saturating_add(pending).saturating_sub(available);
        (short > 0).then_some(short)
    }

    /// Drops a put's reservation (idempotent). A published chunk's bytes move
    /// from reserved to used under the index lock, never counted twice.
    fn release_reservation(&self, ctx: &mut OpContext) {
        self.reserved.fetch_sub(std::mem::take(&mut ctx.reserved), Ordering::Relaxed);
    }

    /// Evicts least recently used chunks until `incoming` more bytes (beyond
    /// the indexed and the reserved ones) fit, and reserves them.
    /// With `reuse` = a root, the first victim on that root is not unlinked:
    /// it leaves the index and is returned for the caller to overwrite.
    /// With `fs_short` = (root, bytes), also evicts chunks on that root until
    /// `bytes` are freed there (the free-space reserve); returns what of it no
    /// chunk could cover.
    fn make_room(&self, incoming: u64, keep: u128, reuse: Option<usize>, fs_short: Option<(usize, u64)>) -> (Option<u128>, u64) {
        let capacity = self.capacity.load(Ordering::Relaxed);
        let mut unmet = 0;
        let victims = {
            let index = self.index.lock().unwrap();
            let reserved = self.reserved.fetch_add(incoming, Ordering::Relaxed);
            let mut victims = index.victims(incoming + reserved, capacity, keep);
            if let Some((root, short)) = fs_short {
                let on_root = |h: u128| self.layout.root_of(h) == root;
                let freed: u64 = victims.iter().filter(|(h, _)| on_root(*h)).map(|(_, l)| l).sum();
                if short > freed {
                    let chosen: std::collections::HashSet<u128> = victims.iter().map(|(h, _)| *h).collect();
                    let more = index.victims_where(short - freed, keep, |h| on_root(h) && !chosen.contains(&h));
                    let got: u64 = more.iter().map(|(_, l)| l).sum();
                    unmet = (short - freed).saturating_sub(got);
                    Stats::add(&self.stats.reserve_evictions, more.len() as u64);
                    victims.extend(more);
                }
            }
            victims
        };
        let mut kept = None;
        for (hash, _) in victims {
            if kept.is_none() && reuse == Some(self.layout.root_of(hash)) {
                if let Some(len) = self.index.lock().unwrap().remove(hash) {
                    Stats::add(&self.stats.evicted_bytes, len);
                    Stats::add(&self.stats.evictions, 1);
                    kept = Some(hash);
                }
                continue;
            }
            if self.remove_chunk(hash) {
                Stats::add(&self.stats.evictions, 1);
            }
        }
        (kept, unmet)
    }

    /// The file a put writes: the evicted `victim` when it can be claimed,
    /// else a fresh one. A fresh file that hits ENOSPC makes room and is
    /// tried once more.
    fn open_chunk_file(&self, ctx: &mut OpContext, victim: Option<u128>) -> std::io::Result<files::PendingFile> {
        let shard = self.layout.shard_dir(ctx.hash);
        let support = self.support[ctx.root];
        let mut claimed = victim.and_then(|v| match files::claim_for_reuse(&self.layout.chunk_path(v), &shard, ctx.file_len, ctx.direct) {
            Ok(f) => {
                Stats::add(&self.stats.recycled_files, 1);
                Some(f)
            }
            // Read by someone right now, taken by another process, or no flock here.
            Err(_) => {
                Stats::add(&self.stats.recycle_skipped, 1);
                None
            }
        });
        loop {
            let opened = match claimed.take() {
                Some(f) => Ok(f),
                None => files::open_for_write(&shard, support, ctx.direct, self.file_mode),
            };
            // Preallocation also finds a full disk before any byte is written.
            // A recycled file at least as long is allocated already.
            let ready = opened.and_then(|f| {
                let allocated = || files::regular_file_size(f.fd).ok().flatten().unwrap_or(0) >= ctx.file_len as u64;
                if !(self.preallocate && support.fallocate) || (f.temp_path.is_some() && allocated()) {
                    return Ok(f);
                }
                match files::preallocate(f.fd, ctx.file_len) {
                    Ok(()) => Ok(f),
                    Err(e) => {
                        files::discard(&f);
                        Err(e)
                    }
                }
            });
            match ready {
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && !ctx.enospc_retried => {
                    ctx.enospc_retried = true;
                    self.on_enospc(ctx.file_len as u64, ctx.hash);
                }
                other => return other,
            }
        }
    }

    /// The filesystem is full before the capacity is: lower the capacity to
    /// what the index holds now (what did fit; never below one chunk) and
    /// evict least recently used chunks until this chunk and one more like
    /// it fit, so that the next write does not hit ENOSPC again at once.
    fn on_enospc(&self, incoming: u64, keep: u128) {
        let victims = {
            let index = self.index.lock().unwrap();
            let fits = index.used_bytes().max(incoming);
            let before = self.capacity.fetch_min(fits, Ordering::Relaxed);
            if fits < before {
                let mut notice = self.capacity_notice.lock().unwrap();
                if Stats::add_first(&self.stats.capacity_lowered, 1) {
                    *notice = Some(format!(
                        "filesystem full before capacity_bytes ({} bytes): evicting on ENOSPC; capacity lowered to {fits} bytes \
                         (stats capacity_bytes shows the current value)",
                        self.configured_capacity
                    ));
                }
            }
            index.victims(incoming.saturating_mul(2), fits, keep)
        };
        Stats::add(&self.stats.enospc_retries, 1);
        for (hash, _) in victims {
            if self.remove_chunk(hash) {
                Stats::add(&self.stats.evictions, 1);
                Stats::add(&self.stats.enospc_evictions, 1);
            }
        }
    }

    fn remove_chunk(&self, hash: u128) -> bool {
        let removed = self.index.lock().unwrap().remove(hash);
        let path = self.layout.chunk_path(hash);
        let unlinked = std::fs::remove_file(&path).is_ok();
        if let Some(len) = removed {
            Stats::add(&self.stats.evicted_bytes, len);
        }
        removed.is_some() || unlinked
    }

    fn fail_early(&self, id: OpId, ctx: OpContext, errno: Option<i32>, message: String) {
        if ctx.kind == OpKind::Put && errno == Some(libc::ENOSPC) {
            Stats::add(&self.stats.write_enospc, 1);
        }
        self.finish(id, ctx, Outcome::new(Status::Error, 0, errno, message));
    }

    fn corrupt(&self, id: OpId, ctx: OpContext, reason: String) {
        // A chunk that fails verification is removed so it is never tried again.
        let path = self.layout.chunk_path(ctx.hash);
        self.remove_chunk(ctx.hash);
        let msg = format!("corrupt chunk {}: {reason}", path.display());
        self.finish(id, ctx, Outcome::new(Status::Corrupt, 0, None, msg));
    }

    /// Single exit of every operation: closes files, unpins the slot, counts, signals.
    fn finish(&self, id: OpId, mut ctx: OpContext, mut outcome: Outcome) {
        self.release_reservation(&mut ctx);
        if ctx.read_fd >= 0 {
            if !ctx.direct {
                files::drop_cached_pages(ctx.read_fd, false);
            }
            files::close(ctx.read_fd);
        }
        if let Some(f) = ctx.write_file.take() {
            files::discard(&f);
        }
        self.pool.unpin_io(ctx.slot);
        outcome.latency = ctx.started.elapsed();
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
        self.ops.complete(id, outcome);
    }

    /// Writes the header block into the slot in place (the padding was
    /// zeroed by `put`), so the whole file leaves in aligned transfers
    /// straight from staging.
    fn seal(&self, id: OpId, slot: usize, payload_len: usize) {
        let pool = &self.pool;
        let payload = unsafe { std::slice::from_raw_parts(pool.payload_ptr(slot), payload_len) };
        let crc = crc32c(payload);
        let header = unsafe { std::slice::from_raw_parts_mut(pool.slot_ptr(slot), HEADER_BYTES) };
        self.ops.with_context(id.index, |ctx| format::encode_header_for(header, &self.namespace, &ctx.key, payload_len as u64, Some(crc)));
    }

    fn finish_op(&self, done: Finished, backend: &dyn Backend) {
        let Finished { id, ctx, error, prefix_crc } = done;
        match ctx.kind {
            OpKind::Get => self.finish_get(id, ctx, error, prefix_crc),
            OpKind::Put => self.finish_put(id, ctx, error, backend),
        }
    }

    /// Checksums the payload bytes of one landed read segment that are
    /// payload whatever the header says: those before the file's last 4 KiB
    /// (padding is shorter than that). The rest is checked in `finish_get`.
    fn verify_piece(&self, seg: &Segment) -> Option<Finished> {
        let file_len = self.ops.with_context(seg.op, |ctx| ctx.file_len);
        let offset = seg.offset as usize;
        let start = offset.max(HEADER_BYTES);
        let end = (offset + seg.len).min(file_len.saturating_sub(IO_ALIGN));
        let piece = offset / self.segment_bytes;
        let (crc, len) = if end > start {
            let bytes = unsafe { std::slice::from_raw_parts(seg.buf.add(start - offset), end - start) };
            (crc32c(bytes), (end - start) as u64)
        } else {
            (0, 0)
        };
        self.ops.segment_done(seg.op, Ok(()), Some((piece, crc, len)))
    }

    fn finish_get(&self, id: OpId, ctx: OpContext, error: Option<SegmentError>, prefix_crc: PrefixCrc) {
        match error {
            Some(SegmentError::Eof) => return self.corrupt(id, ctx, "file shorter than its size (truncated while reading)".into()),
            Some(SegmentError::Errno(errno)) => {
                let msg = format!("reading chunk: {}", std::io::Error::from_raw_os_error(errno));
                return self.finish(id, ctx, Outcome::new(Status::Error, 0, Some(errno), msg));
            }
            None => {}
        }
        let slot_ptr = self.pool.slot_ptr(ctx.slot);
        let block = unsafe { std::slice::from_raw_parts(slot_ptr, HEADER_BYTES) };
        let header = match format::decode_header(block, &self.namespace, &ctx.key, ctx.file_len as u64) {
            Ok(h) => h,
            // A sound header this build cannot interpret: not ours to delete.
            Err(e @ FormatError::Flags(_)) => return self.finish(id, ctx, Outcome::new(Status::Miss, 0, None, e.to_string())),
            Err(e) => return self.corrupt(id, ctx, e.to_string()),
        };
        let payload = unsafe { std::slice::from_raw_parts(self.pool.payload_ptr(ctx.slot), header.payload_len as usize) };
        if self.verify == VerifyPolicy::Full {
            // `decode_header` checked that the payload fills the file to its
            // last 4 KiB, so the verified prefix never exceeds it.
            let Some(expected) = header.payload_crc else {
                // Written by a verify="header" store: sound, but nothing to
                // check the payload against. Never served here, never deleted.
                let msg = "chunk written without a payload checksum (verify=\"header\" writer); this store verifies payloads";
                return self.finish(id, ctx, Outcome::new(Status::Miss, 0, None, msg));
            };
            let rest = &payload[prefix_crc.len as usize..];
            let crc = crc32c_combine(prefix_crc.crc, crc32c(rest), rest.len() as u64);
            if crc != expected {
                return self.corrupt(id, ctx, FormatError::PayloadCrc.to_string());
            }
        }
        let adopted = {
            let mut index = self.index.lock().unwrap();
            if index.contains(ctx.hash) {
                index.touch(ctx.hash);
                false
            } else {
                index.insert(ctx.hash, ctx.file_len as u64);
                true
            }
        };
        if adopted {
            // A chunk another process wrote now counts here too: stay within capacity.
            self.make_room(0, ctx.hash, None, None);
        }
        let len = header.payload_len;
        self.finish(id, ctx, Outcome::new(Status::Ok, len, None, ""));
    }

    fn finish_put(&self, id: OpId, mut ctx: OpContext, error: Option<SegmentError>, backend: &dyn Backend) {
        if let Some(err) = error {
            let errno = match err {
                SegmentError::Errno(e) => e,
                SegmentError::Eof => libc::EIO,
            };
            if errno == libc::ENOSPC && !ctx.enospc_retried {
                // Once: evict, then write the whole (still sealed) slot again.
                ctx.enospc_retried = true;
                self.on_enospc(ctx.file_len as u64, ctx.hash);
                let fd = ctx.write_file.as_ref().expect("put without a file").fd;
                return submit(self, backend, id, ctx, fd, true);
            }
            if errno == libc::ENOSPC {
                Stats::add(&self.stats.write_enospc, 1);
            }
            let msg = format!("writing chunk: {}", std::io::Error::from_raw_os_error(errno));
            return self.finish(id, ctx, Outcome::new(Status::Error, 0, Some(errno), msg));
        }
        let file = ctx.write_file.take().expect("put without a file");
        if !ctx.direct {
            files::drop_cached_pages(file.fd, true);
        }
        let path = self.layout.chunk_path(ctx.hash);
        let published = files::publish(&file, &path);
        files::close(file.fd);
        match published {
            Ok(first) => {
                if !first {
                    Stats::add(&self.stats.write_races, 1);
                }
                {
                    let mut index = self.index.lock().unwrap();
                    index.insert(ctx.hash, ctx.file_len as u64);
                    self.release_reservation(&mut ctx);
                }
                // Concurrent puts each made room for themselves only; trim the overshoot.
                self.make_room(0, ctx.hash, None, None);
                let len = ctx.payload_len as u64;
                self.finish(id, ctx, Outcome::new(Status::Ok, len, None, ""))
            }
            Err(e) => {
                if let Some(temp) = &file.temp_path {
                    let _ = std::fs::remove_file(temp);
                }
                let msg = format!("publishing {}: {e}", path.display());
                self.finish(id, ctx, Outcome::new(Status::Error, 0, e.raw_os_error(), msg))
            }
        }
    }
}

impl SegmentSink for Core {
    fn segment_done(&self, seg: &Segment, result: std::result::Result<(), SegmentError>) {
        if !seg.write && result.is_ok() && self.verify == VerifyPolicy::Full {
            return self.jobs.push(Job::VerifyPiece { seg: *seg });
        }
        if let Some(done) = self.ops.segment_done(seg.op, result, None) {
            if done.ctx.kind == OpKind::Get && self.verify == VerifyPolicy::Header {
                // A 4 KiB header check: cheaper here than waking a chunk
                // worker for it (a wake-up costs more CPU than the check, and
                // at queue depth 1 every operation pays one).
                let Finished { id, ctx, error, prefix_crc } = done;
                return self.finish_get(id, ctx, error, prefix_crc);
            }
            self.jobs.push(Job::Finish(done));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_space_reserve_in_bytes() {
        let tb = 1u64 << 40;
        assert_eq!(FreeSpaceReserve::Default.bytes_for(100 << 30), 5 << 30, "5% of a 100 GiB filesystem");
        assert_eq!(FreeSpaceReserve::Default.bytes_for(4 * tb), DEFAULT_RESERVE_MAX, "capped on large filesystems");
        let r = FreeSpaceReserve::AtLeast { bytes: 1 << 30, fraction: 0.1 };
        assert_eq!(r.bytes_for(100 << 30), 10 << 30, "the larger of the two");
        assert_eq!(r.bytes_for(4 << 30), 1 << 30);
        assert_eq!(FreeSpaceReserve::AtLeast { bytes: 0, fraction: 0.0 }.bytes_for(tb), 0, "off");
    }
}
