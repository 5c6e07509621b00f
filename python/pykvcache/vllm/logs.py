"""The engine's and the gate's log messages under vLLM.

The Rust engine logs on the ``pykvcache`` logger (fallbacks, the ENOSPC
notice, capacity warnings) and the gate on ``pykvcache.gate.*``. vLLM
configures only the ``vllm`` logger tree, so in its processes those messages
reach no handler and Python's last resort prints them as bare stderr lines,
without vLLM's level, time, source and process prefix. Routing them into
``vllm.pykvcache`` prints them like every other vLLM line, once.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

TARGET = "vllm.pykvcache"


class _ToVllm(logging.Handler):
    """Hands each record to the ``vllm.pykvcache`` logger (vLLM's handlers and
    format), unless the application configured the root logger: then the
    record propagates there as usual, and printing it here too would show it
    twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        target = logging.getLogger(TARGET)
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def route_engine_logs() -> None:
    """Idempotent: called when the vLLM integration is imported."""
    source = logging.getLogger("pykvcache")
    if any(isinstance(h, _ToVllm) for h in source.handlers):
        return
    source.addHandler(_ToVllm())
    # Levels follow vLLM's (VLLM_LOGGING_LEVEL): the gate's INFO lines show too.
    if source.level == logging.NOTSET:
        source.setLevel(logging.getLogger(TARGET).getEffectiveLevel())


class ChunkTroubleLog:
    """One WARNING for the first unusable chunk, then at most one summary
    line per ``interval_s`` with the counts per status and the latest case.

    An attack or a failing disk makes every chunk of a prefix unusable at
    once: one line per chunk (65 for one corrupted prefix in a hostile run) buries
    the rest of the log, while the counters (``corrupt_chunks``,
    ``read_errors``) already count each one. What was counted since the last
    line is summarised by the next report after the interval, or by
    :meth:`flush` (at shutdown).
    """

    def __init__(self, log: logging.Logger, what: str, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._what = what  # e.g. "chunk unusable, treated as a miss"
        self._interval_s = interval_s
        self._clock = clock
        self._last_line: float | None = None
        self._counts: Counter[str] = Counter()
        self._latest = ""

    def report(self, key: bytes, status: str, message: str) -> None:
        now = self._clock()
        if self._last_line is None:
            self._last_line = now
            self._log.warning(
                "pykvcache: %s: chunk %s (%s: %s); further ones are summarised at most every %.0f s",
                self._what,
                key.hex(),
                status,
                message,
                self._interval_s,
            )
            return
        self._counts[status] += 1
        self._latest = f"chunk {key.hex()} ({status}: {message})"
        if now - self._last_line >= self._interval_s:
            self.flush()

    def flush(self) -> None:
        """Logs the summary of what was counted since the last line, if anything."""
        if not self._counts:
            return
        now = self._clock()
        since = now - (self._last_line if self._last_line is not None else now)
        by_status = ", ".join(f"{s} {n}" for s, n in sorted(self._counts.items()))
        self._log.warning(
            "pykvcache: %s: %d more in the last %.0f s (%s); the latest: %s",
            self._what,
            sum(self._counts.values()),
            since,
            by_status,
            self._latest,
        )
        self._counts.clear()
        self._last_line = now
