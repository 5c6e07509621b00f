"""Where each KV page of a transfer lives inside the staging slots.

Turns a connector transfer (GPU block ids per KV cache group, plus the slots of
its chunks) into, per group, parallel arrays of (GPU block, slot, sub-block).
A chunk spans ``blocks_per_chunk`` GPU blocks; a load may start in the middle
of its first chunk (``block_indices[g] % blocks_per_chunk`` sub-blocks are
skipped), which is what happens when the GPU prefix cache still holds the
first blocks of a chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pykvcache.vllm.layout import ChunkLayout


@dataclass(frozen=True)
class RefPlacement:
    """One ref (layer or shared tensor) of a group inside a rank's row."""

    tensor_idx: int
    page_bytes: int  # bytes copied per GPU block (un-padded page)
    row_offset: int  # where its ``blocks_per_chunk`` pages start in the row


@dataclass(frozen=True)
class GroupTransfer:
    group: int
    block_ids: np.ndarray  # GPU block per page copied
    slots: np.ndarray  # staging slot per page copied
    sub_blocks: np.ndarray  # sub-block inside the chunk per page copied


class SlotMap:
    def __init__(self, group_data_refs, layout: ChunkLayout) -> None:
        self.layout = layout
        bpc = layout.blocks_per_chunk
        self.groups: list[list[RefPlacement]] = []
        self.group_row_bytes: list[int] = []
        for g, refs in enumerate(group_data_refs):
            offset = 0
            placements = []
            for ref in refs:
                placements.append(RefPlacement(ref.tensor_idx, ref.page_size_bytes, offset))
                offset += ref.page_size_bytes * bpc
            if offset > layout.row_bytes:
                raise ValueError(
                    f"KV cache group {g} needs {offset} bytes per chunk and rank, more than "
                    f"the {layout.row_bytes} the scheduler sized staging for; this KV cache "
                    "layout is not supported by pykvcache"
                )
            self.groups.append(placements)
            self.group_row_bytes.append(offset)

    def transfers(self, gpu_spec, slots: np.ndarray) -> Iterator[GroupTransfer]:
        """Split one transfer into per-group page lists (null blocks dropped)."""
        bpc = self.layout.blocks_per_chunk
        block_ids = np.asarray(gpu_spec.block_ids, dtype=np.int64)
        slots = np.asarray(slots, dtype=np.int64)
        group_sizes = list(gpu_spec.group_sizes)
        if len(group_sizes) != len(self.groups):
            raise ValueError(
                f"transfer has {len(group_sizes)} KV cache groups, worker has {len(self.groups)}"
            )
        block_pos = slot_pos = 0
        for g, (count, first_index) in enumerate(zip(group_sizes, gpu_spec.block_indices)):
            if count == 0:
                continue
            skip = int(first_index) % bpc
            num_slots = -(-(count + skip) // bpc)
            flat = np.arange(skip, skip + count, dtype=np.int64)
            if block_pos + count > len(block_ids) or slot_pos + num_slots > len(slots):
                raise ValueError(
                    f"transfer spec shorter than its group sizes: group {g} needs "
                    f"{count} blocks and {num_slots} slots"
                )
            group_blocks = block_ids[block_pos : block_pos + count]
            group_slots = slots[slot_pos : slot_pos + num_slots][flat // bpc]
            keep = group_blocks != 0  # block 0 is vLLM's null block
            yield GroupTransfer(g, group_blocks[keep], group_slots[keep], (flat % bpc)[keep])
            block_pos += count
            slot_pos += num_slots
        if block_pos != len(block_ids) or slot_pos != len(slots):
            raise ValueError(
                f"transfer spec mismatch: {len(block_ids)} blocks / {len(slots)} slots, "
                f"group sizes cover {block_pos} / {slot_pos}"
            )
