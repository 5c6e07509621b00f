"""Part "fs_tier": pykvcache against vLLM's own filesystem tier, idle and under
CPU contention, with identical data, chunk sizes and job shapes: pykvcache's
store on its own, and pykvcache as a tier inside vLLM's tiering framework
(``PykvcacheTier``, driven exactly like the ``fs`` tier), in one run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import BenchConfig, MiB
from .contention import CpuContention
from .fs_tier_bench import FsCase, run_fs_case, vllm_fs_tier_available
from .parts import BenchContext, Figure, Part, PartOutput, Table, register_part
from .results import PhaseResult, median_by, ratio
from .storage_part import engine_unavailable

SYSTEMS = ("fs_tier", "pykvcache", "pykvcache_tier", "pykvcache_tier_direct")
OPS = (("write", "store"), ("read", "load"))


def steps(config: BenchConfig) -> int:
    return 1 + len(config.fs_contention) * config.repeats * len(config.fs_chunk_sizes) * len(config.fs_shapes)


def measure(ctx: BenchContext) -> list[PhaseResult]:
    cfg = ctx.config
    step = ctx.progress.part("fs_tier", steps(cfg))
    step.advance("vLLM fs tier imported")
    root = Path(cfg.directory) / "fs-tier-compare"
    phases: list[PhaseResult] = []
    for contended in cfg.fs_contention:
        with CpuContention(enabled=contended):
            for rep in range(cfg.repeats):
                for chunk in cfg.fs_chunk_sizes:
                    for i, shape in enumerate(cfg.fs_shapes):
                        # Alternate which system goes first so neither always gets the fresher disk.
                        order = list(SYSTEMS) if (rep + i) % 2 == 0 else list(reversed(SYSTEMS))
                        case = FsCase(chunk, cfg.fs_bytes, shape, contended)
                        phases += run_fs_case(
                            case,
                            root,
                            order,
                            disk=ctx.disk,
                            cold=cfg.cold_reads,
                            repeat=rep,
                            store_kwargs=cfg.store_kwargs,
                            cold_metadata=cfg.cold_metadata,
                        )
                        cond = "contended" if contended else "idle"
                        step.advance(f"fs tier vs pykvcache {chunk // MiB}MiB {shape} {cond} (repeat {rep + 1})")
    return phases


def _cond(contended: bool) -> str:
    return "contended" if contended else "idle"


def analyse(phases: list[PhaseResult], cfg: BenchConfig) -> PartOutput:
    out = PartOutput(name="fs_tier", title="pykvcache vs vLLM's filesystem tier (tiering `fs`)")
    med = median_by(phases, lambda p: (p.system, p.direction, p.chunk_bytes, p.params["shape"], p.params["contention"]))
    rows, pairs = [], []
    for contended in cfg.fs_contention:
        for direction, op in OPS:
            for chunk in cfg.fs_chunk_sizes:
                for shape in cfg.fs_shapes:
                    fs = med.get(("fs_tier", direction, chunk, shape, contended))
                    pk = med.get(("pykvcache", direction, chunk, shape, contended))
                    if fs is None or pk is None:
                        continue
                    r = ratio(pk["gbps"], fs["gbps"])
                    cr = ratio(pk["cpu_s_per_gb"], fs["cpu_s_per_gb"])
                    pairs.append(
                        {
                            "contended": contended, "direction": direction, "chunk_bytes": chunk, "shape": shape,
                            "fs_gbps": fs["gbps"], "pykvcache_gbps": pk["gbps"], "ratio": r,
                            "fs_cpu_s_per_gb": fs["cpu_s_per_gb"], "pykvcache_cpu_s_per_gb": pk["cpu_s_per_gb"], "cpu_ratio": cr,
                        }
                    )  # fmt: skip
                    rows.append(
                        [
                            _cond(contended), op, f"{chunk // MiB}", shape, f"{fs['gbps']:.2f}", f"{pk['gbps']:.2f}",
                            _f(r), _f(fs["cpu_s_per_gb"], 4), _f(pk["cpu_s_per_gb"], 4), _f(cr),
                        ]
                    )  # fmt: skip
    out.tables.append(
        Table(
            title="Store and load GB/s and CPU-s/GB (medians over repeats)",
            header=["machine", "op", "chunk MiB", "job shape", "fs tier GB/s", "pykvcache GB/s", "x fs tier",
                    "fs tier CPU-s/GB", "pykvcache CPU-s/GB", "CPU x fs tier"],
            rows=rows,
            note="one_job = all chunks in one job (one request's load); jobs_of_N = N chunks per job, all jobs submitted at once. "
            "contended = one busy-loop process per core during the phase.",
        )
    )  # fmt: skip
    tier_rows: list[list[str]] = []
    tier_pairs: list[dict[str, Any]] = []
    for contended in cfg.fs_contention:
        for direction, op in OPS:
            for chunk in cfg.fs_chunk_sizes:
                for shape in cfg.fs_shapes:
                    for system, mode in (("pykvcache_tier", "copy"), ("pykvcache_tier_direct", "direct")):
                        fs = med.get(("fs_tier", direction, chunk, shape, contended))
                        pt = med.get((system, direction, chunk, shape, contended))
                        if fs is None or pt is None:
                            continue
                        r = ratio(pt["gbps"], fs["gbps"])
                        cr = ratio(pt["cpu_s_per_gb"], fs["cpu_s_per_gb"])
                        tier_pairs.append(
                            {
                                "contended": contended,
                                "direction": direction,
                                "chunk_bytes": chunk,
                                "shape": shape,
                                "cpu_tier_io": mode,
                                "fs_gbps": fs["gbps"],
                                "tier_gbps": pt["gbps"],
                                "ratio": r,
                                "cpu_ratio": cr,
                            }
                        )
                        tier_rows.append(
                            [
                                _cond(contended),
                                op,
                                f"{chunk // MiB}",
                                shape,
                                mode,
                                f"{fs['gbps']:.2f}",
                                f"{pt['gbps']:.2f}",
                                _f(r),
                                _f(pt["cpu_s_per_gb"], 4),
                                _f(cr),
                            ]
                        )
    if tier_rows:
        out.tables.append(
            Table(
                title="Inside vLLM's tiering framework: pykvcache's tier vs the fs tier (medians over repeats)",
                header=[
                    "machine",
                    "op",
                    "chunk MiB",
                    "job shape",
                    "cpu_tier_io",
                    "fs tier GB/s",
                    "pykvcache tier GB/s",
                    "x fs tier",
                    "pykvcache tier CPU-s/GB",
                    "CPU x fs tier",
                ],
                rows=tier_rows,
                note="Both tiers get the same primary (CPU tier) region, TransferJobs and drain_jobs(); "
                "pykvcache's tier copies each chunk through its staging (cpu_tier_io copy, the default) or has the "
                "engine transfer it straight from and to that region (direct; decision 0062).",
            )
        )
    _targets(out, pairs, med, cfg)
    idle_tier = [p for p in tier_pairs if not p["contended"] and p["ratio"] is not None and p["cpu_tier_io"] == "copy"]
    if idle_tier:
        w = min(idle_tier, key=lambda p: p["ratio"])
        out.targets["pykvcache tier (default cpu_tier_io) >= 1.0x fs tier in the same framework (idle)"] = (
            w["ratio"] >= 1.0,
            f"worst {w['ratio']:.2f}x ({dict(OPS)[w['direction']]}, {w['chunk_bytes'] // MiB} MiB, {w['shape']})",
        )
    out.figures += _figures(med, cfg)
    out.raw = {"pairs": pairs, "tier_pairs": tier_pairs}
    return out


def _targets(out: PartOutput, pairs: list[dict], med: dict, cfg: BenchConfig) -> None:
    def worst(sel: list[dict], key: str, low: bool = True) -> dict | None:
        sel = [p for p in sel if p[key] is not None]
        return (min if low else max)(sel, key=lambda p: p[key], default=None)

    def where(p: dict) -> str:
        return f"{dict(OPS)[p['direction']]}, {p['chunk_bytes'] // MiB} MiB, {p['shape']}, {_cond(p['contended'])}"

    idle = [p for p in pairs if not p["contended"]]
    busy = [p for p in pairs if p["contended"]]
    if (w := worst(idle, "ratio")) is not None:
        out.targets[">= 1.0x fs tier everywhere (idle)"] = (w["ratio"] >= 1.0, f"worst {w['ratio']:.2f}x ({where(w)})")
    if (w := worst(busy, "ratio")) is not None:
        out.targets[">= 1.5x fs tier under CPU contention"] = (w["ratio"] >= 1.5, f"worst {w['ratio']:.2f}x ({where(w)})")
    if (w := worst(pairs, "cpu_ratio", low=False)) is not None:
        out.targets["CPU-s/GB <= 1/4 of the fs tier's"] = (w["cpu_ratio"] <= 0.25, f"worst {w['cpu_ratio']:.2f}x ({where(w)})")
    if "one_job" in cfg.fs_shapes:
        verdicts = []
        for contended in cfg.fs_contention:
            for chunk in cfg.fs_chunk_sizes:
                ours = med.get(("pykvcache", "read", chunk, "one_job", contended))
                theirs = [med.get(("fs_tier", "read", chunk, s, contended)) for s in cfg.fs_shapes]
                best = max((t["gbps"] for t in theirs if t), default=None)
                if ours and best:
                    verdicts.append((ours["gbps"] / best, chunk, contended))
        if verdicts:
            r, chunk, contended = min(verdicts)
            out.targets["one request's load (one job) >= fs tier's best shape"] = (
                r >= 1.0,
                f"worst {r:.2f}x ({chunk // MiB} MiB, {_cond(contended)})",
            )


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _figures(med: dict, cfg: BenchConfig) -> list[Figure]:
    labels = [(c, s) for c in cfg.fs_chunk_sizes for s in cfg.fs_shapes]

    def panel(metric: str, ylabel: str) -> Any:
        def draw(fig: Any) -> None:
            axes = fig.subplots(len(cfg.fs_contention), 2, squeeze=False)
            for row, contended in enumerate(cfg.fs_contention):
                for col, (direction, op) in enumerate(OPS):
                    ax = axes[row][col]
                    x = range(len(labels))
                    for off, system in ((-0.2, "fs_tier"), (0.2, "pykvcache")):
                        vals = [med.get((system, direction, c, s, contended), {}).get(metric) or 0 for c, s in labels]
                        ax.bar([i + off for i in x], vals, 0.4, label="vLLM fs tier" if system == "fs_tier" else "pykvcache")
                    ax.set_xticks(list(x), [f"{c // MiB}M {s}" for c, s in labels], rotation=30, fontsize=7)
                    ax.set_title(f"{op}, {_cond(contended)}", fontsize=9)
                    ax.set_ylabel(ylabel)
                    ax.grid(alpha=0.3, axis="y")
            axes[0][0].legend(fontsize=8)

        return draw

    height = 3.2 * len(cfg.fs_contention) + 1
    return [
        Figure("fs_tier_bandwidth.png", "pykvcache vs vLLM fs tier: GB/s by job shape", panel("gbps", "GB/s"), (10, height)),
        Figure("fs_tier_cpu.png", "pykvcache vs vLLM fs tier: CPU-seconds per GB", panel("cpu_s_per_gb", "CPU-s/GB"), (10, height)),
    ]


def run(ctx: BenchContext) -> PartOutput:
    title = "pykvcache vs vLLM's filesystem tier (tiering `fs`)"
    if (reason := vllm_fs_tier_available()) is not None:
        return PartOutput(name="fs_tier", title=title, skipped=f"vLLM's fs tier is not importable: {reason}")
    if (reason := engine_unavailable()) is not None:
        return PartOutput(name="fs_tier", title=title, skipped=reason)
    phases = measure(ctx)
    out = analyse(phases, ctx.config)
    out.raw["phases"] = [p.to_dict() for p in phases]
    return out


register_part(Part("fs_tier", "pykvcache vs vLLM's tiering fs tier, idle and under CPU contention", run, steps))
