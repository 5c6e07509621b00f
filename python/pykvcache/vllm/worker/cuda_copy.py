"""Copies between GPU KV pages and staging slots on CUDA.

* The staging region is registered with ``cudaHostRegister`` once, when the
  worker first attaches (never per I/O), so copies are real async DMA.
* Copies run on a side stream that first waits on the current (compute)
  stream: a store must not read pages the model is still writing, and a load
  must not race pending writes (zeroing) to its destination blocks.
* Completion is tracked with CUDA events; a transfer is reported finished
  only after its end event has completed.
* All page copies of a transfer go to the driver in one call through vLLM's
  ``swap_blocks_batch`` kernel op when it exists, else one async copy each.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pykvcache.vllm.worker.slot_map import PageSpec, SlotMap, Slots

if TYPE_CHECKING:
    from pykvcache import StagingPool

# Under "vllm." so the messages show up in vLLM's spawned processes, whose
# logging is configured for that namespace only.
logger = logging.getLogger("vllm.pykvcache." + __name__.rsplit(".", 1)[-1])


def register_host_memory(address: int, size: int) -> bool:
    """Pin an existing host range for DMA; False (and a warning) if refused."""
    try:
        from vllm.v1.kv_offload.cpu.host_register import host_register

        return bool(host_register(address, size))
    except ImportError:
        pass
    rc = torch.cuda.cudart().cudaHostRegister(address, size, 0)
    if int(rc) != 0:
        logger.warning("cudaHostRegister failed (%s); staging copies stay pageable", rc)
        return False
    return True


def _batch_copy_op() -> Callable[..., None] | None:
    try:
        from vllm import _custom_ops as ops

        torch.ops._C_cache_ops.swap_blocks_batch  # noqa: B018 - probe presence
        return ops.swap_blocks_batch
    except (ImportError, AttributeError, RuntimeError):
        return None


@dataclass
class _Pending:
    job_id: int
    start: torch.cuda.Event
    end: torch.cuda.Event
    num_bytes: int
    keepalive: tuple[torch.Tensor, ...]


class CudaCopier:
    def __init__(self, kv_tensors: list[torch.Tensor], slot_map: SlotMap, pool: StagingPool, rank: int) -> None:
        layout = slot_map.layout
        if not slot_map.single_run_pages:
            # One copy per page is what the batched copy issues; pages split
            # into many fragments (canonical NHD layouts) would need one per fragment.
            raise RuntimeError(
                "canonical_layout: this KV cache layout's canonical pages interleave the ranks "
                "token by token; pykvcache's CUDA copies support head-major layouts (HND) only. "
                "Remove canonical_layout from kv_connector_extra_config"
            )
        self._map = slot_map
        self._kv = kv_tensors
        self._device = kv_tensors[0].device
        self.registered = register_host_memory(pool.base_address, pool.total_bytes)
        self._region = pool.region()
        self._staging = torch.frombuffer(self._region, dtype=torch.int8)
        self._base = pool.base_address
        self._payload0 = pool.payload_offset(0)
        self._slot_stride = pool.slot_stride
        self._row = layout.row_offset(rank)
        self._bpc = layout.blocks_per_chunk
        self._stream = torch.cuda.Stream(device=self._device)
        self._batch_op = _batch_copy_op()
        self._pending: deque[_Pending] = deque()
        self._by_job: dict[int, _Pending] = {}
        logger.info(
            "pykvcache CUDA copies: staging %s, %s",
            "host-registered" if self.registered else "pageable (registration refused)",
            "batched swap_blocks_batch" if self._batch_op else "per-page async copies",
        )

    # -- address arithmetic --------------------------------------------------
    def _pointers(self, gpu_spec: PageSpec, slots: Slots) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(staging addresses, KV addresses, sizes) of every page of the transfer."""
        stage_ptrs: list[np.ndarray] = []
        kv_ptrs: list[np.ndarray] = []
        sizes: list[np.ndarray] = []
        for part in self._map.transfers(gpu_spec, slots):
            slot_base = (self._base + self._payload0 + part.slots * self._slot_stride + self._row).astype(np.int64)
            for ref in self._map.groups[part.group]:
                kv = self._kv[ref.tensor_idx]
                run = ref.runs[0]  # one contiguous piece per page (checked at start)
                stage_ptrs.append(slot_base + ref.row_offset + run.row_offset + part.sub_blocks * ref.sub_stride)
                kv_ptrs.append(kv.data_ptr() + run.local_offset + part.block_ids * kv.stride(0))
                sizes.append(np.full(len(part.block_ids), run.fragment_size, dtype=np.int64))
        if not sizes:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        return (np.concatenate(stage_ptrs).astype(np.int64), np.concatenate(kv_ptrs).astype(np.int64), np.concatenate(sizes))

    # -- submission ------------------------------------------------------------
    def submit(self, job_id: int, gpu_spec: PageSpec, slots: Slots, *, to_gpu: bool) -> None:
        stage, kv, sizes = self._pointers(gpu_spec, slots)
        src, dst = (stage, kv) if to_gpu else (kv, stage)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        src_t = torch.from_numpy(src).pin_memory() if self.registered else torch.from_numpy(src)
        dst_t = torch.from_numpy(dst).pin_memory() if self.registered else torch.from_numpy(dst)
        size_t = torch.from_numpy(sizes).pin_memory() if self.registered else torch.from_numpy(sizes)
        with torch.cuda.stream(self._stream):
            start.record(self._stream)
            if len(sizes):
                if self._batch_op is not None:
                    try:
                        self._batch_op(src_t, dst_t, size_t, is_src_access_order_any=to_gpu)
                    except TypeError:  # older signature without the keyword
                        self._batch_op(src_t, dst_t, size_t)
                else:
                    self._copy_each(gpu_spec, slots, to_gpu)
            end.record(self._stream)
        pending = _Pending(job_id, start, end, int(sizes.sum()), (src_t, dst_t, size_t))
        self._pending.append(pending)
        self._by_job[job_id] = pending

    def _copy_each(self, gpu_spec: PageSpec, slots: Slots, to_gpu: bool) -> None:
        for part in self._map.transfers(gpu_spec, slots):
            for ref in self._map.groups[part.group]:
                kv = self._kv[ref.tensor_idx]
                run = ref.runs[0]
                for block, slot, sub in zip(part.block_ids, part.slots, part.sub_blocks):
                    off = (
                        self._payload0
                        + int(slot) * self._slot_stride
                        + self._row
                        + ref.row_offset
                        + run.row_offset
                        + int(sub) * ref.sub_stride
                    )
                    stage = self._staging[off : off + run.fragment_size]
                    page = kv[int(block), run.local_offset : run.local_offset + run.fragment_size]
                    if to_gpu:
                        page.copy_(stage, non_blocking=True)
                    else:
                        stage.copy_(page, non_blocking=True)

    # -- completion --------------------------------------------------------------
    def finished(self) -> list[tuple[int, int, float]]:
        """(job id, bytes, seconds) of transfers whose end event has completed."""
        done = []
        while self._pending and self._pending[0].end.query():
            p = self._pending.popleft()
            del self._by_job[p.job_id]
            done.append((p.job_id, p.num_bytes, p.start.elapsed_time(p.end) * 1e-3))
        return done

    def wait(self, job_ids: Iterable[int]) -> None:
        for job_id in job_ids:
            pending = self._by_job.get(job_id)
            if pending is not None:
                pending.end.synchronize()

    def drain(self) -> None:
        deadline = time.monotonic() + 60
        while self._pending and time.monotonic() < deadline:
            self._pending[0].end.synchronize()
            self.finished()
