"""Loads whose disk reads are still in flight, advanced by polling
(decision 0065).

A load handed out with in-flight reads (decision 0055) used to wait for
them inside ``submit_load``, which vLLM calls in the engine step: on the
CPU platform every other request's prefill and decode stood still for the
whole read (2 s for a 48 MiB prefix at 25 MB/s), so loading cost the other
requests exactly what the gate (decision 0070) assumes it does not. Now the
worker polls each pending load's ready words without waiting, once per step
(``get_finished``, which vLLM calls every step, also steps with nothing to
compute while a request waits for its KV), and the chunks whose reads have
ended are copied then: the load overlaps the other requests' compute.

The wait is bounded by progress, not by one deadline for the whole load: a
load fails when none of its reads has ended for ``wait_s``. The scheduler's
engine is the judge of a read: its watchdog settles every read it abandons
as failed (a stalled directory: about one I/O deadline), and ``wait_s`` is
the store's ``io_verdict_bound_s``, by when it has settled any read it
started, so this bound only fires if the scheduler process stopped
answering. A slow device whose reads keep ending never fails a load (a
first version bounded the wait by one I/O deadline and failed a load on a
busy CI machine whose reads were slow but moving).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from pykvcache import StagingPool
    from pykvcache.vllm.worker.cpu_copy import Prepared

#: How long :meth:`PendingLoads.wait` sleeps on one read before it looks
#: whether another one ended (about the read of a 2 MiB chunk at 2 GB/s).
WAIT_SLICE_S = 0.001


@dataclass(slots=True)
class PendingLoad:
    job_id: int
    dst_spec: GPULoadStoreSpec
    slots: list[int]
    #: (slot, generation) of the reads not ended yet, in prefix order.
    waiting: list[tuple[int, int]]
    wait_s: float
    start: float  # perf_counter at submit (the transfer time vLLM records)
    #: No read ended after this (the clock's seconds): the load fails. Set
    #: by :meth:`PendingLoads.add` to ``wait_s`` from then.
    deadline: float = 0.0
    #: Slots whose bytes are verified and not copied yet (the staged ones first).
    ready: set[int] = field(default_factory=set)
    prepared: Prepared | None = None  # the copier's per-job index arrays (CPU)
    copied: int = 0


class PendingLoads:
    """Advances loads whose reads are in flight, without ever blocking.

    ``copy_wave(load, slots)`` copies verified chunks into the load's pages as
    they come (None: copy only once all are verified, e.g. one batched CUDA
    copy), ``finish(load)`` completes a load whose chunks are all verified,
    ``fail(load, why)`` a load with a read that failed, was recycled or made
    no progress within ``wait_s``.
    """

    def __init__(
        self,
        pool: StagingPool,
        *,
        finish: Callable[[PendingLoad], None],
        fail: Callable[[PendingLoad, str], None],
        copy_wave: Callable[[PendingLoad, set[int]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._finish = finish
        self._fail = fail
        self._copy_wave = copy_wave
        self._clock = clock
        self._loads: list[PendingLoad] = []

    def __len__(self) -> int:
        return len(self._loads)

    def add(self, load: PendingLoad) -> None:
        """A new load; advanced at once (its staged chunks, reads that ended already)."""
        load.deadline = self._clock() + load.wait_s
        if not self._advance(load):
            self._loads.append(load)

    def poll(self) -> None:
        """Advances every pending load (each step)."""
        if self._loads:
            self._loads = [load for load in self._loads if not self._advance(load)]

    def wait(self, timeout: float) -> None:
        """Sleeps until a read some load waits for ends, at most ``timeout``
        seconds; at once when no load waits. The poll that follows copies it.
        Reads in flight together end in any order (the device serves them
        so): waiting for the first one of the prefix left the chunks that
        ended meanwhile uncopied for the whole ``timeout`` (20 ms), and the
        last of them were copied after the load's last read (decision 0082).
        The pool waits for all the reads it is given, so this waits on the
        oldest one in slices of :data:`WAIT_SLICE_S` and looks at the others
        between them."""
        slots = [s for load in self._loads for s, _ in load.waiting]
        gens = [g for load in self._loads for _, g in load.waiting]
        if not slots:
            return
        end = self._clock() + max(0.0, timeout)
        for _ in range(max(1, math.ceil(timeout / WAIT_SLICE_S))):
            left = end - self._clock()
            if left <= 0:
                return
            if self._pool.wait_ready(slots[:1], gens[:1], min(left, WAIT_SLICE_S))[0] != "timed_out":
                return
            if any(v != "timed_out" for v in self._pool.wait_ready(slots, gens, 0.0)):
                return

    def drop_all(self) -> list[PendingLoad]:
        """Forgets every pending load (shutdown); returns them."""
        loads, self._loads = self._loads, []
        return loads

    def _advance(self, load: PendingLoad) -> bool:
        """One non-blocking look at ``load``'s reads; True once it ended."""
        now = self._clock()
        if load.waiting:
            verdicts = self._pool.wait_ready([s for s, _ in load.waiting], [g for _, g in load.waiting], 0.0)
            ended = [f"slot {s}: {v}" for (s, _), v in zip(load.waiting, verdicts) if v in ("failed", "recycled")]
            fresh = {s for (s, _), v in zip(load.waiting, verdicts) if v == "ready"}
            load.waiting = [(s, g) for (s, g), v in zip(load.waiting, verdicts) if v != "ready"]
            if fresh:
                load.deadline = now + load.wait_s
                load.ready |= fresh
            if ended:
                # The chunks verified before the failure are still copied (a
                # prefix of the pages is right), the rest never: vLLM
                # recomputes the job's blocks either way.
                self._copy(load)
                self._fail(load, ", ".join(ended))
                return True
        if self._copy_wave is not None:
            self._copy(load)
        if load.waiting:
            if now >= load.deadline:
                self._fail(load, f"slot {load.waiting[0][0]}: no read ended within {load.wait_s:.1f} s")
                return True
            return False
        self._finish(load)
        return True

    def _copy(self, load: PendingLoad) -> None:
        if self._copy_wave is not None and load.ready:
            wave, load.ready = load.ready, set()
            self._copy_wave(load, wave)
