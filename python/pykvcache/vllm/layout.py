"""Byte layout of one staging slot (and of one chunk file's payload).

A slot holds one chunk of one KV cache group for every worker rank::

    | rank 0 row | rank 1 row | ... | rank W-1 row |
    row = | ref 0: sub-block 0 .. B-1 | ref 1: sub-block 0 .. B-1 | ... | zero pad |

where a *ref* is one layer's (or one shared tensor's) page of a group, B is
``blocks_per_chunk`` and every sub-block is one GPU block's page of that ref.
Each rank writes only its own row, so TP ranks never touch each other's bytes,
and one file per chunk serves every rank. Rows are page-aligned so that CUDA
copies and O_DIRECT never straddle a row boundary unaligned.

With a parallelism-agnostic layout (``canonical_layout`` where vLLM certifies
it, :mod:`pykvcache.vllm.spec`) there is one row that every rank shares: each
sub-block is one block's *canonical* page (vLLM's ``CanonicalPageMapping``:
the page the whole model would have at TP=1) and each rank writes and reads
its runs of it, so the bytes do not depend on the parallelism::

    row = | ref 0: canonical page of sub-block 0 .. B-1 | ref 1: ... | zero pad |
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from pykvcache._core import IO_ALIGN

#: Rows start at the engine's I/O alignment.
ROW_ALIGN = IO_ALIGN


def round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


@dataclass(frozen=True)
class ChunkLayout:
    blocks_per_chunk: int
    #: One worker's KV bytes for one GPU block over all offloaded layers
    #: (vLLM's ``worker_kv_bytes_per_block``): an upper bound for any group.
    bytes_per_block: int
    world_size: int
    #: Every rank writes its runs of one shared canonical row (``world_size`` is 1).
    ranks_share_row: bool = False

    def __post_init__(self) -> None:
        if self.bytes_per_block <= 0:
            raise ValueError("KV bytes per block is 0: the engine has no KV cache to offload")
        if self.blocks_per_chunk <= 0 or self.world_size <= 0:
            raise ValueError(f"invalid chunk layout {self}")

    @property
    def row_bytes(self) -> int:
        return self.bytes_per_block * self.blocks_per_chunk

    @property
    def row_stride(self) -> int:
        return round_up(self.row_bytes, ROW_ALIGN)

    @property
    def payload_bytes(self) -> int:
        """Bytes of one chunk: one row per rank (what is written to disk)."""
        return self.row_stride * self.world_size

    def row_offset(self, rank: int) -> int:
        if self.ranks_share_row and rank >= 0:
            return 0
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        return rank * self.row_stride


_SAFE = re.compile(r"[^A-Za-z0-9_-]+")


def staging_shm_name(engine_id: str, namespace: str) -> str:
    """Name of the staging shared-memory file, identical in the scheduler and in
    every worker of one engine (both know the engine id), distinct between
    engines on one host."""
    digest = hashlib.sha256(f"{engine_id}\0{namespace}".encode()).hexdigest()[:16]
    return f"{staging_shm_prefix(engine_id)}{digest}"


def staging_shm_prefix(engine_id: str) -> str:
    """The part of :func:`staging_shm_name` that only depends on the engine."""
    return f"pykvcache-{_SAFE.sub('_', engine_id)[:32]}-"
