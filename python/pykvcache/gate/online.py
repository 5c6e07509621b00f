"""Online refinement of the load cost from observed load times.

The calibration measured an idle device. In service the SSD is shared with
stores, other requests' loads and possibly other processes, so every
completed load is compared with its prediction and the error is split
between the fixed cost and the bandwidth in proportion to how much of the
prediction each explained: a small read that ran slow mostly moves the
fixed cost, a large one mostly the bandwidth. Each update moves an estimate
by at most ``alpha`` of the way (an EWMA of the log, with each error
capped at 4x), and both stay within
``[1/max_factor, max_factor]`` of the calibrated value, so one outlier cannot
swing the gate and the model cannot drift arbitrarily far from what was
measured. A slower SSD lowers the bandwidth estimate, which raises the
break-even: longer prefixes are then needed before loading pays.
"""

from __future__ import annotations

import math

from pykvcache.gate.cost_model import LoadCost


class OnlineLoadModel:
    def __init__(self, base: LoadCost, *, alpha: float = 0.1, max_factor: float = 8.0,
                 min_fixed_s: float = 1e-3) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1] (got {alpha})")
        if not max_factor >= 1:
            raise ValueError(f"max_factor must be >= 1 (got {max_factor})")
        self.base = base
        self.alpha = alpha
        self.max_factor = max_factor
        # The calibration timed raw reads; in service a load also waits for a
        # scheduler step and the copy into KV pages. A calibrated fixed cost
        # of ~0 must not pin the upper bound at ~0, so it is at least
        # max_factor * min_fixed_s.
        self._fixed_floor = max(base.fixed_s, min_fixed_s)
        self._fixed = base.fixed_s
        self._bw = base.disk_bytes_per_s
        self.samples = 0
        self.rejected = 0
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

    def observe(self, disk_bytes: float, seconds: float, *, queued_bytes: float = 0.0) -> None:
        """One finished load: ``disk_bytes`` read in ``seconds`` (first submit to
        last completion) with ``queued_bytes`` of I/O already ahead of it."""
        if not (disk_bytes > 0 and seconds > 0 and math.isfinite(seconds)
                and queued_bytes >= 0 and math.isfinite(queued_bytes)):
            self.rejected += 1
            return
        transfer = (disk_bytes + queued_bytes) / self._bw
        predicted = self._fixed + transfer
        # Winsorised: a single stall (or a lucky cache hit) counts as at most
        # a 4x error, so it moves an estimate by at most 4**alpha.
        ratio = min(4.0, max(0.25, seconds / predicted))
        share = transfer / predicted  # how much of the prediction the bandwidth explained
        step_bw = self.alpha * share
        step_fixed = self.alpha * (1.0 - share)
        # Geometric steps: a 2x slower and a 2x faster observation cancel out.
        bw = self._bw * ratio ** (-step_bw)
        fixed = self._fixed * ratio ** step_fixed if self._fixed > 0 else (
            step_fixed * max(0.0, seconds - transfer)
        )
        lo_bw, hi_bw = self.base.disk_bytes_per_s / self.max_factor, self.base.disk_bytes_per_s * self.max_factor
        self._bw = min(hi_bw, max(lo_bw, bw))
        self._fixed = min(self._fixed_floor * self.max_factor,
                          max(self.base.fixed_s / self.max_factor, fixed))
        self.samples += 1
        self._current = LoadCost(self._fixed, self._bw, self.base.h2d_bytes_per_s, self.base.step_s,
                                 self.base.disk_step_s)

    def state(self) -> dict[str, float]:
        return {
            "fixed_s": self._fixed,
            "disk_bytes_per_s": self._bw,
            "bandwidth_ratio": self._bw / self.base.disk_bytes_per_s,
            "samples": self.samples,
        }
