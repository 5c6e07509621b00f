"""Engine micro-benchmark of decision 0061: how long a read needed now waits
behind a burst of queued prefetches (lookahead preloads), with and without
promotion and the background byte budget.

One store (io_uring, O_DIRECT where the filesystem allows it, default
queue_depth 32: up to 16 prefetch transfers in flight) on a fresh directory;
`--chunks` chunks of `--chunk-mib` are written once. Each round, in turn:

* ``alone``: a get with nothing else queued (the floor);
* ``needed_waited`` / ``needed_promoted`` / ``needed_promoted_budget``: a
  burst of `--burst` prefetches, then the last of them is needed (a lookup
  of its request): the time from that moment until it is verified in
  staging, waited for as it is, after ``IoHandle.promote()``, and after
  ``promote()`` with the byte budget below set (what the vLLM manager does);
* ``get_default`` / ``get_budget``: the burst, then a get of another chunk:
  its latency with the default bound (half the queue depth) and with
  ``set_background_budget(max(chunk, device_bytes_per_s * target))``, the
  device speed measured first by reading every chunk at full depth (as the
  gate learns it); ``drain_*``: when the burst's last prefetch ended (what
  the budget costs the preloads).

The variants alternate within each round, so a load change on the host hits
all of them alike. `--throttle-mbps` caps the process's reads from the disk
with a blkio cgroup (root, cgroup v1; tools/bench/read_throttle.py) to
emulate a slow device. Prints a JSON summary (medians, p90, ratios).

    PYTHONPATH=python .venv/bin/python scripts/preload_yield_bench.py --rounds 15
    PYTHONPATH=python .venv/bin/python scripts/preload_yield_bench.py --rounds 8 --throttle-mbps 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import pykvcache as kv

MiB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="parent of the store directory (default: a temp dir under /work or /tmp)")
    ap.add_argument("--chunk-mib", type=float, default=2.0)
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--target-ms", type=float, default=3.0, help="budget = device speed x this (>= one chunk)")
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--backend", default="io_uring")
    ap.add_argument("--throttle-mbps", type=float, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    chunk = int(args.chunk_mib * MiB) // 4096 * 4096
    n = args.burst
    # The burst, the needed chunk's neighbour and one chunk for the gets.
    keys = [f"c{i}".encode() for i in range(n + 1)]
    parent = args.dir or ("/work" if os.access("/work", os.W_OK) else None)
    with tempfile.TemporaryDirectory(prefix="pykvcache-yield-", dir=parent) as root:
        pool = kv.StagingPool(chunk, n + 1)
        slots = [pool.acquire() for _ in range(n + 1)]
        store = kv.BlockStore([root], pool, namespace="yield", capacity_bytes=(n + 8) * 2 * chunk,
                              queue_depth=args.queue_depth, backend=args.backend)
        payload = os.urandom(chunk)
        for key, slot in zip(keys, slots):
            with pool.view(slot) as v:
                v[:] = payload
            store.put(key, slot, chunk).wait(120).raise_for_status()
        throttle = None
        if args.throttle_mbps:
            from pykvcache.tools.bench.read_throttle import ReadThrottle

            throttle = ReadThrottle(os.getpid(), Path(root), int(args.throttle_mbps * 1e6)).__enter__()
        try:
            result = run(store, keys, slots, chunk, n, args)
        finally:
            if throttle is not None:
                throttle.__exit__(None, None, None)
            store.close()
            for slot in slots:
                pool.release(slot)
    result["config"] = {"chunk_bytes": chunk, "burst": n, "rounds": args.rounds, "queue_depth": args.queue_depth,
                        "backend": args.backend, "throttle_mbps": args.throttle_mbps, "target_ms": args.target_ms,
                        "load_average": os.getloadavg(), "direct_io": result.pop("direct_io")}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def run(store, keys, slots, chunk, n, args) -> dict:
    # The device's speed as the gate learns it: whole chunks read at full depth.
    t0 = time.perf_counter()
    hs = [store.get(k, s) for k, s in zip(keys, slots)]
    for h in hs:
        h.wait(600).raise_for_status()
    device_bps = len(keys) * (chunk + 4096) / (time.perf_counter() - t0)
    budget = max(chunk + 4096, int(device_bps * args.target_ms / 1000))
    burst_keys, burst_slots = keys[:n], slots[:n]
    other_key, other_slot = keys[n], slots[n]

    def burst():
        return [store.prefetch(k, s) for k, s in zip(burst_keys, burst_slots)]

    def drain(handles):
        for h in handles:
            h.wait(600).raise_for_status()
        return time.perf_counter()

    times: dict[str, list[float]] = {k: [] for k in (
        "alone", "needed_waited", "needed_promoted", "needed_promoted_budget", "get_default", "get_budget",
        "drain_default", "drain_budget")}
    for _ in range(args.rounds):
        t = time.perf_counter()
        store.get(other_key, other_slot).wait(600).raise_for_status()
        times["alone"].append(time.perf_counter() - t)
        for name, promote, b in (("waited", False, None), ("promoted", True, None),
                                 ("promoted_budget", True, budget)):
            store.set_background_budget(b)
            hs = burst()
            t = time.perf_counter()
            if promote:
                hs[-1].promote()
            hs[-1].wait(600).raise_for_status()
            times[f"needed_{name}"].append(time.perf_counter() - t)
            drain(hs)
        for name, b in (("default", None), ("budget", budget)):
            store.set_background_budget(b)
            t_burst = time.perf_counter()
            hs = burst()
            t = time.perf_counter()
            store.get(other_key, other_slot).wait(600).raise_for_status()
            times[f"get_{name}"].append(time.perf_counter() - t)
            times[f"drain_{name}"].append(drain(hs) - t_burst)
        store.set_background_budget(None)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    p90 = {k: sorted(v)[int(0.9 * (len(v) - 1))] * 1e3 for k, v in times.items()}
    return {
        "device_bytes_per_s": device_bps,
        "budget_bytes": budget,
        "median_ms": med,
        "p90_ms": p90,
        "ratios": {
            "needed: waited / promoted": med["needed_waited"] / med["needed_promoted"],
            "needed: waited / promoted with budget": med["needed_waited"] / med["needed_promoted_budget"],
            "get: default / budget": med["get_default"] / med["get_budget"],
            "burst drain: budget / default": med["drain_budget"] / med["drain_default"],
        },
        "stats": {k: store.stats()[k] for k in ("promotions", "prefetches", "reads")},
        "direct_io": store.direct_io,
    }


if __name__ == "__main__":
    raise SystemExit(main())
