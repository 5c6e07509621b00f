"""A trace of the gate's view, one JSON object per line (``gate_trace`` key).

Counters say how many loads the gate chose, not which request was priced how,
when, behind what: a trace replays every decision (a request's first lookup
or a preload) with the states and queue it saw, and every read and lesson, on
one monotonic clock. Each line is flushed (vLLM's default stop SIGKILLs the
engine); a write failure is logged once and ends the trace, never serving.
Records:

* ``{"t", "ev": "decide", "role": "lookup"|"preload", "req", "staged", "disk",
  "missing", "first_disk", "queued_mb", "waiting", "load", "disk_load", "reason",
  "sample", "est_load_s", "est_recompute_s", "mbps"}``
* ``{"t", "ev": "read", "started", "latency_s", "mb", "sample"}``
* ``{"t", "ev": "learn", "from": "period"|"load", "mb", "s", "explored", "mbps"}``
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Hashable, Sequence
from typing import IO, Any

from pykvcache.gate.decision import ChunkState, GateDecision

logger = logging.getLogger(__name__)


class DecisionTrace:
    def __init__(self, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = os.fspath(path)
        self.clock = clock
        self._t0 = clock()
        self._out: IO[str] | None = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._write({"ev": "start", "pid": os.getpid(), "unix": time.time()})

    def _write(self, record: dict[str, Any]) -> None:
        out = self._out
        if out is None:
            return
        try:
            out.write(json.dumps({"t": round(self.clock() - self._t0, 4), **record}) + "\n")
        except (OSError, ValueError) as exc:
            logger.warning("pykvcache gate trace: writing %s failed (%s); the trace stops", self.path, exc)
            self.close()

    def decided(
        self,
        role: str,
        req: Hashable,
        states: Sequence[ChunkState],
        decision: GateDecision,
        *,
        queued_bytes: int,
        waiting: int,
        bytes_per_s: float | None,
    ) -> None:
        staged = sum(1 for s in states if s == ChunkState.STAGED)
        disk = sum(1 for s in states if s == ChunkState.DISK)
        first_disk = next((i for i, s in enumerate(states) if s == ChunkState.DISK), -1)
        self._write(
            {
                "ev": "decide",
                "role": role,
                "req": str(req),
                "staged": staged,
                "disk": disk,
                "missing": len(states) - staged - disk,
                "first_disk": first_disk,
                "queued_mb": round(queued_bytes / 1e6, 2),
                "waiting": waiting,
                "load": decision.load_chunks,
                "disk_load": decision.disk_chunks,
                "reason": decision.reason,
                "sample": decision.sample_chunks,
                "est_load_s": round(decision.est_load_s, 4),
                "est_recompute_s": round(decision.est_recompute_s, 4),
                "mbps": None if bytes_per_s is None else round(bytes_per_s / 1e6, 1),
            }
        )

    def read(self, started_at: float, latency_s: float, nbytes: int, *, sample: bool) -> None:
        self._write(
            {
                "ev": "read",
                "started": round(started_at - self._t0, 4),
                "latency_s": round(latency_s, 4),
                "mb": round(nbytes / 1e6, 3),
                "sample": sample,
            }
        )

    def learnt(self, nbytes: float, seconds: float, *, explored: bool, bytes_per_s: float | None, source: str) -> None:
        """``source``: ``"period"`` (a busy period, 0079) or ``"load"`` (a
        request's load timed to its last read, queue ahead included)."""
        self._write(
            {
                "ev": "learn",
                "from": source,
                "mb": round(nbytes / 1e6, 2),
                "s": round(seconds, 4),
                "explored": explored,
                "mbps": None if bytes_per_s is None else round(bytes_per_s / 1e6, 1),
            }
        )

    def close(self) -> None:
        out, self._out = self._out, None
        if out is not None:
            try:
                out.close()
            except OSError:
                pass
