"""The storage part's ``--encrypt`` comparison (decision 0083): every engine case run twice,
plaintext and sealed (an encryption key: AES-256-GCM per frame), both ``verify="full"``, one
after the other with the order alternating per repeat, and the sealed/plaintext ratio of
throughput and of CPU per GB for each direction, chunk size and queue depth."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from pykvcache.keys import write_key_file

from .config import BenchConfig, MiB
from .parts import Table
from .results import PhaseResult

PLAIN, SEALED = "pykvcache", "pykvcache_sealed"
#: Loads and stores the target covers: reads, fresh writes, the first fill of a preformatted
#: store and writes into a full one.
TARGET_DIRECTIONS = ("read", "write", "write_preformatted", "overwrite")
TARGET = 0.85


def bench_key(directory: Path) -> Path:
    """A fresh 32-byte key file (mode 0600) for the sealed cases, in the engine's directory."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "bench-encryption.key"
    path.unlink(missing_ok=True)
    return write_key_file(path)


def engine_cases(cfg: BenchConfig, directory: Path, repeat: int) -> list[tuple[str, dict[str, Any]]]:
    """The (system, store keywords) of each engine case of one queue depth: the configured
    store alone, or with ``--encrypt`` plaintext and sealed, both ``verify="full"``, in the
    order of this repeat."""
    if not cfg.encrypt:
        return [(PLAIN, dict(cfg.store_kwargs))]
    plain = {**cfg.store_kwargs, "verify": "full"}
    sealed = {**plain, "encryption_key_file": str(bench_key(directory))}
    cases = [(PLAIN, plain), (SEALED, sealed)]
    return cases if repeat % 2 == 0 else cases[::-1]


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def sealed_output(phases: list[PhaseResult]) -> tuple[Table, dict[str, tuple[bool, str]], list[dict[str, Any]]]:
    """The comparison table, the target, and its rows as data."""
    by: dict[tuple[str, str, int, int, int], PhaseResult] = {}
    for p in phases:
        if p.system in (PLAIN, SEALED):
            by[(p.system, p.direction, p.chunk_bytes, p.params["queue_depth"], p.params["repeat"])] = p
    keys = sorted({k[1:4] for k in by if k[0] == SEALED})
    rows: list[list[str]] = []
    raw: list[dict[str, Any]] = []
    for direction, chunk, qd in keys:
        pairs = [
            (by[(PLAIN, direction, chunk, qd, r)], by[(SEALED, direction, chunk, qd, r)])
            for r in sorted({k[4] for k in by})
            if (PLAIN, direction, chunk, qd, r) in by and (SEALED, direction, chunk, qd, r) in by
        ]
        if not pairs:
            continue
        ratios = [s.gbps / p.gbps for p, s in pairs if p.gbps > 0]
        plain_gbps = statistics.median(p.gbps for p, _ in pairs)
        sealed_gbps = statistics.median(s.gbps for _, s in pairs)
        plain_cpu = _median([p.cpu_s_per_gb for p, _ in pairs])
        sealed_cpu = _median([s.cpu_s_per_gb for _, s in pairs])
        ratio = statistics.median(ratios) if ratios else None
        raw.append(
            {
                "direction": direction,
                "chunk_bytes": chunk,
                "queue_depth": qd,
                "plain_gbps": plain_gbps,
                "sealed_gbps": sealed_gbps,
                "ratio": ratio,
                "ratios": ratios,
                "plain_cpu_s_per_gb": plain_cpu,
                "sealed_cpu_s_per_gb": sealed_cpu,
                "repeats": len(pairs),
            }
        )
        rows.append(
            [
                direction,
                f"{chunk // MiB}",
                str(qd),
                f"{plain_gbps:.2f}",
                f"{sealed_gbps:.2f}",
                _f(ratio),
                f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-",
                _f(plain_cpu, 4),
                _f(sealed_cpu, 4),
                _f(sealed_cpu / plain_cpu if sealed_cpu and plain_cpu else None),
            ]
        )
    table = Table(
        title="Sealed (encryption key, AES-256-GCM) vs plaintext chunks, both verify=full",
        header=[
            "op",
            "chunk MiB",
            "QD",
            "plaintext GB/s",
            "sealed GB/s",
            "x plaintext (median of repeats)",
            "x plaintext (per repeat)",
            "plaintext CPU-s/GB",
            "sealed CPU-s/GB",
            "CPU x plaintext",
        ],
        rows=rows,
        note="Each repeat runs the plaintext and the sealed store one after the other on the same disk (the order "
        "alternating per repeat); the ratio is sealed/plaintext of that repeat, then the median. CPU: the "
        "whole process (caller, ring, chunk workers) per GB moved.",
    )
    covered = [r for r in raw if r["direction"] in TARGET_DIRECTIONS and r["ratio"] is not None]
    targets: dict[str, tuple[bool, str]] = {}
    if covered:
        worst = min(covered, key=lambda r: r["ratio"])
        targets[f"sealed >= {TARGET}x plaintext throughput (loads and stores)"] = (
            all(r["ratio"] >= TARGET for r in covered),
            f"worst {worst['ratio']:.2f}x ({worst['direction']}, {worst['chunk_bytes'] // MiB} MiB, QD {worst['queue_depth']})",
        )
    return table, targets, raw


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None
