"""Calibration's fits: the gate's cost model from the measurements of :mod:`.measure`.

One :func:`fit_cost_model` serves ``pykvcache calibrate`` and the TTFT
benchmark, so the model the benchmark checks against its measured crossover
is the one the command writes into a profile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pykvcache.gate.cost_model import CostModel, LoadCost, PrefillCurve, nonneg_least_squares

if TYPE_CHECKING:
    from .measure import Point


def fit_cost_model(
    prefill_points: Sequence[Point], path: dict[str, Any], storage_points: Sequence[Point], copy_bytes_per_s: float, bytes_per_token: float
) -> tuple[CostModel, str]:
    """The gate's cost model and where its prefill curve came from (``"paired"``
    or ``"sweep"``, see :func:`fit_recompute`), from the prefill sweep, the load
    path (:func:`.measure.measure_load_path`), the cold storage reads and the
    copy bandwidth. Raises ValueError when the points cannot be fitted."""
    prefill, prefill_source = fit_recompute(path, list(prefill_points))
    fixed, disk_bw = LoadCost.fit_disk([(p.x, p.median) for p in storage_points])
    step_s, path_bw = fit_load_path(path["points"], bytes_per_token, copy_bytes_per_s)
    disk_step_s = fit_disk_step(path, fixed, disk_bw, bytes_per_token)
    load = LoadCost(fixed, disk_bw, path_bw, step_s, disk_step_s)
    return CostModel(prefill, load, bytes_per_token), prefill_source


def fit_prefill_vs_load(
    prefill_points: Sequence[tuple[float, float]],
    disk_points: Sequence[tuple[float, float]],
    copy_bytes_per_s: float,
    bytes_per_token: float,
) -> CostModel:
    """The cost model of ``scripts/gpu_bench.py``'s crossover part (no vLLM, so
    no per-load engine step): the prefill curve fitted to ``(tokens, seconds)``
    of plain forward passes, the disk to ``(bytes, seconds)`` engine reads, the
    copy as measured. Raises ValueError when the points cannot be fitted."""
    fixed, disk_bw = LoadCost.fit_disk(disk_points)
    return CostModel(PrefillCurve.fit(prefill_points), LoadCost(fixed, disk_bw, copy_bytes_per_s), bytes_per_token)


def fit_disk_step(path: dict[str, Any], fixed_s: float, disk_bytes_per_s: float, bytes_per_token: float) -> float:
    """What a load from the disk costs in the engine beyond the read the
    storage sweep measured (``fixed + bytes / BW``): the median over lengths of
    the paired ``TTFT(disk) - TTFT(staging)`` medians minus that read, never
    below 0. The raw read time does not see what the engine adds around it:
    the worker waiting for reads still in flight when the request is scheduled
    (PyKvCacheConnector; the stock connector defers the request a step
    instead) and the completions' handling."""
    residuals = sorted(p.median - (fixed_s + p.x * bytes_per_token / disk_bytes_per_s) for p in path.get("disk_extra_points", ()))
    if not residuals:
        return 0.0
    mid = len(residuals) // 2
    median = residuals[mid] if len(residuals) % 2 else 0.5 * (residuals[mid - 1] + residuals[mid])
    return max(0.0, median)


def fit_recompute(path: dict[str, Any], sweep: list[Point]) -> tuple[PrefillCurve, str]:
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
    # Computing 0 prefix tokens costs nothing: a = 0, only b and c are fitted
    # (relative error; medians <= 0 are noise and carry no information).
    pts = [(float(p.x), p.median) for p in path.get("recompute_points", ()) if p.median > 0]
    if len({n for n, _ in pts}) >= 2:
        b, c = nonneg_least_squares([(n, n * n) for n, _ in pts], [t for _, t in pts], [1.0 / (t * t) for _, t in pts])
        if b > 0 or c > 0:
            return PrefillCurve(0.0, b, c), "paired"
    return PrefillCurve.fit([(p.x, p.low) for p in sweep]), "sweep"


def fit_load_path(points: list[Point], bytes_per_token: float, copy_bytes_per_s: float) -> tuple[float, float]:
    """``(step_s, bytes_per_s)`` of the load path: the fixed cost of a load in
    the engine and the per-byte rate of everything that scales with the
    prefix (the copy into the KV cache and what vLLM does per loaded block),
    never faster than the copy alone."""
    # A median difference <= 0 says the load cost nothing measurable at that
    # length: no information on the relative scale, left out.
    pts = [(p.x * bytes_per_token, p.median) for p in points if p.median > 0]
    if not pts:
        return 0.0, copy_bytes_per_s
    # Relative error: short prefixes (where the step dominates) count as much
    # as long ones (where the per-byte cost does).
    step, per_byte = nonneg_least_squares([(1.0, b) for b, _ in pts], [t for _, t in pts], [1.0 / max(t, 1e-4) ** 2 for _, t in pts])
    return step, 1.0 / max(per_byte, 1.0 / copy_bytes_per_s)
