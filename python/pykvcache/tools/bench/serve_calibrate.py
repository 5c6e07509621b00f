"""Configuration ``calibrated`` of the serving part: pykvcache's defaults
with the gate profile that ``pykvcache calibrate`` measured before the first
round, on the run's storage disk and under the run's read cap.

Why: the other pykvcache configurations start every fresh server with the
gate's default prior (a 1 GB/s disk). Under a read cap the first loads are
priced at that prior until two of them end, and on a 25 MB/s disk they are
where the slowest requests were. A user is told to calibrate on
their device; this configuration measures what that buys, in the same rounds
as the uncalibrated tier.

Calibration is the real command (``python -m pykvcache.tools.calibrate
--quick``, its own vLLM engine, a minute or two) in a child process that the
run's read throttle holds from its start: its cold storage reads and its load
path see the same device as the servers. It runs on quiet cores even when the
measurement has busy ones (a user calibrates a quiet host).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .read_throttle import ReadThrottle
from .serve_options import ServeOptions

#: A calibration that takes longer has hung (it takes 1-2 min with the bench's models).
CALIBRATE_TIMEOUT_S = 1200.0


def calibrate_command(model: str, opts: ServeOptions, storage: Path, out: Path) -> list[str]:
    """The calibration the servers' settings call for: their dtype, block and
    chunk sizes, prompts up to the workload's longest."""
    longest = min(opts.max_model_len - 32, opts.doc_tokens + opts.turns * (opts.question_tokens + opts.answer_tokens) + opts.output_tokens)
    return [
        sys.executable,
        "-m",
        "pykvcache.tools.calibrate",
        "--model",
        model,
        "--storage-dir",
        str(storage),
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--chunk-tokens",
        str(opts.chunk_tokens),
        "--quick",
        "--max-tokens",
        str(max(2 * opts.chunk_tokens, longest)),
        "--no-progress",
        "--out",
        str(out),
    ]


def calibrate(model: str, opts: ServeOptions, work: Path, log: Path) -> dict[str, Any]:
    """Runs the calibration; ``{"profile": path, "seconds": s, "command": ...}``.
    Raises RuntimeError with the log's tail when it fails."""
    storage = work / "calibrate" / "kv"
    storage.mkdir(parents=True, exist_ok=True)
    profile = work / "calibrate" / "gate-profile.json"
    cmd = calibrate_command(model, opts, storage, profile)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    started = time.monotonic()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
        try:
            # Throttled from its first instant: every process it starts (the
            # engine core) is born in the group; its reads begin seconds later.
            throttle = ReadThrottle(proc.pid, storage, int(opts.read_mbps * 1e6)) if opts.read_mbps else None
            if throttle:
                throttle.__enter__()
            try:
                rc = proc.wait(timeout=CALIBRATE_TIMEOUT_S)
            finally:
                if throttle:
                    throttle.__exit__(None, None, None)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"pykvcache calibrate took over {CALIBRATE_TIMEOUT_S:.0f} s (command: {' '.join(cmd)}); see {log}") from None
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    shutil.rmtree(storage, ignore_errors=True)
    if rc != 0 or not profile.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"pykvcache calibrate exited with {rc} (command: {' '.join(cmd)}):\n{tail}")
    return {"profile": str(profile), "seconds": round(time.monotonic() - started, 1), "command": " ".join(cmd)}


def summary(profile_path: str) -> str:
    """One line on what the profile says (for the report's notes)."""
    from pykvcache.gate.profile import GateProfile

    p = GateProfile.read(profile_path)
    be = p.break_even_tokens
    return (
        f"disk {p.load['disk_bytes_per_s'] / 1e6:.0f} MB/s + {p.load['fixed_s'] * 1e3:.2f} ms, "
        f"break-even {'never' if be is None else f'{be:.0f} tokens'}"
    )
