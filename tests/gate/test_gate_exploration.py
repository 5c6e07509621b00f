"""Exploration (a recomputing gate samples loads) and forgetting (decision 0054)."""

from __future__ import annotations

import pytest
from pykvcache.gate import (
    AdmissionGate,
    ChunkState,
    CostModel,
    Exploration,
    LoadCost,
    OnlineLoadModel,
    OutageFilter,
    PrefillCurve,
)

CT = 64
BPT = 12 * 1024
CHUNK = CT * BPT
PREFILL = PrefillCurve(0.0, 2e-4, 0.0)  # 0.2 ms per token: 12.8 ms per chunk
# As calibrated: 20 ms per load, 1 GB/s. One chunk is not worth a load (20.8
# ms against 12.8 ms of prefill), two are.
BASE = LoadCost(0.02, 1e9)


def _gate() -> AdmissionGate:
    model = CostModel(PREFILL, BASE, BPT)
    return AdmissionGate(model, chunk_tokens=CT, online=OnlineLoadModel(BASE), exploration=Exploration())


def _learn(gate, bytes_per_s, n=6, at=0.0):
    for i in range(n):
        gate.observe_load(14 * CHUNK, 0.02 + 14 * CHUNK / bytes_per_s, now=at + i)


def test_the_interval_doubles_while_samples_confirm_the_model_and_restarts_on_a_surprise_or_a_recovery():
    ex = Exploration()  # 5 s, doubling up to 30 s
    assert ex.due(0.0)
    ex.started(0.0)
    assert not ex.due(4.9) and ex.due(5.0)
    assert ex.sampled(predicted_s=1.0, observed_s=0.9, now=1.0) is False  # as predicted
    assert not ex.due(10.9) and ex.due(11.0)  # 10 s after that sample
    for t in (11.0, 40.0, 100.0):
        ex.started(t)
        ex.sampled(1.0, 1.0, t)
    assert ex.interval_s == 30  # bounded
    assert not ex.due(129.0) and ex.due(130.0)
    ex.started(130.0)
    assert ex.sampled(1.0, 0.4, 130.5) is False  # one surprise: explore again at once
    assert ex.due(130.5) and ex.interval_s == 5
    ex.started(131.0)
    assert ex.sampled(1.0, 0.3, 131.5) is True  # two in a row: the device changed
    assert ex.streak_since == 130.5
    ex.started(132.0)
    ex.reset(133.0)  # a breaker closed
    assert ex.due(133.0) and ex.streak == 0


def test_a_fresh_gate_or_one_whose_learnt_device_is_not_why_it_recomputes_never_explores():
    gate = _gate()
    # Nothing learnt: the same decisions as without exploration.
    assert gate.decide([ChunkState.DISK] * 1, now=0.0).reason == "below_break_even"
    # Learnt as fast as calibrated: a prefix the calibrated device would not
    # load either is recomputed, however often it is asked.
    _learn(gate, 1e9)
    for t in range(100):
        assert gate.decide([ChunkState.DISK] * 1, now=float(t)).reason == "below_break_even"
    assert gate.exploration.explored == 0


def test_a_gate_that_learnt_a_slow_disk_explores_a_bounded_prefix_and_counts_it():
    gate = _gate()
    _learn(gate, 20e6)
    states = [ChunkState.STAGED] * 2 + [ChunkState.DISK] * 12
    d = gate.decide(states, now=100.0)
    assert d.reason == "explore"
    # The staged chunks and a few reads: a bounded sample, whose estimated
    # load is within twice its recompute (the whole prefix is not).
    assert d.staged_chunks == 2 and 1 <= d.disk_chunks < 12
    assert d.est_recompute_s < d.est_load_s <= 2 * d.est_recompute_s
    # A second later: not due; the staged chunks alone (a copy) are loaded.
    again = gate.decide(states, now=101.0)
    assert again.reason == "load" and (again.load_chunks, again.disk_chunks) == (2, 0)
    counters = gate.take_counters()
    assert counters["gate_decisions_explore"] == 1 and counters["gate_decisions_load"] == 1
    assert counters["gate_tokens_loaded"] == (d.load_chunks + 2) * CT
    assert counters["gate_est_lost_ms"] == pytest.approx((d.est_load_s - d.est_recompute_s) * 1e3)
    # Preloads never explore (a separate gate, no exploration policy).
    preload = AdmissionGate(gate.model, chunk_tokens=CT, online=gate.online)
    assert preload.decide(states, now=1e6).disk_chunks == 0


def test_two_explored_loads_faster_than_predicted_forget_the_slow_window():
    gate = _gate()
    _learn(gate, 20e6, n=16)
    assert gate.decide([ChunkState.DISK] * 14, now=100.0).reason == "explore"
    gate.observe_load(CHUNK, 0.021, now=100.5, explored=True)  # one fast sample: not enough
    assert gate.online.disk_bytes_per_s < 30e6
    d = gate.decide([ChunkState.DISK] * 14, now=101.0)
    assert d.reason == "explore", "a surprising sample: explore again at once"
    gate.observe_load(d.load_chunks * CHUNK, 0.02 + d.load_chunks * CHUNK / 1e9, now=101.5, explored=True)
    # The window holds 16: the 14 slow loads still in it beside the two samples.
    assert gate.take_counters()["gate_loads_forgotten"] == 14
    d = gate.decide([ChunkState.DISK] * 14, now=102.0)
    assert d.reason == "load" and d.load_chunks == 14


def test_forgetting_keeps_the_loads_outside_the_interval_and_falls_back_to_the_calibration():
    m = OnlineLoadModel(BASE)
    for t in range(4):
        m.observe(14 * CHUNK, 0.02 + 14 * CHUNK / 500e6, now=float(t))
    for t in range(10, 16):
        m.observe(14 * CHUNK, 0.02 + 14 * CHUNK / 20e6, now=float(t))
    assert m.disk_bytes_per_s == pytest.approx(20e6, rel=0.01)
    assert m.forget_since(10.0) == 6
    assert m.disk_bytes_per_s == pytest.approx(500e6, rel=0.01)
    assert m.forget_before(100.0) == 4 and m.forgotten == 10
    assert m.current() is BASE
    assert m.predict_s(1e9) == pytest.approx(0.02 + 1.0)


def test_the_outage_filter_sees_outages_through_counters_even_between_looks():
    f = OutageFilter(lookback_s=10)
    assert f.update(0, 0, 0, now=0.0) == (False, False)
    assert f.learnable(started=0.0)
    assert f.update(1, 0, 1, now=5.0) == (True, False)
    assert not f.learnable(started=5.0)
    assert f.update(1, 0, 1, now=6.0) == (False, False)  # still open (or half-open)
    assert f.update(1, 1, 0, now=9.0) == (False, True)
    assert not f.learnable(started=8.0), "started before the close was seen"
    assert [f.learnable(started=9.5) for _ in range(3)] == [False, False, True]
    # Opened and closed between two looks: both at once.
    assert f.update(2, 2, 0, now=20.0) == (True, True)
    # A new store (after a wipe): counters start over, nothing is an outage.
    assert f.update(0, 0, 0, now=30.0) == (False, False)
    assert f.outages == 2
