"""Part "storage": the pykvcache engine against fio, the physical limit.

For every chunk size: a fio sweep (read and write; depth x numjobs, fixed
buffers) and the engine at each queue depth, interleaved per repeat so both see
the same state of the shared disk. Ratios are taken against fio at the same
depth with one job, and against the best fio configuration. With ``--encrypt``
each engine case also runs with an encryption key (sealed chunks), both
``verify="full"``, one after the other (the order alternating per repeat), and
a table gives the sealed/plaintext ratios (``sealed.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .cold_cache import drop_caches, settle
from .config import BenchConfig, MiB, fio_sweep_for
from .engine_bench import EngineCase, run_engine_case
from .fio_runner import FioJob, FioResult, FioRunner, sweep_jobs
from .parts import BenchContext, Figure, Part, PartOutput, Table, register_part
from .results import Medians, PhaseResult, median_by, ratio
from .sealed import SEALED, engine_cases, sealed_output

RW = ("read", "write")
# Rows of the table: fresh writes into an empty store, the first fill of a
# preformatted store (each put overwrites a filler's file), and writes into a
# full store (each put evicts one chunk) with and without recycling evicted files.
DIRECTIONS = ("read", "write", "write_preformatted", "overwrite", "overwrite_no_recycle")
# Writes into allocated files, as fio's preconditioned files are: what the
# "x best fio" target compares (fresh files are a diagnostic row).
ALLOCATED = ("read", "write_preformatted", "overwrite")


def _fio_rw(direction: str) -> str:
    """fio's direction for an engine phase: every write kind is fio's write
    (fio's big preconditioned files are themselves overwritten)."""
    return "read" if direction == "read" else "write"


def _cf_direction(direction: str) -> str:
    """fio chunk-files phase of the same situation: writes into existing files are its overwrite."""
    return "overwrite" if direction.startswith("overwrite") or direction == "write_preformatted" else direction


# Name the engine gives its io_uring thread (per-thread CPU is grouped by name).
RING_THREAD = "pykvcache-uring"


def _fio_jobs(config: BenchConfig, chunk: int) -> list[Any]:
    jobs = []
    for rw in RW:
        jobs += sweep_jobs(rw, chunk, fio_sweep_for(config), config.fio_runtime_s, config.fio_max_inflight_bytes)
    # The engine's own layout at each engine depth: fresh chunk files written,
    # read, then written over (the files a full store recycles).
    nfiles = max(1, config.engine_bytes // chunk)
    for qd in config.queue_depths:
        for rw, over in (("write", False), ("read", False), ("write", True)):
            jobs.append(FioJob(rw=rw, block_bytes=chunk, iodepth=qd, numjobs=1, runtime_s=0, chunk_files=max(nfiles, qd), overwrite=over))
    return jobs


def engine_unavailable() -> str | None:
    """None when the Rust engine imports, else why not."""
    try:
        import pykvcache  # noqa: F401  (loads the engine, pykvcache._core)
    except ImportError as e:
        return f"pykvcache._core does not import ({e}); build it with `make develop`"
    return None


def steps(config: BenchConfig) -> int:
    cases = len(config.queue_depths) * (2 if config.encrypt else 1)
    per_rep = sum(len(_fio_jobs(config, c)) + cases for c in config.chunk_sizes)
    return 1 + config.repeats * per_rep


def fio_phase(r: FioResult, repeat: int) -> PhaseResult:
    return PhaseResult(
        system="fio_chunk_files" if r.job.chunk_files else "fio",
        direction="overwrite" if r.job.overwrite else r.job.rw,
        chunk_bytes=r.job.block_bytes,
        chunks=r.bytes // r.job.block_bytes,
        bytes=r.bytes,
        seconds=r.seconds,
        cpu_user_s=r.cpu_user_s,
        cpu_sys_s=r.cpu_sys_s,
        params={
            "numjobs": r.job.numjobs,
            "iodepth": r.job.iodepth,
            "fixedbufs": r.job.fixedbufs,
            "chunk_files": r.job.chunk_files,
            "overwrite": r.job.overwrite,
            "repeat": repeat,
        },
        disk=r.disk,
        info={"command": r.command, "mean_latency_s": r.mean_latency_s},
    )


def _before_fio(job: FioJob, cold: bool, metadata: bool) -> None:
    # Chunk-file reads: the same cache state as the engine's reads.
    if job.chunk_files and job.rw == "read" and cold:
        drop_caches(metadata)
    settle(0.1)


def measure(ctx: BenchContext) -> tuple[list[PhaseResult], list[str]]:
    cfg = ctx.config
    step = ctx.progress.part("storage", steps(cfg))
    fio_dir = Path(cfg.directory) / "fio"
    eng_dir = Path(cfg.directory) / "engine"
    runner = FioRunner(
        fio_dir,
        cfg.fio_file_bytes,
        max(nj for nj, _ in fio_sweep_for(cfg)),
        before_run=lambda job: _before_fio(job, cfg.cold_reads, cfg.cold_metadata),
        disk=ctx.disk,
    )
    phases: list[PhaseResult] = []
    commands: list[str] = []
    no_engine = engine_unavailable()
    try:
        commands.append(" ".join(runner.precondition()))
        step.advance("fio: preconditioned files")
        for rep in range(cfg.repeats):
            for chunk in cfg.chunk_sizes:
                fio_first = rep % 2 == 0

                def fio_block() -> None:
                    for job in _fio_jobs(cfg, chunk):
                        phases.append(fio_phase(runner.run(job), rep))
                        step.advance(f"{job.label} (repeat {rep + 1})")

                def engine_block() -> None:
                    for qd in cfg.queue_depths:
                        for system, kwargs in engine_cases(cfg, eng_dir, rep):
                            if no_engine:
                                step.advance("pykvcache engine unavailable")
                                continue
                            case = EngineCase(chunk, qd, cfg.engine_bytes, kwargs, overwrite=True, preformat=True, system=system)
                            phases.extend(
                                run_engine_case(
                                    case, eng_dir, disk=ctx.disk, cold=cfg.cold_reads, repeat=rep, cold_metadata=cfg.cold_metadata
                                )
                            )
                            step.advance(f"{system} bs={chunk // MiB}MiB qd={qd} (repeat {rep + 1})")

                for block in (fio_block, engine_block) if fio_first else (engine_block, fio_block):
                    block()
    finally:
        runner.cleanup()
    commands += sorted({" ".join(p.info["command"]) for p in phases if p.system == "fio"})
    return phases, commands


def analyse(phases: list[PhaseResult], cfg: BenchConfig) -> PartOutput:
    out = PartOutput(name="storage", title="Engine vs physical limit (fio)")
    eng = median_by([p for p in phases if p.system == "pykvcache"], lambda p: (p.direction, p.chunk_bytes, p.params["queue_depth"]))
    fio = median_by(
        [p for p in phases if p.system == "fio"], lambda p: (p.direction, p.chunk_bytes, p.params["numjobs"], p.params["iodepth"])
    )
    fio_cf = median_by([p for p in phases if p.system == "fio_chunk_files"], lambda p: (p.direction, p.chunk_bytes, p.params["iodepth"]))

    def fio_best(rw: str, chunk: int) -> tuple[tuple[Any, ...], Medians] | None:
        cands = [(k, v) for k, v in fio.items() if k[0] == _fio_rw(rw) and k[1] == chunk]
        return max(cands, key=lambda kv: kv[1]["gbps"], default=None)

    rows: list[list[str]] = []
    summary: list[dict[str, Any]] = []
    for rw in DIRECTIONS:
        for chunk in cfg.chunk_sizes:
            best = fio_best(rw, chunk)
            best_engine: tuple[int, Medians] | None = None
            for qd in cfg.queue_depths:
                e = eng.get((rw, chunk, qd))
                if e is None:
                    continue
                same = fio.get((_fio_rw(rw), chunk, 1, qd))
                cf = fio_cf.get((_cf_direction(rw), chunk, qd))
                if best_engine is None or e["gbps"] > best_engine[1]["gbps"]:
                    best_engine = (qd, e)
                rows.append(
                    [
                        rw,
                        f"{chunk // MiB}",
                        str(qd),
                        f"{e['gbps']:.2f}",
                        _f(same and same["gbps"]),
                        _f(best and best[1]["gbps"]) + (f" (j{best[0][2]} qd{best[0][3]})" if best else ""),
                        _f(cf and cf["gbps"]),
                        _f(ratio(e["gbps"], same and same["gbps"])),
                        _f(ratio(e["gbps"], best and best[1]["gbps"])),
                        _f(ratio(e["gbps"], cf and cf["gbps"])),
                        _f(e["cpu_s_per_gb"], 4),
                        _f(same and same["cpu_s_per_gb"], 4),
                        _f(ratio(e["cpu_s_per_gb"], same and same["cpu_s_per_gb"])),
                    ]
                )
            if best_engine and best:
                qd, e = best_engine
                same = fio.get((_fio_rw(rw), chunk, 1, qd))
                cf = fio_cf.get((_cf_direction(rw), chunk, qd))
                summary.append(
                    {
                        "direction": rw,
                        "chunk_bytes": chunk,
                        "engine_qd": qd,
                        "engine_gbps": e["gbps"],
                        "fio_best_gbps": best[1]["gbps"],
                        "fio_best_config": {"numjobs": best[0][2], "iodepth": best[0][3]},
                        "ratio_best": ratio(e["gbps"], best[1]["gbps"]),
                        "fio_chunk_files_gbps": cf and cf["gbps"],
                        "ratio_chunk_files": ratio(e["gbps"], cf and cf["gbps"]),
                        "engine_cpu_s_per_gb": e["cpu_s_per_gb"],
                        "fio_same_cpu_s_per_gb": same and same["cpu_s_per_gb"],
                        "cpu_ratio": ratio(e["cpu_s_per_gb"], same and same["cpu_s_per_gb"]),
                    }
                )
    out.tables.append(
        Table(
            title="pykvcache engine vs fio (medians over repeats)",
            header=[
                "op", "chunk MiB", "engine QD", "engine GB/s", "fio GB/s (1 job, same QD)", "fio best GB/s (config)",
                "fio chunk files GB/s (same QD)", "x fio same QD", "x fio best", "x fio chunk files",
                "engine CPU-s/GB", "fio CPU-s/GB (same QD)", "CPU x fio",
            ],
            rows=rows,
            note="QD = chunk operations in flight (engine) / fio iodepth. fio: io_uring, O_DIRECT, fixed buffers; "
            "'fio best' and 'same QD' use large preconditioned files (registered files); 'fio chunk files' uses the "
            "engine's layout: one fresh file per chunk, written once without preallocation, then read back cold "
            "(and, for the overwrite rows, written over in place). write = fresh chunks into an empty store; "
            "write_preformatted = the same chunks into an empty store first filled with filler chunks by "
            "`pykvcache.preformat` (each put overwrites a filler's file; the preformat itself is not timed here); "
            "overwrite = new chunks into a full store, each put evicting one chunk and overwriting its file; "
            "overwrite_no_recycle = the same with each victim unlinked and a fresh file allocated.",
        )
    )  # fmt: skip
    big = [s for s in summary if s["chunk_bytes"] >= 8 * MiB and s["direction"] in ALLOCATED]
    fresh = [s for s in summary if s["chunk_bytes"] >= 8 * MiB and s["direction"] == "write"]
    if big:
        worst = min(big, key=lambda s: s["ratio_best"] or 0)
        out.targets["engine >= 0.9x best fio at 8-28 MiB (reads; writes into a preformatted or a full store)"] = (
            all((s["ratio_best"] or 0) >= 0.9 for s in big),
            f"worst {worst['ratio_best']:.2f}x ({worst['direction']}, {worst['chunk_bytes'] // MiB} MiB, engine QD {worst['engine_qd']})",
        )
    if fresh:
        worst = min(fresh, key=lambda s: s["ratio_best"] or 0)
        cf_fresh = [s["ratio_chunk_files"] for s in fresh if s["ratio_chunk_files"] is not None]
        out.targets["(diagnostic) first fill of an unformatted store (fresh files) >= 0.9x best fio"] = (
            all((s["ratio_best"] or 0) >= 0.9 for s in fresh),
            f"worst {worst['ratio_best']:.2f}x ({worst['chunk_bytes'] // MiB} MiB, engine QD {worst['engine_qd']})"
            + (f"; {min(cf_fresh):.2f}-{max(cf_fresh):.2f}x fio writing fresh chunk files" if cf_fresh else ""),
        )
    if big:
        with_cf = [s for s in big if s["ratio_chunk_files"] is not None]
        if with_cf:
            worst_cf = min(with_cf, key=lambda s: s["ratio_chunk_files"])
            out.targets["(diagnostic) engine >= 0.9x fio on the same file-per-chunk layout, 8-28 MiB"] = (
                all(s["ratio_chunk_files"] >= 0.9 for s in with_cf),
                f"worst {worst_cf['ratio_chunk_files']:.2f}x ({worst_cf['direction']}, {worst_cf['chunk_bytes'] // MiB} MiB, QD {worst_cf['engine_qd']})",
            )
        cpu = [s for s in big if s["cpu_ratio"] is not None]
        if cpu:
            worst_cpu = max(cpu, key=lambda s: s["cpu_ratio"])
            out.targets["engine CPU-s/GB <= 2x fio fixed-buffer figure"] = (
                all(s["cpu_ratio"] <= 2.0 for s in cpu),
                f"worst {worst_cpu['cpu_ratio']:.1f}x ({worst_cpu['direction']}, {worst_cpu['chunk_bytes'] // MiB} MiB: "
                f"{worst_cpu['engine_cpu_s_per_gb']:.4f} vs {worst_cpu['fio_same_cpu_s_per_gb']:.4f})",
            )
    ring = [
        (sum(v for k, v in p.threads_s.items() if k.startswith(RING_THREAD)) / p.seconds, p)
        for p in phases
        if p.system == "pykvcache" and p.seconds > 0
    ]
    if ring:
        share, p = max(ring, key=lambda x: x[0])
        out.targets["ring thread uses at most one core"] = (
            share <= 1.0,
            f"max {share * 100:.0f}% of a core ({p.direction}, {p.chunk_bytes // MiB} MiB, QD {p.params['queue_depth']}, {p.gbps:.2f} GB/s)",
        )
    out.tables.append(_thread_table(phases))
    out.notes += _cold_notes(phases)
    out.figures += _figures(eng, fio, fio_cf, cfg)
    out.raw = {"summary": summary, "engine_medians": _keyed(eng), "fio_medians": _keyed(fio)}
    if any(p.system == SEALED for p in phases):
        table, targets, raw = sealed_output(phases)
        out.tables.append(table)
        out.targets.update(targets)
        out.raw["sealed"] = raw
    return out


def _thread_table(phases: list[PhaseResult]) -> Table:
    """Where the engine's CPU goes, by thread, at the deepest queue of the largest chunk."""
    rows = []
    eng = [p for p in phases if p.system == "pykvcache"]
    if eng:
        chunk = max(p.chunk_bytes for p in eng)
        qd = max(p.params["queue_depth"] for p in eng)
        for p in eng:
            if p.chunk_bytes == chunk and p.params["queue_depth"] == qd and p.params["repeat"] == 0:
                for name, s in list(p.threads_s.items())[:6]:
                    rows.append([p.direction, name, f"{s:.3f}", f"{s / p.seconds * 100:.0f}%", f"{s / (p.bytes / 1e9):.4f}"])
        title = f"pykvcache CPU by thread ({chunk // MiB} MiB chunks, QD {qd}, first repeat)"
    else:
        title = "pykvcache CPU by thread"
    return Table(title=title, header=["op", "thread", "CPU-s", "of one core", "CPU-s/GB"], rows=rows)


def _cold_notes(phases: list[PhaseResult]) -> list[str]:
    reads = [p for p in phases if p.system == "pykvcache" and p.direction == "read"]
    fr = [p.device_fraction for p in reads if p.device_fraction is not None]
    notes = []
    if reads:
        dropped = sum(1 for p in reads if p.cold)
        what = (
            "page/dentry/inode caches"
            if any(p.params.get("cold_metadata") for p in reads)
            else ("page cache (dentries/inodes kept, as in a serving store; `--cold-metadata` drops them too)")
        )
        notes.append(f"pykvcache reads: {what} dropped before {dropped} of {len(reads)} read phases.")
    if fr:
        notes.append(
            f"Device bytes read / payload bytes in pykvcache read phases: min {min(fr):.2f}, max {max(fr):.2f} "
            "(from /sys/block/<dev>/stat; ~1.0 = data came from the device)."
        )
    return notes


def _keyed(med: dict[tuple[Any, ...], Medians]) -> list[dict[str, Any]]:
    return [{"key": list(k), **v} for k, v in med.items()]


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _figures(eng: dict, fio: dict, fio_cf: dict, cfg: BenchConfig) -> list[Figure]:
    chunks = cfg.chunk_sizes

    def bandwidth(fig: Any) -> None:
        axes = fig.subplots(1, 2, sharey=True)
        xs = [c / MiB for c in chunks]
        for ax, rw in zip(axes, RW):
            for qd in cfg.queue_depths:
                ys = [eng.get((rw, c, qd), {}).get("gbps") for c in chunks]
                ax.plot(xs, ys, marker="o", label=f"pykvcache QD {qd}")
            best = [max((v["gbps"] for k, v in fio.items() if k[0] == rw and k[1] == c), default=None) for c in chunks]
            ax.plot(xs, best, "k--", marker="s", label="fio best config")
            qd = max(cfg.queue_depths)
            one = [fio.get((rw, c, 1, qd), {}).get("gbps") for c in chunks]
            ax.plot(xs, one, ":", color="gray", marker="^", label=f"fio 1 job QD {qd}")
            cf = [fio_cf.get((rw, c, qd), {}).get("gbps") for c in chunks]
            ax.plot(xs, cf, "-.", color="brown", marker="v", label=f"fio file per chunk QD {qd}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
            ax.set_xlabel("chunk size (MiB)")
            ax.set_title(rw)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("GB/s")
        axes[0].legend(fontsize=8)

    def cpu(fig: Any) -> None:
        axes = fig.subplots(1, 2)
        for ax, rw in zip(axes, RW):
            labels, e_vals, f_vals = [], [], []
            for c in chunks:
                for qd in cfg.queue_depths:
                    labels.append(f"{c // MiB}M/q{qd}")
                    e_vals.append(eng.get((rw, c, qd), {}).get("cpu_s_per_gb") or 0)
                    f_vals.append(fio.get((rw, c, 1, qd), {}).get("cpu_s_per_gb") or 0)
            x = range(len(labels))
            ax.bar([i - 0.2 for i in x], e_vals, 0.4, label="pykvcache")
            ax.bar([i + 0.2 for i in x], f_vals, 0.4, label="fio (1 job, fixed bufs)")
            ax.set_xticks(list(x), labels, rotation=45, fontsize=7)
            ax.set_title(f"{rw}: CPU-s per GB")
            ax.grid(alpha=0.3, axis="y")
        axes[0].legend(fontsize=8)

    return [
        Figure("storage_bandwidth.png", "pykvcache engine vs fio: GB/s by chunk size", bandwidth),
        Figure("storage_cpu.png", "pykvcache engine vs fio: CPU-seconds per GB", cpu),
    ]


def run(ctx: BenchContext) -> PartOutput:
    if not FioRunner.available():
        return PartOutput(name="storage", title="Engine vs physical limit (fio)", skipped="fio is not installed (apt-get install fio)")
    phases, commands = measure(ctx)
    out = analyse(phases, ctx.config)
    if (reason := engine_unavailable()) is not None:
        out.notes.insert(0, f"Engine not measured: {reason}. fio figures only.")
    out.raw["phases"] = [p.to_dict() for p in phases]
    out.raw["fio_commands"] = commands
    return out


register_part(Part("storage", "pykvcache engine vs fio over chunk sizes and queue depths", run, steps))
