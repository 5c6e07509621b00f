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

Around a storage outage the plan's loads are filtered before they are learnt
(:class:`~pykvcache.gate.outages.OutageFilter`, fed from the store's circuit
breakers by :meth:`GateWiring.watch_breakers`): what a dying or reconnecting
link took to read is not the device's speed (decision 0054).

An exploration (the gate samples a device it learnt as too slow to load
from) is read in the background where the owner can (:meth:`GateWiring.set_sampler`,
the standalone manager): the explored request recomputes, and the busy period
holding the sample's reads is the measurement (decision 0054). Without a
sampler (vLLM's tiering framework owns the tier's reads) the request loads
its explored prefix, as before.

The prefill side is learnt from the engine's own steps (:class:`~pykvcache.vllm.scheduler.step_timer.StepTimer`):
the connector reports each step's scheduled work when it builds the step's
metadata and the step's end when its output comes back (or the next step is
built, whichever is first); a step that mostly prefilled is one observation
for the gate's :class:`~pykvcache.gate.online.OnlinePrefillModel`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from pykvcache.gate import AdmissionGate, ChunkState, GateDecision, OutageFilter, StoreAdmission, device_memory
from pykvcache.gate.busy_periods import DeviceBusyPeriods
from pykvcache.gate.request_keys import request_keys_from
from pykvcache.gate.trace import DecisionTrace
from pykvcache.vllm.scheduler.step_timer import StepTimer

#: Requests whose loads are still timed after they were scheduled (each
#: holds its plans until its reads end; the oldest are let go beyond this).
MAX_TIMED_REQUESTS = 256
#: A busy period of the device is cut (and learnt from) after this many
#: chunks were read in it (decision 0079).
BUSY_PERIOD_CHUNKS = 16
#: First contact waits at least this long for the device's first read (a FUSE or
#: network filesystem's first read is tens of ms); past it the request recomputes.
FIRST_CONTACT_S = 0.25


@dataclass(frozen=True, slots=True)
class GateInputs:
    """What the gate weighs a request's prefix by, as its scheduler sees it now."""

    #: Where each chunk of the prefix is (staged, on disk, missing).
    states: list[ChunkState]
    #: Disk I/O a read submitted now waits behind.
    queued_bytes: int
    #: Requests waiting to be scheduled after this one (a recompute delays them).
    waiting_requests: int = 0


#: ``(keys, req_id) -> GateInputs``: the scheduler's answer for a request's prefix,
#: asked by the gate plan and by the lookahead preloader.
GateInputsOf = Callable[[Sequence[bytes], Hashable], GateInputs]


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
    #: First contact (decision reason ``untimed``): the request is asked to
    #: retry until the device's first read is timed, at most until then.
    retry_until: float | None = None


