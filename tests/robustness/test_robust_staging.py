"""Staging exhaustion: 32 threads share 4 staging slots and 2 operation
entries. Backpressure (PoolExhausted after a timeout, or blocking), no
deadlock, every request completes with the right bytes, and the process's
memory high-water mark stays within the staging budget plus a constant."""

import json
import subprocess
import sys

from child_paths import child

MiB = 1 << 20
# Engine, I/O ring and 32 Python threads, measured at ~1-2 MiB here.
CONSTANT = 8 * MiB


def run_worker(store_dir) -> dict:
    out = subprocess.run([sys.executable, child("robust_staging_worker.py"), str(store_dir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def check(r: dict):
    assert r["stuck"] == 0, f"{r['stuck']} threads never finished (deadlock?)"
    assert r["done"] == r["requests"] and r["bad"] == 0, r
    assert r["hits"] + r["stores"] == r["requests"], r
    assert r["pool_exhausted"] > 0, "the pool never pushed back"
    assert r["free_slots"] == r["num_slots"], "every slot came back"
    growth = r["hwm"] - r["baseline_rss"]
    assert growth <= r["budget"] + CONSTANT, f"memory grew {growth / MiB:.1f} MiB for a {r['budget'] / MiB:.1f} MiB budget"


def test_tiny_staging_pool_under_many_threads(store_dir):
    r = run_worker(store_dir)
    print("staging report:", r, "growth MiB:", round((r["hwm"] - r["baseline_rss"]) / MiB, 2))
    check(r)
