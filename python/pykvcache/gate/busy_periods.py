"""The device's read speed from the periods it was busy reading
(:class:`DeviceBusyPeriods`; docs/gate.md, decision 0079).

A busy period starts when a read is submitted while none is outstanding and
ends when the last outstanding one ends: its bytes over its length are what
the device delivered while it had work, whoever asked for it, so a server
whose loads all came through the preloader still learns its device. A device
that is never idle would never end one, so a period is also cut once
``cut_bytes`` ended in it (a read still in flight at the cut may have moved
part of its bytes: an error of at most the reads in the kernel).

A period is returned only when one of its reads is timed by nothing else (a
plan times its own reads, ``timed_elsewhere``: counting them twice would let one
load swing the model). A period holding an exploration's sample is flagged:
it is that exploration's measurement (decision 0054).

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
