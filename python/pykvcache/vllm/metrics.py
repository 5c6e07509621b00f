"""Metrics of the pykvcache manager: declarations for vLLM and the running tally.

vLLM asserts that every metric a manager emits was declared by the spec's
``build_metric_definitions``; both sides are generated from the one table
below so they cannot drift apart. Names carry the ``vllm:`` prefix because
vLLM's Prometheus snapshot (``LLM.get_metrics()``) and its re-registration
cleanup only consider that prefix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

from pykvcache.gate.decision import GATE_COUNTERS, GATE_GAUGES
from pykvcache.gate.store_admission import STORE_COUNTERS

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

PREFIX = "vllm:pykvcache_"

_LATENCY_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0, 5.0)

COUNTERS = {
    "staging_hits": "Lookups answered HIT from staging memory (no disk read needed).",
    "disk_reads": "Chunk reads from disk completed and verified.",
    "disk_read_bytes": "Payload bytes read from disk into staging (verified).",
    "disk_writes": "Chunk writes to disk completed.",
    "disk_write_bytes": "Payload bytes written from staging to disk.",
    "corrupt_chunks": "Chunks that failed verification on read; counted as misses and removed.",
    "vanished_chunks": "Chunks the index listed but the read did not find; counted as misses.",
    "peer_chunks_found": "Chunks published by another engine sharing the directories, found on a lookup.",
    "read_errors": "Chunk reads that failed with an OS error; counted as misses.",
    "write_errors": "Chunk writes that failed (full disk, permissions, ...); the chunk is not kept.",
    "staging_full_misses": "Lookups that found the chunk on disk but no staging slot to read it into.",
    "store_deferred": "prepare_store calls deferred because staging was full (retried next step).",
    "store_truncated_chunks": "Chunks not stored because a request offered more than staging holds.",
    "staging_evictions": "Chunks dropped from staging memory to make room (they stay on disk).",
    "unavailable_reads": "Chunk reads answered as misses because the directory timed out, failed or its circuit breaker was open.",
    "kept_chunks": "Chunk reads answered as misses because the file is another writer's that this engine does not serve (a verify=\"header\" writer's, unknown header flags, larger than a slot, sealed with another key or for another tenant, plaintext where chunks are sealed); the file is kept.",
    "tenant_mismatches": "Lookups answered MISS because staging held the chunk key for another tenant (cache_salt); never served across tenants.",
    # Gate wiring (the gate's own decision counters are merged in below).
    "gate_limited_lookups": "Lookups answered MISS because the gate chose to recompute from that chunk on.",
    "gate_load_observations": "Finished loads fed back to the gate's online load model.",
    "gate_sample_reads": "Chunk reads the gate started in the background to sample the device (an exploration: no request waits for them).",
    "lookup_waited_requests": "Requests whose lookups had to wait for a disk read (HIT_PENDING, or HIT with the worker's copy waiting for the read).",
    "lookup_ready_requests": "Requests whose whole gated prefix was already staged at their first lookup.",
    "lookup_hold_cap_retries": "Lookups answered RETRY because waiting requests already hold their staging share.",
    "lookup_first_contact_retries": "Lookups answered RETRY while the gate timed its first read of the device (at most the request's recompute).",
    "lookups_deferred": "Lookups answered HIT_PENDING or RETRY: each defers its request to a later scheduler step.",
    "lookups_deferred_storing": "Deferred lookups of chunks a worker was still copying into staging (a store in progress).",
    "lookup_in_flight_hits": "Chunks answered HIT while their disk read was in flight (the worker's copy waits for it); each read once, however often it is looked up.",
    "in_flight_read_failures": "Chunks answered HIT in flight whose read then failed (missing, corrupt, error or past the deadline): their load is recomputed.",
    "failed_loads": "Loads the workers reported failed (a chunk not ready in time or its read failed); vLLM recomputed those requests (their later lookups miss).",
    # Lookahead preloading.
    "lookahead_requests_queued": "Requests handed to the lookahead queue at arrival.",
    "lookahead_preload_reads": "Chunk reads started ahead of time for waiting requests.",
    "lookahead_preload_bytes": "Bytes of chunk reads started ahead of time for waiting requests.",
    "lookahead_used_bytes": "Preloaded bytes that a request then loaded from staging.",
    "lookahead_wasted_bytes": "Preloaded bytes dropped from staging before any request loaded them.",
    "lookahead_budget_stops": "Planning passes stopped by the lookahead byte budget.",
    "lookahead_gate_skipped_chunks": "Chunks of waiting requests not preloaded because the gate would recompute them.",
    "lookahead_cancelled_requests": "Requests that left the lookahead queue (finished, aborted) while holding preloads.",
    "lookahead_reclaimed_chunks": "Preload holds given up because a lookup found staging full (the request vLLM schedules now goes first).",
    "lookahead_handed_to_lookups": "Requests whose preload holds were released because vLLM's own lookups reached them.",
    "lookahead_requeued_preempted": "Preempted requests queued for lookahead again (their prefix is staged before they resume).",
    "lookahead_promoted_reads": "Preload reads a lookup or load needed before they started: raised to demand priority (they no longer wait behind other preloads).",
}
COUNTERS.update(GATE_COUNTERS)
COUNTERS.update(STORE_COUNTERS)

GAUGES = {
    "staging_slots_used": "Staging slots holding a chunk (pinned or cached).",
    "staging_slots_pinned": "Staging slots held by in-flight I/O, loads or waiting requests.",
    "staging_slots_total": "Staging slots in the shared region.",
    "disk_used_bytes": "Bytes of chunk files under this namespace.",
    "disk_chunks": "Chunk files under this namespace (filler chunks not counted).",
    "disk_filler_chunks": "Filler chunks (preformat: true) not yet overwritten by real chunks.",
    "disk_recycled_files": "Puts since start that overwrote an evicted chunk's or a filler's file instead of allocating one.",
    "disk_recycle_skipped": "Puts since start whose evicted or filler file was locked or taken when claimed (a reader, a scan, another node): they wrote a fresh file.",
    "disk_background_budget_bytes": "Bytes preloads may have in flight at the device: the device speed the gate learnt times 3 ms, at least one chunk; one chunk until the gate has timed a read (0: a gate that does not learn the device, the engine's own count bound).",
    "disk_capacity_bytes": "Capacity eviction enforces: capacity_bytes, or lower once the filesystem filled up first (ENOSPC).",
    "disk_other_namespace_bytes": "Bytes of other namespaces' chunks in the storage directories (other models or configurations): they count against capacity_bytes and are evicted when stalest.",
    "disk_other_writers": "Other processes (or stores) writing the storage directories now, by their writer leases: while any, the index is refreshed (refresh_interval_s: auto).",
    "lookahead_queue_requests": "Waiting requests known to the lookahead queue.",
    "lookahead_slots_held": "Staging slots held by preloads for waiting requests.",
    "lookup_hold_slots": "Staging slots held by lookups of waiting (not yet scheduled) requests.",
    # A stalled or failing storage directory (engine totals since start).
    "disk_io_timeouts": "Disk reads/writes abandoned past the I/O deadline (a miss / a skipped put).",
    "disk_breaker_opens": "Times a storage directory's circuit breaker opened.",
    "disk_breaker_skipped_gets": "Reads answered as misses at once because the directory's breaker was open.",
    "disk_breaker_skipped_puts": "Writes skipped because the directory's breaker was open.",
    "disk_breaker_open_dirs": "Storage directories whose circuit breaker is open or half-open now.",
    "disk_stuck_ops": "Abandoned disk operations the kernel has not ended yet.",
    "disk_quarantined_slots": "Staging slots held back until abandoned I/O on them really ends.",
}
GAUGES.update(GATE_GAUGES)

HISTOGRAMS = {
    "disk_read_latency_seconds": "Submit-to-completion time of chunk reads.",
    "disk_write_latency_seconds": "Submit-to-completion time of chunk writes.",
}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    defs: dict[str, OffloadingMetricMetadata] = {}
    for name, doc in COUNTERS.items():
        defs[PREFIX + name] = OffloadingCounterMetadata(documentation=doc)
    for name, doc in GAUGES.items():
        defs[PREFIX + name] = OffloadingGaugeMetadata(documentation=doc)
    for name, doc in HISTOGRAMS.items():
        defs[PREFIX + name] = OffloadingHistogramMetadata(documentation=doc, buckets=_LATENCY_BUCKETS)
    return defs


def zero_counter_stats() -> OffloadingConnectorStats:
    """vLLM's stats object with every pykvcache counter increased by 0."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

    stats = OffloadingConnectorStats()
    for name in COUNTERS:
        stats.increase_counter(PREFIX + name, 0)
    return stats


