"""The gate as the rest of the vLLM side sees it: one strategy behind :class:`Gating`.

The manager, its lookahead preloader and disk I/O, the tiering tier and the
disk tier they share ask the gate three questions (may this lookup load, how
much may a preload read, how much may a store write), tell it what happened
(:meth:`Gating.observe` with one of the events below), read its figures
(:meth:`Gating.snapshot`) and close it. Everything else (the profile, the
decision trace, the background sampler, the breakers, step timing, the saved
device model) is given when it is built (:class:`GateHooks`, and
:func:`~pykvcache.vllm.scheduler.gate_plan.build_gating`). The break-even gate
is :class:`~pykvcache.vllm.scheduler.gate_plan.GateWiring`; :class:`NoGating`
(no gate) loads and stores everything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pykvcache.gate import ChunkState


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
#: asked by the gate when it decides a lookup's request or a preload.
GateInputsOf = Callable[[Sequence[bytes], Hashable], GateInputs]


# -- events ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ReadStarted:
    """A disk read (demand or preload) was submitted at ``at`` (monotonic s)."""

    at: float


@dataclass(frozen=True, slots=True)
class ReadEnded:
    """The read of ``key`` ended: ``ok`` when it served its chunk (``nbytes``),
    after ``latency_s``. ``started_at``: when it was submitted (None where the
    owner does not time its reads); ``timed_out``: it ran out of the I/O deadline."""

    key: bytes
    ok: bool
    latency_s: float
    nbytes: int = 0
    started_at: float | None = None
    timed_out: bool = False


@dataclass(frozen=True, slots=True)
class StepScheduled:
    """The connector built an engine step scheduling ``work`` ((computed, scheduled) tokens per request)."""

    work: Sequence[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class StepFinished:
    """The oldest built step's output came back."""


@dataclass(frozen=True, slots=True)
class RequestDropped:
    """The request was scheduled or finished: the gate's plan for it ends."""

    req_id: Hashable


@dataclass(frozen=True, slots=True)
class Tick:
    """Once per step: look at the store's breakers, save the learnt device model when due."""


@dataclass(frozen=True, slots=True)
class Reset:
    """The cache was reset: plans, reads and steps in flight are forgotten (what was learnt stays)."""


GateEvent = ReadStarted | ReadEnded | StepScheduled | StepFinished | RequestDropped | Tick | Reset


@dataclass(frozen=True, slots=True)
class GateSnapshot:
    """What the gate reports: counter increments since the previous snapshot,
    gauges, and the device as it learnt it."""

    counters: Mapping[str, float] = field(default_factory=dict)
    gauges: Mapping[str, float] = field(default_factory=dict)
    #: The device's read speed learnt from timed reads; None before any (or when not learnt).
    device_bytes_per_s: float | None = None
    #: Whether reads teach the gate the device (an online load model).
    learns_device: bool = False


@dataclass(frozen=True, slots=True)
class GateHooks:
    """What the scheduler that owns the store gives its gate when it is built."""

    #: ``() -> (breaker_opens, breaker_closes, open_dirs)`` (``BlockStore.breaker_health``); None: none.
    breakers: Callable[[], tuple[int, int, int]] | None = None
    #: The store's I/O deadline: what was learnt within 5 of them before a breaker opened is forgotten.
    io_deadline_s: float = 2.0
    #: Where the learnt device model is kept (restored now, saved as it is learnt); None: nowhere.
    device_file: Path | None = None
    #: ``sampler(keys)`` starts background reads of an exploration's sample and returns the keys
    #: it started; None: an explored request loads its sample itself (decision 0054).
    sampler: Callable[[Sequence[bytes]], Sequence[bytes]] | None = None
    log: logging.Logger = logging.getLogger("vllm.pykvcache.gate_plan")
    #: Starts the gate's log lines (``"pykvcache"``, ``"pykvcache tier"``).
    label: str = "pykvcache"


class Gating(Protocol):
    """The one seam between the gate and the rest of the vLLM side (docs/gate.md)."""

    def allows(self, key: bytes, req_context: Any, inputs_of: GateInputsOf) -> bool | None:
        """Whether the lookup of ``key`` loads it (False: MISS; None: ask again later, first contact)."""
        ...

    def plan_preload(self, keys: Sequence[bytes], req_id: Hashable, inputs_of: GateInputsOf, start_tokens: int = 0) -> int:
        """How many leading ``keys`` of a waiting request (from token ``start_tokens``) a preload reads."""
        ...

    def admit_store(self, keys: Sequence[bytes], req_context: Any) -> int:
        """How many leading ``keys`` to write (the rest are skipped for good)."""
        ...

    def observe(self, event: GateEvent) -> int:
        """What happened; returns how many lessons of the device it taught (0 but for reads)."""
        ...

    def snapshot(self) -> GateSnapshot:
        """Counters since the previous snapshot, gauges and the learnt device."""
        ...

    def close(self) -> None:
        """Saves the learnt device model, closes the decision trace, forgets the rest."""
        ...


#: Builds a scheduler's gate once its store is open.
GatingFactory = Callable[[GateHooks], Gating]


class NoGating:
    """No gate: every chunk a lookup or a preload finds is loaded, every chunk offered is stored."""

    def allows(self, key: bytes, req_context: Any, inputs_of: GateInputsOf) -> bool | None:
        return True

    def plan_preload(self, keys: Sequence[bytes], req_id: Hashable, inputs_of: GateInputsOf, start_tokens: int = 0) -> int:
        states = inputs_of(keys, req_id).states
        return next((i for i, s in enumerate(states) if s is ChunkState.MISSING), len(states))

    def admit_store(self, keys: Sequence[bytes], req_context: Any) -> int:
        return len(keys)

    def observe(self, event: GateEvent) -> int:
        return 0

    def snapshot(self) -> GateSnapshot:
        return GateSnapshot()

    def close(self) -> None:
        pass


def no_gating(hooks: GateHooks) -> Gating:
    """The :data:`GatingFactory` of :class:`NoGating`."""
    return NoGating()
