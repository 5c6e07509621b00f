"""Every read result says what became of its chunk file (``IoResult.miss_kind``), decided by the
engine where it judged the file; the callers above it never delete one (decision 0050).

- ``absent``: no chunk file there; the index forgot the key.
- ``corrupt``: it failed verification; the engine removed it.
- ``kept``: a sound file this store does not serve and leaves in place, indexed (another
  writer's ``verify="header"`` chunk, unknown header flags, a chunk larger than its slots).
- ``unavailable``: the file could not be read (the directory did not answer, or the read
  failed), so it was not judged; it is untouched and stays indexed.
"""

import errno
import os
import struct

import pykvcache as kv
import pytest
from fault_marks import NEEDS_FAULT_INJECTION
from robust_chunkfmt import HEADER_BYTES, chunk_files, seal_header

MiB = 1 << 20
#: Offset of the flags word in the chunk header (rust/src/disk/format.rs).
OFF_FLAGS = 52


def make_store(path, pool, **kw):
    kw.setdefault("namespace", "test-ns")
    kw.setdefault("capacity_bytes", 1 << 30)
    return kv.BlockStore([str(path)], pool, **kw)


def put(store, pool, slot, key: bytes, data: bytes):
    with pool.view(slot) as v:
        v[: len(data)] = data
    return store.put(key, slot, len(data)).wait(10)


def file_bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(params=["io_uring", "threads"])
def backend(request):
    return request.param


def test_ok_reads_and_puts_carry_no_miss_kind(store_dir, backend):
    pool = kv.StagingPool(MiB, 2)
    s = pool.acquire()
    with make_store(store_dir, pool, backend=backend) as store:
        w = put(store, pool, s, b"k", os.urandom(5000))
        assert w.ok and w.miss_kind is None
        r = store.get(b"k", s).wait(10)
        assert r.ok and r.miss_kind is None
    pool.release(s)


def test_a_chunk_not_on_disk_is_absent(store_dir, backend):
    pool = kv.StagingPool(MiB, 2)
    s = pool.acquire()
    with make_store(store_dir, pool, backend=backend) as store:
        r = store.get(b"never-written", s).wait(10)
        assert (r.status, r.miss_kind, r.errno) == ("miss", "absent", None), r
        assert put(store, pool, s, b"gone", os.urandom(5000)).ok
        [path] = chunk_files(store_dir)
        os.unlink(path)  # another node evicted it
        r = store.get(b"gone", s).wait(10)
        assert (r.status, r.miss_kind) == ("miss", "absent"), r
        assert not store.contains(b"gone")
    pool.release(s)


@pytest.mark.parametrize("verify", ["full", "header"])
def test_a_corrupt_chunk_is_removed_by_the_engine_and_says_so(store_dir, backend, verify):
    pool = kv.StagingPool(MiB, 2)
    s = pool.acquire()
    with make_store(store_dir, pool, backend=backend, verify=verify) as store:
        assert put(store, pool, s, b"bad", os.urandom(5000)).ok
        [path] = chunk_files(store_dir)
        raw = bytearray(file_bytes(path))
        raw[40] ^= 0xFF  # a header byte: every verify mode catches it
        with open(path, "wb") as f:
            f.write(raw)
        r = store.get(b"bad", s).wait(10)
        assert (r.status, r.miss_kind) == ("corrupt", "corrupt"), r
        assert not os.path.exists(path) and not store.contains(b"bad")
        assert store.stats()["corrupt_chunks"] == 1
    pool.release(s)


def _header_writers_chunk(store_dir, pool, s, key, data):
    with make_store(store_dir, pool, verify="header") as writer:
        assert put(writer, pool, s, key, data).ok


def _unknown_flag(path):
    raw = bytearray(file_bytes(path))
    flags = struct.unpack_from("<I", raw, OFF_FLAGS)[0]
    struct.pack_into("<I", raw, OFF_FLAGS, flags | 0x100)  # a flag a newer format might define
    raw[:HEADER_BYTES] = seal_header(bytearray(raw[:HEADER_BYTES]))
    with open(path, "wb") as f:
        f.write(raw)


