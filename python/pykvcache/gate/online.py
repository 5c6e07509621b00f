"""Online refinement of the cost model from what service shows: load times
(:class:`OnlineLoadModel`) and prefill times (:class:`OnlinePrefillModel`);
docs/gate.md, "Learning while serving".

Load side (decision 0079): each finished load is ``(bytes, seconds)``, the
bytes counting the I/O queued ahead of it. The last ``LOAD_WINDOW`` are the
device: a Theil-Sen line (fixed cost and bandwidth) when their sizes differ
enough, else their median throughput over the current fixed cost. Medians
ignore a stall or a page-cache hit, and a window follows a device that
changes within a few loads (an exponential average needed tens). The prior
counts as ``prior_weight`` observations (``build_gate`` gives 0: the first
lesson replaces it), and nothing bounds the estimate to it: a profile may
have timed another device (an 8x bound held 1426 MB/s on a disk capped at
0.26 MB/s).

Every lesson covers at least ``min_lesson_s`` of device time: shorter loads
are pooled and learnt as one, so a throttle's burst after an idle spell
(700 MB/s for one chunk on a disk capped at 25 MB/s) is averaged with the
throttled reads behind it. An exploration and a replayed saved window are
lessons in themselves. Each point remembers when it was observed, so what was
learnt while the storage was failing can be forgotten
(:meth:`OnlineLoadModel.forget_since`, decision 0054).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from pykvcache.gate.cost_model import LoadCost, PrefillCurve

#: What a lesson must cover of the device's time: the slice of Linux's
#: blk-throttle (io.max), within which a throttled disk serves at full speed.
MIN_LESSON_S = 0.1
#: Loads the device is fitted from: a few minutes of a long-prefix server's loads.
LOAD_WINDOW = 16
#: Engine steps the prefill scale is fitted from (bounded memory; a few stalled ones do not move it).
PREFILL_WINDOW = 32
#: Timed steps before a default prior's prefill side is trusted to deny a load.
MIN_PREFILL_STEPS = 4
#: How far a profile's prefill curve may move: it was measured on this host.
PROFILE_SCALE_BOUND = 8.0
#: How far the default prior's may move: it cannot tell a 2-core CPU from a GPU.
DEFAULT_SCALE_BOUND = 1e4


class OnlineLoadModel:
    def __init__(self, base: LoadCost, *, prior_weight: int = 2, min_lesson_s: float = 0.0) -> None:
        if prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0 (got {prior_weight})")
        if not (min_lesson_s >= 0 and math.isfinite(min_lesson_s)):
            raise ValueError(f"min_lesson_s must be finite and >= 0 (got {min_lesson_s})")
        self.base = base
        self.prior_weight = prior_weight
        self._fixed = base.fixed_s
        self._bw = base.disk_bytes_per_s
        # (bytes incl. queued, seconds, observed at (monotonic s))
        self._points: deque[tuple[float, float, float]] = deque(maxlen=LOAD_WINDOW)
        self.samples = 0
        self.rejected = 0
        self.forgotten = 0
        self.min_lesson_s = min_lesson_s
        self.pooled = 0  # observations pooled into the next lesson, not learnt yet
        self._pool_bytes = 0.0
        self._pool_s = 0.0
        self._pool_since = 0.0  # when the first of them was observed
        self._current = base

    @property
    def fixed_s(self) -> float:
        return self._fixed

    @property
    def disk_bytes_per_s(self) -> float:
        return self._bw

    def current(self) -> LoadCost:
        """The refined load cost (the same object until the next observation)."""
        return self._current

    @property
    def timed(self) -> bool:
        """Whether the estimate rests on a read of this device: a lesson in the
        window, or a read pooled into the next one. False at start and once
        every lesson was forgotten (an outage): the estimate is the prior's."""
        return bool(self._points) or self.pooled > 0

    def predict_s(self, disk_bytes: float, queued_bytes: float = 0.0) -> float:
        """What the current estimate says reading ``disk_bytes`` behind
        ``queued_bytes`` takes (the read alone, as :meth:`observe` times it)."""
        return self._fixed + (disk_bytes + queued_bytes) / self._bw

    def observe(
        self, disk_bytes: float, seconds: float, *, queued_bytes: float = 0.0, now: float | None = None, whole: bool = False
    ) -> None:
        """One finished load: ``disk_bytes`` read in ``seconds`` (first submit to
        last completion) with ``queued_bytes`` of I/O already ahead of it,
        finished at ``now`` (monotonic seconds; default: the current time).
        ``whole``: a lesson however short (an exploration sized to outlast a
        burst, or a load replayed from a saved window), never pooled."""
        if not (disk_bytes > 0 and seconds > 0 and math.isfinite(seconds) and queued_bytes >= 0 and math.isfinite(queued_bytes)):
            self.rejected += 1
            return
        now = time.monotonic() if now is None else now
        nbytes = disk_bytes + queued_bytes
        if not whole and self._pool_s + seconds < self.min_lesson_s:
            if not self.pooled:
                self._pool_since = now
            self._pool_bytes += nbytes
            self._pool_s += seconds
            self.pooled += 1
            return
        if not whole and self.pooled:
            # The pooled loads' mean: their throughput at a load's size (their
            # sum would look like one big load and skew the fixed cost's fit).
            n = self.pooled + 1
            nbytes, seconds = (nbytes + self._pool_bytes) / n, (seconds + self._pool_s) / n
            self._drop_pool()
        self._points.append((nbytes, seconds, now))
        self.samples += 1
        self._refit()

    def _drop_pool(self) -> None:
        self.pooled, self._pool_bytes, self._pool_s = 0, 0.0, 0.0

    def beyond_a_burst(self, nbytes: float) -> bool:
        """Whether ``nbytes`` is more than two lessons' worth at the current
        speed: an idle throttle's allowance (one slice) cannot have served it
        all, so its timing can tell a faster device from a burst."""
        return nbytes >= 2 * self._bw * self.min_lesson_s

    def window(self) -> list[tuple[float, float]]:
        """The loads the estimate is fitted from, oldest first: ``(bytes
        including the queue ahead, seconds)``."""
        return [(x, y) for x, y, _ in self._points]

    def forget_since(self, since: float) -> int:
        """Drops the loads observed at or after ``since`` (monotonic seconds) and
        fits the device from the others (the calibrated value once none is
        left); returns how many were dropped."""
        return self._keep(lambda t: t < since)

    def forget_before(self, since: float) -> int:
        """Drops the loads observed before ``since``: the device changed then."""
        return self._keep(lambda t: t >= since)

    def _keep(self, keep: Callable[[float], bool]) -> int:
        if self.pooled and not keep(self._pool_since):
            self._drop_pool()  # not learnt yet: not counted as forgotten
        kept = [p for p in self._points if keep(p[2])]
        dropped = len(self._points) - len(kept)
        if dropped:
            self._points.clear()
            self._points.extend(kept)
            self.forgotten += dropped
            if kept:
                # A fixed cost fitted with the dropped loads goes with them
                # (with one size left it is not refitted, only used).
                self._fixed = self.base.fixed_s
                self._refit()
            else:
                self._fixed, self._bw, self._current = self.base.fixed_s, self.base.disk_bytes_per_s, self.base
        return dropped

    def _refit(self) -> None:
        self._fixed, self._bw = self._fit()
        b = self.base
        self._current = LoadCost(self._fixed, self._bw, b.h2d_bytes_per_s, b.step_s, b.disk_step_s)

    def _fit(self) -> tuple[float, float]:
        """``(fixed_s, bytes_per_s)`` from the window (and the prior while it is short)."""
        pts = [(x, y) for x, y, _ in self._points]
        xs = [x for x, _ in pts]
        if len(pts) >= 3 and max(xs) >= 1.5 * min(xs):
            slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(pts) for x2, y2 in pts[i + 1 :] if x2 > 1.2 * x1 or x1 > 1.2 * x2]
            if slopes and (slope := statistics.median(slopes)) > 0:
                return max(0.0, statistics.median(y - slope * x for x, y in pts)), 1.0 / slope
        # One size (or no usable spread): the fixed cost cannot be separated,
        # so it stays what it is and each load gives a throughput. A load that
        # took less than the fixed cost (a page-cache hit) counts as fast, not
        # as infinitely fast.
        fixed = self._fixed
        rates = [x / max(y - fixed, 0.05 * y) for x, y in pts]
        rates += [self.base.disk_bytes_per_s] * max(0, self.prior_weight + 1 - len(pts))
        return fixed, statistics.median(rates)

    def state(self) -> dict[str, float]:
        return {
            "fixed_s": self._fixed,
            "disk_bytes_per_s": self._bw,
            "bandwidth_ratio": self._bw / self.base.disk_bytes_per_s,
            "samples": self.samples,
            "forgotten": self.forgotten,
            "pooled": self.pooled,
        }


