"""Independent reference for the on-disk chunk format (rust/src/disk/format.rs),
plus the payload and file helpers the robustness tests share.

Written separately from the engine on purpose: the tests tamper with headers
(re-sealing them with a valid CRC) and judge what the engine served against
this reference, so a bug in the engine's decoder cannot hide behind itself."""

import os
import random
import struct

HEADER_BYTES = 4096
IO_ALIGN = 4096
MAX_KEY_BYTES = 1024
MAGIC = b"PYKVCHNK"
FORMAT_VERSION = 1

# Field offsets inside the 4 KiB header block (little-endian).
OFF_MAGIC, OFF_VERSION, OFF_HEADER_LEN, OFF_NAMESPACE = 0, 8, 12, 16
OFF_PAYLOAD_LEN, OFF_PAYLOAD_CRC, OFF_KEY_LEN, OFF_HEADER_CRC, OFF_KEY = 32, 40, 44, 48, 64


def _crc_table():
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C (Castagnoli), as the crc32c crate computes it. Pure Python: keep inputs small."""
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def round_up(n: int, align: int = IO_ALIGN) -> int:
    return -(-n // align) * align


def file_len(payload_len: int) -> int:
    return HEADER_BYTES + round_up(payload_len)


def parse_header(block: bytes) -> dict:
    return {
        "magic": block[OFF_MAGIC : OFF_MAGIC + 8],
        "version": struct.unpack_from("<I", block, OFF_VERSION)[0],
        "header_len": struct.unpack_from("<I", block, OFF_HEADER_LEN)[0],
        "namespace": block[OFF_NAMESPACE : OFF_NAMESPACE + 16],
        "payload_len": struct.unpack_from("<Q", block, OFF_PAYLOAD_LEN)[0],
        "payload_crc": struct.unpack_from("<I", block, OFF_PAYLOAD_CRC)[0],
        "key_len": struct.unpack_from("<I", block, OFF_KEY_LEN)[0],
        "header_crc": struct.unpack_from("<I", block, OFF_HEADER_CRC)[0],
    }


def seal_header(block: bytearray) -> bytearray:
    """Recomputes the header CRC, so that tampered fields pass the header check."""
    struct.pack_into("<I", block, OFF_HEADER_CRC, 0)
    struct.pack_into("<I", block, OFF_HEADER_CRC, crc32c(bytes(block[:HEADER_BYTES])))
    return block


def set_field(block: bytearray, name: str, value) -> bytearray:
    fmt = {
        "version": ("<I", OFF_VERSION),
        "header_len": ("<I", OFF_HEADER_LEN),
        "payload_len": ("<Q", OFF_PAYLOAD_LEN),
        "payload_crc": ("<I", OFF_PAYLOAD_CRC),
        "key_len": ("<I", OFF_KEY_LEN),
    }
    if name == "magic":
        block[OFF_MAGIC : OFF_MAGIC + 8] = value
    elif name == "namespace":
        block[OFF_NAMESPACE : OFF_NAMESPACE + 16] = value
    elif name == "key":
        block[OFF_KEY : OFF_KEY + len(value)] = value
    else:
        f, off = fmt[name]
        struct.pack_into(f, block, off, value)
    return block


def encode_header(namespace: bytes, key: bytes, payload: bytes) -> bytes:
    block = bytearray(HEADER_BYTES)
    block[OFF_MAGIC : OFF_MAGIC + 8] = MAGIC
    struct.pack_into("<IIQ", block, OFF_VERSION, FORMAT_VERSION, HEADER_BYTES, 0)
    block[OFF_NAMESPACE : OFF_NAMESPACE + 16] = namespace
    struct.pack_into("<QII", block, OFF_PAYLOAD_LEN, len(payload), crc32c(payload), len(key))
    block[OFF_KEY : OFF_KEY + len(key)] = key
    return bytes(seal_header(block))


def is_valid_chunk_for(data: bytes, namespace: bytes, key: bytes, served: bytes) -> bool:
    """True when `data` (a whole file) is a correct encoding of `served` as chunk `key`.

    Padding after the payload is not covered by any checksum and is never
    served, so it may hold anything."""
    n = len(served)
    return (
        len(data) == file_len(n)
        and data[:HEADER_BYTES] == encode_header(namespace, key, served)
        and data[HEADER_BYTES : HEADER_BYTES + n] == served
    )


# ---- payloads derived from the key, so any reader can check what it got


def payload_for(key: bytes, max_len: int, min_len: int = 1) -> bytes:
    rng = random.Random(key)
    return rng.randbytes(rng.randint(min_len, max_len))


# ---- files


def chunk_files(root) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".kvc"))


def temp_files(root) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.startswith(".tmp-"))


def namespace_fingerprint(store) -> bytes:
    """The 16-byte fingerprint, read back from the namespace directory name."""
    [ns_dir] = store.namespace_dir
    return bytes.fromhex(os.path.basename(ns_dir))


# ---- store round trips through a staging slot


def put_bytes(store, pool, slot: int, key: bytes, data: bytes, timeout: float = 30):
    with pool.view(slot) as v:
        v[: len(data)] = data
    return store.put(key, slot, len(data)).wait(timeout)


def get_bytes(store, pool, slot: int, key: bytes, timeout: float = 30):
    """Returns (IoResult, served bytes or None)."""
    r = store.get(key, slot).wait(timeout)
    if not r.ok:
        return r, None
    with pool.view(slot) as v:
        return r, bytes(v[: r.length])
