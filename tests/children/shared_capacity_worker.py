"""Child process of tests/engine/test_core_shared_capacity.py: one of two
writers of one local storage directory, opened with the engine's defaults
(no refresh interval given). Writes its keys, then on "report" says what its
index holds, as JSON.

usage: shared_capacity_worker.py STORE_DIR NAMESPACE PREFIX COUNT CAPACITY"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pykvcache as kv  # noqa: E402
from robust_chunkfmt import put_bytes  # noqa: E402

PAYLOAD = 60 << 10


def main():
    store_dir, namespace, prefix, count, capacity = sys.argv[1:6]
    pool = kv.StagingPool(PAYLOAD, 1)
    slot = pool.acquire()
    store = kv.BlockStore([store_dir], pool, namespace=namespace, capacity_bytes=int(capacity), min_free_bytes=0)
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    errors = 0
    for i in range(int(count)):
        key = f"{prefix}-{i:03d}".encode()
        errors += not put_bytes(store, pool, slot, key, bytes([i % 251]) * PAYLOAD).ok
    print("written", flush=True)
    while sys.stdin.readline().strip() == "report":
        stats = store.stats()
        print(json.dumps({"errors": errors, "chunks": stats["chunks"], "used_bytes": stats["used_bytes"],
                          "ns_dir": os.path.basename(store.namespace_dir[0])}), flush=True)
    store.close()


if __name__ == "__main__":
    main()
