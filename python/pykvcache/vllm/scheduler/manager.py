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

With a gate (:mod:`pykvcache.vllm.scheduler.gate_plan`, seen through
:class:`~pykvcache.vllm.scheduler.gating.Gating`) the first lookup of a request
decides how many leading chunks to load; keys past that answer MISS without
touching the disk. With lookahead (:mod:`pykvcache.vllm.scheduler.lookahead`, fed by
:class:`pykvcache.vllm.connector.PyKvCacheConnector`) each step end starts
reads for the head of the waiting queue. Lookups of waiting requests hold
their chunks until the request is scheduled; ``lookup_hold_slots`` caps what
*other* waiting requests may hold when a lookup needs a new slot.

The reads and writes in flight are kept by :mod:`pykvcache.vllm.scheduler.disk_io`,
the KV events by :mod:`pykvcache.vllm.scheduler.kv_events`.
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, cast

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from pykvcache.gate import ChunkState
from pykvcache.vllm.layout import ChunkLayout
from pykvcache.vllm.scheduler.disk_io import DiskIo
from pykvcache.vllm.scheduler.disk_tier import DiskTier, UsesDiskTier
from pykvcache.vllm.scheduler.gating import (
    GateInputs,
    GatingFactory,
    RequestDropped,
    Reset,
    StepFinished,
    StepScheduled,
    no_gating,
)
from pykvcache.vllm.scheduler.kv_events import KvEvents
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
from pykvcache.vllm.scheduler.tenants import Tenant, tenant_of
from pykvcache.vllm.scheduler.waiting_queue import WaitingQueue
from pykvcache.vllm.transfer_spec import StagingSlotsSpec

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

    from pykvcache._core import BlockStore, StagingPool
    from pykvcache.preformat import BackgroundPreformat

# Under "vllm." so the messages show up in vLLM's spawned processes, whose
# logging is configured for that namespace only.
logger = logging.getLogger("vllm.pykvcache." + __name__.rsplit(".", 1)[-1])


