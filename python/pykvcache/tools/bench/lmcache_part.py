"""Part "lmcache_disk": pykvcache's store against LMCache's local disk tier, at
the storage level, side by side in one run.

LMCache cannot move KV inside vLLM's CPU build (the serve part reports its
error), so this part drives the layer under LMCache's connector directly --
its StorageManager, LocalCPUBackend allocator and LocalDiskBackend, from a
private install (``PYKVCACHE_LMCACHE_PATH``, default ``.lmcache``; ``make
lmcache-env``) -- against pykvcache's BlockStore with the same chunk bytes,
sizes, total bytes and operations in flight (see lmcache_disk.py for exactly
which LMCache calls). Not a default part: it needs that install.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .cold_cache import settle
from .config import BenchConfig, MiB
from .engine_bench import BenchDataError
from .lmcache_disk import BYTES_PER_TOKEN
from .parts import BenchContext, Part, PartOutput, Table, register_part
from .results import PhaseResult
from .serve_options import LMCACHE_PATH_ENV
from .storage_part import engine_unavailable

NAME = "lmcache_disk"
TITLE = "pykvcache vs LMCache's local disk tier (storage level)"
SYSTEMS = ("pykvcache", "lmcache")
#: Where ``make lmcache-env`` installs it: the repository root of a checkout.
DEFAULT_DIR = ".lmcache"
INSTALL_HINT = (
    f"`make lmcache-env` (= `bash dev/setup_lmcache.sh .lmcache`) installs it into .lmcache, or "
    f"set {LMCACHE_PATH_ENV}=DIR for an install made with `pip install --no-deps --target DIR "
    f"lmcache==0.5.6 aiofile==3.12.3 caio==0.12.10`; never into vLLM's venv"
)
_PHASES = dict.fromkeys(("write", "flush", "read"))


def _package_dir() -> Path:
    """python/pykvcache of this checkout (found without importing the engine)."""
    spec = importlib.util.find_spec("pykvcache")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).resolve().parent


def lmcache_install() -> tuple[Path | None, str | None]:
    """(directory to put on the child's PYTHONPATH or None when lmcache is
    importable as it is, reason it is unavailable)."""
    env = os.environ.get(LMCACHE_PATH_ENV)
    if env:
        if not (Path(env) / "lmcache").is_dir():
            return None, f"{LMCACHE_PATH_ENV}={env} holds no lmcache package: {INSTALL_HINT}"
        return Path(env).resolve(), None
    repo = _package_dir().parents[1]
    for cand in (Path.cwd() / DEFAULT_DIR, repo / DEFAULT_DIR):
        if (cand / "lmcache").is_dir():
            return cand.resolve(), None
    if importlib.util.find_spec("lmcache") is not None:
        return None, None
    return None, f"LMCache is not installed ({LMCACHE_PATH_ENV} unset, no {DEFAULT_DIR}/): {INSTALL_HINT}"


def child_env(lmcache_dir: Path | None) -> dict[str, str]:
    """pykvcache's own package first, then the private LMCache install."""
    paths = [str(_package_dir().parent)]
    if lmcache_dir is not None:
        paths.append(str(lmcache_dir))
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), LMCACHE_LOG_LEVEL="WARNING")


def lmcache_import_error(lmcache_dir: Path | None) -> str | None:
    """None when LMCache's storage layer imports in a child, else its last error line."""
    code = "import lmcache.v1.storage_backend.storage_manager, lmcache.v1.storage_backend.local_disk_backend"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(lmcache_dir), timeout=300)
    except subprocess.TimeoutExpired:
        return "importing LMCache took over 300 s"
    if proc.returncode == 0:
        return None
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    return f"LMCache does not import from {lmcache_dir or 'sys.path'}: {lines[-1] if lines else f'exit {proc.returncode}'}"


def steps(config: BenchConfig) -> int:
    return 1 + config.repeats * len(config.lmcache_chunk_sizes) * len(config.lmcache_concurrency) * len(SYSTEMS)


def run_child(spec: dict[str, Any], work: Path, lmcache_dir: Path | None) -> dict[str, Any]:
    """One system, one case, in a fresh process (lmcache_disk.main)."""
    stem = f"{spec['system']}-{time.monotonic_ns()}"
    spec_path, out_path = work / f"{stem}.spec.json", work / f"{stem}.out.json"
    spec_path.write_text(json.dumps(spec))
    timeout = max(300.0, 4 * spec["chunks"] * spec["chunk_bytes"] / 10e6)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pykvcache.tools.bench.lmcache_disk", str(spec_path), str(out_path)],
            capture_output=True,
            text=True,
            env=child_env(lmcache_dir),
            timeout=timeout,
        )
        try:
            result = json.loads(out_path.read_text())
        except (OSError, ValueError):
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
            raise BenchDataError(f"{spec['system']} child exited with {proc.returncode} and no result:\n{tail}") from None
    finally:
        spec_path.unlink(missing_ok=True)
        out_path.unlink(missing_ok=True)
    if "error" in result:
        # A failed put/get or a wrong byte voids the case: no number is reported for it.
        raise BenchDataError(
            f"{spec['system']} ({spec['chunk_bytes'] // MiB} MiB, {spec['concurrency']} in flight): "
            f"{result['error']}\n{result.get('traceback', '')[-2000:]}"
        )
    return result


