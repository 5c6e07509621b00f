#!/usr/bin/env python3
"""One-command check of pykvcache's CUDA path (a few minutes on one GPU).

1. Copy path: a staging pool shared the way vLLM workers see it, GPU KV pages,
   the real worker. Checks that staging is host-registered (cudaHostRegister,
   once), that copies run on a side stream ordered after the compute stream,
   that bytes round-trip exactly, and prints store (GPU->staging) and load
   (staging->GPU) GB/s.
2. Engine: a tiny Llama under vLLM (needs a CUDA build of vLLM), greedy
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


def _log(msg: str) -> None:
    print(msg, flush=True)


def check_copy_path(chunk_mib: int, chunks: int) -> dict:
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )

    from pykvcache import StagingPool
    from pykvcache.vllm.layout import ChunkLayout
    from pykvcache.vllm.transfer_spec import StagingSlotsSpec
    from pykvcache.vllm.worker import StagingWorker

    layers, bpc = 8, 16
    page = chunk_mib * (1 << 20) // (layers * bpc)
    num_blocks = chunks * bpc + 1
    layout = ChunkLayout(bpc, bytes_per_block=layers * page, world_size=1)
    kv = [torch.randint(-128, 127, (num_blocks, page), dtype=torch.int8, device="cuda")
          for _ in range(layers)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, page) for t in kv],
        group_data_refs=[[CanonicalKVCacheRef(i, page) for i in range(layers)]],
    )
    shm = f"pykvcache-gpucheck-{os.getpid()}"
    pool = StagingPool(layout.payload_bytes, chunks, shm_name=shm)
    worker = StagingWorker(caches, layout, shm, rank=0)
    blocks = list(range(1, num_blocks))
    spec = GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])
    slots = StagingSlotsSpec(list(range(chunks)))
    original = [t.clone() for t in kv]

    def run(job: int, store: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if store:
            worker.submit_store(job, spec, slots)
        else:
            worker.submit_load(job, slots, spec, expedited=False)
        copier = worker.copier
        side = copier._stream
        assert side != torch.cuda.current_stream(), "copies must not run on the compute stream"
        worker.wait({job})
        elapsed = time.perf_counter() - t0
        results = [r for r in worker.get_finished() if r.job_id == job]
        assert results and results[0].success
        return elapsed

    total = chunks * layout.payload_bytes
    run(0, store=True)  # warm-up
    store_s = min(run(1 + i, store=True) for i in range(3))
    for t in kv:
        t.zero_()
    load_s = min(run(10 + i, store=False) for i in range(3))
    identical = all(torch.equal(a, b) for a, b in zip(kv, original))
    report = {
        "staging_registered": bool(worker.copier.registered),
        "batched_copies": worker.copier._batch_op is not None,
        "roundtrip_identical": identical,
        "store_GBps": round(total / store_s / 1e9, 2),
        "load_GBps": round(total / load_s / 1e9, 2),
        "bytes_per_pass": total,
    }
    worker.shutdown()
    del worker, original
    import gc

    gc.collect()
    pool.close()
    return report


def _engine(scenario_path: str) -> int:
    """Child process: one vLLM engine, greedy outputs as JSON on the last line."""
    scenario = json.loads(Path(scenario_path).read_text())
    from vllm import LLM, SamplingParams

    llm = LLM(model=scenario["model"], dtype="float32", enable_prefix_caching=True,
              enforce_eager=True, gpu_memory_utilization=0.2, max_model_len=2048,
              kv_cache_memory_bytes=64 << 20, disable_log_stats=False, seed=0,
              **scenario.get("llm", {}))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = {}
    for name, prompts, reset in scenario["phases"]:
        if reset:
            llm.reset_prefix_cache()
        res = llm.generate(prompts, params, use_tqdm=False)
        out[name] = {"tokens": [list(r.outputs[0].token_ids) for r in res],
                     "cached": [r.num_cached_tokens or 0 for r in res]}
        time.sleep(0.5)
    print("RESULT " + json.dumps(out), flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


def check_engine(workdir: Path) -> dict:
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return {"skipped": "the installed vLLM is not a CUDA build"}
    from pykvcache.testing.tiny_model import build_tiny_model, synthetic_text

    model = str(build_tiny_model(workdir / "models"))
    prefix = synthetic_text(250, seed=100)
    xs = [f"{prefix} {synthetic_text(12, seed=200 + i)}" for i in range(3)]
    fillers = [synthetic_text(250, seed=300 + i) for i in range(6)]
    phases = [("first", xs, False), ("fillers", fillers, True), ("repeat", [xs[0]], False)]
    kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {
              "spec_name": "NvmeOffloadingSpec", "spec_module_path": "pykvcache.vllm",
              "storage_dirs": [str(workdir / "store")], "capacity_bytes": 1 << 30,
              "staging_bytes": 8 << 20, "block_size": 64}}
    results = {}
    for name, llm_kwargs in (("baseline", {}), ("pykvcache", {"kv_transfer_config": kv})):
        path = workdir / f"{name}.json"
        path.write_text(json.dumps({"model": model, "llm": llm_kwargs, "phases": phases}))
        proc = subprocess.run([sys.executable, __file__, "--engine", str(path)],
                              capture_output=True, text=True, timeout=420,
                              env=dict(os.environ, HF_HUB_OFFLINE="1"))
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
    copy = check_copy_path(args.chunk_mib, args.chunks)
    _log("copy path: " + json.dumps(copy))
    if not copy["staging_registered"]:
        failures.append("staging region was not host-registered")
    if not copy["roundtrip_identical"]:
        failures.append("store+load did not round-trip the KV bytes")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="pykvcache-gpucheck-"))
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
