"""pykvcache against vLLM's own filesystem tier (tiering `fs`), side by side.

vLLM's ``FileSystemTierManager`` is driven directly, as its tiering manager
would drive it, with a primary memoryview holding the chunks; the pykvcache
store gets the same bytes in its staging slots, the same keys, the same job
shapes on the same filesystem. A job is a list of chunks submitted together
(vLLM's fs tier runs the chunks of one job sequentially on one of its threads);
all jobs are submitted at once and the phase ends when the last one finishes.
Shapes: one job of all chunks (one request's load), jobs of 8, jobs of 1.
"""

from __future__ import annotations

import abc
import logging
import mmap
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import vllm_adapter
from .cold_cache import DiskCounter, drop_caches, settle
from .cpu_meter import CpuMeter
from .engine_bench import BenchDataError, open_store, store_info
from .payload import digest, expected_digest, payload
from .results import PhaseResult

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadKey

#: Job shapes: name -> chunks per job (None = all chunks in one job).
JOB_SHAPES: dict[str, int | None] = {"one_job": None, "jobs_of_8": 8, "jobs_of_1": 1}


def vllm_fs_tier_available() -> str | None:
    """None when vLLM's fs tier can be imported, else the reason it cannot."""
    try:
        from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager  # noqa: F401
    except Exception as e:  # vLLM absent or broken: the part is skipped with this reason
        return f"{type(e).__name__}: {e}"
    return None


def split_jobs(n: int, shape: str) -> list[list[int]]:
    per = JOB_SHAPES[shape] or n
    return [list(range(i, min(i + per, n))) for i in range(0, n, per)]


def offload_keys(n: int, tag: str) -> list[OffloadKey]:
    """vLLM offload keys (32-byte block hash + 4-byte group index), used by both systems."""
    import hashlib

    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(hashlib.sha256(f"{tag}-{i}".encode()).digest(), 0) for i in range(n)]


def _offloading_spec(chunk_bytes: int, num_chunks: int) -> Any:
    """A real tiering spec with one KV group and one block per chunk, so the
    fs tier's block size (the primary view's stride) is the chunk size."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("bench.layer",), group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": num_chunks * chunk_bytes, "secondary_tiers": []},
        engine_id="pykvcache-bench",
        model=OffloadingModelConfig(name="pykvcache-bench", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )
    return TieringOffloadingSpec(config)


class TierSystem(abc.ABC):
    """A secondary tier of vLLM's tiering framework over a page-aligned primary
    region, driven with the framework's TransferJobs (as its manager drives it)."""

    name = "tier"

    def __init__(self, root: Path, chunk_bytes: int, num_chunks: int, **tier_kwargs: Any):
        self.root, self.chunk, self.n = root, chunk_bytes, num_chunks
        # Anonymous mmap: page-aligned, as O_DIRECT needs and vLLM's primary tier provides.
        self._map = mmap.mmap(-1, num_chunks * chunk_bytes)
        self._flat = memoryview(self._map)
        self.view = self._flat.cast("B", [num_chunks, chunk_bytes])
        for i in range(num_chunks):
            self._flat[i * chunk_bytes : (i + 1) * chunk_bytes] = payload(i, chunk_bytes)
        root.mkdir(parents=True, exist_ok=True)
        self.tier = self._make_tier(_offloading_spec(chunk_bytes, num_chunks), **tier_kwargs)
        self._job_id = 0

    @abc.abstractmethod
    def _make_tier(self, spec: Any, **kwargs: Any) -> Any:
        """The tier under test, over ``self.view``."""

    def chunk_view(self, i: int) -> memoryview:
        return self._flat[i * self.chunk : (i + 1) * self.chunk]

    def run(self, direction: str, keys: list[OffloadKey], jobs: list[list[int]]) -> list[str]:
        import numpy as np
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.tiering.base import TransferJob

        ctx = ReqContext(req_id="pykvcache-bench")
        submitted = []
        for job in jobs:
            self._job_id += 1
            tj = TransferJob(
                job_id=self._job_id,
                keys=[keys[i] for i in job],
                chunk_ids=np.asarray(job, dtype=np.int64),
                is_promotion=direction == "read",
                req_context=ctx,
            )
            (self.tier.submit_load if direction == "read" else self.tier.submit_store)(tj)
            submitted.append(self._job_id)
        self.tier.drain_jobs()
        results = {r.job_id: r for r in self.tier.get_finished_jobs()}
        return [f"job {j}: {'missing' if j not in results else 'failed'}" for j in submitted if j not in results or not results[j].success]

    def close(self) -> None:
        self.tier.shutdown()
        self.tier = None  # it views the primary region
        self.view.release()
        self._flat.release()
        self._map.close()


