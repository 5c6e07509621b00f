#!/usr/bin/env python3
"""One-command check of pykvcache's CUDA path (a few minutes on one GPU).

1. Copy path: a staging pool shared the way vLLM workers see it, GPU KV pages,
   the real worker (or, where vLLM is not installed, ``CudaCopier``, which the
   worker delegates every CUDA copy to). Checks that staging is host-registered
   (cudaHostRegister, once), that copies run on a side stream, that bytes
   round-trip exactly, and prints store (GPU->staging) and load (staging->GPU)
   GB/s.
2. Ordering: a store submitted while the compute stream still has a slow kernel
   and page writes queued must copy the written pages.
3. Disk: GPU -> staging -> this machine's disk -> (page cache dropped) ->
   staging -> GPU through a BlockStore, bytes exact, GB/s of each leg.
4. Engine: a tiny Llama under vLLM (needs a CUDA build of vLLM), greedy
   tokens with and without pykvcache, and a prefix served from pykvcache
   after the device prefix cache was reset and filled with other prompts.

Where there is no GPU it prints "skipped: no GPU" and exits 0. Exit status 1
means a check failed.

    python scripts/gpu_check.py [--workdir DIR] [--chunk-mib 16] [--chunks 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple


def _log(msg: str) -> None:
    print(msg, flush=True)


class _Ref(NamedTuple):
    """vLLM's CanonicalKVCacheRef, for the copier harness without vLLM."""

    tensor_idx: int
    page_size_bytes: int


class _GpuSpec(NamedTuple):
    """vLLM's GPULoadStoreSpec fields the copy path reads."""

    block_ids: list[int]
    group_sizes: list[int]
    block_indices: list[int]


def _vllm_worker_available() -> bool:
    try:
        import vllm.v1.kv_offload.base  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "use the copier directly"
        return False
    return True


class _Harness:
    """GPU KV pages + a staging pool + the copy path under test.

    With vLLM installed the copies go through the real worker
    (``StagingWorker``); without it through ``CudaCopier``, the class that
    worker delegates every CUDA copy to, driven the same way (submit, wait on
    the end event, collect finished jobs)."""

    def __init__(self, chunk_mib: int, chunks: int, layers: int = 8, bpc: int = 16) -> None:
        import torch
        from pykvcache import StagingPool
        from pykvcache.vllm.layout import ChunkLayout

        self.page = chunk_mib * (1 << 20) // (layers * bpc)
        self.chunks = chunks
        self.num_blocks = chunks * bpc + 1  # block 0 is vLLM's null block
        self.layout = ChunkLayout(bpc, bytes_per_block=layers * self.page, world_size=1)
        self.kv = [torch.randint(-128, 127, (self.num_blocks, self.page), dtype=torch.int8, device="cuda") for _ in range(layers)]
        blocks = list(range(1, self.num_blocks))
        self.through_vllm = _vllm_worker_available()
        # vLLM's workers map staging by name; the copier alone takes anonymous
        # memory (a small /dev/shm, as in containers, cannot hold 1 GiB).
        self.shm = f"pykvcache-gpucheck-{os.getpid()}" if self.through_vllm else None
        self.pool = StagingPool(self.layout.payload_bytes, chunks, shm_name=self.shm)
        if self.through_vllm:
            from pykvcache.vllm.transfer_spec import StagingSlotsSpec
            from pykvcache.vllm.worker.staging_worker import StagingWorker
            from vllm.v1.kv_offload.base import (
                CanonicalKVCacheRef,
                CanonicalKVCaches,
                CanonicalKVCacheTensor,
                GPULoadStoreSpec,
            )

            caches = CanonicalKVCaches(
                tensors=[CanonicalKVCacheTensor(t, self.page) for t in self.kv],
                group_data_refs=[[CanonicalKVCacheRef(i, self.page) for i in range(layers)]],
            )
            self.worker = StagingWorker(caches, self.layout, self.shm, rank=0)
            self.spec = GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])
            self.slots = StagingSlotsSpec(list(range(chunks)))
        else:
            from pykvcache.vllm.worker.cuda_copy import CudaCopier
            from pykvcache.vllm.worker.slot_map import SlotMap

            slot_map = SlotMap([[_Ref(i, self.page) for i in range(layers)]], self.layout)
            self.copier_only = CudaCopier(self.kv, slot_map, self.pool, rank=0)
            self.spec = _GpuSpec(blocks, [len(blocks)], [0])
            self.slots = list(range(chunks))

    @property
    def copier(self):
        return self.worker.copier if self.through_vllm else self.copier_only

    @property
    def total_bytes(self) -> int:
        return self.chunks * self.layout.payload_bytes

    def submit(self, job: int, *, store: bool) -> None:
        if self.through_vllm:
            if store:
                self.worker.submit_store(job, self.spec, self.slots)
            else:
                self.worker.submit_load(job, self.slots, self.spec, expedited=False)
        else:
            self.copier_only.submit(job, self.spec, self.slots.copy(), to_gpu=not store)

    def wait(self, job: int) -> None:
        if self.through_vllm:
            self.worker.wait({job})
            results = [r for r in self.worker.get_finished() if r.job_id == job]
            assert results and results[0].success, f"job {job} did not finish successfully"
        else:
            self.copier_only.wait([job])
            assert any(j == job for j, _, _ in self.copier_only.finished()), f"job {job} not reported finished"

    def run(self, job: int, *, store: bool) -> float:
        import torch

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.submit(job, store=store)
        assert self.copier._stream != torch.cuda.current_stream(), "copies must not run on the compute stream"
        self.wait(job)
        return time.perf_counter() - t0

    def staging_tensor(self):
        import torch

        return torch.frombuffer(self.pool.region(), dtype=torch.int8)

    def close(self) -> None:
        import gc

        if self.through_vllm:
            self.worker.shutdown()
        else:
            self.copier_only.drain()
        self.__dict__.pop("worker", None)
        self.__dict__.pop("copier_only", None)
        self.kv = []
        gc.collect()
        self.pool.close()


