"""Online refinement of the cost model: load times (:class:`OnlineLoadModel`)
and prefill times (:class:`OnlinePrefillModel`) observed in service.

Load side: the calibration measured an idle device. In service the SSD is
shared with stores, other requests' loads and possibly other processes (or
it is slower than calibrated). Every completed load is an observation of
``(bytes, seconds)`` where the bytes include the I/O already queued ahead of
it; :class:`OnlineLoadModel` keeps the last ``LOAD_WINDOW`` of them and fits the
device from those alone: a Theil-Sen line (fixed cost and bandwidth) when
the loads' sizes differ enough, else the median throughput of the loads over
the current fixed cost. Medians make a single stall or a lucky page-cache
hit irrelevant, and the window makes the model follow a device whose speed
changes, within a few loads: an exponential average with a small step
(what this was before) needed tens of loads to move, and a serving engine
with long prefixes sees only a few loads a minute (a server whose reads were
capped at 200 MB/s still believed 478-1159 MB/s after a run). The
prior first counts as ``prior_weight`` observations, one fewer with each load
seen (``build_gate`` gives every prior 0: the first lesson replaces it).
Nothing bounds the estimates to the prior: a profile may have timed another
device, or this one before a throttle, a cloud volume's spent burst credits or
a replacement (an 8x bound held a profile's 1426 MB/s at 178 MB/s or more on a
disk capped at 0.26 MB/s, where a chunk costs more than its recompute). A slower
SSD lowers the bandwidth estimate, which raises the break-even: longer
prefixes are then needed before loading pays.

Every lesson covers at least ``min_lesson_s`` of the device's time
(decision 0079): shorter observations are pooled until their seconds add up
to it, and learnt as one load, their mean. A disk behind a throttle (a
cgroup's io.max, a cloud volume's burst credits) serves the first reads after
an idle spell at full speed: on a disk capped at 25 MB/s a fresh server's
first busy period was one chunk, 2.1 MB in 2-4 ms (700 MB/s), and so was a
later one. A throttle's slice is 0.1 s; pooled past it, a burst is averaged
with the throttled reads after it. A fast device's loads are pooled too, and
their mean is its speed. An exploration (sized to outlast a burst, decision
0054) and a load replayed from a saved window are lessons in themselves.
A default prior knows nothing of the device and gives way to the first
lesson (``prior_weight`` 0).

Each point remembers when it was observed, so that what was learnt while the
storage was failing can be forgotten (:meth:`OnlineLoadModel.forget_since`,
decision 0054): loads that ended just before a circuit breaker opened timed a
dying link, not the device.
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
    """Online refinement of the prefill curve from timed engine steps.

    The load side is refined from timed reads; without this, the prefill side
    would be only what the profile (or, without one, a default prior) says. A
    default prior knows nothing of the host: on a 2-core CPU a 1k-token
    prefill takes seconds where the prior says milliseconds, and the gate then
    recomputes prefixes that loading would serve many times faster.

    Each observation is one engine step that mostly prefilled: the work it did
    (``(start, tokens)`` per scheduled request, decodes included as one token
    at their position) and how long it took. The prior prices that work; the
    step time is ``overhead + scale * priced``. The last ``PREFILL_WINDOW`` steps are
    kept (bounded memory) and ``scale`` is their Theil-Sen slope (the median of
    pairwise slopes: robust to a few stalled or idle-inflated steps, and it
    separates the per-step overhead, which recomputing a prefix does not add,
    from the per-token cost, which it does). Without enough spread in step
    sizes the slope is not identifiable and the median ratio (through the
    origin, i.e. overhead counted as compute: biased towards loading) is used.
    CPU contention slows compute and reads alike, which the ratio the gate
    compares is insensitive to.

    ``calibrated`` says whether the prior was measured on this host (a gate
    profile): its scale stays within ``PROFILE_SCALE_BOUND`` of 1 either way; a
    default prior may be off by orders of magnitude and gets ``DEFAULT_SCALE_BOUND``.
    :attr:`trusted` is what the gate needs before it denies a load, and only
    once :attr:`fed` says that something times steps (PyKvCacheConnector
    does; vLLM's tiering framework and the stock connector do not, and there
    the gate keeps its prior as before).
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
