"""Start-up checks of NvmeOffloadingSpec that need the chunk size (known only
once vLLM describes the KV cache): built from a real vLLM OffloadingConfig,
no engine process."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

BYTES_PER_BLOCK = 65536  # 2 blocks per chunk -> 128 KiB of KV, a 132 KiB file


def _config(extra: dict):
    from offloading_configs import tiny_offloading_config

    return tiny_offloading_config(extra, bytes_per_block=BYTES_PER_BLOCK)


def _spec(tmp_path, **extra):
    from pykvcache.vllm.spec import NvmeOffloadingSpec

    extra.setdefault("storage_dirs", [str(tmp_path / "kv")])
    extra.setdefault("capacity_bytes", "1GiB")
    extra.setdefault("staging_bytes", "8MiB")
    return NvmeOffloadingSpec(_config(extra))


def test_capacity_below_one_chunk_is_refused_at_start_up(tmp_path):
    from pykvcache.vllm.config import ConfigError

    chunk_file = 4096 + 2 * BYTES_PER_BLOCK
    with pytest.raises(ConfigError, match=rf"capacity_bytes=8192 is smaller than one chunk file \({chunk_file} bytes"):
        _spec(tmp_path, capacity_bytes=8192)
    assert _spec(tmp_path, capacity_bytes=chunk_file).settings.capacity_bytes == chunk_file


def test_staging_beyond_the_slot_limit_names_the_key_and_what_fits(tmp_path):
    from pykvcache.vllm.config import ConfigError

    with pytest.raises(ConfigError) as info:
        _spec(tmp_path, staging_bytes="100TiB")
    message = str(info.value)
    most = 65535 * (4096 + 2 * BYTES_PER_BLOCK)
    assert "staging_bytes" in message and f"at most {most}" in message, message


def test_storage_keys_reach_the_engine(tmp_path):
    """allow_insecure_root (the world-writable error tells vLLM users to set
    it) and the free-space reserve are passed to the BlockStore."""
    from pykvcache._core import StagingPool
    from pykvcache.vllm.config import ConfigError

    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(ConfigError, match="world-writable.*allow_insecure_root"):
        _spec(tmp_path, storage_dirs=[str(open_dir)])
    spec = _spec(tmp_path, storage_dirs=[str(open_dir)], allow_insecure_root=True, min_free_bytes="64MiB")
    pool = StagingPool(spec.layout.payload_bytes, 4)
    store = spec._open_store(pool)
    try:
        assert store.stats()["min_free_bytes"] == [64 << 20]
    finally:
        store.close()
        pool.close()


def test_the_first_stats_report_lists_every_counter_at_zero():
    """With the stock OffloadingConnector vLLM creates a series on its first
    observation: the manager's first report carries every counter (at 0)."""
    from pykvcache.vllm.metrics import COUNTERS, PREFIX, ManagerMetrics

    metrics = ManagerMetrics()
    first = metrics.take_stats()
    assert first is not None
    values = first.reduce()
    assert all(values[PREFIX + name] == 0 for name in COUNTERS)
    assert metrics.take_stats() is None, "then only increments"
    metrics.inc("disk_reads")
    assert metrics.take_stats().reduce() == {PREFIX + "disk_reads": 1}


def test_the_connector_checks_settings_in_vllms_front_end_hook(tmp_path):
    """requires_piecewise_for_cudagraph is what vLLM calls with the settings
    while it builds its config (CUDA graphs on), before any model loads."""
    from pykvcache.vllm.config import ConfigError
    from pykvcache.vllm.connector import PyKvCacheConnector

    good = {"storage_dirs": [str(tmp_path / "kv")], "capacity_bytes": "1GiB"}
    assert PyKvCacheConnector.requires_piecewise_for_cudagraph(good) is False
    with pytest.raises(ConfigError, match="capacity_bytes"):
        PyKvCacheConnector.requires_piecewise_for_cudagraph({**good, "capacity_bytes": "infGiB"})


def test_a_kind_of_write_failure_is_logged_once_and_counted_always(tmp_path, caplog):
    """A store that cannot keep its free-space reserve refuses every write:
    one warning, not one per chunk; write_errors counts each."""
    import logging

    from pykvcache import BlockStore
    from test_vllm_manager import LAYOUT, Harness

    h = Harness(tmp_path / "kv")
    h.manager.store.close()
    h.manager.store = BlockStore(h.dirs, h.pool, namespace="test-ns", capacity_bytes=1 << 30, min_free_bytes=(1 << 62))
    try:
        with caplog.at_level(logging.DEBUG, logger="vllm.pykvcache"):
            h.store([1, 2, 3])
            h.settle()
        failed = [r for r in caplog.records if "write of chunk" in r.getMessage()]
        assert [r.levelno for r in failed] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
        assert "min_free_bytes" in failed[0].getMessage()
        assert h.manager.metrics.totals["write_errors"] == 3
        assert LAYOUT.payload_bytes > 0
    finally:
        h.close()


@pytest.mark.parametrize("verify", ["full", "header"])
def test_verify_key_reaches_the_engine(tmp_path, verify):
    """``verify: "header"`` (for storage that checksums itself) opens the
    BlockStore in header-only mode: its chunks carry no payload CRC and say so
    in their header (flag 1); the default writes the CRC."""
    import struct

    from pykvcache._core import StagingPool

    spec = _spec(tmp_path, **({"verify": verify} if verify != "full" else {}))
    assert spec.settings.verify == verify
    pool = StagingPool(spec.layout.payload_bytes, 4)
    store = spec._open_store(pool)
    try:
        slot = pool.acquire()
        assert store.put(b"chunk", slot, spec.layout.payload_bytes).wait(10).ok
    finally:
        store.close()
        pool.close()
    [path] = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "kv") for f in fs if f.endswith(".kvc")]
    with open(path, "rb") as f:
        flags = struct.unpack_from("<I", f.read(64), 52)[0]
    assert flags == (1 if verify == "header" else 0)


def test_verify_key_is_checked(tmp_path):
    from pykvcache.vllm.config import ConfigError

    with pytest.raises(ConfigError, match="verify must be one of full, header"):
        _spec(tmp_path, verify="none")


def test_the_chunk_size_checks_come_with_every_other_problem(tmp_path):
    """Where the chunk size is first known (the spec), what it makes of capacity_bytes and
    staging_bytes is reported with the keys' own problems, not one start after them."""
    from pykvcache.vllm.config import ConfigError

    with pytest.raises(ConfigError) as info:
        _spec(tmp_path, capacity_bytes=8192, staging_bytes=2 * (4096 + 2 * BYTES_PER_BLOCK), capacty="1GiB", model_id="../x")
    text = "\n".join(info.value.problems)
    for fragment in (
        "unknown key(s) 'capacty'",
        "model_id must be a label",
        "capacity_bytes=8192 is smaller than one chunk file",
        "staging_bytes=270336 holds 2 chunk(s)",
    ):
        assert fragment in text, (fragment, text)
    assert len(info.value.problems) == 4 and str(info.value).count("invalid pykvcache") == 1, str(info.value)
