"""A model whose KV values change at the same path never loads the old KV.

Four engine processes on one store and one model directory (a copy of the tiny
model, so its weights can be replaced in place):

* stored     the model as built: stores the prefix of X;
* override   the same path with ``hf_overrides`` changing ``rope_theta``;
* replaced   the same path after its safetensors file was overwritten with
             other weights of the same shapes (same size, same header);
* again      the original weights back: the prefix comes from disk again.

In ``override`` and ``replaced`` the reference is X with a cache salt, which no
stored chunk can match (the salt is in the block hashes): what vLLM computes
alone under that configuration. The unsalted X must then be computed too: 0
disk reads, identical tokens. Before the model identity was in the namespace,
both read the stored chunks and generated other tokens. ``again`` shows the
identity is stable across processes and that the chunks were loadable all along.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from vllm_marks import VLLM_ENGINE
from test_vllm_e2e import _kv_config, _run, _texts

pytestmark = VLLM_ENGINE

ROPE_OVERRIDE = {"rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}


def _metric(phase: dict, name: str) -> float:
    return phase["metrics"].get("vllm:pykvcache_" + name, 0)


def _phases(x: str, *, reference: bool) -> list[dict]:
    phases = [{"op": "generate", "name": "reference", "prompts": [{"text": x, "salt": "fresh"}]}] \
        if reference else []
    return phases + [{"op": "generate", "name": "x", "prompts": [x]}]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, tiny_model_other_weights):
    original, other = Path(tiny_model), Path(tiny_model_other_weights)
    work = tmp_path_factory.mktemp("model-identity")
    model = work / "model"
    shutil.copytree(original, model)
    weights = model / "model.safetensors"
    assert weights.stat().st_size == (other / "model.safetensors").stat().st_size
    store = work / "store"
    x = _texts()[0][0]

    def run(name: str, *, reference: bool, **llm) -> dict:
        scenario = {"model": str(model), "phases": _phases(x, reference=reference),
                    "llm": {"kv_transfer_config": _kv_config(store, 24), **llm}}
        return _run(scenario, work, name)

    out = {"stored": run("stored", reference=False)}
    out["override"] = run("override", reference=True, hf_overrides=ROPE_OVERRIDE)
    shutil.copyfile(other / "model.safetensors", weights)
    out["replaced"] = run("replaced", reference=True)
    shutil.copyfile(original / "model.safetensors", weights)
    out["again"] = run("again", reference=False)
    return out


def test_the_prefix_was_stored(runs):
    x = runs["stored"]["by_name"]["x"]
    assert _metric(x, "disk_writes") >= 12


@pytest.mark.parametrize("change", ["override", "replaced"])
def test_a_changed_model_at_the_same_path_loads_nothing_and_matches_vllm_alone(runs, change):
    phases = runs[change]["by_name"]
    x, reference = phases["x"], phases["reference"]
    assert reference["num_cached_tokens"] == [0]
    assert x["num_cached_tokens"] == [0]
    assert _metric(x, "disk_reads") == 0, f"{change}: stale chunks were read"
    assert _metric(x, "corrupt_chunks") == 0
    assert x["tokens"] == reference["tokens"]
    # The change is real: this configuration generates other tokens than the stored one.
    assert x["tokens"] != runs["stored"]["by_name"]["x"]["tokens"]


def test_the_same_model_again_loads_the_stored_prefix(runs):
    x = runs["again"]["by_name"]["x"]
    assert x["num_cached_tokens"][0] >= 800
    assert _metric(x, "disk_reads") >= 12
    assert x["tokens"] == runs["stored"]["by_name"]["x"]["tokens"]
