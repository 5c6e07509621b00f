"""The path of a load, timed, into the ``gate_trace`` file.

Why: a disk hit's time to first token is the sum of steps in two processes
(the scheduler's lookups and disk reads, the worker's copies, the engine
steps between them), and the end-to-end figure alone cannot say which one
took the time. With ``gate_trace`` set, the scheduler process and every
worker append these records to the gate's trace file (one JSON object per
line, each written by one ``write`` in append mode, so the processes'
lines never interleave). ``mono`` is ``CLOCK_MONOTONIC`` in seconds, the
same clock in every process of the machine, so the records join without
the gate records' per-process ``t``.

Scheduler (``pid`` of the EngineCore):

* ``{"ev": "arrival", "req", "tokens"}``: vLLM added the request;
* ``{"ev": "lookup", "req", "computed", "hit_tokens"}``: vLLM asked for its
  external hit (``hit_tokens`` null: asked again later);
* ``{"ev": "load_out", "req", "tokens"}``: the load was handed to the worker;
* ``{"ev": "read", "key", "submitted", "ended", "collected", "ok", "mb"}``:
  one disk read, as its completion was collected (``ended`` = submission
  plus the engine's latency);
* ``{"ev": "received", "req"}``: the worker reported the load done;
* ``{"ev": "step", "tokens", "prefill": [req, ...]}``: a step was built
  while a load was out (or the step that prefills its request).

Worker: ``{"ev": "load_in", "job", "chunks", "in_flight"}`` (a load
arrived), ``{"ev": "copied", "job", "chunks", "s"}`` (chunks copied into
KV pages), ``{"ev": "load_done", "job"}``, ``{"ev": "idle_wait", "s"}``
(a step with nothing to compute slept on reads).

Writing is best effort: the first failure is logged and tracing stops.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm.pykvcache." + __name__.rsplit(".", 1)[-1])


class LoadTrace:
    def __init__(self, path: str | os.PathLike[str], role: str) -> None:
        self.path = os.fspath(path)
        self.role = role
        self._pid = os.getpid()
        self._out: IO[str] | None = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def __call__(self, ev: str, **fields: Any) -> None:
        out = self._out
        if out is None:
            return
        try:
            out.write(json.dumps({"mono": round(time.monotonic(), 6), "ev": ev, "role": self.role, "pid": self._pid, **fields}) + "\n")
        except (OSError, ValueError) as exc:
            logger.warning("pykvcache load trace: writing %s failed (%s); the trace stops", self.path, exc)
            self.close()

    def close(self) -> None:
        out, self._out = self._out, None
        if out is not None:
            try:
                out.close()
            except OSError:
                pass


def trace_path(vllm_config: VllmConfig) -> str | None:
    """The ``gate_trace`` file of vLLM's connector settings, if any."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(kv, "kv_connector_extra_config", None) or {}
    path = extra.get("gate_trace")
    return str(path) if path else None


def open_trace(vllm_config: VllmConfig, role: str) -> LoadTrace | None:
    path = trace_path(vllm_config)
    if not path:
        return None
    try:
        return LoadTrace(path, role)
    except OSError as exc:  # a diagnostic: serving goes on without it
        logger.warning("pykvcache: cannot open the load trace %s (%s); not tracing loads", path, exc)
        return None
