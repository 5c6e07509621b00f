"""Scheduler-side OffloadingManager: lookups, staging, and all disk I/O.

Workers only copy between KV pages and staging slots; every disk read and
write happens here, through the Rust engine, into and out of the shared
staging region. Every read is verified before a worker copies from its slot:
either before the lookup answers HIT (the stock connector: vLLM asserts that
transfers succeed, so a missing, corrupt or unreadable chunk turns into a MISS
at lookup time), or, with in-flight hits, by the engine while the worker's
copy waits on the slot's ready word (a failed read is then a failed load that
vLLM recomputes; decision 0055).

Lookup protocol per chunk key:

* HIT          the chunk is verified in staging (READY), or - with in-flight
               hits (:meth:`enable_in_flight_hits`, turned on by
               ``PyKvCacheConnector``) - its disk read is in flight: the
               worker copies the chunk once the slot's ready word says its
               bytes are verified (polled at each step, decision 0065), and a
               read that fails becomes a failed load that vLLM recomputes;
* HIT_PENDING  its disk read is in flight (without in-flight hits), or a
               worker is still copying it in (STORING);
* RETRY        on disk, but waiting requests already hold their share of
               staging (``lookup_hold_slots``): asked again next step;
* MISS         not in staging and not on disk (or no slot to read it into).

Existence is never unknown: the disk index is built when the store opens,
before the engine serves, and each lookup is an index probe.

The methods a lookahead preloader or an admission gate builds on are
:meth:`stage` (start reading a key into staging), :meth:`hold` and
:meth:`release` (keep staged keys for an owner), :meth:`staged_state`,
:meth:`poll_io` and :meth:`allocatable_slots`.

With a gate (:mod:`pykvcache.vllm.scheduler.gate_plan`) the first lookup of a request
decides how many leading chunks to load; keys past that answer MISS without
touching the disk. With lookahead (:mod:`pykvcache.vllm.scheduler.lookahead`, fed by
:class:`pykvcache.vllm.connector.PyKvCacheConnector`) each step end starts
reads for the head of the waiting queue. Lookups of waiting requests hold
their chunks until the request is scheduled; ``lookup_hold_slots`` caps what
*other* waiting requests may hold when a lookup needs a new slot.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Collection, Hashable, Iterable

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from pykvcache._core import chunk_file_bytes
from pykvcache.gate import ChunkState
from pykvcache.vllm.scheduler.disk_tier import DiskTier, UsesDiskTier
from pykvcache.vllm.scheduler.gate_plan import GateInputs, GateWiring, NoGating
from pykvcache.vllm.layout import ChunkLayout
from pykvcache.vllm.scheduler.lookahead import Preloader, WaitingRequest
from pykvcache.vllm.scheduler.staging_cache import (
    LOAD,
    LOOKAHEAD,
    LOOKUP,
    EntryState,
    Origin,
    StagingCache,
    owner,
)
from pykvcache.vllm.transfer_spec import StagingSlotsSpec
from pykvcache.vllm.scheduler.waiting_queue import WaitingQueue

# Under "vllm." so the messages show up in vLLM's spawned processes, whose
# logging is configured for that namespace only.
logger = logging.getLogger("vllm.pykvcache." + __name__.rsplit(".", 1)[-1])

#: Device time a load may wait behind preloads already at the device: the
#: engine's bound on prefetch bytes in flight is the device speed the gate
#: learnt times this, at least one chunk (decision 0061).
PRELOAD_YIELD_S = 0.003



class NvmeOffloadingManager(UsesDiskTier, OffloadingManager):
    def __init__(
        self,
        *,
        pool,
        store,
        layout: ChunkLayout,
        reopen_store=None,
        enable_events: bool = False,
        max_inflight_writes: int = 64,
        gating: GateWiring | None = None,
        lookahead_slots: int = 0,
        lookahead_requests: int = 0,
        lookup_hold_slots: int | None = None,
        by_priority: bool = False,
    ) -> None:
        # The store, its staging pool, the gate that learns from its reads,
        # the metrics: the disk side the tier of vLLM's tiering shares.
        self.disk = DiskTier(store, pool, gating=gating if gating is not None else NoGating(), log=logger,
                             on_learnt=self._update_background_budget)
        self.layout = layout
        # Creates a fresh store on the same directories (after a wipe).
        self._reopen_store = reopen_store
        self.cache = StagingCache(pool)
        # What ``lock`` returns (vLLM >= 0.33 holds it around manager calls).
        self._lock = threading.RLock()
        self._max_inflight_writes = max(1, max_inflight_writes)
        self._reads: dict[bytes, object] = {}  # key -> IoHandle
        self._read_started: dict[bytes, float] = {}  # key -> when its read was submitted (monotonic s)
        # Keys a lookup answered HIT while their read was in flight, until the read ends.
        self._hit_in_flight: set[bytes] = set()
        self._prefetching: set[bytes] = set()  # keys of _reads submitted at background priority
        self._background_budget: int | None = None  # the engine's prefetch byte bound (None: its default)
        self._writes: dict[bytes, object] = {}
        self._write_queue: list[bytes] = []  # stored in staging, not yet submitted
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        # With events: the chunks this node announced as stored, by the hash
        # the engine reports removals with (BlockStore.take_removed), so that
        # every chunk leaving the disk - evicted here, by another node sharing
        # the directory, or found corrupt - is announced as removed, once.
        self._announced: dict[int, bytes] = {}
        self.preloader = Preloader(self, self.cache, self.metrics, chunk_bytes=layout.payload_bytes,
                                   budget_slots=lookahead_slots, window=lookahead_requests,
                                   gate=self.gating.preload_gate(),
                                   chunk_tokens=self.gating.chunk_tokens, by_priority=by_priority)
        # Staging that lookups of requests not scheduled yet may hold (the
        # cache knows who holds what: owners ("lookup", req_id)).
        self._lookup_hold_slots = lookup_hold_slots
        self._waited: set[str] = set()  # requests that met HIT_PENDING
        self._recomputing: set[str] = set()  # requests whose load failed (loads_failed)
        # Requests that arrived (or were preempted) and are not scheduled yet:
        # the gate weighs a recompute by how many wait behind it.
        self._waiting = WaitingQueue()
        # Lookups answer HIT for chunks whose reads are in flight (decision
        # 0055); only a connector that reports failed loads to vLLM, under
        # kv_load_failure_policy="recompute", may turn it on.
        self.in_flight_hits = False
        self._preformatter = None  # BackgroundPreformat while one runs
        self._preformat_wanted = False  # start it again after a wipe
        # The gate's explorations are read here in the background; the
        # explored request recomputes (decision 0054).
        self.gating.set_sampler(self._sample_reads)
        # The preload byte bound from the start: what a restored device model
        # says (0073), or one chunk until the gate has timed a read.
        self._update_background_budget()

    def enable_in_flight_hits(self) -> None:
        """Answer HIT for a chunk whose disk read is in flight. The caller
        guarantees that a load the worker reports failed is recomputed by
        vLLM (``PyKvCacheConnector`` with ``kv_load_failure_policy=
        "recompute"``): otherwise a failed read would fail the request."""
        self.in_flight_hits = True

    @property
    def lock(self):
        """Held by vLLM >= 0.33 around every manager call. A property there
        (no setter), so it is one here too. The background preformat thread
        reads the I/O tables, so a real (re-entrant) lock, not a no-op."""
        return self._lock

    # ------------------------------------------------------------------
    # Building blocks (also for a preloader / admission gate)
    # ------------------------------------------------------------------
    def staged_state(self, key: bytes) -> EntryState | None:
        entry = self.cache.get(key)
        return None if entry is None else entry.state

    def allocatable_slots(self) -> int:
        return self.cache.allocatable()

    def on_disk(self, key: bytes) -> bool:
        """In the index, or published since by another engine sharing the
        directories (:class:`~pykvcache.vllm.scheduler.disk_presence.DiskPresence`)."""
        return self.disk.on_disk(key)

    def stage(self, key: bytes, owner: Hashable | None = None, background: bool = False) -> LookupResult:
        """Make ``key`` readable from staging: HIT if it already is, HIT_PENDING
        while a store or a read is filling its slot (a read is started here if
        the chunk is on disk; a prefetch with ``background``), MISS if it is
        nowhere or no slot is available. With ``owner`` the staged chunk is held
        for that owner until :meth:`release`."""
        result = self._stage(key, owner, background)
        if result is None:
            self.metrics.inc("staging_full_misses")
            return LookupResult.MISS
        return result

    def _stage(self, key: bytes, owner: Hashable | None, background: bool) -> LookupResult | None:
        """:meth:`stage`, with None where a read was due and did not start (no slot)."""
        self._poll_read(key)
        entry = self.cache.get(key)
        if entry is None:
            if not self.on_disk(key):
                return LookupResult.MISS
            entry = self._start_read(key, background)
            if entry is None:
                return None
        elif not background and key in self._prefetching:
            self._promote(key)
        if entry.state is EntryState.FAILED:
            return LookupResult.MISS  # its read failed; a load still holds the slot
        if owner is not None:
            self.cache.hold(owner, key)
        if entry.state is EntryState.READY:
            self.cache.touch(key)
            return LookupResult.HIT
        return LookupResult.HIT_PENDING

    def chunk_state(self, key: bytes) -> ChunkState:
        """The gate's view of a chunk: anything with a staging slot (verified,
        or being read or stored) costs no further disk read."""
        if key in self.cache:
            return ChunkState.STAGED
        return ChunkState.DISK if self.on_disk(key) else ChunkState.MISSING

    def queued_bytes(self) -> int:
        """Disk I/O a read submitted now waits behind: demand reads and writes
        handed to the engine and not finished (its demand class is FIFO). Not
        I/O that finished but is not collected yet (it is collected at the
        next step: up to a second later under prefill), not the writes still
        queued here (submitted after it) and not prefetches (the engine starts
        a demand read before queued background work). Counting those made
        loads look faster than predicted, and the gate learnt a disk capped
        at 200 MB/s as 0.4-7 GB/s."""
        waiting = sum(1 for key, handle in self._reads.items()
                      if key not in self._prefetching and not handle.done())
        waiting += sum(1 for handle in self._writes.values() if not handle.done())
        return waiting * self.layout.payload_bytes

    def trace_decision(self, role, req_id, inputs, decision) -> None:
        """The preloader's decisions into the gate's trace (``gate_trace``)."""
        self.gating.trace_decision(role, req_id, inputs, decision)

    def waiting_behind(self, req_id) -> int:
        """Requests waiting to be scheduled after ``req_id`` (the ones its
        recompute would delay; waiting_queue.py)."""
        return self._waiting.behind(req_id)

    def gate_inputs(self, keys, req_id) -> GateInputs:
        """What the gate weighs ``req_id``'s prefix ``keys`` by: asked by the
        gate plan at a request's first lookup and by the preloader."""
        return GateInputs([self.chunk_state(k) for k in keys], self.queued_bytes(),
                          self.waiting_behind(req_id))

    def lookahead_add(self, request: WaitingRequest) -> None:
        """A request arrived (lookahead connector): queue it and plan at once,
        so its reads can start before the scheduler's next probe."""
        self.preloader.add(request)
        self.preloader.plan()

    def hold(self, owner: Hashable, key: bytes) -> None:
        self.cache.hold(owner, key)

    def release(self, owner: Hashable) -> None:
        self.cache.release_owner(owner)

    def poll_io(self) -> None:
        """Collect finished reads and writes (non-blocking)."""
        for key in [k for k, h in self._reads.items() if h.done()]:
            self._finish_read(key)
        for key in [k for k, h in self._writes.items() if h.done()]:
            self._finish_write(key)

    def flush(self, timeout: float | None = None) -> None:
        """Submit queued writes and wait for every in-flight I/O."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._write_queue or self._writes or self._reads:
            self._submit_writes()
            for _key, handle in list(self._writes.items()) + list(self._reads.items()):
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                handle.wait(remaining)
            self.poll_io()

    # ------------------------------------------------------------------
    # OffloadingManager API
    # ------------------------------------------------------------------
    def loads_failed(self, req_ids: Iterable[str]) -> None:
        """vLLM recomputes these requests (their loads failed): each lookup of
        theirs misses until they finish. A load again would deadlock a small
        KV cache: vLLM 0.32's scheduler keeps a request whose asynchronous load
        failed among its in-flight prefills, whose reservation (every block of
        the request) every later asynchronous admission must fit beside, its
        own included; a recompute is admitted without it and ends it."""
        self._recomputing.update(req_ids)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        req_id = req_context.req_id
        if req_id in self._recomputing:
            return LookupResult.MISS
        mine = owner(LOOKUP, req_id)
        allowed = self.gating.allows(key, req_context, self.gate_inputs)
        if allowed is None:
            # The gate times the device's first read before it decides
            # (bounded by the request's recompute: gate_plan.py).
            self.metrics.inc("lookup_first_contact_retries")
            self.metrics.inc("lookups_deferred")
            return LookupResult.RETRY
        if not allowed:
            self.metrics.inc("gate_limited_lookups")
            return LookupResult.MISS
        entry_before = self.cache.get(key)
        if entry_before is None and self._lookup_hold_slots is not None:
            # A new slot for a waiting request while other waiting requests
            # already hold their share: ask again later (RETRY defers the
            # request without holding anything). Not MISS: vLLM would schedule
            # it at once and recompute a prefix that is on disk. The holders
            # are requests whose reads are in flight; they get scheduled and
            # release their holds, so the retry resolves.
            others = self.cache.count_held(LOOKUP) - len(self.cache.held_by(mine))
            if others >= self._lookup_hold_slots and self.store.contains(key):
                self.metrics.inc("lookup_hold_cap_retries")
                self.metrics.inc("lookups_deferred")
                return LookupResult.RETRY
        result = self._stage(key, mine, background=False)
        # Staging is full: a lookup may take a slot from a later request's
        # preload (a preload never takes one).
        if result is None and self.preloader.reclaim(for_req=req_id):
            result = self._stage(key, mine, background=False)  # a preload gave way
        if result is None:
            self.metrics.inc("staging_full_misses")
            return LookupResult.MISS
        if result is LookupResult.MISS:
            return result
        in_flight = result is LookupResult.HIT_PENDING and self.in_flight_hits \
            and self.cache.get(key).state is EntryState.READING
        if in_flight:
            # The read started (now or earlier) at once; the worker's copy
            # waits for it (prepare_load hands over the ready word's generation).
            # Counted once per read: vLLM looks a waiting request's chunks up
            # again at every scheduling attempt until it is admitted.
            if key not in self._hit_in_flight:
                self.metrics.inc("lookup_in_flight_hits")
                self._hit_in_flight.add(key)
        elif result is not LookupResult.HIT:
            self.metrics.inc("lookups_deferred")
            if self.cache.get(key).state is EntryState.STORING:
                # Stored by a worker this step or the last: readable once its
                # copy completes (what is left of deferrals with in-flight hits).
                self.metrics.inc("lookups_deferred_storing")
        if result is LookupResult.HIT_PENDING:
            # The request waits for a disk read: a scheduler step (deferred)
            # or, in flight, its worker's copy.
            if req_id not in self._waited:
                self._waited.add(req_id)
                self.metrics.inc("lookup_waited_requests")
            if in_flight:
                return LookupResult.HIT
        elif entry_before is not None and entry_before.state is EntryState.READY:
            self.metrics.inc("staging_hits")
        return result

    def _release_request(self, req_id: str, *, finished: bool) -> None:
        """The request was scheduled or finished: its lookup holds, preload holds
        and gate plan end (a pending load pins what it still needs)."""
        self.cache.release_owner(owner(LOOKUP, req_id))
        self._waited.discard(req_id)
        self._waiting.left(req_id)
        self.preloader.forget(req_id, cancelled=finished)
        self.gating.drop(req_id)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        entry = self.cache.get(key)
        if entry is not None and entry.origin is Origin.DISK:
            return CacheHitSource.DISK
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext):
        slots = []
        pinned = []
        # Per slot: 0 = verified now, > 0 = the worker waits for that
        # generation of the slot's ready word, -1 = failed already.
        generations = []
        loader = owner(LOAD, req_context.req_id)
        for key in keys:
            self._poll_read(key)
            if key in self._prefetching:
                self._promote(key)  # the load waits for it: not behind other preloads
            entry = self.cache.get(key)
            ready = entry is not None and entry.state is EntryState.READY
            reading = entry is not None and entry.state is EntryState.READING and entry.ready_gen > 0
            if not ready and not (self.in_flight_hits and reading):
                if self.in_flight_hits:
                    # Answered HIT while its read was in flight, and the read
                    # failed since (counted by _finish_read): the worker reports
                    # this load failed and vLLM recomputes (nothing is copied).
                    slots.append(entry.slot if entry is not None else 0)
                    generations.append(-1)
                    continue
                # The connector only loads keys this manager answered HIT for,
                # and held keys are never evicted; reaching this is a bug.
                for done in pinned:
                    self.cache.release(loader, done)
                raise RuntimeError(f"prepare_load of chunk {key.hex()} that is not staged")
            # Held until complete_load: the slot is never recycled while a
            # worker may wait on it or copy from it.
            self.cache.hold(loader, key)
            pinned.append(key)
            slots.append(entry.slot)
            generations.append(0 if ready else entry.ready_gen)
        self.preloader.loaded(pinned)
        if pinned and req_context.req_id not in self._waited:
            self.metrics.inc("lookup_ready_requests")
        # The request is being scheduled: what it held for lookups is now
        # either pinned for this load or not needed any more.
        self._release_request(req_context.req_id, finished=False)
        if not any(generations):
            return StagingSlotsSpec(slots)
        return StagingSlotsSpec(slots, ready_generations=generations,
                                wait_s=self.store.stats()["io_verdict_bound_s"])

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:
            self.cache.touch(key)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        loader = owner(LOAD, req_context.req_id)
        for key in keys:
            self.cache.release(loader, key)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        self.poll_io()
        keys = list(dict.fromkeys(keys))
        # Admission keeps a prefix: a chunk stored after a skipped one could
        # never be loaded.
        keys = keys[: self.gating.admit_store(keys, req_context)]
        new_keys = [
            key for key in keys
            if key not in self.cache and not self.store.contains(key)
        ]
        if not new_keys:
            return PrepareStoreOutput(keys_to_store=[], store_spec=StagingSlotsSpec([]),
                                      evicted_keys=[])
        available = self.cache.allocatable()
        if available < len(new_keys):
            # Slots held only by disk writes become evictable within a step or
            # two: if that is enough, retry next step (None). Otherwise the
            # batch would never fit whole, so store its leading chunks - the
            # prefix is what gets reused - and skip the rest for good.
            freeing = len(self._writes) + len(self._write_queue)
            if available == 0 or len(new_keys) <= available + freeing:
                self.metrics.inc("store_deferred")
                return None
            self.metrics.inc("store_truncated_chunks", len(new_keys) - available)
            new_keys = new_keys[:available]
        evictions_before = self.cache.evictions
        slots = []
        for key in new_keys:
            entry = self.cache.insert(key, EntryState.STORING, Origin.HOST)
            assert entry is not None, "allocatable() promised a slot"
            slots.append(entry.slot)
        self.metrics.inc("staging_evictions", self.cache.evictions - evictions_before)
        # Chunks leaving staging are still on disk, so no tier lost them:
        # evicted_keys stays empty.
        return PrepareStoreOutput(
            keys_to_store=new_keys, store_spec=StagingSlotsSpec(slots), evicted_keys=[]
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        stored = []
        for key in keys:
            entry = self.cache.get(key)
            if entry is None or entry.state is not EntryState.STORING:
                continue
            if not success:
                self.cache.remove(key)
                continue
            self.cache.pin(key)  # held until the disk write completes
            self.cache.mark_ready(key, Origin.HOST)
            self._write_queue.append(key)
            stored.append(key)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._waiting.arrived(req_context.req_id)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._recomputing.discard(req_context.req_id)
        self._release_request(req_context.req_id, finished=True)

    def on_request_resumed(self, req_id: str) -> None:
        """A preempted request was scheduled again (vLLM reports it among the
        cached requests, not the new ones): as for a newly scheduled request."""
        self._release_request(req_id, finished=False)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        for req_id in context.new_req_ids:
            self._release_request(req_id, finished=False)
        for req_id in getattr(context, "preempted_req_ids", None) or ():
            self._waiting.preempted(req_id)
            self.preloader.preempted(req_id)
        self.poll_io()
        self._submit_writes()
        # After the writes: a preload never takes a slot before the step's
        # stores were handed to the disk.
        self.preloader.plan()

    def step_scheduled(self, work) -> None:
        """The connector built a step scheduling ``work`` ((computed, scheduled) per request).
        A step that hands out a load of reads in flight is timed like any
        other: the worker polls those reads, it never waits for them in the
        step (decision 0065)."""
        self.gating.step_scheduled(work)

    def step_finished(self) -> None:
        """The connector saw the oldest built step's output."""
        self.gating.step_finished()

    def has_pending_work(self) -> bool:
        return bool(self._reads or self._writes or self._write_queue)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            return ()
        self.poll_io()
        self._collect_removed()
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        """Forget everything: staging, pins and (unless ``wipe_on_reset`` is off)
        the chunk files of this namespace. Used after weight updates, when
        every stored KV is stale."""
        self._stop_preformat()
        self.flush()
        self._collect_removed()
        removed = list(dict.fromkeys([entry.key for entry in self.cache] + list(self._announced.values())))
        self._announced.clear()
        self.preloader.clear()
        self.gating.clear()
        self._waited.clear()
        self.cache.clear()
        self._write_queue.clear()
        if self._reopen_store is not None:
            dirs = list(self.store.namespace_dir)
            self.store.close()
            for directory in dirs:
                shutil.rmtree(directory, ignore_errors=True)
            self.store = self._reopen_store()
            if self._background_budget is not None:
                self.store.set_background_budget(self._background_budget)
            if self._preformat_wanted:
                self.start_background_preformat()
        self._emit(removed, removed=True)

    def get_stats(self):
        self.poll_io()
        self.preloader.sweep()
        self.metrics.set_gauge("lookahead_queue_requests", len(self.preloader.queue))
        self.metrics.set_gauge("lookahead_slots_held", self.cache.count_held(LOOKAHEAD))
        self.metrics.set_gauge("lookup_hold_slots", self.cache.count_held(LOOKUP))
        self.metrics.set_gauge("staging_slots_pinned", self.cache.pinned_slots())
        self.metrics.set_gauge("disk_background_budget_bytes", self._background_budget or 0)
        return self.disk.take_stats(staging_used=len(self.cache), staging_total=self.cache.num_slots)

    def start_background_preformat(self) -> None:
        """Fill the free capacity with filler chunks while serving (``preformat:
        "background"``): one at a time, none while this manager has disk I/O in
        flight or queued. Stopped by ``reset_cache`` and ``shutdown``."""
        from pykvcache.preformat import BackgroundPreformat

        def busy() -> bool:
            return bool(self._reads or self._writes or self._write_queue)

        def done(p: BackgroundPreformat) -> None:
            if p.error is not None:
                logger.warning("pykvcache: background preformat stopped after %d filler chunk(s): %s",
                               p.chunks, p.error)
            else:
                logger.info("pykvcache: background preformat wrote %d filler chunk(s), %.2f GB in %.0f s",
                            p.chunks, p.bytes / 1e9, p.seconds)

        self._stop_preformat()
        self._preformat_wanted = True
        self._preformatter = BackgroundPreformat(self.store, self.pool, busy=busy, on_done=done).start()

    def _stop_preformat(self) -> None:
        if self._preformatter is not None:
            self._preformatter.stop()
            self._preformatter = None

    def shutdown(self) -> None:
        """Persist what was stored (pending writes complete), then unmap."""
        self.disk.shutdown(self._drain)

    def _drain(self) -> None:
        self._stop_preformat()
        try:
            self.flush(timeout=60.0)
        except Exception:  # noqa: BLE001 - shutting down anyway; say what was lost
            logger.exception("pykvcache: not every pending chunk write completed")
        self.cache.clear()

    # ------------------------------------------------------------------
    # Internals
    # ------------------------------------------------------------------
    def _start_read(self, key: bytes, background: bool = False):
        entry = self.cache.insert(key, EntryState.READING, Origin.DISK)
        if entry is None:
            return None
        try:
            read = self.store.prefetch if background else self.store.get
            self._reads[key] = read(key, entry.slot)
            started = time.monotonic()
            self._read_started[key] = started
            self.gating.read_started(started)
            # The get armed the slot's ready word; the slot stays pinned for
            # it until it ends, so nothing re-arms it before this is read.
            entry.ready_gen = self.pool.ready_state(entry.slot)[0]
            if background:
                self._prefetching.add(key)
        except Exception as exc:  # noqa: BLE001 - submission refused: a miss
            self.disk.submit_refused("read", key, exc)
            self.cache.remove(key)
            return None
        return entry

    def _sample_reads(self, keys) -> list[bytes]:
        """Start the background reads of an exploration's sample (decision
        0054): preload priority, no owner (a later request may load them),
        into at most half the slots staging could give now, so that a sample
        never takes the room a lookup needs. ``keys`` are chunks the gate plan
        found on disk and not staged in this same call."""
        started = []
        for key in keys[: self.cache.allocatable() // 2]:
            if self._start_read(key, background=True) is None:
                break
            started.append(key)
        self.metrics.inc("gate_sample_reads", len(started))
        return started

    def _promote(self, key: bytes) -> None:
        """A preload still queued is needed now: raise it to demand priority,
        so it no longer waits behind the other preloads (decision 0061). One
        whose transfers all started stays a preload (nothing to move)."""
        if self._reads[key].promote():
            self._prefetching.discard(key)  # a demand read now: a new read waits behind it
            self.metrics.inc("lookahead_promoted_reads")

    def _update_background_budget(self) -> None:
        """Bound what preloads have at the device to ``PRELOAD_YIELD_S`` of the
        device speed the gate learnt (at least one chunk), so that a load
        waits at most about that long behind them. Before the gate has timed
        a read (and restored none, 0073), one chunk: the engine's own bound
        counts reads, not bytes, and on a disk capped at 25 MB/s the preloads
        a server started with kept its first demand reads seconds behind them
        (decision 0061). A gate that does not learn keeps the engine's bound."""
        speed = self.gating.device_bytes_per_s()
        floor = chunk_file_bytes(self.layout.payload_bytes)
        if speed is None:
            if not self.gating.learns_device():
                return
            budget = floor
        else:
            budget = max(floor, int(speed * PRELOAD_YIELD_S))
        if budget != self._background_budget:
            self._background_budget = budget
            self.store.set_background_budget(budget)

    def _poll_read(self, key: bytes) -> None:
        handle = self._reads.get(key)
        if handle is not None and handle.done():
            self._finish_read(key)

    def _finish_read(self, key: bytes) -> None:
        handle = self._reads.pop(key)
        self._prefetching.discard(key)
        answered_in_flight = key in self._hit_in_flight
        self._hit_in_flight.discard(key)
        result = handle.wait()
        if self.disk.read_finished(key, result, started_at=self._read_started.pop(key, None)):
            self.cache.mark_ready(key, Origin.DISK)
            return
        if answered_in_flight:
            # Answered HIT in flight: the engine settled the ready word failed
            # and the worker reports the load failed. Not "held by a load": the
            # failed load may have been reported and released before this poll.
            self.metrics.inc("in_flight_read_failures")
        self.cache.fail(key)
        # The chunk left the disk only when absent or corrupt (decision 0050).
        if result.miss_kind in ("absent", "corrupt") and self._events is not None \
                and self._announced.pop(self._key_hash(key), None) is not None:
            self._emit([key], removed=True)

    def _submit_writes(self) -> None:
        while self._write_queue and len(self._writes) < self._max_inflight_writes:
            key = self._write_queue.pop(0)
            entry = self.cache.get(key)
            if entry is None:
                continue
            try:
                self._writes[key] = self.store.put(key, entry.slot, self.layout.payload_bytes)
            except Exception as exc:  # noqa: BLE001 - the chunk stays in staging only
                self.disk.submit_refused("write", key, exc)
                self.cache.unpin(key)

    def _finish_write(self, key: bytes) -> None:
        handle = self._writes.pop(key)
        if self.disk.write_finished(key, handle.wait()):
            # Announced once on disk (not when only in staging): a router may
            # send a request for this prefix to any node sharing the directory.
            self._emit([key], removed=False)
        self.cache.unpin(key)

    @staticmethod
    def _key_hash(key: bytes) -> int:
        from pykvcache._core import key_hash

        return key_hash(bytes(key))

    def _collect_removed(self) -> None:
        """Announces the chunks the engine's index lost since the last call
        (capacity evictions, chunks another node removed, corrupt files) among
        those this node announced as stored."""
        if self._events is None:
            return
        hashes, dropped = self.store.take_removed()
        if dropped:
            logger.warning("pykvcache: %d chunk removals were not announced as KV events (log full)", dropped)
        keys = [k for k in (self._announced.pop(h, None) for h in hashes) if k is not None]
        self._emit(keys, removed=True)

    def _emit(self, keys: list[bytes], *, removed: bool) -> None:
        if self._events is not None and keys and not removed:
            for key in keys:
                self._announced[self._key_hash(key)] = bytes(key)
        if self._events is not None and keys:
            self._events.append(
                OffloadingEvent(keys=list(keys), medium=Medium.STORAGE, removed=removed,
                                locality=Locality.LOCAL)
            )

