"""The cost model: fits recover known curves, the break-even is where load and
recompute cross."""

from __future__ import annotations

import math

import pytest
from pykvcache.gate.cost_model import CostModel, LoadCost, PrefillCurve, nonneg_least_squares


def test_quadratic_fit_recovers_a_known_curve():
    truth = PrefillCurve(0.004, 25e-6, 3e-9)
    points = [(n, truth.time(n)) for n in (32, 128, 512, 1024, 2048, 4096)]
    fit = PrefillCurve.fit(points)
    assert fit.a == pytest.approx(truth.a, rel=1e-6)
    assert fit.b == pytest.approx(truth.b, rel=1e-6)
    assert fit.c == pytest.approx(truth.c, rel=1e-6)


def test_fit_never_returns_a_decreasing_curve():
    # Noisy measurements that an unconstrained fit would bend downwards.
    points = [(32, 0.010), (256, 0.030), (1024, 0.080), (2048, 0.075), (4096, 0.110)]
    fit = PrefillCurve.fit(points)
    assert min(fit.a, fit.b, fit.c) >= 0
    times = [fit.time(n) for n in range(0, 8192, 64)]
    assert times == sorted(times)
    assert fit.time(4096) > fit.time(32)


def test_fit_rejects_what_it_cannot_fit():
    with pytest.raises(ValueError, match="two or more prompt lengths"):
        PrefillCurve.fit([(100, 0.01), (100, 0.02)])
    with pytest.raises(ValueError, match="does not grow"):
        PrefillCurve.fit([(100, 0.05), (1000, 0.01), (4000, 0.005)])
    with pytest.raises(ValueError):
        PrefillCurve(0.0, -1e-6, 0.0)


def test_nonneg_least_squares_prefers_the_best_feasible_subset():
    rows = [(1.0, x) for x in (1, 2, 3, 4)]
    ys = [10.0 - x for x in (1, 2, 3, 4)]  # slope -1: infeasible, so slope 0
    coef = nonneg_least_squares(rows, ys, [1.0] * 4)
    assert coef[1] == 0
    assert coef[0] == pytest.approx(sum(ys) / 4)


def test_disk_fit_recovers_fixed_cost_and_bandwidth():
    fixed, bw = 0.0008, 2.5e9
    points = [(b, fixed + b / bw) for b in (1 << 20, 4 << 20, 16 << 20, 64 << 20)]
    got_fixed, got_bw = LoadCost.fit_disk(points)
    assert got_fixed == pytest.approx(fixed, rel=1e-6)
    assert got_bw == pytest.approx(bw, rel=1e-6)


def test_disk_fit_is_not_fooled_by_a_burst():
    """``pykvcache calibrate``'s points on this VM's disk capped at 100 MB/s
    (a cgroup throttle serves ~10 MB at once after idling): the relative fit
    said 1437 MB/s. The sustained rate is what loads in service get."""
    points = [(2097152, 0.00169), (4194304, 0.00235), (10485760, 0.1065), (25165824, 0.3089), (58720256, 0.5881)]
    fixed, bw = LoadCost.fit_disk(points)
    assert 90e6 <= bw <= 130e6 and fixed >= 0
    assert fixed + 58720256 / bw == pytest.approx(0.5881, rel=0.1)
    # The 25 MB/s run's points (the burst is 2.5 MB there): unchanged, already right.
    slow = [(2097152, 0.0836), (4194304, 0.168), (10485760, 0.420), (25165824, 1.008), (58720256, 2.352)]
    assert LoadCost.fit_disk(slow)[1] == pytest.approx(25e6, rel=0.05)


def test_load_time_counts_queue_fixed_cost_and_copy():
    load = LoadCost(0.001, 1e9, 10e9)
    assert load.time(0, 0) == 0
    # Staged bytes only pay the copy, and no fixed cost or queue.
    assert load.time(0, 1e6, queued_bytes=5e9) == pytest.approx(1e6 / 10e9)
    assert load.time(1e6, 0, queued_bytes=2e6) == pytest.approx(0.001 + 3e6 / 1e9 + 1e6 / 10e9)


def _brute_break_even(model: CostModel, queued: float = 0.0, limit: int = 200_000) -> float:
    for n in range(1, limit):
        if model.recompute_time(n) > model.load_time(n, queued_bytes=queued):
            return n
    return math.inf


