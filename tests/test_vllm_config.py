"""Validation of kv_connector_extra_config (no vLLM process)."""

from __future__ import annotations

import os

import pytest

from pykvcache.vllm.config import GIB, ConfigError, parse_extra_config


def _base(tmp_path, **extra):
    return {"spec_name": "NvmeOffloadingSpec", "spec_module_path": "pykvcache.vllm",
            "storage_dirs": [str(tmp_path / "kv")], "capacity_bytes": 10 * GIB, **extra}


def test_minimal_config_gets_documented_defaults(tmp_path):
    cfg = parse_extra_config(_base(tmp_path))
    assert cfg.storage_dirs == (str(tmp_path / "kv"),)
    assert cfg.capacity_bytes == 10 * GIB
    assert cfg.staging_bytes == 1 * GIB
    assert (cfg.queue_depth, cfg.backend, cfg.direct_io) == (32, "auto", "optional")
    assert cfg.offload_prompt_only is False
    assert cfg.register_buffers is True and cfg.wipe_on_reset is True
    assert cfg.model_id is None and cfg.namespace_salt == ""


def test_all_problems_reported_in_one_error(tmp_path):
    bad = {"spec_name": "NvmeOffloadingSpec", "queue_depth": 0, "backend": "spdk",
           "direct_io": "yes", "offload_prompt_only": "true", "capcity_bytes": 5,
           "staging_bytes": -1}
    with pytest.raises(ConfigError) as info:
        parse_extra_config(bad)
    message = str(info.value)
    for fragment in ("storage_dirs is required", "capacity_bytes is required",
                     "queue_depth must be a positive integer", "backend must be one of",
                     "direct_io must be one of", "offload_prompt_only must be true or false",
                     "unknown key(s) 'capcity_bytes'", "staging_bytes must be"):
        assert fragment in message, fragment
    assert isinstance(info.value, ValueError)


def test_sizes_accept_binary_and_decimal_suffixes(tmp_path):
    cfg = parse_extra_config(_base(tmp_path, capacity_bytes="2TiB", staging_bytes="512MiB"))
    assert cfg.capacity_bytes == 2 << 40
    assert cfg.staging_bytes == 512 << 20
    assert parse_extra_config(_base(tmp_path, capacity_bytes="3GB")).capacity_bytes == 3 * 10**9
    for bad in ("lots", "0GiB", True, 0, "-5MiB", 1.5):
        with pytest.raises(ConfigError, match="capacity_bytes"):
            parse_extra_config(_base(tmp_path, capacity_bytes=bad))


def test_chunk_size_keys(tmp_path):
    assert parse_extra_config(_base(tmp_path, block_size=256)).block_size == 256
    assert parse_extra_config(_base(tmp_path, blocks_per_chunk=4)).blocks_per_chunk == 4
    with pytest.raises(ConfigError, match="only one of block_size"):
        parse_extra_config(_base(tmp_path, block_size=256, blocks_per_chunk=4))
    with pytest.raises(ConfigError, match="block_size must be a positive integer"):
        parse_extra_config(_base(tmp_path, block_size="256"))


def test_storage_dirs_forms_and_errors(tmp_path):
    cfg = parse_extra_config(_base(tmp_path, storage_dirs=str(tmp_path / "a")))
    assert cfg.storage_dirs == (str(tmp_path / "a"),)
    rel = parse_extra_config(_base(tmp_path, storage_dirs=["rel/dir"]))
    assert rel.storage_dirs == (os.path.abspath("rel/dir"),)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for bad, fragment in (([], "non-empty list"), ([str(a_file)], "not a directory"),
                          ([str(tmp_path), str(tmp_path)], "twice"), ([""], "non-empty paths"),
                          (5, "non-empty list")):
        with pytest.raises(ConfigError, match=fragment):
            parse_extra_config(_base(tmp_path, storage_dirs=bad))


def test_identity_keys(tmp_path):
    cfg = parse_extra_config(_base(tmp_path, model_id="llama-3b@rev7", namespace_salt="tenantA"))
    assert (cfg.model_id, cfg.namespace_salt) == ("llama-3b@rev7", "tenantA")
    with pytest.raises(ConfigError, match="model_id"):
        parse_extra_config(_base(tmp_path, model_id=""))



def test_kv_transfer_config_helper_builds_a_valid_config(tmp_path):
    from pykvcache.vllm.config import kv_transfer_config

    kv = kv_transfer_config([str(tmp_path / "kv")], "2GiB", block_size=64)
    assert kv["kv_connector"] == "OffloadingConnector" and kv["kv_role"] == "kv_both"
    cfg = parse_extra_config(kv["kv_connector_extra_config"])
    assert cfg.capacity_bytes == 2 * GIB and cfg.storage_dirs == (str(tmp_path / "kv"),)


def test_preformat_keys(tmp_path):
    cfg = parse_extra_config(_base(tmp_path))
    assert cfg.preformat is False and cfg.preformat_max_s == 300.0
    cfg = parse_extra_config(_base(tmp_path, preformat=True, preformat_max_s=30))
    assert cfg.preformat is True and cfg.preformat_max_s == 30.0
    for bad in (0, -1, float("nan"), float("inf"), "60", True):
        with pytest.raises(ConfigError, match="preformat_max_s must be"):
            parse_extra_config(_base(tmp_path, preformat=True, preformat_max_s=bad))
    assert parse_extra_config(_base(tmp_path, preformat="background")).preformat == "background"
    for bad in ("yes", 1, 0, None):
        with pytest.raises(ConfigError, match="preformat must be true, false or"):
            parse_extra_config(_base(tmp_path, preformat=bad))
