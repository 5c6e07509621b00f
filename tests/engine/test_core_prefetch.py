"""Prefetch: a read at background priority, on real files through both backends."""

import os

import pykvcache as kv
import pytest

MiB = 1 << 20


def _burst_store(store_dir, backend, n, *, queue_depth=2, io_threads=2):
    """A store holding n + 1 chunks of 2 MiB, and slots zeroed to read them into."""
    pool = kv.StagingPool(2 * MiB, n + 1)
    slots = [pool.acquire() for _ in range(n + 1)]
    keys = [f"p{i}".encode() for i in range(n + 1)]
    data = [os.urandom(2 * MiB) for _ in keys]
    store = kv.BlockStore(
        [str(store_dir)],
        pool,
        namespace="prefetch",
        capacity_bytes=1 << 30,
        backend=backend,
        queue_depth=queue_depth,
        io_threads=io_threads,
    )
    for slot, key, payload in zip(slots, keys, data):
        with pool.view(slot) as v:
            v[:] = payload
        store.put(key, slot, len(payload)).wait(30).raise_for_status()
    for slot in slots:
        with pool.view(slot) as v:
            v[:] = bytes(2 * MiB)
    return pool, slots, keys, data, store


@pytest.mark.parametrize("backend", ["io_uring", "threads"])
def test_a_get_overtakes_a_burst_of_prefetches(store_dir, backend):
    n = 24
    # Depth 2 (io_uring) / two threads: background reads may hold one place, so
    # the get always has one, whatever is queued before it.
    pool, slots, keys, data, store = _burst_store(store_dir, backend, n)
    with store:
        burst = [store.prefetch(key, slot) for key, slot in zip(keys[:n], slots[:n])]
        demand = store.get(keys[n], slots[n])
        assert demand.op == "get" and burst[0].op == "prefetch"
        demand.wait(60).raise_for_status()
        pending = sum(not h.done() for h in burst)
        # FIFO service would finish the get after (nearly) the whole burst.
        assert pending >= n // 2, f"the get waited behind {n - pending} of {n} prefetches"
        for h in burst:
            h.wait(60).raise_for_status()
        for slot, payload in zip(slots, data):
            with pool.view(slot) as v:
                assert bytes(v) == payload
        s = store.stats()
        assert s["prefetches"] == n and s["reads"] == n + 1 and s["read_hits"] == n + 1
    for slot in slots:
        pool.release(slot)


def test_prefetch_reports_misses_and_corruption_like_get(store_dir):
    pool = kv.StagingPool(MiB, 2)
    a, b = pool.acquire(), pool.acquire()
    with kv.BlockStore([str(store_dir)], pool, namespace="prefetch", capacity_bytes=1 << 30) as store:
        assert store.prefetch(b"absent", a).wait(10).status == "miss"
        with pool.view(a) as v:
            v[:] = os.urandom(MiB)
        store.put(b"k", a, MiB).wait(10).raise_for_status()
        (path,) = [os.path.join(d, f) for d, _, fs in os.walk(store_dir) for f in fs if f.endswith(".kvc")]
        with open(path, "r+b") as f:
            f.seek(4096 + 1234)
            byte = f.read(1)
            f.seek(4096 + 1234)
            f.write(bytes([byte[0] ^ 0xFF]))
        r = store.prefetch(b"k", b).wait(10)
        assert r.status == "corrupt" and not store.contains(b"k")
        assert store.stats()["prefetches"] == 2
    pool.release(a)
    pool.release(b)


@pytest.mark.parametrize("backend", ["io_uring", "threads"])
def test_a_promoted_prefetch_overtakes_the_rest_of_its_burst(store_dir, backend):
    # A preload its request now needs: promoted, it is served with demand
    # reads instead of after every prefetch queued before it.
    n = 24
    pool, slots, keys, data, store = _burst_store(store_dir, backend, n)
    with store:
        burst = [store.prefetch(key, slot) for key, slot in zip(keys[:n], slots[:n])]
        needed = store.prefetch(keys[n], slots[n])
        assert needed.promote() is True
        assert needed.promote() is False, "promoted already"
        needed.wait(60).raise_for_status()
        pending = sum(not h.done() for h in burst)
        # Unpromoted it is the last of the background queue (0 pending then).
        assert pending >= n // 2, f"the promoted prefetch waited behind {n - pending} of {n} prefetches"
        assert needed.promote() is False, "done"
        for h in burst:
            h.wait(60).raise_for_status()
        for slot, payload in zip(slots, data):
            with pool.view(slot) as v:
                assert bytes(v) == payload
        s = store.stats()
        assert s["promotions"] == 1 and s["prefetches"] == n + 1 and s["read_hits"] == n + 1
        # Gets and puts are demand work already: nothing to promote.
        got = store.get(keys[0], slots[0])
        assert got.promote() is False
        got.wait(60).raise_for_status()
        assert store.stats()["promotions"] == 1
    for slot in slots:
        pool.release(slot)


@pytest.mark.parametrize("backend", ["io_uring", "threads"])
def test_a_background_byte_budget_keeps_prefetches_moving_and_gets_first(store_dir, backend):
    # Budget below one chunk: one prefetch at a time still runs (the bound
    # never stops them), and a get issued behind the burst overtakes it.
    n = 16
    pool, slots, keys, data, store = _burst_store(store_dir, backend, n, queue_depth=8, io_threads=8)
    with store:
        assert store.background_budget is None
        store.set_background_budget(4096)
        assert store.background_budget == 4096
        burst = [store.prefetch(key, slot) for key, slot in zip(keys[:n], slots[:n])]
        demand = store.get(keys[n], slots[n])
        demand.wait(60).raise_for_status()
        pending = sum(not h.done() for h in burst)
        assert pending >= n // 2, f"the get waited behind {n - pending} of {n} prefetches"
        # Raised at run time: the queued prefetches start at once.
        store.set_background_budget(64 * MiB)
        for h in burst:
            h.wait(60).raise_for_status()
        for slot, payload in zip(slots, data):
            with pool.view(slot) as v:
                assert bytes(v) == payload
        store.set_background_budget(None)
        assert store.background_budget is None
        assert store.stats()["read_hits"] == n + 1
    for slot in slots:
        pool.release(slot)
