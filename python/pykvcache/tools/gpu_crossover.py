"""Prefill vs load from disk, per model of real geometry: where loading starts to win.

Needs torch and transformers, not vLLM (the common locked-down GPU host has
no vLLM and no network): models are built from hand-written configurations of
real architectures (Llama-3.2-3B, Qwen3-4B, Llama-3.1-8B) with random weights
in bf16, so no download. For each model:

* prefill: seconds of one forward pass over ``n`` tokens (transformers, SDPA,
  logits of the last token only), median of a few repeats after a warm-up;
* load: the KV bytes of the same ``n`` tokens (``2 x layers x kv_heads x
  head_dim x 2`` bytes per token, in 256-token chunks as the vLLM integration
  lays them out) written through the engine (``BlockStore``), the page cache
  dropped when possible, read back into staging and copied into device
  memory through ``CudaCopier`` (``CpuCopier`` with ``--device cpu``): the
  copy path the vLLM worker uses, driven without vLLM.

The crossover is the gate's own arithmetic (:class:`pykvcache.gate.cost_model.CostModel`):
prefill fitted ``a + b n + c n^2``, load = fixed + bytes / disk bandwidth +
bytes / copy bandwidth; reported as measured and with the disk at 7, 14 and
28 GB/s (the copy and fixed cost as measured).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from pykvcache.gate.cost_model import CostModel, LoadCost, PrefillCurve

CHUNK_TOKENS = 256
BLOCK_TOKENS = 16
STORAGE_GBPS = (7.0, 14.0, 28.0)


@dataclass(frozen=True)
class Shape:
    """The parts of a model configuration that set compute and KV size."""

    name: str
    arch: str  # "llama" | "qwen3"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


#: Published configurations (config.json of each checkpoint), copied by hand.
SHAPES = {
    "llama-3.2-3b": Shape("llama-3.2-3b", "llama", 3072, 8192, 28, 24, 8, 128, 128256, True),
    "qwen3-4b": Shape("qwen3-4b", "qwen3", 2560, 9728, 36, 32, 8, 128, 151936, True),
    "llama-3.1-8b": Shape("llama-3.1-8b", "llama", 4096, 14336, 32, 32, 8, 128, 128256, False),
}
#: For ``--tiny`` (CPU smoke runs): Llama geometry, two layers.
TINY = Shape("tiny-llama", "llama", 512, 1024, 2, 8, 2, 64, 1024, False)


def build_model(shape: Shape, device: str, dtype: Any) -> Any:
    """A random-weight model of ``shape`` on ``device`` (no download)."""
    import torch

    # Either architecture through one construction; transformers' configs take attn_implementation
    # through an __init__ wrapper that their dataclass typing does not show.
    Config: Any
    Model: Any
    if shape.arch == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        Config, Model = Qwen3Config, Qwen3ForCausalLM
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        Config, Model = LlamaConfig, LlamaForCausalLM
    config = Config(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab_size,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=131072,
        attn_implementation="sdpa",
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Model(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_prefill(model: Any, lengths: list[int], device: str, repeats: int, vocab: int) -> list[tuple[int, float]]:
    """(tokens, median seconds) of one forward pass per length."""
    import torch

    gen = torch.Generator().manual_seed(0)
    out = []
    with torch.inference_mode():
        warm = torch.randint(0, vocab, (1, min(lengths)), generator=gen).to(device)
        model(input_ids=warm, use_cache=True, logits_to_keep=1)
        _sync(device)
        for n in lengths:
            ids = torch.randint(0, vocab, (1, n), generator=gen).to(device)
            times = []
            for _ in range(repeats):
                _sync(device)
                t0 = time.perf_counter()
                model(input_ids=ids, use_cache=True, logits_to_keep=1)
                _sync(device)
                times.append(time.perf_counter() - t0)
            out.append((n, statistics.median(times)))
    return out


class _Ref(NamedTuple):  # vLLM's CanonicalKVCacheRef fields the copy path reads
    tensor_idx: int
    page_size_bytes: int


class _Spec(NamedTuple):  # vLLM's GPULoadStoreSpec fields the copy path reads
    block_ids: list[int]
    group_sizes: list[int]
    block_indices: list[int]


def _drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def measure_load(shape: Shape, lengths: list[int], device: str, store_dir: Path, repeats: int) -> dict[str, Any]:
    """Disk -> staging (engine) -> device KV pages (the worker's copier), per length."""
    import torch

    from pykvcache import BlockStore, StagingPool
    from pykvcache.vllm.layout import ChunkLayout
    from pykvcache.vllm.worker.slot_map import SlotMap

    layers = shape.num_hidden_layers
    page = 2 * BLOCK_TOKENS * shape.num_key_value_heads * shape.head_dim * 2  # K and V of one block, bf16
    bpc = CHUNK_TOKENS // BLOCK_TOKENS
    layout = ChunkLayout(bpc, bytes_per_block=layers * page, world_size=1)
    chunks = max(math.ceil(n / CHUNK_TOKENS) for n in lengths)
    num_blocks = chunks * bpc + 1  # block 0 is vLLM's null block
    kv = [torch.zeros((num_blocks, page), dtype=torch.int8, device=device) for _ in range(layers)]
    pool = StagingPool(layout.payload_bytes, chunks)
    slot_map = SlotMap([[_Ref(i, page) for i in range(layers)]], layout)
    if device.startswith("cuda"):
        from pykvcache.vllm.worker.cuda_copy import CudaCopier

        copier = CudaCopier(kv, slot_map, pool, rank=0)

        def copy(spec: _Spec, slots: list[int]) -> None:
            copier.submit(1, spec, slots, to_gpu=True)
            copier.wait([1])
            copier.finished()

        path = "CudaCopier"
    else:
        from pykvcache.vllm.worker.cpu_copy import CpuCopier

        cpu = CpuCopier(kv, slot_map, pool, rank=0)

        def copy(spec: _Spec, slots: list[int]) -> None:
            cpu.load(spec, slots)

        path = "CpuCopier"
    rows: list[dict[str, Any]] = []
    cold = True
    try:
        region = pool.region()
        noise = os.urandom(1 << 20)
        slots = [pool.acquire() for _ in range(chunks)]  # the engine reads and writes acquired slots only
        for s in slots:
            off = pool.payload_offset(s)
            for o in range(0, layout.payload_bytes, len(noise)):
                n = min(len(noise), layout.payload_bytes - o)
                region[off + o : off + o + n] = noise[:n]
        with BlockStore(
            [str(store_dir)], pool, namespace="gpu-crossover", capacity_bytes=(chunks + 4) * (layout.payload_bytes + (1 << 20))
        ) as store:
            keys = [f"{shape.name}-{i}".encode() for i in range(chunks)]
            for h in [store.put(k, slots[i], layout.payload_bytes) for i, k in enumerate(keys)]:
                if not h.wait(120).ok:
                    raise RuntimeError("writing the KV chunks failed")
            for n in lengths:
                k = math.ceil(n / CHUNK_TOKENS)
                blocks = list(range(1, k * bpc + 1))
                spec = _Spec(blocks, [len(blocks)], [0])
                disk, copy_s = [], []
                for _ in range(repeats):
                    cold = _drop_page_cache() and cold
                    t0 = time.perf_counter()
                    results = [h.wait(120) for h in [store.get(keys[i], slots[i]) for i in range(k)]]
                    t1 = time.perf_counter()
                    if not all(r.ok for r in results):
                        raise RuntimeError(f"reading the KV chunks failed: {[r.status for r in results][:3]}")
                    copy(spec, slots[:k])
                    _sync(device)
                    t2 = time.perf_counter()
                    disk.append(t1 - t0)
                    copy_s.append(t2 - t1)
                nbytes = k * layout.payload_bytes
                rows.append(
                    {
                        "tokens": n,
                        "bytes": nbytes,
                        "disk_s": statistics.median(disk),
                        "copy_s": statistics.median(copy_s),
                        "load_s": statistics.median(d + c for d, c in zip(disk, copy_s)),
                    }
                )
    finally:
        del kv
        for s in locals().get("slots", []):
            pool.release(s)
        pool.close()
    return {"rows": rows, "copy_path": path, "cold": cold, "chunk_bytes": layout.payload_bytes}


def crossover(prefill: PrefillCurve, load: LoadCost, bytes_per_token: float) -> float:
    """Tokens from which loading the prefix beats computing it (``inf``: never)."""
    return CostModel(prefill, load, bytes_per_token).break_even_tokens()


def fitted(prefill: list[tuple[int, float]], rows: list[dict[str, Any]], bytes_per_token: float) -> CostModel:
    """Prefill curve, disk (fixed + bandwidth, fitted over sizes) and the copy's
    bandwidth (median over sizes), fitted where calibration fits."""
    from .calibrate.fit import fit_prefill_vs_load

    copy_bw = statistics.median(r["bytes"] / r["copy_s"] for r in rows if r["copy_s"] > 0)
    return fit_prefill_vs_load(prefill, [(r["bytes"], r["disk_s"]) for r in rows], copy_bw, bytes_per_token)


def at_bandwidths(
    prefill: PrefillCurve, load: LoadCost, bytes_per_token: float, gbps: tuple[float, ...] = STORAGE_GBPS
) -> dict[float, float]:
    """The crossover with the disk at each bandwidth (fixed cost and copy as measured)."""
    return {g: crossover(prefill, LoadCost(load.fixed_s, g * 1e9, load.h2d_bytes_per_s), bytes_per_token) for g in gbps}


def run(shapes: list[Shape], lengths: list[int], device: str, store_dir: Path, repeats: int = 3, log: Any = print) -> list[dict[str, Any]]:
    import torch

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    results = []
    for shape in shapes:
        t0 = time.perf_counter()
        model = build_model(shape, device, dtype)
        log(f"    {shape.name}: built in {time.perf_counter() - t0:.0f} s")
        pre = measure_prefill(model, lengths, device, repeats, shape.vocab_size)
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        bpt = shape.kv_bytes_per_token(2)
        ld = measure_load(shape, lengths, device, store_dir, repeats)
        entry: dict[str, Any] = {"model": shape.name, "kv_bytes_per_token": bpt, "prefill": pre, "load": ld}
        results.append(entry)
        for (n, t), row in zip(pre, ld["rows"]):
            log(
                f"      {n:>6} tokens: prefill {t * 1e3:8.1f} ms, load {row['load_s'] * 1e3:8.1f} ms "
                f"(disk {row['disk_s'] * 1e3:.1f} + copy {row['copy_s'] * 1e3:.1f}; {row['bytes'] / 2**20:.0f} MiB)"
            )
        try:
            model_fit = fitted(pre, ld["rows"], bpt)
            curve, cost = model_fit.prefill, model_fit.load
        except ValueError as e:  # noisy measurements (a busy machine): reported, not fatal
            entry["fit_error"] = str(e)
            log(f"      no crossover: {e}")
            continue
        entry.update(
            {
                "fit": {
                    "prefill": [curve.a, curve.b, curve.c],
                    "fixed_s": cost.fixed_s,
                    "disk_bytes_per_s": cost.disk_bytes_per_s,
                    "copy_bytes_per_s": cost.h2d_bytes_per_s,
                },
                "crossover_tokens": crossover(curve, cost, bpt),
                "crossover_at_gbps": at_bandwidths(curve, cost, bpt),
            }
        )
        log(
            f"      crossover {fmt_tokens(entry['crossover_tokens'])} tokens at the measured "
            f"{cost.disk_bytes_per_s / 1e9:.2f} GB/s; "
            + ", ".join(f"{g:g} GB/s: {fmt_tokens(v)}" for g, v in entry["crossover_at_gbps"].items())
        )
    return results


def fmt_tokens(x: float) -> str:
    return "never" if x == math.inf else f"{x:.0f}"


def markdown(results: list[dict[str, Any]], device_name: str) -> str:
    head = [
        "model",
        "KV KiB/token",
        "crossover (measured disk)",
        "disk GB/s measured",
        "copy GB/s",
        *[f"crossover at {g:g} GB/s" for g in STORAGE_GBPS],
    ]
    lines = [f"## Prefill vs load from disk ({device_name})", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if "fit" not in r:
            lines.append(f"| {r['model']} | {r['kv_bytes_per_token'] / 1024:.0f} | no fit: {r['fit_error']} |" + " - |" * (len(head) - 3))
            continue
        f = r["fit"]
        lines.append(
            "| "
            + " | ".join(
                [
                    r["model"],
                    f"{r['kv_bytes_per_token'] / 1024:.0f}",
                    fmt_tokens(r["crossover_tokens"]),
                    f"{f['disk_bytes_per_s'] / 1e9:.2f}",
                    f"{f['copy_bytes_per_s'] / 1e9:.1f}",
                    *[fmt_tokens(r["crossover_at_gbps"][g]) for g in STORAGE_GBPS],
                ]
            )
            + " |"
        )
    lines.append("")
    for r in results:
        lines += [
            f"**{r['model']}** ({r['load']['copy_path']}, reads {'cold' if r['load']['cold'] else 'warm'})",
            "",
            "| tokens | prefill ms | load ms (disk + copy) |",
            "|---|---|---|",
        ]
        for (n, t), row in zip(r["prefill"], r["load"]["rows"]):
            lines.append(f"| {n} | {t * 1e3:.1f} | {row['load_s'] * 1e3:.1f} ({row['disk_s'] * 1e3:.1f} + {row['copy_s'] * 1e3:.1f}) |")
        lines.append("")
    return "\n".join(lines) + "\n"
