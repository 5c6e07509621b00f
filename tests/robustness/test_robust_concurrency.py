"""Two processes share one store directory for a few seconds, writing
overlapping key ranges and reading both: no wrong byte is ever served, each
loads the other's chunks (on a plain get, and after a rescan), and each stays
within its capacity."""

import json
import os
import subprocess
import sys

from child_paths import child
from robust_chunkfmt import chunk_files
from robust_share_worker import CAPACITY

SECONDS = 3.0


def test_two_processes_share_a_directory_without_corruption(store_dir):
    ranges = {"A": (0, 200), "B": (100, 300)}  # keys 100..199 are written by both
    procs = {}
    for i, (name, (first, last)) in enumerate(ranges.items()):
        cmd = [sys.executable, child("robust_share_worker.py"), str(store_dir), str(first), str(last), str(SECONDS), str(i)]
        procs[name] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for p in procs.values():
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    for p in procs.values():  # start both at once
        p.stdin.write("go\n")
        p.stdin.flush()
    seen = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        seen[name] = json.loads(out.strip().splitlines()[-1])
    print("sharing report:", seen)
    for name, s in seen.items():
        assert s["bad"] == 0 and s["corrupt_chunks"] == 0 and s["read_errors"] == 0, (name, s)
        assert s["put_errors"] == 0 and s["write_errors"] == 0, (name, s)
        assert s["foreign_hits"] > 0, f"{name} never loaded a chunk of the other process"
        assert s["rescan_foreign"] > 0 and s["rescan_foreign_ok"] > 0, (name, s)
        assert s["max_used"] <= s["capacity"], (name, s)
        assert s["evictions"] > 0, "capacity was under pressure"
        # Evicted files were overwritten in place while the other process read and evicted too.
        assert s["recycled_files"] > 0, s
    assert seen["A"]["write_races"] + seen["B"]["write_races"] > 0, "both wrote the same keys"
    on_disk = sum(os.path.getsize(f) for f in chunk_files(store_dir))
    assert on_disk <= 2 * CAPACITY
