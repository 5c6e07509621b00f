"""Where each KV page of a transfer lives inside the staging slots.

Turns a connector transfer (GPU block ids per KV cache group, plus the slots of
its chunks) into, per group, parallel arrays of (GPU block, slot, sub-block).
A chunk spans ``blocks_per_chunk`` GPU blocks; a load may start in the middle
of its first chunk (``block_indices[g] % blocks_per_chunk`` sub-blocks are
skipped), which is what happens when the GPU prefix cache still holds the
first blocks of a chunk.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pykvcache.vllm.layout import ChunkLayout

#: The staging slots of a transfer's chunks: a spec's ``block_ids`` array or a list.
Slots = np.ndarray | Sequence[int]


class PageRef(Protocol):
    """What the slot map reads of vLLM's ``CanonicalKVCacheRef`` (and its
    ``mapping``, when there is one, for the canonical layout)."""

    @property
    def tensor_idx(self) -> int: ...
    @property
    def page_size_bytes(self) -> int: ...


class PageSpec(Protocol):
    """What the copies read of vLLM's ``GPULoadStoreSpec``."""

    @property
    def block_ids(self) -> Slots: ...
    @property
    def group_sizes(self) -> Sequence[int]: ...
    @property
    def block_indices(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class Run:
    """``num_fragments`` pieces of ``fragment_size`` bytes: at ``local_offset +
    i * local_stride`` in the worker's page and ``row_offset + i * row_stride``
    inside the sub-block (vLLM's ``CopyRun``; one piece for a whole page)."""

    local_offset: int
    row_offset: int
    fragment_size: int
    num_fragments: int
    local_stride: int
    row_stride: int


@dataclass(frozen=True)
class RefPlacement:
    """One ref (layer or shared tensor) of a group inside a rank's row."""

    tensor_idx: int
    page_bytes: int  # bytes of this worker's page per GPU block (un-padded)
    row_offset: int  # where its ``blocks_per_chunk`` sub-blocks start in the row
    sub_stride: int = 0  # bytes from one sub-block to the next (0: page_bytes)
    runs: tuple[Run, ...] = ()  # where this worker's bytes go in a sub-block (): the whole page at 0

    def __post_init__(self) -> None:
        if not self.sub_stride:
            object.__setattr__(self, "sub_stride", self.page_bytes)
        if not self.runs:
            page = self.page_bytes
            object.__setattr__(self, "runs", (Run(0, 0, page, 1, page, page),))


@dataclass(frozen=True)
class GroupTransfer:
    group: int
    block_ids: np.ndarray  # GPU block per page copied
    slots: np.ndarray  # staging slot per page copied
    sub_blocks: np.ndarray  # sub-block inside the chunk per page copied


class SlotMap:
    def __init__(self, group_data_refs: Sequence[Sequence[PageRef]], layout: ChunkLayout) -> None:
        self.layout = layout
        bpc = layout.blocks_per_chunk
        self.groups: list[list[RefPlacement]] = []
        self.group_row_bytes: list[int] = []
        for g, refs in enumerate(group_data_refs):
            offset = 0
            placements = []
            for ref in refs:
                if layout.ranks_share_row:
                    placement = _canonical_placement(g, ref, offset)
                else:
                    placement = RefPlacement(ref.tensor_idx, ref.page_size_bytes, offset)
                placements.append(placement)
                offset += placement.sub_stride * bpc
            if offset > layout.row_bytes:
                raise ValueError(
                    f"KV cache group {g} needs {offset} bytes per chunk and rank, more than "
                    f"the {layout.row_bytes} the scheduler sized staging for; this KV cache "
                    "layout is not supported by pykvcache"
                )
            self.groups.append(placements)
            self.group_row_bytes.append(offset)

    @property
    def single_run_pages(self) -> bool:
        """Each worker page lands in one contiguous piece (what the CUDA path copies)."""
        return all(len(p.runs) == 1 and p.runs[0].num_fragments == 1 for placements in self.groups for p in placements)

    def transfers(self, gpu_spec: PageSpec, slot_ids: Slots) -> Iterator[GroupTransfer]:
        """Split one transfer into per-group page lists (null blocks dropped)."""
        bpc = self.layout.blocks_per_chunk
        block_ids = np.asarray(gpu_spec.block_ids, dtype=np.int64)
        slots = np.asarray(slot_ids, dtype=np.int64)
        group_sizes = list(gpu_spec.group_sizes)
        if len(group_sizes) != len(self.groups):
            raise ValueError(f"transfer has {len(group_sizes)} KV cache groups, worker has {len(self.groups)}")
        block_pos = slot_pos = 0
        for g, (count, first_index) in enumerate(zip(group_sizes, gpu_spec.block_indices)):
            if count == 0:
                continue
            skip = int(first_index) % bpc
            num_slots = -(-(count + skip) // bpc)
            flat = np.arange(skip, skip + count, dtype=np.int64)
            if block_pos + count > len(block_ids) or slot_pos + num_slots > len(slots):
                raise ValueError(f"transfer spec shorter than its group sizes: group {g} needs {count} blocks and {num_slots} slots")
            group_blocks = block_ids[block_pos : block_pos + count]
            group_slots = slots[slot_pos : slot_pos + num_slots][flat // bpc]
            keep = group_blocks != 0  # block 0 is vLLM's null block
            yield GroupTransfer(g, group_blocks[keep], group_slots[keep], (flat % bpc)[keep])
            block_pos += count
            slot_pos += num_slots
        if block_pos != len(block_ids) or slot_pos != len(slots):
            raise ValueError(
                f"transfer spec mismatch: {len(block_ids)} blocks / {len(slots)} slots, group sizes cover {block_pos} / {slot_pos}"
            )


def _canonical_placement(group: int, ref: PageRef, offset: int) -> RefPlacement:
    """A ref's place in the shared canonical row, from vLLM's certified mapping;
    refuses (fails closed, as vLLM's own tiering spec does) a ref vLLM could not
    certify as parallelism-agnostic: its bytes would depend on the topology."""
    mapping = getattr(ref, "mapping", None)
    if mapping is None or not mapping.parallelism_agnostic:
        raise RuntimeError(
            f"canonical_layout: vLLM could not certify KV cache group {group} (tensor "
            f"{ref.tensor_idx}) as parallelism-agnostic "
            f"({'no canonical mapping' if mapping is None else 'opaque per-rank mapping'}); "
            "remove canonical_layout from kv_connector_extra_config"
        )
    if mapping.local_page_size_bytes != ref.page_size_bytes:
        raise RuntimeError(
            f"canonical_layout: mapping of {mapping.local_page_size_bytes} bytes for a "
            f"{ref.page_size_bytes}-byte page (KV cache group {group})"
        )
    runs = tuple(
        Run(r.local_offset, r.canonical_offset, r.fragment_size, r.num_fragments, r.local_stride, r.canonical_stride) for r in mapping.runs
    )
    return RefPlacement(ref.tensor_idx, ref.page_size_bytes, offset, sub_stride=mapping.canonical_page_size_bytes, runs=runs)
