"""Time to open a store of many chunks: blocking scan vs background scan.

    python scripts/open_scan.py DIR [--chunks 100000] [--rounds 3]

Writes CHUNKS chunks of 4 KiB payload (8 KiB files) once, then per round and
mode drops the page/dentry/inode caches (root) and opens the store: prints
how long the constructor took, when the index was complete, and how long a
`get` of a known key took right after the constructor returned.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import pykvcache as kv
from pykvcache.tools.bench.cold_cache import drop_caches
from pykvcache.tools.bench.engine_bench import pump

NS = "open-scan"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--chunks", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    root = a.dir / "open-scan"
    pool = kv.StagingPool(4096, 32)
    slots = [pool.acquire() for _ in range(32)]
    keys = [b"scan-%d" % i for i in range(a.chunks)]
    try:
        with kv.BlockStore([str(root)], pool, namespace=NS, capacity_bytes=1 << 40) as store:
            t0 = time.perf_counter()
            ok, errors = pump(store, "put", keys, slots, 4096)
            assert ok == len(keys), errors[:3]
            print(f"wrote {ok} chunks in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        res: dict[str, list[tuple[float, float, float]]] = {"blocking": [], "background": []}
        for rnd in range(a.rounds):
            for mode in ("blocking", "background") if rnd % 2 == 0 else ("background", "blocking"):
                cold = drop_caches()
                t0 = time.perf_counter()
                store = kv.BlockStore([str(root)], pool, namespace=NS, capacity_bytes=1 << 40,
                                      background_scan=(mode == "background"))
                opened = time.perf_counter() - t0
                r = store.get(keys[len(keys) // 2], slots[0]).wait(30)
                first_get = time.perf_counter() - t0
                assert r.ok, r.message
                assert store.wait_scan(120)
                indexed = time.perf_counter() - t0
                assert len(store) == len(keys), len(store)
                store.close()
                res[mode].append((opened, first_get, indexed))
                print(f"round {rnd + 1} {mode}: open {opened:.3f} s, first get done {first_get:.3f} s, "
                      f"index complete {indexed:.3f} s (caches dropped: {cold})", file=sys.stderr)
    finally:
        for s in slots:
            pool.release(s)
        shutil.rmtree(root, ignore_errors=True)
    print(f"{a.chunks} chunks, medians of {a.rounds} rounds (s): constructor / first get done / index complete")
    for mode, v in res.items():
        med = [statistics.median(x[i] for x in v) for i in range(3)]
        print(f"{mode:10} {med[0]:8.3f} {med[1]:8.3f} {med[2]:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
