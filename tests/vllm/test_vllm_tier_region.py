"""The tier's two data paths (decision 0062): with ``cpu_tier_io: "direct"``
chunks move straight between vLLM's CPU-tier region and the disk (the region
registered with the engine once), on every engine fallback; rows the engine
cannot transfer (not whole 4 KiB pages) are copied through staging slots,
said once in the log; the default copies, and a bad value is refused. Driven
as test_vllm_tier.py drives the tier, through vLLM's tiering manager."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import time

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

from test_vllm_tier import TIER, Scheduler, _keys, _payload  # noqa: E402


def _spec(tmp_path, bytes_per_block, num_chunks=8, **tier_keys):
    from offloading_configs import tiny_offloading_config
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    tier = {
        **TIER,
        "storage_dirs": [str(tmp_path / "kv")],
        "capacity_bytes": "64MiB",
        "fingerprint_weights": False,
        "gate": False,
        "cpu_tier_io": "direct",
        **tier_keys,
    }
    config = tiny_offloading_config({}, engine_id="tier-region", bytes_per_block=bytes_per_block)
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "blocks_per_chunk": 2,
        "cpu_bytes_to_use": num_chunks * 2 * bytes_per_block,
        "secondary_tiers": [tier],
    }
    return TieringOffloadingSpec(dataclasses.replace(config, extra_config=extra))


def _store_and_load(s: Scheduler, keys):
    s.store(keys)
    s.reset()
    s.primary[:] = 0  # what is loaded must come from the disk
    hits, data = s.load(keys)
    assert hits == keys
    assert all(np.array_equal(d, _payload(k, s.primary.shape[1])) for k, d in zip(keys, data))


@pytest.mark.parametrize(
    "tier_keys",
    [
        {"backend": "threads", "verify": "header"},
        {"direct_io": "disabled", "register_buffers": False},
    ],
    ids=["threads-header", "buffered-no-fixed"],
)
def test_chunks_move_straight_from_and_to_the_cpu_tier_on_every_fallback(tmp_path, tier_keys):
    from pykvcache.vllm.tier import MIN_TIER_SLOTS

    s = Scheduler(_spec(tmp_path, 16384, **tier_keys))
    try:
        store = s.tier.store
        assert s.tier._region is not None and store.region_count == 1
        assert s.tier.pool.num_slots == MIN_TIER_SLOTS  # no staging slot per chunk
        _store_and_load(s, _keys("region", 4))
        assert store.stats()["writes"] == 4 and store.stats()["read_hits"] == 4
    finally:
        s.close()
    assert store.region_count == 0, "shutdown releases the CPU tier's region before vLLM unmaps it"


def test_rows_of_partial_pages_are_copied_through_staging_said_once(tmp_path, caplog, monkeypatch):
    import pykvcache.vllm.tier as tier

    # vLLM pads its CPU tier's rows to whole pages: 8 KiB "pages" make its
    # 12 KiB rows partial ones, the case of a layout that is not.
    monkeypatch.setattr(tier, "PAGE", 8192)
    caplog.set_level(logging.WARNING, logger="vllm.pykvcache.tier")
    s = Scheduler(_spec(tmp_path, 6144))
    try:
        assert s.tier.chunk_bytes == 12288
        assert s.tier._region is None and s.tier.store.region_count == 0
        _store_and_load(s, _keys("copied", 3))
    finally:
        s.close()
    said = [r for r in caplog.records if "copied through staging slots" in r.getMessage()]
    assert len(said) == 1 and "whole number of 8192-byte pages" in said[0].getMessage()


def test_the_default_copies_through_staging_and_a_bad_mode_is_refused(tmp_path, caplog):
    from pykvcache.vllm.config import ConfigError
    from pykvcache.vllm.tier import MIN_TIER_SLOTS, tier_settings

    caplog.set_level(logging.WARNING, logger="vllm.pykvcache.tier")
    s = Scheduler(_spec(tmp_path, 16384, cpu_tier_io="copy"))
    try:
        assert s.tier._region is None and s.tier.store.region_count == 0
        assert s.tier.pool.num_slots > MIN_TIER_SLOTS
        _store_and_load(s, _keys("default", 3))
    finally:
        s.close()
    assert not [r for r in caplog.records if "copied through staging" in r.getMessage()], "the default is no warning"
    with pytest.raises(ConfigError, match="cpu_tier_io"):
        tier_settings({"storage_dirs": [str(tmp_path / "kv")], "cpu_tier_io": "zero-copy"})


def test_a_read_abandoned_on_a_stalled_directory_holds_its_promotion_until_the_kernel_lets_go(tmp_path):
    """Decision 0062's known limitation, closed: a region read the I/O deadline
    abandoned may still land bytes in its CPU-tier row when the directory
    answers. Its promotion job (a miss for that chunk) ends only once the read
    really ended, so vLLM never reuses the row under it; before, the job
    failed at the deadline with the read still in the kernel."""
    from stall_fs import StallFs, skip_reason
    from vllm.v1.kv_offload.base import LookupResult

    if skip_reason() is not None:
        pytest.skip(skip_reason())
    keys = _keys("abandoned", 1)
    with StallFs(tmp_path / "fuse") as fs:
        s = Scheduler(_spec(tmp_path, 16384, storage_dirs=[str(fs.mount_point)], io_deadline_s=0.5))
        try:
            assert s.tier._region is not None
            s.store(keys)
            s.reset()
            store = s.tier.store
            fs.stall()
            ctx = s.ctx(keys)
            pending = (LookupResult.HIT_PENDING, LookupResult.RETRY)  # vLLM waits for the promotion
            assert s.manager.lookup(keys[0], ctx) in pending  # the promotion starts
            s.step()
            # Past the deadline (abandoned within a few deadlines), while the directory stays silent.
            deadline = time.monotonic() + 10
            while not store.stats()["stuck_ops"]:
                assert time.monotonic() < deadline, "the read was never abandoned"
                s.step()
                time.sleep(0.05)
            for _ in range(20):  # a second more of scheduler steps: the job must not end
                s.step()
                assert s.manager.lookup(keys[0], ctx) in pending, "the promotion ended under a live read"
                assert s.tier.has_pending_work()
                time.sleep(0.05)
            fs.resume()
            deadline = time.monotonic() + 20
            while s.tier.has_pending_work():
                assert time.monotonic() < deadline, "the promotion never ended after the directory answered"
                s.step()
                time.sleep(0.02)
            assert store.stats()["stuck_ops"] == 0, "the job ended only after the kernel let go of the row"
            assert s.tier.metrics.totals["unavailable_reads"] == 1, "the abandoned read failed its chunk"
            s.manager.on_request_finished(ctx)
            time.sleep(1.1)  # the key is not read again for a second (DiskPresence)
            hits, data = s.load(keys)  # the chunk was kept: read again once the directory answers
            assert hits == keys and np.array_equal(data[0], _payload(keys[0], s.primary.shape[1]))
        finally:
            fs.resume()
            s.close()
