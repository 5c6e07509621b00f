"""Part "engine_profile" (not run by default): what limits the engine.

The same engine case is run with one store setting changed at a time --
read/write segment size, ring depth, fixed buffers, O_DIRECT, backend -- interleaved per
repeat, and the CPU is split by thread (caller, ring thread, io-wq workers).
Changing a setting that does not matter leaves the ratio near 1.0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import BenchConfig, MiB
from .engine_bench import EngineCase, run_engine_case
from .parts import BenchContext, Part, PartOutput, Table, register_part
from .results import PhaseResult, median_by, ratio
from .storage_part import engine_unavailable

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "segment 1 MiB": {"segment_bytes": 1 * MiB},
    "segment 16 MiB": {"segment_bytes": 16 * MiB},
    "segment 32 MiB": {"segment_bytes": 32 * MiB},
    "write segment 4 MiB": {"write_segment_bytes": 4 * MiB},
    "ring depth 8": {"queue_depth": 8},
    "ring depth 128": {"queue_depth": 128},
    "no fixed buffers": {"register_buffers": False},
    "buffered (no O_DIRECT)": {"direct_io": "disabled"},
    "threads backend": {"backend": "threads"},
    "no file recycling": {"recycle_files": False},
}


def _chunks(cfg: BenchConfig) -> list[int]:
    big = [c for c in cfg.chunk_sizes if c >= 8 * MiB]
    return big or cfg.chunk_sizes[-1:]


def _qd(cfg: BenchConfig) -> int:
    return 8 if 8 in cfg.queue_depths else max(cfg.queue_depths)


def steps(cfg: BenchConfig) -> int:
    return cfg.repeats * len(_chunks(cfg)) * len(VARIANTS)


def _thread_share(p: PhaseResult, prefix: str) -> float:
    s = sum(v for k, v in p.threads_s.items() if k.startswith(prefix))
    return s / (p.bytes / 1e9) if p.bytes else 0.0


def run(ctx: BenchContext) -> PartOutput:
    title = "What limits the engine (one setting changed at a time)"
    if (reason := engine_unavailable()) is not None:
        return PartOutput(name="engine_profile", title=title, skipped=reason)
    cfg = ctx.config
    step = ctx.progress.part("profile", steps(cfg))
    qd = _qd(cfg)
    phases: list[PhaseResult] = []
    for rep in range(cfg.repeats):
        for chunk in _chunks(cfg):
            names = list(VARIANTS) if rep % 2 == 0 else list(reversed(VARIANTS))
            for name in names:
                case = EngineCase(chunk, qd, cfg.engine_bytes, {**cfg.store_kwargs, **VARIANTS[name]}, overwrite=True)
                for p in run_engine_case(
                    case, Path(cfg.directory) / "profile", disk=ctx.disk, cold=cfg.cold_reads, repeat=rep, cold_metadata=cfg.cold_metadata
                ):
                    p.params["variant"] = name
                    phases.append(p)
                step.advance(f"{name} {chunk // MiB}MiB (repeat {rep + 1})")
    med = median_by(phases, lambda p: (p.params["variant"], p.direction, p.chunk_bytes))
    by_thread: dict[tuple, dict[str, float]] = {}
    for p in phases:
        k = (p.params["variant"], p.direction, p.chunk_bytes)
        if p.params["repeat"] == 0:
            by_thread[k] = {
                "caller": _thread_share(p, "python"),
                "ring": _thread_share(p, "pykvcache"),
                "io-wq": _thread_share(p, "iou-wrk"),
            }
    rows = []
    for chunk in _chunks(cfg):
        for direction in ("read", "write", "overwrite"):
            base = med.get(("default", direction, chunk))
            for name in VARIANTS:
                m = med.get((name, direction, chunk))
                if m is None or base is None:
                    continue
                t = by_thread.get((name, direction, chunk), {})
                rows.append(
                    [
                        f"{chunk // MiB}", direction, name, f"{m['gbps']:.2f}", f"{ratio(m['gbps'], base['gbps']):.2f}",
                        f"{m['cpu_s_per_gb']:.4f}", f"{t.get('caller', 0):.4f}", f"{t.get('ring', 0):.4f}", f"{t.get('io-wq', 0):.4f}",
                    ]
                )  # fmt: skip
    out = PartOutput(name="engine_profile", title=title)
    out.tables.append(
        Table(
            title=f"Engine variants at QD {qd} (medians; CPU split from the first repeat)",
            header=["chunk MiB", "op", "variant", "GB/s", "x default", "CPU-s/GB", "caller thread", "ring thread", "io-wq workers"],
            rows=rows,
            note="CPU columns are CPU-seconds per GB. Chunk workers verify checksums on reads and compute them on writes. "
            "write = fresh chunks into an empty store; overwrite = new chunks into the full store (each put evicts one).",
        )
    )
    out.raw = {"phases": [p.to_dict() for p in phases]}
    return out


register_part(Part("engine_profile", "engine settings one at a time: what limits throughput and CPU", run, steps, default=False))
