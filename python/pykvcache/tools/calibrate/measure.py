"""Calibration's measurements: both sides of the break-even, on this machine.

1. **Prefill**: the user's model runs in vLLM (prefix caching off, every
   prompt distinct) on prompts swept over lengths; each request asks for one
   token, so its time to first token is its prefill. Lengths are interleaved
   across repeats so that a burst of background load hits every length
   alike (fitted in :mod:`.fit`).
2. **Storage**: chunks of the model's real size (its KV bytes per token as
   pykvcache lays them out on disk, times the chunk length) are written
   through :class:`pykvcache.BlockStore` into a temporary directory on the
   real storage directory, then read back cold (O_DIRECT; page cache dropped
   where O_DIRECT is refused and we are allowed to) in batches of several
   sizes, all chunks of a batch in flight at once as the manager reads them.
3. **Copy into the KV cache**: host-to-device bandwidth (CUDA), or memcpy
   bandwidth on a CPU-only host.

Every function takes what it measures as parameters (an engine, lengths,
repeats, :class:`StorageOptions`), so ``pykvcache calibrate`` (:mod:`.cli`) and
the TTFT benchmark's driver run the same measurements.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

MiB = 1 << 20


def default_model_cache() -> Path:
    """Where the tiny test model is built when no model is given."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pykvcache" / "models"


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
        out: dict[str, Any] = {unit: self.x, "median_s": self.median, "low_s": self.low, "samples_s": self.samples}
        if self.wall:
            out["wall_median_s"] = statistics.median(self.wall)
        return out


def default_lengths(chunk_tokens: int, max_tokens: int, quick: bool) -> list[int]:
    """Geometric sweep from one chunk to ``max_tokens`` (whole chunks)."""
    count = 5 if quick else 9
    lo = chunk_tokens
    hi = max(max_tokens // chunk_tokens, 2) * chunk_tokens
    values = {min(hi, max(lo, round(lo * (hi / lo) ** (i / (count - 1)) / chunk_tokens) * chunk_tokens)) for i in range(count)}
    return sorted(values)


def measure_prefill(llm, lengths: list[int], repeats: int, vocab: int, seed: int, tick) -> tuple[list[Point], str]:
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
        if m is not None and getattr(m, "first_token_ts", None) and getattr(m, "scheduled_ts", None):
            engine = m.first_token_ts - m.scheduled_ts
        return wall, engine if engine is not None and engine > 0 else None

    for n in (lengths[len(lengths) // 2], lengths[-1]):  # warm-up: allocator, caches, lazy init
        run(n)
    points = {n: Point(n) for n in lengths}
    engine_ok = True

    def one_round(r: int) -> None:
        nonlocal engine_ok
        order = lengths[:] if r % 2 == 0 else lengths[::-1]
        for n in order:
            wall, engine = run(n)
            points[n].wall.append(wall)
            if engine is None:
                engine_ok = False
            else:
                points[n].samples.append(engine)
            tick(f"{n} tokens: {wall * 1e3:.1f} ms")

    def inconsistent() -> bool:
        # The longest prompt faster than the shortest, at their fastest: every
        # sample of the short one met a burst of background load (seen on a
        # 2-core machine running another engine beside calibrate).
        first, last = points[lengths[0]], points[lengths[-1]]
        key = "samples" if engine_ok else "wall"
        return len(lengths) > 1 and min(getattr(last, key)) <= min(getattr(first, key))

    for r in range(repeats):
        one_round(r)
    # Measured again while inconsistent, at most as many rounds more: a
    # profile fitted on such samples would set the break-even on noise.
    extra = 0
    while inconsistent() and extra < repeats:
        tick("the longest prompt measured faster than the shortest (a busy machine?): one more round")
        one_round(repeats + extra)
        extra += 1
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


def measure_load_path(
    llm, lengths: list[int], repeats: int, vocab: int, seed: int, tick, *, suffix_tokens: int, reset=None, reset_staging=None
) -> dict[str, Any]:
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
        for n in lengths if r % 2 == 0 else lengths[::-1]:
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
            tick(f"{n} tokens: load path {(staged - base) * 1e3:.2f} ms, prefix compute {(computed - base) * 1e3:.2f} ms")
    measured = [p for p in points.values() if p.samples]
    if len(measured) < 2:
        raise RuntimeError(f"too few loads came from staging ({short_loads} did not); is the gate off?")
    return {
        "points": measured,
        "recompute_points": [recompute[n] for n in lengths],
        "disk_extra_points": [p for p in disk_extra.values() if p.samples],
        "short_loads": short_loads,
        "suffix_tokens": suffix_tokens,
    }


def _drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


@dataclass
class StorageOptions:
    """How the storage sweep opens its store and how much it may write."""

    queue_depth: int = 32
    backend: Literal["auto", "io_uring", "threads"] = "auto"
    direct_io: Literal["required", "optional", "disabled"] = "optional"
    budget_mib: int = 2048  # chunk files written at most
    # Sealed chunks (decision 0083): the loads measured open what a sealing store reads.
    encryption_key_file: str | None = None


def measure_storage(
    dirs: list[Path], chunk_bytes: int, chunk_counts: list[int], repeats: int, options: StorageOptions, tick, log
) -> dict[str, Any]:
    """Write chunks of ``chunk_bytes``, then time cold batched reads of them."""
    from pykvcache import BlockStore, StagingPool

    max_batch = max(chunk_counts)
    pool_chunks = max(1, min(max_batch, (1 << 30) // chunk_bytes))  # staging bounded to ~1 GiB
    batches = [min(c, pool_chunks) for c in chunk_counts]
    file_chunks = max(pool_chunks, min(max_batch * 2, (options.budget_mib * MiB) // chunk_bytes))
    tmpdirs = [Path(tempfile.mkdtemp(prefix=".pykvcache-calibrate-", dir=d)) for d in dirs]
    pool = StagingPool(chunk_bytes, pool_chunks)
    store = None
    try:
        store = BlockStore(
            [str(d) for d in tmpdirs],
            pool,
            namespace="calibrate",
            capacity_bytes=(file_chunks + 2) * (chunk_bytes + (1 << 20)),
            queue_depth=options.queue_depth,
            backend=options.backend,
            direct_io=options.direct_io,
            encryption_key_file=options.encryption_key_file,
        )
        slots = [pool.acquire() for _ in range(pool_chunks)]  # held for the whole measurement
        noise = os.urandom(chunk_bytes)
        for slot in slots:
            view = pool.view(slot)
            view[:] = noise
            view[:8] = slot.to_bytes(8, "little")
            view.release()
        keys = [f"calibrate-{i:08d}".encode() for i in range(file_chunks)]
        for start in range(0, file_chunks, pool_chunks):
            handles = [store.put(keys[i], slots[i - start], chunk_bytes) for i in range(start, min(file_chunks, start + pool_chunks))]
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
            for b in batches if r % 2 == 0 else batches[::-1]:
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
            "queue_depth": options.queue_depth,
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
    table = {
        "float32": 4,
        "float": 4,
        "float16": 2,
        "half": 2,
        "bfloat16": 2,
        "float8_e4m3fn": 1,
        "float8_e5m2": 1,
        "fp8": 1,
        "int8": 1,
        "uint8": 1,
    }
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
