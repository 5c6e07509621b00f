"""``pykvcache calibrate``: measure both sides of the break-even on this machine
and write the gate profile.

The command starts the user's model in vLLM with pykvcache's connector (gate
off), runs :mod:`.measure`'s measurements (prefill sweep, load path through
vLLM, cold storage reads, copy bandwidth), fits the cost model with
:func:`.fit.fit_cost_model` and writes the profile (JSON, see docs/gate.md)
that the vLLM spec reads through its ``gate_profile`` key.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pykvcache.vllm.config import kv_transfer_config

from .. import vllm_adapter
from ..progress import PhaseProgress
from .fit import fit_cost_model
from .measure import (
    MiB,
    Point,
    StorageOptions,
    default_lengths,
    default_model_cache,
    kv_bytes_per_token_per_rank,
    measure_copy,
    measure_load_path,
    measure_prefill,
    measure_storage,
)


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
    parser.add_argument("--model", default=None, help="model for vLLM (path or name); default: the tiny test model, built offline")
    parser.add_argument("--model-cache", type=Path, default=None, help="where the tiny model is built (default: ~/.cache/pykvcache/models)")
    parser.add_argument(
        "--storage-dir",
        type=Path,
        nargs="+",
        default=None,
        help="the storage directories pykvcache will use, created when missing (a "
        "temporary subdirectory is created in each and removed); default: current directory",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("pykvcache-gate-profile.json"), help="profile to write (default: ./pykvcache-gate-profile.json)"
    )
    parser.add_argument("--quick", action="store_true", help="few lengths and repeats (a smoke run; a minute or two with the tiny model)")
    parser.add_argument(
        "--lengths", type=_lengths, default=None, help="prompt lengths in tokens, e.g. 256,1024,4096 (default: a geometric sweep)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="longest prompt of the default sweep (default: 8192, quick 2048, capped by the model)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="measurements per point (median kept)")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="vLLM dtype; serve with the same, or the gate ignores the profile "
        "(default: float32 on CPU, as vLLM's CPU server runs in this README; "
        "the model's own on GPUs)",
    )
    parser.add_argument("--block-size", type=int, default=None, help="vLLM KV block size in tokens")
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help="tokens per stored chunk, a multiple of the block size (the offloading block_size; default: one block)",
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument(
        "--kv-cache-memory", type=int, default=None, help="vLLM kv_cache_memory_bytes (default on CPU: just enough for the longest prompt)"
    )
    parser.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM eager mode (default: on for CPU, vLLM's default on GPUs)",
    )
    parser.add_argument(
        "--vllm-arg",
        type=_vllm_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra vllm.LLM keyword argument (VALUE parsed as JSON when it is); repeatable",
    )
    parser.add_argument(
        "--kv-bytes-per-token", type=float, default=None, help="override the stored KV bytes per token (for models the formula gets wrong)"
    )
    parser.add_argument("--direct-io", choices=("required", "optional", "disabled"), default="optional")
    parser.add_argument("--backend", choices=("auto", "io_uring", "threads"), default="auto")
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--storage-budget", type=int, default=2048, help="MiB of chunk files written at most (default 2048)")
    parser.add_argument(
        "--encryption-key-file",
        default=None,
        help="the key file the server seals chunks with (its encryption_key_file): loads are measured sealed",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (logs, CI)")


def _prepare_model(args: argparse.Namespace) -> tuple[str, bool]:
    if args.model:
        return args.model, False
    from pykvcache.testing.tiny_model import build_tiny_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return str(build_tiny_model(args.model_cache or default_model_cache())), True


#: Mode of a storage directory calibrate creates: the engine's default
#: ``dir_mode``, with which the server creates a missing one.
STORAGE_DIR_MODE = 0o700


def _create_storage_dir(d: Path) -> str | None:
    """Creates a missing ``--storage-dir`` and its missing parents, as the
    server does when it opens the store; the problem, or None."""
    missing = []
    p = d.absolute()
    while not p.exists() and not p.is_symlink():
        missing.append(p)
        p = p.parent
    try:
        for m in reversed(missing):
            m.mkdir(mode=STORAGE_DIR_MODE)
    except OSError as exc:
        return f"--storage-dir {d} does not exist and cannot be created: {exc.strerror or exc}"
    return None


def calibration_dtype(requested: str, on_gpu: bool) -> str:
    """The dtype to calibrate in. ``auto`` on CPU is float32: vLLM's CPU
    backend would pick bfloat16, while the CPU server of the README (and the
    tiny model) run in float32, and a profile of another dtype is ignored."""
    if requested == "auto" and not on_gpu:
        return "float32"
    return requested


#: vLLM's KV block size calibrate gives the CPU backend (its attention needs multiples of 32).
CPU_BLOCK_SIZE = 32


def chunk_tokens_problem(chunk_tokens: int | None, block_size: int | None, whose: str) -> str | None:
    """``--chunk-tokens`` must be whole KV blocks; said in the command's terms
    before vLLM starts (vLLM's own refusal names a ``block_size`` the user
    never typed, repeated by every process it started)."""
    if not chunk_tokens or not block_size or chunk_tokens <= 0 or block_size <= 0 or chunk_tokens % block_size == 0:
        return None
    lower, upper = chunk_tokens // block_size * block_size, (chunk_tokens // block_size + 1) * block_size
    return f"--chunk-tokens {chunk_tokens} is not a multiple of {whose} KV block size, {block_size} tokens: give {upper}" + (
        f" or {lower}" if lower else ""
    )


def _check_args(args: argparse.Namespace) -> list[str]:
    problems = []
    for d in args.storage_dir:
        if not d.exists() and not d.is_symlink():
            created = _create_storage_dir(d)
            if created:
                problems.append(created)
                continue
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
    if (chunks := chunk_tokens_problem(args.chunk_tokens, args.block_size, "the --block-size")) is not None:
        problems.append(chunks)
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
    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.block_size:
        chunks = chunk_tokens_problem(args.chunk_tokens, CPU_BLOCK_SIZE, "the CPU backend's")
        if chunks is not None:
            print(f"pykvcache calibrate: {chunks} (or set --block-size)", file=sys.stderr)
            return 2
    model, tiny = _prepare_model(args)
    from transformers import AutoConfig

    # The tiny model is float32 on GPUs too (its KV size is tested as such).
    args.dtype = calibration_dtype(args.dtype, on_gpu and not tiny)
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
        llm_kwargs["block_size"] = CPU_BLOCK_SIZE
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
    llm_kwargs["kv_transfer_config"] = kv_transfer_config(
        [str(engine_dir)],
        max(1 << 30, 8 * staging_chunks * per_rank * tp * chunk_guess),
        lookahead=True,
        staging_bytes=max(64 * MiB, staging_chunks * (per_rank * tp * chunk_guess + 4096)),
        gate=False,
        wipe_on_reset=False,  # the disk-path measurement empties staging, not the files
        direct_io=args.direct_io,
        backend=args.backend,
        encryption_key_file=args.encryption_key_file,
        **({"block_size": args.chunk_tokens} if args.chunk_tokens else {}),
    )
    llm_kwargs.update(dict(args.vllm_arg))
    try:
        return _run_engine(args, llm_kwargs, model, tiny, on_gpu, hf_config, vocab, repeats, max_tokens, dtype, tp, per_rank, started)
    finally:
        shutil.rmtree(engine_dir, ignore_errors=True)


def _run_engine(args, llm_kwargs, model, tiny, on_gpu, hf_config, vocab, repeats, max_tokens, dtype, tp, per_rank, started) -> int:
    from vllm import LLM

    from pykvcache.gate.profile import GateProfile, hardware_id, storage_info
    from pykvcache.vllm.layout import ChunkLayout

    notes: list[str] = []
    with PhaseProgress(not args.no_progress) as progress:
        progress.log(f"starting vLLM with {model} ...")
        llm = LLM(**llm_kwargs)
        vcfg = vllm_adapter.engine_config(llm)
        block_size = int(vcfg.cache_config.block_size)
        resolved_dtype = str(vcfg.model_config.dtype).removeprefix("torch.")
        if resolved_dtype != dtype.removeprefix("torch."):
            per_rank = kv_bytes_per_token_per_rank(hf_config, resolved_dtype, tp)
        chunk_tokens = args.chunk_tokens or block_size
        if chunk_tokens % block_size:
            print(f"pykvcache calibrate: --chunk-tokens {chunk_tokens} is not a multiple of the block size {block_size}", file=sys.stderr)
            return 2
        num_blocks = getattr(vcfg.cache_config, "num_gpu_blocks", None)
        kv_mem = llm_kwargs.get("kv_cache_memory_bytes")
        if kv_mem and num_blocks:
            # What the engine actually allocates per block beats the formula
            # (hybrid and sliding-window models differ from it).
            engine_per_rank = kv_mem // num_blocks / block_size
            if not math.isclose(engine_per_rank, per_rank, rel_tol=0.05):
                notes.append(f"KV bytes per token per rank: formula {per_rank}, engine ~{engine_per_rank:.0f}; the engine's figure is used")
                per_rank = int(round(engine_per_rank))
        pp = int(getattr(vcfg.parallel_config, "pipeline_parallel_size", 1) or 1)
        world = tp * pp
        if pp > 1 and not notes:
            per_rank = math.ceil(per_rank / pp)  # each pipeline stage holds its share of the layers
        layout = ChunkLayout(blocks_per_chunk=chunk_tokens // block_size, bytes_per_block=int(per_rank * block_size), world_size=world)
        chunk_bytes = layout.payload_bytes
        bytes_per_token = args.kv_bytes_per_token or chunk_bytes / chunk_tokens
        if args.kv_bytes_per_token:
            chunk_bytes = int(math.ceil(args.kv_bytes_per_token * chunk_tokens / 4096)) * 4096
        lengths = args.lengths or default_lengths(chunk_tokens, max_tokens, args.quick)
        progress.log(
            f"model {model} ({resolved_dtype}, block {block_size}, chunk {chunk_tokens} tokens = "
            f"{chunk_bytes / MiB:.2f} MiB); prompt lengths {lengths}"
        )

        tick = progress.phase("prefill", repeats * len(lengths))
        prefill_points, timing = measure_prefill(llm, lengths, repeats, vocab, args.seed, tick)
        suffix = max(1, min(16, chunk_tokens // 2))
        path_lengths = [n for n in lengths if n + suffix < int(vcfg.model_config.max_model_len)]
        tick = progress.phase("load path", repeats * len(path_lengths))
        try:
            path = measure_load_path(
                llm,
                path_lengths,
                repeats,
                vocab,
                args.seed + 1,
                tick,
                suffix_tokens=suffix,
                reset_staging=lambda: bool(llm.reset_prefix_cache(reset_connector=True)),
            )
        except RuntimeError as exc:
            print(f"pykvcache calibrate: load path measurement failed: {exc}", file=sys.stderr)
            return 1
        vllm_adapter.shutdown(llm)

        chunk_counts = sorted({max(1, math.ceil(n / chunk_tokens)) for n in lengths})
        if len(chunk_counts) < 2:
            chunk_counts = sorted({1, max(2, chunk_counts[0])})
        tick = progress.phase("storage", repeats * len(chunk_counts))
        from pykvcache import PykvcacheError

        try:
            storage = measure_storage(
                args.storage_dir,
                chunk_bytes,
                chunk_counts,
                repeats,
                StorageOptions(
                    queue_depth=args.queue_depth,
                    backend=args.backend,
                    direct_io=args.direct_io,
                    budget_mib=args.storage_budget,
                    encryption_key_file=args.encryption_key_file,
                ),
                tick,
                progress.log,
            )
        except (OSError, PykvcacheError) as exc:
            print(f"pykvcache calibrate: storage measurement in {', '.join(map(str, args.storage_dir))} failed: {exc}", file=sys.stderr)
            return 1
        copy = measure_copy(chunk_bytes, repeats)

    try:
        model_cost, prefill_source = fit_cost_model(prefill_points, path, storage["points"], copy["bytes_per_s"], bytes_per_token)
    except ValueError as exc:
        print(f"pykvcache calibrate: the measurements cannot be fitted: {exc}. Try more --repeats or longer --lengths.", file=sys.stderr)
        return 1
    break_even = model_cost.break_even_tokens()
    prefill, load = model_cost.prefill, model_cost.load
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
            "a": prefill.a,
            "b": prefill.b,
            "c": prefill.c,
            "timing": timing,
            "repeats": repeats,
            "fitted_to": "paired: TTFT(prefix + suffix) - TTFT(suffix), with the load path"
            if prefill_source == "paired"
            else "sweep: scheduled -> first token, lower quartiles",
            "points": [p.as_dict("tokens") for p in prefill_points],
            "paired_points": [p.as_dict("tokens") for p in path["recompute_points"]],
        },
        load={
            "fixed_s": load.fixed_s,
            "disk_bytes_per_s": load.disk_bytes_per_s,
            "h2d_bytes_per_s": load.h2d_bytes_per_s,
            "step_s": load.step_s,
            "disk_step_s": load.disk_step_s,
            "chunk_bytes": chunk_bytes,
            "copy": copy,
            "points": [p.as_dict("bytes") for p in storage["points"]],
            "path": {
                "what": "TTFT of a prefix loaded from staging minus TTFT of its suffix alone (arrival -> first token, through vLLM)",
                "suffix_tokens": path["suffix_tokens"],
                "incomplete_loads": path["short_loads"],
                "points": [p.as_dict("tokens") for p in path["points"]],
                "disk_minus_staging_points": [p.as_dict("tokens") for p in path["disk_extra_points"]],
            },
        },
        break_even_tokens=None if math.isinf(break_even) else break_even,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        pykvcache_version=__version__,
        notes=notes + (["tiny test model built offline"] if tiny else []),
    )
    saved = profile.save(args.out)
    _summary(profile, prefill_points, storage["points"], saved, time.monotonic() - started)
    return 0


def _summary(profile, prefill_points: list[Point], load_points: list[Point], path: Path, elapsed: float) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=False)
    model = profile.cost_model()
    table = Table(title="prefill vs load")
    # What the gate compares: the fitted compute of the prefix (no constant
    # term: loading saves the prefix's compute, not the request's overhead)
    # against the fitted load. A "TTFT fit" column showed that same compute
    # fit under a TTFT name, next to measured TTFTs it does not fit.
    for h in ("tokens", "TTFT measured ms", "prefix compute fit ms", "load fit ms", "winner"):
        table.add_column(h, justify="right")
    for p in prefill_points:
        recompute = model.recompute_time(p.x)
        load = model.load_time(p.x)
        table.add_row(
            str(p.x), f"{p.median * 1e3:.2f}", f"{recompute * 1e3:.3f}", f"{load * 1e3:.3f}", "load" if load < recompute else "recompute"
        )
    console.print(table)
    bw = profile.load["disk_bytes_per_s"]
    console.print(
        f"disk: fixed {profile.load['fixed_s'] * 1e3:.3f} ms + {bw / 1e6:.0f} MB/s "
        f"({profile.storage['cold']}, {profile.storage['backend']}); "
        f"copy {profile.load['copy']['bytes_per_s'] / 1e9:.1f} GB/s; load path in vLLM: "
        f"{profile.load.get('step_s', 0.0) * 1e3:.2f} ms per load + "
        f"{profile.load['h2d_bytes_per_s'] / 1e9:.2f} GB/s"
    )
    be = profile.break_even_tokens
    console.print(f"break-even: {'never (loading does not pay)' if be is None else f'{be:.0f} tokens'}")
    console.print(
        f"profile: {path} ({elapsed:.0f} s), valid for {profile.model} in {profile.dtype}: "
        f"serve with --dtype {profile.dtype} (the gate ignores it for another dtype)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pykvcache calibrate", description="measure prefill and KV load times; write the gate profile")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
