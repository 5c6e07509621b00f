"""Which finished loads the gate may learn the device from, given the storage's
circuit breakers (docs/gate.md, "Outages"; decisions 0031, 0054).

A load timed while a directory was failing measures the failure, not the
device (after a GlusterFS partition healed, the first loads taught 20.7 MB/s
and the gate recomputed from then on). :class:`OutageFilter` follows the
breakers through ``BlockStore.breaker_health`` (counters: an outage that
opened and closed between two looks is still seen) and tells the gate to
forget the loads within ``lookback_s`` before an outage began, to learn
nothing while a breaker is open or half-open, and, after they close, to skip
a load that straddled the outage and the first ``SETTLE_LOADS`` after it (a
reconnecting filesystem refills its caches); exploration then starts over.
"""

from __future__ import annotations

#: Loads not learnt from after the breakers close: a reconnecting mount's first reads.
SETTLE_LOADS = 2


class OutageFilter:
    def __init__(self, *, lookback_s: float = 10.0) -> None:
        if lookback_s < 0:
            raise ValueError(f"need lookback_s >= 0 (got {lookback_s})")
        self.lookback_s = lookback_s
        self._seen: tuple[int, int] | None = None  # (opens, closes) at the last look
        self.down = False
        self.recovered_at = float("-inf")
        self._settle_left = 0
        self.outages = 0

    def update(self, opens: int, closes: int, open_dirs: int, now: float) -> tuple[bool, bool]:
        """The breakers' state at ``now``; returns ``(began, ended)``: an outage
        began since the last look (and possibly ended too), one ended."""
        seen = self._seen
        self._seen = (opens, closes)
        if seen is None or opens < seen[0] or closes < seen[1]:
            # First look, or a new store (the counters start over after a
            # wipe): what is open now is an outage whose start was not seen.
            began = open_dirs > 0 and not self.down
            self.down = open_dirs > 0
            if began:
                self.outages += 1
            return began, False
        began = not self.down and (opens > seen[0] or open_dirs > 0)
        down = open_dirs > 0
        ended = (self.down or began) and not down
        self.down = down
        if began:
            self.outages += 1
        if ended:
            self._settle_left = SETTLE_LOADS
            self.recovered_at = now
        return began, ended

    def learnable(self, started: float) -> bool:
        """Whether a load that started at ``started`` and finished now may be
        learnt from (consumes one of the loads ignored after a recovery)."""
        if self.down or started < self.recovered_at:
            return False
        if self._settle_left:
            self._settle_left -= 1
            return False
        return True
