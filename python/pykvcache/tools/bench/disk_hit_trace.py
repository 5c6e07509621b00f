"""Where a disk hit's time went, from the ``gate_trace`` file of its server.

The connector, the manager's disk tier and the worker append the load path's
records to the gate's trace (:mod:`pykvcache.vllm.load_trace`), each with
``mono`` (``CLOCK_MONOTONIC`` seconds, one clock for every process). For the
first request of ``tokens`` prompt tokens that loaded from disk, this says,
in ms after vLLM added it: its reads (first submitted, first and last ended),
the load's last copy into KV pages, when vLLM saw the load done and when it
scheduled the prefill; and the time the worker spent copying.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def records(path: Path) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if "mono" in rec:
                    out.append(rec)
    except OSError:
        return []
    return out


def breakdown(path: Path, tokens: int) -> dict[str, Any] | None:
    """The load path of the first request of ``tokens`` prompt tokens whose
    load was handed out, or None when the trace holds none."""
    recs = records(path)
    arrivals = {r["req"]: r["mono"] for r in recs if r["ev"] == "arrival" and r.get("tokens") == tokens}
    out = next((r for r in recs if r["ev"] == "load_out" and r["req"] in arrivals), None)
    if out is None:
        return None
    req, t0 = out["req"], arrivals[out["req"]]
    received = next((r["mono"] for r in recs if r["ev"] == "received" and r["req"] == req), None)
    prefill = next((r["mono"] for r in recs if r["ev"] == "step" and req in (r.get("prefill") or ())), None)
    end = prefill if prefill is not None else float("inf")
    reads = [r for r in recs if r["ev"] == "read" and t0 - 0.001 <= r["submitted"] <= end]
    job = next((r["job"] for r in recs if r["ev"] == "load_in" and r["mono"] >= out["mono"]), None)
    copies = [r for r in recs if r["ev"] == "copied" and r.get("job") == job and r["mono"] >= t0]
    done = next((r["mono"] for r in recs if r["ev"] == "load_done" and r.get("job") == job and r["mono"] >= t0), None)

    def ms(t: float | None) -> float | None:
        return None if t is None else round((t - t0) * 1000, 1)

    return {
        "req": req,
        "chunks_read": len(reads),
        "read_mb": round(sum(r.get("mb", 0.0) for r in reads), 1),
        "first_read_submitted_ms": ms(min((r["submitted"] for r in reads), default=None)),
        "first_read_ended_ms": ms(min((r["ended"] for r in reads), default=None)),
        "last_read_ended_ms": ms(max((r["ended"] for r in reads), default=None)),
        "load_out_ms": ms(out["mono"]),
        "copy_waves": len(copies),
        "copy_ms": round(sum(r.get("s", 0.0) for r in copies) * 1000, 1),
        "load_done_ms": ms(done),
        "received_ms": ms(received),
        "prefill_step_ms": ms(prefill),
    }
