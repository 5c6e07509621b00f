"""The full-disk scenario where capacity_bytes exceeds what the filesystem
holds (ENOSPC evicts and lowers the capacity), as a plain function so that the test can run it in-process (O_TMPFILE
path) and in a child whose filesystems lack O_TMPFILE (temp + rename path).

usage (child): robust_full_disk_check.py DIR rename  -> prints a JSON report"""

import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from robust_chunkfmt import chunk_files, get_bytes, payload_for, put_bytes, temp_files  # noqa: E402

PAYLOAD = 252 << 10  # + 4 KiB header = 256 KiB files


def free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def chunk_bytes(path) -> int:
    return sum(os.stat(f).st_blocks * 512 for f in chunk_files(path))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def fill_past_full(kv, store_dir) -> dict:
    """capacity_bytes (1 TiB) far above what the filesystem holds: ENOSPC makes
    the store evict LRU chunks, retry, and lower its capacity to what fits."""
    pool = kv.StagingPool(PAYLOAD, 1)
    slot = pool.acquire()
    records = _Records()
    logging.getLogger("pykvcache").addHandler(records)
    # min_free_bytes=0: no free-space reserve, so that the filesystem really
    # fills and the ENOSPC path (evict, retry, lower the capacity) is what runs.
    store = kv.BlockStore([str(store_dir)], pool, namespace="robust-full", capacity_bytes=1 << 40, min_free_bytes=0)
    free_at_open = free_bytes(store_dir)
    fs_bytes = free_at_open + chunk_bytes(store_dir)
    keys = [b"full-%03d" % i for i in range(3 * fs_bytes // (PAYLOAD + 4096))]  # 3x the filesystem
    for key in keys:
        r = put_bytes(store, pool, slot, key, payload_for(key, PAYLOAD, PAYLOAD))
        assert r.ok, (key, r.status, r.errno, r.message)
        assert store.used_bytes <= store.capacity_bytes
    store.log_notices()  # the ENOSPC notice: logged outside put/wait
    logging.getLogger("pykvcache").removeHandler(records)
    s = store.stats()
    assert s["write_enospc"] == 0 and s["write_errors"] == 0 and s["writes"] == len(keys)
    assert s["enospc_retries"] >= 1 and s["enospc_evictions"] >= 1 and s["capacity_lowered"] >= 1
    assert s["configured_capacity_bytes"] == 1 << 40
    assert store.capacity_bytes < fs_bytes, "capacity lowered to what the filesystem holds"
    lowered = [m for m in records.messages if "ENOSPC" in m]
    assert len(lowered) == 1, records.messages
    assert any("exceeds the storage filesystem size" in m for m in records.messages), records.messages
    # Nothing leaked: every byte the filesystem lost is in a visible chunk.
    assert temp_files(store_dir) == []
    assert free_at_open - free_bytes(store_dir) == chunk_bytes(store_dir)
    kept = [k for k in keys if store.contains(k)]
    assert kept and kept == keys[-len(kept) :], "LRU keeps the newest chunks"
    assert len(chunk_files(store_dir)) == len(kept)
    for key in keys:
        r, data = get_bytes(store, pool, slot, key)
        if key in kept:
            assert r.ok and data == payload_for(key, PAYLOAD, PAYLOAD), key
        else:
            assert r.status == "miss", key
    report = {
        "puts": len(keys),
        "failed": 0,
        "enospc_retries": s["enospc_retries"],
        "enospc_evictions": s["enospc_evictions"],
        "evictions": s["evictions"],
        "capacity_lowered_to": store.capacity_bytes,
        "filesystem_bytes": fs_bytes,
        "kept_and_loaded": len(kept),
        "recycled_files": s["recycled_files"],
        "fallbacks": s["fallbacks"],
    }
    store.close()
    return report


if __name__ == "__main__":
    if sys.argv[2] == "rename":
        import robust_no_tmpfile

        robust_no_tmpfile.refuse_o_tmpfile()
    import pykvcache

    print(json.dumps(fill_past_full(pykvcache, sys.argv[1])))
