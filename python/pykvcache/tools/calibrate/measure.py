"""``pykvcache calibrate``: measure both sides of the break-even on this machine.

1. **Prefill**: the user's model runs in vLLM (prefix caching off, every
   prompt distinct) on prompts swept over lengths; each request asks for one
   token, so its time to first token is its prefill. Lengths are interleaved
   across repeats so that a burst of background load hits every length
   alike; the median per length is fitted with ``a + b*n + c*n^2``.
2. **Storage**: chunks of the model's real size (its KV bytes per token as
   pykvcache lays them out on disk, times the chunk length) are written
   through :class:`pykvcache.BlockStore` into a temporary directory on the
   real storage directory, then read back cold (O_DIRECT; page cache dropped
   where O_DIRECT is refused and we are allowed to) in batches of several
   sizes, all chunks of a batch in flight at once as the manager reads them.
   ``fixed + bytes/BW`` is fitted to the medians.
3. **Copy into the KV cache**: host-to-device bandwidth (CUDA), or memcpy
   bandwidth on a CPU-only host.

The profile (JSON, see docs/gate.md) is what the vLLM spec reads through its
``gate_profile`` key.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MiB = 1 << 20


# ----------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------
def _default_model_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pykvcache" / "models"


def _lengths(text: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if len(values) < 2 or values[0] <= 0:
        raise argparse.ArgumentTypeError("give at least two distinct positive prompt lengths")
    return values


def _vllm_arg(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model for vLLM (path or name); default: the tiny test model, built offline")
    parser.add_argument("--model-cache", type=Path, default=None,
                        help="where the tiny model is built (default: ~/.cache/pykvcache/models)")
    parser.add_argument("--storage-dir", type=Path, nargs="+", default=None,
                        help="the storage directories pykvcache will use (a temporary subdirectory is "
                             "created in each and removed); default: current directory")
    parser.add_argument("--out", type=Path, default=Path("pykvcache-gate-profile.json"),
                        help="profile to write (default: ./pykvcache-gate-profile.json)")
    parser.add_argument("--quick", action="store_true",
                        help="few lengths and repeats (a smoke run; a minute or two with the tiny model)")
    parser.add_argument("--lengths", type=_lengths, default=None,
                        help="prompt lengths in tokens, e.g. 256,1024,4096 (default: a geometric sweep)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="longest prompt of the default sweep (default: 8192, quick 2048, capped by the model)")
    parser.add_argument("--repeats", type=int, default=None, help="measurements per point (median kept)")
    parser.add_argument("--dtype", default="auto", help="vLLM dtype (default: auto)")
    parser.add_argument("--block-size", type=int, default=None, help="vLLM KV block size in tokens")
    parser.add_argument("--chunk-tokens", type=int, default=None,
                        help="tokens per stored chunk, a multiple of the block size "
                             "(the offloading block_size; default: one block)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--kv-cache-memory", type=int, default=None,
                        help="vLLM kv_cache_memory_bytes (default on CPU: just enough for the longest prompt)")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                        help="vLLM eager mode (default: on for CPU, vLLM's default on GPUs)")
    parser.add_argument("--vllm-arg", type=_vllm_arg, action="append", default=[], metavar="KEY=VALUE",
                        help="extra vllm.LLM keyword argument (VALUE parsed as JSON when it is); repeatable")
    parser.add_argument("--kv-bytes-per-token", type=float, default=None,
                        help="override the stored KV bytes per token (for models the formula gets wrong)")
    parser.add_argument("--direct-io", choices=("required", "optional", "disabled"), default="optional")
    parser.add_argument("--backend", choices=("auto", "io_uring", "threads"), default="auto")
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--storage-budget", type=int, default=2048,
                        help="MiB of chunk files written at most (default 2048)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (logs, CI)")


# ----------------------------------------------------------------------
# Measurements
# ----------------------------------------------------------------------
@dataclass
class Point:
    x: int  # tokens (prefill) or bytes (load / copy)
    samples: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def low(self) -> float:
        """The lower quartile (the minimum of 3 or 4 samples): background load
        only ever adds time, and on a shared machine it adds bursts of 10-100x
        to some samples, which can move even a median of 3."""
        ordered = sorted(self.samples)
        return ordered[(len(ordered) - 1) // 4]

    def as_dict(self, unit: str) -> dict[str, Any]:
        out: dict[str, Any] = {unit: self.x, "median_s": self.median, "low_s": self.low,
                               "samples_s": self.samples}
        if self.wall:
            out["wall_median_s"] = statistics.median(self.wall)
        return out


class _Progress:
    """A rich progress bar per phase, or plain lines without a terminal."""

    def __init__(self, enabled: bool) -> None:
        self._p = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._p = Progress(TextColumn("[bold]{task.fields[phase]:<8}"), BarColumn(),
                               MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}"))

    def __enter__(self) -> _Progress:
        if self._p is not None:
            self._p.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._p is not None:
            self._p.__exit__(*exc)  # type: ignore[arg-type]

    def phase(self, name: str, total: int):
        if self._p is None:
            print(f"calibrate: {name} ({total} measurements)", file=sys.stderr, flush=True)
            return lambda description="": None
        task = self._p.add_task("", total=total, phase=name)
        return lambda description="": self._p.update(task, advance=1, description=description)

    def log(self, text: str) -> None:
        if self._p is not None:
            self._p.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)


def default_lengths(chunk_tokens: int, max_tokens: int, quick: bool) -> list[int]:
    """Geometric sweep from one chunk to ``max_tokens`` (whole chunks)."""
    count = 5 if quick else 9
    lo = chunk_tokens
    hi = max(max_tokens // chunk_tokens, 2) * chunk_tokens
    values = {min(hi, max(lo, round(lo * (hi / lo) ** (i / (count - 1)) / chunk_tokens) * chunk_tokens))
              for i in range(count)}
    return sorted(values)


def measure_prefill(llm, lengths: list[int], repeats: int, vocab: int, seed: int,
                    tick) -> tuple[list[Point], str]:
    """TTFT of single requests with ``max_tokens=1``, one distinct prompt each."""
    from vllm import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    low = min(10, vocab - 1)  # keep clear of special tokens at the start of the vocabulary

    def run(n: int) -> tuple[float, float | None]:
        prompt = {"prompt_token_ids": [rng.randrange(low, vocab) for _ in range(n)]}
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        m = getattr(out, "metrics", None)
        engine = None
        if m is not None and getattr(m, "first_token_ts", 0) and getattr(m, "scheduled_ts", 0):
            engine = m.first_token_ts - m.scheduled_ts
        return wall, engine if engine is not None and engine > 0 else None

    for n in (lengths[len(lengths) // 2], lengths[-1]):  # warm-up: allocator, caches, lazy init
        run(n)
    points = {n: Point(n) for n in lengths}
    engine_ok = True
    for r in range(repeats):
        order = lengths[:] if r % 2 == 0 else lengths[::-1]
        for n in order:
            wall, engine = run(n)
            points[n].wall.append(wall)
            if engine is None:
                engine_ok = False
            else:
                points[n].samples.append(engine)
            tick(f"{n} tokens: {wall * 1e3:.1f} ms")
    if not engine_ok:
        # Without engine timestamps, the client-side time is the measurement.
        for p in points.values():
            p.samples = list(p.wall)
    return [points[n] for n in lengths], "engine" if engine_ok else "wall"


def _queued_ttft(out) -> float | None:
    """The engine's arrival -> first token time of one output (None without
    engine timestamps)."""
    m = getattr(out, "metrics", None)
    first = getattr(m, "first_token_ts", 0) if m is not None else 0
    queued = getattr(m, "queued_ts", 0) if m is not None else 0
    return first - queued if first and queued and first > queued else None


def measure_load_path(llm, lengths: list[int], repeats: int, vocab: int, seed: int, tick, *,
                      suffix_tokens: int, reset=None, reset_staging=None) -> dict[str, Any]:
    """What any load costs end to end in vLLM, storage aside.

    The engine must run pykvcache's connector with the gate off (every
    available prefix is loaded). Per length ``n`` and repeat: a fresh prefix
    ``P`` is computed once (``P + s1``; its chunks go to staging), the device
    prefix cache is emptied, and ``P + s2`` loads ``P`` from staging; a fresh
    prompt of ``suffix_tokens`` tokens is timed alongside as the baseline.
    The load path is ``TTFT(P + s2) - TTFT(baseline)`` (arrival -> first
    token, so the scheduler steps of vLLM's asynchronous load are in it); its
    medians are fitted with ``step + n * per_token``. ``reset()`` empties the
    device prefix cache and returns whether it could (default:
    ``llm.reset_prefix_cache()``).

    With ``reset_staging`` (empties the device cache and pykvcache's staging,
    keeping the files), ``P + s3`` is then loaded from the disk: the paired
    ``TTFT(disk) - TTFT(staging)`` is what a disk load adds in the engine
    (``disk_extra_points``; see :func:`fit_disk_step`).
    """
    from vllm import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    low = min(10, vocab - 1)
    reset = reset or (lambda: bool(llm.reset_prefix_cache()))

    def tokens(n: int) -> list[int]:
        return [rng.randrange(low, vocab) for _ in range(n)]

    def generate(ids: list[int]):
        return llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]

    def empty_device_cache() -> None:
        # A finished request's store is handed over on the engine's next step:
        # a request shorter than a chunk gives it that step.
        for _ in range(20):
            generate(tokens(max(1, suffix_tokens // 2)))
            if reset():
                return
            time.sleep(0.05)
        raise RuntimeError("vLLM refused to reset its prefix cache (requests still hold blocks)")

    def once(n: int) -> tuple | None:
        prefix = tokens(n)
        computed = _queued_ttft(generate(prefix + tokens(suffix_tokens)))
        empty_device_cache()
        base = _queued_ttft(generate(tokens(suffix_tokens)))
        out = generate(prefix + tokens(suffix_tokens))
        staged = _queued_ttft(out)
        disk = disk_cached = None
        if reset_staging is not None and reset_staging():
            from_disk = generate(prefix + tokens(suffix_tokens))
            disk, disk_cached = _queued_ttft(from_disk), int(from_disk.num_cached_tokens or 0)
        if base is None or staged is None or computed is None:
            return None
        return staged, base, computed, int(out.num_cached_tokens or 0), disk, disk_cached

    for n in (lengths[0], lengths[-1]):  # warm-up: the first loads pay one-off costs
        once(n)
    points = {n: Point(n) for n in lengths}
    recompute = {n: Point(n) for n in lengths}
    disk_extra = {n: Point(n) for n in lengths}
    short_loads = 0
    for r in range(repeats):
        for n in (lengths if r % 2 == 0 else lengths[::-1]):
            got = once(n)
            if got is None:
                raise RuntimeError("vLLM reports no per-request timestamps (disable_log_stats=False?)")
            staged, base, computed, cached, disk, disk_cached = got
            recompute[n].samples.append(computed - base)
            if disk is not None and disk_cached >= n and cached >= n:
                disk_extra[n].samples.append(disk - staged)
            if cached < n:
                short_loads += 1  # the prefix was not (all) loaded: not a load-path sample
                tick(f"{n} tokens: only {cached} loaded")
                continue
            points[n].samples.append(staged - base)
            tick(f"{n} tokens: load path {(staged - base) * 1e3:.2f} ms, "
                 f"prefix compute {(computed - base) * 1e3:.2f} ms")
    measured = [p for p in points.values() if p.samples]
    if len(measured) < 2:
        raise RuntimeError(f"too few loads came from staging ({short_loads} did not); is the gate off?")
    return {"points": measured, "recompute_points": [recompute[n] for n in lengths],
            "disk_extra_points": [p for p in disk_extra.values() if p.samples],
            "short_loads": short_loads, "suffix_tokens": suffix_tokens}


def fit_disk_step(path: dict[str, Any], fixed_s: float, disk_bytes_per_s: float,
                  bytes_per_token: float) -> float:
    """What a load from the disk costs in the engine beyond the read the
    storage sweep measured (``fixed + bytes / BW``): the median over lengths of
    the paired ``TTFT(disk) - TTFT(staging)`` medians minus that read, never
    below 0. vLLM defers a request whose chunks are still being read to a later
    scheduler step; the raw read time does not see that step."""
    residuals = sorted(p.median - (fixed_s + p.x * bytes_per_token / disk_bytes_per_s)
                       for p in path.get("disk_extra_points", ()))
    if not residuals:
        return 0.0
    mid = len(residuals) // 2
    median = residuals[mid] if len(residuals) % 2 else 0.5 * (residuals[mid - 1] + residuals[mid])
    return max(0.0, median)


def fit_recompute(path: dict[str, Any], sweep: list[Point]) -> tuple[Any, str]:
    """The prefill curve the gate compares loads with, and where it came from.

    Preferred: the prefix's end-to-end compute time measured alongside the
    load path (``TTFT(prefix + suffix) - TTFT(suffix)``, arrival -> first
    token, paired per repeat), so both sides of the decision are the same kind
    of measurement on the same engine state. On the tiny CPU model the
    quadratic fitted to the plain sweep put much of short prompts' time into
    the constant ``a`` (which cancels in the decision) and too little into
    ``b`` (one run: a=6.1 ms, b=17.6 µs/token where the paired gains say
    ~24 µs/token). Falls back to the sweep (lower quartiles) when the paired
    medians cannot be fitted."""
    from pykvcache.gate.cost_model import PrefillCurve, nonneg_least_squares

    # Computing 0 prefix tokens costs nothing: a = 0, only b and c are fitted
    # (relative error; medians <= 0 are noise and carry no information).
    pts = [(float(p.x), p.median) for p in path.get("recompute_points", ()) if p.median > 0]
    if len({n for n, _ in pts}) >= 2:
        b, c = nonneg_least_squares([(n, n * n) for n, _ in pts], [t for _, t in pts],
                                    [1.0 / (t * t) for _, t in pts])
        if b > 0 or c > 0:
            return PrefillCurve(0.0, b, c), "paired"
    return PrefillCurve.fit([(p.x, p.low) for p in sweep]), "sweep"


def fit_load_path(points: list[Point], bytes_per_token: float, copy_bytes_per_s: float) -> tuple[float, float]:
    """``(step_s, bytes_per_s)`` of the load path: the fixed cost of a load in
    the engine and the per-byte rate of everything that scales with the
    prefix (the copy into the KV cache and what vLLM does per loaded block),
    never faster than the copy alone."""
    from pykvcache.gate.cost_model import nonneg_least_squares

    # A median difference <= 0 says the load cost nothing measurable at that
    # length: no information on the relative scale, left out.
    pts = [(p.x * bytes_per_token, p.median) for p in points if p.median > 0]
    if not pts:
        return 0.0, copy_bytes_per_s
    # Relative error: short prefixes (where the step dominates) count as much
    # as long ones (where the per-byte cost does).
    step, per_byte = nonneg_least_squares([(1.0, b) for b, _ in pts], [t for _, t in pts],
                                          [1.0 / max(t, 1e-4) ** 2 for _, t in pts])
    return step, 1.0 / max(per_byte, 1.0 / copy_bytes_per_s)


def _drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def measure_storage(dirs: list[Path], chunk_bytes: int, chunk_counts: list[int], repeats: int,
                    args: argparse.Namespace, tick, log) -> dict[str, Any]:
    """Write chunks of ``chunk_bytes``, then time cold batched reads of them."""
    from pykvcache import BlockStore, StagingPool

    max_batch = max(chunk_counts)
    pool_chunks = max(1, min(max_batch, (1 << 30) // chunk_bytes))  # staging bounded to ~1 GiB
    batches = [min(c, pool_chunks) for c in chunk_counts]
    file_chunks = max(pool_chunks, min(max_batch * 2, (args.storage_budget * MiB) // chunk_bytes))
    tmpdirs = [Path(tempfile.mkdtemp(prefix=".pykvcache-calibrate-", dir=d)) for d in dirs]
    pool = StagingPool(chunk_bytes, pool_chunks)
    store = None
    try:
        store = BlockStore([str(d) for d in tmpdirs], pool, namespace="calibrate",
                           capacity_bytes=(file_chunks + 2) * (chunk_bytes + (1 << 20)),
                           queue_depth=args.queue_depth, backend=args.backend,
                           direct_io=args.direct_io)
        slots = [pool.acquire() for _ in range(pool_chunks)]  # held for the whole measurement
        noise = os.urandom(chunk_bytes)
        for slot in slots:
            view = pool.view(slot)
            view[:] = noise
            view[:8] = slot.to_bytes(8, "little")
            view.release()
        keys = [f"calibrate-{i:08d}".encode() for i in range(file_chunks)]
        for start in range(0, file_chunks, pool_chunks):
            handles = [store.put(keys[i], slots[i - start], chunk_bytes)
                       for i in range(start, min(file_chunks, start + pool_chunks))]
            for h in handles:
                h.wait().raise_for_status()
        if store.direct_io:
            cold = "O_DIRECT"
        elif _drop_page_cache():
            cold = "page cache dropped"
        else:
            cold = "none: O_DIRECT refused and page cache not droppable (reads may be warm)"
            log(f"[yellow]warning: {cold}")
        time.sleep(0.2)  # let the device settle after the burst of writes
        points = {b: Point(b * chunk_bytes) for b in batches}
        cursor = 0
        for r in range(repeats):
            for b in (batches if r % 2 == 0 else batches[::-1]):
                if cursor + b > file_chunks:
                    cursor = 0
                    if not store.direct_io:
                        _drop_page_cache()
                t0 = time.perf_counter()
                handles = [store.get(keys[cursor + i], slots[i]) for i in range(b)]
                results = [h.wait() for h in handles]
                elapsed = time.perf_counter() - t0
                for res in results:
                    res.raise_for_status()
                cursor += b
                points[b].samples.append(elapsed)
                tick(f"{b} chunk(s): {b * chunk_bytes / elapsed / 1e6:.0f} MB/s")
        return {
            "points": [points[b] for b in batches],
            "backend": store.backend,
            "direct_io": store.direct_io,
            "fixed_buffers": store.fixed_buffers,
            "cold": cold,
            "queue_depth": args.queue_depth,
        }
    finally:
        if store is not None:
            store.close()
        pool.close()
        for d in tmpdirs:
            shutil.rmtree(d, ignore_errors=True)


def measure_copy(chunk_bytes: int, repeats: int) -> dict[str, Any]:
    """Bandwidth of the copy from staging into the KV cache: pinned host to
    GPU with CUDA, memcpy on a CPU-only host."""
    import torch

    # Large enough that thread wake-up and page faults do not dominate.
    size = max(chunk_bytes, 32 * MiB)
    if torch.cuda.is_available():
        src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(size, dtype=torch.uint8, device="cuda")
        kind = "host_to_device"

        def once() -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            return time.perf_counter() - t0
    else:
        src = torch.ones(size, dtype=torch.uint8)
        dst = torch.empty(size, dtype=torch.uint8)
        kind = "memcpy"

        def once() -> float:
            t0 = time.perf_counter()
            dst.copy_(src)
            return time.perf_counter() - t0

    once()
    once()
    times = [once() for _ in range(max(5, repeats))]
    return {"kind": kind, "bytes": size, "samples_s": times, "bytes_per_s": size / statistics.median(times)}


# ----------------------------------------------------------------------
# The model's KV size
# ----------------------------------------------------------------------
def _dtype_bytes(dtype: Any) -> int:
    name = str(dtype).removeprefix("torch.")
    table = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
             "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "int8": 1, "uint8": 1}
    if name not in table:
        raise ValueError(f"unknown KV dtype {name!r}; pass --kv-bytes-per-token")
    return table[name]


def kv_bytes_per_token_per_rank(hf_config: Any, dtype: Any, tp: int) -> int:
    """One worker's KV bytes per token over all layers, from the model config
    (standard attention and MLA; anything else: --kv-bytes-per-token)."""
    cfg = getattr(hf_config, "text_config", None) or hf_config
    layers = int(cfg.num_hidden_layers)
    elem = _dtype_bytes(dtype)
    if getattr(cfg, "kv_lora_rank", None):  # MLA: one latent per token, replicated over TP
        return layers * (int(cfg.kv_lora_rank) + int(getattr(cfg, "qk_rope_head_dim", 0))) * elem
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    heads_per_rank = max(1, heads // tp)  # replicated when TP exceeds the KV heads
    return layers * 2 * heads_per_rank * head_dim * elem


# ----------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------
def _prepare_model(args: argparse.Namespace) -> tuple[str, bool]:
    if args.model:
        return args.model, False
    from pykvcache.testing.tiny_model import build_tiny_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return str(build_tiny_model(args.model_cache or _default_model_cache())), True


def _check_args(args: argparse.Namespace) -> list[str]:
    problems = []
    for d in args.storage_dir:
        if not d.is_dir():
            problems.append(f"--storage-dir {d} is not a directory")
        elif not os.access(d, os.W_OK | os.X_OK):
            problems.append(f"--storage-dir {d} is not writable")
    for name in ("repeats", "max_tokens", "block_size", "chunk_tokens", "kv_cache_memory"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            problems.append(f"--{name.replace('_', '-')} must be > 0")
    if args.tensor_parallel_size <= 0 or args.queue_depth <= 0 or args.storage_budget <= 0:
        problems.append("--tensor-parallel-size, --queue-depth and --storage-budget must be > 0")
    if args.kv_bytes_per_token is not None and not args.kv_bytes_per_token > 0:
        problems.append("--kv-bytes-per-token must be > 0")
    out_dir = args.out.resolve().parent
    if out_dir.exists() and not os.access(out_dir, os.W_OK):
        problems.append(f"cannot write the profile into {out_dir}")
    return problems


def run(args: argparse.Namespace) -> int:
    args.storage_dir = args.storage_dir or [Path.cwd()]
    problems = _check_args(args)
    if problems:
        for p in problems:
            print(f"pykvcache calibrate: {p}", file=sys.stderr)
        return 2
    started = time.monotonic()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # no binding fights on small hosts
    model, tiny = _prepare_model(args)
    if tiny and args.dtype == "auto":
        args.dtype = "float32"  # vLLM's CPU backend would otherwise run it in bfloat16

    import torch
    from transformers import AutoConfig

    on_gpu = torch.cuda.is_available()
    hf_config = AutoConfig.from_pretrained(model)
    text_cfg = getattr(hf_config, "text_config", None) or hf_config
    vocab = int(text_cfg.vocab_size)
    model_max = int(getattr(text_cfg, "max_position_embeddings", 0) or 1 << 20)
    repeats = args.repeats or (3 if args.quick else 5)
    max_tokens = min(args.max_tokens or (2048 if args.quick else 8192), model_max - 1)
    if args.lengths and args.lengths[-1] > model_max - 1:
        print(f"pykvcache calibrate: --lengths exceed the model's {model_max} positions", file=sys.stderr)
        return 2
    longest = args.lengths[-1] if args.lengths else max_tokens
    dtype = args.dtype if args.dtype != "auto" else str(getattr(text_cfg, "torch_dtype", None) or "float32")
    tp = args.tensor_parallel_size
    per_rank = kv_bytes_per_token_per_rank(hf_config, dtype, tp)

    llm_kwargs: dict[str, Any] = {
        "model": model,
        "dtype": args.dtype,
        # Needed by the connector (block hashes); prompts are distinct random
        # token ids, so nothing is ever matched unless a load is wanted.
        "enable_prefix_caching": True,
        "max_model_len": min(longest + 32, model_max),  # room for the load path's suffix
        "tensor_parallel_size": tp,
        "disable_log_stats": False,  # per-request engine timestamps
        "enforce_eager": (not on_gpu) if args.enforce_eager is None else args.enforce_eager,
    }
    if args.block_size:
        llm_kwargs["block_size"] = args.block_size
    elif not on_gpu:
        llm_kwargs["block_size"] = 32  # the CPU attention backend needs multiples of 32
    if args.kv_cache_memory:
        llm_kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory
    elif not on_gpu:
        llm_kwargs["kv_cache_memory_bytes"] = max(64 * MiB, 4 * (longest + 64) * per_rank)
    # pykvcache's connector on a temporary directory inside the storage
    # directory, gate off: the load path is measured with real loads from
    # staging (the disk itself is measured separately, cold).
    chunk_guess = args.chunk_tokens or llm_kwargs.get("block_size") or 16
    engine_dir = Path(tempfile.mkdtemp(prefix=".pykvcache-calibrate-engine-", dir=args.storage_dir[0]))
    staging_chunks = 4 * (longest // chunk_guess + 2)
    llm_kwargs["kv_transfer_config"] = {
        "kv_connector": "PyKvCacheConnector",
        "kv_connector_module_path": "pykvcache.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "storage_dirs": [str(engine_dir)],
            "capacity_bytes": max(1 << 30, 8 * staging_chunks * per_rank * tp * chunk_guess),
            "staging_bytes": max(64 * MiB, staging_chunks * (per_rank * tp * chunk_guess + 4096)),
            "gate": False,
            "wipe_on_reset": False,  # the disk-path measurement empties staging, not the files
            "direct_io": args.direct_io,
            "backend": args.backend,
            **({"block_size": args.chunk_tokens} if args.chunk_tokens else {}),
        },
    }
    llm_kwargs.update(dict(args.vllm_arg))
    try:
        return _run_engine(args, llm_kwargs, model, tiny, on_gpu, hf_config, vocab, repeats, max_tokens,
                           dtype, tp, per_rank, started)
    finally:
        shutil.rmtree(engine_dir, ignore_errors=True)


def _run_engine(args, llm_kwargs, model, tiny, on_gpu, hf_config, vocab, repeats, max_tokens, dtype, tp,
                per_rank, started) -> int:
    from pykvcache.gate.cost_model import CostModel, LoadCost
    from pykvcache.gate.profile import GateProfile, hardware_id, storage_info
    from pykvcache.vllm.layout import ChunkLayout
    from vllm import LLM

    notes: list[str] = []
    with _Progress(not args.no_progress) as progress:
        progress.log(f"starting vLLM with {model} ...")
        llm = LLM(**llm_kwargs)
        vcfg = llm.llm_engine.vllm_config
        block_size = int(vcfg.cache_config.block_size)
        resolved_dtype = str(vcfg.model_config.dtype).removeprefix("torch.")
        if resolved_dtype != dtype.removeprefix("torch."):
            per_rank = kv_bytes_per_token_per_rank(hf_config, resolved_dtype, tp)
        chunk_tokens = args.chunk_tokens or block_size
        if chunk_tokens % block_size:
            print(f"pykvcache calibrate: --chunk-tokens {chunk_tokens} is not a multiple of the "
                  f"block size {block_size}", file=sys.stderr)
            return 2
        num_blocks = getattr(vcfg.cache_config, "num_gpu_blocks", None)
        kv_mem = llm_kwargs.get("kv_cache_memory_bytes")
        if kv_mem and num_blocks:
            # What the engine actually allocates per block beats the formula
            # (hybrid and sliding-window models differ from it).
            engine_per_rank = kv_mem // num_blocks / block_size
            if not math.isclose(engine_per_rank, per_rank, rel_tol=0.05):
                notes.append(f"KV bytes per token per rank: formula {per_rank}, engine ~{engine_per_rank:.0f}; "
                             "the engine's figure is used")
                per_rank = int(round(engine_per_rank))
        pp = int(getattr(vcfg.parallel_config, "pipeline_parallel_size", 1) or 1)
        world = tp * pp
        if pp > 1 and not notes:
            per_rank = math.ceil(per_rank / pp)  # each pipeline stage holds its share of the layers
        layout = ChunkLayout(blocks_per_chunk=chunk_tokens // block_size,
                             bytes_per_block=int(per_rank * block_size), world_size=world)
        chunk_bytes = layout.payload_bytes
        bytes_per_token = args.kv_bytes_per_token or chunk_bytes / chunk_tokens
        if args.kv_bytes_per_token:
            chunk_bytes = int(math.ceil(args.kv_bytes_per_token * chunk_tokens / 4096)) * 4096
        lengths = args.lengths or default_lengths(chunk_tokens, max_tokens, args.quick)
        progress.log(f"model {model} ({resolved_dtype}, block {block_size}, chunk {chunk_tokens} tokens = "
                     f"{chunk_bytes / MiB:.2f} MiB); prompt lengths {lengths}")

        tick = progress.phase("prefill", repeats * len(lengths))
        prefill_points, timing = measure_prefill(llm, lengths, repeats, vocab, args.seed, tick)
        suffix = max(1, min(16, chunk_tokens // 2))
        path_lengths = [n for n in lengths if n + suffix < int(vcfg.model_config.max_model_len)]
        tick = progress.phase("load path", repeats * len(path_lengths))
        try:
            path = measure_load_path(llm, path_lengths, repeats, vocab, args.seed + 1, tick,
                                     suffix_tokens=suffix,
                                     reset_staging=lambda: bool(llm.reset_prefix_cache(reset_connector=True)))
        except RuntimeError as exc:
            print(f"pykvcache calibrate: load path measurement failed: {exc}", file=sys.stderr)
            return 1
        llm.llm_engine.engine_core.shutdown()

        chunk_counts = sorted({max(1, math.ceil(n / chunk_tokens)) for n in lengths})
        if len(chunk_counts) < 2:
            chunk_counts = sorted({1, max(2, chunk_counts[0])})
        tick = progress.phase("storage", repeats * len(chunk_counts))
        from pykvcache import PykvcacheError

        try:
            storage = measure_storage(args.storage_dir, chunk_bytes, chunk_counts, repeats, args, tick,
                                      progress.log)
        except (OSError, PykvcacheError) as exc:
            print(f"pykvcache calibrate: storage measurement in {', '.join(map(str, args.storage_dir))} "
                  f"failed: {exc}", file=sys.stderr)
            return 1
        copy = measure_copy(chunk_bytes, repeats)

    try:
        prefill, prefill_source = fit_recompute(path, prefill_points)
        fixed, disk_bw = LoadCost.fit_disk([(p.x, p.median) for p in storage["points"]])
        step_s, path_bw = fit_load_path(path["points"], bytes_per_token, copy["bytes_per_s"])
        disk_step_s = fit_disk_step(path, fixed, disk_bw, bytes_per_token)
        load = LoadCost(fixed, disk_bw, path_bw, step_s, disk_step_s)
        model_cost = CostModel(prefill, load, bytes_per_token)
    except ValueError as exc:
        print(f"pykvcache calibrate: the measurements cannot be fitted: {exc}. "
              "Try more --repeats or longer --lengths.", file=sys.stderr)
        return 1
    break_even = model_cost.break_even_tokens()
    from pykvcache import __version__

    profile = GateProfile(
        model=model,
        dtype=resolved_dtype,
        block_size=block_size,
        chunk_tokens=chunk_tokens,
        kv_bytes_per_token=bytes_per_token,
        world_size=world,
        hardware=hardware_id(),
        storage={
            **storage_info(args.storage_dir[0]),
            "dirs": [str(d.resolve()) for d in args.storage_dir],
            **{k: v for k, v in storage.items() if k != "points"},
        },
        prefill={
            "a": prefill.a, "b": prefill.b, "c": prefill.c, "timing": timing, "repeats": repeats,
            "fitted_to": "paired: TTFT(prefix + suffix) - TTFT(suffix), with the load path"
            if prefill_source == "paired" else "sweep: scheduled -> first token, lower quartiles",
            "points": [p.as_dict("tokens") for p in prefill_points],
            "paired_points": [p.as_dict("tokens") for p in path["recompute_points"]],
        },
        load={
            "fixed_s": fixed, "disk_bytes_per_s": disk_bw, "h2d_bytes_per_s": path_bw, "step_s": step_s,
            "disk_step_s": disk_step_s,
            "chunk_bytes": chunk_bytes, "copy": copy,
            "points": [p.as_dict("bytes") for p in storage["points"]],
            "path": {"what": "TTFT of a prefix loaded from staging minus TTFT of its suffix alone "
                             "(arrival -> first token, through vLLM)",
                     "suffix_tokens": path["suffix_tokens"], "incomplete_loads": path["short_loads"],
                     "points": [p.as_dict("tokens") for p in path["points"]],
                     "disk_minus_staging_points": [p.as_dict("tokens") for p in path["disk_extra_points"]]},
        },
        break_even_tokens=None if math.isinf(break_even) else break_even,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        pykvcache_version=__version__,
        notes=notes + (["tiny test model built offline"] if tiny else []),
    )
    path = profile.save(args.out)
    _summary(profile, prefill_points, storage["points"], path, time.monotonic() - started)
    return 0


def _summary(profile, prefill_points: list[Point], load_points: list[Point], path: Path,
             elapsed: float) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=False)
    model = profile.cost_model()
    table = Table(title="prefill vs load")
    for h in ("tokens", "TTFT measured ms", "TTFT fit ms", "prefix compute ms", "load ms", "winner"):
        table.add_column(h, justify="right")
    for p in prefill_points:
        # Loading saves the prefix's compute, not the request's constant overhead.
        recompute = model.recompute_time(p.x)
        load = model.load_time(p.x)
        table.add_row(str(p.x), f"{p.median * 1e3:.2f}", f"{model.prefill.time(p.x) * 1e3:.2f}",
                      f"{recompute * 1e3:.3f}", f"{load * 1e3:.3f}",
                      "load" if load < recompute else "recompute")
    console.print(table)
    bw = profile.load["disk_bytes_per_s"]
    console.print(f"disk: fixed {profile.load['fixed_s'] * 1e3:.3f} ms + {bw / 1e6:.0f} MB/s "
                  f"({profile.storage['cold']}, {profile.storage['backend']}); "
                  f"copy {profile.load['copy']['bytes_per_s'] / 1e9:.1f} GB/s; load path in vLLM: "
                  f"{profile.load.get('step_s', 0.0) * 1e3:.2f} ms per load + "
                  f"{profile.load['h2d_bytes_per_s'] / 1e9:.2f} GB/s")
    be = profile.break_even_tokens
    console.print(f"break-even: {'never (loading does not pay)' if be is None else f'{be:.0f} tokens'}")
    console.print(f"profile: {path} ({elapsed:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pykvcache calibrate",
                                     description="measure prefill and KV load times; write the gate profile")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
