#!/usr/bin/env python3
"""The benchmark on a GPU machine, one command, under 8 minutes.

1. Storage on the local disk: ``pykvcache bench`` parts ``storage`` (engine vs
   fio) and ``fs_tier`` (vs vLLM's filesystem tier) with the default sweep.
2. End to end on the GPU with a small real model if one is present locally
   (``--model``, ``$PYKVCACHE_GPU_MODEL``, or the smallest Llama/Qwen/Mistral
   checkpoint of at most 8 GB in the local Hugging Face cache), a generated
   one otherwise (random weights, ~0.2 B parameters, built offline):
   a. prefix reuse: greedy tokens with and without pykvcache must match; after
      the device prefix cache is emptied the prefixes come back from
      pykvcache; time of a one-token request, recompute vs load;
   b. the ``ttft`` benchmark part (TTFT vs prefix length, the gate's choice)
      when it is installed.

3. Prefill vs load crossover without vLLM (torch + transformers only, no
   network): prefill time vs prefix length on random-weight bf16 models of
   real geometry (Llama-3.2-3B, Qwen3-4B, Llama-3.1-8B shapes), the load time
   of the same KV bytes from disk through the engine and ``CudaCopier``, and
   the crossover per model, measured and at 7, 14 and 28 GB/s of storage
   (:mod:`pykvcache.tools.gpu_crossover`). ``--device cpu --tiny`` runs this
   part alone on the CPU with a two-layer model (a smoke run, not a figure).

Where there is no GPU (and no ``--device cpu``) it prints "skipped: no GPU
(...)" and exits 0. Parts 1 and 3 need no vLLM; part 2 is skipped without a
CUDA build of vLLM. Exit status 1: a check failed or a part broke. Report:
``<out>/crossover.md``, ``<out>/crossover.json``, ``<out>/gpu_e2e.json``.

    python scripts/gpu_bench.py [--out gpu-bench-out] [--dir DIR] [--model PATH]
    python scripts/gpu_bench.py --device cpu --tiny --out /tmp/x   # smoke, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

MAX_MODEL_BYTES = 8 << 30
ARCHITECTURES = ("Llama", "Qwen2", "Qwen3", "Mistral")
#: A generated model big enough that prefill time on a GPU is not noise.
GENERATED = dict(
    vocab_size=800, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=16384, initializer_range=0.02,
)  # fmt: skip
PREFIX_WORDS = (400, 1600, 3200)  # about 1k, 4k and 8k tokens
CHUNK_TOKENS = 256
TTFT_LENGTHS = (512, 2048, 8192)


def log(msg: str) -> None:
    print(msg, flush=True)


def no_gpu_reason() -> str | None:
    """None when a CUDA GPU is usable; the cheap checks come first so a
    machine without a GPU answers in well under a second."""
    if not (shutil.which("nvidia-smi") or os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")):
        return "no NVIDIA driver or device node on this machine"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return None


def find_local_model() -> Path | None:
    """The smallest supported checkpoint in the local Hugging Face cache."""
    roots = [Path(os.environ["HF_HOME"]) / "hub"] if os.environ.get("HF_HOME") else []
    roots += [Path.home() / ".cache" / "huggingface" / "hub"]
    found: list[tuple[int, Path]] = []
    for root in roots:
        for config in root.glob("models--*/snapshots/*/config.json"):
            try:
                archs = json.loads(config.read_text()).get("architectures") or []
            except (OSError, ValueError):
                continue
            weights = list(config.parent.glob("*.safetensors"))
            size = sum(w.stat().st_size for w in weights if w.exists())
            if weights and 0 < size <= MAX_MODEL_BYTES and any(a.startswith(ARCHITECTURES) for a in archs):
                found.append((size, config.parent))
    return min(found)[1] if found else None


def pick_model(given: str | None, workdir: Path) -> tuple[str, str]:
    if given:
        return given, "given"
    if env := os.environ.get("PYKVCACHE_GPU_MODEL"):
        return env, "$PYKVCACHE_GPU_MODEL"
    if (local := find_local_model()) is not None:
        return str(local), "local Hugging Face cache"
    from pykvcache.testing.tiny_model import TinyModelSpec, build_tiny_model

    return str(build_tiny_model(workdir / "models", TinyModelSpec(**GENERATED))), "generated (random weights)"


def storage(out: Path, directory: Path) -> int:
    from pykvcache.tools.bench import BenchConfig, run_bench

    config = BenchConfig(out=out / "storage", directory=directory, parts=["storage", "fs_tier"], argv=sys.argv)
    result = run_bench(config)
    for o in result.outputs:
        log(f"[{o.name}] " + (f"skipped: {o.skipped}" if o.skipped else f"{len(o.targets)} targets"))
        for name, (met, why) in o.targets.items():
            log(f"    {'met   ' if met else 'missed'} {name}: {why}")
    log(f"storage report: {result.report} ({result.elapsed_s:.0f} s)")
    return 1 if result.failed else 0


def e2e_scenario(model: str, store: Path, generated: bool) -> dict:
    from pykvcache.testing.tiny_model import synthetic_text

    max_len = min(16384, max_positions(model))
    # Synthetic words are 2-4 tokens each with a real tokenizer: keep prompts inside the context.
    lengths = [w for w in PREFIX_WORDS if 4 * w + 256 <= max_len] or [max_len // 8]
    cold, warm = [], []
    for i, words in enumerate(lengths):
        prefix = synthetic_text(words, seed=700 + i)
        cold.append({"op": "generate", "name": f"cold_{words}", "prompts": [f"{prefix} {synthetic_text(8, seed=1)}"], "max_tokens": 1})
        warm.append({"op": "generate", "name": f"warm_{words}", "prompts": [f"{prefix} {synthetic_text(8, seed=2)}"], "max_tokens": 1})
    # Warm-up so the first timed request does not pay one-time CUDA costs.
    phases = [{"op": "generate", "name": "warmup", "prompts": [synthetic_text(50, seed=3)], "max_tokens": 4},
              *cold, {"op": "settle"}, {"op": "reset_prefix_cache"}, *warm]  # fmt: skip
    kv = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "NvmeOffloadingSpec", "spec_module_path": "pykvcache.vllm",
            "storage_dirs": [str(store)], "capacity_bytes": "32GiB", "staging_bytes": "2GiB", "block_size": CHUNK_TOKENS,
        },
    }  # fmt: skip
    return {
        "model": model,
        "engine": {
            "dtype": "bfloat16" if generated else "auto",
            "enable_prefix_caching": True,
            "enforce_eager": True,
            "gpu_memory_utilization": 0.3,
            "max_model_len": max_len,
            "disable_log_stats": False,
            "seed": 0,
        },  # fmt: skip
        "runs": [{"name": "without", "phases": phases}, {"name": "with", "kv_transfer_config": kv, "phases": phases}],
    }


def e2e_prefix_reuse(model: str, generated: bool, out: Path, workdir: Path) -> tuple[int, dict]:
    from pykvcache.tools.vllm_run import start_child, wait_child

    proc, vlog = start_child(e2e_scenario(model, workdir / "store", generated), out, "gpu_e2e_vllm")
    result = wait_child(proc, vlog, lambda run, step: log(f"    {run}: {step}"), timeout=420)
    runs = {r["name"]: {p["name"]: p for p in r["phases"]} for r in result["runs"]}
    rows, failures = [], []
    for words in [int(n.split("_")[1]) for n in runs["with"] if n.startswith("warm_")]:
        a, b = runs["without"][f"warm_{words}"], runs["with"][f"warm_{words}"]
        rows.append({
            "prompt_tokens": b["prompt_lens"][0],
            "recompute_s": a["seconds"], "pykvcache_s": b["seconds"],
            "speedup": round(a["seconds"] / b["seconds"], 2) if b["seconds"] else None,
            "cached_tokens": b["num_cached_tokens"][0],
            "disk_read_bytes_so_far": b["metrics"].get("vllm:pykvcache_disk_read_bytes", 0),
        })  # fmt: skip
        if b["num_cached_tokens"][0] < b["prompt_lens"][0] // 2:
            failures.append(f"prefix of ~{b['prompt_lens'][0]} tokens not served from pykvcache")
    same = all(
        runs["without"][n].get("tokens") == runs["with"][n].get("tokens") for n in runs["with"] if runs["with"][n]["op"] == "generate"
    )
    if not same:
        failures.append("greedy tokens differ with pykvcache")
    report = {"model": model, "rows": rows, "tokens_identical": same, "failures": failures,
              "startup_s": {r["name"]: r["startup_s"] for r in result["runs"]}}  # fmt: skip
    return (1 if failures else 0), report


def max_positions(model: str) -> int:
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return 4096
    return int(config.get("max_position_embeddings") or 4096)


def ttft_part(out: Path, directory: Path, model: str) -> int:
    from pykvcache.tools.bench import BenchConfig, run_bench
    from pykvcache.tools.bench.parts import PARTS, load_builtin_parts

    load_builtin_parts()
    if "ttft" not in PARTS:
        log("ttft part: not installed in this version, skipped")
        return 0
    config = BenchConfig(out=out / "ttft", directory=directory, parts=["ttft"], argv=sys.argv, quick=True)
    # Read by the ttft part when present (BenchConfig attributes ttft_*): GPU-sized prefixes.
    config.ttft_model = model  # type: ignore[attr-defined]
    config.ttft_lengths = [n for n in TTFT_LENGTHS if n + 64 <= max_positions(model)]  # type: ignore[attr-defined]
    result = run_bench(config)
    for o in result.outputs:
        log(f"[{o.name}] " + (f"skipped: {o.skipped}" if o.skipped else ""))
        for name, (met, why) in o.targets.items():
            log(f"    {'met   ' if met else 'missed'} {name}: {why}")
    return 1 if result.failed else 0


CROSSOVER_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
TINY_LENGTHS = (128, 256, 512, 1024)


def crossover_part(out: Path, directory: Path, device: str, tiny: bool) -> int:
    from pykvcache.tools import gpu_crossover as gc

    shapes = [gc.TINY] if tiny else list(gc.SHAPES.values())
    lengths = list(TINY_LENGTHS if tiny else CROSSOVER_LENGTHS)
    store = directory / "crossover-store"
    store.mkdir(parents=True, exist_ok=True)
    try:
        results = gc.run(shapes, lengths, device, store, repeats=2 if tiny else 3, log=log)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    if device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name(0)
    else:
        name = "CPU (smoke run, float32)"
    (out / "crossover.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "crossover.md").write_text(gc.markdown(results, name))
    log(f"    report: {out / 'crossover.md'}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-bench-out"))
    parser.add_argument("--dir", type=Path, default=None, help="directory on the local disk to measure (default: --out)")
    parser.add_argument("--model", default=None, help="model directory for the end-to-end part")
    parser.add_argument("--no-storage", action="store_true")
    parser.add_argument("--no-e2e", action="store_true")
    parser.add_argument("--no-crossover", action="store_true", help="skip part 3 (prefill vs load crossover)")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: run part 3 only, on the CPU (a smoke run where there is no GPU)"
    )
    parser.add_argument("--tiny", action="store_true", help="part 3 with a two-layer model and short prefixes")
    args = parser.parse_args()
    if args.device == "cpu":
        t0 = time.monotonic()
        args.out.mkdir(parents=True, exist_ok=True)
        log("3. prefill vs load crossover on the CPU" + (" (tiny model)" if args.tiny else ""))
        status = crossover_part(args.out, args.dir or args.out, "cpu", args.tiny)
        log(("ok" if status == 0 else "FAILED") + f" ({time.monotonic() - t0:.0f} s); report in {args.out}/")
        return status
    if (reason := no_gpu_reason()) is not None:
        log(f"skipped: no GPU ({reason})")
        return 0
    import torch

    t0 = time.monotonic()
    log(f"GPU: {torch.cuda.get_device_name(0)}")
    args.out.mkdir(parents=True, exist_ok=True)
    directory = args.dir or args.out
    workdir = args.out / "work"
    shutil.rmtree(workdir, ignore_errors=True)
    status = 0
    if not args.no_storage:
        log("1. storage on the local disk (engine vs fio, vs vLLM's fs tier)")
        status |= storage(args.out, directory)
    if not args.no_crossover:
        # Before the vLLM part: it needs no vLLM, and is what a GPU host without it can measure.
        log("3. prefill vs load crossover (transformers + engine + CudaCopier, no vLLM)")
        try:
            status |= crossover_part(args.out, directory, "cuda", args.tiny)
        except Exception as e:  # noqa: BLE001 - report, keep the other parts
            log(f"    crossover part failed: {type(e).__name__}: {e}")
            status |= 1
    if not args.no_e2e:
        try:
            from vllm.platforms import current_platform
        except ImportError as e:
            current_platform = None
            log(f"2. end to end: skipped (vLLM is not installed: {e})")
        if current_platform is None:
            pass
        elif not current_platform.is_cuda():
            log("2. end to end: skipped (the installed vLLM is not a CUDA build)")
        else:
            model, where = pick_model(args.model, workdir)
            log(f"2. end to end on the GPU with {model} ({where})")
            code, report = e2e_prefix_reuse(model, where.startswith("generated"), args.out, workdir)
            (args.out / "gpu_e2e.json").write_text(json.dumps(report, indent=1))
            for row in report["rows"]:
                log(f"    {row['prompt_tokens']:>6} tokens: recompute {row['recompute_s'] * 1e3:7.1f} ms, "
                    f"pykvcache {row['pykvcache_s'] * 1e3:7.1f} ms ({row['cached_tokens']} tokens loaded)")  # fmt: skip
            log(f"    tokens identical: {report['tokens_identical']}")
            status |= code
            status |= ttft_part(args.out, directory, model)
    shutil.rmtree(workdir, ignore_errors=True)
    log(("ok" if status == 0 else "FAILED") + f" ({time.monotonic() - t0:.0f} s); report in {args.out}/")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
