"""Load-versus-recompute cost model of the admission gate (docs/gate.md, "The model").

Loading the tokens ``[start, end)`` costs
``step + fixed + (queued + disk_bytes) / BW_disk + all_bytes / BW_h2d``:
``step`` what any load costs end to end in the engine (the request computes
one scheduler step after its copy), ``fixed`` the storage's per-load latency
(only when something comes from disk), ``queued`` the I/O ahead of the read.
Recomputing costs ``T_prefill(end) - T_prefill(start)``, a least-squares fit
``a + b*n + c*n^2`` with non-negative coefficients (monotone; quadratic as
attention is) on relative error. Plain arithmetic: it runs per request per step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

INF = math.inf


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (systems of at most 3x3)."""
    n = len(rhs)
    m = [row[:] + [rhs[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    return [m[i][n] / m[i][i] for i in range(n)]


def nonneg_least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float], weights: Sequence[float]) -> list[float]:
    """Weighted least squares with every coefficient >= 0 (exact, by trying
    every subset of free coefficients: fine for the 2-3 unknowns used here)."""
    if not rows or len(rows) != len(ys) or len(ys) != len(weights):
        raise ValueError("need as many rows, values and weights, and at least one")
    dim = len(rows[0])
    best: tuple[float, list[float]] | None = None
    for size in range(dim, 0, -1):
        for active in itertools.combinations(range(dim), size):
            normal = [[0.0] * size for _ in range(size)]
            rhs = [0.0] * size
            for row, y, w in zip(rows, ys, weights):
                for i, ai in enumerate(active):
                    rhs[i] += w * row[ai] * y
                    for j, aj in enumerate(active):
                        normal[i][j] += w * row[ai] * row[aj]
            sol = _solve(normal, rhs)
            if sol is None or any(v < 0 for v in sol):
                continue
            coef = [0.0] * dim
            for i, ai in enumerate(active):
                coef[ai] = sol[i]
            sse = sum(w * (y - sum(c * x for c, x in zip(coef, row))) ** 2 for row, y, w in zip(rows, ys, weights))
            if best is None or sse < best[0] - 1e-18 * abs(best[0]):
                best = (sse, coef)
    return best[1] if best else [0.0] * dim


@dataclass(frozen=True)
class PrefillCurve:
    """``T_prefill(n) = a + b*n + c*n^2`` seconds for a prompt of ``n`` tokens."""

    a: float
    b: float
    c: float

    def __post_init__(self) -> None:
        for name in ("a", "b", "c"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"prefill coefficient {name} must be finite and >= 0 (got {value})")

    def time(self, tokens: float) -> float:
        return self.a + tokens * (self.b + self.c * tokens)

    def compute_cost(self, start: float, end: float) -> float:
        """Seconds saved by not computing tokens ``[start, end)``."""
        if end <= start:
            return 0.0
        return (end - start) * (self.b + self.c * (start + end))

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]]) -> PrefillCurve:
        """Fit measured ``(tokens, seconds)`` points (at least two distinct lengths)."""
        pts = [(float(n), float(t)) for n, t in points if n > 0 and t > 0 and math.isfinite(t)]
        if len({n for n, _ in pts}) < 2:
            raise ValueError("a prefill curve needs measurements at two or more prompt lengths")
        rows = [(1.0, n, n * n) for n, _ in pts]
        ys = [t for _, t in pts]
        a, b, c = nonneg_least_squares(rows, ys, [1.0 / (t * t) for t in ys])
        if b == 0 and c == 0:
            raise ValueError("prefill time does not grow with prompt length in these measurements")
        return cls(a, b, c)


