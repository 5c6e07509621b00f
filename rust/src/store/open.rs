//! Opening a store: the configuration checked, the directories probed, the
//! index built or its scan started, then the backend and the store's threads.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::config::{BackendChoice, StoreConfig};
use super::health::Health;
use super::jobs::{DirQueue, JobQueue};
use super::sealing::{OpenStates, SealBuffers, Sealing};
use super::{capacity, completion, read, region, segments, BlockStore, Core, OpenReport};
use crate::backend::threads::ThreadBackend;
use crate::backend::uring::UringBackend;
use crate::backend::{Backend, SegmentSink};
use crate::disk::dirfds::HeldDirs;
use crate::disk::files::{self, DirectIoPolicy};
use crate::disk::format;
use crate::disk::index::ChunkIndex;
use crate::disk::layout::Layout;
use crate::disk::roots::RootIdentity;
use crate::disk::scan::{self, ScanProgress, ScanReport};
use crate::disk::seal::{KeyRing, MasterKey};
use crate::disk::writers::WriterLease;
use crate::error::{EngineError, Result};
use crate::ops::OpTable;
use crate::staging::StagingPool;
use crate::stats::Stats;

impl BlockStore {
    pub fn open(config: StoreConfig, pool: Arc<StagingPool>) -> Result<(Self, OpenReport)> {
        if !pool.is_owner() {
            return Err(EngineError::invalid("a store needs the staging pool's owner (not an attached mapping)"));
        }
        config.validate(pool.stride())?;
        // The keys first: a key file refused leaves nothing touched.
        let sealing = open_sealing(&config, &pool)?;
        let namespace = format::namespace_fingerprint(&config.namespace);
        let layout = Layout::open(&config.dirs, &namespace, &config.namespace, &config.permissions)?;
        let stats = Stats::default();
        let root_ids = layout.roots().iter().map(|r| RootIdentity::of(r).ok()).collect();

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
                    return Err(EngineError::BackendUnavailable(format!("{} refuses O_DIRECT and direct_io=required", dir.display())))
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
        let ledgers = super::ledger::Ledgers::new(layout.roots().len(), lease.id());

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

        let (segment_dirs, lease_id, segment_direct) =
            ((layout.roots().to_vec(), layout.ns_dirs().to_vec()), lease.id(), direct_active.clone());
        let punches: Vec<bool> = support.iter().map(|s: &files::FsSupport| s.punch_hole).collect();
        let segment_writes = config.segment_files.resolve(layout.roots(), &punches);
        if segment_writes && punches.contains(&false) {
            stats.record_fallback(
                "segment_files on a filesystem that cannot punch holes: an evicted slot keeps its bytes until its segment is unlinked"
                    .to_string(),
            );
        }
        let health = Health::new(layout.ns_dirs(), config.io_deadline.resolve(pool.stride()));
        let dirs = layout.ns_dirs().iter().map(|_| DirQueue::default()).collect();
        let core = Arc::new(Core {
            health,
            dirs,
            held: HeldDirs::default(),
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
            permissions: config.permissions,
            root_ids: Mutex::new(root_ids),
            rebuild: AtomicBool::new(false),
            ledgers,
            walk_now: AtomicBool::new(false),
            support,
            direct_active,
            index: Mutex::new(index),
            ops: OpTable::new(config.max_inflight)?,
            pieces: read::Pieces::new(config.max_inflight),
            regions: region::Regions::default(),
            headers: region::HeaderBlocks::new(config.max_inflight)?,
            stats,
            verify: config.verify,
            sealing,
            jobs: JobQueue::default(),
            // Every store reads segments (and counts and evicts their chunks);
            // one with `segment_files` writes them.
            segments: segments::Segments::new(
                (&segment_dirs.0, &segment_dirs.1),
                segment_writes,
                lease_id,
                segment_direct,
                (config.permissions.file_mode, config.permissions.dir_mode),
                config.capacity_bytes,
            ),
        });
        // Chunks in segments (every namespace's), before the ledgers count the index.
        core.discover_segments(std::time::Duration::ZERO, true);
        for ns_dir in core.layout.ns_dirs() {
            core.held.hold(ns_dir);
        }
        // The capacity ledgers, counted from the index at once while this
        // store is the only writer (decision 0053).
        core.open_ledgers();
        let (others, _) = core.check_writers();
        core.tend_ledgers(others == 0, true);
        let backend: Arc<dyn Backend> = Arc::from(make_backend(&config, &core)?);
        let mut workers = Vec::new();
        for i in 0..config.chunk_workers.max(1) {
            let (c, b) = (core.clone(), backend.clone());
            let spawned = std::thread::Builder::new().name(format!("pykvcache-chunk-{i}")).spawn(move || completion::chunk_worker(&c, &*b));
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
        if !config.background_scan {
            core.hold_shard_dirs();
        }
        if config.background_scan {
            let (c, faults) = (core.clone(), config.faults.clone());
            let spawned = std::thread::Builder::new().name("pykvcache-scan".into()).spawn(move || {
                c.scan.run(&c.layout, &c.index, &faults);
                c.hold_shard_dirs();
            });
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
            background_budget: AtomicU64::new(0),
        };
        if let Err(e) = store.start_guards() {
            store.close();
            return Err(e);
        }
        Ok((store, report))
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
    let mut iovecs: Vec<libc::iovec> =
        (0..pool.num_slots()).map(|s| libc::iovec { iov_base: pool.slot_ptr(s) as *mut _, iov_len: pool.stride() }).collect();
    // The seal buffers follow the slots (`SealBuffers::register_after` numbered them so).
    if let Some(s) = &core.sealing {
        iovecs.extend(s.buffers.registered());
    }
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

/// The keys and seal buffers of a store with an encryption key; None without.
fn open_sealing(config: &StoreConfig, pool: &StagingPool) -> Result<Option<Sealing>> {
    let Some(path) = &config.encryption_key_file else { return Ok(None) };
    let current = MasterKey::load(path, "encryption_key_file")?;
    let previous = match &config.encryption_previous_key_file {
        Some(p) => Some(MasterKey::load(p, "encryption_previous_key_file")?),
        None => None,
    };
    let keys = KeyRing::new(current, previous)?;
    let mut buffers = SealBuffers::new(config.seal_buffers, pool.stride())?;
    if config.register_buffers {
        buffers.number_after(pool.num_slots());
    }
    Ok(Some(Sealing { keys, buffers, opens: OpenStates::new(config.max_inflight), workers: config.chunk_workers.max(1) }))
}
