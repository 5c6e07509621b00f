"""Online refinement: converges towards what loads really take, within bounds."""

from __future__ import annotations

import pytest
from pykvcache.gate import CostModel, LoadCost, OnlineLoadModel, PrefillCurve

BASE = LoadCost(0.001, 2e9, 10e9)


def _truth_time(fixed, bw, nbytes, queued=0.0):
    return fixed + (nbytes + queued) / bw


def test_converges_to_a_slower_device():
    online = OnlineLoadModel(BASE)
    sizes = [256 << 10, 4 << 20, 32 << 20]
    for i in range(30):
        b = sizes[i % 3]
        online.observe(b, _truth_time(0.002, 5e8, b))
    assert online.disk_bytes_per_s == pytest.approx(5e8, rel=0.15)
    assert online.fixed_s == pytest.approx(0.002, rel=0.3)
    assert online.current().h2d_bytes_per_s == BASE.h2d_bytes_per_s


def test_queued_bytes_are_not_mistaken_for_a_slow_device():
    online = OnlineLoadModel(BASE)
    for _ in range(100):
        online.observe(4 << 20, _truth_time(0.001, 2e9, 4 << 20, queued=64 << 20), queued_bytes=64 << 20)
    assert online.disk_bytes_per_s == pytest.approx(2e9, rel=0.01)


def test_a_busy_ssd_raises_the_break_even():
    model = CostModel(PrefillCurve(0.005, 10e-6, 2e-9), BASE, 64 * 1024)
    online = OnlineLoadModel(BASE)
    before = model.break_even_tokens()
    for _ in range(50):
        online.observe(8 << 20, _truth_time(0.004, 4e8, 8 << 20))
    after = model.with_load(online.current()).break_even_tokens()
    assert after > 1.5 * before


def test_estimates_follow_the_device_however_far_it_is_from_the_prior():
    # No bound to the prior: a profile may have timed another device.
    online = OnlineLoadModel(BASE)
    for _ in range(20):
        online.observe(1 << 30, 1000.0)  # ~1 MB/s: 2,000x slower than the prior
    assert online.disk_bytes_per_s == pytest.approx((1 << 30) / (1000.0 - BASE.fixed_s), rel=1e-6)
    for _ in range(20):
        online.observe(1 << 30, 1e-6)  # faster than the fixed cost: fast, not infinitely fast
    assert 1e3 * BASE.disk_bytes_per_s < online.disk_bytes_per_s < float("inf")


def test_one_outlier_moves_the_estimate_only_a_little():
    online = OnlineLoadModel(BASE)
    online.observe(32 << 20, 100 * _truth_time(0.001, 2e9, 32 << 20))
    assert online.disk_bytes_per_s > BASE.disk_bytes_per_s * 0.7
    # Nor one stall among loads that agree.
    for _ in range(6):
        online.observe(32 << 20, _truth_time(0.001, 2e9, 32 << 20))
    online.observe(32 << 20, 100 * _truth_time(0.001, 2e9, 32 << 20))
    assert online.disk_bytes_per_s == pytest.approx(2e9, rel=0.01)


def test_a_slow_device_is_learnt_within_a_few_loads():
    # What a serving engine sees: long prefixes, a load every few seconds, all
    # about the same size. Reads capped at 200 MB/s where 1 GB/s was assumed.
    base = LoadCost(0.001, 1e9, 10e9)
    online = OnlineLoadModel(base)
    online.observe(48 << 20, _truth_time(0.001, 2e8, 48 << 20))
    assert online.disk_bytes_per_s == base.disk_bytes_per_s  # one load alone moves nothing
    for _ in range(2):
        online.observe(48 << 20, _truth_time(0.001, 2e8, 48 << 20))
    assert online.disk_bytes_per_s == pytest.approx(2e8, rel=0.02)


def test_follows_a_device_that_speeds_up_again():
    online = OnlineLoadModel(BASE)
    for _ in range(16):  # the window
        online.observe(8 << 20, _truth_time(0.001, 4e8, 8 << 20))
    assert online.disk_bytes_per_s == pytest.approx(4e8, rel=0.02)
    for _ in range(9):  # the window's majority is the fast device again
        online.observe(8 << 20, _truth_time(0.001, 2e9, 8 << 20))
    assert online.disk_bytes_per_s == pytest.approx(2e9, rel=0.02)


def test_invalid_observations_are_ignored():
    online = OnlineLoadModel(BASE)
    for args in ((0, 0.1), (1 << 20, 0.0), (1 << 20, float("nan")), (1 << 20, float("inf"))):
        online.observe(*args)
    online.observe(1 << 20, 0.01, queued_bytes=-1)
    assert online.samples == 0 and online.rejected == 5
    assert online.current() is BASE
    with pytest.raises(ValueError):
        OnlineLoadModel(BASE, prior_weight=-1)


def test_engine_step_costs_are_kept_while_the_device_is_learned():
    base = LoadCost(0.001, 2e9, 10e9, step_s=5e-4, disk_step_s=1.2e-3)
    online = OnlineLoadModel(base)
    for _ in range(30):
        online.observe(8e6, 0.010)  # a slower device than calibrated
    current = online.current()
    assert current.disk_bytes_per_s < base.disk_bytes_per_s
    assert (current.step_s, current.disk_step_s) == (base.step_s, base.disk_step_s)
