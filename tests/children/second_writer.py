"""A second writer of a storage directory a vLLM engine is serving from: opens its own BlockStore with the engine's defaults (no refresh interval
given), writes COUNT chunks of PAYLOAD bytes in its own namespace, closes, and
prints what it wrote as JSON. Run by a driver's ``shell`` phase while the engine lives.

usage: second_writer.py STORE_DIR NAMESPACE COUNT PAYLOAD CAPACITY"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pykvcache as kv  # noqa: E402
from robust_chunkfmt import put_bytes  # noqa: E402


def main():
    store_dir, namespace, count, payload, capacity = sys.argv[1:6]
    pool = kv.StagingPool(int(payload), 1)
    slot = pool.acquire()
    store = kv.BlockStore([store_dir], pool, namespace=namespace, capacity_bytes=int(capacity), min_free_bytes=0)
    ok = sum(put_bytes(store, pool, slot, f"second-{i:03d}".encode(), bytes([i % 251]) * int(payload)).ok for i in range(int(count)))
    namespace_dir = os.path.basename(store.namespace_dir[0])
    store.close()
    print(json.dumps({"written": ok, "ns_dir": namespace_dir}))


if __name__ == "__main__":
    main()
