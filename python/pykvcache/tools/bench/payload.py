"""Deterministic chunk contents shared by every system under test, so each one
moves identical bytes and reads can be checked against what was written.
Generated outside timed windows only."""

from __future__ import annotations

import hashlib
import random
from functools import lru_cache


@lru_cache(maxsize=4)
def _base(nbytes: int) -> bytes:
    return random.Random(nbytes).randbytes(nbytes)


def payload(index: int, nbytes: int) -> bytes:
    """Incompressible bytes for chunk ``index``: one random block per size,
    rotated by a per-index offset (distinct chunks at memcpy speed)."""
    base = _base(nbytes)
    k = (index * 4099) % nbytes
    return base[k:] + base[:k]


def digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


@lru_cache(maxsize=4096)
def expected_digest(index: int, nbytes: int) -> bytes:
    return digest(payload(index, nbytes))
