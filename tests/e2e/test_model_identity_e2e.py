"""A model whose KV values change at the same path never loads the old KV.

Four engine processes on one store and one model directory (a copy of the tiny
model, so its weights can be replaced in place):

* stored     the model as built: stores the prefix of X;
* override   the same path with ``hf_overrides`` changing ``rope_theta``;
* edited     the same path after ~200 rows of ``embed_tokens`` (those of X's
             tokens, between the positions the old identity sampled) were
             edited in place: same inode, size and header, mtime put back;
* again      the original weights back: the prefix comes from disk again.

In ``override`` and ``edited`` the reference is X with a cache salt, which no
stored chunk can match (the salt is in the block hashes): what vLLM computes
alone under that configuration. The unsalted X must then be computed too: 0
disk reads, identical tokens. Before the model identity was in the namespace,
both read the stored chunks and generated other tokens. ``again`` shows the
identity is stable across processes and that the chunks were loadable all along.
``override`` finds the weights' digest in the node's digest cache (written by
``stored``): a second start on unchanged weights reads none of them.

Four more engines (``startup``) on another copy, all with LoRA enabled, then
one engine on the files as they are at the end, which must answer as vLLM
alone for every prompt:

* swapped   the weights file is renamed over with other weights the moment
            vLLM logs that it has loaded them; stores X1 (old weights' KV);
* dummy     ``load_format="dummy"`` (random weights) on the same directory;
            stores X2;
* adapted   the real weights; stores X3 with adapter "a", X4 without one and
            X5 with adapter "b"; then "a" is retrained and saved under the
            same name and path;
* after     X1..X5 salted (vLLM alone), then unsalted: X1, X2 and X3 (new
            "a") load nothing; X4 and X5 (unchanged "b") load their chunks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from test_vllm_e2e import _kv_config, _run, _texts
from vllm_marks import VLLM_ENGINE

pytestmark = VLLM_ENGINE

#: Longer than loaded_weights' margin below an engine's start.
SETTLE_S = 0.2

ROPE_OVERRIDE = {"rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}


def _metric(phase: dict, name: str) -> float:
    return phase["metrics"].get("vllm:pykvcache_" + name, 0)


def _edit_embedding_rows(weights: Path, token_ids: set[int], rows: int = 200) -> list[int]:
    """Negates ``rows`` rows of ``embed_tokens`` in place, preferring ``token_ids``;
    rows that overlap the 4 KiB the old identity sampled at the tensor's start,
    middle and end are left alone, so only a digest of every byte sees the edit.
    The file keeps its inode, size, header and mtime. Returns the rows edited."""
    with open(weights, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
    entry = header["model.embed_tokens.weight"]
    assert entry["dtype"] == "F32"
    vocab, hidden = entry["shape"]
    begin, end = entry["data_offsets"]
    length, row_bytes = end - begin, hidden * 4
    sampled = [(0, 4096), (length // 2 - 2048, length // 2 + 2048), (length - 4096, length)]

    def clear(row: int) -> bool:
        lo, hi = row * row_bytes, (row + 1) * row_bytes
        return all(hi <= a or lo >= b for a, b in sampled)

    chosen = [r for r in sorted(token_ids) if r < vocab and clear(r)]
    chosen += [r for r in range(vocab) if r not in token_ids and clear(r)][: max(0, rows - len(chosen))]
    chosen = sorted(chosen[:rows])
    before = weights.stat()
    with open(weights, "r+b") as f:
        for row in chosen:
            f.seek(8 + header_len + begin + row * row_bytes)
            values = np.frombuffer(f.read(row_bytes), dtype=np.float32)
            f.seek(-row_bytes, os.SEEK_CUR)
            f.write((-values).tobytes())
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = weights.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    return chosen


def _write_adapter(dest: Path, seed: int, rank: int = 8) -> None:
    """A LoRA adapter (PEFT layout) for the tiny model's q_proj and v_proj,
    written to a temporary directory renamed over ``dest``'s files (a
    retrained adapter saved under the same name and path)."""
    from pykvcache.testing.tiny_model import TinyModelSpec
    from safetensors.numpy import save_file

    spec = TinyModelSpec()
    rng = np.random.default_rng(seed)
    outs = {"q_proj": spec.num_attention_heads * spec.head_dim, "v_proj": spec.num_key_value_heads * spec.head_dim}
    tensors = {}
    for layer in range(spec.num_hidden_layers):
        for module, out in outs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((rank, spec.hidden_size)) * 0.3).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = (rng.standard_normal((out, rank)) * 0.3).astype(np.float32)
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.new"
    tmp.mkdir(exist_ok=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(
        json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": sorted(outs), "bias": "none", "task_type": "CAUSAL_LM"}
        )
    )
    for f in tmp.iterdir():
        os.replace(f, dest / f.name)
    tmp.rmdir()


def _token_ids(model: Path, text: str) -> set[int]:
    from tokenizers import Tokenizer

    return set(Tokenizer.from_file(str(model / "tokenizer.json")).encode(text).ids)


def _phases(x: str, *, reference: bool) -> list[dict]:
    phases = [{"op": "generate", "name": "reference", "prompts": [{"text": x, "salt": "fresh"}]}] if reference else []
    return phases + [{"op": "generate", "name": "x", "prompts": [x]}]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model):
    original = Path(tiny_model)
    work = tmp_path_factory.mktemp("model-identity")
    model = work / "model"
    shutil.copytree(original, model)
    # A file changed within the digest cache's racy window is hashed but not cached
    # (digest_cache.RACY_WINDOW_NS). An engine in a warm host process starts well
    # inside that window after the copy; wait it out, so the second start can use the cache.
    from pykvcache.vllm.identity.digest_cache import RACY_WINDOW_NS

    time.sleep(RACY_WINDOW_NS / 1e9 + 0.2)
    weights = model / "model.safetensors"
    store = work / "store"
    x = _texts()[0][0]
    # The engines' digest cache (per user and node): this test's own.
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(work / "xdg-cache"))

    def run(name: str, *, reference: bool, **llm) -> dict:
        scenario = {
            "model": str(model),
            "phases": _phases(x, reference=reference),
            "llm": {"kv_transfer_config": _kv_config(store, 24), **llm},
        }
        return _run(scenario, work, name)

    try:
        out = {"stored": run("stored", reference=False)}
        out["override"] = run("override", reference=True, hf_overrides=ROPE_OVERRIDE)
        edited_rows = _edit_embedding_rows(weights, _token_ids(model, x))
        assert len(edited_rows) == 200
        # Files changed right before an engine's configuration is made count as
        # changed while it loaded (loaded_weights.FINE_MARGIN_NS): these
        # engines are to identify the files, so they start a little later.
        time.sleep(SETTLE_S)
        out["edited"] = run("edited", reference=True)
        shutil.copyfile(original / "model.safetensors", weights)
        time.sleep(SETTLE_S)
        out["again"] = run("again", reference=False)
    finally:
        mp.undo()
    for name in out:
        out[name]["log"] = (work / f"{name}.log").read_text()
    return out


def test_the_prefix_was_stored(runs):
    x = runs["stored"]["by_name"]["x"]
    assert _metric(x, "disk_writes") >= 12


@pytest.mark.parametrize("change", ["override", "edited"])
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
    # Identified by their digests, not refused as changed while loading.
    for name in ("edited", "again"):
        assert "changed while this engine started" not in runs[name]["log"], name
    x = runs["again"]["by_name"]["x"]
    assert x["num_cached_tokens"][0] >= 800
    assert _metric(x, "disk_reads") >= 12
    assert x["tokens"] == runs["stored"]["by_name"]["x"]["tokens"]


def _weights_log(run: dict) -> dict[str, int]:
    """The start-up's weights-identity log line, as numbers."""
    m = re.search(
        r"weights identity of \S+: (\d+) file\(s\), (\d+) from the digest cache, "
        r"(\d+) bytes hashed",
        run["log"],
    )
    assert m, "no weights identity line in the engine's log"
    return dict(zip(("files", "cached", "hashed"), map(int, m.groups())))


