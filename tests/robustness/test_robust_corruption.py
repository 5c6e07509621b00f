"""Corruption and hostile files in the store: bit flips, truncation, header
tampering (re-sealed with a valid header CRC), foreign files, chunks of
another namespace, symlinks, FIFOs and zero-length files. Every one is a
corrupt read (counted, the file removed) or a miss, never served."""

import os
import random
import shutil
import threading

import pykvcache as kv
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from robust_chunkfmt import (
    HEADER_BYTES,
    chunk_files,
    file_len,
    get_bytes,
    namespace_fingerprint,
    payload_for,
    put_bytes,
    seal_header,
    set_field,
)

MAX_PAYLOAD = 20_000
FUZZ = settings(max_examples=150, deadline=None, database=None, derandomize=True)


class Bench:
    """One store, a write slot and a separate read slot (pre-filled with junk
    so that a read that served nothing cannot pass for one that served data)."""

    def __init__(self, root, namespace="robust-corrupt", capacity=1 << 30, **kw):
        self.root = root
        self.pool = kv.StagingPool(64 << 10, 2)
        self.w, self.r = self.pool.acquire(), self.pool.acquire()
        self.store = kv.BlockStore([str(root)], self.pool, namespace=namespace, capacity_bytes=capacity, **kw)
        self.paths = {}

    def put(self, key: bytes, payload: bytes) -> str:
        before = set(chunk_files(self.root)) if key not in self.paths else None
        self.store.evict(key)  # a put of an existing chunk keeps the old file (benign race rule)
        assert put_bytes(self.store, self.pool, self.w, key, payload).ok
        if before is not None:
            [self.paths[key]] = set(chunk_files(self.root)) - before
        return self.paths[key]

    def get(self, key: bytes):
        with self.pool.view(self.r) as v:
            v[:] = b"\xee" * len(v)
        return get_bytes(self.store, self.pool, self.r, key)

    def corrupt_count(self) -> int:
        return self.store.stats()["corrupt_chunks"]

    def expect_rejected(self, key: bytes, path: str):
        before = self.corrupt_count()
        r, data = self.get(key)
        assert r.status == "corrupt" and data is None, (r.status, r.message)
        assert self.corrupt_count() == before + 1, "every corrupt read is counted"
        assert not os.path.lexists(path), "a corrupt file is removed"
        assert not self.store.contains(key)
        assert self.get(key)[0].status == "miss", "and is a plain miss afterwards"


@pytest.fixture
def bench(store_dir):
    b = Bench(store_dir)
    yield b
    b.store.close()


def test_bit_flips_anywhere_served_data_depends_on_are_detected(bench):
    flips = {"header": 0, "payload": 0, "padding": 0}

    @FUZZ
    @given(
        payload=st.binary(min_size=1, max_size=MAX_PAYLOAD),
        region=st.sampled_from(sorted(flips)),
        where=st.floats(0, 1, exclude_max=True),
        bit=st.integers(0, 7),
    )
    def check(payload, region, where, bit):
        padding = file_len(len(payload)) - HEADER_BYTES - len(payload)
        assume(region != "padding" or padding > 0)
        start, size = {
            "header": (0, HEADER_BYTES),
            "payload": (HEADER_BYTES, len(payload)),
            "padding": (HEADER_BYTES + len(payload), padding),
        }[region]
        offset = start + int(where * size)
        path = bench.put(b"victim", payload)
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ (1 << bit)]))
        flips[region] += 1
        if region == "padding":
            # Padding after the payload is outside every checksum, and never served.
            r, data = bench.get(b"victim")
            assert r.ok and data == payload
        else:
            bench.expect_rejected(b"victim", path)

    check()
    print("bit flips:", flips, "corrupt reads:", bench.corrupt_count())
    assert min(flips.values()) > 20 and bench.corrupt_count() == flips["header"] + flips["payload"]


def test_truncated_or_extended_files_are_rejected(bench):
    @FUZZ
    @given(payload=st.binary(min_size=1, max_size=MAX_PAYLOAD), cut=st.floats(0, 1, exclude_max=True), grow=st.integers(-1, 8192))
    def check(payload, cut, grow):
        path = bench.put(b"victim", payload)
        size = file_len(len(payload))
        new_size = int(cut * size) if grow < 0 else size + 1 + grow
        os.truncate(path, new_size)
        bench.expect_rejected(b"victim", path)

    check()


FIELDS = {
    "magic": st.binary(min_size=8, max_size=8),
    "version": st.integers(0, 2**32 - 1),
    "header_len": st.integers(0, 2**32 - 1),
    "namespace": st.binary(min_size=16, max_size=16),
    "payload_len": st.integers(0, 2**64 - 1),
    "payload_crc": st.integers(0, 2**32 - 1),
    "key_len": st.integers(0, 2**32 - 1),
    "key": st.binary(min_size=6, max_size=6),  # same length as b"victim"
}


