"""The model identity in the namespace: what changes KV values changes it, and
nothing else does (a path, an mtime, a scheduler setting)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from pykvcache.vllm.model_identity import (
    BLOB_SAMPLES,
    config_identity,
    model_identity,
    resolve_weights,
    weights_identity,
)
from pykvcache.vllm.namespace import identity_digest

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def _safetensors(path: Path, tensors: dict[str, bytes]) -> None:
    header, offset = {}, 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + b"".join(tensors.values()))


@pytest.fixture
def checkpoint(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    tensors = {f"layer{i}.weight": bytes([i]) * (100_000 + i) for i in range(4)}
    _safetensors(d / "model.safetensors", tensors)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (d / "tokenizer.json").write_text("{}")
    return d


def _digest(path: Path) -> str:
    return weights_identity(path).digest


def test_identical_weights_elsewhere_or_touched_have_the_same_identity(checkpoint, tmp_path):
    copy_dir = tmp_path / "node-b" / "ckpt"
    shutil.copytree(checkpoint, copy_dir)
    os.utime(copy_dir / "model.safetensors", (1, 1))
    (copy_dir / "tokenizer.json").write_text('{"changed": true}')  # maps text to ids only
    assert _digest(checkpoint) == _digest(copy_dir) != ""


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_one_changed_tensor_changes_the_identity(checkpoint, where):
    before = _digest(checkpoint)
    path = checkpoint / "model.safetensors"
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    tensor_start = 8 + header_len + 100_000 + 100_001  # layer2.weight
    offset = {"start": 0, "middle": 50_000, "end": 100_001}[where]
    with open(path, "r+b") as f:
        f.seek(tensor_start + offset)
        f.write(b"\xff")
    assert _digest(checkpoint) != before


def test_config_and_index_files_are_part_of_the_identity(checkpoint):
    before = _digest(checkpoint)
    (checkpoint / "quantize_config.json").write_text('{"bits": 4}')
    assert _digest(checkpoint) != before


def test_other_weight_formats_are_sampled(tmp_path):
    blob = tmp_path / "ckpt"
    blob.mkdir()
    data = bytearray(os.urandom(BLOB_SAMPLES * 65536 * 3))
    (blob / "pytorch_model.bin").write_bytes(data)
    identity = weights_identity(blob)
    assert identity.reads == BLOB_SAMPLES
    data[0] ^= 1
    (blob / "pytorch_model.bin").write_bytes(data)
    assert weights_identity(blob).digest != identity.digest


def test_weights_not_found_locally_fall_back_to_name_and_revision(caplog):
    assert resolve_weights("no-such-org/no-such-model-xyz", None) is None
    ident = model_identity(None, "no-such-org/no-such-model-xyz")
    assert ident["weights"] == {"model": "no-such-org/no-such-model-xyz", "revision": "None"}
    assert "namespace_salt" in caplog.text


def test_reads_are_a_few_per_tensor(checkpoint):
    identity = weights_identity(checkpoint)
    assert identity.tensors == 4
    # header length + header + 3 samples per tensor + the config.json
    assert identity.reads == 2 + 3 * 4 + 1
    assert identity.bytes_read < 64 << 10


@pytest.fixture(scope="module")
def engine_configs(tiny_model):
    """Real VllmConfig objects of the tiny model, as vLLM builds them from its flags."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    from vllm_marks import skip_without_device_type

    skip_without_device_type()
    from vllm.engine.arg_utils import EngineArgs

    model = tiny_model

    def build(**kw):
        kw.setdefault("dtype", "float32")
        return EngineArgs(model=model, enforce_eager=True, max_model_len=2048, **kw).create_engine_config()

    return build


@needs_vllm
def test_every_kv_relevant_engine_flag_changes_the_identity(engine_configs):
    base = identity_digest(config_identity(engine_configs()))
    assert identity_digest(config_identity(engine_configs())) == base
    # Scheduler and memory settings do not change KV values.
    assert identity_digest(config_identity(engine_configs(max_num_seqs=3, gpu_memory_utilization=0.5))) == base
    changes = {
        "hf_overrides rope_theta": {"hf_overrides": {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}},
        "rope scaling": {"hf_overrides": {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear",
                                                              "factor": 2.0}}},
        "revision": {"revision": "v2"},
        "code_revision": {"code_revision": "abc"},
        "kv cache dtype fp8": {"kv_cache_dtype": "fp8"},
        "kv cache dtype fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
        "compute dtype": {"dtype": "bfloat16"},
        "lora": {"enable_lora": True, "max_lora_rank": 8},
    }
    digests = {name: identity_digest(config_identity(engine_configs(**kw))) for name, kw in changes.items()}
    assert base not in digests.values()
    assert len(set(digests.values())) == len(digests), digests


@needs_vllm
def test_quantization_is_part_of_the_identity(engine_configs):
    # The CPU build refuses --quantization fp8 for this model at config time,
    # so the resolved config is changed the way that flag sets it.
    config = engine_configs()
    quantized = copy.copy(config)
    quantized.model_config = copy.copy(config.model_config)
    object.__setattr__(quantized.model_config, "quantization", "fp8")
    assert identity_digest(config_identity(quantized)) != identity_digest(config_identity(config))


def test_the_cost_script_samples_every_tensor_of_a_llama_shaped_checkpoint(tmp_path):
    import importlib.util as iu

    script = Path(__file__).resolve().parents[2] / "scripts" / "weights_identity_cost.py"
    spec = iu.spec_from_file_location("weights_identity_cost", script)
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    count, size = mod.build_sparse_checkpoint(tmp_path, layers=2, shards=2)
    assert count == 2 * 9 + 3 and size > 4e9  # embeddings and lm_head alone are 4.2 GB
    identity = weights_identity(tmp_path)
    assert identity.tensors == count
    # per shard: header length + header; 3 samples a tensor; config.json
    assert identity.reads == 2 * 2 + 3 * count + 1
