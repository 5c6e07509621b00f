"""asyncio completion through the eventfd, and striping over several directories."""

import asyncio
import os

import pykvcache as kv
from pykvcache import aio

MiB = 1 << 20


def test_asyncio_awaits_many_operations(store_dir):
    pool = kv.StagingPool(MiB, 16)
    store = kv.BlockStore([str(store_dir)], pool, namespace="aio", capacity_bytes=1 << 30)
    slots = [pool.acquire() for _ in range(16)]
    for i, s in enumerate(slots):
        with pool.view(s) as v:
            v[:8] = i.to_bytes(8, "little")

    async def main():
        puts = [aio.wait(store, store.put(b"a%d" % i, s, MiB)) for i, s in enumerate(slots)]
        results = await asyncio.wait_for(asyncio.gather(*puts), 20)
        assert all(r.ok for r in results)
        gets = [aio.wait(store, store.get(b"a%d" % (15 - i), s)) for i, s in enumerate(slots)]
        results = await asyncio.wait_for(asyncio.gather(*gets), 20)
        assert all(r.ok for r in results)

    asyncio.run(main())
    for i, s in enumerate(slots):
        with pool.view(s) as v:
            assert int.from_bytes(v[:8], "little") == 15 - i


def test_chunks_are_striped_over_all_directories(tmp_path):
    dirs = [tmp_path / f"d{i}" for i in range(3)]
    pool = kv.StagingPool(64 * 1024, 1)
    store = kv.BlockStore([str(d) for d in dirs], pool, namespace="stripe", capacity_bytes=1 << 30)
    s = pool.acquire()
    for i in range(60):
        assert store.put(b"s%d" % i, s, 4096).wait(10).ok
    counts = [sum(f.endswith(".kvc") for _, _, fs in os.walk(d) for f in fs) for d in dirs]
    assert sum(counts) == 60 and min(counts) >= 8, counts
    store.close()
    reopened = kv.BlockStore([str(d) for d in dirs], pool, namespace="stripe", capacity_bytes=1 << 30)
    assert len(reopened) == 60
    assert all(reopened.get(b"s%d" % i, s).wait(10).ok for i in range(60))
