"""A device the gate has not timed yet costs a request no wait.

A profile may come from another device (or from this one before a throttle):
on its first contact with a disk capped at 0.26 MB/s, a gate with a fast
device's profile committed its first requests to reads of up to 24 chunks, each of
which waited for the I/O deadline before it was recomputed (2026-12-06,
2-core VM). Until a read of
the device is timed, a request loads only what is staged and its first chunk
on disk is read in the background.
"""

from __future__ import annotations

from pykvcache.gate import AdmissionGate, ChunkState, CostModel, LoadCost, OnlineLoadModel, PrefillCurve

S, D = ChunkState.STAGED, ChunkState.DISK
CT = 64
BPT = 32 * 1024  # the serving benchmark's model: a 2 MiB chunk
CHUNK = CT * BPT
PROFILED = LoadCost(0.0, 1426e6, 4.7e9)  # the fast disk's profile
PREFILL = PrefillCurve(0.0, 6.5e-4, 0.0)  # ~1 s for a 1.5k-token prefix (a 2-core CPU)


def _gate(**kw) -> AdmissionGate:
    return AdmissionGate(
        CostModel(PREFILL, PROFILED, BPT), chunk_tokens=CT, online=OnlineLoadModel(PROFILED, prior_weight=0, min_lesson_s=0.1), **kw
    )


def test_before_a_read_is_timed_a_request_waits_for_no_disk_read_and_one_read_ends_that():
    gate = _gate()
    states = [S, S] + [D] * 22
    d = gate.decide(states, sample_in_background=True)
    assert (d.load_chunks, d.disk_chunks, d.sample_chunks, d.reason) == (2, 0, 3, "untimed")
    assert d.est_load_s > 0
    # Where nothing reads in the background (vLLM's tiering framework): the prior decides.
    d = gate.decide(states)
    assert (d.load_chunks, d.disk_chunks, d.sample_chunks, d.reason) == (24, 22, 0, "load")
    # Nothing staged: the request recomputes while its first chunk is read for the gate.
    d = gate.decide([D] * 24, sample_in_background=True)
    assert (d.load_chunks, d.sample_chunks, d.reason) == (0, 1, "untimed")
    totals = gate.take_counters()
    assert "gate_decisions_explore" not in totals and totals["gate_decisions_recompute"] == 1
    # A choice that reads nothing from the disk, and a disabled gate, are as before.
    d = gate.decide([S] * 3 + [ChunkState.MISSING, D], sample_in_background=True)
    assert (d.load_chunks, d.sample_chunks, d.reason) == (3, 0, "load")
    d = _gate(enabled=False).decide([D] * 24, sample_in_background=True)
    assert (d.load_chunks, d.sample_chunks, d.reason) == (24, 0, "gate_disabled")
    # One read at the profile's speed (pooled: shorter than a lesson) times the device.
    gate.observe_load(CHUNK, 0.002)
    assert gate.online.timed and gate.online.samples == 0
    d = gate.decide([S, S] + [D] * 22, sample_in_background=True)
    assert (d.load_chunks, d.sample_chunks, d.reason) == (24, 0, "load")


def test_a_gate_that_forgot_every_lesson_times_the_device_again():
    gate = _gate()
    gate.observe_load(CHUNK, 8.0, now=10.0)  # 0.26 MB/s
    assert gate.online.timed
    assert gate.decide([D] * 24, sample_in_background=True).reason == "below_break_even"
    gate.storage_outage(True, False, now=11.0, lookback_s=10.0)  # a breaker opened: the lesson goes
    assert not gate.online.timed
    d = gate.decide([D] * 24, sample_in_background=True)
    assert (d.load_chunks, d.sample_chunks, d.reason) == (0, 1, "untimed")
