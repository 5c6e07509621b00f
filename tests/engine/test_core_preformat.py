"""Preformatting: filler chunks take the free capacity, the first real puts
overwrite their files (no new file is allocated), real chunks are never
evicted while a filler remains, and fillers stay fillers across a reopen."""

import os
from pathlib import Path

import pykvcache as kv
import pytest

CHUNK = 256 << 10
FILE = kv.HEADER_BYTES + CHUNK
N = 10


def chunk_inodes(store) -> set[int]:
    return {p.stat().st_ino for d in store.namespace_dir for p in Path(d).rglob("*.kvc")}


def open_store(store_dir, pool, **kw):
    return kv.BlockStore([str(store_dir)], pool, namespace="preformat", capacity_bytes=N * FILE, **kw)


def put(store, pool, slot, key: bytes, payload: bytes) -> None:
    with pool.view(slot) as v:
        v[: len(payload)] = payload
    store.put(key, slot, len(payload)).wait(30).raise_for_status()


@pytest.mark.parametrize("backend", ["io_uring", "threads"])
def test_the_first_fill_overwrites_filler_files(store_dir, backend):
    pool = kv.StagingPool(CHUNK, 4)
    with open_store(store_dir, pool, backend=backend) as store:
        seen = []
        report = kv.preformat(store, pool, queue_depth=3, progress=lambda done, total: seen.append((done, total)))
        assert (report.chunks, report.bytes) == (N, N * FILE)
        assert seen[-1] == (N * FILE, N * FILE) and len(seen) == N
        assert len(store) == 0 and store.stats()["filler_chunks"] == N and store.used_bytes == N * FILE
        assert pool.free_slots == 4, "preformat returns its slots"
        fillers = chunk_inodes(store)
        assert len(fillers) == N

        slot = pool.acquire()
        data = {f"real-{i}".encode(): os.urandom(CHUNK) for i in range(N)}
        before = store.stats()
        for key, payload in data.items():
            put(store, pool, slot, key, payload)
        after = store.stats()
        assert after["recycled_files"] - before["recycled_files"] == N
        assert chunk_inodes(store) == fillers, "every real chunk went into a filler's file"
        assert len(store) == N and after["filler_chunks"] == 0 and store.used_bytes == N * FILE
        for key, payload in data.items():
            store.get(key, slot).wait(30).raise_for_status()
            with pool.view(slot) as v:
                assert bytes(v[:CHUNK]) == payload
        pool.release(slot)


def test_real_chunks_outlive_fillers_written_after_them_and_reopen_agrees(store_dir):
    pool = kv.StagingPool(CHUNK, 2)
    slot = pool.acquire()
    old = [f"old-{i}".encode() for i in range(3)]
    new = [f"new-{i}".encode() for i in range(N - 3)]
    with open_store(store_dir, pool) as store:
        for key in old:
            put(store, pool, slot, key, os.urandom(CHUNK))
        pool.release(slot)
        assert kv.preformat(store, pool, queue_depth=1).chunks == N - 3
        assert len(store) == 3
    # Another process (here: a reopen) sees the same fillers from the files alone.
    with open_store(store_dir, pool) as store:
        assert len(store) == 3 and store.stats()["filler_chunks"] == N - 3
        slot = pool.acquire()
        for key in new:
            put(store, pool, slot, key, os.urandom(CHUNK))
        # The fillers were evicted, not the older real chunks.
        assert all(store.contains(k) for k in old + new)
        assert store.stats()["filler_chunks"] == 0
        # Full now: nothing left to preformat, and a filler never displaces a chunk.
        pool.release(slot)
        assert kv.preformat(store, pool).chunks == 0
        assert len(store) == N


def test_preformat_refuses_bad_arguments_and_respects_max_bytes(store_dir):
    pool = kv.StagingPool(CHUNK, 2)
    with open_store(store_dir, pool) as store:
        with pytest.raises(ValueError, match="chunk_bytes"):
            kv.preformat(store, pool, chunk_bytes=CHUNK + 1)
        with pytest.raises(ValueError, match="queue_depth"):
            kv.preformat(store, pool, queue_depth=0)
        with pytest.raises(ValueError, match="max_seconds"):
            kv.preformat(store, pool, max_seconds=0)
        assert kv.preformat(store, pool, max_seconds=1e-9).chunks == 0, "the time limit stops it"
        assert kv.preformat(store, pool, max_bytes=3 * FILE + 1).chunks == 3
        assert kv.preformat(store, pool, chunk_bytes=CHUNK // 2).chunks > 0
        assert store.used_bytes <= N * FILE


def test_background_preformat_yields_to_busy_io_stops_and_survives_a_closed_store(store_dir):
    import threading
    import time

    pool = kv.StagingPool(CHUNK, 2)
    busy = threading.Event()
    busy.set()
    with open_store(store_dir, pool) as store:
        bg = kv.BackgroundPreformat(store, pool, busy=busy.is_set, poll_s=0.01).start()
        time.sleep(0.3)
        assert bg.chunks == 0 and not bg.finished.is_set(), "nothing written while serving I/O is in flight"
        assert pool.free_slots == 1, "it holds one slot"
        busy.clear()
        assert bg.finished.wait(30) and bg.error is None
        assert bg.chunks == N and store.stats()["filler_chunks"] == N and pool.free_slots == 2
        # Full: a second one ends at once.
        again = kv.BackgroundPreformat(store, pool).start()
        assert again.finished.wait(10) and again.chunks == 0

    # stop() while it waits for idle disk returns its slot.
    with open_store(store_dir.parent / "other", pool) as store:
        busy.set()
        bg = kv.BackgroundPreformat(store, pool, busy=busy.is_set, poll_s=0.01).start()
        time.sleep(0.05)
        bg.stop()
        assert bg.finished.is_set() and bg.chunks == 0 and bg.error is None and pool.free_slots == 2
        # A store closed under it: the error is recorded, the thread ends, the slot comes back.
        busy.clear()
        bg = kv.BackgroundPreformat(store, pool, busy=lambda: store.close() or False).start()
        assert bg.finished.wait(10) and bg.error is not None and pool.free_slots == 2