def failed_read_counter(status: str, miss_kind: str | None) -> str:
    """The counter of a chunk read that served nothing, by the engine's verdict
    on its file (``IoResult.status`` and ``miss_kind``)."""
    if status == "error":
        return "read_errors"
    return {"absent": "vanished_chunks", "corrupt": "corrupt_chunks", "kept": "kept_chunks", "unavailable": "unavailable_reads"}.get(
        miss_kind or "", "read_errors"
    )


class ManagerMetrics:
    """Cumulative totals (for :meth:`snapshot`) plus the increments not yet
    handed to vLLM (for :meth:`take_stats`)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self.gauges: dict[str, float] = {}
        # Every counter at 0 in the first report: with the stock
        # OffloadingConnector (no start-up hook) the series then exist from the
        # first engine step on, not only after their first increment.
        self._pending_counters: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self._pending_hist: dict[str, list[float]] = {}
        self._pending_gauges: dict[str, float] = {}

    def inc(self, name: str, value: float = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(f"undeclared counter {name}")
        if value:
            self.totals[name] += value
            self._pending_counters[name] = self._pending_counters.get(name, 0) + value

    def observe(self, name: str, value: float) -> None:
        if name not in HISTOGRAMS:
            raise KeyError(f"undeclared histogram {name}")
        self._pending_hist.setdefault(name, []).append(value)

    def set_gauge(self, name: str, value: float) -> None:
        if name not in GAUGES:
            raise KeyError(f"undeclared gauge {name}")
        if self.gauges.get(name) != value:
            self.gauges[name] = value
            self._pending_gauges[name] = value

    def snapshot(self) -> dict[str, Any]:
        return {**self.totals, **self.gauges}

    def take_stats(self) -> OffloadingConnectorStats | None:
        """Increments since the last call as vLLM's stats object, or None."""
        if not (self._pending_counters or self._pending_hist or self._pending_gauges):
            return None
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        stats = OffloadingConnectorStats()
        for name, value in self._pending_counters.items():
            stats.increase_counter(PREFIX + name, value)
        for name, values in self._pending_hist.items():
            for value in values:
                stats.observe_histogram(PREFIX + name, value)
        for name, value in self._pending_gauges.items():
            stats.set_gauge(PREFIX + name, value)
        self._pending_counters, self._pending_hist, self._pending_gauges = {}, {}, {}
        return stats
