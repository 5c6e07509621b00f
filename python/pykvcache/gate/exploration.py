"""Exploration: a gate that recomputes still samples a load now and then.

The online load model learns only from loads, and a gate that chose to
recompute makes none: once it has learnt a slow disk (a busy device, a network
filesystem reconnecting after a partition) nothing can teach it that the disk
got fast again. Measured on the two-node GlusterFS fixture: the
first loads after a reconnect taught the gate 20.7 MB/s, and it recomputed
every lookup for the next 92 s and more (84 decisions, 0 disk reads).

:class:`Exploration` decides when such a gate loads anyway. The gate asks
only for a request whose decision reads nothing from disk although a chunk is
there, and whose prefix the calibrated (or default) device would have loaded:
the learnt device is why it recomputes (``AdmissionGate.decide``). Its cost
is bounded twice:

* **how often**: one explored request per interval, which starts at
  ``MIN_INTERVAL_S`` and doubles (up to ``MAX_INTERVAL_S``) each time a sample
  confirms what the model predicted. A sample well faster than predicted (by
  ``SURPRISE``) says the model is stale: the next eligible request explores
  again at once. Two surprising samples in a row (:attr:`streak_since`) say
  the device changed: the gate then forgets what it learnt before the first
  of them (two loads that agree move the model, as after calibration; one
  lucky page-cache hit does not), so a disk that got fast is loaded from
  again after two explored requests, not after a window of them;
* **how much**: the explored prefix is the longest whose estimated load is at
  most ``MAX_LOAD_RATIO`` times its estimated recompute (at least the first
  chunk that must come from disk: one read is the smallest sample). Where the
  model is right, an exploration costs at most ``MAX_LOAD_RATIO - 1`` times
  the recompute of what it loads; where it is stale (the disk is faster than
  believed) it costs less, or saves time.

A circuit breaker that closes again (:meth:`reset`) says the device may now
be anything: the interval starts over and the next eligible request explores.

**In the background** (where the caller can read without a request, the
standalone manager; decision 0054) the explored request does not load at
all: it recomputes, and the gate reads a sample of its prefix's disk chunks
at preload priority, which no request waits for. At 25 MB/s an exploration
in the request itself queued its one-chunk sample behind 36 MB of demand
reads: 1.6 s to save 19 ms, the slowest request of most runs (decision
0054). The sample is timed by the device's busy period that holds it (its
own latency includes its wait behind demand reads submitted after it), and
is sized to outlast a throttle's or cache's burst: its disk chunks until
their estimated read at the learnt speed reaches ``min_sample_s`` (at most
``MAX_SAMPLE_CHUNKS``, within the loadable prefix). On an idle device whose
reads are capped at 25 MB/s, a lone 2 MB read is served from the cgroup
throttle's 100 ms slice allowance at the disk's full speed: a one-chunk
sample there was "surprising" every time and made the gate forget a window
that was right.
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
