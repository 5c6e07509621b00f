"""Child process of tests/shared_fs: one "node" of two sharing a store
directory on a shared filesystem (each through its own mount). Writes keys of
its range, reads keys of both ranges, checks every byte it is served against
the payload the key determines, and reports what it saw as JSON.

usage: shared_fs_worker.py SCENARIO.json
scenario: dir, first, last, seconds, seed, capacity, [refresh_interval_s], [read_share],
[min_puts] (goes on past ``seconds`` until this many puts, for at most 10x as long:
on a busy host a fixed time may write too little to fill the capacity)"""

import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pykvcache as kv  # noqa: E402
from robust_chunkfmt import get_bytes, payload_for, put_bytes  # noqa: E402

NAMESPACE = "shared-fs"
ALL_KEYS = [b"shared-%03d" % i for i in range(300)]
MAX_PAYLOAD = 64 << 10


def main():
    sc = json.load(open(sys.argv[1]))
    mine = ALL_KEYS[sc["first"] : sc["last"]]
    rng = random.Random(sc["seed"])
    pool = kv.StagingPool(MAX_PAYLOAD, 1)
    slot = pool.acquire()
    extra = {}
    if sc.get("refresh_interval_s") is not None:
        extra["refresh_interval_s"] = sc["refresh_interval_s"]
    store = kv.BlockStore([sc["dir"]], pool, namespace=NAMESPACE, capacity_bytes=sc["capacity"], **extra)
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    put_ever = set()
    seen = {"puts": 0, "put_errors": 0, "gets": 0, "hits": 0, "misses": 0, "foreign_hits": 0, "bad": 0, "max_used": 0, "failures": []}
    began = time.monotonic()
    deadline, cap = began + sc["seconds"], began + 10 * sc["seconds"]
    min_puts = sc.get("min_puts", 0)
    while (time.monotonic() < deadline or seen["puts"] < min_puts) and time.monotonic() < cap:
        if rng.random() >= sc.get("read_share", 0.5):
            key = rng.choice(mine)
            r = put_bytes(store, pool, slot, key, payload_for(key, MAX_PAYLOAD))
            seen["puts"] += 1
            if r.ok:
                put_ever.add(key)
            else:
                seen["put_errors"] += 1
                # In the result, so that a failing test says why (a CI run
                # once had one put error and no message to tell what it was).
                seen["failures"].append(f"put {r.status}: {r.message}"[:300])
        else:
            key = rng.choice(ALL_KEYS)
            store.probe(key)  # what the vLLM manager does on an index miss
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
                seen["failures"].append(f"get {r.status}: {r.message}"[:300])
        seen["max_used"] = max(seen["max_used"], store.used_bytes)
    stats = store.stats()
    seen.update(
        {
            k: stats[k]
            for k in (
                "corrupt_chunks",
                "write_races",
                "evictions",
                "read_errors",
                "write_errors",
                "recycled_files",
                "recycle_skipped",
                "shared_capacity_refused",
            )
        }
    )
    store.close()
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
