//! Engine counters: lock-free, read as one snapshot for Python or vLLM metrics.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

/// Latency histogram bucket upper bounds, in microseconds (last is +inf).
pub const LATENCY_BUCKETS_US: [u64; 16] =
    [50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000, 5_000_000, u64::MAX];

#[derive(Default)]
pub struct Stats {
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    pub reads: AtomicU64,
    /// Reads asked for at background priority (successful ones also count in `reads`).
    pub prefetches: AtomicU64,
    /// Prefetches raised to demand priority before all their transfers
    /// started (`BlockStore::promote`).
    pub promotions: AtomicU64,
    pub writes: AtomicU64,
    pub read_hits: AtomicU64,
    pub read_misses: AtomicU64,
    pub corrupt: AtomicU64,
    pub read_errors: AtomicU64,
    pub write_errors: AtomicU64,
    pub write_enospc: AtomicU64,
    pub write_races: AtomicU64,
    pub evictions: AtomicU64,
    pub evicted_bytes: AtomicU64,
    /// Puts that overwrote an evicted chunk file instead of allocating a new one.
    pub recycled_files: AtomicU64,
    /// Evicted files that could not be claimed (being read, taken by another
    /// process, no flock): unlinked, and a fresh file written.
    pub recycle_skipped: AtomicU64,
    /// ENOSPC seen by a put (each followed by eviction and one retry).
    pub enospc_retries: AtomicU64,
    pub enospc_evictions: AtomicU64,
    /// Times ENOSPC lowered the effective capacity.
    pub capacity_lowered: AtomicU64,
    /// Chunks evicted to keep the free-space reserve (beyond the capacity's).
    pub reserve_evictions: AtomicU64,
    /// Puts refused because evicting everything could not keep the reserve.
    pub reserve_refused: AtomicU64,
    /// Puts refused because the capacity ledger showed the room held by
    /// chunks of other writers this store did not know yet (a walk follows).
    pub shared_capacity_refused: AtomicU64,
    /// Directory walks that brought the index in line with a shared directory.
    pub refreshes: AtomicU64,
    /// Chunks a refresh found that another process or node wrote (now counted here).
    pub refresh_added: AtomicU64,
    /// Indexed chunks a refresh found gone (another process or node evicted them).
    pub refresh_dropped: AtomicU64,
    pub refresh_errors: AtomicU64,
    /// Times `refresh_interval_s=auto` started walking because another
    /// writer's lease appeared in a root (decision 0053).
    pub auto_refresh_starts: AtomicU64,
    /// Evicted chunks of other namespaces under the roots (the capacity
    /// spans them: decision 0053); also counted in `evictions`.
    pub other_namespace_evictions: AtomicU64,
    /// Segment files (decision 0086) unlinked because nobody adds a slot to
    /// them any more and every slot they list was punched.
    pub segments_unlinked: AtomicU64,
    /// Anomalies the engine survived instead of panicking (a completion for
    /// an operation not in flight, ...): each is also written to stderr.
    pub internal_errors: AtomicU64,
    /// Sealed chunks (an encryption key configured, decision 0083): puts
    /// sealed, gets whose every frame opened, gets that found a chunk sealed
    /// with another key or for another tenant (or a plaintext one where
    /// chunks are sealed, or a sealed one where they are not: kept, never
    /// deleted), and gets whose frames failed authentication (corrupt).
    pub sealed_puts: AtomicU64,
    pub opened_gets: AtomicU64,
    pub not_ours_misses: AtomicU64,
    pub auth_failures: AtomicU64,
    pub read_latency_us: [AtomicU64; 16],
    pub write_latency_us: [AtomicU64; 16],
    pub read_latency_sum_us: AtomicU64,
    pub write_latency_sum_us: AtomicU64,
    fallbacks: Mutex<Vec<String>>,
}

impl Stats {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }

    /// Adds `n`; true when the counter was zero before (a first occurrence).
    pub fn add_first(counter: &AtomicU64, n: u64) -> bool {
        counter.fetch_add(n, Relaxed) == 0
    }

    pub fn observe(hist: &[AtomicU64; 16], sum: &AtomicU64, latency: Duration) {
        let us = latency.as_micros() as u64;
        let bucket = LATENCY_BUCKETS_US.iter().position(|&b| us <= b).unwrap_or(15);
        hist[bucket].fetch_add(1, Relaxed);
        sum.fetch_add(us, Relaxed);
    }

    /// Records a fallback once; returns true the first time (so the caller logs it once).
    pub fn record_fallback(&self, what: impl Into<String>) -> bool {
        let what = what.into();
        let mut f = self.fallbacks.lock().unwrap();
        if f.contains(&what) {
            return false;
        }
        f.push(what);
        true
    }

    /// Counts and logs an anomaly (the engine has no logger: stderr). Used
    /// where a panic would take down a thread others depend on, such as the
    /// ring thread.
    pub fn record_error(&self, what: impl AsRef<str>) {
        self.internal_errors.fetch_add(1, Relaxed);
        eprintln!("pykvcache: internal error: {}", what.as_ref());
    }

    pub fn fallbacks(&self) -> Vec<String> {
        self.fallbacks.lock().unwrap().clone()
    }

    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        let g = |c: &AtomicU64| c.load(Relaxed);
        vec![
            ("bytes_read", g(&self.bytes_read)),
            ("bytes_written", g(&self.bytes_written)),
            ("reads", g(&self.reads)),
            ("prefetches", g(&self.prefetches)),
            ("promotions", g(&self.promotions)),
            ("writes", g(&self.writes)),
            ("read_hits", g(&self.read_hits)),
            ("read_misses", g(&self.read_misses)),
            ("corrupt_chunks", g(&self.corrupt)),
            ("read_errors", g(&self.read_errors)),
            ("write_errors", g(&self.write_errors)),
            ("write_enospc", g(&self.write_enospc)),
            ("write_races", g(&self.write_races)),
            ("evictions", g(&self.evictions)),
            ("evicted_bytes", g(&self.evicted_bytes)),
            ("recycled_files", g(&self.recycled_files)),
            ("recycle_skipped", g(&self.recycle_skipped)),
            ("enospc_retries", g(&self.enospc_retries)),
            ("enospc_evictions", g(&self.enospc_evictions)),
            ("capacity_lowered", g(&self.capacity_lowered)),
            ("reserve_evictions", g(&self.reserve_evictions)),
            ("reserve_refused", g(&self.reserve_refused)),
            ("shared_capacity_refused", g(&self.shared_capacity_refused)),
            ("refreshes", g(&self.refreshes)),
            ("refresh_added", g(&self.refresh_added)),
            ("refresh_dropped", g(&self.refresh_dropped)),
            ("refresh_errors", g(&self.refresh_errors)),
            ("auto_refresh_starts", g(&self.auto_refresh_starts)),
            ("other_namespace_evictions", g(&self.other_namespace_evictions)),
            ("segments_unlinked", g(&self.segments_unlinked)),
            ("internal_errors", g(&self.internal_errors)),
            ("sealed_puts", g(&self.sealed_puts)),
            ("opened_gets", g(&self.opened_gets)),
            ("not_ours_misses", g(&self.not_ours_misses)),
            ("auth_failures", g(&self.auth_failures)),
            ("read_latency_sum_us", g(&self.read_latency_sum_us)),
            ("write_latency_sum_us", g(&self.write_latency_sum_us)),
        ]
    }

    pub fn histogram(hist: &[AtomicU64; 16]) -> Vec<u64> {
        hist.iter().map(|c| c.load(Relaxed)).collect()
    }
}
