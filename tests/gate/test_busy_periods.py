"""The device's speed from its busy periods (decision 0079): pure arithmetic
on submit times and latencies."""

from __future__ import annotations

import pytest
from pykvcache.gate.busy_periods import DeviceBusyPeriods

MIB = 1 << 20


def test_a_period_runs_from_the_first_submit_while_idle_to_the_last_end():
    busy = DeviceBusyPeriods(cut_bytes=64 * MIB)
    # Three 2 MiB reads queued at once on a 100 MB/s device: they end 21,
    # 42 and 63 ms after the first submit, whatever order they are noticed in.
    for at in (10.0, 10.0, 10.001):
        busy.read_started(at)
    assert busy.read_ended(10.0, 0.042, 2 * MIB) is None
    assert busy.read_ended(10.0, 0.021, 2 * MIB) is None
    nbytes, seconds, start, sampled = busy.read_ended(10.001, 0.062, 2 * MIB)
    assert (nbytes, start, sampled) == (6 * MIB, 10.0, False)
    assert seconds == pytest.approx(0.063)
    assert busy.outstanding == 0 and busy.periods == 1


def test_idle_time_between_periods_is_not_counted():
    busy = DeviceBusyPeriods(cut_bytes=64 * MIB)
    busy.read_started(1.0)
    first = busy.read_ended(1.0, 0.02, 2 * MIB)
    busy.read_started(5.0)  # four seconds idle
    second = busy.read_ended(5.0, 0.02, 2 * MIB)
    assert first[:2] == (2 * MIB, pytest.approx(0.02))
    assert second[:2] == (2 * MIB, pytest.approx(0.02)) and second[2] == 5.0


def test_a_device_that_never_idles_is_cut_into_periods():
    """A saturated device (the preloader keeps 4 reads queued) still teaches the gate."""
    busy = DeviceBusyPeriods(cut_bytes=8 * MIB)
    chunk_s = 2 * MIB / 50e6  # a FIFO device at 50 MB/s: read i ends at (i + 1) * chunk_s
    started = {}
    for i in range(4):
        started[i] = 0.0
        busy.read_started(0.0)
    seen = []
    for i in range(12):
        end = (i + 1) * chunk_s
        period = busy.read_ended(started[i], end - started[i], 2 * MIB)
        if period is not None:
            seen.append(period)
        started[i + 4] = end  # the next read is queued as this one ends
        busy.read_started(end)
    assert busy.outstanding == 4
    assert len(seen) == 3, seen
    for nbytes, seconds, _, _ in seen:
        assert nbytes == 8 * MIB
        assert nbytes / seconds == pytest.approx(50e6, rel=1e-6)


def test_a_read_that_served_nothing_counts_its_time_not_bytes():
    busy = DeviceBusyPeriods(cut_bytes=64 * MIB)
    busy.read_started(0.0)
    busy.read_started(0.0)
    assert busy.read_ended(0.0, 0.5, 0) is None  # a miss after a stall
    nbytes, seconds, _, _ = busy.read_ended(0.0, 0.6, 2 * MIB)
    assert nbytes == 2 * MIB and seconds == pytest.approx(0.6)


def test_ends_without_a_start_are_ignored_and_clear_forgets():
    busy = DeviceBusyPeriods(cut_bytes=64 * MIB)
    assert busy.read_ended(0.0, 0.1, 2 * MIB) is None
    busy.read_started(1.0)
    busy.clear()
    assert busy.read_ended(1.0, 0.1, 2 * MIB) is None and busy.periods == 0
    with pytest.raises(ValueError):
        DeviceBusyPeriods(cut_bytes=0)


def test_a_period_of_reads_a_plan_already_times_teaches_nothing_twice():
    busy = DeviceBusyPeriods(cut_bytes=64 * MIB)
    busy.read_started(0.0)
    busy.read_started(0.0)
    assert busy.read_ended(0.0, 0.02, 2 * MIB, timed_elsewhere=True) is None
    assert busy.read_ended(0.0, 0.04, 2 * MIB, timed_elsewhere=True) is None
    # One preload in the next period is enough: the period is learnt, whole.
    busy.read_started(1.0)
    busy.read_started(1.0)
    assert busy.read_ended(1.0, 0.02, 2 * MIB, timed_elsewhere=True) is None
    assert busy.read_ended(1.0, 0.04, 2 * MIB)[:2] == (4 * MIB, pytest.approx(0.04))


def test_a_period_holding_a_sample_read_is_flagged_and_the_next_one_is_not():
    # A 16-chunk cut: the sample's period is cut with a demand read still
    # outstanding, which carries on into a period of its own.
    busy = DeviceBusyPeriods(cut_bytes=4 * MIB)
    for at in (0.0, 0.0, 0.01):
        busy.read_started(at)
    assert busy.read_ended(0.0, 0.08, 2 * MIB, timed_elsewhere=True) is None
    period = busy.read_ended(0.0, 0.16, 2 * MIB, sample=True)
    assert period[0] == 4 * MIB and period[3] is True
    after = busy.read_ended(0.01, 0.23, 2 * MIB)
    assert after[0] == 2 * MIB and after[3] is False
