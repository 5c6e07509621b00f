"""Region I/O from Python (decision 0062): chunk payloads written from and read
into caller memory (a numpy array, a bytearray) by the engine, no staging slot;
each bounds and lifetime error forced; a corrupt chunk fails only its key; a
restart reads the chunks back. Real files, real io_uring."""

import os
from pathlib import Path

import numpy as np
import pykvcache as kv
import pytest
from pykvcache import _core

ROW = 64 << 10


def make_store(path, **kw):
    kw.setdefault("namespace", "test-ns")
    kw.setdefault("capacity_bytes", 1 << 30)
    return kv.BlockStore([str(path)], kv.StagingPool(ROW, 1), **kw)


def rows(n=4):
    """Page-aligned rows, as vLLM's CPU tier lays out its chunks."""
    raw = np.zeros(n * ROW + 4096, dtype=np.uint8)
    start = (-raw.ctypes.data) % 4096
    return raw[start : start + n * ROW].reshape(n, ROW)


@pytest.mark.parametrize("backend,direct_io", [("io_uring", "optional"), ("threads", "optional"), ("io_uring", "disabled")])
def test_round_trip_through_a_region_and_back_after_a_restart(store_dir, backend, direct_io):
    region = rows()
    region[0] = np.frombuffer(os.urandom(ROW), dtype=np.uint8)
    with make_store(store_dir, backend=backend, direct_io=direct_io) as store:
        rid = store.register_region(region)
        assert store.region_count == 1
        put = store.put_region(b"k", rid, 0, ROW)
        assert put.slot is None and put.wait(10).ok
        handle = store.get_region(b"k", rid, 2 * ROW, ROW)
        got = handle.wait(10)
        assert got.ok and got.length == ROW
        assert handle.settled(), "a read that completed is settled (only an abandoned one is not)"
        assert np.array_equal(region[2], region[0])
        store.unregister_region(rid)
        assert store.region_count == 0
    with make_store(store_dir, backend=backend, direct_io=direct_io) as store:
        rid = store.register_region(region)
        assert store.get_region(b"k", rid, 3 * ROW, ROW).wait(10).ok
        assert np.array_equal(region[3], region[0])
        store.unregister_region(rid)


def test_each_bounds_and_lifetime_error(store_dir):
    region = rows()
    store = make_store(store_dir)
    rid = store.register_region(region)
    with pytest.raises(ValueError, match="outside the region"):
        store.get_region(b"k", rid, 4 * ROW, ROW)
    with pytest.raises(ValueError, match="outside the region"):
        store.put_region(b"k", rid, 3 * ROW + 4096, ROW)
    with pytest.raises(ValueError, match="aligned"):
        store.put_region(b"k", rid, 100, 4096)
    with pytest.raises(ValueError, match="multiple of 4096"):
        store.put_region(b"k", rid, 0, ROW - 1)
    with pytest.raises(OverflowError):
        store.put_region(b"k", rid, -1, ROW)
    with pytest.raises(ValueError, match="writable"):
        store.register_region(bytes(ROW))
    with pytest.raises(ValueError, match="contiguous"):
        store.register_region(region[:, :4096])
    store.unregister_region(rid)
    with pytest.raises(kv.PykvcacheError, match="not registered"):
        store.put_region(b"k", rid, 0, ROW)
    with pytest.raises(kv.PykvcacheError, match="not registered"):
        store.unregister_region(rid)
    # The registration holds the buffer export: the exporter cannot resize it.
    grow = bytearray(2 * ROW)
    rid = store.register_region(grow)
    with pytest.raises(BufferError):
        grow.extend(b"x")
    store.close()
    with pytest.raises(kv.PykvcacheError, match="closed"):
        store.get_region(b"k", rid, 0, ROW)
    with pytest.raises(kv.PykvcacheError, match="closed"):
        store.register_region(region)
    store.unregister_region(rid)  # closing did not touch it; unregistering releases it
    grow.extend(b"x")


def test_a_flipped_payload_byte_fails_only_its_key(store_dir):
    region = rows()
    region[:2] = np.frombuffer(os.urandom(2 * ROW), dtype=np.uint8).reshape(2, ROW)
    with make_store(store_dir) as store:
        rid = store.register_region(region)
        assert store.put_region(b"bad", rid, 0, ROW).wait(10).ok
        assert store.put_region(b"good", rid, ROW, ROW).wait(10).ok
        h = _core.key_hash(b"bad")
        bad = Path(store.namespace_dir[0]) / f"{h & 0xFF:02x}" / f"{h:032x}.kvc"
        with open(bad, "r+b") as f:
            f.seek(4096 + 12345)
            b = f.read(1)
            f.seek(4096 + 12345)
            f.write(bytes([b[0] ^ 1]))
        assert store.get_region(b"bad", rid, 2 * ROW, ROW).wait(10).status == "corrupt"
        assert not store.contains(b"bad")
        assert store.get_region(b"good", rid, 3 * ROW, ROW).wait(10).ok
        assert np.array_equal(region[3], region[1])
        store.unregister_region(rid)
