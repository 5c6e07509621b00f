"""What a lesson of the gate's device model is (decision 0079).

Every lesson covers a throttle's slice (0.1 s) of the device's time, because
a throttled disk serves the first reads after an idle spell at full speed: a
server on a disk capped at 25 MB/s learnt one chunk read in 2-3 ms, as its
first lesson and again as a later one. The default prior
(1 GB/s) knows nothing of the device and gives way to the first lesson.
"""

from __future__ import annotations

import pytest
from pykvcache.gate import (
    MIN_LESSON_S,
    GateProfile,
    LoadCost,
    OnlineLoadModel,
    ProfileExpectation,
    build_gate,
    device_memory,
    hardware_id,
)

BPT = 12 * 1024
CT = 64
PRIOR = LoadCost(0.0, 1e9, 10e9)
CHUNK = 2_100_000  # bytes: one chunk of the serving benchmark's model


def _expect() -> ProfileExpectation:
    return ProfileExpectation(model="tiny-llama", dtype="torch.float32", kv_bytes_per_token=BPT, chunk_tokens=CT)


def test_a_burst_served_read_alone_teaches_nothing_and_is_averaged_with_the_throttled_reads_after_it():
    online = OnlineLoadModel(PRIOR, prior_weight=0, min_lesson_s=MIN_LESSON_S)
    online.observe(CHUNK, 0.003)  # from the throttle's slice allowance: 700 MB/s
    assert online.samples == 0 and online.pooled == 1
    assert online.disk_bytes_per_s == PRIOR.disk_bytes_per_s
    online.observe(2 * CHUNK, 2 * CHUNK / 25e6)  # then the cap: 25 MB/s
    assert online.samples == 1 and online.pooled == 0
    # Three chunks in 0.171 s: 37 MB/s, where the burst alone said 700.
    assert online.disk_bytes_per_s == pytest.approx(3 * CHUNK / (0.003 + 2 * CHUNK / 25e6))
    assert online.disk_bytes_per_s < 40e6
    # A burst after an idle spell later on is pooled as well.
    online.observe(CHUNK, 0.003)
    assert online.samples == 1 and online.disk_bytes_per_s < 40e6
    online.observe(4 * CHUNK, 4 * CHUNK / 25e6)
    assert online.samples == 2 and online.disk_bytes_per_s < 40e6


def test_a_fast_device_is_learnt_once_its_loads_cover_the_slice_at_its_own_speed():
    online = OnlineLoadModel(PRIOR, prior_weight=0, min_lesson_s=MIN_LESSON_S)
    load = 16 * CHUNK  # 33.6 MB in 11.2 ms at 3 GB/s
    loads = 0
    while not online.samples:
        online.observe(load, load / 3e9)
        loads += 1
    assert loads == 9  # the first nine loads' 0.101 s
    assert online.disk_bytes_per_s == pytest.approx(3e9)
    # Learnt as one load of the loads' mean size, not as their sum: a line
    # fitted later still sees loads of this size.
    assert online.window() == [pytest.approx((load, load / 3e9))]


def test_a_fast_device_that_slows_down_is_followed_lesson_by_lesson():
    online = OnlineLoadModel(PRIOR, prior_weight=0, min_lesson_s=MIN_LESSON_S)
    load = 16 * CHUNK
    for _ in range(90):
        online.observe(load, load / 3e9)  # 11.2 ms: nine loads a lesson
    assert online.samples == 10 and online.disk_bytes_per_s == pytest.approx(3e9)
    for _ in range(3 * 16):
        online.observe(load, load / 1e9)  # 33.6 ms: three loads a lesson
    assert online.samples == 26 and online.disk_bytes_per_s == pytest.approx(1e9)


