"""Demand reads before preloads at the device (decision 0061): what a new read
waits behind, a lookup promoting the queued preload of its chunk, and the byte
bound on preloads in flight. A stalled FUSE mount keeps reads in flight.

Over a real staging pool and store (tests/helpers/manager_harness.py).
"""

from __future__ import annotations

import time

import pytest
from manager_harness import CHUNK, Harness, ReqContext, break_even_gate, chunk_key, chunk_payload, learning_gate
from pykvcache.gate import LoadCost


def test_queued_bytes_count_what_a_new_read_waits_behind(tmp_path):
    """The gate prices a load behind the demand reads and writes the engine
    has not finished: not prefetches (a demand read overtakes them), not
    writes still queued in the manager (submitted after it), not I/O that
    finished but is collected only at the next step. Counting those made
    loads look faster than predicted (the gate learnt a disk capped at 200
    MB/s as 0.4-7 GB/s). A stalled FUSE mount keeps reads in flight."""
    from stall_fs import StallFs, skip_reason

    if (why := skip_reason()) is not None:
        pytest.skip(why)
    with StallFs(tmp_path / "fs") as fs:
        h = Harness(fs.mount_point, num_slots=16, lookahead_slots=8, window=4)
        try:
            keys = [chunk_key(i) for i in range(1, 7)]
            h.on_disk_only(keys)
            assert h.m.queued_bytes() == 0
            # A stored chunk whose write is not submitted yet is not ahead of a read.
            ctx = ReqContext(req_id="writer")
            out = h.m.prepare_store([chunk_key(50)], ctx)
            view = h.pool.view(int(out.store_spec.block_ids[0]))
            view[:] = chunk_payload(chunk_key(50))
            view.release()
            h.m.complete_store(out.keys_to_store, ctx)
            fs.stall()
            assert h.m.queued_bytes() == 0
            h.m.io.submit_writes()  # handed to the engine, stuck on the mount: ahead of a read
            assert h.m.queued_bytes() == CHUNK
            h.m.stage(keys[0], background=True)  # prefetches: a demand read overtakes them
            h.m.stage(keys[1], background=True)
            assert len(h.m.io.reads) == 2 and h.m.queued_bytes() == CHUNK
            h.m.stage(keys[2])  # a demand read
            assert h.m.queued_bytes() == 2 * CHUNK
            fs.resume()
            handles = list(h.m.io.reads.values()) + list(h.m.io.writes.values())
            deadline = time.monotonic() + 30
            while not all(x.done() for x in handles):
                assert time.monotonic() < deadline, "I/O did not finish after the mount resumed"
                time.sleep(0.01)
            # Finished, not collected yet (no step has polled): nothing to wait behind.
            assert len(h.m.io.reads) == 3 and h.m.queued_bytes() == 0
            h.settle()
            assert not h.m.io.prefetching
        finally:
            fs.resume()
            h.close()


def test_a_lookup_promotes_the_queued_preload_of_its_chunk(tmp_path):
    """A preload its request now needs must not wait behind the other preloads
    (decision 0061): the lookup raises its queued prefetch to demand priority.
    A stalled FUSE mount keeps the preloads queued (their opens wait)."""
    from stall_fs import StallFs, skip_reason

    if (why := skip_reason()) is not None:
        pytest.skip(why)
    with StallFs(tmp_path / "fs") as fs:
        h = Harness(fs.mount_point, num_slots=32, lookahead_slots=16, window=4, gate=break_even_gate())
        try:
            keys = [chunk_key(i) for i in range(1, 7)]
            other = [chunk_key(i) for i in range(20, 24)]
            h.on_disk_only(keys + other)
            fs.stall()
            h.queue("r0", other, arrival=1.0)
            h.queue("r1", keys, arrival=2.0)
            assert h.m.io.prefetching == set(keys + other)  # all queued, none started
            ctx, hits = h.probe("r1", keys)
            assert hits is None  # still reading: the request waits
            m = h.m.metrics.totals
            assert m["lookahead_promoted_reads"] == 6 and h.store_obj.stats()["promotions"] == 6
            # Now demand reads (a new read waits behind them); r0's stay preloads.
            assert h.m.io.prefetching == set(other)
            assert h.m.queued_bytes() == 6 * CHUNK
            h.probe("r1", keys)  # asked again: promoted once
            assert m["lookahead_promoted_reads"] == 6
            fs.resume()
            h.settle()
            ctx, hits = h.probe("r1", keys)
            assert hits == 6
            h.load(ctx, keys)
            assert m["lookahead_promoted_reads"] == 6 and h.store_obj.stats()["promotions"] == 6
        finally:
            fs.resume()
            h.close()


def test_the_preload_byte_budget_follows_the_device_speed_the_gate_learns(tmp_path):
    from pykvcache._core import chunk_file_bytes
    from pykvcache.vllm.scheduler.disk_io import PRELOAD_YIELD_S

    gate = learning_gate(LoadCost(fixed_s=1e-3, disk_bytes_per_s=1e9, h2d_bytes_per_s=1e15))
    h = Harness(tmp_path / "kv", num_slots=16, gate=gate)
    try:
        keys = [chunk_key(i) for i in range(8)]
        h.on_disk_only(keys)
        # Nothing learnt yet: one chunk (decision 0061; before, no byte bound at all).
        assert h.store_obj.background_budget == chunk_file_bytes(CHUNK)
        h.m.get_stats()
        assert h.m.metrics.gauges["disk_background_budget_bytes"] == chunk_file_bytes(CHUNK)
        h.probe("r", keys[:4])
        h.settle()
        assert gate.online.samples == 1
        expected = max(chunk_file_bytes(CHUNK), int(gate.online.disk_bytes_per_s * PRELOAD_YIELD_S))
        assert h.store_obj.background_budget == expected
        h.m.get_stats()
        assert h.m.metrics.gauges["disk_background_budget_bytes"] == expected
    finally:
        h.close()
    # A manager whose gate does not learn the device keeps the engine's own bound.
    h = Harness(tmp_path / "kv2", num_slots=16)
    try:
        assert h.store_obj.background_budget is None
    finally:
        h.close()
