"""Worker-side OffloadingWorker: copies KV pages to and from staging slots.

No disk I/O happens here. The scheduler hands out loads of chunks verified in
staging or, with in-flight hits (decision 0055), of chunks whose reads are in
flight. Such a load is never waited for in the engine's step: its slots'
ready words, which the scheduler process's engine settles with each read's
verdict, are polled at every ``get_finished`` (decision 0065), and on the CPU
platform each chunk is copied once its read has ended (decision 0057). A
load with a slot whose read failed, or none of whose reads ended within the
store's ``io_verdict_bound_s`` (the scheduler stopped answering), is reported failed, that slot's chunk never copied
(:meth:`StagingWorker.take_failed_loads`, read by ``PyKvCacheConnector``,
which tells vLLM to recompute the request).
The staging region is created by the scheduler process as a memfd (no name
in /dev/shm: it goes away with the engine however the engine exits); vLLM
builds workers before the scheduler, so the region is attached on the first
transfer (by which time the scheduler that issued it exists), through the
scheduler's ``/proc/<pid>/fd``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, cast

from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult

from pykvcache.vllm.layout import ChunkLayout
from pykvcache.vllm.worker.pending_loads import PendingLoad, PendingLoads
from pykvcache.vllm.worker.slot_map import SlotMap, Slots

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec

    from pykvcache import StagingPool
    from pykvcache.vllm.load_trace import LoadTrace
    from pykvcache.vllm.transfer_spec import StagingSlotsSpec
    from pykvcache.vllm.worker.cpu_copy import CpuCopier
    from pykvcache.vllm.worker.cuda_copy import CudaCopier

# Under "vllm." so the messages show up in vLLM's spawned processes, whose
# logging is configured for that namespace only.
logger = logging.getLogger("vllm.pykvcache." + __name__.rsplit(".", 1)[-1])


def _attach_pool(shm_name: str) -> StagingPool:
    from pykvcache._core import StagingPool

    return StagingPool.attach_memfd(shm_name)


class StagingWorker(OffloadingWorker):
    def __init__(self, kv_caches: CanonicalKVCaches, layout: ChunkLayout, shm_name: str, rank: int) -> None:
        self._kv = [t.tensor for t in kv_caches.tensors]
        self._map = SlotMap(kv_caches.group_data_refs, layout)
        self._layout = layout
        self._shm_name = shm_name
        self._rank = rank
        self._layout.row_offset(rank)  # validates the rank early
        self._copier: CudaCopier | CpuCopier | None = None
        self._on_cuda = bool(self._kv) and self._kv[0].is_cuda
        self._finished: list[TransferResult] = []
        # Set by a connector that reports failed loads to vLLM
        # (PyKvCacheConnector); without it a failed wait raises instead.
        self.report_load_failures = False
        self._failed_loads: set[int] = set()
        # Copy each chunk as its read ends (CPU platform; decision 0057). False:
        # wait for every read, then copy (the CUDA path's order): kept for the
        # A/B that decision 0057 records.
        self.copy_as_reads_end = True
        self._pending: PendingLoads | None = None
        self._failure: RuntimeError | None = None
        self.trace: LoadTrace | None = None  # gate_trace: the load path's timestamps (load_trace.py)

    @property
    def copier(self) -> CudaCopier | CpuCopier:
        if self._copier is None:
            pool = _attach_pool(self._shm_name)
            if pool.slot_bytes < self._layout.payload_bytes:
                raise RuntimeError(
                    f"staging slots of {pool.slot_bytes} bytes cannot hold a "
                    f"{self._layout.payload_bytes}-byte chunk: scheduler and worker disagree "
                    "on the KV layout"
                )
            if self._on_cuda:
                from pykvcache.vllm.worker.cuda_copy import CudaCopier

                self._copier = CudaCopier(self._kv, self._map, pool, self._rank)
            else:
                from pykvcache.vllm.worker.cpu_copy import CpuCopier

                self._copier = CpuCopier(self._kv, self._map, pool, self._rank)
            self._pool: StagingPool = pool
        return self._copier

    # The copier is a CudaCopier exactly when the KV cache is on CUDA (``copier``).
    def _cuda_copier(self) -> CudaCopier:
        return cast("CudaCopier", self.copier)

    def _cpu_copier(self) -> CpuCopier:
        return cast("CpuCopier", self.copier)

    # The offloaded side of every transfer is the StagingSlotsSpec that pykvcache's manager built.
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        slots = cast("StagingSlotsSpec", dst_spec).block_ids
        return self._submit(job_id, gpu_spec=src_spec, slots=slots, to_gpu=False)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False, **_future_kwargs: Any
    ) -> bool:
        # ``expedited`` (vLLM >= 0.33) asks to jump queued stores; copies here
        # are issued in order on one stream and are short, so it needs nothing.
        start = time.perf_counter()
        src_spec = cast("StagingSlotsSpec", src_spec)
        slots = [int(s) for s in src_spec.block_ids]
        generations = list(getattr(src_spec, "ready_generations", None) or ())
        if self.trace is not None:
            self.trace("load_in", job=job_id, chunks=len(slots), in_flight=sum(1 for g in generations if g > 0))
        if not any(generations):
            if self.trace is None or self._on_cuda:
                return self._submit(job_id, gpu_spec=dst_spec, slots=slots, to_gpu=True)
            # Every read ended before the load came: one wave, every chunk, copied now.
            began = time.perf_counter()
            submitted = self._submit(job_id, gpu_spec=dst_spec, slots=slots, to_gpu=True)
            self.trace("copied", job=job_id, chunks=len(slots), s=round(time.perf_counter() - began, 6))
            self.trace("load_done", job=job_id)
            return submitted
        if any(gen < 0 for gen in generations):
            failed = sum(1 for gen in generations if gen < 0)
            self._load_failed(job_id, f"{failed} read(s) failed before the load", start)
            return True
        # Reads in flight: never waited for here, in the engine's step
        # (decision 0065); polled at each get_finished.
        wait_s = float(src_spec.wait_s or 10.0)
        waiting = [(s, gen) for s, gen in zip(slots, generations) if gen > 0]
        load = PendingLoad(job_id, dst_spec, slots, waiting, wait_s, start, ready={s for s, gen in zip(slots, generations) if gen == 0})
        self._pending_loads().add(load)
        return True

    def wait_for_reads(self, timeout: float) -> None:
        """Sleeps (GIL released) until the oldest pending load's next read
        ends, at most ``timeout`` seconds; at once without pending loads.
        Called in steps that compute nothing (decision 0065)."""
        if self._pending is not None:
            began = time.perf_counter()
            self._pending.wait(timeout)
            if self.trace is not None:
                self.trace("idle_wait", s=round(time.perf_counter() - began, 6))

    def _pending_loads(self) -> PendingLoads:
        if self._pending is None:
            pool = self._attached_pool()
            if self._on_cuda or not self.copy_as_reads_end:
                # All reads first, then one batched copy (see decision 0057).
                self._pending = PendingLoads(pool, finish=self._finish_whole, fail=self._fail_pending)
            else:
                self._pending = PendingLoads(pool, finish=self._finish_copied, fail=self._fail_pending, copy_wave=self._copy_wave)
        return self._pending

    def _copy_wave(self, load: PendingLoad, wave: set[int]) -> None:
        """Copies the chunks of ``wave`` (verified) into the load's pages
        (decision 0057: the first chunks are in their pages while the last
        are still read)."""
        began = time.perf_counter()
        copier = self._cpu_copier()  # waves are the CPU platform's (_pending_loads)
        if load.prepared is None:
            load.prepared = copier.prepare(load.dst_spec, load.slots)
        load.copied += copier.load_wave(load.prepared, wave)
        if self.trace is not None:
            self.trace("copied", job=load.job_id, chunks=len(wave), s=round(time.perf_counter() - began, 6))

    def _finish_copied(self, load: PendingLoad) -> None:
        if self.trace is not None:
            self.trace("load_done", job=load.job_id)
        self._finished.append(
            TransferResult(job_id=load.job_id, success=True, transfer_size=load.copied, transfer_time=time.perf_counter() - load.start)
        )

    def _finish_whole(self, load: PendingLoad) -> None:
        self._submit(load.job_id, gpu_spec=load.dst_spec, slots=load.slots, to_gpu=True, start=load.start)

    def _fail_pending(self, load: PendingLoad, why: str) -> None:
        try:
            self._load_failed(load.job_id, why, load.start)
        except RuntimeError as e:  # raised in the step, by get_finished
            self._failure = e

    def _load_failed(self, job_id: int, why: str, start: float) -> bool:
        """A load whose chunks are not all verified: reported finished, its
        request recomputed by vLLM (the connector reports the job failed)."""
        if not self.report_load_failures:
            # Copying would serve wrong KV and nobody would tell vLLM: stop.
            raise RuntimeError(
                f"load job {job_id}: chunks not ready ({why}) and the connector does not report failed loads (use PyKvCacheConnector)"
            )
        logger.warning("pykvcache: load job %d not (fully) copied, vLLM recomputes it: %s", job_id, why)
        self._failed_loads.add(job_id)
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=0, transfer_time=time.perf_counter() - start))
        return True

    def take_failed_loads(self) -> set[int]:
        """Load jobs reported finished but not copied since the last call."""
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def _attached_pool(self) -> StagingPool:
        _ = self.copier  # the property attaches the region on first use
        return self._pool

    def _submit(self, job_id: int, *, gpu_spec: GPULoadStoreSpec, slots: Slots, to_gpu: bool, start: float | None = None) -> bool:
        if self._on_cuda:
            self._cuda_copier().submit(job_id, gpu_spec, slots, to_gpu=to_gpu)
            return True
        copier = self._cpu_copier()
        start = time.perf_counter() if start is None else start
        num_bytes = copier.load(gpu_spec, slots) if to_gpu else copier.store(gpu_spec, slots)
        self._finished.append(
            TransferResult(job_id=job_id, success=True, transfer_size=num_bytes, transfer_time=time.perf_counter() - start)
        )
        return True

    def get_finished(self) -> list[TransferResult]:
        if self._pending is not None:
            self._pending.poll()
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        done, self._finished = self._finished, []
        if self._on_cuda and self._copier is not None:
            done.extend(
                TransferResult(job_id=job, success=True, transfer_size=size, transfer_time=secs)
                for job, size, secs in self._cuda_copier().finished()
            )
        return done

    def wait(self, job_ids: set[int]) -> None:
        if self._on_cuda and self._copier is not None:
            self._cuda_copier().wait(job_ids)

    def shutdown(self) -> None:
        if self._pending is not None:
            dropped = self._pending.drop_all()
            if dropped:
                logger.info("pykvcache: %d load(s) still waiting for reads at shutdown", len(dropped))
        if self._on_cuda and self._copier is not None:
            self._cuda_copier().drain()
