"""Exploration: a gate that recomputes still samples a load now and then
(docs/gate.md, decision 0054).

The online load model learns only from loads, and a gate that recomputes
makes none: once it learnt a slow disk (a partition, a reconnecting network
filesystem: 92 s of recomputes after a GlusterFS reconnect), nothing would
teach it that the disk got fast again. :class:`Exploration` lets a request
whose learnt device recomputes, but whose calibrated one would load, load
anyway, at a bounded cost:

* **how often**: one per interval, ``MIN_INTERVAL_S`` doubling to
  ``MAX_INTERVAL_S`` while samples confirm the model; a sample ``SURPRISE``
  times faster than predicted explores again at once, and two in a row
  (:attr:`streak_since`) forget what was learnt before them;
* **how much**: the longest prefix whose estimated load is at most
  ``MAX_LOAD_RATIO`` times its recompute (at least one disk chunk).

A breaker that closes (:meth:`reset`) starts the interval over. Where the
caller can read without a request (the standalone manager), the explored
request recomputes and the sample is read in the background, sized to
outlast a throttle's burst (``min_sample_s``, at most ``MAX_SAMPLE_CHUNKS``).
"""

from __future__ import annotations

import time

#: The interval after an exploration that confirmed the model: one explored request per 5 s at most.
MIN_INTERVAL_S = 5.0
#: Where the doubling stops: a disk that got fast again is sampled within 30 s.
MAX_INTERVAL_S = 30.0
#: A sample this many times faster than predicted says the model is stale.
SURPRISE = 2.0
#: An explored prefix may cost at most this many times its recompute, as the model prices it.
MAX_LOAD_RATIO = 2.0
#: A background sample's disk chunks at most (with ``min_sample_s``): bounded staging use.
MAX_SAMPLE_CHUNKS = 16


class Exploration:
    def __init__(self, *, min_sample_s: float = 0.5) -> None:
        if not min_sample_s >= 0:
            raise ValueError(f"need min_sample_s >= 0 (got {min_sample_s})")
        self.min_sample_s = min_sample_s
        self.interval_s = MIN_INTERVAL_S
        # The first recompute of a loadable prefix may explore at once: nothing
        # was sampled before it.
        self._next_at = float("-inf")
        self.explored = 0
        self.surprises = 0
        self.streak = 0  # surprising samples in a row
        self.streak_since = 0.0  # when the first of them finished

    @staticmethod
    def now() -> float:
        return time.monotonic()

    def due(self, now: float) -> bool:
        """Whether a request the gate would recompute (with a chunk on disk) explores."""
        return now >= self._next_at

    def started(self, now: float) -> None:
        """A request explores: the next one waits at least the current interval."""
        self.explored += 1
        self._next_at = now + self.interval_s

    def sampled(self, predicted_s: float, observed_s: float, now: float) -> bool:
        """An explored load finished at ``now`` in ``observed_s`` where the
        model (before learning from it) predicted ``predicted_s``; returns
        whether this sample and the one before both were surprising (the
        device changed at :attr:`streak_since`)."""
        if observed_s * SURPRISE <= predicted_s:
            # Stale model: sample again with the next eligible request.
            self.surprises += 1
            if self.streak == 0:
                self.streak_since = now
            self.streak += 1
            self.interval_s = MIN_INTERVAL_S
            self._next_at = now
            return self.streak >= 2
        self.streak = 0
        self.interval_s = min(MAX_INTERVAL_S, self.interval_s * 2)
        self._next_at = max(self._next_at, now + self.interval_s)
        return False

    def reset(self, now: float) -> None:
        """The storage came back from an outage: explore with the next eligible request."""
        self.interval_s = MIN_INTERVAL_S
        self.streak = 0
        self._next_at = now

    def state(self) -> dict[str, float]:
        return {"interval_s": self.interval_s, "explored": self.explored, "surprises": self.surprises}
