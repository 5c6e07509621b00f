"""Child process of test_robust_fuzz: hypothesis writes arbitrary contents at
a chunk's path and reads the chunk through the public API. The engine must
never crash (a crash kills only this child, and the test reports it), and
must serve data exactly when the file is a valid chunk of that key in that
namespace, judged by the independent reference decoder below.

usage: robust_fuzz_chunks.py STORE_DIR MAX_EXAMPLES LAST_INPUT_FILE"""

import json
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pykvcache as kv  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from robust_chunkfmt import (  # noqa: E402
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    MAX_KEY_BYTES,
    OFF_HEADER_CRC,
    OFF_KEY,
    crc32c,
    encode_header,
    file_len,
    namespace_fingerprint,
    parse_header,
    put_bytes,
    seal_header,
    set_field,
)

SLOT = 16 << 10
KEY = b"fuzz-victim"
OTHER_NS = b"\x01" * 16


def reference_decode(content: bytes, ns: bytes, key: bytes, max_len: int):
    """The payload a correct reader serves for `content`, or None."""
    if len(content) < HEADER_BYTES or len(content) % 4096 or len(content) > max_len:
        return None
    h = parse_header(content[:HEADER_BYTES])
    block = bytearray(content[:HEADER_BYTES])
    struct.pack_into("<I", block, OFF_HEADER_CRC, 0)
    if (h["magic"], h["version"], h["header_len"]) != (MAGIC, FORMAT_VERSION, HEADER_BYTES):
        return None
    if crc32c(bytes(block)) != h["header_crc"] or h["namespace"] != ns:
        return None
    if h["key_len"] > MAX_KEY_BYTES or content[OFF_KEY : OFF_KEY + h["key_len"]] != key:
        return None
    n = h["payload_len"]
    if file_len(n) != len(content):
        return None
    payload = content[HEADER_BYTES : HEADER_BYTES + n]
    return payload if crc32c(payload) == h["payload_crc"] else None


def chunk(ns: bytes, key: bytes, payload: bytes) -> bytes:
    pad = file_len(len(payload)) - HEADER_BYTES - len(payload)
    return encode_header(ns, key, payload) + payload + bytes(pad)


def contents(ns: bytes):
    # Empty payloads make header-only files, where length arithmetic is tightest.
    payloads = st.one_of(st.just(b""), st.binary(max_size=SLOT))
    valid = payloads.map(lambda p: chunk(ns, KEY, p))
    header_fields = st.sampled_from(["magic", "version", "header_len", "namespace", "payload_len", "payload_crc", "key_len"])
    values = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 4095, 4096, 2**32 - 1, 2**63, 2**64 - 1]))
    # Lengths around the file's real capacity and around 2**64 (where rounding wraps).
    lengths = st.one_of(st.integers(0, SLOT + 2 * 4096), st.integers(2**64 - 3 * 4096, 2**64 - 1), values)

    def tamper(c, field, value):
        b = bytearray(c[:HEADER_BYTES])
        if field in ("magic", "namespace"):
            size = 8 if field == "magic" else 16
            value = value.to_bytes(8, "little").ljust(size, b"\0")[:size]
        elif field != "payload_len":
            value &= 0xFFFFFFFF
        return bytes(seal_header(set_field(b, field, value))) + c[HEADER_BYTES:]

    def overwrite(c, edits):
        b = bytearray(c)
        for pos, byte in edits:
            if b:
                b[pos % len(b)] = byte
        return bytes(b)

    def resize(c, n):
        return c[:n] if n <= len(c) else c + bytes(n - len(c))

    return st.one_of(
        st.binary(max_size=3 * 4096 + 10),
        st.integers(0, 5).flatmap(lambda n: st.binary(min_size=n * 4096, max_size=n * 4096)),
        valid,
        st.tuples(valid, header_fields, values).map(lambda t: tamper(*t)),
        st.tuples(valid, lengths).map(lambda t: tamper(t[0], "payload_len", t[1])),
        st.tuples(valid, st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), min_size=1, max_size=4)).map(
            lambda t: overwrite(*t)
        ),
        st.tuples(valid, st.integers(0, 6 * 4096)).map(lambda t: resize(*t)),
        st.tuples(payloads, st.sampled_from([b"fuzz-victin", b"", b"x" * 40])).map(lambda t: chunk(ns, t[1], t[0])),
        payloads.map(lambda p: chunk(OTHER_NS, KEY, p)),
    )


def main():
    store_dir, max_examples, last_input = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    pool = kv.StagingPool(SLOT, 2)
    w, r = pool.acquire(), pool.acquire()
    store = kv.BlockStore([store_dir], pool, namespace="robust-fuzz", capacity_bytes=1 << 30)
    ns = namespace_fingerprint(store)
    assert put_bytes(store, pool, w, KEY, b"seed").ok
    [path] = [os.path.join(d, f) for d, _, fs in os.walk(store_dir) for f in fs if f.endswith(".kvc")]
    max_len = HEADER_BYTES + SLOT
    seen = {"ok": 0, "corrupt": 0, "miss": 0, "error": 0}

    @settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(content=contents(ns))
    def check(content):
        with open(last_input, "wb") as f:  # what to look at if the engine takes this process down
            f.write(content)
        with open(path, "wb") as f:
            f.write(content)
        with pool.view(r) as v:
            v[:] = b"\xee" * len(v)
        res = store.get(KEY, r).wait(30)
        seen[res.status] += 1
        expected = reference_decode(content, ns, KEY, max_len)
        if expected is None and len(content) > max_len and len(content) % 4096 == 0:
            # Too big for this process's slots: maybe another process's valid chunk,
            # so a miss that leaves the file alone (never served, never deleted).
            assert res.status == "miss", (res.status, res.message)
            assert os.path.exists(path)
        elif expected is None:
            assert res.status == "corrupt", (res.status, res.message)
            assert not os.path.exists(path), "a rejected file is removed"
        else:
            assert res.ok, (res.status, res.message)
            with pool.view(r) as v:
                assert bytes(v[: res.length]) == expected

    check()
    s = store.stats()
    assert s["corrupt_chunks"] == seen["corrupt"] and s["read_hits"] == seen["ok"] and s["read_misses"] == seen["miss"]
    store.close()
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
