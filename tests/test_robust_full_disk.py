"""Full disk on a size-limited tmpfs: with capacity_bytes below the
filesystem size eviction keeps writes succeeding; above it, ENOSPC evicts
LRU chunks, retries the write and lowers the capacity to what fits (no write
fails, no space or files leaked, the newest chunks load)."""

import json
import os
import subprocess
import sys

import pykvcache as kv
from robust_chunkfmt import chunk_files, get_bytes, payload_for, put_bytes
from robust_full_disk_check import PAYLOAD, fill_past_full

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20


def test_capacity_below_filesystem_size_evicts_instead_of_failing(mounted):
    fs = mounted("tmpfs", "size=8m,mode=0700")
    capacity = 6 * MiB
    pool = kv.StagingPool(PAYLOAD, 1)
    slot = pool.acquire()
    store = kv.BlockStore([str(fs)], pool, namespace="robust-full", capacity_bytes=capacity)
    keys = [b"evict-%03d" % i for i in range(60)]  # 15 MiB through an 8 MiB filesystem
    for key in keys:
        assert put_bytes(store, pool, slot, key, payload_for(key, PAYLOAD, PAYLOAD)).ok, key
        assert store.used_bytes <= capacity
    s = store.stats()
    assert s["write_enospc"] == 0 and s["write_errors"] == 0
    kept = [k for k in keys if store.contains(k)]
    assert s["evictions"] == len(keys) - len(kept) > 0
    assert len(chunk_files(fs)) == len(kept) == capacity // (PAYLOAD + 4096)
    assert kept == keys[-len(kept):], "LRU keeps the newest chunks"
    for key in keys:
        r, data = get_bytes(store, pool, slot, key)
        if key in kept:
            assert r.ok and data == payload_for(key, PAYLOAD, PAYLOAD)
        else:
            assert r.status == "miss"
    print("evict report:", {"puts": len(keys), "evictions": s["evictions"], "kept_and_loaded": len(kept)})
    store.close()


def test_capacity_above_filesystem_size_evicts_on_enospc(mounted):
    fs = mounted("tmpfs", "size=4m,mode=0700")
    report = fill_past_full(kv, fs)
    print("full-disk report (O_TMPFILE):", report)


def test_capacity_above_filesystem_size_on_the_rename_path(mounted):
    fs = mounted("tmpfs", "size=4m,mode=0700")
    out = subprocess.run([sys.executable, os.path.join(HERE, "robust_full_disk_check.py"), str(fs), "rename"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert any("O_TMPFILE unsupported" in f for f in report["fallbacks"])
    print("full-disk report (temp + rename):", report)