class OnlinePrefillModel:
    """Online refinement of the prefill curve from timed engine steps (decision 0040).

    A default prior knows nothing of the host (on a 2-core CPU a 1k-token
    prefill takes seconds where it says milliseconds). Each observation is one
    engine step that mostly prefilled: its work (``(start, tokens)`` per
    request, priced by the prior) and its time, ``overhead + scale * priced``.
    ``scale`` is the Theil-Sen slope of the last ``PREFILL_WINDOW`` steps,
    robust to stalled steps and apart from the per-step overhead a recompute
    does not add; without spread in step sizes, their median ratio (biased
    towards loading).

    A profile's prior (``calibrated``) moves within ``PROFILE_SCALE_BOUND`` of
    itself, a default one within ``DEFAULT_SCALE_BOUND``. :attr:`trusted` is
    what the gate needs before it denies a load, once :attr:`fed` says that
    something times steps (PyKvCacheConnector does; elsewhere the prior decides).
    """

    def __init__(self, base: PrefillCurve, *, calibrated: bool) -> None:
        self.base = base
        self.calibrated = calibrated
        self.factor = PROFILE_SCALE_BOUND if calibrated else DEFAULT_SCALE_BOUND
        self._points: deque[tuple[float, float]] = deque(maxlen=PREFILL_WINDOW)  # (priced s, observed s)
        self.samples = 0
        self.rejected = 0
        self.scale = 1.0
        self.fed = False  # set once a step source is connected
        self._current = base

    @property
    def trusted(self) -> bool:
        """A profile, or enough steps observed on this host."""
        return self.calibrated or self.samples >= MIN_PREFILL_STEPS

    def current(self) -> PrefillCurve:
        """The refined curve (the same object until the scale changes)."""
        return self._current

    def priced(self, work: Iterable[tuple[int, int]]) -> float:
        return sum(self.base.compute_cost(start, start + n) for start, n in work)

    def observe(self, work: Sequence[tuple[int, int]], seconds: float) -> bool:
        """One step that computed ``work`` in ``seconds``; False when rejected."""
        priced = self.priced(work) if work else 0.0
        if not (priced > 0 and seconds > 0 and math.isfinite(seconds)):
            self.rejected += 1
            return False
        self._points.append((priced, seconds))
        self.samples += 1
        scale = self._fit()
        scale = min(self.factor, max(1.0 / self.factor, scale))
        if scale != self.scale:
            self.scale = scale
            b = self.base
            self._current = PrefillCurve(b.a * scale, b.b * scale, b.c * scale)
        return True

    def _fit(self) -> float:
        pts = self._points
        xs = [x for x, _ in pts]
        if len(pts) >= 3 and max(xs) >= 1.5 * min(xs):
            slopes = [
                (y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(pts) for x2, y2 in list(pts)[i + 1 :] if x2 > 1.2 * x1 or x1 > 1.2 * x2
            ]
            if slopes:
                slope = statistics.median(slopes)
                if slope > 0:
                    return slope
        return statistics.median(y / x for x, y in pts)

    def state(self) -> dict[str, float]:
        return {"scale": self.scale, "samples": self.samples, "rejected": self.rejected, "trusted": float(self.trusted)}
