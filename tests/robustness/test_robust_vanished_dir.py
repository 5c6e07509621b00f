"""A storage directory that goes away under a running store and comes back.

`rm -rf` of the storage directory (a cleanup job, an operator), and a filesystem
unmounted from the directory that was its mountpoint: while it is gone the
directory is unavailable (puts skipped and counted, its breaker open, one
warning) and the store creates nothing there; once it is back, stores succeed
again within seconds, without a restart, the index rebuilt from what is there.
Real files, real io_uring; the mount is a real FUSE passthrough
(tests/helpers/stall_fs.py)."""

from __future__ import annotations

import logging
import os
import shutil
import time

import pykvcache as kv
import pytest
from robust_chunkfmt import get_bytes, put_bytes
from stall_fs import StallFs, skip_reason

PAYLOAD = 60 << 10
FILE_LEN = 4096 + PAYLOAD
BACK_WITHIN_S = 10.0


def data(key: bytes) -> bytes:
    return (key * (PAYLOAD // len(key) + 1))[:PAYLOAD]


def chunk_files(root) -> int:
    return sum(1 for _, _, files in os.walk(root) for f in files if f.endswith(".kvc"))


def put_until_ok(store, pool, slot, key: bytes) -> float:
    t0 = time.monotonic()
    while True:
        r = put_bytes(store, pool, slot, key, data(key))
        if r.ok:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < 2 * BACK_WITHIN_S, f"no put succeeds after the directory came back: {r.message}"
        time.sleep(0.05)


def wait_for(cond, timeout: float = 3.0) -> bool:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)
    return cond()


def test_a_deleted_storage_directory_is_skipped_never_recreated_and_used_again_once_back(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pykvcache")
    root = tmp_path / "kv"
    pool = kv.StagingPool(PAYLOAD, 1)
    slot = pool.acquire()
    store = kv.BlockStore([str(root)], pool, namespace="vanish", capacity_bytes=64 * FILE_LEN, min_free_bytes=0)
    try:
        for i in range(4):
            assert put_bytes(store, pool, slot, b"old-%d" % i, data(b"old-%d" % i)).ok
        shutil.rmtree(root)
        results = []
        for i in range(25):  # 2.5 s: the breaker's probe looks every second meanwhile
            results.append(put_bytes(store, pool, slot, b"gone-%d" % i, data(b"gone-%d" % i)))
            time.sleep(0.1)
            assert not root.exists(), "the store re-created its deleted storage directory"
        assert not any(r.ok for r in results)
        assert "put skipped" in results[-1].message, results[-1].message
        s = store.stats()
        assert s["breaker_open_dirs"] == 1 and s["breaker_skipped_puts"] >= 24, s
        store.log_notices()
        gone = [m for m in caplog.messages if "is gone" in m]
        assert len(gone) == 1, caplog.messages  # one warning, however long it stays gone

        root.mkdir(mode=0o700)  # an operator makes it again: a new directory at the path
        assert put_until_ok(store, pool, slot, b"new-0") <= BACK_WITHIN_S
        r, got = get_bytes(store, pool, slot, b"new-0")
        assert r.ok and got == data(b"new-0")
        assert get_bytes(store, pool, slot, b"old-1")[0].status == "miss"
        assert wait_for(lambda: store.stats()["chunks"] == chunk_files(root) == 1), (store.stats()["chunks"], chunk_files(root))
        store.log_notices()
        assert any("the directory is back" in m for m in caplog.messages), caplog.messages
    finally:
        store.close()


@pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))
def test_an_unmounted_filesystem_leaves_its_mountpoint_untouched_and_its_chunks_serve_again_once_remounted(tmp_path):
    pool = kv.StagingPool(PAYLOAD, 1)
    slot = pool.acquire()
    fs = StallFs(tmp_path).__enter__()
    store = kv.BlockStore([str(fs.mount_point)], pool, namespace="mounted", capacity_bytes=64 * FILE_LEN, min_free_bytes=0)
    try:
        for i in range(3):
            assert put_bytes(store, pool, slot, b"kept-%d" % i, data(b"kept-%d" % i)).ok
        fs.__exit__(None, None, None)  # unmounted: the mountpoint is a plain, empty directory again
        assert not os.path.ismount(fs.mount_point) and os.listdir(fs.mount_point) == []
        for i in range(25):
            assert not put_bytes(store, pool, slot, b"gone-%d" % i, data(b"gone-%d" % i)).ok
            time.sleep(0.1)
        assert os.listdir(fs.mount_point) == [], "the store wrote into the mountpoint of an unmounted filesystem"
        assert store.stats()["breaker_open_dirs"] == 1

        fs = StallFs(tmp_path).__enter__()  # mounted again: the same backing files
        assert put_until_ok(store, pool, slot, b"kept-new") <= BACK_WITHIN_S
        for i in range(3):  # what the filesystem held is indexed and served again
            r, got = get_bytes(store, pool, slot, b"kept-%d" % i)
            assert r.ok and got == data(b"kept-%d" % i), r.message
        assert wait_for(lambda: store.stats()["chunks"] == 4), store.stats()["chunks"]
    finally:
        store.close()
        fs.__exit__(None, None, None)
