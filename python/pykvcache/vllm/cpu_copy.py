"""Copies between KV pages and staging slots when the KV cache is host memory
(vLLM's CPU platform): vectorised torch gathers/scatters, synchronous.

The forward pass on CPU is synchronous and every copy runs in the engine's
step (``submit_*`` or ``get_finished``), so a copy never races with the model
writing the same pages.
"""

from __future__ import annotations

import numpy as np
import torch

from pykvcache.vllm.slot_map import SlotMap

#: Pages of at least this many bytes are copied one by one (one memcpy each);
#: smaller ones by one vectorised gather and scatter. Torch's advanced
#: indexing moves int8 pages at 0.13-0.4 GB/s here whatever their size, a
#: ``copy_`` per page costs a few microseconds of Python and then runs at
#: memcpy speed: 1.8x faster at 4 KiB pages, 4-9x at 16-128 KiB, 2.5x slower
#: at 2 KiB (this VM, 2026-12-02; decision 0057's amendment).
PAGE_LOOP_MIN_BYTES = 4096


def _copy_pages(kv, stage, blocks, slot_idx, sub_idx, *, to_kv: bool) -> int:
    """Copies pages ``kv[blocks[i]]`` <-> ``stage[slot_idx[i], sub_idx[i]]``;
    returns the bytes moved."""
    page = kv.shape[1] * kv.shape[2]
    if page >= PAGE_LOOP_MIN_BYTES:
        for b, s, u in zip(blocks.tolist(), slot_idx.tolist(), sub_idx.tolist()):
            if to_kv:
                kv[b].copy_(stage[s, u])
            else:
                stage[s, u].copy_(kv[b])
    elif to_kv:
        kv[blocks] = stage[slot_idx, sub_idx]
    else:
        stage[slot_idx, sub_idx] = kv[blocks]
    return len(blocks) * page


class CpuCopier:
    def __init__(self, kv_tensors: list[torch.Tensor], slot_map: SlotMap, pool, rank: int) -> None:
        layout = slot_map.layout
        self._map = slot_map
        # Kept alive for as long as the tensors view it.
        self._region = pool.region()
        staging = torch.frombuffer(self._region, dtype=torch.int8)
        stride = pool.slot_stride
        base = pool.payload_offset(0)
        if pool.num_slots > 1 and pool.payload_offset(pool.num_slots - 1) != base + (
            pool.num_slots - 1
        ) * stride:
            raise ValueError("staging slots are not evenly spaced; cannot build views")
        row = base + layout.row_offset(rank)
        bpc = layout.blocks_per_chunk
        # Per group, per ref and run: (KV view (block, fragment, byte), staging
        # view (slot, sub-block, fragment, byte)). One run of one fragment per
        # page in the per-rank layout; vLLM's canonical runs in the shared row.
        self._views = []
        self._tails = []
        for g, placements in enumerate(slot_map.groups):
            views = []
            for ref in placements:
                kv_t = kv_tensors[ref.tensor_idx]
                for run in ref.runs:
                    kv = kv_t.as_strided(
                        (kv_t.shape[0], run.num_fragments, run.fragment_size),
                        (kv_t.stride(0), run.local_stride, 1),
                        kv_t.storage_offset() + run.local_offset,
                    )
                    stage = staging.as_strided(
                        (pool.num_slots, bpc, run.num_fragments, run.fragment_size),
                        (stride, ref.sub_stride, run.row_stride, 1),
                        row + ref.row_offset + run.row_offset,
                    )
                    views.append((kv, stage))
            self._views.append(views)
            # Bytes of the row this group leaves unused: zeroed on store so a
            # chunk file never carries stale bytes of another chunk.
            tail = layout.row_stride - slot_map.group_row_bytes[g]
            self._tails.append(
                staging.as_strided((pool.num_slots, tail), (stride, 1),
                                   row + slot_map.group_row_bytes[g])
                if tail else None
            )

    def _indexed(self, gpu_spec, slots):
        """Each transfer part with its block, slot and sub-block index tensors."""
        for part in self._map.transfers(gpu_spec, slots):
            yield (part, torch.from_numpy(part.block_ids), torch.from_numpy(part.slots),
                   torch.from_numpy(part.sub_blocks))

    def load(self, gpu_spec, slots) -> int:
        copied = 0
        for part, blocks, slot_idx, sub_idx in self._indexed(gpu_spec, slots):
            for kv, stage in self._views[part.group]:
                copied += _copy_pages(kv, stage, blocks, slot_idx, sub_idx, to_kv=True)
        return copied

    def prepare(self, gpu_spec, slots) -> list:
        """The index arrays of a load whose chunks come in waves (:meth:`load_wave`)."""
        return list(self._indexed(gpu_spec, slots))

    def load_wave(self, prepared: list, wave: set[int]) -> int:
        """Copies the pages of the slots in ``wave`` (verified chunks) of a
        prepared load; the other slots' pages keep what they hold (decision
        0057: the first chunks are copied while the last are still read)."""
        chosen = torch.from_numpy(np.fromiter(wave, dtype=np.int64, count=len(wave)))
        copied = 0
        for part, blocks, slot_idx, sub_idx in prepared:
            mask = torch.isin(slot_idx, chosen)
            if not bool(mask.any()):
                continue
            b, si, sb = blocks[mask], slot_idx[mask], sub_idx[mask]
            for kv, stage in self._views[part.group]:
                copied += _copy_pages(kv, stage, b, si, sb, to_kv=True)
        return copied

    def store(self, gpu_spec, slots) -> int:
        copied = 0
        for part, blocks, slot_idx, sub_idx in self._indexed(gpu_spec, slots):
            for kv, stage in self._views[part.group]:
                copied += _copy_pages(kv, stage, blocks, slot_idx, sub_idx, to_kv=False)
            tail = self._tails[part.group]
            if tail is not None:
                tail[torch.unique(slot_idx)] = 0
        return copied