@pytest.mark.parametrize("case", ["verify-header-writer", "unknown-flags", "larger-slots"])
def test_another_writers_chunk_is_kept_unserved_and_untouched(store_dir, backend, case):
    """Sound chunks this store cannot serve: a miss; neither the file nor the index entry is
    touched, and the writer still serves its chunk."""
    key, data = b"theirs", os.urandom(6000)
    pool = kv.StagingPool(64 << 10, 2)
    s = pool.acquire()
    if case == "larger-slots":
        big_pool = kv.StagingPool(MiB, 1)
        b = big_pool.acquire()
        with make_store(store_dir, big_pool) as writer:
            assert put(writer, big_pool, b, key, os.urandom(200 << 10)).ok
        big_pool.release(b)
        big_pool.close()
    else:
        _header_writers_chunk(store_dir, pool, s, key, data)
    [path] = chunk_files(store_dir)
    if case == "unknown-flags":
        _unknown_flag(path)
    before = file_bytes(path)
    with make_store(store_dir, pool, backend=backend) as reader:
        assert reader.contains(key)
        r = reader.get(key, s).wait(10)
        assert (r.status, r.miss_kind, r.errno) == ("miss", "kept", None), r
        assert file_bytes(path) == before, "another writer's chunk is left as it is"
        assert reader.contains(key) and reader.stats()["corrupt_chunks"] == 0
        r = reader.get(key, s).wait(10)
        assert (r.status, r.miss_kind) == ("miss", "kept"), "judged the same way every time"
    assert file_bytes(path) == before
    if case == "verify-header-writer":
        with make_store(store_dir, pool, verify="header", backend=backend) as writer:
            r = writer.get(key, s).wait(10)
            assert r.ok, r
            with pool.view(s) as v:
                assert bytes(v[: len(data)]) == data
    pool.release(s)


@NEEDS_FAULT_INJECTION
@pytest.mark.parametrize("verify", ["full", "header"])
def test_unreachable_storage_is_unavailable_and_the_chunk_stays(store_dir, backend, verify):
    """A storage errno (EIO here, injected into the transfer) says nothing about the file."""
    pool = kv.StagingPool(MiB, 2)
    s = pool.acquire()
    data = os.urandom(5000)
    with make_store(store_dir, pool) as writer:
        assert put(writer, pool, s, b"k", data).ok
    [path] = chunk_files(store_dir)
    with make_store(store_dir, pool, backend=backend, verify=verify, _fault_fail_nth=(1, errno.EIO)) as reader:
        r = reader.get(b"k", s).wait(10)
        assert (r.status, r.miss_kind, r.errno) == ("miss", "unavailable", errno.EIO), r
        assert os.path.exists(path) and reader.contains(b"k")
        r = reader.get(b"k", s).wait(10)
        assert r.ok, r
        with pool.view(s) as v:
            assert bytes(v[: len(data)]) == data
    pool.release(s)


@NEEDS_FAULT_INJECTION
@pytest.mark.parametrize("verify", ["full", "header"])
def test_a_failed_read_leaves_the_file_unjudged(store_dir, backend, verify):
    """An errno that is not a storage failure (EINVAL here): status ``error``; the file was not
    read, so not judged: ``unavailable``, untouched and still indexed."""
    pool = kv.StagingPool(MiB, 2)
    s = pool.acquire()
    with make_store(store_dir, pool) as writer:
        assert put(writer, pool, s, b"k", os.urandom(5000)).ok
    [path] = chunk_files(store_dir)
    with make_store(store_dir, pool, backend=backend, verify=verify, _fault_fail_nth=(1, errno.EINVAL)) as reader:
        r = reader.get(b"k", s).wait(10)
        assert (r.status, r.miss_kind, r.errno) == ("error", "unavailable", errno.EINVAL), r
        assert os.path.exists(path) and reader.contains(b"k")
        assert reader.get(b"k", s).wait(10).ok
    pool.release(s)
