"""Per-request decision: how many prefix tokens to load (0 = recompute;
docs/gate.md, "The decision").

The manager hands the gate the states of a request's chunks in prompt order,
from the first chunk the device cache lacks (``STAGED``: the copy remains;
``DISK``: a read behind the queued I/O, then the copy; ``MISSING``: the
loadable prefix ends). One pass evaluates every prefix length up to the
first missing chunk and keeps the one that saves the most; the answer is a
prefix because vLLM can only skip a prompt's leading tokens.

With requests waiting behind (``waiting_requests``) a recompute delays them
all while a load lets the engine compute for others: the recompute side
counts ``1 + waiting`` times, capped at ``behind_weight_cap`` (2), since a
load also queues later loads behind its reads (decision 0070).

Until the device's first read is timed (the online model is not ``timed``;
the prior may be a profile of another device), a caller that reads in the
background commits no request to the disk: the decision loads the staged head
and names the first disk chunk to read (``sample_chunks``, reason ``untimed``)
and the caller decides again once it is timed (``vllm/scheduler/gate_plan.py``).
An :class:`~pykvcache.gate.exploration.Exploration` policy makes the gate load
now and then what it would recompute (reason ``explore``, decision 0054).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from pykvcache.gate.cost_model import CostModel, LoadCost, PrefillCurve
from pykvcache.gate.exploration import MAX_LOAD_RATIO, MAX_SAMPLE_CHUNKS, Exploration
from pykvcache.gate.online import OnlineLoadModel, OnlinePrefillModel


class ChunkState(enum.IntEnum):
    STAGED = 0
    DISK = 1
    MISSING = 2


@dataclass(frozen=True, slots=True)
class GateDecision:
    """The decision and everything it was computed from (for metrics and logs)."""

    load_chunks: int
    load_tokens: int
    #: Chunks that could have been loaded (up to the first missing one).
    available_chunks: int
    staged_chunks: int  # among the chunks chosen
    disk_chunks: int  # among the chunks chosen
    start_tokens: int
    queued_bytes: int
    est_load_s: float  # of the chosen prefix (0 when recomputing)
    est_recompute_s: float  # of the same tokens, or of the whole available prefix when recomputing
    #: "load" | "below_break_even" | "nothing_available" | "gate_disabled" |
    #: "uncalibrated" (loaded because the prefill side is not known yet) |
    #: "explore" (loaded to sample the disk although recompute looked faster) |
    #: "untimed" (the device has not been timed: no read waited for; see the module docstring)
    reason: str
    #: Leading chunks of the prefix whose disk chunks the caller reads in the
    #: background to sample the device (0: none); the request itself follows
    #: ``load_chunks`` (decision 0054).
    sample_chunks: int = 0

    @property
    def recompute(self) -> bool:
        return self.load_chunks == 0

    @property
    def est_saving_s(self) -> float:
        return self.est_recompute_s - self.est_load_s if self.load_chunks else 0.0


#: Counters the gate keeps; the manager declares them as metrics (name -> help).
GATE_COUNTERS = {
    "gate_decisions_load": "Requests for which the gate chose to load a prefix from the KV tier.",
    "gate_decisions_recompute": "Requests with a loadable prefix that the gate chose to recompute.",
    "gate_tokens_loaded": "Prefix tokens the gate chose to load.",
    "gate_tokens_recomputed": "Loadable prefix tokens the gate chose to recompute instead.",
    "gate_est_saved_ms": "Estimated prefill milliseconds saved by the gate's load decisions.",
    "gate_est_lost_ms": "Estimated milliseconds lost by loads slower than recompute (gate disabled, or exploring).",
    "gate_decisions_explore": "Requests for which the gate sampled the disk although it estimated recompute faster: by loading their prefix, or by reading part of it in the background while they recompute.",
    "gate_loads_forgotten": "Loads the gate had learnt from and forgot: a storage directory's circuit breaker opened soon after, or two explored loads in a row showed the device had changed.",
    "gate_loads_ignored": "Finished loads not learnt from: they overlapped a circuit-breaker outage or were the first after one.",
}
GATE_GAUGES = {
    "gate_break_even_tokens": "Current break-even prefix length (tokens, with no I/O queued).",
    "gate_disk_bandwidth_mbps": "Current effective disk bandwidth estimate (MB/s) used by the gate.",
    "gate_fixed_load_ms": "Current fixed cost estimate of one load (ms) used by the gate.",
    "gate_step_load_ms": "Calibrated cost of any load inside the engine (ms; vLLM's asynchronous load step).",
    "gate_disk_step_ms": "Calibrated extra cost of a load from disk inside the engine beyond the read (ms).",
    "gate_prefill_scale": "Observed prefill cost over the prior's (profile or default; 1 before any observation).",
    "gate_prefill_observations": "Engine steps the gate has timed to learn the prefill cost.",
}


class AdmissionGate:
    """Chooses load or recompute per request. ``enabled=False`` loads every
    available prefix (vLLM's behaviour without a gate) but still counts.

    With ``prefill_online`` the prefill side is learnt from timed engine
    steps; while that model is not :attr:`~OnlinePrefillModel.trusted` (no
    profile, too few steps seen) the gate never denies a load: its prior cannot
    tell a slow host from a fast one, and a wrongly denied load costs a
    recompute (seconds on a CPU) where a wrongly allowed one costs at most its
    own load time, for the few requests before the steps are seen."""

    def __init__(
        self,
        model: CostModel,
        *,
        chunk_tokens: int,
        online: OnlineLoadModel | None = None,
        margin: float = 1.0,
        enabled: bool = True,
        prefill_online: OnlinePrefillModel | None = None,
        exploration: Exploration | None = None,
        behind_weight_cap: float = 2.0,
    ) -> None:
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be > 0 (got {chunk_tokens})")
        if not margin > 0:
            raise ValueError(f"margin must be > 0 (got {margin})")
        if not behind_weight_cap >= 1:
            raise ValueError(f"behind_weight_cap must be >= 1 (got {behind_weight_cap})")
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.chunk_bytes = model.bytes_per_token * chunk_tokens
        self.online = online
        self.prefill_online = prefill_online
        self.margin = margin  # load only when recompute > margin * load
        self.behind_weight_cap = behind_weight_cap
        self.enabled = enabled
        # First contact is timed before a prefix is committed to the device only where the
        # prior is a profile, which may be another device's; the default prior never denies a
        # load while uncalibrated (vLLM's behaviour) and is left so (build_gate sets this).
        self.first_contact = True
        # Samples loads while recomputing; useless without an online model to learn from them.
        self.exploration = exploration if online is not None else None
        self.totals: dict[str, float] = dict.fromkeys(GATE_COUNTERS, 0)
        self._pending: dict[str, float] = {}
        self._refined: CostModel | None = None

    def current_model(self) -> CostModel:
        load = self.online.current() if self.online is not None and self.online.samples else self.model.load
        prefill = self.prefill_online.current() if self.prefill_online is not None else self.model.prefill
        if load is self.model.load and prefill is self.model.prefill:
            return self.model
        refined = self._refined
        if refined is None or refined.load is not load or refined.prefill is not prefill:
            # Rebuilt only after an observation changed a side.
            self._refined = refined = CostModel(prefill, load, self.model.bytes_per_token)
        return refined

    @property
    def uncalibrated(self) -> bool:
        """True while the gate does not deny loads (prefill side unknown)."""
        po = self.prefill_online
        return po is not None and po.fed and not po.trusted

    def break_even_tokens(self, queued_bytes: float = 0.0) -> float:
        return self.current_model().break_even_tokens(queued_bytes=queued_bytes)

    def decide(
        self,
        states: Sequence[ChunkState],
        *,
        start_tokens: int = 0,
        queued_bytes: int = 0,
        waiting_requests: int = 0,
        now: float | None = None,
        sample_in_background: bool = False,
    ) -> GateDecision:
        """``waiting_requests``: requests waiting to be scheduled after this one
        (each would wait for a recompute's compute; see the module docstring).
        ``now``: monotonic seconds, for the exploration's interval.
        ``sample_in_background``: the caller reads ``sample_chunks`` without
        the request waiting; an exploration then leaves the request's own
        choice as it is."""
        model = self.current_model()
        load, prefill = model.load, model.prefill
        chunk_bytes = self.chunk_bytes
        copy_per_chunk = chunk_bytes / load.h2d_bytes_per_s
        read_per_chunk = chunk_bytes / load.disk_bytes_per_s
        first_read = load.fixed_s + load.disk_step_s + queued_bytes / load.disk_bytes_per_s
        step = load.step_s  # any load, staged or not

        ct = self.chunk_tokens
        b, c2s = prefill.b, prefill.c * 2 * start_tokens
        c = prefill.c
        # Recompute's cost, for this request and every one waiting behind it,
        # but a load may cost its own request at most behind_weight_cap times
        # its recompute, whatever it saves the others.
        margin = self.margin / min(1 + max(0, waiting_requests), self.behind_weight_cap)
        missing, disk = int(ChunkState.MISSING), int(ChunkState.DISK)
        uncalibrated = self.enabled and self.uncalibrated
        load_always = not self.enabled or uncalibrated

        best_k = best_staged = staged = k = 0
        best_net = best_load = load_s = 0.0
        any_disk = False
        first_disk = 0  # chunks up to and including the first one on disk
        for state in states:
            if state == missing:
                break
            k += 1
            load_s += copy_per_chunk if k > 1 else copy_per_chunk + step
            if state == disk:
                if not any_disk:
                    any_disk = True
                    first_disk = k
                    load_s += first_read
                load_s += read_per_chunk
            else:
                staged += 1
            n = k * ct
            # compute_cost(start, start + n), inlined: this loop is the hot path.
            net = n * (b + c2s + c * n) - margin * load_s
            if net > best_net or load_always:
                best_k, best_net, best_load, best_staged = k, net, load_s, staged
        available = k
        reason = None
        sample_chunks = 0
        ex = self.exploration
        online = self.online
        if (
            sample_in_background
            and self.enabled
            and self.first_contact
            and online is not None
            and not online.timed
            and best_k >= first_disk > 0
        ):
            # First contact: the prior may be another device's (see the module docstring).
            reason = "untimed"
            sample_chunks = first_disk
            head = first_disk - 1
            best_k = head if load_always else self._best_prefix(states, head, load, prefill, start_tokens, queued_bytes, margin)
            best_load, best_staged = self._prefix_load(states, best_k, load, queued_bytes)
        elif ex is not None and not load_always and first_disk > best_k and load is not self.model.load:
            # Nothing chosen comes from disk, so no load would teach the model
            # anything, and the device as learnt is why: as calibrated it
            # would have been loaded. Now and then, sample it (Exploration).
            if now is None:
                now = ex.now()
            if (
                ex.due(now)
                and self._best_prefix(states, available, self.model.load, prefill, start_tokens, queued_bytes, margin) >= first_disk
            ):
                ex.started(now)
                if sample_in_background:
                    sample_chunks = self._sample_prefix(ex, states, first_disk, available, load)
                else:
                    best_k, best_load, best_staged = self._explored_prefix(states, first_disk, available, model, start_tokens, queued_bytes)
                    reason = "explore"
        if best_k:
            reason = reason or ("gate_disabled" if not self.enabled else "uncalibrated" if uncalibrated else "load")
            recompute_s = prefill.compute_cost(start_tokens, start_tokens + best_k * self.chunk_tokens)
        else:
            reason = reason or ("nothing_available" if available == 0 else "below_break_even")
            recompute_s = prefill.compute_cost(start_tokens, start_tokens + available * self.chunk_tokens)
        decision = GateDecision(
            load_chunks=best_k,
            load_tokens=best_k * self.chunk_tokens,
            available_chunks=available,
            staged_chunks=best_staged,
            disk_chunks=best_k - best_staged,
            start_tokens=start_tokens,
            queued_bytes=queued_bytes,
            est_load_s=best_load if best_k else 0.0,
            est_recompute_s=recompute_s,
            reason=reason,
            sample_chunks=sample_chunks,
        )
        self._count(decision)
        return decision

    def _best_prefix(
        self,
        states: Sequence[ChunkState],
        available: int,
        load: LoadCost,
        prefill: PrefillCurve,
        start_tokens: int,
        queued_bytes: int,
        margin: float,
    ) -> int:
        """The prefix (chunks) the decision loop would choose with load cost
        ``load``: for exploring only (rare), so not the inlined hot loop."""
        copy_per_chunk = self.chunk_bytes / load.h2d_bytes_per_s
        read_per_chunk = self.chunk_bytes / load.disk_bytes_per_s
        first_read = load.fixed_s + load.disk_step_s + queued_bytes / load.disk_bytes_per_s
        best_k, best_net, load_s, any_disk = 0, 0.0, 0.0, False
        for k, state in enumerate(states[:available], start=1):
            load_s += copy_per_chunk if k > 1 else copy_per_chunk + load.step_s
            if state == ChunkState.DISK:
                load_s += read_per_chunk + (0.0 if any_disk else first_read)
                any_disk = True
            net = prefill.compute_cost(start_tokens, start_tokens + k * self.chunk_tokens) - margin * load_s
            if net > best_net:
                best_k, best_net = k, net
        return best_k

    def _prefix_load(self, states: Sequence[ChunkState], k: int, load: LoadCost, queued_bytes: int) -> tuple[float, int]:
        """``(est_load_s, staged)`` of the first ``k`` chunks (outside the hot loop)."""
        load_s = load.step_s if k else 0.0
        staged = 0
        for i, state in enumerate(states[:k]):
            load_s += self.chunk_bytes / load.h2d_bytes_per_s
            if state == ChunkState.DISK:
                load_s += self.chunk_bytes / load.disk_bytes_per_s
                if staged == i:  # the first chunk from disk
                    load_s += load.fixed_s + load.disk_step_s + queued_bytes / load.disk_bytes_per_s
            else:
                staged += 1
        return load_s, staged

    def _explored_prefix(
        self, states: Sequence[ChunkState], first_disk: int, available: int, model: CostModel, start_tokens: int, queued_bytes: int
    ) -> tuple[int, float, int]:
        """``(chunks, est_load_s, staged)`` of the longest prefix (at least
        ``first_disk`` chunks) whose estimated load is within
        ``MAX_LOAD_RATIO`` times its recompute. Only when exploring: a second pass
        keeps the hot loop above as it was."""
        load, prefill = model.load, model.prefill
        copy_per_chunk = self.chunk_bytes / load.h2d_bytes_per_s
        read_per_chunk = self.chunk_bytes / load.disk_bytes_per_s
        first_read = load.fixed_s + load.disk_step_s + queued_bytes / load.disk_bytes_per_s
        chosen = (0, 0.0, 0)
        load_s = 0.0
        staged = 0
        for k, state in enumerate(states[:available], start=1):
            load_s += copy_per_chunk if k > 1 else copy_per_chunk + load.step_s
            if state == ChunkState.DISK:
                load_s += read_per_chunk + (first_read if k == first_disk else 0.0)
            else:
                staged += 1
            if k < first_disk:
                continue
            recompute_s = prefill.compute_cost(start_tokens, start_tokens + k * self.chunk_tokens)
            if k == first_disk or load_s <= MAX_LOAD_RATIO * recompute_s:
                chosen = (k, load_s, staged)
        return chosen

    def _sample_prefix(self, ex: Exploration, states: Sequence[ChunkState], first_disk: int, available: int, load: LoadCost) -> int:
        """Chunks of the prefix (from the start) that hold a background sample:
        disk chunks from ``first_disk`` on, until their estimated read at the
        learnt speed reaches the exploration's ``min_sample_s`` or they are
        ``MAX_SAMPLE_CHUNKS`` (decision 0054)."""
        read_per_chunk = self.chunk_bytes / load.disk_bytes_per_s
        disk = 0
        k = first_disk - 1
        for k in range(first_disk - 1, available):
            if states[k] == ChunkState.DISK:
                disk += 1
                if disk >= MAX_SAMPLE_CHUNKS or load.fixed_s + disk * read_per_chunk >= ex.min_sample_s:
                    break
        return k + 1

    def _inc(self, name: str, value: float) -> None:
        self.totals[name] += value
        self._pending[name] = self._pending.get(name, 0) + value

    def _count(self, d: GateDecision) -> None:
        if d.available_chunks == 0:
            return
        if d.sample_chunks and d.reason != "untimed":
            self._inc("gate_decisions_explore", 1)
        if d.reason == "explore":
            self._inc("gate_decisions_explore", 1)
            self._inc("gate_tokens_loaded", d.load_tokens)
            self._inc("gate_est_lost_ms", max(0.0, -d.est_saving_s) * 1e3)
        elif d.load_chunks:
            self._inc("gate_decisions_load", 1)
            self._inc("gate_tokens_loaded", d.load_tokens)
            # Prometheus counters only go up: a load the (disabled) gate would
            # have refused is counted as time lost, not as negative savings.
            if d.est_saving_s >= 0:
                self._inc("gate_est_saved_ms", d.est_saving_s * 1e3)
            else:
                self._inc("gate_est_lost_ms", -d.est_saving_s * 1e3)
        else:
            self._inc("gate_decisions_recompute", 1)
            self._inc("gate_tokens_recomputed", d.available_chunks * self.chunk_tokens)

    def take_counters(self) -> dict[str, float]:
        """Counter increments since the previous call (for ``get_stats``)."""
        pending, self._pending = self._pending, {}
        return pending

    def observe_load(
        self, disk_bytes: float, seconds: float, *, queued_bytes: float = 0.0, now: float | None = None, explored: bool = False
    ) -> None:
        """Feed a finished load back (see :class:`OnlineLoadModel`);
        ``explored``: it was loaded to sample the disk (reason ``explore``)."""
        if self.online is None:
            return
        if explored and self.exploration is not None:
            if now is None:
                now = self.exploration.now()
            predicted = self.online.predict_s(disk_bytes, queued_bytes)
            if self.exploration.sampled(predicted, seconds, now):
                # Two explored loads in a row beat the model: the device
                # changed; what was learnt before them is stale.
                self.online.observe(disk_bytes, seconds, queued_bytes=queued_bytes, now=now, whole=True)
                forgotten = self.online.forget_before(self.exploration.streak_since)
                if forgotten:
                    self._inc("gate_loads_forgotten", forgotten)
                return
        # A request's own exploration (one chunk, loaded by the request) is a
        # lesson however short: pooled, a gate that learnt a slow disk would
        # not see it fast again (decision 0079). Background samples cut short
        # of a burst come here as ordinary lessons (GateWiring.read_ended).
        self.online.observe(disk_bytes, seconds, queued_bytes=queued_bytes, now=now, whole=explored)

    def ignore_load(self) -> None:
        """A finished load that timed a storage outage, not the device (see
        :class:`~pykvcache.gate.outages.OutageFilter`): counted, not learnt."""
        self._inc("gate_loads_ignored", 1)

    def storage_outage(self, began: bool, ended: bool, now: float, lookback_s: float) -> None:
        """A storage directory's breaker opened (``began``: the loads learnt
        within ``lookback_s`` before ``now`` are forgotten) or closed again
        (``ended``: the exploration starts over)."""
        if began and self.online is not None:
            forgotten = self.online.forget_since(now - lookback_s)
            if forgotten:
                self._inc("gate_loads_forgotten", forgotten)
        if ended and self.exploration is not None:
            self.exploration.reset(now)

    def observe_prefill(self, work: Sequence[tuple[int, int]], seconds: float) -> bool:
        """Feed a timed engine step back (see :class:`OnlinePrefillModel`)."""
        return self.prefill_online is not None and self.prefill_online.observe(work, seconds)

    def gauges(self) -> dict[str, float]:
        model = self.current_model()
        po = self.prefill_online
        be = model.break_even_tokens()
        return {
            "gate_break_even_tokens": be if be != float("inf") else -1.0,
            "gate_disk_bandwidth_mbps": model.load.disk_bytes_per_s / 1e6,
            "gate_fixed_load_ms": model.load.fixed_s * 1e3,
            "gate_step_load_ms": model.load.step_s * 1e3,
            "gate_disk_step_ms": model.load.disk_step_s * 1e3,
            "gate_prefill_scale": po.scale if po is not None else 1.0,
            "gate_prefill_observations": po.samples if po is not None else 0,
        }
