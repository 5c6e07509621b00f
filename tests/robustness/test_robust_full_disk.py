"""Full disk on a size-limited tmpfs: with capacity_bytes below the
filesystem size eviction keeps writes succeeding; above it, ENOSPC evicts
LRU chunks, retries the write and lowers the capacity to what fits (no write
fails, no space or files leaked, the newest chunks load)."""

import json
import os
import subprocess
import sys

import pykvcache as kv
from child_paths import child
from robust_chunkfmt import chunk_files, get_bytes, payload_for, put_bytes, temp_files
from robust_full_disk_check import PAYLOAD, fill_past_full, free_bytes

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
    assert kept == keys[-len(kept) :], "LRU keeps the newest chunks"
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
    out = subprocess.run(
        [sys.executable, child("robust_full_disk_check.py"), str(fs), "rename"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert any("O_TMPFILE unsupported" in f for f in report["fallbacks"])
    print("full-disk report (temp + rename):", report)


WRITER = r"""
import os, sys
path, size = sys.argv[1], int(sys.argv[2])
written = 0
try:
    with open(path, "wb") as f:
        while written < size:
            written += f.write(b"x" * min(65536, size - written))
            f.flush()
        os.fsync(f.fileno())
except OSError as e:
    print(written, e.errno)
    raise SystemExit(0)
print(written, 0)
"""


def _second_writer(path, size: int) -> tuple[int, int]:
    """Another process writes a plain file: (bytes written, errno or 0)."""
    out = subprocess.run([sys.executable, "-c", WRITER, str(path), str(size)], capture_output=True, text=True, timeout=60, check=True)
    written, errno = out.stdout.split()
    return int(written), int(errno)


def _fill(store, pool, slot, prefix: str, count: int) -> list:
    results = [
        put_bytes(store, pool, slot, b"%s-%03d" % (prefix.encode(), i), payload_for(b"%s-%03d" % (prefix.encode(), i), PAYLOAD, PAYLOAD))
        for i in range(count)
    ]
    return results


def test_free_space_reserve_leaves_room_for_another_writer(mounted, tmp_path):
    """capacity_bytes far above an 8 MiB filesystem: the store stops 1 MiB
    short of full (min_free_bytes), so a second process can still write; when
    that writer takes the space, the store's next puts evict to restore it."""
    fs = mounted("tmpfs", "size=8m,mode=0700")
    reserve = 1 * MiB
    pool = kv.StagingPool(PAYLOAD, 1)
    slot = pool.acquire()
    store = kv.BlockStore([str(fs / "kv")], pool, namespace="robust-reserve", capacity_bytes=1 << 40, min_free_bytes=reserve)
    assert store.stats()["min_free_bytes"] == [reserve]
    results = _fill(store, pool, slot, "a", 3 * 8 * MiB // (PAYLOAD + 4096))  # 3x the filesystem
    assert all(r.ok for r in results), [(r.status, r.message) for r in results if not r.ok][:3]
    s = store.stats()
    assert s["write_enospc"] == 0 and s["enospc_retries"] == 0, "the reserve keeps ENOSPC away"
    assert s["reserve_evictions"] > 0 and s["reserve_refused"] == 0
    assert free_bytes(fs) >= reserve, free_bytes(fs)
    assert len(store) > 0
    # Another process writes into the reserve: it gets every byte.
    written, errno = _second_writer(fs / "other.log", 768 << 10)
    assert (written, errno) == (768 << 10, 0)
    # The store now finds less than its reserve free: its puts evict its own
    # chunks to give it back, and keep succeeding.
    before = len(store)
    results = _fill(store, pool, slot, "b", 8)
    assert all(r.ok for r in results)
    assert free_bytes(fs) >= reserve and len(store) < before
    assert temp_files(fs) == []
    print(
        "reserve report:",
        {"chunks": len(store), "free": free_bytes(fs), "reserve": reserve, "reserve_evictions": store.stats()["reserve_evictions"]},
    )
    store.close()


def test_a_new_namespace_evicts_old_namespaces_at_the_reserve_and_the_log_names_them(mounted, caplog):
    """Every configuration change starts a namespace; the
    old ones filled the filesystem to its reserve and the new namespace then
    stored nothing (each put refused, naming only min_free_bytes). Capacity
    and the reserve span every namespace in the directory: the new one evicts
    the old ones' stalest chunks, and the log says which namespaces held it."""
    fs = mounted("tmpfs", "size=8m,mode=0700")
    reserve = 1 * MiB
    pool = kv.StagingPool(PAYLOAD, 1)
    slot = pool.acquire()
    for old in ("model-v1", "model-v2"):  # two configuration changes, each filling the disk
        with kv.BlockStore([str(fs)], pool, namespace=old, capacity_bytes=1 << 40, min_free_bytes=reserve) as store:
            assert all(r.ok for r in _fill(store, pool, slot, old, 8 * MiB // (PAYLOAD + 4096)))
    with caplog.at_level("INFO", logger="pykvcache"):
        store = kv.BlockStore([str(fs)], pool, namespace="model-v3", capacity_bytes=1 << 40, min_free_bytes=reserve)
        assert store.stats()["other_namespace_bytes"] > 0, "the old namespaces are counted"
        results = _fill(store, pool, slot, "new", 12)
        s = store.stats()
    assert all(r.ok for r in results), [(r.status, r.message) for r in results if not r.ok][:3]
    assert s["reserve_refused"] == 0 and s["write_errors"] == 0
    assert s["other_namespace_evictions"] >= 12 - 1 and len(store) == 12
    assert free_bytes(fs) >= reserve
    lines = [r.getMessage() for r in caplog.records]
    spans = [m for m in lines if "bounds every namespace under" in m]
    # Each store said once which namespaces held the space it evicted from:
    # model-v2 found model-v1's chunks (and evicted them all, stalest first),
    # model-v3 then found only model-v2's.
    assert len(spans) == 2, lines
    assert "model-v1 (" in spans[0] and "model-v2 (" in spans[1] and "model-v1 (" not in spans[1], spans
    assert all(get_bytes(store, pool, slot, b"new-%03d" % i)[0].ok for i in range(12))
    print(
        "namespaces report:",
        {k: s[k] for k in ("chunks", "other_namespace_chunks", "other_namespace_bytes", "other_namespace_evictions", "reserve_evictions")},
        spans[1],
    )
    store.close()


def test_default_reserve_is_five_percent_and_capacity_above_the_filesystem_warns(mounted, caplog):
    fs = mounted("tmpfs", "size=8m,mode=0700")
    total = os.statvfs(fs).f_blocks * os.statvfs(fs).f_frsize
    pool = kv.StagingPool(PAYLOAD, 1)
    slot = pool.acquire()
    with caplog.at_level("WARNING", logger="pykvcache"):
        store = kv.BlockStore([str(fs)], pool, namespace="robust-reserve", capacity_bytes=1 << 40)
    assert [r for r in caplog.records if "exceeds the storage filesystem size" in r.getMessage()]
    reserve = store.stats()["min_free_bytes"][0]
    assert reserve == int(total * 0.05)
    assert all(r.ok for r in _fill(store, pool, slot, "c", 2 * 8 * MiB // (PAYLOAD + 4096)))
    assert free_bytes(fs) >= reserve and store.stats()["write_enospc"] == 0
    store.close()


def test_a_put_that_cannot_keep_the_reserve_is_refused_not_written(mounted):
    fs = mounted("tmpfs", "size=4m,mode=0700")
    pool = kv.StagingPool(PAYLOAD, 1)
    slot = pool.acquire()
    store = kv.BlockStore([str(fs)], pool, namespace="robust-reserve", capacity_bytes=1 << 40, min_free_bytes=8 * MiB)
    r = put_bytes(store, pool, slot, b"refused", payload_for(b"refused", PAYLOAD, PAYLOAD))
    assert r.status == "error" and r.errno == 28 and "min_free_bytes" in r.message
    assert not store.contains(b"refused") and chunk_files(fs) == [] and temp_files(fs) == []
    assert store.stats()["reserve_refused"] == 1
    store.close()
