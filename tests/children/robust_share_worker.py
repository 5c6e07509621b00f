"""Child process of test_robust_concurrency: one of two stores sharing a
directory. Writes keys of its own range, reads keys of both ranges, checks
every byte it is served, and reports what it saw as JSON.

usage: robust_share_worker.py STORE_DIR FIRST_KEY LAST_KEY SECONDS SEED"""

import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pykvcache as kv  # noqa: E402
from robust_chunkfmt import get_bytes, payload_for, put_bytes  # noqa: E402

NAMESPACE = "robust-share"
ALL_KEYS = [b"shared-%03d" % i for i in range(300)]
MAX_PAYLOAD = 64 << 10
CAPACITY = 2 << 20


def main():
    store_dir, first, last, seconds, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    mine = ALL_KEYS[first:last]
    rng = random.Random(seed)
    pool = kv.StagingPool(MAX_PAYLOAD, 1)
    slot = pool.acquire()
    store = kv.BlockStore([store_dir], pool, namespace=NAMESPACE, capacity_bytes=CAPACITY)
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    put_ever = set()
    seen = {"puts": 0, "put_errors": 0, "gets": 0, "hits": 0, "misses": 0, "foreign_hits": 0, "bad": 0, "max_used": 0}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if rng.random() < 0.5:
            key = rng.choice(mine)
            r = put_bytes(store, pool, slot, key, payload_for(key, MAX_PAYLOAD))
            seen["puts"] += 1
            if r.ok:
                put_ever.add(key)
            else:
                seen["put_errors"] += 1
        else:
            key = rng.choice(ALL_KEYS)
            r, data = get_bytes(store, pool, slot, key)
            seen["gets"] += 1
            if r.ok:
                seen["hits"] += 1
                seen["foreign_hits"] += key not in put_ever
                seen["bad"] += data != payload_for(key, MAX_PAYLOAD)
            elif r.status == "miss":
                seen["misses"] += 1
            else:
                seen["bad"] += 1
                print(r.status, r.message, file=sys.stderr)
        seen["max_used"] = max(seen["max_used"], store.used_bytes)
    # Everything the other process left on disk, found by a scan.
    seen["rescan_chunks"] = store.rescan()
    foreign = [k for k in ALL_KEYS if store.contains(k) and k not in put_ever]
    seen["rescan_foreign"] = len(foreign)
    seen["rescan_foreign_ok"] = 0
    for key in foreign:
        r, data = get_bytes(store, pool, slot, key)
        if r.ok and data == payload_for(key, MAX_PAYLOAD):
            seen["rescan_foreign_ok"] += 1
        elif r.status != "miss":  # the other process may have evicted it since
            seen["bad"] += 1
    stats = store.stats()
    seen.update(
        {
            k: stats[k]
            for k in ("corrupt_chunks", "write_races", "evictions", "read_errors", "write_errors", "recycled_files", "recycle_skipped")
        }
    )
    seen["capacity"] = CAPACITY
    store.close()
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
