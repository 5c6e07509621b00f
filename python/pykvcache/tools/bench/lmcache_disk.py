"""pykvcache's store against LMCache's local disk tier, one system per process.

LMCache cannot run inside vLLM's CPU build (its vLLM connector has no CPU KV
path: ``lmcache/v1/gpu_connector/__init__.py`` raises ``No supported cpu
connector found.``), but the layer below the connector does: LMCache's own
``StorageManager`` built from an ``LMCacheEngineConfig`` and ``LMCacheMetadata``
(what ``LMCacheEngine.post_init`` constructs), which creates its
``LocalCPUBackend`` (the memory allocator every LMCache chunk lives in) and its
``LocalDiskBackend``. This module drives those objects the way the engine does:

* store: chunks allocated by the storage manager (``StorageManager.allocate``,
  the KV_2LTD layout), filled, then handed to the disk backend's
  ``batched_submit_put_task`` (the call ``StorageManager.batched_put`` makes for
  the disk backend) with LMCache's per-key ``on_complete_callback`` marking
  completion; the allocation reference is dropped after submission, as
  ``batched_put`` does;
* load: ``StorageManager.batched_get(keys, location="LocalDiskBackend")``, the
  call the engine's retrieve makes after a lookup found the keys on disk (the
  disk backend's ``batched_get_blocking``: buffers from the allocator, files
  read by its thread pool).

pykvcache's ``BlockStore`` gets the same chunk bytes, the same number of
operations in flight and the same cold-read discipline. Each system runs in a
fresh child process (``python -m pykvcache.tools.bench.lmcache_disk SPEC OUT``)
so LMCache's private install (``PYKVCACHE_LMCACHE_PATH``), its threads and its
logging never touch the other system or the benchmark process; CPU time is
metered inside the child around each phase.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from .cold_cache import DiskCounter, drop_caches, settle
from .cpu_meter import CpuMeter
from .payload import digest, expected_digest, payload
from .results import PhaseResult

#: Llama-3's KV geometry as in the serving benchmark (8 KV heads x 128, 4 layers,
#: float32): 32 KiB of KV per token, so a 2 MiB chunk is 64 tokens (pykvcache's
#: serving chunk) and an 8 MiB chunk 256 tokens (LMCache's default chunk_size).
LAYERS, KV_HEADS, HEAD_SIZE, DTYPE_BYTES = 4, 8, 128, 4
BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_SIZE * DTYPE_BYTES
LMCACHE_DISK = "LocalDiskBackend"


class BenchSystem(Protocol):
    """What ``run_system`` drives: a store with its staging memory, chunk ``i`` in buffer ``i``."""

    name: str

    def key(self, tag: str, i: int) -> Any: ...
    def fill(self, i: int) -> None: ...
    def store(self, keys: list[Any], indices: list[int], timeout_s: float) -> list[str]: ...
    def prepare_load(self) -> None: ...
    def before_single_load(self, i: int) -> None: ...
    def load(self, keys: list[Any], indices: list[int]) -> list[str]: ...
    def loaded_digest(self, i: int) -> bytes: ...
    def files(self) -> list[Path]: ...
    def info(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class LMCacheSystem:
    """LMCache's StorageManager with its LocalCPUBackend (allocator, no hot
    cache: reads must come from the disk tier) and LocalDiskBackend."""

    name = "lmcache"

    def __init__(self, root: Path, chunk_bytes: int, num_chunks: int, concurrency: int, stored_chunks: int, **_: Any):
        import torch
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.storage_manager import StorageManager

        if chunk_bytes % BYTES_PER_TOKEN:
            raise ValueError(f"chunk of {chunk_bytes} bytes is not a whole number of {BYTES_PER_TOKEN}-byte tokens")
        self.root, self.chunk, self.tokens = root, chunk_bytes, chunk_bytes // BYTES_PER_TOKEN
        root.mkdir(parents=True, exist_ok=True)
        gib = 1 << 30
        # The allocator holds every chunk of a phase (all are submitted at once)
        # plus slack for its alignment; the disk tier holds everything written
        # twice over (when full it evicts, and an evicted chunk would be a miss).
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=self.tokens,
            local_cpu=False,
            max_local_cpu_size=(num_chunks + 8) * chunk_bytes / gib,
            local_disk=f"file://{root}/",
            max_local_disk_size=2 * (stored_chunks + 8) * chunk_bytes / gib,
            extra_config={"disk_io_threads": concurrency},
        )
        self.metadata = LMCacheMetadata(
            model_name="pykvcache-bench",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.float32,
            kv_shape=(LAYERS, 2, self.tokens, KV_HEADS, HEAD_SIZE),
            chunk_size=self.tokens,
        )
        self.manager = StorageManager(self.config, self.metadata, event_manager=EventManager())
        self.disk = self.manager.storage_backends[LMCACHE_DISK]
        self.shape = torch.Size([2, LAYERS, self.tokens, KV_HEADS * HEAD_SIZE])
        self.dtype = torch.float32
        self.sources: dict[int, Any] = {}
        self.loaded: dict[int, Any] = {}

    def key(self, tag: str, i: int) -> Any:
        import hashlib

        from lmcache.utils import CacheEngineKey

        h = int.from_bytes(hashlib.sha256(f"{tag}-{i}".encode()).digest()[:16], "big")
        return CacheEngineKey(model_name="pykvcache-bench", world_size=1, worker_id=0, chunk_hash=h, dtype=self.dtype)

    def _allocate(self) -> Any:
        from lmcache.v1.memory_management import MemoryFormat

        obj = self.manager.allocate(self.shape, self.dtype, fmt=MemoryFormat.KV_2LTD, busy_loop=False)
        if obj is None:
            raise RuntimeError("LMCache's allocator has no room for a chunk")
        if obj.get_size() != self.chunk:
            raise RuntimeError(f"LMCache chunk is {obj.get_size()} bytes, expected {self.chunk}")
        return obj

    def fill(self, i: int) -> None:
        import numpy as np

        obj = self._allocate()
        np.frombuffer(obj.byte_array, dtype=np.uint8)[:] = np.frombuffer(payload(i, self.chunk), dtype=np.uint8)
        self.sources[i] = obj

    def _put(self, pairs: list[tuple[Any, int]], timeout_s: float) -> list[str]:
        left = {k for k, _ in pairs}
        lock, done = threading.Lock(), threading.Event()

        def completed(key: Any) -> None:
            with lock:
                left.discard(key)
                if not left:
                    done.set()

        objs = [self.sources.pop(i) for _, i in pairs]
        self.disk.batched_submit_put_task([k for k, _ in pairs], objs, on_complete_callback=completed)
        for obj in objs:  # StorageManager.batched_put drops the allocation's reference here
            obj.ref_count_down()
        if not done.wait(timeout_s):
            return [f"LMCache completed {len(pairs) - len(left)} of {len(pairs)} puts within {timeout_s:.0f} s"]
        return []

    def store(self, keys: list[Any], indices: list[int], timeout_s: float) -> list[str]:
        return self._put(list(zip(keys, indices, strict=True)), timeout_s)

    def prepare_load(self) -> None:
        # Freed chunks keep their bytes: a read that filled nothing would then
        # "verify". Zero the whole allocator region first.
        self.disk.local_cpu_backend.memory_allocator.buffer.zero_()

    def load(self, keys: list[Any], indices: list[int]) -> list[str]:
        objs = self.manager.batched_get(keys, location=LMCACHE_DISK)
        errors = []
        for k, i, obj in zip(keys, indices, objs, strict=True):
            if obj is None:
                errors.append(f"get {k.chunk_hash:x}: LMCache returned no chunk")
            else:
                self.loaded[i] = obj
        return errors

    def before_single_load(self, i: int) -> None:
        """Nothing to clear: each get gets a fresh allocation, and the region was
        zeroed before the bulk load; stale bytes there belong to other chunks."""

    def loaded_digest(self, i: int) -> bytes:
        obj = self.loaded.pop(i)
        try:
            return digest(obj.byte_array)
        finally:
            obj.ref_count_down()

    def files(self) -> list[Path]:
        return sorted(p for p in self.root.iterdir() if p.is_file())

    def info(self) -> dict[str, Any]:
        from importlib.metadata import version

        return {
            "lmcache": version("lmcache"),
            "disk_io_threads": self.config.get_extra_config_value("disk_io_threads", 4),
            "o_direct": bool(self.disk.use_odirect),
            "allocator": type(self.disk.local_cpu_backend.memory_allocator).__name__,
            # The install's directory name only: reports carry no machine-specific paths.
            "lmcache_install": Path(sys.modules["lmcache"].__file__ or "").parent.parent.name,
        }

    def close(self) -> None:
        for obj in [*self.sources.values(), *self.loaded.values()]:
            obj.ref_count_down()
        self.manager.close()


class PykvcacheSystem:
    """pykvcache's BlockStore: one staging slot per chunk of a phase (all in
    flight, like LMCache's allocator), ``queue_depth`` = the same concurrency."""

    name = "pykvcache"

    def __init__(
        self,
        root: Path,
        chunk_bytes: int,
        num_chunks: int,
        concurrency: int,
        stored_chunks: int,
        store_kwargs: dict[str, Any] | None = None,
    ):
        from pykvcache import BlockStore, StagingPool

        self.root, self.chunk, self.n = root, chunk_bytes, num_chunks
        root.mkdir(parents=True, exist_ok=True)
        # One more slot for the one-at-a-time operations.
        self.pool = StagingPool(chunk_bytes, num_chunks + 1)
        self.free = [self.pool.acquire() for _ in range(num_chunks)]
        self.spare = self.pool.acquire()
        self.slot_of: dict[int, int] = {}
        self.store_ = BlockStore(
            [str(root)],
            self.pool,
            namespace="pykvcache-bench",
            capacity_bytes=2 * (stored_chunks + 8) * (chunk_bytes + (1 << 20)),
            queue_depth=concurrency,
            **(store_kwargs or {}),
        )

    def key(self, tag: str, i: int) -> bytes:
        return f"{tag}-{i}".encode()

    def fill(self, i: int) -> None:
        slot = self.slot_of.get(i)
        if slot is None:
            slot = self.slot_of[i] = self.free.pop() if i < self.n else self.spare
        with self.pool.view(slot) as v:
            v[:] = payload(i, self.chunk)

    def _wait(self, handles: list[Any]) -> list[str]:
        errors = []
        for h in handles:
            r = h.wait()
            if not r.ok:
                errors.append(f"{h.op} {h.key!r}: {r.status} {r.message}")
        return errors

    def store(self, keys: list[bytes], indices: list[int], timeout_s: float) -> list[str]:
        return self._wait([self.store_.put(k, self.slot_of[i], self.chunk) for k, i in zip(keys, indices, strict=True)])

    def prepare_load(self) -> None:
        zero = bytes(self.chunk)
        for slot in self.slot_of.values():
            with self.pool.view(slot) as v:
                v[:] = zero

    def before_single_load(self, i: int) -> None:
        # The spare slot still holds the previous chunk: a get that filled
        # nothing must not verify.
        with self.pool.view(self.slot_of[i]) as v:
            v[:] = bytes(self.chunk)

    def load(self, keys: list[bytes], indices: list[int]) -> list[str]:
        return self._wait([self.store_.get(k, self.slot_of[i]) for k, i in zip(keys, indices, strict=True)])

    def loaded_digest(self, i: int) -> bytes:
        with self.pool.view(self.slot_of[i]) as v:
            return digest(v)

    def files(self) -> list[Path]:
        return sorted(p for p in self.root.rglob("*") if p.is_file())

    def info(self) -> dict[str, Any]:
        s = self.store_
        return {"backend": s.backend, "fixed_buffers": s.fixed_buffers, "direct_io": s.direct_io}

    def close(self) -> None:
        self.store_.close()
        for slot in {*self.free, *self.slot_of.values(), self.spare}:
            self.pool.release(slot)
        self.pool.close()