def test_a_requests_exploration_is_a_lesson_in_itself_and_a_forgotten_spell_takes_its_pool_along():
    gate, _ = build_gate(None, _expect())
    online = gate.online
    gate.observe_load(8 * CHUNK, 8 * CHUNK / 25e6, now=10.0)  # learnt: 25 MB/s
    gate.observe_load(CHUNK, 0.002, now=11.0)  # a burst: pooled
    assert online.samples == 1 and online.pooled == 1
    # A breaker opened at 10.5 s: what was observed since timed a dying link.
    online.forget_since(10.5)
    assert online.pooled == 0 and online.samples == 1 and online.forgotten == 0
    gate.observe_load(CHUNK, 0.002, now=12.0, explored=True)  # sized to outlast a burst (0054)
    assert online.samples == 2 and online.pooled == 0


def test_a_saved_window_is_replayed_as_it_was_learnt(tmp_path):
    before = OnlineLoadModel(PRIOR)
    for _ in range(3):
        before.observe(CHUNK, 0.004)  # 525 MB/s, each well under the slice
    path = tmp_path / device_memory.FILE_NAME
    assert device_memory.save(path, before)
    after = OnlineLoadModel(PRIOR, prior_weight=0, min_lesson_s=MIN_LESSON_S)
    assert device_memory.restore(path, after) == (3, None)
    assert after.pooled == 0 and after.disk_bytes_per_s == pytest.approx(CHUNK / 0.004)


def _profile(tmp_path, disk_bytes_per_s: float):
    profile = GateProfile(
        model="/models/tiny-llama",
        dtype="float32",
        block_size=32,
        chunk_tokens=CT,
        kv_bytes_per_token=BPT,
        world_size=1,
        hardware=hardware_id(),
        storage={"dir": "/data", "device": "nvme0n1", "fstype": "ext4"},
        prefill={"a": 0.004, "b": 2e-5, "c": 1e-9, "points": []},
        load={"fixed_s": 0.0, "disk_bytes_per_s": disk_bytes_per_s, "h2d_bytes_per_s": 2e10, "points": []},
        break_even_tokens=30.0,
        created="2025-01-01T00:00:00+00:00",
        pykvcache_version="0.1.0",
    )
    expect = ProfileExpectation(model=profile.model, dtype=profile.dtype, kv_bytes_per_token=BPT, chunk_tokens=CT)
    gate, source = build_gate(profile.save(tmp_path / "p.json"), expect)
    assert source == "profile"
    return gate


def test_a_profile_gives_way_to_the_first_lesson_as_the_default_prior_does(tmp_path):
    slow = 25e6
    load, seconds = 8 * CHUNK, 8 * CHUNK / slow  # 0.67 s: longer than the slice
    default, source = build_gate(None, _expect())
    assert source.startswith("default")
    default.observe_load(load, seconds)
    assert default.online.disk_bytes_per_s == pytest.approx(slow, rel=0.01)
    # A profile timed a device, maybe another one or this one before a throttle:
    # what this server's reads take replaces it as soon as they make a lesson.
    profiled = _profile(tmp_path, 100e6)
    profiled.observe_load(load, seconds)
    assert profiled.online.disk_bytes_per_s == pytest.approx(slow, rel=0.01)


@pytest.mark.parametrize("bytes_per_s", [0.26e6, 1e12])
def test_a_profile_is_corrected_however_far_the_device_is_from_it(tmp_path, bytes_per_s):
    # A profile calibrated on a fast disk, then served from one capped at
    # 0.26 MB/s, ~4,000x slower (an 8x bound held the estimate at 1/8 of the
    # profile's speed and the gate kept loading); or from a far faster array.
    gate = _profile(tmp_path, 1139e6)
    lesson_s = 1.0
    while gate.online.samples < 3:
        gate.observe_load(bytes_per_s * lesson_s, lesson_s)
    assert gate.online.disk_bytes_per_s == pytest.approx(bytes_per_s, rel=0.01)


@pytest.mark.parametrize("bad", [-0.1, float("inf"), float("nan")])
def test_a_first_lesson_must_be_a_finite_time(bad):
    with pytest.raises(ValueError, match="min_lesson_s"):
        OnlineLoadModel(PRIOR, min_lesson_s=bad)
