"""Chunk I/O by the memory it moves from and to (decision 0062): the engine's
staging slots (private, transparent huge pages) against a registered region
of private huge pages, private 4 KiB pages, and shared 4 KiB pages (what
vLLM's CPU tier is: a /dev/shm mapping). Same store settings, same chunks;
each phase starts with the page cache dropped. Prints GB/s and the process's
CPU-seconds per GB for puts and gets of every kind, kinds alternating per round.

    PYTHONPATH=python .venv/bin/python scripts/region_memory_bench.py --dir /mnt/nvme0/tmp --rounds 2
"""

from __future__ import annotations

import argparse
import mmap
import resource
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pykvcache as kv

KINDS = ("slots", "region-private-huge", "region-private-4k", "region-shared-4k")


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def drop_caches() -> None:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass  # not root: reads may come from the page cache (O_DIRECT ones do not)


def region(kind: str, size: int) -> mmap.mmap:
    if kind == "region-shared-4k":
        return mmap.mmap(-1, size)  # MAP_SHARED | MAP_ANONYMOUS: shmem, 4 KiB pages here
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE if kind == "region-private-huge" else mmap.MADV_NOHUGEPAGE)
    return m


def run(kind: str, root: Path, chunk: int, n: int) -> dict[str, tuple[float, float]]:
    pool = kv.StagingPool(chunk, n if kind == "slots" else 1)
    store = kv.BlockStore([str(root / kind)], pool, namespace="region-bench", capacity_bytes=4 * n * (chunk + (1 << 20)), min_free_bytes=0)
    out = {}
    try:
        if kind == "slots":
            slots = [pool.acquire() for _ in range(n)]
            for s in slots:
                with pool.view(s) as v:
                    np.frombuffer(v, dtype=np.uint8)[:] = 7
            ops = {"put": lambda i: store.put(b"k%d" % i, slots[i], chunk), "get": lambda i: store.get(b"k%d" % i, slots[i])}
        else:
            m = region(kind, n * chunk)
            rows = np.frombuffer(m, dtype=np.uint8).reshape(n, chunk)
            rows[:] = 7
            rid = store.register_region(rows)
            ops = {
                "put": lambda i: store.put_region(b"k%d" % i, rid, i * chunk, chunk),
                "get": lambda i: store.get_region(b"k%d" % i, rid, i * chunk, chunk),
            }
        for op in ("put", "get"):
            drop_caches()
            t, c = time.perf_counter(), cpu_s()
            handles = [ops[op](i) for i in range(n)]
            assert all(h.wait(120).ok for h in handles), f"{kind} {op} failed"
            gb = n * chunk / 1e9
            out[op] = (gb / (time.perf_counter() - t), (cpu_s() - c) / gb)
        if kind != "slots":
            store.unregister_region(rid)
            del rows
    finally:
        store.close()
        pool.close()
        shutil.rmtree(root / kind, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=".", help="a directory on the storage to measure")
    ap.add_argument("--chunk-mib", type=int, default=28)
    ap.add_argument("--chunks", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="region-bench-", dir=args.dir))
    try:
        for r in range(args.rounds):
            for kind in KINDS:
                res = run(kind, root, args.chunk_mib << 20, args.chunks)
                cells = "  ".join(f"{op} {gbps:.2f} GB/s {cpu:.3f} CPU-s/GB" for op, (gbps, cpu) in res.items())
                print(f"round {r + 1} {kind:20s} {cells}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