def measure(ctx: BenchContext, lmcache_dir: Path | None) -> tuple[list[PhaseResult], list[dict[str, Any]]]:
    cfg = ctx.config
    step = ctx.progress.part(NAME, steps(cfg))
    step.advance("LMCache imports")
    work = Path(cfg.directory) / "lmcache-compare"
    work.mkdir(parents=True, exist_ok=True)
    sysfs = ctx.machine.device.sysfs if ctx.machine.device else None
    fields = PhaseResult.__dataclass_fields__
    phases: list[PhaseResult] = []
    runs: list[dict[str, Any]] = []
    try:
        for rep in range(cfg.repeats):
            for ci, chunk in enumerate(cfg.lmcache_chunk_sizes):
                if chunk % BYTES_PER_TOKEN:
                    raise ValueError(f"lmcache_disk: chunk of {chunk} bytes is not a whole number of {BYTES_PER_TOKEN // 1024} KiB tokens")
                chunks = max(1, cfg.lmcache_bytes // chunk)
                for qi, conc in enumerate(cfg.lmcache_concurrency):
                    # Alternate which system goes first so neither always gets the fresher disk.
                    order = SYSTEMS if (rep + ci + qi) % 2 == 0 else SYSTEMS[::-1]
                    for system in order:
                        root = work / f"{system}-{rep}-{ci}-{qi}"
                        spec = {
                            "system": system,
                            "root": str(root),
                            "chunk_bytes": chunk,
                            "chunks": chunks,
                            "concurrency": conc,
                            "latency_ops": cfg.lmcache_latency_ops,
                            "repeat": rep,
                            "tag": f"{system}-{chunk}-{conc}-{rep}-{time.monotonic_ns()}",
                            "cold": cfg.cold_reads,
                            "cold_metadata": cfg.cold_metadata,
                            "sysfs": sysfs,
                            "store_kwargs": cfg.store_kwargs,
                        }
                        try:
                            result = run_child(spec, work, lmcache_dir)
                        finally:
                            shutil.rmtree(root, ignore_errors=True)
                            settle()
                        phases += [PhaseResult(**{k: v for k, v in p.items() if k in fields}) for p in result["phases"]]
                        runs.append(
                            {
                                "system": system,
                                "chunk_bytes": chunk,
                                "concurrency": conc,
                                "repeat": rep,
                                "chunks": chunks,
                                "latency_s": result["latency_s"],
                                "verified": result["verified"],
                                "files": result["files"],
                                "file_bytes": result["file_bytes"],
                                "info": result["info"],
                            }
                        )
                        step.advance(f"{system} {chunk // MiB} MiB x{conc} (repeat {rep + 1})")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return phases, runs


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _spread(xs: list[float], digits: int = 2) -> str:
    if not xs:
        return "-"
    med = statistics.median(xs)
    if len(xs) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({min(xs):.{digits}f}–{max(xs):.{digits}f})"


def _op_figures(by: dict[tuple, PhaseResult], system: str, chunk: int, conc: int, rep: int) -> dict[str, tuple[float, float | None]]:
    """op -> (GB/s, CPU-s/GB) of one system in one repeat."""
    w, f, r = (by.get((system, d, chunk, conc, rep)) for d in _PHASES)
    out: dict[str, tuple[float, float | None]] = {}
    if r:
        out["load (cold)"] = (r.gbps, r.cpu_s_per_gb)
    if w:
        out["store (acknowledged)"] = (w.gbps, w.cpu_s_per_gb)
        if f:
            secs, cpu = w.seconds + f.seconds, w.cpu_s + f.cpu_s
            out["store + fsync (on device)"] = (w.bytes / secs / 1e9 if secs > 0 else 0.0, cpu / (w.bytes / 1e9))
    return out


def analyse(phases: list[PhaseResult], runs: list[dict[str, Any]], cfg: BenchConfig) -> PartOutput:
    out = PartOutput(name=NAME, title=TITLE)
    by = {(p.system, p.direction, p.chunk_bytes, p.params["concurrency"], p.params["repeat"]): p for p in phases}
    rows: list[list[str]] = []
    pairs: list[dict[str, Any]] = []
    ops = ("load (cold)", "store (acknowledged)", "store + fsync (on device)")
    for chunk in cfg.lmcache_chunk_sizes:
        for conc in cfg.lmcache_concurrency:
            for op in ops:
                g: dict[str, list[float]] = {
                    "lmcache": [],
                    "pykvcache": [],
                    "ratio": [],
                    "lmcache_cpu": [],
                    "pykvcache_cpu": [],
                    "cpu_ratio": [],
                }
                for rep in range(cfg.repeats):
                    lm = _op_figures(by, "lmcache", chunk, conc, rep).get(op)
                    pk = _op_figures(by, "pykvcache", chunk, conc, rep).get(op)
                    if lm is None or pk is None:
                        continue
                    g["lmcache"].append(lm[0])
                    g["pykvcache"].append(pk[0])
                    if lm[0] > 0:
                        g["ratio"].append(pk[0] / lm[0])
                    if lm[1] is not None and pk[1] is not None:
                        g["lmcache_cpu"].append(lm[1])
                        g["pykvcache_cpu"].append(pk[1])
                        if lm[1] > 0:
                            g["cpu_ratio"].append(pk[1] / lm[1])
                if not g["lmcache"]:
                    continue
                pairs.append({"chunk_bytes": chunk, "concurrency": conc, "op": op, **g})
                rows.append(
                    [
                        f"{chunk // MiB}",
                        str(conc),
                        op,
                        _spread(g["lmcache"]),
                        _spread(g["pykvcache"]),
                        _spread(g["ratio"]),
                        _spread(g["lmcache_cpu"], 3),
                        _spread(g["pykvcache_cpu"], 3),
                        _spread(g["cpu_ratio"]),
                    ]
                )
    out.tables.append(
        Table(
            title="Store and load, every chunk of the phase in flight: GB/s and CPU-s/GB, median (min–max) over repeats",
            header=[
                "chunk MiB",
                "in flight",
                "op",
                "LMCache GB/s",
                "pykvcache GB/s",
                "pykvcache / LMCache",
                "LMCache CPU-s/GB",
                "pykvcache CPU-s/GB",
                "CPU pykvcache / LMCache",
            ],
            rows=rows,
            note="Ratios are per repeat (the two systems back to back, order alternated), then median (min–max). "
            "'in flight' = LMCache's disk_io_threads (its writer pool and its read pool) = pykvcache's queue_depth; "
            "all chunks are submitted at once. 'acknowledged' = until each system reports every put done "
            "(LMCache: after a buffered write() into the page cache, no fsync; pykvcache: after its O_DIRECT "
            "write completed); '+ fsync' adds an fsync of every file the system wrote, so both have their bytes "
            "on the device. CPU = the child process's user+sys time (every thread), not the kernel's writeback "
            "workers (LMCache's dirty pages are written by them until the fsync). Loads: page cache dropped first; "
            "LMCache's default disk tier reads through the page cache, pykvcache with O_DIRECT and a CRC-32C per chunk "
            "(LMCache checks nothing).",
        )
    )
    lat_rows, lat = [], []
    for chunk in cfg.lmcache_chunk_sizes:
        for d, op in (("read", "load (cold)"), ("write", "store (acknowledged)")):
            vals = {s: [x for r in runs if r["system"] == s and r["chunk_bytes"] == chunk for x in r["latency_s"][d]] for s in SYSTEMS}
            if not all(vals.values()):
                continue
            p = {s: (_pct(v, 0.5) * 1e3, _pct(v, 0.99) * 1e3) for s, v in vals.items()}
            lat.append(
                {
                    "chunk_bytes": chunk,
                    "op": op,
                    "n": {s: len(v) for s, v in vals.items()},
                    **{f"{s}_p50_ms": p[s][0] for s in SYSTEMS},
                    **{f"{s}_p99_ms": p[s][1] for s in SYSTEMS},
                }
            )
            lat_rows.append(
                [
                    f"{chunk // MiB}",
                    op,
                    str(len(vals["lmcache"])),
                    f"{p['lmcache'][0]:.2f}",
                    f"{p['lmcache'][1]:.2f}",
                    f"{p['pykvcache'][0]:.2f}",
                    f"{p['pykvcache'][1]:.2f}",
                    f"{p['pykvcache'][0] / p['lmcache'][0]:.2f}",
                    f"{p['pykvcache'][1] / p['lmcache'][1]:.2f}",
                ]
            )
    out.tables.append(
        Table(
            title="Per-operation latency, one operation at a time (ms)",
            header=[
                "chunk MiB",
                "op",
                "ops per system",
                "LMCache p50",
                "LMCache p99",
                "pykvcache p50",
                "pykvcache p99",
                "p50 pykvcache / LMCache",
                "p99 pykvcache / LMCache",
            ],
            rows=lat_rows,
            note=f"{cfg.lmcache_latency_ops} chunks per case stored then loaded one at a time (caller-observed time: "
            "submit to completion), pooled over repeats and in-flight settings; loads after the page cache was "
            "dropped. Below 1 = pykvcache faster.",
        )
    )
    ver_rows = []
    for s in SYSTEMS:
        rs = [r for r in runs if r["system"] == s]
        reads = [p for p in phases if p.system == s and p.direction == "read"]
        fr = [p.device_fraction for p in reads if p.device_fraction is not None]
        ver_rows.append(
            [
                s,
                str(sum(r["verified"] for r in rs)),
                str(sum(r["chunks"] + cfg.lmcache_latency_ops for r in rs)),
                f"{sum(r['files'] for r in rs)}",
                f"{sum(r['file_bytes'] for r in rs) / 1e6:.0f}",
                _spread(fr),
                json.dumps({k: v for k, v in rs[0]["info"].items() if k != "disk_io_threads"}) if rs else "-",
            ]
        )
    out.tables.append(
        Table(
            title="Bytes read back, files, what each system is",
            header=["system", "chunks verified", "chunks read", "files written", "MB on disk", "device bytes / payload (loads)", "info"],
            rows=ver_rows,
            note="Every chunk each system loaded was compared with what was stored (BLAKE2b of the chunk); one wrong "
            "byte or failed operation fails the part instead of giving a number. Before loads the destination "
            "buffers are zeroed (LMCache: its whole allocator region), so a read that filled nothing cannot pass.",
        )
    )
    verified = {s: sum(r["verified"] for r in runs if r["system"] == s) for s in SYSTEMS}
    expected = {s: sum(r["chunks"] + cfg.lmcache_latency_ops for r in runs if r["system"] == s) for s in SYSTEMS}
    out.targets["every chunk read back identical, both systems"] = (
        all(verified[s] == expected[s] > 0 for s in SYSTEMS),
        ", ".join(f"{s} {verified[s]}/{expected[s]}" for s in SYSTEMS),
    )
    loads = [(min(p["ratio"]), p) for p in pairs if p["op"] == "load (cold)" and p["ratio"]]
    if loads:
        r, worst = min(loads, key=lambda x: x[0])
        out.targets["cold loads >= 1.0x LMCache's disk tier (every repeat)"] = (
            r >= 1.0,
            f"worst {r:.2f}x ({worst['chunk_bytes'] // MiB} MiB, {worst['concurrency']} in flight)",
        )
    durable = [(min(p["ratio"]), p) for p in pairs if p["op"] == "store + fsync (on device)" and p["ratio"]]
    if durable:
        r, worst = min(durable, key=lambda x: x[0])
        out.targets["stores to the device >= 1.0x LMCache's (every repeat)"] = (
            r >= 1.0,
            f"worst {r:.2f}x ({worst['chunk_bytes'] // MiB} MiB, {worst['concurrency']} in flight)",
        )
    out.notes.append(
        "LMCache is driven below its vLLM connector (which has no CPU path: `RuntimeError: No supported cpu connector "
        "found.` from lmcache/v1/gpu_connector/__init__.py): its StorageManager built from LMCacheEngineConfig "
        "(local_cpu=False, local_disk=DIR, disk_io_threads=N) and LMCacheMetadata, chunks allocated by its "
        "LocalCPUBackend allocator, stored with LocalDiskBackend.batched_submit_put_task (what "
        "StorageManager.batched_put calls) and loaded with StorageManager.batched_get(location='LocalDiskBackend') "
        "(what the engine's retrieve calls). Not compared: the GPU<->CPU copies of its connector, its CPU hot cache, "
        "its lookup/prefetch path, restart (its disk index is in memory only). docs/decisions/0046."
    )
    out.raw = {"pairs": pairs, "latency": lat, "runs": runs}
    return out


def run(ctx: BenchContext) -> PartOutput:
    lmcache_dir, reason = lmcache_install()
    if reason is None:
        reason = lmcache_import_error(lmcache_dir)
    if reason is not None:
        return PartOutput(name=NAME, title=TITLE, skipped=reason)
    if (reason := engine_unavailable()) is not None:
        return PartOutput(name=NAME, title=TITLE, skipped=reason)
    phases, runs = measure(ctx, lmcache_dir)
    out = analyse(phases, runs, ctx.config)
    out.raw["phases"] = [p.to_dict() for p in phases]
    out.raw["lmcache_install"] = lmcache_dir.name if lmcache_dir else "sys.path"
    return out


register_part(Part(NAME, "pykvcache vs LMCache's local disk tier, storage level (needs `make lmcache-env`)", run, steps, default=False))
