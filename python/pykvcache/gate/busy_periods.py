"""The device's read speed from the periods it was busy reading
(:class:`DeviceBusyPeriods`, decision 0079).

The gate learns the device from timed loads: a request's reads from the
moment its plan was made (``vllm/scheduler/gate_plan.py``). A load that the preloader
started (lookahead: the chunks are being read when the request's lookup comes)
is not such a load, and with lookahead on every load can be one: in the 8k
long-context benchmark with reads capped at 50 MB/s the gate observed no load
in a whole run and kept its prior of 1000 MB/s, so it loaded every prefix of
a disk 20x slower than it believed.

Every read, demand or preload, tells how busy the device was. A busy period
starts when a read is submitted while none is outstanding and ends when the
last outstanding one ends; its bytes over its length are what the device
delivered while it had work, whoever asked for it. A device that is never
idle (a saturated one, exactly where the speed matters) would never end a
period, so a period is also cut once it has ``cut_bytes`` behind it: the
device was busy from the period's start to the latest end seen, and the bytes
of the reads that ended by then were served in it (a read still outstanding
may have moved part of its bytes before the cut: an error of at most the
reads in flight in the kernel, small against ``cut_bytes``).

A read a request's plan already times (``timed_elsewhere``) is counted in
its period but does not make one worth learning from: a period of demand
loads alone would teach the gate each of those loads twice (and one load
alone must not swing it, ``OnlineLoadModel.prior_weight``). A period is
returned only when at least one of its reads was timed by nothing else: a
preload, or a read whose plan stopped timing it.

A period that holds a read the gate started to sample the device
(``sample``: an exploration read in the background, decision 0054) is
returned flagged: it is the exploration's measurement. Timing the sample
alone would time its wait in the background queue, behind every demand read
submitted after it; its period times what the device delivered meanwhile,
which is the sustained service the gate prices (a lone read on an idle
throttled device sees the throttle's burst, not its rate: the sample is
sized to outlast it, ``Exploration.min_sample_s``).

Pure arithmetic on times the caller gives: no clock, no I/O.
"""

from __future__ import annotations


class DeviceBusyPeriods:
    def __init__(self, *, cut_bytes: int) -> None:
        if cut_bytes <= 0:
            raise ValueError(f"cut_bytes must be > 0 (got {cut_bytes})")
        self.cut_bytes = cut_bytes
        self.outstanding = 0
        self._start = 0.0  # the period's start (monotonic s)
        self._end = 0.0  # the latest end of a read of the period
        self._bytes = 0
        self._untimed = False  # a read of this period that no plan times
        self._sampled = False  # a read of this period sampled the device for the gate
        self.periods = 0

    def read_started(self, at: float) -> None:
        """A read was submitted at ``at``."""
        if self.outstanding == 0:
            self._start, self._end, self._bytes = at, at, 0
        self.outstanding += 1

    def read_ended(
        self, started_at: float, seconds: float, nbytes: int, *, timed_elsewhere: bool = False, sample: bool = False
    ) -> tuple[int, float, float, bool] | None:
        """The read submitted at ``started_at`` ended after ``seconds`` having
        served ``nbytes`` (0 for a read that served nothing); ``sample``: the
        gate started it to sample the device. Returns ``(bytes, seconds,
        started_at, sampled)`` of a busy period that ended or was cut here and
        holds a read not ``timed_elsewhere``, or None; ``sampled``: one of its
        reads was a sample."""
        if self.outstanding <= 0:
            return None  # started before this tracker (or counted twice): nothing to time
        self.outstanding -= 1
        self._end = max(self._end, started_at + max(0.0, seconds))
        self._bytes += max(0, nbytes)
        self._untimed |= not timed_elsewhere
        self._sampled |= sample
        if self.outstanding and self._bytes < self.cut_bytes:
            return None
        period = (self._bytes, self._end - self._start, self._start, self._sampled)
        untimed = self._untimed
        # A cut: the reads still outstanding continue a new period from here.
        self._start, self._bytes, self._untimed, self._sampled = self._end, 0, False, False
        if period[0] <= 0 or period[1] <= 0 or not untimed:
            return None
        self.periods += 1
        return period

    def clear(self) -> None:
        """Forget the period (the store was replaced: its reads end elsewhere)."""
        self.outstanding = 0
        self._bytes = 0
        self._untimed = False
        self._sampled = False