@pytest.mark.parametrize(
    "prefill,load",
    [
        (PrefillCurve(0.01, 20e-6, 1e-9), LoadCost(0.002, 1e9, 20e9)),
        (PrefillCurve(0.01, 20e-6, 0.0), LoadCost(0.002, 1e9)),
        (PrefillCurve(0.0, 1e-7, 2e-8), LoadCost(0.0005, 2e9)),  # load per token > prefill per token at first
        (PrefillCurve(0.01, 1e-7, 0.0), LoadCost(0.0005, 2e9)),  # never pays
        (PrefillCurve(0.01, 20e-6, 1e-9), LoadCost(0.002, 1e9, 20e9, step_s=0.003)),  # engine step
    ],
)
def test_break_even_matches_a_brute_force_scan(prefill, load):
    model = CostModel(prefill, load, bytes_per_token=112 * 1024)
    be = model.break_even_tokens()
    brute = _brute_break_even(model)
    if math.isinf(brute):
        assert math.isinf(be)
    else:
        assert math.ceil(be - 1e-9) == brute or abs(be - brute) <= 1
        # Past the break-even, loading keeps winning.
        for n in (brute, 2 * brute, 10 * brute):
            assert model.recompute_time(n) > model.load_time(n)


def test_engine_step_is_paid_by_every_load_once():
    load = LoadCost(0.001, 1e9, 10e9, step_s=0.004)
    assert load.time(0, 0) == 0  # nothing loaded: nothing paid
    # A staged load pays the step and the copy, not the storage's fixed cost.
    assert load.time(0, 1e6, queued_bytes=5e9) == pytest.approx(0.004 + 1e6 / 10e9)
    assert load.time(1e6, 1e6) == pytest.approx(0.004 + 0.001 + 1e6 / 1e9 + 2e6 / 10e9)
    base = CostModel(PrefillCurve(0.01, 20e-6, 0.0), LoadCost(0.001, 1e9, 10e9), 2048)
    with_step = base.with_load(load)
    # Linear prefill: break-even = (step + fixed) / (b - per-token load).
    per_token = 2048 / 1e9 + 2048 / 10e9
    assert with_step.break_even_tokens() == pytest.approx(0.005 / (20e-6 - per_token))
    assert with_step.break_even_tokens() == pytest.approx(5 * base.break_even_tokens())
    with pytest.raises(ValueError):
        LoadCost(0.001, 1e9, step_s=-1.0)


def test_queued_io_raises_the_break_even():
    model = CostModel(PrefillCurve(0.01, 20e-6, 1e-9), LoadCost(0.001, 1e9), 2048)
    idle = model.break_even_tokens()
    busy = model.break_even_tokens(queued_bytes=512 << 20)
    assert busy > 2 * idle
    assert (
        math.ceil(busy - 1e-9) == _brute_break_even(model, queued=512 << 20) or abs(busy - _brute_break_even(model, queued=512 << 20)) <= 1
    )


def test_saving_includes_attention_over_earlier_tokens():
    curve = PrefillCurve(0.0, 1e-5, 1e-8)
    # The same 256 tokens cost more to compute deep in a prompt.
    assert curve.compute_cost(4096, 4352) > curve.compute_cost(0, 256)
    assert curve.compute_cost(0, 4352) == pytest.approx(curve.time(4352) - curve.time(0))


def test_disk_step_is_paid_once_by_loads_that_read_the_disk():
    load = LoadCost(fixed_s=1e-4, disk_bytes_per_s=1e9, h2d_bytes_per_s=1e10, step_s=5e-4, disk_step_s=1e-3)
    staged_only = load.time(0, staged_bytes=1e6)
    assert staged_only == pytest.approx(5e-4 + 1e6 / 1e10)
    assert load.time(1e6) == pytest.approx(5e-4 + 1e-4 + 1e-3 + 1e6 / 1e9 + 1e6 / 1e10)
    prefill = PrefillCurve(0.0, 2e-5, 0.0)
    without = CostModel(prefill, LoadCost(1e-4, 1e9, 1e10, 5e-4), 2048.0)
    with_step = without.with_load(load)
    # A per-load cost moves the break-even by cost / (per-token gain).
    gain = 2e-5 - 2048.0 * (1 / 1e9 + 1 / 1e10)
    assert with_step.break_even_tokens() - without.break_even_tokens() == pytest.approx(1e-3 / gain)
