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