class FsTierSystem(TierSystem):
    """vLLM's FileSystemTierManager."""

    name = "fs_tier"

    def _make_tier(self, spec: Any, read_threads: int = 16, write_threads: int = 16, **unknown: Any) -> Any:
        from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

        if unknown:
            raise TypeError(f"the fs tier takes read_threads and write_threads, not {sorted(unknown)}")

        return FileSystemTierManager(
            spec, self.view, tier_type="fs", root_dir=str(self.root), n_read_threads=read_threads, n_write_threads=write_threads
        )

    def info(self) -> dict[str, Any]:
        return vllm_adapter.fs_tier_info(self.tier)


class PykvcacheTierSystem(TierSystem):
    """pykvcache's tier (``PykvcacheTier``) in the same framework: the same
    primary region, jobs and drain as the fs tier; staging for every chunk of
    the phase (up to 1 GiB) so that, like the fs tier's threads, all of a
    phase's chunks can be in flight."""

    name = "pykvcache_tier"
    #: The tier's ``cpu_tier_io`` (decision 0062): "copy" is its default.
    cpu_tier_io = "copy"

    def _make_tier(self, spec: Any, **store_kwargs: Any) -> Any:
        from pykvcache.vllm.tier import PykvcacheTier

        # No engine exists here, so the tier's start-up warning that the namespace cannot
        # cover the engine's VllmConfig is true and says nothing to a benchmark reader (it
        # printed once per tier into `make demo`): below WARNING only while it is built.
        identity_log = logging.getLogger("vllm.pykvcache.model_identity")
        level = identity_log.level
        identity_log.setLevel(logging.ERROR)
        # `--verify` reaches the tier too (the CPU-per-GB comparison with verify="header").
        keys = {k: store_kwargs[k] for k in ("backend", "direct_io", "queue_depth", "register_buffers", "verify") if k in store_kwargs}
        try:
            return PykvcacheTier(
                spec,
                self.view,
                "PykvcacheTier",
                storage_dirs=[str(self.root)],
                capacity_bytes=2 * self.n * (self.chunk + (1 << 20)),
                # a chunk file is the chunk plus a header of at most 1 MiB
                staging_bytes=max(2, min(self.n, (1 << 30) // self.chunk)) * (self.chunk + (1 << 20)),
                fingerprint_weights=False,
                gate=False,
                min_free_bytes=0,
                cpu_tier_io=self.cpu_tier_io,
                **keys,
            )
        finally:
            identity_log.setLevel(level)

    def info(self) -> dict[str, Any]:
        return {**store_info(self.tier.store), "cpu_tier_io": self.cpu_tier_io, "region": self.tier.store.region_count > 0}


class PykvcacheTierDirectSystem(PykvcacheTierSystem):
    """The same tier with ``cpu_tier_io: "direct"``: the engine moves each
    chunk straight from and to its CPU-tier row (no copy)."""

    name = "pykvcache_tier_direct"
    cpu_tier_io = "direct"


class PykvcacheSystem:
    """The pykvcache store with one staging slot per chunk (the fs tier's primary
    region plays the same role for vLLM), all of a phase's chunks in flight."""

    name = "pykvcache"

    def __init__(self, root: Path, chunk_bytes: int, num_chunks: int, **store_kwargs: Any):
        from pykvcache import StagingPool

        self.root, self.chunk, self.n = root, chunk_bytes, num_chunks
        self.pool = StagingPool(chunk_bytes, num_chunks)
        self.slots = [self.pool.acquire() for _ in range(num_chunks)]
        for i, s in enumerate(self.slots):
            with self.pool.view(s) as v:
                v[:] = payload(i, chunk_bytes)
        root.mkdir(parents=True, exist_ok=True)
        self.store = open_store(root, self.pool, 2 * num_chunks * (chunk_bytes + (1 << 20)), "pykvcache-bench", **store_kwargs)

    def info(self) -> dict[str, Any]:
        return store_info(self.store)

    @contextmanager
    def chunk_view_ctx(self, i: int) -> Iterator[memoryview]:
        with self.pool.view(self.slots[i]) as v:
            yield v

    def run(self, direction: str, keys: Sequence[bytes], jobs: list[list[int]]) -> list[str]:
        handles = []
        for job in jobs:
            for i in job:
                if direction == "write":
                    handles.append(self.store.put(keys[i], self.slots[i], self.chunk))
                else:
                    handles.append(self.store.get(keys[i], self.slots[i]))
        errors = []
        for h in handles:
            r = h.wait()
            if not r.ok:
                errors.append(f"{h.op} {h.key!r}: {r.status} {r.message}")
        return errors

    def close(self) -> None:
        self.store.close()
        for s in self.slots:
            self.pool.release(s)
        self.pool.close()


def _with_view(system: Any, i: int, fn: Callable[[memoryview], Any]) -> Any:
    if isinstance(system, PykvcacheSystem):
        with system.chunk_view_ctx(i) as v:
            return fn(v)
    v = system.chunk_view(i)
    try:
        return fn(v)
    finally:
        v.release()


def _zero(v: memoryview) -> None:
    v[:] = bytes(len(v))


def _sample_indices(n: int) -> list[int]:
    return sorted({0, n // 2, n - 1})


@dataclass(frozen=True)
class FsCase:
    chunk_bytes: int
    total_bytes: int
    shape: str
    contention: bool

    @property
    def chunks(self) -> int:
        return max(1, self.total_bytes // self.chunk_bytes)


def run_system_case(
    system: Any,
    case: FsCase,
    keys: list[OffloadKey],
    *,
    disk: DiskCounter | None,
    cold: bool,
    repeat: int,
    cold_metadata: bool = False,
) -> list[PhaseResult]:
    """Store then load every chunk with ``system``. Returns [write, read]."""
    jobs = split_jobs(case.chunks, case.shape)
    params = {"shape": case.shape, "jobs": len(jobs), "contention": case.contention, "repeat": repeat}
    out: list[PhaseResult] = []
    for direction in ("write", "read"):
        dropped = None
        if direction == "read":
            for i in _sample_indices(case.chunks):
                _with_view(system, i, _zero)
            dropped = drop_caches(cold_metadata) if cold else False
        settle()
        d0 = disk.sample() if disk else None
        with CpuMeter() as meter:
            errors = system.run(direction, keys, jobs)
        d1 = disk.sample() if disk else None
        cpu = meter.result
        assert cpu is not None
        delta = DiskCounter.delta(d0, d1)
        ok_chunks = case.chunks if not errors else 0
        out.append(
            PhaseResult.measured(system.name, direction, case.chunk_bytes, ok_chunks, cpu, params, delta, dropped, errors, system.info())
        )
        if errors:
            raise BenchDataError(f"{system.name} {direction} ({case.shape}) failed: {errors[0]}")
    for i in _sample_indices(case.chunks):
        if _with_view(system, i, digest) != expected_digest(i, case.chunk_bytes):
            raise BenchDataError(f"{system.name} loaded wrong bytes for chunk {i} ({case.shape})")
    return out


def make_system(name: str, root: Path, case: FsCase, store_kwargs: dict[str, Any] | None = None) -> Any:
    if name == "fs_tier":
        return FsTierSystem(root / "vllm-fs-tier", case.chunk_bytes, case.chunks)
    if name == "pykvcache_tier":
        return PykvcacheTierSystem(root / "pykvcache-tier", case.chunk_bytes, case.chunks, **(store_kwargs or {}))
    if name == "pykvcache_tier_direct":
        return PykvcacheTierDirectSystem(root / "pykvcache-tier-direct", case.chunk_bytes, case.chunks, **(store_kwargs or {}))
    return PykvcacheSystem(root / "pykvcache", case.chunk_bytes, case.chunks, **(store_kwargs or {}))


def run_fs_case(
    case: FsCase,
    directory: Path,
    systems: list[str],
    *,
    disk: DiskCounter | None,
    cold: bool,
    repeat: int,
    store_kwargs: dict[str, Any] | None = None,
    cold_metadata: bool = False,
) -> list[PhaseResult]:
    """Both systems on one case, in the given order, each on fresh files."""
    results: list[PhaseResult] = []
    for name in systems:
        keys = offload_keys(case.chunks, f"{name}-{case.chunk_bytes}-{case.shape}-{repeat}-{time.monotonic_ns()}")
        system = make_system(name, directory, case, store_kwargs)
        try:
            results += run_system_case(system, case, keys, disk=disk, cold=cold, repeat=repeat, cold_metadata=cold_metadata)
        finally:
            system.close()
            shutil.rmtree(system.root, ignore_errors=True)
            settle()
    return results
