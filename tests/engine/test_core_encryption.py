"""Chunks sealed at rest (``BlockStore(encryption_key_file=...)``, decision 0083), through the
Python API on real files and both backends: round trips, no plaintext on disk, the slot never
written by a put, chunks of no key / another key / another tenant left in place as misses of kind
``kept``, tampering found ``corrupt``, key files refused with their path and the fix, fresh
nonces on recycled and preformatted files, restarts, the previous key, the seal buffers'
backpressure, and ``pykvcache keygen``."""

import os
import re
import shutil
import struct
import time

import pykvcache as kv
import pytest
from fault_marks import NEEDS_FAULT_INJECTION
from robust_chunkfmt import HEADER_BYTES, chunk_files, crc32c

MiB = 1 << 20
# Sealed header fields (rust/src/disk/format.rs): flags, key id, tenant id, nonce, tags.
OFF_FLAGS, OFF_KEY_ID, OFF_TENANT_ID, OFF_NONCE, OFF_TAGS = 52, 1088, 1096, 1112, 1128
FLAG_SEALED = 2


@pytest.fixture(params=["io_uring", "threads"])
def backend(request):
    return request.param


def key_file(dir_, name="key", data=None, mode=0o600):
    path = os.path.join(dir_, name)
    with open(path, "wb") as f:
        f.write(os.urandom(32) if data is None else data)
    os.chmod(path, mode)
    return path


def make_store(path, pool, **kw):
    kw.setdefault("namespace", "test-ns")
    kw.setdefault("capacity_bytes", 1 << 30)
    return kv.BlockStore([str(path)], pool, **kw)


def put(store, pool, slot, key, data, tenant=b""):
    with pool.view(slot) as v:
        v[: len(data)] = data
    return store.put(key, slot, len(data), tenant=tenant).wait(30)


def get(store, pool, slot, key, length, tenant=b""):
    r = store.get(key, slot, tenant=tenant).wait(30)
    with pool.view(slot) as v:
        return r, bytes(v[:length])


def header(path) -> bytes:
    with open(path, "rb") as f:
        return f.read(HEADER_BYTES)


def files_of(store_dir):
    return {p: os.path.getsize(p) for p in chunk_files(store_dir)}


@pytest.mark.parametrize("direct_io", ["optional", "disabled"])
def test_round_trips_at_several_sizes(store_dir, tmp_path, backend, direct_io):
    pool = kv.StagingPool(3 * MiB, 2)
    a, b = pool.acquire(), pool.acquire()
    with make_store(store_dir, pool, backend=backend, direct_io=direct_io, encryption_key_file=key_file(tmp_path)) as store:
        for n in (1, 4096, MiB + 1, 3 * MiB):
            data = os.urandom(n)
            assert put(store, pool, a, b"k%d" % n, data).ok
            r, got = get(store, pool, b, b"k%d" % n, n)
            assert (r.status, r.length, got == data) == ("ok", n, True), r
        stats = store.stats()
        assert stats["sealing"] and (stats["sealed_puts"], stats["opened_gets"]) == (4, 4)
    for path in chunk_files(store_dir):
        assert struct.unpack_from("<I", header(path), OFF_FLAGS)[0] == FLAG_SEALED


def test_no_plaintext_on_disk_and_the_slot_is_not_written(store_dir, tmp_path, backend):
    pool = kv.StagingPool(MiB, 1)
    s = pool.acquire()
    pattern = (b"KNOWN-PLAINTEXT-PATTERN-%04d|" * 40000)[:MiB]
    with pool.view(s) as v:
        v[:] = pattern
    with make_store(store_dir, pool, backend=backend, encryption_key_file=key_file(tmp_path)) as store:
        # Not a whole number of blocks: a plaintext put zeroes the padding in the slot.
        assert store.put(b"k", s, MiB - 100).wait(30).ok
        with pool.view(s) as v:
            assert bytes(v) == pattern, "a sealed put wrote the caller's slot"
    [path] = chunk_files(store_dir)
    with open(path, "rb") as f:
        assert b"KNOWN-PLAINTEXT-PATTERN" not in f.read()


