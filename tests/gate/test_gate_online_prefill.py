"""Online prefill learning: the gate learns how fast this host computes.

Without a profile the default prior priced a 1k-token prefill at
milliseconds on a 2-core CPU where it takes seconds, and the gate recomputed
prefixes that loading served much faster.
"""

from __future__ import annotations

import pytest
from pykvcache.gate import (
    ChunkState,
    GateProfile,
    OnlinePrefillModel,
    PrefillCurve,
    ProfileExpectation,
    build_gate,
    hardware_id,
)

BPT = 12 * 1024  # KV bytes per token of a small model
CT = 64
BASE = PrefillCurve(0.0, 1e-5, 1e-9)


def _expect() -> ProfileExpectation:
    return ProfileExpectation(model="tiny-llama", dtype="torch.float32", kv_bytes_per_token=BPT, chunk_tokens=CT)


def _steps(truth: PrefillCurve, overhead: float, count: int):
    """(work, seconds) of steps prefilling prompts of several lengths."""
    sizes = [256, 1024, 512, 2048, 768]
    for i in range(count):
        n = sizes[i % len(sizes)]
        start = 64 * (i % 3)
        work = [(start, n), (4000, 1)]  # one prefill beside one decode
        yield work, overhead + sum(truth.compute_cost(s, s + k) for s, k in work)


def test_converges_to_the_observed_cost_despite_outliers():
    online = OnlinePrefillModel(BASE, calibrated=False)
    truth = PrefillCurve(0.0, BASE.b * 150, BASE.c * 150)  # a CPU 150x slower than the prior
    for i, (work, seconds) in enumerate(_steps(truth, overhead=0.004, count=32)):
        # Every fourth step stalled 10x (an idle gap, another process).
        assert online.observe(work, seconds * (10 if i % 4 == 3 else 1))
    assert online.scale == pytest.approx(150, rel=0.05)
    assert online.current().b == pytest.approx(truth.b, rel=0.05)
    assert online.trusted and online.samples == 32
    assert not online.observe([], 1.0) and not online.observe([(0, 64)], float("nan"))
    assert online.rejected == 2


def test_memory_is_bounded_and_the_estimate_follows_a_change():
    from pykvcache.gate.online import PREFILL_WINDOW

    online = OnlinePrefillModel(BASE, calibrated=False)
    for work, seconds in _steps(BASE, 0.0, 80):
        online.observe(work, seconds * 3)
    for work, seconds in _steps(BASE, 0.0, PREFILL_WINDOW):
        online.observe(work, seconds * 30)
    assert len(online._points) == PREFILL_WINDOW
    assert online.scale == pytest.approx(30, rel=0.05)


def test_a_profile_bounds_the_scale_and_is_trusted_from_the_start():
    online = OnlinePrefillModel(BASE, calibrated=True)
    assert online.trusted
    for work, seconds in _steps(BASE, 0.0, 10):
        online.observe(work, seconds * 1000)
    assert online.scale == 8.0


def _slow_disk(gate, bw=2e8):
    """The online load side under CPU contention learnt a slow disk."""
    for i in range(200):
        nbytes = (4 + 12 * (i % 2)) * CT * BPT
        gate.observe_load(nbytes, 0.001 + nbytes / bw)


def test_uncalibrated_gate_on_a_cpu_slow_host_stops_denying_loads():
    gate, source = build_gate(None, _expect(), steps=True)
    assert source.startswith("default:")
    _slow_disk(gate)
    prefix = [ChunkState.DISK] * 16  # 1k tokens: ~0.1 s to load, ~2 s to compute here
    first = gate.decide(prefix)
    assert first.load_chunks == 16 and first.reason == "uncalibrated"
    assert gate.gauges()["gate_prefill_observations"] == 0
    # The engine's steps show a 1k-token prefill taking ~2 s.
    cpu = PrefillCurve(0.0, 2e-3, 0.0)
    for work, seconds in _steps(cpu, overhead=0.01, count=8):
        assert gate.observe_prefill(work, seconds)
    assert not gate.uncalibrated
    d = gate.decide(prefix)
    assert d.load_chunks == 16 and d.reason == "load"
    assert d.est_recompute_s == pytest.approx(16 * CT * 2e-3, rel=0.1)
    assert d.est_recompute_s > 10 * d.est_load_s
    # Short prompts load too: even one chunk computes slower than it loads here.
    assert gate.decide([ChunkState.DISK] * 2).load_chunks == 2
    assert gate.gauges()["gate_prefill_scale"] > 50


def test_a_host_that_computes_faster_than_it_loads_still_recomputes_short_prompts():
    gate, _ = build_gate(None, _expect(), steps=True)
    fast = PrefillCurve(0.0, 2e-7, 5e-12)  # a GPU: 1k tokens in ~0.2 ms
    for work, seconds in _steps(fast, overhead=0.002, count=8):
        gate.observe_prefill(work, seconds)
    assert not gate.uncalibrated
    short = gate.decide([ChunkState.DISK] * 2)
    assert short.recompute and short.reason == "below_break_even"
    assert gate.decide([ChunkState.DISK] * 16).recompute


def test_a_profile_stays_authoritative_and_no_load_is_waved_through(tmp_path):
    profile = GateProfile(
        model="/models/tiny-llama",
        dtype="float32",
        block_size=32,
        chunk_tokens=CT,
        kv_bytes_per_token=4096.0,
        world_size=1,
        hardware=hardware_id(),
        storage={"dir": "/data", "device": "nvme0n1", "fstype": "ext4"},
        prefill={"a": 0.004, "b": 2e-5, "c": 1e-9, "points": []},
        load={"fixed_s": 0.0005, "disk_bytes_per_s": 2e9, "h2d_bytes_per_s": 2e10, "points": []},
        break_even_tokens=30.0,
        created="2025-01-01T00:00:00+00:00",
        pykvcache_version="0.1.0",
    )
    path = profile.save(tmp_path / "p.json")
    expect = ProfileExpectation(
        model=profile.model, dtype=profile.dtype, kv_bytes_per_token=profile.kv_bytes_per_token, chunk_tokens=profile.chunk_tokens
    )
    gate, source = build_gate(path, expect, steps=True)
    assert source == "profile" and not gate.uncalibrated
    be = gate.break_even_tokens()
    assert gate.decide([ChunkState.DISK]).recompute == (be > profile.chunk_tokens)
    assert gate.current_model().prefill == profile.cost_model().prefill
    # It was measured on this host through vLLM: steps do not move it.
    assert gate.prefill_online is None
    work, seconds = next(_steps(PrefillCurve(0.0, 1.0, 0.0), 0.0, 1))
    assert not gate.observe_prefill(work, seconds)
    assert gate.current_model().prefill == profile.cost_model().prefill


def test_without_online_refinement_the_static_default_still_gates():
    gate, _ = build_gate(None, _expect(), online=False)
    assert not gate.uncalibrated
    assert gate.decide([ChunkState.DISK] * 2).recompute


def test_without_a_step_source_the_default_prior_still_gates():
    # vLLM's tiering framework and the stock connector do not report steps.
    gate, _ = build_gate(None, _expect())
    assert not gate.uncalibrated
    assert gate.decide([ChunkState.DISK] * 2).recompute
