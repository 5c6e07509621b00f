//! What a store reports about itself: one `StoreSnapshot` for everything
//! `stats()` shows (read once, in one place), the few single values callers
//! read on their own (sizes, the backend), and the notices for the caller's log.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{BlockStore, RefreshPolicy};
use crate::disk::files::FsSupport;
use crate::disk::scan::ScanReport;
use crate::notice::Notice;
use crate::stats::Stats;

/// Everything `BlockStore::snapshot` reads, at one moment (each value is
/// read once; counters keep moving meanwhile, as they did getter by getter).
pub struct StoreSnapshot {
    /// The circuit breakers' counters, by the names `stats()` shows.
    pub health: Vec<(&'static str, u64)>,
    /// Operations abandoned past their deadline whose work the kernel has not ended.
    pub stuck_ops: usize,
    pub quarantined_slots: usize,
    pub quarantine_releases: u64,
    /// Per storage directory, its circuit breaker's state.
    pub dir_states: Vec<&'static str>,
    /// The I/O deadline in force (configured or derived from the chunk size).
    pub io_deadline: Duration,
    /// What probing each storage directory found at open.
    pub storage_support: Vec<(PathBuf, FsSupport)>,
    /// The engine's counters (`Stats::counters`).
    pub counters: Vec<(&'static str, u64)>,
    pub read_latency_hist: Vec<u64>,
    pub write_latency_hist: Vec<u64>,
    pub backend: &'static str,
    /// Why the backend moves no more bytes; None while it works.
    pub backend_error: Option<String>,
    pub fixed_buffers: bool,
    pub direct_io: bool,
    pub fallbacks: Vec<String>,
    pub inflight: usize,
    /// Chunks indexed, fillers not counted.
    pub chunks: usize,
    pub filler_chunks: usize,
    pub used_bytes: u64,
    /// Chunks and bytes of the other namespaces under the roots, which count
    /// against the capacity (decision 0053).
    pub other_namespace_chunks: u64,
    pub other_namespace_bytes: u64,
    /// Other writers' live leases in the roots, as last checked.
    pub other_writers: u64,
    pub refresh_policy: RefreshPolicy,
    pub capacity_bytes: u64,
    pub configured_capacity_bytes: u64,
    /// Bytes kept free on each root's filesystem (`StoreConfig::min_free`).
    pub min_free_bytes: Vec<u64>,
    pub backend_cpu: Duration,
    /// CPU time of the chunk workers (checksums, verification, publication).
    pub chunk_worker_cpu: Duration,
    /// The open-time scan.
    pub scan: ScanReport,
    pub staging_free_slots: usize,
    /// With an encryption key: what `stats()` shows of it (never key bytes).
    pub sealing: Option<SealingSnapshot>,
}

/// The sealing side of a store (decision 0083).
pub struct SealingSnapshot {
    /// Hex of the id of the key new chunks are sealed with (derived from the
    /// key, never the key), and of the previous key's ("" without one).
    pub key_id: String,
    pub previous_key_id: String,
    pub seal_buffers: usize,
    pub seal_buffers_free: usize,
    pub tenants_cached: usize,
}

impl BlockStore {
    /// Everything `stats()` shows, read once.
    pub fn snapshot(&self) -> StoreSnapshot {
        let core = &self.core;
        let c = &core.health.counters;
        let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let health = vec![
            ("io_timeouts", g(&c.timeouts)),
            ("storage_errors", g(&c.storage_errors)),
            ("breaker_opens", g(&c.breaker_opens)),
            ("breaker_skipped_gets", g(&c.skipped_gets)),
            ("breaker_skipped_puts", g(&c.skipped_puts)),
            ("breaker_probes", g(&c.probes)),
            ("breaker_probe_failures", g(&c.probe_failures)),
            ("breaker_closes", g(&c.breaker_closes)),
            ("late_completions", g(&c.late_completions)),
        ];
        let (chunks, filler_chunks, used_bytes) = {
            let index = core.index.lock().unwrap();
            (index.len() - index.filler_count(), index.filler_count(), index.used_bytes())
        };
        let (other_namespace_chunks, other_namespace_bytes) = self.other_namespace_usage();
        let s = &core.stats;
        StoreSnapshot {
            health,
            stuck_ops: core.ops.stuck(),
            quarantined_slots: core.pool.quarantined_slots(),
            quarantine_releases: core.pool.quarantine_releases(),
            dir_states: (0..core.health.dirs.len()).map(|i| core.health.state(i).name()).collect(),
            io_deadline: core.health.deadline,
            storage_support: core.layout.ns_dirs().iter().cloned().zip(core.support.iter().copied()).collect(),
            counters: s.counters(),
            read_latency_hist: Stats::histogram(&s.read_latency_us),
            write_latency_hist: Stats::histogram(&s.write_latency_us),
            backend: self.backend_name(),
            backend_error: self.backend_failure(),
            fixed_buffers: self.fixed_buffers(),
            direct_io: self.direct_io(),
            fallbacks: s.fallbacks(),
            inflight: self.in_flight(),
            chunks,
            filler_chunks,
            used_bytes,
            other_namespace_chunks,
            other_namespace_bytes,
            other_writers: self.other_writers(),
            refresh_policy: self.refresh_policy(),
            capacity_bytes: self.capacity_bytes(),
            configured_capacity_bytes: core.configured_capacity,
            min_free_bytes: core.min_free.clone(),
            backend_cpu: Duration::from_nanos(self.backend.cpu_time_ns()),
            chunk_worker_cpu: Duration::from_nanos(core.jobs.cpu_time_ns()),
            scan: core.scan.report(),
            staging_free_slots: core.pool.free_slots(),
            sealing: core.sealing.as_ref().map(|s| {
                let hex = |id: [u8; 8]| id.iter().map(|b| format!("{b:02x}")).collect::<String>();
                SealingSnapshot {
                    key_id: hex(s.keys.key_id()),
                    previous_key_id: s.keys.previous_key_id().map(hex).unwrap_or_default(),
                    seal_buffers: s.buffers.count(),
                    seal_buffers_free: s.buffers.available(),
                    tenants_cached: s.keys.cached_tenants(),
                }
            }),
        }
    }

    /// Messages for the caller's log since the last call, each once, in the
    /// order they arose per source: the circuit breakers' state changes, then
    /// those about space (ENOSPC lowered the capacity, another namespace's
    /// chunks evicted, a put refused for the reserve, another writer found).
    /// Taken outside the I/O path (the engine has no logger; see `notice`).
    pub fn take_notices(&self) -> Vec<Notice> {
        let mut notices = self.core.health.take_notices();
        notices.append(&mut self.core.notices.lock().unwrap());
        notices
    }

    /// `(breaker_opens, breaker_closes, open_dirs)`: what the snapshot says of
    /// the circuit breakers, without the rest of it (a few atomic loads and
    /// one lock per directory; the vLLM gate asks once per request).
    pub fn breaker_health(&self) -> (u64, u64, usize) {
        let h = &self.core.health;
        let open = (0..h.dirs.len()).filter(|&i| h.state(i).name() != "closed").count();
        (h.counters.breaker_opens.load(Ordering::Relaxed), h.counters.breaker_closes.load(Ordering::Relaxed), open)
    }

    /// Chunks indexed, fillers not counted (they hold space, not data).
    pub fn len(&self) -> usize {
        let index = self.core.index.lock().unwrap();
        index.len() - index.filler_count()
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

    /// Whether new chunks go into segment files (`segment_files` as resolved at open).
    pub fn segment_files(&self) -> bool {
        self.core.segments.writes
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
}
