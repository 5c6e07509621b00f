"""The break-even gate inside the manager: one decision per request, kept as a plan
(docs/gate.md, "Inside the vLLM manager").

At a request's first lookup its whole key list is known (``request_keys_from``):
the gate decides there how many leading chunks to load, and later lookups of
the request are a set probe of the plan; keys it does not allow are answered
MISS before anything is staged, so a recomputed prefix costs no read. The plan
times the request's reads (the longest submit-to-completion time, what
``fixed + bytes/BW`` predicts), every read times the device's busy periods
(decision 0079), the connector's steps time the prefill side (``StepTimer``),
and nothing is learnt around a storage outage (``OutageFilter``). The rest of
the vLLM side sees it through :class:`~pykvcache.vllm.scheduler.gating.Gating`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pykvcache.gate import AdmissionGate, ChunkState, GateDecision, OutageFilter, StoreAdmission, device_memory
from pykvcache.gate.busy_periods import DeviceBusyPeriods
from pykvcache.gate.request_keys import request_keys_from
from pykvcache.gate.trace import DecisionTrace
from pykvcache.vllm.scheduler.background_save import LatestWriter
from pykvcache.vllm.scheduler.gating import (
    GateEvent,
    GateHooks,
    GateInputs,
    GateInputsOf,
    GateSnapshot,
    ReadEnded,
    ReadStarted,
    RequestDropped,
    Reset,
    StepFinished,
    StepScheduled,
    Tick,
)
from pykvcache.vllm.scheduler.step_timer import StepTimer

if TYPE_CHECKING:
    from pykvcache.vllm.config import PykvcacheConfig

logger = logging.getLogger("vllm.pykvcache." + __name__.rsplit(".", 1)[-1])

#: Requests whose loads are still timed after they were scheduled (each
#: holds its plans until its reads end; the oldest are let go beyond this).
MAX_TIMED_REQUESTS = 256
#: A busy period of the device is cut (and learnt from) after this many
#: chunks were read in it (decision 0079).
BUSY_PERIOD_CHUNKS = 16
#: First contact waits at least this long for the device's first read (a FUSE or
#: network filesystem's first read is tens of ms); past it the request recomputes.
FIRST_CONTACT_S = 0.25
#: The learnt device model is saved at most this often while serving (and at
#: shutdown): a server killed without one keeps what it learnt up to a minute before.
DEVICE_SAVE_EVERY_S = 60.0


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


class GateWiring:
    """The break-even gate as the manager's :class:`~pykvcache.vllm.scheduler.gating.Gating`:
    a plan per request, its reads timed, the device's busy periods, the
    prefill side from the engine's steps, store admission, the saved device
    model and the decision trace."""

    def __init__(
        self,
        gate: AdmissionGate,
        *,
        chunk_tokens: int,
        chunk_bytes: int,
        admission: StoreAdmission | None = None,
        store_min_tokens: int | str = 0,
        hooks: GateHooks | None = None,
        trace: DecisionTrace | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        hooks = GateHooks() if hooks is None else hooks
        self.gate = gate
        # Same cost model and online refinement, separate counters: a
        # preload's decision is not a request's decision.
        self.preload_gate = AdmissionGate(
            gate.model,
            chunk_tokens=gate.chunk_tokens,
            online=gate.online,
            margin=gate.margin,
            enabled=gate.enabled,
            prefill_online=gate.prefill_online,
            behind_weight_cap=gate.behind_weight_cap,
        )
        self.chunk_tokens = chunk_tokens
        self.chunk_bytes = chunk_bytes
        self.admission = admission
        self.store_min_tokens = store_min_tokens
        self.clock = clock
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
        self._skipped_preloads = 0  # chunks preloads did not read: the gate would recompute them
        # A step worth timing prefilled at least one chunk: shorter ones are
        # dominated by per-step overhead, and a chunk is what the gate decides on.
        self.steps = StepTimer(gate.observe_prefill, min_prefill_tokens=chunk_tokens)
        # Every read, preloads included, times the device (decision 0079):
        # periods cut at 16 chunks, so a saturated device still teaches it.
        self.busy = DeviceBusyPeriods(cut_bytes=BUSY_PERIOD_CHUNKS * chunk_bytes)
        # Reads explorations in the background (decision 0054); None: the
        # explored request loads its sample itself.
        self._sampler = hooks.sampler
        self._sample_keys: set[bytes] = set()  # sample reads not ended yet
        self.trace = trace  # gate_trace: every decision, read and lesson
        self._log, self._label = hooks.log, hooks.label
        # ``() -> (breaker_opens, breaker_closes, open_dirs)``; None: nothing to
        # watch. What was learnt within 5 I/O deadlines before a breaker opened
        # is forgotten: it opens after three operations timed out or failed, and
        # the loads that ended meanwhile timed the failing link (plus a step of
        # lag before the gate looks).
        self._breakers = hooks.breakers
        self.outages = OutageFilter(lookback_s=5 * hooks.io_deadline_s)
        self._poll_breakers()
        # The learnt device model, kept beside the namespace (decision 0073):
        # a restart starts from what the last server learnt, not from the prior.
        self._device_file = hooks.device_file
        self._device_writer = LatestWriter("pykvcache-gate-save", hooks.log)
        self._device_saved_at = float("-inf")
        self._device_saved_samples = 0
        if self._device_file is not None:
            self._restore_device(self._device_file)

    # -- the seam (gating.Gating) ----------------------------------------------
    def allows(self, key: bytes, req_context: Any, inputs_of: GateInputsOf) -> bool | None:
        """Whether this lookup's key is in the request's plan (decided at its first lookup);
        None: ask again later (the device's first read is being timed).
        ``inputs_of`` is asked only when a plan is made (once per request, not
        per key: counting queued I/O walks the I/O tables)."""
        plan = self.plan_for(key, req_context, inputs_of)
        return None if plan.retry_until is not None else key in plan.allowed

    def plan_preload(self, keys: Sequence[bytes], req_id: Hashable, inputs_of: GateInputsOf, start_tokens: int = 0) -> int:
        """How many leading ``keys`` of a waiting request the preloader reads.
        Background reading: before the device is timed, a preload reads none
        of it (the request's own plan samples it; a chunk read for a preload
        looks staged to that plan, which would wait for it)."""
        inputs = inputs_of(keys, req_id)
        gate = self.preload_gate
        decision = gate.decide(
            inputs.states,
            start_tokens=start_tokens,
            queued_bytes=inputs.queued_bytes,
            waiting_requests=inputs.waiting_requests,
            sample_in_background=True,
        )
        gate.take_counters()  # a gate of its own: lookups count decisions, preloads not
        self._trace_decision("preload", req_id, inputs, decision)
        self._skipped_preloads += decision.available_chunks - decision.load_chunks
        return decision.load_chunks

    def admit_store(self, keys: Sequence[bytes], req_context: Any) -> int:
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

    def observe(self, event: GateEvent) -> int:
        """What happened; returns how many lessons of the device a read taught."""
        match event:
            case ReadEnded():
                learnt = 0
                if event.started_at is not None:
                    # Before the plans' timing, which a failed read ends.
                    learnt += self._read_ended(event.key, event.started_at, event.latency_s, event.nbytes, timed_out=event.timed_out)
                learnt += self._read_finished(event.key, event.ok, event.latency_s)
                if learnt:
                    self._save_device(every_s=DEVICE_SAVE_EVERY_S)
                return learnt
            case ReadStarted():
                self.busy.read_started(event.at)
            case StepScheduled():
                self.steps.scheduled(event.work)
            case StepFinished():
                self.steps.finished()
            case RequestDropped():
                self._drop(event.req_id)
            case Tick():
                # Once per step: an outage is seen with no load meanwhile.
                self._poll_breakers()
                self._save_device(every_s=DEVICE_SAVE_EVERY_S)
            case Reset():
                self._clear()
        return 0

    def snapshot(self) -> GateSnapshot:
        counters = dict(self.gate.take_counters())
        if self.admission is not None:
            counters.update(self.admission.take_counters())
        if self._skipped_preloads:
            counters["lookahead_gate_skipped_chunks"] = self._skipped_preloads
            self._skipped_preloads = 0
        return GateSnapshot(
            counters=counters,
            gauges=self.gate.gauges(),
            device_bytes_per_s=self.device_bytes_per_s(),
            learns_device=self.gate.online is not None,
        )

    def close(self) -> None:
        # A save stalled longer than this is given up: the model is a hint.
        self._device_writer.flush(timeout=2.0)
        self._save_device(here=True)
        if self.trace is not None:
            self.trace.close()
        self._clear()

    # -- plans ---------------------------------------------------------------
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

    def _trace_decision(self, role: str, req_id: Hashable, inputs: GateInputs, decision: GateDecision) -> None:
        if self.trace is not None:
            self.trace.decided(
                role,
                req_id,
                inputs.states,
                decision,
                queued_bytes=inputs.queued_bytes,
                waiting=inputs.waiting_requests,
                bytes_per_s=self.device_bytes_per_s(),
            )

    def _poll_breakers(self, now: float | None = None) -> None:
        """Look at the breakers (once per plan, per observed load and per
        engine step: a few atomic loads)."""
        if self._breakers is None:
            return
        now = self.clock() if now is None else now
        began, ended = self.outages.update(*self._breakers(), now)
        if began or ended:
            self.gate.storage_outage(began, ended, now, self.outages.lookback_s)

    def plan_for(self, key: bytes, req_context: Any, inputs_of: GateInputsOf) -> Plan:
        """The plan of the lookup's request, made at its first lookup (see the module docstring)."""
        req_id = req_context.req_id
        group = key[-4:]
        plans = self._plans.get(req_id)
        plan = plans.get(group) if plans is not None else None
        again = plan is not None and plan.retry_until is not None
        if plan is not None and key in plan.considered:
            if plan.retry_until is None:
                return plan
            online = self.gate.online
            assert online is not None  # a plan retried is an untimed first contact: an online gate's
            if not (online.timed or self.clock() >= plan.retry_until):
                return plan
        # First lookup of this request (or of a start the old plan did not
        # cover, e.g. after a preemption, or after first contact): decide once
        # for the whole prefix.
        if plan is not None:
            self._stop_timing(req_id, plan)
        keys, start = request_keys_from(req_context, key, self.chunk_tokens)
        inputs = inputs_of(keys, req_id)
        states, queued = inputs.states, inputs.queued_bytes
        if self._sample_keys:
            # A chunk whose sample read is in flight has a staging slot but is
            # not there yet: loading it would wait for that read.
            states = [ChunkState.DISK if s is ChunkState.STAGED and k in self._sample_keys else s for k, s in zip(keys, states)]
        now = self.clock()
        # A breaker that closed since the last look restarts the exploration
        # before this decision.
        self._poll_breakers(now)
        decision = self.gate.decide(
            states,
            start_tokens=start,
            queued_bytes=queued,
            waiting_requests=inputs.waiting_requests,
            now=now,
            sample_in_background=self._sampler is not None,
        )
        self._trace_decision("lookup", req_id, inputs, decision)
        allowed = keys[: decision.load_chunks]
        plan = Plan(considered=frozenset(keys), allowed=frozenset(allowed), decision=decision, started=now, queued_bytes=queued)
        if decision.reason == "untimed" and decision.sample_chunks and not again:
            # First contact (docs/gate.md): the request retries while its first
            # disk chunk is read in the background, at most for its recompute's
            # time (itself a prior: never less than FIRST_CONTACT_S), then is
            # decided again at the speed that read showed.
            plan.retry_until = now + max(decision.est_recompute_s, FIRST_CONTACT_S)
        for k, state in zip(allowed, states):
            if state is ChunkState.DISK:
                plan.awaiting.add(k)
                self._awaited_by.setdefault(k, set()).add(req_id)
        plan.disk_bytes = len(plan.awaiting) * self.chunk_bytes
        self._plans.setdefault(req_id, {})[group] = plan
        # One first-contact read at a time: reads that overlap keep the
        # device's busy period, the lesson they make, from ending.
        if decision.sample_chunks and self._sampler is not None and not (decision.reason == "untimed" and self._sample_keys):
            sample = [
                k for k, state in zip(keys[: decision.sample_chunks], states) if state is ChunkState.DISK and k not in self._sample_keys
            ]
            self._sample_keys.update(self._sampler(sample))
        if self.admission is not None:
            self.admission.sighted(req_id, keys)
        return plan

    def _drop(self, req_id: Hashable) -> None:
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
    def _read_finished(self, key: bytes, ok: bool, latency_s: float) -> int:
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
                    self._poll_breakers(now)
                    if self.outages.learnable(plan.started):
                        self.gate.observe_load(
                            plan.disk_bytes,
                            plan.longest_read_s,
                            queued_bytes=plan.queued_bytes,
                            now=now,
                            explored=plan.decision.reason == "explore",
                        )
                        observed += 1
                        if self.trace is not None:
                            self.trace.learnt(
                                plan.disk_bytes + plan.queued_bytes,
                                plan.longest_read_s,
                                explored=plan.decision.reason == "explore",
                                bytes_per_s=self.device_bytes_per_s(),
                                source="load",
                            )
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

    def _read_ended(self, key: bytes, started_at: float, latency_s: float, nbytes: int, *, timed_out: bool) -> int:
        """The read of ``key`` submitted at ``started_at`` ended after
        ``latency_s``, serving ``nbytes``; returns 1 when it ended (or cut) a
        busy period the gate learnt from (decision 0079; one holding an
        exploration's sample is its measurement, decision 0054). A read that
        ran out of the I/O deadline (``timed_out``) counts as served when it
        was given up: the device is at least that slow (a gate that learnt
        only from served reads kept a profile's 1426 MB/s on a 0.26 MB/s disk)."""
        sample = key in self._sample_keys
        self._sample_keys.discard(key)
        if timed_out:
            latency_s, nbytes = max(latency_s, self.clock() - started_at), self.chunk_bytes
        if self.trace is not None:
            self.trace.read(started_at, latency_s, nbytes, sample=sample)
        period = self.busy.read_ended(
            started_at, latency_s, nbytes, timed_elsewhere=key in self._awaited_by and not timed_out, sample=sample
        )
        if period is None:
            return 0
        now = self.clock()
        self._poll_breakers(now)
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
            self.trace.learnt(nbytes, seconds, explored=sampled, bytes_per_s=self.device_bytes_per_s(), source="period")
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

    def _clear(self) -> None:
        self._plans.clear()
        self._timing.clear()
        self._awaited_by.clear()
        self.steps.clear()
        self.busy.clear()
        self._sample_keys.clear()

    # -- the device model kept for the next start (decision 0073) --------------
    def _restore_device(self, path: Path) -> None:
        """Replay the device model a previous server saved at ``path`` (before anything was learnt)."""
        online = self.gate.online
        restored, why_not = 0, "the gate has learnt the device already"
        if online is None:
            why_not = "the gate does not learn the device (gate_online: false)"
        elif not online.samples:
            restored, reason = device_memory.restore(path, online)
            why_not = reason or ""
        if online is not None and restored:
            self._log.info(
                "%s: the gate starts from the device model saved in %s (%d loads: %.0f MB/s)",
                self._label,
                path,
                restored,
                online.disk_bytes_per_s / 1e6,
            )
        else:
            self._log.debug("%s: no saved device model used (%s)", self._label, why_not)

    def _save_device(self, every_s: float = 0.0, *, here: bool = False) -> None:
        """Save the learnt device model, unless nothing new was learnt since
        the last save, or it was saved less than ``every_s`` ago and the window
        already outweighs the prior. Until it does, every load is saved: those
        are the loads that move the model most, and vLLM's OpenAI server stops
        its engine without a teardown (``--shutdown-timeout 0``, its default,
        force-kills it), so the save at shutdown may never run. Written on the
        writer's thread (background_save.py: never on the scheduler's, decision
        0082), or ``here`` (shutdown)."""
        online, path = self.gate.online, self._device_file
        if path is None or online is None or online.samples == self._device_saved_samples:
            return
        now = self.clock()
        if now - self._device_saved_at < every_s and online.samples > online.prior_weight + 1:
            return
        try:
            if here:
                device_memory.save(path, online)
            else:
                window = online.window()  # taken now, on the scheduler's thread
                self._device_writer.submit(lambda: device_memory.save(path, window))
        except OSError as exc:  # a hint for the next start, never a failure of this one
            self._log.warning("%s: could not save the gate's device model to %s: %s", self._label, path, exc)
            return
        self._device_saved_at, self._device_saved_samples = now, online.samples


def build_gating(
    settings: PykvcacheConfig, hooks: GateHooks, *, model: str, dtype: str, chunk_bytes: int, chunk_tokens: int, steps_timed: bool = False
) -> GateWiring:
    """The break-even gate and store admission for chunks of ``chunk_bytes``
    covering ``chunk_tokens`` tokens (``gate: false`` still builds it, loading
    everything but counting), with the ``hooks`` of the scheduler that owns
    the store (built once it is open: the storage device is read from its
    first directory). ``steps_timed``: the connector reports the engine's
    steps (PyKvCacheConnector), so the prefill side is learnt from them."""
    from pykvcache.gate import ProfileExpectation, build_gate
    from pykvcache.gate.profile import storage_info

    s = settings
    expected = ProfileExpectation(
        model=model,
        dtype=dtype,
        kv_bytes_per_token=chunk_bytes / chunk_tokens,
        chunk_tokens=chunk_tokens,
        storage_device=storage_info(s.storage_dirs[0])["device"],
    )
    gate, source = build_gate(s.gate_profile, expected, online=s.gate_online, margin=s.gate_margin, enabled=s.gate, steps=steps_timed)
    admission = None
    if s.store_min_tokens or s.store_second_sighting:
        # A token count unless "break_even" (the config's check).
        min_tokens = 0 if s.store_min_tokens == "break_even" else cast(int, s.store_min_tokens)
        admission = StoreAdmission(chunk_tokens=chunk_tokens, min_tokens=min_tokens, second_sighting=s.store_second_sighting)
    be = gate.break_even_tokens()
    # The reason for a default cost model was logged as a warning already.
    logger.info(
        "pykvcache gate: %s, cost model from %s, break-even %s tokens%s",
        "on" if s.gate else "off (loads everything, counts)",
        source.split(":", 1)[0],
        "never" if be == float("inf") else f"{be:.0f}",
        f", store admission min_tokens={s.store_min_tokens} second_sighting={s.store_second_sighting}" if admission else "",
    )
    trace = None
    if s.gate_trace:
        try:
            trace = DecisionTrace(s.gate_trace)
            logger.info("pykvcache gate: tracing decisions, reads and learnt periods to %s", s.gate_trace)
        except OSError as exc:  # a diagnostic: serving goes on without it
            logger.warning("pykvcache gate: cannot open gate_trace %s (%s); not tracing", s.gate_trace, exc)
    return GateWiring(
        gate,
        chunk_tokens=chunk_tokens,
        chunk_bytes=chunk_bytes,
        admission=admission,
        store_min_tokens=s.store_min_tokens,
        hooks=hooks,
        trace=trace,
    )