def test_sealed_chunks_in_segment_files_round_trip_with_no_plaintext_on_disk(store_dir, tmp_path, backend):
    """Sealing and segment files together (decisions 0083, 0086): a slot holds the sealed
    image a chunk file would, read back through another store that finds it by the segment's
    index; the plaintext is nowhere in the segment."""
    pool = kv.StagingPool(MiB, 2)
    a, b = pool.acquire(), pool.acquire()
    pattern = (b"KNOWN-PLAINTEXT-PATTERN-%04d|" * 40000)[:MiB]
    key = key_file(tmp_path)
    with make_store(store_dir, pool, backend=backend, encryption_key_file=key, segment_files=True) as store:
        for n in (4096, MiB - 100, MiB):
            assert put(store, pool, a, b"k%d" % n, pattern[:n]).ok
    assert chunk_files(store_dir) == []
    # One segment per chunk length: 8 KiB, and 1 MiB + 4 KiB (two chunks).
    segments = [os.path.join(d, f) for d, _, fs in os.walk(store_dir) for f in fs if f.endswith(".seg")]
    assert len(segments) == 2, segments
    for log in segments:
        with open(log, "rb") as f:
            assert b"KNOWN-PLAINTEXT-PATTERN" not in f.read()
    with make_store(store_dir, pool, backend=backend, encryption_key_file=key, segment_files=True) as store:
        for n in (4096, MiB - 100, MiB):
            r, got = get(store, pool, b, b"k%d" % n, n)
            assert (r.status, got == pattern[:n]) == ("ok", True), r
        assert store.stats()["opened_gets"] == 3


def test_a_planted_plaintext_chunk_is_not_ours_and_stays(store_dir, tmp_path, backend):
    pool = kv.StagingPool(MiB, 1)
    s = pool.acquire()
    with make_store(store_dir, pool, backend=backend) as plain:  # a writer without the key
        assert put(plain, pool, s, b"k", b"planted " * 512).ok
    before = files_of(store_dir)
    with make_store(store_dir, pool, backend=backend, encryption_key_file=key_file(tmp_path)) as store:
        r, _ = get(store, pool, s, b"k", 10)
        assert (r.status, r.miss_kind) == ("miss", "kept"), r
        assert "plaintext" in r.message
        assert store.stats()["not_ours_misses"] == 1
    assert files_of(store_dir) == before


def test_another_key_misses_and_deletes_nothing(store_dir, tmp_path, backend):
    pool = kv.StagingPool(MiB, 1)
    s = pool.acquire()
    with make_store(store_dir, pool, backend=backend, encryption_key_file=key_file(tmp_path, "a")) as store:
        for i in range(5):
            assert put(store, pool, s, b"k%d" % i, os.urandom(9000)).ok
    before = files_of(store_dir)
    with make_store(store_dir, pool, backend=backend, encryption_key_file=key_file(tmp_path, "b")) as store:
        for i in range(5):
            r, _ = get(store, pool, s, b"k%d" % i, 10)
            assert (r.status, r.miss_kind) == ("miss", "kept"), r
        assert (store.stats()["not_ours_misses"], store.stats()["corrupt_chunks"]) == (5, 0)
    with make_store(store_dir, pool, backend=backend) as plain:  # no key at all
        r, _ = get(plain, pool, s, b"k0", 10)
        assert (r.status, r.miss_kind) == ("miss", "kept"), r
    assert files_of(store_dir) == before


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_key_file_others_may_read_or_write_is_refused(store_dir, tmp_path, mode):
    secret = os.urandom(32)
    path = key_file(tmp_path, data=secret, mode=mode)
    pool = kv.StagingPool(MiB, 1)
    with pytest.raises(ValueError) as e:
        make_store(store_dir, pool, encryption_key_file=path)
    assert path in str(e.value) and f"chmod 600 {path}" in str(e.value), e.value
    assert secret.hex() not in str(e.value)


@pytest.mark.parametrize("size", [0, 31, 33, 64])
def test_a_key_file_of_the_wrong_size_or_kind_is_refused(store_dir, tmp_path, size):
    path = key_file(tmp_path, data=os.urandom(size))
    pool = kv.StagingPool(MiB, 1)
    with pytest.raises(ValueError, match=re.escape(f"{path} holds {size} bytes, not 32")):
        make_store(store_dir, pool, encryption_key_file=path)
    with pytest.raises(ValueError, match="not a regular file"):
        make_store(store_dir, pool, encryption_key_file=str(tmp_path))
    with pytest.raises(kv.StoreError):
        make_store(store_dir, pool, encryption_key_file=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="needs encryption_key_file"):
        make_store(store_dir, pool, encryption_previous_key_file=path)


