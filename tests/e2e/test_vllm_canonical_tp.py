"""KV that survives a change of tensor parallelism, on vLLM's CPU build.

With ``canonical_layout`` (where vLLM certifies the KV cache as
parallelism-agnostic: the tiny model's one full-attention group with its 2 KV
heads, one per rank at TP=2) every rank writes its share of vLLM's canonical
page into one shared row, and the namespace leaves the parallel sizes out.
Three engine processes on one store directory (~4 minutes here):

* TP=1 computes and stores the X prompts;
* TP=2 serves X0's prefix from that store with the same greedy tokens, and
  computes and stores Y;
* TP=1 again serves Y's prefix, stored at TP=2, with TP=2's tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_vllm_e2e import CHUNK_BYTES, _kv_config, _run, _texts
from vllm_marks import VLLM_ENGINE

pytestmark = VLLM_ENGINE


def _metric(phase: dict, name: str) -> float:
    return phase["metrics"].get("vllm:pykvcache_" + name, 0)


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    from pykvcache.testing.tiny_model import synthetic_text

    workdir = tmp_path_factory.mktemp("pykvcache-canonical")
    store = workdir / "store"
    xs, _, _ = _texts()
    y = f"{synthetic_text(240, seed=4242)} {synthetic_text(10, seed=4243)}"

    def scenario(tp: int, phases: list) -> dict:
        llm = {"kv_transfer_config": _kv_config(store, 24, canonical_layout=True)}
        if tp > 1:
            llm["tensor_parallel_size"] = tp
        return {"model": tiny_model, "phases": phases, "llm": llm}

    out = {"store": store}
    out["tp1"] = _run(scenario(1, [{"op": "generate", "name": "x", "prompts": xs}, {"op": "settle"}]), workdir, "canonical-tp1")
    out["tp2"] = _run(
        scenario(
            2, [{"op": "generate", "name": "x0", "prompts": [xs[0]]}, {"op": "generate", "name": "y", "prompts": [y]}, {"op": "settle"}]
        ),
        workdir,
        "canonical-tp2",
    )
    out["back"] = _run(scenario(1, [{"op": "generate", "name": "y", "prompts": [y]}]), workdir, "canonical-tp1-again")
    return out


def test_a_prefix_stored_at_tp1_is_served_at_tp2_with_identical_tokens(runs):
    stored = runs["tp1"]["by_name"]["x"]
    served = runs["tp2"]["by_name"]["x0"]
    assert stored["num_cached_tokens"][0] == 0
    assert served["num_cached_tokens"][0] >= 800, "TP=2 did not find TP=1's chunks"
    assert _metric(served, "disk_reads") >= 12
    assert served["tokens"][0] == stored["tokens"][0]


def test_a_prefix_stored_at_tp2_is_served_back_at_tp1(runs):
    stored = runs["tp2"]["by_name"]["y"]
    served = runs["back"]["by_name"]["y"]
    assert stored["num_cached_tokens"][0] == 0
    assert served["num_cached_tokens"][0] >= 700
    assert _metric(served, "disk_reads") >= 10
    assert served["tokens"][0] == stored["tokens"][0]


def test_both_sizes_share_one_namespace_of_whole_model_chunks(runs):
    # Namespace directories (the root also holds `.writers`, the writer leases: decision 0053).
    namespaces = [p for p in Path(runs["store"]).iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(namespaces) == 1, namespaces
    sizes = {f.stat().st_size for f in namespaces[0].rglob("*.kvc")}
    assert sizes == {4096 + CHUNK_BYTES}  # one canonical row: both KV heads, no per-rank rows
