"""The engine's steps, timed for the gate's prefill side: what each step
scheduled (:func:`step_work`, from vLLM's ``SchedulerOutput``) and how long it
took (:class:`StepTimer`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


def step_work(scheduler_output: SchedulerOutput) -> list[tuple[int, int]]:
    """``(computed_tokens, scheduled_tokens)`` of every request a vLLM
    ``SchedulerOutput`` schedules (new, resumed and running ones)."""
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    work = []
    for req in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        n = scheduled.get(req.req_id, 0)
        if n > 0:
            work.append((int(req.num_computed_tokens), int(n)))
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if cached is not None:
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            n = scheduled.get(req_id, 0)
            if n > 0:
                work.append((int(computed), int(n)))
    return work


#: A timed step holds at most one decode per this many prefill tokens (see :class:`StepTimer`).
DECODE_RATIO = 8


class StepTimer:
    """Times engine steps for the prefill side of the gate.

    ``scheduled(work, now)`` when a step is built, ``finished(now)`` when its
    output comes back; a step also ends when the next one is built (vLLM does
    not report outputs with nothing in them), and is timed from whichever is
    later, its build or the previous step's end. Only steps that
    mostly prefilled are observations: at least ``min_prefill_tokens``
    prefill tokens and at most one decode per ``DECODE_RATIO`` of them (a
    decode is priced as one token at its position, which is right for
    compute and bounded in error by that share).
    """

    def __init__(
        self,
        observe: Callable[[Sequence[tuple[int, int]], float], bool],
        *,
        min_prefill_tokens: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._observe = observe
        self.min_prefill_tokens = max(1, min_prefill_tokens)
        self.clock = clock
        self._pending: list[tuple[float, list[tuple[int, int]] | None]] = []  # oldest first
        self._last_end = 0.0
        self.observed = 0

    def qualifies(self, work: Sequence[tuple[int, int]]) -> bool:
        prefill = sum(n for _, n in work if n > 1)
        decodes = sum(1 for _, n in work if n == 1)
        return prefill >= self.min_prefill_tokens and decodes * DECODE_RATIO <= prefill

    def scheduled(self, work: Sequence[tuple[int, int]], now: float | None = None) -> None:
        now = self.clock() if now is None else now
        # A step still pending ends here at the latest: synchronously its
        # output would have come back before this build; with asynchronous
        # scheduling steps are pipelined, so the interval between builds is
        # the step period either way.
        while self._pending:
            self.finished(now)
        self._pending.append((now, list(work) if work and self.qualifies(work) else None))

    def finished(self, now: float | None = None) -> None:
        if not self._pending:
            return
        now = self.clock() if now is None else now
        built, work = self._pending.pop(0)
        began = max(built, self._last_end)
        self._last_end = now
        if work is not None and now > began and self._observe(work, now - began):
            self.observed += 1

    def clear(self) -> None:
        self._pending.clear()
