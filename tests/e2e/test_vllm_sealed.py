"""Chunks sealed at rest under a real vLLM (CPU build), tenants by ``cache_salt``
(decision 0083): ``encryption_key_file`` in the connector's settings,
``PyKvCacheConnector`` (it sees each request's salt). Four engines, one after
another on one directory, in the session's engine host:

* plain     no key: the prompt X0 under salt "planted" is stored in plaintext,
            as a writer without the key (or an attacker with write access to
            the directory) would plant it: a valid header and checksum under
            the real chunk name;
* sealed    key K1: X0 "planted" again: its planted chunks are never loaded
            (misses of kind kept), tokens identical; X1 under salt "a", then
            under salt "b" after the device cache is reset: b loads nothing of
            a's; no plaintext page of the KV appears in any sealed file;
* rotated   key K2 with K1 as the previous key (a rolling restart): X1 for a
            and for b hit from disk, tokens identical;
* wrong     key K3 alone: X1 for a misses, tokens identical, no file deleted.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from robust_chunkfmt import HEADER_BYTES, chunk_files
from test_vllm_e2e import _kv_config, _run, _texts
from vllm_marks import VLLM_ENGINE

pytestmark = VLLM_ENGINE

FLAGS_OFFSET, FLAG_SEALED = 52, 2  # rust/src/disk/format.rs


def _metric(phase: dict, name: str) -> float:
    return phase["metrics"].get("vllm:pykvcache_" + name, 0)


def _key_file(directory: Path, name: str) -> str:
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(32))
    return str(path)


def _payloads(paths) -> dict[str, bytes]:
    out = {}
    for path in paths:
        with open(path, "rb") as f:
            out[path] = f.read()
    return out


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("pykvcache-sealed")
    store = work / "store"
    k1, k2, k3 = (_key_file(work, n) for n in ("k1", "k2", "k3"))
    xs, _, _ = _texts()
    x0, x1 = {"text": xs[0], "salt": "planted"}, xs[1]

    def scenario(phases, **keys):
        return {"model": tiny_model, "llm": {"kv_transfer_config": _kv_config(store, 24, lookahead=True, **keys)}, "phases": phases}

    out = {"store": store}
    out["plain"] = _run(scenario([{"op": "generate", "name": "x0", "prompts": [x0]}, {"op": "settle"}]), work, "sealed-plain")
    out["plain_files"] = _payloads(chunk_files(store))
    phases = [
        {"op": "generate", "name": "planted", "prompts": [x0]},
        {"op": "generate", "name": "a", "prompts": [{"text": x1, "salt": "a"}]},
        {"op": "settle"},
        {"op": "reset_prefix_cache"},
        {"op": "generate", "name": "b", "prompts": [{"text": x1, "salt": "b"}]},
        {"op": "settle"},
    ]
    out["sealed"] = _run(scenario(phases, encryption_key_file=k1), work, "sealed-k1")
    out["sealed_files"] = _payloads(set(chunk_files(store)) - set(out["plain_files"]))
    both = [
        {"op": "generate", "name": "a", "prompts": [{"text": x1, "salt": "a"}]},
        {"op": "generate", "name": "b", "prompts": [{"text": x1, "salt": "b"}]},
    ]
    out["rotated"] = _run(scenario(both, encryption_key_file=k2, encryption_previous_key_file=k1), work, "sealed-rotated")
    out["before_wrong"] = set(chunk_files(store))
    out["wrong"] = _run(scenario(both[:1], encryption_key_file=k3), work, "sealed-wrong-key")
    out["after_wrong"] = set(chunk_files(store))
    return out


def test_a_chunk_planted_without_the_key_is_never_loaded(runs):
    plain, sealed = runs["plain"]["by_name"]["x0"], runs["sealed"]["by_name"]["planted"]
    assert runs["plain_files"], "the plain engine stored nothing"
    assert sealed["num_cached_tokens"] == [0]
    assert _metric(sealed, "kept_chunks") >= 1, "the planted chunks were not even read"
    assert _metric(sealed, "corrupt_chunks") == 0 and set(runs["plain_files"]) <= runs["before_wrong"], "a planted file was deleted"
    assert sealed["tokens"] == plain["tokens"]


def test_tenants_with_different_salts_never_load_each_others_sealed_chunks(runs):
    by = runs["sealed"]["by_name"]
    assert _metric(by["a"], "disk_writes") > _metric(by["planted"], "disk_writes")
    assert by["b"]["num_cached_tokens"] == [0]
    assert _metric(by["b"], "disk_reads") == _metric(by["a"], "disk_reads")
    assert by["b"]["tokens"] == by["a"]["tokens"]


def test_sealed_files_hold_no_plaintext_page_of_the_kv(runs):
    """X0 and X1 share their first ~880 tokens: the plaintext files of X0 hold
    the very KV the sealed files of X1 hold. No 512-byte piece of it (taken
    every 4 KiB of each payload) appears in any sealed file."""
    sealed = runs["sealed_files"]
    assert sealed, "the sealed engine stored nothing"
    for data in sealed.values():
        assert struct.unpack_from("<I", data, FLAGS_OFFSET)[0] == FLAG_SEALED
    pieces = {
        data[i : i + 512]
        for data in runs["plain_files"].values()
        for i in range(HEADER_BYTES, len(data) - 512, 4096)
        if any(data[i : i + 512])
    }
    assert len(pieces) > 10
    assert not [p for p in pieces for data in sealed.values() if p in data]


def test_a_rolling_restart_with_the_previous_key_keeps_every_hit(runs):
    sealed, rotated = runs["sealed"]["by_name"], runs["rotated"]["by_name"]
    for tenant in ("a", "b"):
        assert rotated[tenant]["num_cached_tokens"][0] >= 800, tenant
        assert rotated[tenant]["tokens"] == sealed[tenant]["tokens"], tenant
    assert _metric(rotated["b"], "disk_reads") >= 24  # both tenants' ~13 chunks, from disk


def test_a_wrong_key_misses_deletes_nothing_and_serves_identical_tokens(runs):
    wrong = runs["wrong"]["by_name"]["a"]
    assert wrong["num_cached_tokens"] == [0]
    assert _metric(wrong, "kept_chunks") >= 1 and _metric(wrong, "corrupt_chunks") == 0
    assert wrong["tokens"] == runs["sealed"]["by_name"]["a"]["tokens"]
    assert runs["before_wrong"] <= runs["after_wrong"], "a chunk sealed with another key was deleted"