def test_the_key_never_shows(store_dir, tmp_path):
    secret = os.urandom(32)
    pool = kv.StagingPool(MiB, 1)
    with make_store(store_dir, pool, encryption_key_file=key_file(tmp_path, data=secret)) as store:
        shown = repr(store) + repr(store.stats())
        assert secret.hex() not in shown and repr(secret) not in shown
        assert len(store.stats()["encryption_key_id"]) == 16


def _tamper(path, at, recrc):
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[at] ^= 0x20
        if recrc:  # a forger's edit: the header CRC recomputed
            struct.pack_into("<I", data, 48, 0)
            struct.pack_into("<I", data, 48, crc32c(bytes(data[:HEADER_BYTES])))
        f.seek(0)
        f.write(data)


@pytest.mark.parametrize(
    ("at", "recrc"),
    [
        (OFF_NONCE + 1, True),  # a header field bound as associated data
        (OFF_KEY_ID - 100, True),  # the key area (bound too)
        (OFF_NONCE + 1, False),  # torn header: its CRC
        (HEADER_BYTES + 12345, False),  # the payload
        (OFF_TAGS + 3, True),  # a tag
    ],
)
def test_a_flipped_bit_is_corrupt(store_dir, tmp_path, backend, at, recrc):
    pool = kv.StagingPool(2 * MiB, 1)
    s = pool.acquire()
    with make_store(store_dir, pool, backend=backend, encryption_key_file=key_file(tmp_path)) as store:
        assert put(store, pool, s, b"k", os.urandom(2 * MiB - 5)).ok
        [path] = chunk_files(store_dir)
        _tamper(path, at, recrc)
        r, _ = get(store, pool, s, b"k", 10)
        assert (r.status, r.miss_kind) == ("corrupt", "corrupt"), r
        assert not os.path.exists(path)
        assert store.stats()["auth_failures"] == (0 if not recrc and at < HEADER_BYTES else 1)


def test_a_sealed_file_moved_to_another_tenant_is_a_miss_not_corrupt(tmp_path, backend):
    pool = kv.StagingPool(MiB, 1)
    s = pool.acquire()
    key = key_file(tmp_path)
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir(mode=0o700)
    b_dir.mkdir(mode=0o700)
    data = os.urandom(70000)
    with make_store(a_dir, pool, backend=backend, encryption_key_file=key) as store:
        assert put(store, pool, s, b"k", data, tenant=b"alice").ok
        r, got = get(store, pool, s, b"k", len(data), tenant=b"alice")
        assert r.ok and got == data
        r, _ = get(store, pool, s, b"k", 10, tenant=b"bob")
        assert (r.status, r.miss_kind) == ("miss", "kept"), r
        [src] = chunk_files(a_dir)
        ns_dir = store.namespace_dir[0]
    with make_store(b_dir, pool, backend=backend, encryption_key_file=key) as store:
        dst = os.path.join(store.namespace_dir[0], os.path.relpath(src, ns_dir))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst)
        r, _ = get(store, pool, s, b"k", 10, tenant=b"bob")
        assert (r.status, r.miss_kind) == ("miss", "kept"), r
        assert "another tenant" in r.message and os.path.exists(dst)
        r, got = get(store, pool, s, b"k", len(data), tenant=b"alice")
        assert r.ok and got == data


def _nonces(store_dir):
    out = set()
    for path in chunk_files(store_dir):
        h = header(path)
        out.add((h[OFF_KEY_ID : OFF_KEY_ID + 8], h[OFF_NONCE : OFF_NONCE + 12]))
    return out


@pytest.mark.parametrize("preformatted", [False, True])
def test_recycled_and_preformatted_files_get_fresh_nonces(store_dir, tmp_path, preformatted):
    chunk = 256 << 10
    pool = kv.StagingPool(chunk, 2)
    cap = 6 * kv._core.chunk_file_bytes(chunk)
    with make_store(store_dir, pool, capacity_bytes=cap, encryption_key_file=key_file(tmp_path)) as store:
        if preformatted:
            assert kv.preformat(store, pool).chunks == 6
        seen = _nonces(store_dir)
        s = pool.acquire()
        for i in range(60):
            assert put(store, pool, s, b"k%d" % i, os.urandom(chunk)).ok
            path = next(p for p in chunk_files(store_dir) if os.path.basename(p).startswith("%032x" % kv._core.key_hash(b"k%d" % i)))
            h = header(path)
            pair = (h[OFF_KEY_ID : OFF_KEY_ID + 8], h[OFF_NONCE : OFF_NONCE + 12])
            assert pair not in seen, f"put {i} repeated a (key id, nonce) pair"
            seen.add(pair)
        assert store.stats()["recycled_files"] >= 50


