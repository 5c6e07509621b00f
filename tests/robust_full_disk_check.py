"""The full-disk scenario where capacity_bytes exceeds what the filesystem
holds, as a plain function so that the test can run it in-process (O_TMPFILE
path) and in a child whose filesystems lack O_TMPFILE (temp + rename path).

usage (child): robust_full_disk_check.py DIR rename  -> prints a JSON report"""

import errno
import json
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


def fill_past_full(kv, store_dir) -> dict:
    pool = kv.StagingPool(PAYLOAD, 1)
    slot = pool.acquire()
    store = kv.BlockStore([str(store_dir)], pool, namespace="robust-full", capacity_bytes=1 << 40)
    stored, failures = [], 0
    free_at_open = free_bytes(store_dir)
    for i in range(200):
        key = b"full-%03d" % i
        r = put_bytes(store, pool, slot, key, payload_for(key, PAYLOAD, PAYLOAD))
        if r.ok:
            assert failures == 0, "a write succeeded after the disk was full without anything freed"
            stored.append(key)
            continue
        # Write failed: cleanly, with the errno, and without leaking space or files.
        assert r.status == "error" and r.errno == errno.ENOSPC, (r.status, r.errno, r.message)
        if failures == 0:
            free_at_full, files_at_full = free_bytes(store_dir), len(chunk_files(store_dir))
        else:
            assert free_bytes(store_dir) == free_at_full, "a failed write leaked space"
        assert len(chunk_files(store_dir)) == files_at_full and temp_files(store_dir) == []
        assert not store.contains(key)
        failures += 1
        if failures == 20:
            break
    assert stored and failures == 20, (len(stored), failures)
    # Every byte the filesystem lost is in a visible chunk: failed writes hold none.
    assert free_at_open - free_bytes(store_dir) == chunk_bytes(store_dir)
    s = store.stats()
    assert s["write_enospc"] == failures and s["write_errors"] == failures and s["writes"] == len(stored)
    # Nothing already stored was lost, and loads keep working on a full disk.
    for key in stored:
        r, data = get_bytes(store, pool, slot, key)
        assert r.ok and data == payload_for(key, PAYLOAD, PAYLOAD), key
    # The engine does not evict on ENOSPC by itself; evicting makes room again.
    for key in stored[:2]:
        assert store.evict(key)
    again = [b"again-%d" % i for i in range(2)]
    for key in again:
        assert put_bytes(store, pool, slot, key, payload_for(key, PAYLOAD, PAYLOAD)).ok
    for key in stored[2:] + again:
        r, data = get_bytes(store, pool, slot, key)
        assert r.ok and data == payload_for(key, PAYLOAD, PAYLOAD), key
    report = {"stored_before_full": len(stored), "enospc_failures": failures, "reads_ok_after_full": len(stored),
              "lost": 0, "stored_after_evicting_2": len(again), "fallbacks": s["fallbacks"]}
    store.close()
    return report


if __name__ == "__main__":
    if sys.argv[2] == "rename":
        import robust_no_tmpfile

        robust_no_tmpfile.refuse_o_tmpfile()
    import pykvcache

    print(json.dumps(fill_past_full(pykvcache, sys.argv[1])))
