"""Copies between KV pages and staging slots when the KV cache is host memory
(vLLM's CPU platform): one memcpy per page, synchronous.

The forward pass on CPU is synchronous and every copy runs in the engine's
step (``submit_*`` or ``get_finished``), so a copy never races with the model
writing the same pages.

Pages are copied by numpy (one single-threaded memcpy each), not by torch's
``copy_``, which splits every copy of more than 32 KiB over the worker's
OpenMP threads: their barrier spins until each thread got a core, and
during a disk hit the scheduler process's threads (reads, checksums, the
engine loop) hold the other core. An 8 MiB chunk then took 30-660 ms
instead of ~1 ms (2026-12-06, 2-core VM; decision 0082).

A load whose reads are in flight runs only code that the stores before it
ran too (:meth:`CpuCopier.prepare` is plain Python): the first call of a
numpy or torch routine in a process can page its code in from disk, and
that read waits at the device behind the load's own chunks (a first load
waited 37-76 ms for it; decision 0082).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from pykvcache.vllm.worker.slot_map import GroupTransfer, PageSpec, SlotMap, Slots

if TYPE_CHECKING:
    from pykvcache import StagingPool

#: One run's KV view and staging view, as torch tensors and as numpy arrays of the same bytes.
_Views = tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]
#: A load's pages per slot and group: ``{slot: {group: (blocks, sub-blocks)}}`` (:meth:`CpuCopier.prepare`).
Prepared = dict[int, dict[int, tuple[list[int], list[int]]]]

#: Pages of at least this many bytes are copied one by one (one memcpy each);
#: smaller ones by one vectorised gather and scatter. Torch's advanced
#: indexing moves int8 pages at 0.13-0.4 GB/s here whatever their size, a
#: copy per page costs a few microseconds of Python and then runs at
#: memcpy speed: 1.8x faster at 4 KiB pages, 4-9x at 16-128 KiB, 2.5x slower
#: at 2 KiB (this VM, 2026-12-02; decision 0057's amendment).
PAGE_LOOP_MIN_BYTES = 4096


def _copy_pages(views: _Views, blocks: Sequence[int], slot_idx: Sequence[int], sub_idx: Sequence[int], *, to_kv: bool) -> int:
    """Copies pages ``kv[blocks[i]]`` <-> ``stage[slot_idx[i], sub_idx[i]]``
    of one run's ``views`` (torch and numpy views of the same bytes; indices
    as lists); returns the bytes moved."""
    kv, stage, kv_np, stage_np = views
    page: int = kv.shape[1] * kv.shape[2]
    if page >= PAGE_LOOP_MIN_BYTES:
        if to_kv:
            for b, s, u in zip(blocks, slot_idx, sub_idx):
                np.copyto(kv_np[b], stage_np[s, u])
        else:
            for b, s, u in zip(blocks, slot_idx, sub_idx):
                np.copyto(stage_np[s, u], kv_np[b])
        return len(blocks) * page
    tb, ts, tu = (torch.tensor(x, dtype=torch.int64) for x in (blocks, slot_idx, sub_idx))
    if to_kv:
        kv[tb] = stage[ts, tu]
    else:
        stage[ts, tu] = kv[tb]
    return len(blocks) * page


class CpuCopier:
    def __init__(self, kv_tensors: list[torch.Tensor], slot_map: SlotMap, pool: StagingPool, rank: int) -> None:
        layout = slot_map.layout
        self._map = slot_map
        # Kept alive for as long as the tensors view it.
        self._region = pool.region()
        staging = torch.frombuffer(self._region, dtype=torch.int8)
        stride = pool.slot_stride
        base = pool.payload_offset(0)
        if pool.num_slots > 1 and pool.payload_offset(pool.num_slots - 1) != base + (pool.num_slots - 1) * stride:
            raise ValueError("staging slots are not evenly spaced; cannot build views")
        row = base + layout.row_offset(rank)
        bpc = layout.blocks_per_chunk
        # Per group, per ref and run: (KV view (block, fragment, byte), staging
        # view (slot, sub-block, fragment, byte)). One run of one fragment per
        # page in the per-rank layout; vLLM's canonical runs in the shared row.
        self._views: list[list[_Views]] = []
        self._tails: list[torch.Tensor | None] = []
        for g, placements in enumerate(slot_map.groups):
            views: list[_Views] = []
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
                    views.append((kv, stage, kv.numpy(), stage.numpy()))
            self._views.append(views)
            # Bytes of the row this group leaves unused: zeroed on store so a
            # chunk file never carries stale bytes of another chunk.
            tail = layout.row_stride - slot_map.group_row_bytes[g]
            self._tails.append(staging.as_strided((pool.num_slots, tail), (stride, 1), row + slot_map.group_row_bytes[g]) if tail else None)

    def _indexed(self, gpu_spec: PageSpec, slots: Slots) -> Iterator[tuple[GroupTransfer, list[int], list[int], list[int]]]:
        """Each transfer part with its block, slot and sub-block indices (lists)."""
        for part in self._map.transfers(gpu_spec, slots):
            yield part, part.block_ids.tolist(), part.slots.tolist(), part.sub_blocks.tolist()

    def load(self, gpu_spec: PageSpec, slots: Slots) -> int:
        copied = 0
        for part, blocks, slot_idx, sub_idx in self._indexed(gpu_spec, slots):
            for views in self._views[part.group]:
                copied += _copy_pages(views, blocks, slot_idx, sub_idx, to_kv=True)
        return copied

    def prepare(self, gpu_spec: PageSpec, slots: Slots) -> Prepared:
        """Per slot of a load whose chunks come in waves (:meth:`load_wave`),
        its pages per group: ``{slot: {group: (blocks, sub-blocks)}}``."""
        by_slot: Prepared = {}
        for part, blocks, slot_idx, sub_idx in self._indexed(gpu_spec, slots):
            for b, s, u in zip(blocks, slot_idx, sub_idx):
                pages = by_slot.setdefault(s, {}).setdefault(part.group, ([], []))
                pages[0].append(b)
                pages[1].append(u)
        return by_slot

    def load_wave(self, prepared: Prepared, wave: set[int]) -> int:
        """Copies the pages of the slots in ``wave`` (verified chunks) of a
        prepared load; the other slots' pages keep what they hold (decision
        0057: the first chunks are copied while the last are still read)."""
        copied = 0
        for slot in sorted(wave):
            for group, (blocks, subs) in prepared.get(slot, {}).items():
                slots = [slot] * len(blocks)
                for views in self._views[group]:
                    copied += _copy_pages(views, blocks, slots, subs, to_kv=True)
        return copied

    def store(self, gpu_spec: PageSpec, slots: Slots) -> int:
        copied = 0
        for part, blocks, slot_idx, sub_idx in self._indexed(gpu_spec, slots):
            for views in self._views[part.group]:
                copied += _copy_pages(views, blocks, slot_idx, sub_idx, to_kv=False)
            tail = self._tails[part.group]
            if tail is not None:
                tail[torch.tensor(sorted(set(slot_idx)), dtype=torch.int64)] = 0
        return copied