def _same_blocks(kv, original) -> bool:
    """Equal in every block the transfers cover (block 0, vLLM's null block, is
    never copied)."""
    import torch

    return all(torch.equal(a[1:], b[1:]) for a, b in zip(kv, original))


def check_copy_path(h: _Harness) -> dict:
    """Round trip GPU -> staging -> GPU, bytes exact; store/load GB/s."""
    original = [t.clone() for t in h.kv]
    h.run(0, store=True)  # warm-up
    store_s = min(h.run(1 + i, store=True) for i in range(3))
    for t in h.kv:
        t.zero_()
    load_s = min(h.run(10 + i, store=False) for i in range(3))
    identical = _same_blocks(h.kv, original)
    return {
        "through": "vLLM StagingWorker" if h.through_vllm else "CudaCopier (vLLM not installed)",
        "staging_registered": bool(h.copier.registered),
        "batched_copies": h.copier._batch_op is not None,
        "roundtrip_identical": identical,
        "store_GBps": round(h.total_bytes / store_s / 1e9, 2),
        "load_GBps": round(h.total_bytes / load_s / 1e9, 2),
        "bytes_per_pass": h.total_bytes,
    }


def check_stream_ordering(h: _Harness) -> dict:
    """A store submitted right after the compute stream queued a slow kernel and
    then rewrote the pages must copy the rewritten bytes: the side stream waits
    on the compute stream. Without that wait it would copy the old bytes."""
    import torch

    marker = 37
    staging = h.staging_tensor()
    staging.zero_()
    torch.cuda.synchronize()
    compute = torch.cuda.current_stream()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the compute stream
    for t in h.kv:
        t.fill_(marker)  # queued behind the sleep, still pending at submit
    pending_at_submit = not compute.query()
    h.submit(100, store=True)
    h.wait(100)
    row = h.layout.row_offset(0)
    ordered = all(
        bool((staging[h.pool.payload_offset(i) + row : h.pool.payload_offset(i) + row + h.layout.row_bytes] == marker).all())
        for i in range(h.chunks)
    )
    return {"compute_pending_at_submit": pending_at_submit, "store_saw_compute_writes": ordered}


def check_disk_to_gpu(h: _Harness, store_dir: Path) -> dict:
    """GPU -> staging -> NVMe (put) ... page cache dropped ... NVMe -> staging
    (get, verified) -> GPU: the whole tier on this machine's disk."""
    import torch
    from pykvcache import BlockStore

    for t in h.kv:
        t.random_(-128, 128)
    original = [t.clone() for t in h.kv]
    h.run(200, store=True)
    store_dir.mkdir(parents=True, exist_ok=True)
    with BlockStore([store_dir], h.pool, namespace="gpu-check", capacity_bytes=4 * h.total_bytes, queue_depth=32) as store:
        # The store writes only slots it owns: take all of them (a fresh pool hands out each once).
        owned = [h.pool.acquire() for _ in range(h.chunks)]
        assert sorted(owned) == list(range(h.chunks)), owned
        t0 = time.perf_counter()
        handles = [store.put(f"chunk-{i}".encode(), i, h.layout.payload_bytes) for i in range(h.chunks)]
        for handle in handles:
            handle.wait(120).raise_for_status()
        put_s = time.perf_counter() - t0
        os.sync()
        dropped = _drop_page_cache()
        h.staging_tensor().zero_()
        for t in h.kv:
            t.zero_()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        handles = [store.get(f"chunk-{i}".encode(), i) for i in range(h.chunks)]
        for handle in handles:
            handle.wait(120).raise_for_status()
        get_s = time.perf_counter() - t0
        h.submit(201, store=False)
        h.wait(201)
        total_s = time.perf_counter() - t0
        identical = _same_blocks(h.kv, original)
        info = {"backend": store.backend, "direct_io": store.direct_io, "fixed_buffers": store.fixed_buffers}
        for slot in owned:
            h.pool.release(slot)
    return {
        **info,
        "page_cache_dropped": dropped,
        "disk_roundtrip_identical": identical,
        "put_GBps": round(h.total_bytes / put_s / 1e9, 2),
        "get_GBps": round(h.total_bytes / get_s / 1e9, 2),
        "disk_to_gpu_GBps": round(h.total_bytes / total_s / 1e9, 2),
        "bytes": h.total_bytes,
    }