@dataclass(frozen=True)
class LoadCost:
    """Cost of moving KV from the SSD (and from staging) into the KV cache."""

    fixed_s: float
    disk_bytes_per_s: float
    h2d_bytes_per_s: float = INF
    #: End-to-end overhead of any load in the serving engine, staged or not
    #: (vLLM's asynchronous load: one more scheduler step before the request
    #: computes). Not refined online: it does not depend on the device.
    step_s: float = 0.0
    #: What a load from the disk costs in the engine beyond the read itself
    #: and ``step_s``: the reads still in flight when the request is
    #: scheduled, their completions' handling (PyKvCacheConnector answers such
    #: lookups HIT and the worker polls them, decisions 0055 and 0065; vLLM's stock
    #: connector and the tiering framework defer the request a scheduler step
    #: instead). Measured through vLLM by ``calibrate`` as a disk load minus a
    #: staging load of the same prefix, minus the modelled read. Not refined
    #: online (online observations are raw read times).
    disk_step_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("fixed_s", "step_s", "disk_step_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} (load cost) must be finite and >= 0 (got {value})")
        for name in ("disk_bytes_per_s", "h2d_bytes_per_s"):
            value = getattr(self, name)
            if not value > 0:  # also rejects NaN
                raise ValueError(f"{name} must be > 0 (got {value})")

    def time(self, disk_bytes: float, staged_bytes: float = 0.0, queued_bytes: float = 0.0) -> float:
        if disk_bytes + staged_bytes <= 0:
            return 0.0
        cost = self.step_s + (disk_bytes + staged_bytes) / self.h2d_bytes_per_s
        if disk_bytes > 0:
            cost += self.fixed_s + self.disk_step_s + (queued_bytes + disk_bytes) / self.disk_bytes_per_s
        return cost

    @staticmethod
    def fit_disk(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
        """``(fixed_s, bytes_per_s)`` from measured ``(bytes, seconds)`` reads.

        Relative error, so that short reads (the fixed cost) count as much as
        long ones, unless the fit then misses the longest read by more than
        half: a device that serves a burst at a faster rate (a cgroup
        throttle's slice allowance, a cloud disk's burst credits) made short
        reads look 14x faster than the 100 MB/s it sustained, and that fit
        priced every load in service at the burst. Then only the
        reads of at least a quarter of the longest count, by absolute error,
        and the fixed cost is what the burst leaves (at least 0)."""
        pts = [(float(b), float(t)) for b, t in points if b > 0 and t > 0 and math.isfinite(t)]
        if len({b for b, _ in pts}) < 2:
            raise ValueError("a load fit needs reads of two or more sizes")
        fixed, per_byte = nonneg_least_squares([(1.0, b) for b, _ in pts], [t for _, t in pts], [1.0 / (t * t) for _, t in pts])
        if per_byte <= 0:
            raise ValueError("read time does not grow with size in these measurements")
        longest = max(b for b, _ in pts)
        slowest = max(t for b, t in pts if b == longest)
        if fixed + per_byte * longest < slowest / 1.5:
            long_reads = [(b, t) for b, t in pts if b >= longest / 4]
            if len({b for b, _ in long_reads}) >= 2:
                fixed, per_byte = nonneg_least_squares(
                    [(1.0, b) for b, _ in long_reads], [t for _, t in long_reads], [1.0] * len(long_reads)
                )
            if per_byte <= 0 or len({b for b, _ in long_reads}) < 2:
                fixed, per_byte = 0.0, slowest / longest
        return fixed, 1.0 / per_byte


@dataclass(frozen=True)
class CostModel:
    prefill: PrefillCurve
    load: LoadCost
    #: KV bytes of one token as stored (all layers, all ranks, as laid out on disk).
    bytes_per_token: float

    def __post_init__(self) -> None:
        if not self.bytes_per_token > 0:
            raise ValueError(f"bytes_per_token must be > 0 (got {self.bytes_per_token})")

    def with_load(self, load: LoadCost) -> CostModel:
        return CostModel(self.prefill, load, self.bytes_per_token)

    def load_time(self, tokens: float, *, staged_tokens: float = 0.0, queued_bytes: float = 0.0) -> float:
        disk = max(0.0, tokens - staged_tokens) * self.bytes_per_token
        return self.load.time(disk, min(tokens, staged_tokens) * self.bytes_per_token, queued_bytes)

    def recompute_time(self, tokens: float, *, start: float = 0.0) -> float:
        return self.prefill.compute_cost(start, start + tokens)

    def break_even_tokens(self, *, queued_bytes: float = 0.0) -> float:
        """Shortest prefix (from token 0, all on disk) whose load beats its
        recompute; ``inf`` when loading never pays. Once reached, longer
        prefixes pay too: recompute is convex, the load cost linear."""
        per_token_load = self.bytes_per_token * (1.0 / self.load.disk_bytes_per_s + 1.0 / self.load.h2d_bytes_per_s)
        fixed = self.load.step_s + self.load.fixed_s + self.load.disk_step_s + queued_bytes / self.load.disk_bytes_per_s
        b = self.prefill.b - per_token_load
        c = self.prefill.c
        # Solve c*n^2 + b*n - fixed = 0 for its positive root.
        if c <= 0:
            return fixed / b if b > 0 else INF
        disc = b * b + 4 * c * fixed
        # The form below avoids cancellation when b >> 0.
        return (2 * fixed) / (b + math.sqrt(disc)) if b > 0 else (-b + math.sqrt(disc)) / (2 * c)