def test_header_tampering_with_a_valid_header_crc_is_rejected(bench):
    seen = set()

    @FUZZ
    @given(
        payload=st.binary(min_size=1, max_size=MAX_PAYLOAD),
        tamper=st.sampled_from(sorted(FIELDS)).flatmap(lambda name: st.tuples(st.just(name), FIELDS[name])),
    )
    def check(payload, tamper):
        name, value = tamper
        path = bench.put(b"victim", payload)
        with open(path, "r+b") as f:
            original = f.read(HEADER_BYTES)
            block = seal_header(set_field(bytearray(original), name, value))
            f.seek(0)
            f.write(block)
        if bytes(block) == original:  # the "tampered" value was the real one
            r, data = bench.get(b"victim")
            assert r.ok and data == payload
            return
        seen.add(name)
        bench.expect_rejected(b"victim", path)

    check()
    assert seen == set(FIELDS)


def test_foreign_files_and_zero_length_files_at_a_chunk_path_are_rejected(bench):
    @FUZZ
    @given(content=st.one_of(st.binary(max_size=3 * 4096), st.integers(0, 3).map(lambda n: os.urandom(n * 4096))))
    def check(content):
        path = bench.put(b"victim", b"real")
        with open(path, "wb") as f:
            f.write(content)
        bench.expect_rejected(b"victim", path)

    check()
    path = bench.put(b"victim", b"real")
    open(path, "wb").close()
    bench.expect_rejected(b"victim", path)


def test_foreign_files_named_like_chunks_are_never_served_and_evicted_first(store_dir):
    b = Bench(store_dir, capacity=64 << 10)
    ns_dir = b.store.namespace_dir[0]
    rng = random.Random(3)
    planted = []
    for _ in range(8):
        name = "%032x.kvc" % rng.getrandbits(128)
        path = os.path.join(ns_dir, name[-6:-4], name)
        with open(path, "wb") as f:
            f.write(rng.randbytes(rng.choice([0, 100, 4096, 8192])))
        os.utime(path, (1, 1))  # older than anything the store writes
        planted.append(path)
    b.store.close()
    b = Bench(store_dir, capacity=64 << 10)
    assert len(b.store) == 8, "a scan indexes files by name"
    # Five 12 KiB chunks fit in 64 KiB; the sixth must push out every foreign
    # file (all older) and then the oldest real chunk, nothing else.
    keys = [b"k%d" % i for i in range(6)]
    for key in keys:
        b.put(key, payload_for(key, 8000, 8000))
    assert not any(os.path.exists(p) for p in planted), "foreign files go before any real chunk"
    assert b.get(keys[0])[0].status == "miss"
    for key in keys[1:]:
        r, data = b.get(key)
        assert r.ok and data == payload_for(key, 8000, 8000)
    s = b.store.stats()
    assert s["evictions"] == 8 + 1 and s["corrupt_chunks"] == 0 and s["read_hits"] == 5
    b.store.close()


def test_chunks_of_another_namespace_are_rejected(store_dir):
    mine, other = Bench(store_dir), Bench(store_dir, namespace="robust-other")
    assert namespace_fingerprint(mine.store) != namespace_fingerprint(other.store)
    payload = payload_for(b"victim", MAX_PAYLOAD)
    theirs = other.put(b"victim", payload)
    ours = os.path.join(mine.store.namespace_dir[0], os.path.relpath(theirs, other.store.namespace_dir[0]))
    shutil.copyfile(theirs, ours)
    mine.store.rescan()
    assert mine.store.contains(b"victim")
    mine.expect_rejected(b"victim", ours)
    r, data = other.get(b"victim")
    assert r.ok and data == payload, "the owner's copy is untouched"
    mine.store.close()
    other.store.close()


def test_symlinks_in_the_store_are_never_followed(store_dir, tmp_path):
    bench = Bench(store_dir)
    payload = payload_for(b"victim", MAX_PAYLOAD)
    path = bench.put(b"victim", payload)
    outside = tmp_path / "outside"
    outside.mkdir()
    valid_copy = outside / os.path.basename(path)
    shutil.copyfile(path, valid_copy)  # a perfectly valid chunk of this key, outside the store
    for target in [valid_copy, "/etc/hostname", outside / "missing"]:
        if os.path.lexists(path):
            os.unlink(path)
        os.symlink(target, path)
        bench.expect_rejected(b"victim", path)
    assert valid_copy.read_bytes()[:8] == b"PYKVCHNK", "the link is removed, not its target"
    # A scan does not index symlinks named like chunks.
    os.symlink(valid_copy, path)
    assert bench.store.rescan() == 0 and not bench.store.contains(b"victim")
    os.unlink(path)
    # A symlinked shard directory would be followed by path lookups: refused at open.
    shard = os.path.dirname(path)
    shutil.rmtree(shard)
    os.symlink(outside, shard)
    bench.store.close()
    with pytest.raises(ValueError, match="symlink"):
        Bench(store_dir)


@pytest.mark.parametrize("direct_io", ["optional", "disabled"])
def test_a_fifo_at_a_chunk_path_does_not_hang_a_read(store_dir, direct_io):
    bench = Bench(store_dir, direct_io=direct_io)
    path = bench.put(b"victim", b"real")
    os.unlink(path)
    os.mkfifo(path, 0o600)
    result = []
    t = threading.Thread(target=lambda: result.append(bench.get(b"victim")), daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():  # unblock the reader so that the test can report instead of hanging
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail("get() blocked opening a FIFO planted at a chunk path")
    r = result[0][0]
    assert r.status == "corrupt" and not os.path.lexists(path), r.message
