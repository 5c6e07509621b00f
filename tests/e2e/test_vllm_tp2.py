"""Tensor parallelism 2 on vLLM's CPU build: two worker processes map one
staging region, each copies its own row of every chunk (one chunk file holds
all ranks' rows), and a prefix loaded back from disk gives the same greedy
tokens as when it was computed.

One engine process (~2 minutes here): X prompts computed and stored, device
prefix cache reset and refilled with other prompts, X0 again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_vllm_e2e import CHUNK_BYTES, _kv_config, _run, _texts
from vllm_marks import VLLM_ENGINE

pytestmark = VLLM_ENGINE


@pytest.fixture(scope="module")
def tp2(tiny_model, tmp_path_factory):
    model = tiny_model  # 2 KV heads: one per rank
    workdir = tmp_path_factory.mktemp("pykvcache-tp2")
    store = workdir / "store"
    xs, fillers, _ = _texts()
    phases = [
        {"op": "generate", "name": "first", "prompts": xs},
        {"op": "settle"},
        {"op": "reset_prefix_cache"},
        {"op": "generate", "name": "fillers", "prompts": fillers},
        {"op": "generate", "name": "repeat", "prompts": [xs[0]]},
    ]
    scenario = {"model": model, "phases": phases, "llm": {"tensor_parallel_size": 2, "kv_transfer_config": _kv_config(store, 24)}}
    result = _run(scenario, workdir, "tp2")
    result["store"] = store
    return result


def _metric(phase: dict, name: str) -> float:
    return phase["metrics"].get("vllm:pykvcache_" + name, 0)


def test_tp2_prefix_from_disk_gives_identical_tokens(tp2):
    first, before, repeat = (tp2["by_name"][n] for n in ("first", "fillers", "repeat"))
    assert first["num_cached_tokens"][0] == 0
    assert repeat["num_cached_tokens"][0] >= 800, "the prefix was not served after the device cache reset"
    assert _metric(repeat, "disk_reads") - _metric(before, "disk_reads") >= 12
    assert repeat["tokens"][0] == first["tokens"][0]


def test_tp2_one_file_holds_every_ranks_row(tp2):
    files = list(Path(tp2["store"]).rglob("*.kvc"))
    assert files
    # A chunk of the whole model (both KV heads) per file: header + both rows.
    assert {f.stat().st_size for f in files} == {4096 + CHUNK_BYTES}