class NoGating:
    """The null strategy: every chunk a lookup finds is loaded, every chunk offered is stored."""

    gate = None
    admission = None
    chunk_tokens = 1

    def allows(self, key: bytes, req_context, gate_inputs: GateInputsOf) -> bool | None:
        return True

    def preload_gate(self) -> AdmissionGate | None:
        return None

    def drop(self, req_id: Hashable) -> None:
        pass

    def read_finished(self, key: bytes, ok: bool, latency_s: float = 0.0) -> int:
        return 0

    def read_started(self, at: float) -> None:
        pass

    def set_sampler(self, sampler: Callable[[Sequence[bytes]], Sequence[bytes]]) -> None:
        pass

    def read_ended(self, key: bytes, started_at: float, latency_s: float, nbytes: int, *,
                   timed_out: bool = False) -> int:
        return 0

    def watch_breakers(self, health: Callable[[], tuple[int, int, int]], *, io_deadline_s: float) -> None:
        pass

    def device_bytes_per_s(self) -> float | None:
        return None

    def learns_device(self) -> bool:
        return False

    def set_trace(self, trace) -> None:
        pass

    def trace_decision(self, role: str, req_id: Hashable, inputs: GateInputs, decision: GateDecision) -> None:
        pass

    def close_trace(self) -> None:
        pass

    def restore_device(self, path) -> tuple[int, str | None]:
        return 0, "no gate"

    def save_device(self, path, *, every_s: float = 0.0, write=None) -> bool:
        return False

    def poll_breakers(self) -> None:
        pass

    def admit_store(self, keys: Sequence[bytes], req_context) -> int:
        return len(keys)

    def enable_step_timing(self) -> None:
        pass

    def step_scheduled(self, work: Sequence[tuple[int, int]]) -> None:
        pass

    def step_finished(self) -> None:
        pass

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
        # Plans of requests already scheduled or finished whose disk reads are
        # still being timed (oldest first, at most MAX_TIMED_REQUESTS): with
        # lookups answering HIT for reads in flight (decision 0055) a request
        # is scheduled before its reads end, and dropping its timing then left
        # the gate with almost no load to learn the device from (2 per run at
        # 25 MB/s, the prior's 1000 MB/s kept).
        self._timing: OrderedDict[Hashable, list[Plan]] = OrderedDict()
        self.observations = 0
        self.clock: Callable[[], float] = time.monotonic
        # ``() -> (breaker_opens, breaker_closes, open_dirs)``; None: nothing to watch.
        self._breaker_health: Callable[[], tuple[int, int, int]] | None = None
        self.outages = OutageFilter()
        # A step worth timing prefilled at least one chunk: shorter ones are
        # dominated by per-step overhead, and a chunk is what the gate decides on.
        self.steps = StepTimer(gate.observe_prefill, min_prefill_tokens=chunk_tokens)
        # Every read, preloads included, times the device (decision 0079):
        # periods cut at 16 chunks, so a saturated device still teaches it.
        self.busy = DeviceBusyPeriods(cut_bytes=BUSY_PERIOD_CHUNKS * chunk_bytes)
        # Reads explorations in the background (decision 0054); None: the
        # explored request loads its sample itself.
        self._sampler: Callable[[Sequence[bytes]], Sequence[bytes]] | None = None
        self._sample_keys: set[bytes] = set()  # sample reads not ended yet
        # When the device model was last saved, and how many loads it had then.
        self._device_saved_at = float("-inf")
        self._device_saved_samples = 0
        self.trace: DecisionTrace | None = None  # gate_trace: every decision, read and lesson

    def set_trace(self, trace: DecisionTrace | None) -> None:
        """Write every decision, read and learnt busy period to ``trace`` (pykvcache.gate.trace)."""
        self.trace = trace

    def trace_decision(self, role: str, req_id: Hashable, inputs: GateInputs, decision: GateDecision) -> None:
        """A decision made elsewhere (the preloader's) into the trace."""
        if self.trace is not None:
            self.trace.decided(role, req_id, inputs.states, decision, queued_bytes=inputs.queued_bytes,
                               waiting=inputs.waiting_requests, bytes_per_s=self.device_bytes_per_s())

    def close_trace(self) -> None:
        if self.trace is not None:
            self.trace.close()

    def set_sampler(self, sampler: Callable[[Sequence[bytes]], Sequence[bytes]]) -> None:
        """``sampler(keys)`` starts background reads of ``keys`` (chunks this
        plan just found on disk and not staged) into staging and returns the keys it started (each then ends in
        :meth:`read_ended`); from now on an exploration is read by it while
        its request recomputes (decision 0054)."""
        self._sampler = sampler

    # -- lookups -------------------------------------------------------------
    def allows(self, key: bytes, req_context, gate_inputs: GateInputsOf) -> bool | None:
        """Whether this lookup's key is in the request's plan (decided at its first lookup);
        None: ask again later (the device's first read is being timed).
        ``gate_inputs`` is asked only when a plan is made (once per request, not
        per key: counting queued I/O walks the I/O tables)."""
        plan = self.plan_for(key, req_context, gate_inputs)
        return None if plan.retry_until is not None else key in plan.allowed

    def device_bytes_per_s(self) -> float | None:
        """The device's read speed the online load model holds; None before
        it has timed a read (or without an online model). A read pooled into a
        lesson not learnt yet (decision 0079) counts as timed: the speed is
        then still the prior's, as it was after a first load the prior
        outvoted, and the preload bound (0061) follows it."""
        online = self.gate.online
        if online is None or not (online.samples or online.pooled):
            return None
        return online.disk_bytes_per_s

    def learns_device(self) -> bool:
        """Whether reads teach this gate the device (an online load model)."""
        return self.gate.online is not None

    def restore_device(self, path) -> tuple[int, str | None]:
        """Replay the device model a previous server saved at ``path``
        (decision 0073); ``(loads restored, why none were)``."""
        online = self.gate.online
        if online is None:
            return 0, "the gate does not learn the device (gate_online: false)"
        if online.samples:
            return 0, "the gate has learnt the device already"
        return device_memory.restore(path, online)

    def save_device(self, path, *, every_s: float = 0.0,
                    write: Callable[[object, list[tuple[float, float]]], bool] | None = None) -> bool:
        """Save the learnt device model at ``path`` (decision 0073), unless
        nothing new was learnt since the last save, or it was saved less than
        ``every_s`` ago and the window already outweighs the prior. Until it
        does, every load is saved: those are the loads that move the model
        most, and vLLM's OpenAI server stops its engine without a teardown
        (``--shutdown-timeout 0``, its default, force-kills it), so the save
        at shutdown may never run (decision 0073). ``write(path, window)``
        writes the window, taken now, elsewhere (off the scheduler's thread:
        disk_tier.py, decision 0082); None: here."""
        online = self.gate.online
        now = self.clock()
        if online is None or online.samples == self._device_saved_samples:
            return False
        if now - self._device_saved_at < every_s and online.samples > online.prior_weight + 1:
            return False
        saved = device_memory.save(path, online) if write is None else write(path, online.window())
        self._device_saved_at, self._device_saved_samples = now, online.samples
        return saved

    def watch_breakers(self, health: Callable[[], tuple[int, int, int]], *, io_deadline_s: float) -> None:
        """Follow the store's circuit breakers (``BlockStore.breaker_health``).
        What was learnt within 5 I/O deadlines before a breaker opened is
        forgotten: it opens after three operations timed out or failed, and the
        loads that ended meanwhile timed the failing link (plus a step of
        lag before the gate looks)."""
        self._breaker_health = health
        self.outages.lookback_s = 5 * io_deadline_s
        self.poll_breakers()

    def poll_breakers(self, now: float | None = None) -> None:
        """Look at the breakers (once per plan, per observed load and per
        engine step: a few atomic loads)."""
        if self._breaker_health is None:
            return
        now = self.clock() if now is None else now
        began, ended = self.outages.update(*self._breaker_health(), now)
        if began or ended:
            self.gate.storage_outage(began, ended, now, self.outages.lookback_s)

    def preload_gate(self) -> AdmissionGate:
        """Same cost model and online refinement, separate counters: a
        preload's decision is not a request's decision."""
        g = self.gate
        return AdmissionGate(g.model, chunk_tokens=g.chunk_tokens, online=g.online,
                             margin=g.margin, enabled=g.enabled, prefill_online=g.prefill_online,
                             behind_weight_cap=g.behind_weight_cap)

    def plan_for(self, key: bytes, req_context, gate_inputs: GateInputsOf) -> Plan:
        req_id = req_context.req_id
        group = key[-4:]
        plans = self._plans.get(req_id)
        plan = plans.get(group) if plans is not None else None
        again = plan is not None and plan.retry_until is not None
        if plan is not None and key in plan.considered:
            if not again or not (self.gate.online.timed or self.clock() >= plan.retry_until):
                return plan
        # First lookup of this request (or of a start the old plan did not
        # cover, e.g. after a preemption, or after first contact): decide once
        # for the whole prefix.
        if plan is not None:
            self._stop_timing(req_id, plan)
        keys, start = request_keys_from(req_context, key, self.chunk_tokens)
        inputs = gate_inputs(keys, req_id)
        states, queued = inputs.states, inputs.queued_bytes
        if self._sample_keys:
            # A chunk whose sample read is in flight has a staging slot but is
            # not there yet: loading it would wait for that read.
            states = [ChunkState.DISK if s is ChunkState.STAGED and k in self._sample_keys else s
                      for k, s in zip(keys, states)]
        now = self.clock()
        # A breaker that closed since the last look restarts the exploration
        # before this decision.
        self.poll_breakers(now)
        decision = self.gate.decide(states, start_tokens=start, queued_bytes=queued,
                                    waiting_requests=inputs.waiting_requests, now=now,
                                    sample_in_background=self._sampler is not None)
        if self.trace is not None:
            self.trace_decision("lookup", req_id, inputs, decision)
        allowed = keys[: decision.load_chunks]
        plan = Plan(considered=frozenset(keys), allowed=frozenset(allowed), decision=decision,
                    started=now, queued_bytes=queued)
        if decision.reason == "untimed" and decision.sample_chunks and not again:
            # First contact: the request waits while its first chunk on disk
            # is read in the background, then is decided again at the speed
            # that read showed; it waits at most its recompute's time (a
            # device too slow for one chunk in that long is not loaded from).
            # On a fast device that is a scheduler step; a profile of a fast
            # disk served from one capped at 0.26 MB/s committed requests to
            # reads of up to 24 chunks that each waited for the 2 s I/O deadline
            # (2026-12-06, 2-core VM). The recompute estimate is a prior too (a
            # few ms for a CPU host's 1k tokens): never less than FIRST_CONTACT_S.
            plan.retry_until = now + max(decision.est_recompute_s, FIRST_CONTACT_S)
        for k, state in zip(allowed, states):
            if state is ChunkState.DISK:
                plan.awaiting.add(k)
                self._awaited_by.setdefault(k, set()).add(req_id)
        plan.disk_bytes = len(plan.awaiting) * self.chunk_bytes
        self._plans.setdefault(req_id, {})[group] = plan
        # One first-contact read at a time: reads that overlap keep the
        # device's busy period, the lesson they make, from ending.
        if decision.sample_chunks and self._sampler is not None and not (
                decision.reason == "untimed" and self._sample_keys):
            sample = [k for k, state in zip(keys[: decision.sample_chunks], states)
                      if state is ChunkState.DISK and k not in self._sample_keys]
            self._sample_keys.update(self._sampler(sample))
        if self.admission is not None:
            self.admission.sighted(req_id, keys)
        return plan

    def plans_of(self, req_id: Hashable) -> list[Plan]:
        return list(self._plans.get(req_id, {}).values())

    def drop(self, req_id: Hashable) -> None:
        """The request was scheduled or finished: its plans end, but reads
        they wait for keep being timed until they end."""
        timed = [plan for plan in self._plans.pop(req_id, {}).values() if plan.awaiting and plan.disk_bytes]
        if not timed:
            return
        self._timing.setdefault(req_id, []).extend(timed)
        self._timing.move_to_end(req_id)
        while len(self._timing) > MAX_TIMED_REQUESTS:
            # Reads that never came (a lookup that stopped early): not a load.
            old_req, plans = self._timing.popitem(last=False)
            for plan in plans:
                self._stop_timing(old_req, plan)

    # -- online refinement ----------------------------------------------------
    def read_finished(self, key: bytes, ok: bool, latency_s: float = 0.0) -> int:
        """A disk read completed; returns how many loads were observed."""
        waiters = self._awaited_by.pop(key, None)
        if not waiters:
            return 0
        observed = 0
        for req_id in waiters:
            for plan in [*self._plans.get(req_id, {}).values(), *self._timing.get(req_id, ())]:
                if key not in plan.awaiting:
                    continue
                if not ok:
                    # A failed read is a miss, not a slow load: do not learn from it.
                    self._stop_timing(req_id, plan)
                    continue
                plan.awaiting.discard(key)
                plan.longest_read_s = max(plan.longest_read_s, latency_s)
                if not plan.awaiting and plan.disk_bytes:
                    now = self.clock()
                    self.poll_breakers(now)
                    if self.outages.learnable(plan.started):
                        self.gate.observe_load(plan.disk_bytes, plan.longest_read_s,
                                               queued_bytes=plan.queued_bytes, now=now,
                                               explored=plan.decision.reason == "explore")
                        observed += 1
                        if self.trace is not None:
                            self.trace.learnt(plan.disk_bytes + plan.queued_bytes, plan.longest_read_s,
                                              explored=plan.decision.reason == "explore",
                                              bytes_per_s=self.device_bytes_per_s(), source="load")
                    else:
                        self.gate.ignore_load()
                    plan.disk_bytes = 0
            timed = self._timing.get(req_id)
            if timed is not None:
                timed[:] = [p for p in timed if p.awaiting and p.disk_bytes]
                if not timed:
                    del self._timing[req_id]
        self.observations += observed
        return observed

    def read_started(self, at: float) -> None:
        """A disk read (demand or preload) was submitted at ``at`` (monotonic s)."""
        self.busy.read_started(at)

    def read_ended(self, key: bytes, started_at: float, latency_s: float, nbytes: int, *,
                   timed_out: bool = False) -> int:
        """The read of ``key`` submitted at ``started_at`` ended after
        ``latency_s``, serving ``nbytes`` (called before :meth:`read_finished`);
        returns 1 when that ended (or cut) a busy period the gate learnt from
        (decision 0079). A period holding an exploration's sample is that
        exploration's measurement (decision 0054).

        ``timed_out``: the read ran out of the I/O deadline and served
        nothing. It still times the device, which did not deliver the chunk
        in all that time: it counts as the chunk served when it was given up
        (the device is at least that slow), and no plan times it (a failed
        read ends their timing). On a disk capped at 0.26 MB/s no 2 MiB read
        ended within the 2 s deadline, and a gate that learnt only from reads
        that served their chunk timed nothing and kept its profile's 1426 MB/s
        (2026-12-06, 2-core VM)."""
        sample = key in self._sample_keys
        self._sample_keys.discard(key)
        if timed_out:
            latency_s, nbytes = max(latency_s, self.clock() - started_at), self.chunk_bytes
        if self.trace is not None:
            self.trace.read(started_at, latency_s, nbytes, sample=sample)
        period = self.busy.read_ended(started_at, latency_s, nbytes,
                                      timed_elsewhere=key in self._awaited_by and not timed_out, sample=sample)
        if period is None:
            return 0
        now = self.clock()
        self.poll_breakers(now)
        if not self.outages.learnable(period[2]):
            self.gate.ignore_load()
            return 0
        nbytes, seconds, _, sampled = period
        online = self.gate.online
        if sampled and online is not None and not online.beyond_a_burst(nbytes):
            # A sample cut short (staging had room for one chunk): an idle
            # throttle's allowance could serve all of it (one chunk in 2.4 ms
            # on a disk capped at 25 MB/s), so it says nothing of a faster
            # device. An ordinary lesson, pooled (decision 0079).
            sampled = False
        self.gate.observe_load(nbytes, seconds, now=now, explored=sampled)
        self.observations += 1
        if self.trace is not None:
            self.trace.learnt(nbytes, seconds, explored=sampled, bytes_per_s=self.device_bytes_per_s(),
                              source="period")
        return 1

    def _stop_timing(self, req_id: Hashable, plan: Plan) -> None:
        for k in plan.awaiting:
            waiters = self._awaited_by.get(k)
            if waiters is not None:
                waiters.discard(req_id)
                if not waiters:
                    del self._awaited_by[k]
        plan.awaiting.clear()
        plan.disk_bytes = 0

    def enable_step_timing(self) -> None:
        """Steps will be reported: the gate may rely on learning the prefill
        side (and does not deny loads until it has)."""
        if self.gate.prefill_online is not None:
            self.gate.prefill_online.fed = True

    def step_scheduled(self, work: Sequence[tuple[int, int]]) -> None:
        """A step was built with ``work`` (see :func:`step_work`)."""
        self.steps.scheduled(work)

    def step_finished(self) -> None:
        """The oldest built step's output came back."""
        self.steps.finished()

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
        self._timing.clear()
        self._awaited_by.clear()
        self.steps.clear()
        self.busy.clear()
        self._sample_keys.clear()