class NvmeOffloadingManager(UsesDiskTier, OffloadingManager):
    def __init__(
        self,
        *,
        pool: StagingPool,
        store: BlockStore,
        layout: ChunkLayout,
        reopen_store: Callable[[], BlockStore] | None = None,
        enable_events: bool = False,
        max_inflight_writes: int = 64,
        gating: GatingFactory | None = None,
        chunk_tokens: int = 1,  # tokens per chunk: the preloader skips whole chunks the device cache holds
        lookahead_slots: int = 0,
        lookahead_requests: int = 0,
        lookup_hold_slots: int | None = None,
        by_priority: bool = False,
    ) -> None:
        # The store, its staging pool, the gate that learns from its reads,
        # the metrics: the disk side the tier of vLLM's tiering shares. The
        # gate's explorations are read here in the background; the explored
        # request recomputes (decision 0054).
        self.disk = DiskTier(
            store,
            pool,
            gating=gating if gating is not None else no_gating,
            sampler=lambda keys: self.io.sample(keys, self._lookup_tenant),  # during a lookup: its tenant
            log=logger,
            on_learnt=lambda: self.io.update_background_budget(),
        )
        self.layout = layout
        # Creates a fresh store on the same directories (after a wipe).
        self._reopen_store = reopen_store
        self.cache = StagingCache(pool)
        # What ``lock`` returns (vLLM >= 0.33 holds it around manager calls).
        self._lock = threading.RLock()
        # Chunks reaching and leaving the disk, for vLLM's KV events (decision 0037).
        self.events = KvEvents() if enable_events else None
        self.io = DiskIo(
            self.disk, self.cache, payload_bytes=layout.payload_bytes, max_inflight_writes=max_inflight_writes, events=self.events
        )
        self.preloader = Preloader(
            self,
            self.cache,
            self.metrics,
            chunk_bytes=layout.payload_bytes,
            budget_slots=lookahead_slots,
            window=lookahead_requests,
            chunk_tokens=chunk_tokens,
            by_priority=by_priority,
        )
        # Staging that lookups of requests not scheduled yet may hold (the
        # cache knows who holds what: owners ("lookup", req_id)).
        self._lookup_hold_slots = lookup_hold_slots
        self._waited: set[str] = set()  # requests that met HIT_PENDING
        self._recomputing: set[str] = set()  # requests whose load failed (loads_failed)
        self._arrived: ReqContext | None = None  # the last request on_new_request saw (request_tenant)
        self._lookup_tenant = b""  # the tenant of the lookup in progress (the gate's samples)
        # Requests that arrived (or were preempted) and are not scheduled yet:
        # the gate weighs a recompute by how many wait behind it.
        self._waiting = WaitingQueue()
        # Lookups answer HIT for chunks whose reads are in flight (decision
        # 0055); only a connector that reports failed loads to vLLM, under
        # kv_load_failure_policy="recompute", may turn it on.
        self.in_flight_hits = False
        self._preformatter: BackgroundPreformat | None = None  # while one runs
        self._preformat_wanted = False  # start it again after a wipe
        # The preload byte bound from the start: what a restored device model
        # says (0073), or one chunk until the gate has timed a read.
        self.io.update_background_budget()

    def enable_in_flight_hits(self) -> None:
        """Answer HIT for a chunk whose disk read is in flight. The caller
        guarantees that a load the worker reports failed is recomputed by
        vLLM (``PyKvCacheConnector`` with ``kv_load_failure_policy=
        "recompute"``): otherwise a failed read would fail the request."""
        self.in_flight_hits = True

    @property
    def lock(self) -> AbstractContextManager[bool]:
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

    def stage(self, key: bytes, owner: Hashable | None = None, background: bool = False, tenant: bytes = b"") -> LookupResult:
        """Make ``key`` readable from staging: HIT if it already is, HIT_PENDING
        while a store or a read is filling its slot (a read is started here if
        the chunk is on disk; a prefetch with ``background``), MISS if it is
        nowhere or no slot is available. With ``owner`` the staged chunk is held
        for that owner until :meth:`release`. Only ``tenant``'s chunk is
        served (tenants.py)."""
        result = self._stage(key, owner, background, tenant)
        if result is None:
            self.metrics.inc("staging_full_misses")
            return LookupResult.MISS
        return result

    def _stage(self, key: bytes, owner: Hashable | None, background: bool, tenant: bytes) -> LookupResult | None:
        """:meth:`stage`, with None where a read was due and did not start (no slot)."""
        self.io.poll_read(key)
        entry = self.cache.get(key)
        if entry is None:
            if not self.on_disk(key):
                return LookupResult.MISS
            entry = self.io.start_read(key, background, tenant)
            if entry is None:
                return None
        elif entry.tenant != tenant:  # one key, two tenants (a hash or indexing bug): never shared
            self.metrics.inc("tenant_mismatches")
            return LookupResult.MISS
        elif not background:
            self.io.promote(key)
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
        """Disk I/O a read submitted now waits behind (:meth:`DiskIo.queued_bytes`)."""
        return self.io.queued_bytes()

    def waiting_behind(self, req_id: str) -> int:
        """Requests waiting to be scheduled after ``req_id`` (the ones its
        recompute would delay; waiting_queue.py)."""
        return self._waiting.behind(req_id)

    def gate_inputs(self, keys: Sequence[bytes], req_id: Hashable) -> GateInputs:
        """What the gate weighs ``req_id``'s prefix ``keys`` by: asked by the
        gate plan at a request's first lookup and by the preloader."""
        return GateInputs(
            [self.chunk_state(k) for k in keys], self.queued_bytes(), self.waiting_behind(cast(str, req_id))
        )  # vLLM's request ids

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
        self.io.poll()

    def flush(self, timeout: float | None = None) -> None:
        """Submit queued writes and wait for every in-flight I/O."""
        self.io.flush(timeout)

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
        tenant = self._lookup_tenant = tenant_of(req_context)
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
        result = self._stage(key, mine, background=False, tenant=tenant)
        # Staging is full: a lookup may take a slot from a later request's
        # preload (a preload never takes one).
        if result is None and self.preloader.reclaim(for_req=req_id):
            result = self._stage(key, mine, background=False, tenant=tenant)  # a preload gave way
        if result is None:
            self.metrics.inc("staging_full_misses")
            return LookupResult.MISS
        if result is LookupResult.MISS:
            return result
        staged = self.cache.get(key)
        assert staged is not None  # HIT or HIT_PENDING: the chunk has a staging slot
        in_flight = result is LookupResult.HIT_PENDING and self.in_flight_hits and staged.state is EntryState.READING
        if in_flight:
            # The read started (now or earlier) at once; the worker's copy
            # waits for it (prepare_load hands over the ready word's generation).
            # Counted once per read: vLLM looks a waiting request's chunks up
            # again at every scheduling attempt until it is admitted.
            if self.io.hit_in_flight(key):
                self.metrics.inc("lookup_in_flight_hits")
        elif result is not LookupResult.HIT:
            self.metrics.inc("lookups_deferred")
            if staged.state is EntryState.STORING:
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
        self.gating.observe(RequestDropped(req_id))

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        entry = self.cache.get(key)
        if entry is not None and entry.origin is Origin.DISK:
            return CacheHitSource.DISK
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> StagingSlotsSpec:
        slots: list[int] = []
        pinned: list[OffloadKey] = []
        # Per slot: 0 = verified now, > 0 = the worker waits for that
        # generation of the slot's ready word, -1 = failed already.
        generations: list[int] = []
        loader = owner(LOAD, req_context.req_id)
        for key in keys:
            self.io.poll_read(key)
            self.io.promote(key)  # the load waits for it: not behind other preloads
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
            assert entry is not None  # ready or reading
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
        return StagingSlotsSpec(slots, ready_generations=generations, wait_s=self.store.stats()["io_verdict_bound_s"])

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:
            self.cache.touch(key)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        loader = owner(LOAD, req_context.req_id)
        for key in keys:
            self.cache.release(loader, key)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        self.poll_io()
        keys = list(dict.fromkeys(keys))
        # Admission keeps a prefix: a chunk stored after a skipped one could
        # never be loaded.
        keys = keys[: self.gating.admit_store(keys, req_context)]
        new_keys = [key for key in keys if key not in self.cache and not self.store.contains(key)]
        if not new_keys:
            return PrepareStoreOutput(keys_to_store=[], store_spec=StagingSlotsSpec([]), evicted_keys=[])
        available = self.cache.allocatable()
        if available < len(new_keys):
            # Slots held only by disk writes become evictable within a step or
            # two: if that is enough, retry next step (None). Otherwise the
            # batch would never fit whole, so store its leading chunks - the
            # prefix is what gets reused - and skip the rest for good.
            freeing = self.io.writes_pending()
            if available == 0 or len(new_keys) <= available + freeing:
                self.metrics.inc("store_deferred")
                return None
            self.metrics.inc("store_truncated_chunks", len(new_keys) - available)
            new_keys = new_keys[:available]
        evictions_before = self.cache.evictions
        slots, tenant = [], tenant_of(req_context)
        for key in new_keys:
            entry = self.cache.insert(key, EntryState.STORING, Origin.HOST, tenant)
            assert entry is not None, "allocatable() promised a slot"
            slots.append(entry.slot)
        self.metrics.inc("staging_evictions", self.cache.evictions - evictions_before)
        # Chunks leaving staging are still on disk, so no tier lost them:
        # evicted_keys stays empty.
        return PrepareStoreOutput(keys_to_store=new_keys, store_spec=StagingSlotsSpec(slots), evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
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
            self.io.queue_write(key)
            stored.append(key)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._waiting.arrived(req_context.req_id)
        self._arrived = req_context
        return RequestOffloadingContext()

    def request_tenant(self, req_id: str, tenant: bytes) -> None:
        """The request ``on_new_request`` just saw (the connector calls this
        next, for its salt) is ``tenant``'s: its ``ReqContext`` says so (tenants.py)."""
        arrived, self._arrived = self._arrived, None
        if arrived is not None and arrived.req_id == req_id and tenant:
            arrived.set_state(Tenant(tenant))

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
        self.io.submit_writes()
        # After the writes: a preload never takes a slot before the step's
        # stores were handed to the disk.
        self.preloader.plan()

    def step_scheduled(self, work: Sequence[tuple[int, int]]) -> None:
        """The connector built a step scheduling ``work`` ((computed, scheduled) per request).
        A step that hands out a load of reads in flight is timed like any
        other: the worker polls those reads, it never waits for them in the
        step (decision 0065)."""
        self.gating.observe(StepScheduled(work))

    def step_finished(self) -> None:
        """The connector saw the oldest built step's output."""
        self.gating.observe(StepFinished())

    def has_pending_work(self) -> bool:
        return self.io.busy()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is None:
            return ()
        self.poll_io()
        self.events.collect_removed(self.store)
        return self.events.take()

    def reset_cache(self) -> None:
        """Forget everything: staging, pins and (unless ``wipe_on_reset`` is off)
        the chunk files of this namespace. Used after weight updates, when
        every stored KV is stale."""
        self._stop_preformat()
        self.flush()
        if self.events is not None:
            self.events.collect_removed(self.store)
            self.events.wiped(entry.key for entry in self.cache)
        self.preloader.clear()
        self.gating.observe(Reset())
        self._waited.clear()
        self.cache.clear()
        self.io.write_queue.clear()
        if self._reopen_store is not None:
            dirs = list(self.store.namespace_dir)
            self.store.close()
            for directory in dirs:
                shutil.rmtree(directory, ignore_errors=True)
            self.store = self._reopen_store()
            self.io.store_reopened()
            if self._preformat_wanted:
                self.start_background_preformat()

    def get_stats(self) -> OffloadingConnectorStats | None:
        self.poll_io()
        self.preloader.sweep()
        self.metrics.set_gauge("lookahead_queue_requests", len(self.preloader.queue))
        self.metrics.set_gauge("lookahead_slots_held", self.cache.count_held(LOOKAHEAD))
        self.metrics.set_gauge("lookup_hold_slots", self.cache.count_held(LOOKUP))
        self.metrics.set_gauge("staging_slots_pinned", self.cache.pinned_slots())
        self.metrics.set_gauge("disk_background_budget_bytes", self.io.background_budget or 0)
        return self.disk.take_stats(staging_used=len(self.cache), staging_total=self.cache.num_slots)

    def start_background_preformat(self) -> None:
        """Fill the free capacity with filler chunks while serving (``preformat:
        "background"``): one at a time, none while this manager has disk I/O in
        flight or queued. Stopped by ``reset_cache`` and ``shutdown``."""
        from pykvcache.preformat import BackgroundPreformat

        def done(p: BackgroundPreformat) -> None:
            if p.error is not None:
                logger.warning("pykvcache: background preformat stopped after %d filler chunk(s): %s", p.chunks, p.error)
            else:
                logger.info(
                    "pykvcache: background preformat wrote %d filler chunk(s), %.2f GB in %.0f s", p.chunks, p.bytes / 1e9, p.seconds
                )

        self._stop_preformat()
        self._preformat_wanted = True
        self._preformatter = BackgroundPreformat(self.store, self.pool, busy=self.io.busy, on_done=done).start()

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