def test_a_restart_with_the_same_key_keeps_every_hit(store_dir, tmp_path, backend):
    pool = kv.StagingPool(MiB, 1)
    s = pool.acquire()
    key = key_file(tmp_path)
    data = {b"k%d" % i: os.urandom(1000 * (i + 1)) for i in range(8)}
    with make_store(store_dir, pool, backend=backend, encryption_key_file=key) as store:
        for k, d in data.items():
            assert put(store, pool, s, k, d, tenant=b"t").ok
    with make_store(store_dir, pool, backend=backend, encryption_key_file=key) as store:
        for k, d in data.items():
            r, got = get(store, pool, s, k, len(d), tenant=b"t")
            assert r.ok and got == d, r
        assert store.stats()["opened_gets"] == len(data)


def test_the_previous_key_reads_and_new_puts_use_the_current_one(store_dir, tmp_path, backend):
    pool = kv.StagingPool(MiB, 1)
    s = pool.acquire()
    key_a, key_b = key_file(tmp_path, "a"), key_file(tmp_path, "b")
    old = os.urandom(5000)
    with make_store(store_dir, pool, backend=backend, encryption_key_file=key_a) as store:
        assert put(store, pool, s, b"old", old).ok
        id_a = store.stats()["encryption_key_id"]
    with make_store(store_dir, pool, backend=backend, encryption_key_file=key_b, encryption_previous_key_file=key_a) as store:
        st = store.stats()
        assert (st["encryption_previous_key_id"], st["encryption_key_id"] != id_a) == (id_a, True)
        r, got = get(store, pool, s, b"old", len(old))
        assert r.ok and got == old, r
        assert put(store, pool, s, b"new", os.urandom(5000)).ok
        new_path = next(p for p in chunk_files(store_dir) if os.path.basename(p).startswith("%032x" % kv._core.key_hash(b"new")))
        assert header(new_path)[OFF_KEY_ID : OFF_KEY_ID + 8].hex() == st["encryption_key_id"]


@NEEDS_FAULT_INJECTION
def test_a_put_waits_for_a_seal_buffer_then_times_out_never_deadlocks(store_dir, tmp_path):
    n = 16 * MiB
    pool = kv.StagingPool(n, 3)
    slots = [pool.acquire() for _ in range(3)]
    for s in slots:
        with pool.view(s) as v:
            v[:] = os.urandom(n)
    # 4 KiB per transfer: a 16 MiB put holds its seal buffer for ~0.1 s here.
    kw = dict(encryption_key_file=key_file(tmp_path), seal_buffers=1, chunk_workers=1, _fault_max_transfer=4096)
    with make_store(store_dir, pool, submit_timeout=0.02, **kw) as store:
        first = store.put(b"a", slots[0], n)
        started = time.monotonic()
        with pytest.raises(kv.PoolExhausted, match="seal buffer"):
            store.put(b"b", slots[1], n)
        assert time.monotonic() - started >= 0.015, "it waited for the submit timeout"
        assert first.wait(30).ok
    with make_store(store_dir, pool, **kw) as store:
        handles = [store.put(b"c%d" % i, s, n) for i, s in enumerate(slots)]  # each waits its turn
        assert all(h.wait(60).ok for h in handles)
        assert store.stats()["seal_buffers_free"] == 1


def test_keygen_writes_a_private_key_once(store_dir, tmp_path):
    from pykvcache.tools.cli import main

    path = tmp_path / "new.key"
    assert main(["keygen", str(path)]) == 0
    assert (os.stat(path).st_mode & 0o777, os.path.getsize(path)) == (0o600, 32)
    first = path.read_bytes()
    assert main(["keygen", str(path)]) == 1 and path.read_bytes() == first, "never overwritten"
    pool = kv.StagingPool(MiB, 1)
    with make_store(store_dir, pool, encryption_key_file=path) as store:
        s = pool.acquire()
        assert put(store, pool, s, b"k", b"x" * 100).ok
