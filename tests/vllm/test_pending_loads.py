"""Loads whose reads are in flight, polled without waiting (decision 0065).

The state machine alone, against a scripted ready-word pool and clock: when
a load copies, finishes and fails. The real pool, store and worker are in
test_vllm_in_flight_hits.py (reads stalled on a FUSE filesystem).
"""

from __future__ import annotations

from pykvcache.vllm.worker.pending_loads import WAIT_SLICE_S, PendingLoad, PendingLoads


class ScriptedPool:
    """Ready words whose verdicts the test sets; ``wait_ready`` must never wait."""

    def __init__(self) -> None:
        self.verdicts: dict[int, str] = {}
        self.timeouts: list[float] = []

    def wait_ready(self, slots, generations, timeout):
        self.timeouts.append(timeout)
        return [self.verdicts.get(s, "timed_out") for s in slots]


class Rig:
    def __init__(self, *, waves: bool = True) -> None:
        self.now = 0.0
        self.pool = ScriptedPool()
        self.copied: list[set[int]] = []
        self.finished: list[int] = []
        self.failed: list[tuple[int, str]] = []
        self.loads = PendingLoads(
            self.pool,
            finish=lambda load: self.finished.append(load.job_id),
            fail=lambda load, why: self.failed.append((load.job_id, why)),
            copy_wave=(lambda load, wave: self.copied.append(set(wave))) if waves else None,
            clock=lambda: self.now,
        )

    def add(self, job_id: int, staged: list[int], in_flight: list[int], wait_s: float = 1.0) -> None:
        slots = staged + in_flight
        self.loads.add(PendingLoad(job_id, None, slots, [(s, 7) for s in in_flight], wait_s, 0.0, ready=set(staged)))

    def step(self, at: float) -> None:
        self.now = at
        self.loads.poll()


def test_staged_chunks_are_copied_at_once_and_each_read_when_it_ends():
    rig = Rig()
    rig.add(1, staged=[0], in_flight=[1, 2])
    assert rig.copied == [{0}] and not rig.finished
    rig.pool.verdicts[2] = "ready"  # reads end in any order
    rig.step(0.1)
    assert rig.copied == [{0}, {2}] and not rig.finished
    rig.pool.verdicts[1] = "ready"
    rig.step(0.2)
    assert rig.copied == [{0}, {2}, {1}] and rig.finished == [1] and len(rig.loads) == 0
    assert set(rig.pool.timeouts) == {0.0}, "a poll never waits"


def test_a_slow_load_whose_reads_keep_ending_never_times_out():
    """The bound is on progress: a read ending within ``wait_s`` of the
    previous one, not the whole load within ``wait_s``."""
    rig = Rig()
    rig.add(1, staged=[], in_flight=[1, 2, 3], wait_s=1.0)
    for at, slot in ((0.8, 1), (1.6, 2), (2.4, 3)):
        rig.step(at - 0.01)
        rig.pool.verdicts[slot] = "ready"
        rig.step(at)
    assert rig.finished == [1] and rig.failed == []


def test_a_load_with_no_read_ending_within_the_bound_fails():
    rig = Rig()
    rig.add(1, staged=[0], in_flight=[1, 2], wait_s=1.0)
    rig.pool.verdicts[1] = "ready"
    rig.step(0.5)
    rig.step(1.4)
    assert rig.failed == []
    rig.step(1.5)  # 1.0 s after the last read ended
    assert [job for job, _ in rig.failed] == [1] and "slot 2" in rig.failed[0][1]
    assert rig.copied == [{0}, {1}], "the verified chunks are in their pages, the other never"
    assert rig.finished == [] and len(rig.loads) == 0


def test_a_failed_or_recycled_read_fails_the_load_at_the_next_poll():
    for verdict in ("failed", "recycled"):
        rig = Rig()
        rig.add(1, staged=[], in_flight=[1, 2])
        rig.pool.verdicts.update({1: "ready", 2: verdict})
        rig.step(0.1)
        assert rig.failed == [(1, f"slot 2: {verdict}")]
        assert rig.copied == [{1}] and rig.finished == []


def test_without_waves_nothing_is_copied_before_every_read_ended():
    """One batched copy (the CUDA order): ``finish`` does it."""
    rig = Rig(waves=False)
    rig.add(1, staged=[0], in_flight=[1])
    rig.step(0.1)
    assert rig.finished == [] and rig.copied == []
    rig.pool.verdicts[1] = "ready"
    rig.step(0.2)
    assert rig.finished == [1] and rig.copied == []


def test_loads_advance_independently():
    rig = Rig()
    rig.add(1, staged=[], in_flight=[1])
    rig.add(2, staged=[], in_flight=[2])
    rig.pool.verdicts[2] = "ready"
    rig.step(0.1)
    assert rig.finished == [2] and len(rig.loads) == 1
    assert [load.job_id for load in rig.loads.drop_all()] == [1]


def test_an_idle_step_returns_when_any_waited_read_ends():
    """``wait`` sleeps on the oldest read in slices and looks at every read a
    load waits for between them: reads in flight together end in any order,
    and one that ended behind the oldest is copied within a slice, not after
    the caller's whole bound (decision 0082). With nothing waited for it
    returns at once."""
    rig = Rig()
    rig.loads.wait(0.02)
    assert rig.pool.timeouts == [], "no load: no wait"
    rig.add(1, staged=[0], in_flight=[3, 4])
    rig.add(2, staged=[], in_flight=[5])
    calls = []
    real = rig.pool.wait_ready

    def sleeping(slots, gens, timeout):
        calls.append((list(slots), timeout))
        if len(calls) == 5:
            rig.pool.verdicts[5] = "ready"  # the other load's read ends, the oldest does not
        out = real(slots, gens, timeout)
        if all(v == "timed_out" for v in out):
            rig.now += timeout  # slept the whole timeout
        return out

    rig.pool.wait_ready = sleeping
    rig.loads.wait(0.02)
    assert rig.now < 0.005, f"slept {rig.now * 1000:.1f} ms of the 20 ms bound after a read ended"
    assert calls[0] == ([3], WAIT_SLICE_S) and calls[1] == ([3, 4, 5], 0.0), calls[:2]
    rig.step(rig.now)
    assert rig.copied[-1] == {5}


def test_an_idle_step_sleeps_at_most_its_bound():
    rig = Rig()
    rig.add(1, staged=[], in_flight=[3])
    real = rig.pool.wait_ready

    def sleeping(slots, gens, timeout):
        rig.now += timeout
        return real(slots, gens, timeout)

    rig.pool.wait_ready = sleeping
    rig.loads.wait(0.02)
    assert 0.02 <= rig.now < 0.021
