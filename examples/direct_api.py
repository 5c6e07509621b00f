"""The direct Python API, for serving stacks other than vLLM.

Stores a chunk, reads it back verified, prefetches another and awaits a read
from asyncio. Run it as it is (a store under ./pykvcache-example, 64 MiB at
most, removed at the end): ``python examples/direct_api.py [directory]``.
The README shows this file; tests/docs/test_readme_commands.py runs it.
"""

import asyncio
import os
import shutil
import sys

import pykvcache as kv
import pykvcache.aio

CHUNK_BYTES = 4 << 20  # one chunk of KV (a 256-token chunk of Llama-3.2-3B is 28 MiB)


def main(root: str) -> None:
    pool = kv.StagingPool(slot_bytes=CHUNK_BYTES, num_slots=4)  # hard budget: 4 slots
    store = kv.BlockStore([root], pool, namespace="example-model/bf16/chunk256",
                          capacity_bytes=64 << 20)         # LRU eviction beyond 64 MiB
    kv_bytes = os.urandom(CHUNK_BYTES)                     # stands in for a chunk of KV
    key, key2 = b"prefix-hash-0", b"prefix-hash-1"

    slot = pool.acquire(timeout=1.0)       # blocks with the GIL released, then PoolExhausted
    with pool.view(slot) as v:             # zero-copy, writable view of the slot payload
        v[:len(kv_bytes)] = kv_bytes       # (numpy.frombuffer / torch.frombuffer work too)
    store.put(key, slot, len(kv_bytes)).wait().raise_for_status()  # visible atomically
    store.put(key2, slot, len(kv_bytes)).wait().raise_for_status()

    result = store.get(key, slot).wait(timeout=5)  # read + verify into the slot
    print("get:", result.status, result.length, "bytes")  # "ok" | "miss" | "corrupt" | "error"
    with pool.view(slot) as v:
        assert v[:result.length] == kv_bytes
    print("missing key:", store.get(b"never-stored", slot).wait(timeout=5).status)

    slot2 = pool.acquire(timeout=1.0)
    handle = store.prefetch(key2, slot2)   # a get at background priority
    result2 = asyncio.run(pykvcache.aio.wait(store, handle))  # or await it in a running loop
    print("prefetch via asyncio:", result2.status)

    stats = store.stats()                  # bytes/ops per direction, latencies, fallbacks...
    print("backend:", store.backend, "| direct I/O:", store.direct_io,
          "| chunks:", len(store), "| bytes read:", stats["bytes_read"])
    pool.release(slot)
    pool.release(slot2)
    store.close()
    pool.close()


if __name__ == "__main__":
    directory = sys.argv[1] if len(sys.argv) > 1 else "pykvcache-example"
    try:
        main(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