def _drop_page_cache() -> bool:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _engine(scenario_path: str) -> int:
    """Child process: one vLLM engine, greedy outputs as JSON on the last line."""
    scenario = json.loads(Path(scenario_path).read_text())
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=scenario["model"],
        dtype="float32",
        enable_prefix_caching=True,
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        max_model_len=2048,
        kv_cache_memory_bytes=64 << 20,
        disable_log_stats=False,
        seed=0,
        **scenario.get("llm", {}),
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = {}
    for name, prompts, reset in scenario["phases"]:
        if reset:
            llm.reset_prefix_cache()
        res = llm.generate(prompts, params, use_tqdm=False)
        out[name] = {"tokens": [list(r.outputs[0].token_ids) for r in res], "cached": [r.num_cached_tokens or 0 for r in res]}
        time.sleep(0.5)
    print("RESULT " + json.dumps(out), flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


def check_engine(workdir: Path) -> dict:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return {"skipped": "vLLM is not installed"}

    if not current_platform.is_cuda():
        return {"skipped": "the installed vLLM is not a CUDA build"}
    from pykvcache.testing.tiny_model import build_tiny_model, synthetic_text

    model = str(build_tiny_model(workdir / "models"))
    prefix = synthetic_text(250, seed=100)
    xs = [f"{prefix} {synthetic_text(12, seed=200 + i)}" for i in range(3)]
    fillers = [synthetic_text(250, seed=300 + i) for i in range(6)]
    phases = [("first", xs, False), ("fillers", fillers, True), ("repeat", [xs[0]], False)]
    kv = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "NvmeOffloadingSpec",
            "spec_module_path": "pykvcache.vllm",
            "storage_dirs": [str(workdir / "store")],
            "capacity_bytes": 1 << 30,
            "staging_bytes": 8 << 20,
            "block_size": 64,
        },
    }
    results = {}
    for name, llm_kwargs in (("baseline", {}), ("pykvcache", {"kv_transfer_config": kv})):
        path = workdir / f"{name}.json"
        path.write_text(json.dumps({"model": model, "llm": llm_kwargs, "phases": phases}))
        proc = subprocess.run(
            [sys.executable, __file__, "--engine", str(path)],
            capture_output=True,
            text=True,
            timeout=420,
            env=dict(os.environ, HF_HUB_OFFLINE="1"),
        )
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
            raise RuntimeError(f"{name} engine failed:\n{tail}")
        results[name] = json.loads(lines[-1][7:])
    base, ours = results["baseline"], results["pykvcache"]
    return {
        "tokens_identical": all(base[p]["tokens"] == ours[p]["tokens"] for p, _, _ in phases),
        "repeat_cached_tokens": ours["repeat"]["cached"][0],
        "baseline_repeat_cached_tokens": base["repeat"]["cached"][0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--chunk-mib", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        return _engine(args.engine)
    try:
        import torch
    except ImportError:
        _log("skipped: no GPU (torch is not installed)")
        return 0
    if not torch.cuda.is_available():
        _log("skipped: no GPU (torch.cuda.is_available() is False)")
        return 0
    _log(f"GPU: {torch.cuda.get_device_name(0)}")
    failures = []
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="pykvcache-gpucheck-"))
    harness = _Harness(args.chunk_mib, args.chunks)
    try:
        copy = check_copy_path(harness)
        _log("copy path: " + json.dumps(copy))
        order = check_stream_ordering(harness)
        _log("stream ordering: " + json.dumps(order))
        disk = check_disk_to_gpu(harness, workdir / "disk-check")
        _log("disk to GPU: " + json.dumps(disk))
    finally:
        harness.close()
    if not copy["staging_registered"]:
        failures.append("staging region was not host-registered")
    if not copy["roundtrip_identical"]:
        failures.append("store+load did not round-trip the KV bytes")
    if not order["store_saw_compute_writes"]:
        failures.append("a store copied pages before the compute stream finished writing them")
    if not disk["disk_roundtrip_identical"]:
        failures.append("KV bytes changed on the way GPU -> disk -> GPU")
    try:
        engine = check_engine(workdir)
    except Exception as exc:  # noqa: BLE001 - report and fail, do not hide
        engine = {"error": str(exc)}
        failures.append("engine check failed")
    _log("engine: " + json.dumps(engine))
    if "tokens_identical" in engine:
        if not engine["tokens_identical"]:
            failures.append("tokens differ with pykvcache")
        if engine["repeat_cached_tokens"] <= engine["baseline_repeat_cached_tokens"]:
            failures.append("the repeated prefix was not served from pykvcache")
    if failures:
        _log("FAILED: " + "; ".join(failures))
        return 1
    _log("ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
