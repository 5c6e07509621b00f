"""The weights digested after vLLM's load are confirmed as the ones it loaded
(pykvcache.vllm.identity.loaded_weights): real files, real timestamps, no engine."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from pykvcache.vllm.identity.loaded_weights import COARSE_MARGIN_NS, FINE_MARGIN_NS, engine_started_ns, first_change
from pykvcache.vllm.identity.model_identity import confirm_loaded, weights_identity


def _model(root: Path) -> Path:
    model = root / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(os.urandom(1 << 16))
    (model / "config.json").write_text('{"hidden_size": 8}')
    return model


def _settled() -> int:
    """A start time safely after everything written so far."""
    time.sleep(2 * FINE_MARGIN_NS / 1e9)
    return time.time_ns()


def _config(started_ns: int) -> SimpleNamespace:
    return SimpleNamespace(instance_id=str(started_ns))


def test_files_unchanged_since_the_engine_started_are_confirmed(tmp_path):
    model = _model(tmp_path)
    started = _settled()
    weights = weights_identity(model, cache=None)
    assert confirm_loaded(weights, _config(started)) is None


@pytest.mark.parametrize("change", ["rewritten", "renamed_over", "mtime_put_back", "file_added"])
def test_a_file_changed_after_the_engine_started_is_not_confirmed(tmp_path, change):
    model = _model(tmp_path)
    weights_file = model / "model.safetensors"
    staged = tmp_path / "staged.safetensors"
    staged.write_bytes(os.urandom(1 << 16))
    before = weights_file.stat()
    started = _settled()
    if change == "rewritten":
        weights_file.write_bytes(os.urandom(1 << 16))
    elif change == "renamed_over":  # prepared before the start, swapped in after
        os.replace(staged, weights_file)
    elif change == "mtime_put_back":
        with open(weights_file, "r+b") as f:
            f.write(b"x")
        os.utime(weights_file, ns=(before.st_atime_ns, before.st_mtime_ns))
    else:
        (model / "extra.safetensors").write_bytes(b"\0" * 64)
    weights = weights_identity(model, cache=None)
    why = confirm_loaded(weights, _config(started))
    assert why is not None and "after the engine started" in why


def test_a_file_replaced_after_its_digest_is_not_confirmed(tmp_path):
    model = _model(tmp_path)
    started = _settled()
    weights = weights_identity(model, cache=None)
    fresh = tmp_path / "fresh"
    fresh.write_bytes(b"1" * 10)
    os.replace(fresh, model / "model.safetensors")
    # Even with the directory's and file's times before the start, the name
    # no longer leads to the file digested.
    os.utime(model, ns=(started - COARSE_MARGIN_NS * 2,) * 2)
    os.utime(model / "model.safetensors", ns=(started - COARSE_MARGIN_NS * 2,) * 2)
    why = first_change(model, weights.digested, started)
    assert why is not None


def test_a_hub_snapshots_blob_replaced_behind_its_link_is_not_confirmed(tmp_path):
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    (blobs / "1111").write_bytes(os.urandom(4096))
    (snapshot / "model.safetensors").symlink_to("../../blobs/1111")
    started = _settled()
    assert first_change(snapshot, weights_identity(snapshot, cache=None).digested, started) is None
    (blobs / "2222").write_bytes(os.urandom(4096))
    os.replace(blobs / "2222", blobs / "1111")
    why = first_change(snapshot, weights_identity(snapshot, cache=None).digested, started)
    assert why is not None


def test_the_start_is_the_engines_configuration_stamp_or_this_process_start():
    now = time.time_ns()
    assert engine_started_ns(SimpleNamespace(instance_id=str(now))) == (now, "the engine's configuration")
    assert engine_started_ns(SimpleNamespace(instance_id=f"{now}_dp1"))[0] == now
    # Not a time (another vLLM), or in the future: this process's start, earlier than now.
    for stamp in ("abcde", str(now + 10**12)):
        started, origin = engine_started_ns(SimpleNamespace(instance_id=stamp))
        assert origin == "this process's start" and started < now


def test_no_engine_no_check(tmp_path):
    model = _model(tmp_path)
    assert confirm_loaded(weights_identity(model, cache=None), None) is None