def test_a_second_start_on_unchanged_weights_reads_none_of_them(runs, tiny_model):
    first, second = _weights_log(runs["stored"]), _weights_log(runs["override"])
    assert first["cached"] == 0 and first["hashed"] > 0
    assert second == {"files": first["files"], "cached": first["files"], "hashed": 0}
    # The edit changed ctime (mtime was put back): that file was digested again.
    edited = _weights_log(runs["edited"])
    assert edited["hashed"] >= (Path(tiny_model) / "model.safetensors").stat().st_size


LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}


@pytest.fixture(scope="module")
def startup(tmp_path_factory, tiny_model, tiny_model_other_weights):
    from pykvcache.testing.tiny_model import synthetic_text
    from pykvcache.vllm.identity.digest_cache import RACY_WINDOW_NS

    work = tmp_path_factory.mktemp("identity-start-up")
    model = work / "model"
    shutil.copytree(tiny_model, model)
    # Staged beside the model: renamed over its weights while the engine starts.
    staged = work / "other.safetensors"
    shutil.copyfile(Path(tiny_model_other_weights) / "model.safetensors", staged)
    adapter_a, adapter_b = work / "adapter-a", work / "adapter-b"
    _write_adapter(adapter_a, seed=1)
    _write_adapter(adapter_b, seed=2)
    time.sleep(RACY_WINDOW_NS / 1e9 + 0.2)  # the digest cache keeps only settled files
    store = work / "store"
    xs = [synthetic_text(250, seed=500 + i) for i in range(5)]
    lora_a, lora_b = ["a", 1, str(adapter_a)], ["b", 2, str(adapter_b)]
    prompts = [{"text": xs[0]}, {"text": xs[1]}, {"text": xs[2], "lora": lora_a}, {"text": xs[3]}, {"text": xs[4], "lora": lora_b}]
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(work / "xdg-cache"))

    def run(name: str, phases: list[dict], **llm) -> dict:
        scenario = {
            "model": str(model),
            "phases": phases,
            **llm.pop("scenario", {}),
            "llm": {"kv_transfer_config": _kv_config(store, 40), **LORA, **llm},
        }
        result = _run(scenario, work, name)
        result["log"] = (work / f"{name}.log").read_text()
        return result

    def gen(name: str, *which: int, salt: str | None = None) -> list[dict]:
        return [{"op": "generate", "name": f"{name}{i}", "prompts": [{**prompts[i], **({"salt": salt} if salt else {})}]} for i in which]

    out = {}
    try:
        out["swapped"] = run(
            "swapped",
            gen("x", 0),
            scenario={"replace_on_log": {"pattern": "Loading weights took", "src": str(staged), "dst": str(model / "model.safetensors")}},
        )
        out["dummy"] = run("dummy", gen("x", 1), load_format="dummy")
        out["adapted"] = run("adapted", gen("x", 2, 3, 4))
        _write_adapter(adapter_a, seed=3)  # retrained, saved under the same name and path
        out["after"] = run("after", gen("reference", 0, 1, 2, 3, 4, salt="alone") + gen("x", 0, 1, 2, 3, 4))
    finally:
        mp.undo()
    return out


