"""Configuration ``restarted`` of the serving part: pykvcache's defaults on a
server that starts where an earlier server of the same configuration stopped.

Why: every other configuration starts a fresh server on empty storage, so its
gate prices its first reads at its prior (1 GB/s without a profile) until
two loads end; under a read cap the slowest requests of a run were there.
A production server restarts on its own directories, and the
gate keeps what it learnt of the device beside the namespace (decision 0073).
This configuration measures that at serving level: before the measured
server, a predecessor with the same settings and storage serves a short
workload on other documents (so nothing it stored is reused by the measured
sessions), under the same read cap, and is stopped cleanly (SIGINT: vLLM's
shutdown, where the tier saves the device model). The measured server then
starts on those directories.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..vllm_server import Server, ServerConfig, ServerFailed, log_tail
from .read_throttle import ReadThrottle
from .serve_options import ServeOptions
from .serve_workload import Workload, run_sessions

#: The line the tier logs when it starts from a saved device model (disk_tier.py).
RESTORED_MARK = "the gate starts from the device model saved in"
DEVICE_FILE = "gate-device.json"
#: Documents of the predecessor's workload come from their own seed: none of
#: them is among the measured workload's.
PREDECESSOR_SEED = 77_777


def predecessor_workload(opts: ServeOptions, bytes_per_token: int) -> Workload:
    """Two sessions per document, over more documents than staging holds:
    the second session on a document finds it on disk, not in staging, so the
    gate learns the device from real reads (it needs three loads to outweigh
    its prior). About half a minute at 25 MB/s."""
    held = opts.staging_bytes / max(1, opts.doc_tokens * bytes_per_token)
    documents = max(2, math.ceil(1.5 * held) + 1)
    return Workload(
        sessions=2 * documents,
        turns=2,
        documents=documents,
        doc_tokens=opts.doc_tokens,
        question_tokens=opts.question_tokens,
        answer_tokens=opts.answer_tokens,
        output_tokens=opts.output_tokens,
        concurrency=3,
        think_s=opts.think_s,
        seed=opts.seed + PREDECESSOR_SEED,
        block_tokens=32,
    )


def run_predecessor(
    cfg: ServerConfig, model: str, opts: ServeOptions, bytes_per_token: int, storage: Path, log: Path, tokenizer_json: str
) -> dict[str, Any]:
    """Serves :func:`predecessor_workload` on ``storage`` and stops cleanly.
    Raises ServerFailed when the predecessor cannot start or dies, or when it
    left no device model behind (the measurement would then be of a fresh
    server under another name)."""
    server = Server(replace(cfg), log, opts.start_timeout_s)
    started = time.monotonic()
    server.start()
    throttle: ReadThrottle | None = None
    try:
        if opts.read_mbps and server.proc is not None:
            throttle = ReadThrottle(server.proc.pid, storage, int(opts.read_mbps * 1e6))
            throttle.__enter__()
        w = predecessor_workload(opts, bytes_per_token)
        records, wall = run_sessions(server.url, model, w, tokenizer_json)
        learnt = next((v for k, v in server.metrics().items() if k.startswith("vllm:pykvcache_gate_disk_bandwidth_mbps")), None)
        if not server.alive():
            raise ServerFailed(f"the predecessor died during its workload:\n{log_tail(log)}")
    finally:
        if throttle is not None:
            throttle.__exit__(None, None, None)
        server.stop()
    saved = sorted(storage.glob(f"*/{DEVICE_FILE}"))
    if not saved:
        raise ServerFailed(f"the predecessor left no {DEVICE_FILE} under {storage}:\n{log_tail(log)}")
    try:
        points = len(json.loads(saved[0].read_text())["points"])
    except (OSError, ValueError, KeyError, TypeError):
        points = 0
    return {
        "requests": len(records),
        "errors": sum(r.error is not None for r in records),
        "workload_s": round(wall, 1),
        "seconds": round(time.monotonic() - started, 1),
        "learnt_mbps": learnt,
        "saved_loads": points,
        "device_file": str(saved[0]),
        "log": str(log),
    }


_RESTORED = re.compile(re.escape(RESTORED_MARK) + r" \S+ \((\d+) loads: (\d+) MB/s\)")


def restored(log: Path) -> tuple[int, float] | None:
    """``(loads, MB/s)`` the measured server's tier started from, as it logged
    them; None when it started from its prior."""
    try:
        m = _RESTORED.search(log.read_text(errors="replace"))
    except OSError:
        return None
    return (int(m.group(1)), float(m.group(2))) if m else None
