"""Lookahead preloading: stage waiting requests' prefixes before vLLM asks.

vLLM only probes the waiting requests its scheduling loop reaches; when the
running batch is full it probes none, so without lookahead a queued request
starts its disk reads only when it reaches the head, and then waits a step
for them. The connector subclass (:mod:`pykvcache.vllm.connector`) hands
every request's chunk keys to :class:`Preloader` at arrival; at each step end
the preloader starts reads for the head of the queue.

Rules that keep it from thrashing the staging region:

* queue order (priority under the priority policy, then arrival), at most
  ``window`` requests that vLLM has not probed yet: once a request's own
  lookups hold its chunks, its preload holds are handed over (released), so
  the budget goes to the requests behind it;
* every preloaded chunk is held for its request (never evicted) until the
  request is scheduled, finishes or is aborted; held chunks count against
  ``budget_slots`` (shared prefixes are held once);
* a read is started only into a free slot or by evicting a chunk that is not
  an unused preload (a pending load, a store or a held chunk is never
  evictable in the first place);
* the gate runs on preloads too: only what it would load is read.

Preloaded bytes that a request then loads count as used; preloaded chunks
that leave staging before any load used them count as wasted.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from vllm.v1.kv_offload.base import LookupResult

from pykvcache.vllm.scheduler.gating import GateInputs, Gating
from pykvcache.vllm.scheduler.staging_cache import LOOKAHEAD, LOOKUP, EntryState, StagingCache, owner


class PreloadHost(Protocol):
    """What the preloader needs of the scheduler it preloads for (the manager)."""

    @property
    def gating(self) -> Gating:
        """The gate, which says how much of a waiting request a preload reads."""
        ...

    def gate_inputs(self, keys: Sequence[bytes], req_id: Hashable) -> GateInputs:
        """The gate's view of a request's prefix, as the gate gets it for a lookup."""
        ...

    def stage(self, key: bytes, owner: Hashable | None = None, background: bool = False, tenant: bytes = b"") -> LookupResult:
        """Start reading ``key`` into staging for ``tenant``, held for ``owner``; MISS when it cannot."""
        ...


class Counters(Protocol):
    def inc(self, name: str, value: float = 1) -> None: ...


@dataclass(eq=False)
class WaitingRequest:
    req_id: Hashable
    #: Chunk keys per KV cache group, in prompt order.
    key_lists: Sequence[Sequence[bytes]]
    priority: int = 0
    arrival: float = 0.0
    #: Cap on chunks worth loading (vLLM's ``max_load_tokens``), None = no cap.
    max_chunks: int | None = None
    #: Tokens of the prompt already in the device cache (re-evaluated each pass).
    device_cached_tokens: Callable[[], int] | None = None
    #: Whose chunks to preload (its ``cache_salt``: tenants.py).
    tenant: bytes = b""
    #: ``(priority, arrival, insertion)``: its place in the queue (set by ``LookaheadQueue.add``).
    order: tuple[float, ...] = field(default=(), init=False)


class LookaheadQueue:
    """Waiting requests in the scheduler's order: ``(priority, arrival)`` under
    the priority policy, arrival otherwise (ties by insertion)."""

    def __init__(self, *, by_priority: bool = False) -> None:
        self.by_priority = by_priority
        self._order: list[tuple[tuple[float, ...], Hashable]] = []
        self._by_id: dict[Hashable, WaitingRequest] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, req_id: Hashable) -> bool:
        return req_id in self._by_id

    def add(self, req: WaitingRequest) -> None:
        if req.req_id in self._by_id:
            self.remove(req.req_id)
        prio = req.priority if self.by_priority else 0
        req.order = (prio, req.arrival, next(self._seq))
        self._by_id[req.req_id] = req
        bisect.insort(self._order, (req.order, req.req_id))

    def remove(self, req_id: Hashable) -> WaitingRequest | None:
        req = self._by_id.pop(req_id, None)
        if req is not None:
            i = bisect.bisect_left(self._order, (req.order, req_id))
            if i < len(self._order) and self._order[i][1] == req_id:
                del self._order[i]
        return req

    def head(self, n: int) -> list[WaitingRequest]:
        return [self._by_id[rid] for _, rid in self._order[:n]]

    def __iter__(self) -> Iterator[WaitingRequest]:
        return iter(self.head(len(self._order)))


class Preloader:
    """Plans and tracks preloads for ``host`` (the manager): it asks the host
    for the gate's inputs and to stage chunks, and keeps its holds in the
    staging ``cache`` it shares with the host (the one book of who holds what)."""

    def __init__(
        self,
        host: PreloadHost,
        cache: StagingCache,
        metrics: Counters,
        *,
        chunk_bytes: int,
        budget_slots: int,
        window: int,
        chunk_tokens: int,
        by_priority: bool = False,
    ) -> None:
        self.host = host
        self.cache = cache
        self.metrics = metrics
        self.chunk_bytes = chunk_bytes
        self.budget_slots = max(0, budget_slots)
        self.window = max(0, window)
        self.chunk_tokens = chunk_tokens
        self.queue = LookaheadQueue(by_priority=by_priority)
        #: chunks read by a preload that no load has used yet
        self.unused: dict[bytes, None] = {}
        #: scheduled requests, kept until they finish: a preempted one is queued again
        self.running: dict[Hashable, WaitingRequest] = {}
        self.peak_held = 0

    @property
    def enabled(self) -> bool:
        return self.budget_slots > 0 and self.window > 0

    @staticmethod
    def owner(req_id: Hashable) -> tuple[str, Hashable]:
        return owner(LOOKAHEAD, req_id)

    @property
    def held(self) -> frozenset[bytes]:
        """Chunks preloads hold (a shared prefix once); the staging cache keeps the books."""
        return self.cache.keys_held(LOOKAHEAD)

    # -- queue membership ---------------------------------------------------------
    def add(self, req: WaitingRequest) -> None:
        if not self.enabled:
            return
        self.queue.add(req)
        self.metrics.inc("lookahead_requests_queued")

    def forget(self, req_id: Hashable, *, cancelled: bool) -> None:
        """The request left the queue: scheduled (its lookups now hold what it
        needs) or finished/aborted. Its preload holds are released."""
        req = self.queue.remove(req_id)
        if cancelled:
            self.running.pop(req_id, None)
        elif req is not None:
            self.running[req_id] = req
        if req is None:
            return
        holder = self.owner(req_id)
        held_any = bool(self.cache.held_by(holder))
        self.cache.release_owner(holder)
        if cancelled and held_any:
            self.metrics.inc("lookahead_cancelled_requests")

    def preempted(self, req_id: Hashable) -> None:
        """vLLM preempted a running request: its KV blocks are freed and it
        waits again (at the front: its arrival is old), so its prefix is worth
        staging again before it is rescheduled."""
        req = self.running.pop(req_id, None)
        if req is not None and self.enabled:
            self.queue.add(req)
            self.metrics.inc("lookahead_requeued_preempted")

    # -- accounting ---------------------------------------------------------------
    def loaded(self, keys: Iterable[bytes]) -> None:
        chunk = self.chunk_bytes
        for key in keys:
            if key in self.unused:
                del self.unused[key]
                self.metrics.inc("lookahead_used_bytes", chunk)

    def sweep(self) -> None:
        """Count preloads that left staging unused (evicted, failed read, reset)."""
        if not self.unused:
            return
        cache = self.cache
        gone = [key for key in self.unused if key not in cache]
        for key in gone:
            del self.unused[key]
        if gone:
            self.metrics.inc("lookahead_wasted_bytes", len(gone) * self.chunk_bytes)

    def reclaim(self, for_req: Hashable) -> bool:
        """Staging is full and a lookup of ``for_req`` needs a slot: give up
        one unused preload hold of another request so that its slot becomes
        evictable. vLLM probes in queue order, so whoever asks is ahead of
        every request still preloaded; the youngest request yields first, the
        end of its prefix first (never ``for_req``'s own preloads: its next
        lookups want them). False when no preload hold can be given up."""
        cache = self.cache
        for req in reversed(self.queue.head(len(self.queue))):
            if req.req_id == for_req:
                continue
            holder = self.owner(req.req_id)
            held = cache.held_by(holder)
            if not held:
                continue
            for keys in reversed(req.key_lists):
                for key in reversed(keys):
                    entry = cache.get(key) if key in held else None
                    if entry is None or entry.state is not EntryState.READY or entry.pins or entry.owners != {holder}:
                        continue  # in flight, pinned, or shared: freeing it frees nothing
                    cache.release(holder, key)
                    self.metrics.inc("lookahead_reclaimed_chunks")
                    return True
        return False

    def clear(self) -> None:
        for req in list(self.queue):
            self.forget(req.req_id, cancelled=False)
        self.running.clear()
        self.unused.clear()

    # -- planning -----------------------------------------------------------------
    def plan(self) -> None:
        """Start reads for the head of the queue, within budget and window."""
        self.sweep()
        if not self.enabled or not len(self.queue):
            return
        cache = self.cache
        planned = 0
        for req in self.queue:
            if planned >= self.window:
                break
            if cache.held_by(owner(LOOKUP, req.req_id)):
                # vLLM has reached this request: its own lookups hold (and read)
                # what it needs. Preload holds would only re-hold those chunks
                # and spend the budget the requests behind it need.
                if cache.held_by(self.owner(req.req_id)):
                    cache.release_owner(self.owner(req.req_id))
                    self.metrics.inc("lookahead_handed_to_lookups")
                continue
            planned += 1
            skip = 0
            if req.device_cached_tokens is not None:
                skip = max(0, req.device_cached_tokens()) // self.chunk_tokens
            for keys in req.key_lists:
                end = len(keys) if req.max_chunks is None else min(len(keys), skip + req.max_chunks)
                if not self._preload(req.req_id, keys[skip:end], skip * self.chunk_tokens, req.tenant):
                    self.peak_held = max(self.peak_held, self.cache.count_held(LOOKAHEAD))
                    return
        self.peak_held = max(self.peak_held, self.cache.count_held(LOOKAHEAD))

    def _preload(self, req_id: Hashable, keys: Sequence[bytes], start_tokens: int, tenant: bytes) -> bool:
        """Hold or read this request's gated prefix; False when the budget or
        staging stops the pass (later requests must not jump ahead)."""
        cache = self.cache
        wanted = self.host.gating.plan_preload(keys, req_id, self.host.gate_inputs, start_tokens)
        holder = self.owner(req_id)
        for key in keys[:wanted]:
            entry = cache.get(key)
            if entry is not None:
                if entry.tenant != tenant:
                    return False  # another tenant's chunk: its lookup misses here (tenants.py)
                if holder not in entry.owners:
                    # Already staged (another request's preload, a store, a
                    # cached chunk): holding it costs no read, but it counts
                    # against the budget once.
                    if not cache.is_held(key, LOOKAHEAD) and cache.count_held(LOOKAHEAD) >= self.budget_slots:
                        self.metrics.inc("lookahead_budget_stops")
                        return False
                    cache.hold(holder, key)
                continue
            if cache.count_held(LOOKAHEAD) >= self.budget_slots:
                self.metrics.inc("lookahead_budget_stops")
                return False
            if cache.allocatable() == 0:
                return False
            victim = cache.next_victim()
            if victim is not None and victim in self.unused:
                # Taking this slot would throw away another preload before use.
                self.metrics.inc("lookahead_budget_stops")
                return False
            # At background priority: a load the scheduler waits for now goes first.
            if self.host.stage(key, owner=holder, background=True, tenant=tenant) is LookupResult.MISS:
                return False  # no slot, or the read was refused
            self.unused[key] = None
            self.metrics.inc("lookahead_preload_reads")
            self.metrics.inc("lookahead_preload_bytes", self.chunk_bytes)
        return True