@pytest.mark.parametrize("i, run", [(0, "swapped"), (1, "dummy")])
def test_weights_replaced_during_start_up_and_dummy_weights_share_nothing(startup, i, run):
    after = startup["after"]["by_name"]
    x, reference = after[f"x{i}"], after[f"reference{i}"]
    assert x["tokens"] == reference["tokens"], f"X{i + 1}: other tokens than vLLM alone after {run}"
    assert x["num_cached_tokens"] == [0], f"X{i + 1}: {run}'s chunks were loaded"
    # The weights differed: that engine's KV was not the last one's.
    assert startup[run]["by_name"][f"x{i}"]["tokens"] != reference["tokens"]
    said = {"swapped": "changed while this engine started", "dummy": "load_format=dummy"}[run]
    assert said in startup[run]["log"]


def test_a_retrained_adapter_loads_nothing(startup):
    after, adapted = startup["after"]["by_name"], startup["adapted"]["by_name"]
    assert after["x2"]["tokens"] == after["reference2"]["tokens"], "X3: other tokens than vLLM alone"
    assert after["x2"]["num_cached_tokens"] == [0], "the retrained adapter's old chunks were loaded"
    assert adapted["x2"]["tokens"] != after["reference2"]["tokens"]  # the retraining is real


@pytest.mark.parametrize("i", [3, 4])
def test_chunks_without_an_adapter_or_with_an_unchanged_one_are_loaded(startup, i):
    after, adapted = startup["after"]["by_name"], startup["adapted"]["by_name"]
    assert after[f"x{i}"]["tokens"] == after[f"reference{i}"]["tokens"]
    assert after[f"x{i}"]["num_cached_tokens"][0] >= 800, f"X{i + 1} was not loaded"
    assert after[f"x{i}"]["tokens"] == adapted[f"x{i}"]["tokens"]