SYSTEMS: dict[str, Callable[..., BenchSystem]] = {"pykvcache": PykvcacheSystem, "lmcache": LMCacheSystem}


def _fsync_all(paths: list[Path]) -> list[str]:
    """fsync every file; no errors (an fsync that fails raises)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return []


def run_system(spec: dict[str, Any]) -> dict[str, Any]:
    """Store then load ``chunks`` chunks with every one in flight, then one at a
    time for per-operation latency; every chunk read is checked byte for byte.

    Phases: ``write`` (until the system acknowledges every put), ``flush``
    (fsync of every file it wrote: LMCache's writes are buffered, so its bytes
    reach the device here), ``read`` (page cache dropped first)."""
    root = Path(spec["root"])
    chunk, n, conc, lat_ops = spec["chunk_bytes"], spec["chunks"], spec["concurrency"], spec["latency_ops"]
    disk = DiskCounter(spec.get("sysfs"))
    params = {"concurrency": conc, "repeat": spec["repeat"]}
    kwargs = {"store_kwargs": spec.get("store_kwargs") or {}} if spec["system"] == "pykvcache" else {}
    system = SYSTEMS[spec["system"]](root, chunk, n, conc, n + lat_ops, **kwargs)
    out: dict[str, Any] = {"phases": [], "latency_s": {"write": [], "read": []}, "verified": 0}
    # Generous: a stalled put is an error, not a hang (1 MB/s floor).
    timeout_s = max(60.0, n * chunk / 1e6)

    def phase(direction: str, fn: Any, *, cold: bool | None = None) -> None:
        d0 = disk.sample()
        with CpuMeter() as meter:
            errors = fn()
        delta = DiskCounter.delta(d0, disk.sample())
        out["phases"].append(
            PhaseResult.measured(
                system.name, direction, chunk, n if not errors else 0, meter.result, params, delta, cold, errors, system.info()
            ).to_dict()
        )
        if errors:
            raise RuntimeError(f"{system.name} {direction} failed: {errors[0]} ({len(errors)} errors)")

    try:
        tag = spec["tag"]
        keys = [system.key(tag, i) for i in range(n)]
        indices = list(range(n))
        for i in indices:
            system.fill(i)
        settle()
        phase("write", lambda: system.store(keys, indices, timeout_s))
        files = system.files()
        phase("flush", lambda: _fsync_all(files))
        # One operation at a time: the latency of a put and of a cold get alone.
        lat_keys = [system.key(tag + "-lat", j) for j in range(lat_ops)]
        for j in range(lat_ops):
            system.fill(n + j)
            t0 = time.perf_counter()
            errors = system.store([lat_keys[j]], [n + j], timeout_s)
            out["latency_s"]["write"].append(time.perf_counter() - t0)
            if errors:
                raise RuntimeError(f"{system.name} single put failed: {errors[0]}")
        system.prepare_load()
        dropped = drop_caches(spec.get("cold_metadata", False)) if spec["cold"] else False
        settle()
        phase("read", lambda: system.load(keys, indices), cold=dropped)
        for i in indices:
            if system.loaded_digest(i) != expected_digest(i, chunk):
                raise RuntimeError(f"{system.name} loaded wrong bytes for chunk {i} of {n}")
            out["verified"] += 1
        for j in range(lat_ops):
            system.before_single_load(n + j)
            t0 = time.perf_counter()
            errors = system.load([lat_keys[j]], [n + j])
            out["latency_s"]["read"].append(time.perf_counter() - t0)
            if errors:
                raise RuntimeError(f"{system.name} single get failed: {errors[0]}")
            if system.loaded_digest(n + j) != expected_digest(n + j, chunk):
                raise RuntimeError(f"{system.name} loaded wrong bytes for single-get chunk {j}")
            out["verified"] += 1
        out["files"] = len(system.files())
        out["file_bytes"] = sum(p.stat().st_size for p in system.files())
        out["info"] = system.info()
    finally:
        system.close()
    return out


def main(argv: list[str]) -> int:
    """``python -m pykvcache.tools.bench.lmcache_disk SPEC.json OUT.json``"""
    spec = json.loads(Path(argv[0]).read_text())
    try:
        result = run_system(spec)
    except Exception as e:  # reported to the parent with its text, never a number
        import traceback

        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    Path(argv[1]).write_text(json.dumps(result))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
