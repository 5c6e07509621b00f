"""The admission gate inside the manager: one decision per request, kept as a plan.

vLLM asks the manager one key at a time. At the first lookup of a request the
whole key list is known (``request_keys_from``), so the gate decides there how
many leading chunks to load; the plan remembers which keys it allowed, and
later lookups of the same request (this step or the next ones, while reads
complete) are a set probe. Keys the plan does not allow are answered MISS
before anything is staged, so a recomputed prefix costs no disk read.

The plan also times the request's disk reads and feeds the result to the
gate's online model: the load time is the longest submit-to-completion time
among its reads (they are submitted together, at the first lookup), which is
what the calibrated ``fixed + bytes/BW`` predicts. The scheduler step a
request may wait before it sees its reads complete is not learned: it depends
on the step time, not on the device (lookahead preloading hides it). The
store side asks :meth:`GateWiring.admit_store` how many chunks to write.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from pykvcache.gate import AdmissionGate, ChunkState, GateDecision, StoreAdmission
from pykvcache.gate.request_keys import request_keys_from


@dataclass(slots=True)
class Plan:
    considered: frozenset[bytes]
    allowed: frozenset[bytes]
    decision: GateDecision
    started: float
    queued_bytes: int
    #: Chunks that had to come from disk and are not verified in staging yet;
    #: the load is observed once this empties.
    awaiting: set[bytes] = field(default_factory=set)
    disk_bytes: int = 0
    longest_read_s: float = 0.0


class NoGating:
    """The null strategy: every chunk a lookup finds is loaded, every chunk offered is stored."""

    gate = None
    admission = None
    chunk_tokens = 1

    def allows(self, key: bytes, req_context, state_of, queued_bytes: int) -> bool:
        return True

    def preload_gate(self) -> AdmissionGate | None:
        return None

    def drop(self, req_id: Hashable) -> None:
        pass

    def read_finished(self, key: bytes, ok: bool, latency_s: float = 0.0) -> int:
        return 0

    def admit_store(self, keys: Sequence[bytes], req_context) -> int:
        return len(keys)

    def take_counters(self) -> dict[str, float]:
        return {}

    def gauges(self) -> dict[str, float]:
        return {}

    def clear(self) -> None:
        pass


class GateWiring:
    def __init__(self, gate: AdmissionGate, *, chunk_tokens: int, chunk_bytes: int,
                 admission: StoreAdmission | None = None,
                 store_min_tokens: int | str = 0) -> None:
        self.gate = gate
        self.chunk_tokens = chunk_tokens
        self.chunk_bytes = chunk_bytes
        self.admission = admission
        self.store_min_tokens = store_min_tokens
        self._plans: dict[Hashable, dict[bytes, Plan]] = {}  # req -> group -> plan
        self._awaited_by: dict[bytes, set[Hashable]] = {}  # disk key -> requests timing it
        self.observations = 0

    # -- lookups -------------------------------------------------------------
    def allows(self, key: bytes, req_context, state_of: Callable[[bytes], ChunkState],
               queued_bytes: int) -> bool:
        """Whether this lookup's key is in the request's plan (decided at its first lookup)."""
        return key in self.plan_for(key, req_context, state_of, queued_bytes).allowed

    def preload_gate(self) -> AdmissionGate:
        """Same cost model and online refinement, separate counters: a
        preload's decision is not a request's decision."""
        g = self.gate
        return AdmissionGate(g.model, chunk_tokens=g.chunk_tokens, online=g.online,
                             margin=g.margin, enabled=g.enabled)

    def plan_for(self, key: bytes, req_context, state_of: Callable[[bytes], ChunkState],
                 queued_bytes: int) -> Plan:
        req_id = req_context.req_id
        group = key[-4:]
        plans = self._plans.get(req_id)
        plan = plans.get(group) if plans is not None else None
        if plan is not None and key in plan.considered:
            return plan
        # First lookup of this request (or of a start the old plan did not
        # cover, e.g. after a preemption): decide once for the whole prefix.
        if plan is not None:
            self._stop_timing(req_id, plan)
        keys, start = request_keys_from(req_context, key, self.chunk_tokens)
        states = [state_of(k) for k in keys]
        decision = self.gate.decide(states, start_tokens=start, queued_bytes=queued_bytes)
        allowed = keys[: decision.load_chunks]
        plan = Plan(considered=frozenset(keys), allowed=frozenset(allowed), decision=decision,
                    started=time.monotonic(), queued_bytes=queued_bytes)
        for k, state in zip(allowed, states):
            if state is ChunkState.DISK:
                plan.awaiting.add(k)
                self._awaited_by.setdefault(k, set()).add(req_id)
        plan.disk_bytes = len(plan.awaiting) * self.chunk_bytes
        self._plans.setdefault(req_id, {})[group] = plan
        if self.admission is not None:
            self.admission.sighted(req_id, keys)
        return plan

    def plans_of(self, req_id: Hashable) -> list[Plan]:
        return list(self._plans.get(req_id, {}).values())

    def drop(self, req_id: Hashable) -> None:
        for plan in self._plans.pop(req_id, {}).values():
            self._stop_timing(req_id, plan)

    # -- online refinement ----------------------------------------------------
    def read_finished(self, key: bytes, ok: bool, latency_s: float = 0.0) -> int:
        """A disk read completed; returns how many loads were observed."""
        waiters = self._awaited_by.pop(key, None)
        if not waiters:
            return 0
        observed = 0
        for req_id in waiters:
            for plan in self._plans.get(req_id, {}).values():
                if key not in plan.awaiting:
                    continue
                if not ok:
                    # A failed read is a miss, not a slow load: do not learn from it.
                    self._stop_timing(req_id, plan)
                    continue
                plan.awaiting.discard(key)
                plan.longest_read_s = max(plan.longest_read_s, latency_s)
                if not plan.awaiting and plan.disk_bytes:
                    self.gate.observe_load(plan.disk_bytes, plan.longest_read_s,
                                           queued_bytes=plan.queued_bytes)
                    plan.disk_bytes = 0
                    observed += 1
        self.observations += observed
        return observed

    def _stop_timing(self, req_id: Hashable, plan: Plan) -> None:
        for k in plan.awaiting:
            waiters = self._awaited_by.get(k)
            if waiters is not None:
                waiters.discard(req_id)
                if not waiters:
                    del self._awaited_by[k]
        plan.awaiting.clear()
        plan.disk_bytes = 0

    # -- stores ---------------------------------------------------------------
    def admit_store(self, keys: Sequence[bytes], req_context) -> int:
        """How many leading ``keys`` to write (the rest are skipped for good)."""
        if self.admission is None or not keys:
            return len(keys)
        if self.store_min_tokens == "break_even":
            self.admission.min_tokens = self.gate.break_even_tokens()
        positions = getattr(req_context, "_offload_key_positions", None) or {}
        ct = self.chunk_tokens
        # Storable length of the whole request (not just this step's chunks:
        # chunked prefill offers a long prompt's chunks a few at a time).
        tokens = max((p for p in positions.values() if p % ct == 0), default=0)
        if not tokens:
            tokens = len(keys) * ct
        return self.admission.admit(keys, request_tokens=tokens)

    # -- metrics --------------------------------------------------------------
    def take_counters(self) -> dict[str, float]:
        counters = dict(self.gate.take_counters())
        if self.admission is not None:
            counters.update(self.admission.take_counters())
        return counters

    def gauges(self) -> dict[str, float]:
        return self.gate.gauges()

    def clear(self) -> None:
        self._plans.clear()
        self._awaited_by.clear()
