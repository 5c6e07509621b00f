"""The standalone manager's disk reads and writes in flight.

A read fills a staging slot the cache gave it (``READING`` until the engine's
verdict: ``READY``, or ``FAILED`` while a load still holds the slot); a write
empties a slot a worker stored into, pinned until the write ends. Writes wait
in a queue and at most ``max_inflight_writes`` are at the engine at once.

Demand reads go to the engine's FIFO class. Preloads (lookahead) and the
gate's exploration samples are read at background priority, promoted to
demand when a lookup or a load needs them (decision 0061), and what they have
at the device is bounded to ``PRELOAD_YIELD_S`` of the device speed the gate
learnt. What a finished read or write means (the metrics, the presence index,
the gate's timing) the disk tier says (:class:`~pykvcache.vllm.scheduler.disk_tier.DiskTier`);
a chunk that reached or left the disk is a KV event
(:class:`~pykvcache.vllm.scheduler.kv_events.KvEvents`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pykvcache._core import chunk_file_bytes
from pykvcache.vllm.scheduler.disk_tier import DiskTier
from pykvcache.vllm.scheduler.gating import ReadStarted
from pykvcache.vllm.scheduler.kv_events import KvEvents
from pykvcache.vllm.scheduler.staging_cache import EntryState, Origin, StagingCache, StagingEntry

if TYPE_CHECKING:
    from pykvcache._core import IoHandle

#: Device time a load may wait behind preloads already at the device: the
#: engine's bound on prefetch bytes in flight is the device speed the gate
#: learnt times this, at least one chunk (decision 0061).
PRELOAD_YIELD_S = 0.003


class DiskIo:
    """The reads and writes between the staging slots of ``cache`` and the
    disk tier's store (read from ``disk`` at each use: a wipe reopens it)."""

    def __init__(
        self, disk: DiskTier, cache: StagingCache, *, payload_bytes: int, max_inflight_writes: int, events: KvEvents | None
    ) -> None:
        self._disk = disk
        self._cache = cache
        self._payload_bytes = payload_bytes
        self._max_inflight_writes = max(1, max_inflight_writes)
        self._events = events
        self.reads: dict[bytes, IoHandle] = {}
        self._read_started: dict[bytes, float] = {}  # key -> when its read was submitted (monotonic s)
        # Keys a lookup answered HIT while their read was in flight, until the read ends.
        self._hit_in_flight: set[bytes] = set()
        self.prefetching: set[bytes] = set()  # keys of reads submitted at background priority
        self.background_budget: int | None = None  # the engine's prefetch byte bound (None: its default)
        self.writes: dict[bytes, IoHandle] = {}
        self.write_queue: list[bytes] = []  # stored in staging, not yet submitted

    def busy(self) -> bool:
        """Reads or writes in flight, or writes queued."""
        return bool(self.reads or self.writes or self.write_queue)

    def writes_pending(self) -> int:
        """Writes queued or in flight: the slots they pin become evictable soon."""
        return len(self.writes) + len(self.write_queue)

    def queued_bytes(self) -> int:
        """Disk I/O a read submitted now waits behind: demand reads and writes
        handed to the engine and not finished (its demand class is FIFO). Not
        I/O that finished but is not collected yet (it is collected at the
        next step: up to a second later under prefill), not the writes still
        queued here (submitted after it) and not prefetches (the engine starts
        a demand read before queued background work). Counting those made
        loads look faster than predicted, and the gate learnt a disk capped
        at 200 MB/s as 0.4-7 GB/s."""
        waiting = sum(1 for key, handle in self.reads.items() if key not in self.prefetching and not handle.done())
        waiting += sum(1 for handle in self.writes.values() if not handle.done())
        return waiting * self._payload_bytes

    # ---------------------------------------------------------------- reads

    def start_read(self, key: bytes, background: bool = False, tenant: bytes = b"") -> StagingEntry | None:
        """Read ``key`` into a new staging slot (a prefetch with ``background``),
        opened for ``tenant`` (tenants.py); None when no slot is free or the
        engine refused the read."""
        entry = self._cache.insert(key, EntryState.READING, Origin.DISK, tenant)
        if entry is None:
            return None
        store = self._disk.store
        try:
            read = store.prefetch if background else store.get
            # Before the call: the engine's latency counts from inside it, so a stamp
            # taken after it returned put the read's end (this + latency) late by the
            # call's own time (a trace showed a read "ending" after its load was done).
            started = time.monotonic()
            self.reads[key] = read(key, entry.slot, tenant=tenant)
            self._read_started[key] = started
            self._disk.gating.observe(ReadStarted(started))
            # The get armed the slot's ready word; the slot stays pinned for
            # it until it ends, so nothing re-arms it before this is read.
            entry.ready_gen = self._disk.pool.ready_state(entry.slot)[0]
            if background:
                self.prefetching.add(key)
        except Exception as exc:  # noqa: BLE001 - submission refused: a miss
            self._disk.submit_refused("read", key, exc)
            self._cache.remove(key)
            return None
        return entry

    def sample(self, keys: Sequence[bytes], tenant: bytes = b"") -> list[bytes]:
        """Start the background reads of an exploration's sample (decision
        0054): preload priority, no owner (a later request may load them),
        into at most half the slots staging could give now, so that a sample
        never takes the room a lookup needs. ``keys`` are chunks the gate plan
        found on disk and not staged in this same call."""
        started = []
        for key in keys[: self._cache.allocatable() // 2]:
            if self.start_read(key, background=True, tenant=tenant) is None:
                break
            started.append(key)
        self._disk.metrics.inc("gate_sample_reads", len(started))
        return started

    def promote(self, key: bytes) -> None:
        """``key`` is needed now: a preload of it still queued is raised to
        demand priority, so it no longer waits behind the other preloads
        (decision 0061). One whose transfers all started stays a preload
        (nothing to move)."""
        if key in self.prefetching and self.reads[key].promote():
            self.prefetching.discard(key)  # a demand read now: a new read waits behind it
            self._disk.metrics.inc("lookahead_promoted_reads")

    def hit_in_flight(self, key: bytes) -> bool:
        """A lookup answered HIT while ``key``'s read is in flight; True the
        first time for this read (vLLM looks a waiting request's chunks up
        again at every scheduling attempt)."""
        first = key not in self._hit_in_flight
        self._hit_in_flight.add(key)
        return first

    def update_background_budget(self) -> None:
        """Bound what preloads have at the device to ``PRELOAD_YIELD_S`` of the
        device speed the gate learnt (at least one chunk), so that a load
        waits at most about that long behind them. Before the gate has timed
        a read (and restored none, 0073), one chunk: the engine's own bound
        counts reads, not bytes, and on a disk capped at 25 MB/s the preloads
        a server started with kept its first demand reads seconds behind them
        (decision 0061). A gate that does not learn keeps the engine's bound."""
        gate = self._disk.gate_snapshot()
        speed = gate.device_bytes_per_s
        floor = chunk_file_bytes(self._payload_bytes)
        if speed is None:
            if not gate.learns_device:
                return
            budget = floor
        else:
            budget = max(floor, int(speed * PRELOAD_YIELD_S))
        if budget != self.background_budget:
            self.background_budget = budget
            self._disk.store.set_background_budget(budget)

    def store_reopened(self) -> None:
        """A wipe opened a new store: it starts with the engine's bound."""
        if self.background_budget is not None:
            self._disk.store.set_background_budget(self.background_budget)

    def poll_read(self, key: bytes) -> None:
        handle = self.reads.get(key)
        if handle is not None and handle.done():
            self._finish_read(key)

    def _finish_read(self, key: bytes) -> None:
        handle = self.reads.pop(key)
        self.prefetching.discard(key)
        answered_in_flight = key in self._hit_in_flight
        self._hit_in_flight.discard(key)
        result = handle.wait()
        if self._disk.read_finished(key, result, started_at=self._read_started.pop(key, None)):
            self._cache.mark_ready(key, Origin.DISK)
            return
        if answered_in_flight:
            # Answered HIT in flight: the engine settled the ready word failed
            # and the worker reports the load failed. Not "held by a load": the
            # failed load may have been reported and released before this poll.
            self._disk.metrics.inc("in_flight_read_failures")
        self._cache.fail(key)
        # The chunk left the disk only when absent or corrupt (decision 0050).
        if result.miss_kind in ("absent", "corrupt") and self._events is not None:
            self._events.left_disk(key)

    # ---------------------------------------------------------------- writes

    def queue_write(self, key: bytes) -> None:
        """A worker stored ``key`` into its slot (pinned until the write ends)."""
        self.write_queue.append(key)

    def submit_writes(self) -> None:
        while self.write_queue and len(self.writes) < self._max_inflight_writes:
            key = self.write_queue.pop(0)
            entry = self._cache.get(key)
            if entry is None:
                continue
            try:
                self.writes[key] = self._disk.store.put(key, entry.slot, self._payload_bytes, tenant=entry.tenant)
            except Exception as exc:  # noqa: BLE001 - the chunk stays in staging only
                self._disk.submit_refused("write", key, exc)
                self._cache.unpin(key)

    def _finish_write(self, key: bytes) -> None:
        handle = self.writes.pop(key)
        if self._disk.write_finished(key, handle.wait()) and self._events is not None:
            # Announced once on disk (not when only in staging): a router may
            # send a request for this prefix to any node sharing the directory.
            self._events.stored(key)
        self._cache.unpin(key)

    # ---------------------------------------------------------------- both

    def poll(self) -> None:
        """Collect finished reads and writes (non-blocking)."""
        for key in [k for k, h in self.reads.items() if h.done()]:
            self._finish_read(key)
        for key in [k for k, h in self.writes.items() if h.done()]:
            self._finish_write(key)

    def flush(self, timeout: float | None = None) -> None:
        """Submit queued writes and wait for every read and write in flight."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.write_queue or self.writes or self.reads:
            self.submit_writes()
            for _key, handle in list(self.writes.items()) + list(self.reads.items()):
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                handle.wait(remaining)
            self.poll()
