"""The scheduler-side manager over a real staging pool and a real on-disk store.

No vLLM engine: the test plays the connector's part, calling the manager in the
order vLLM does, and writes chunk bytes into slots the way a worker does.
"""

from __future__ import annotations

import errno
import glob
import os
import time

import pytest
from fault_marks import NEEDS_FAULT_INJECTION
from pykvcache import BlockStore, StagingPool
from pykvcache.vllm.layout import ChunkLayout
from pykvcache.vllm.metrics import metric_definitions
from pykvcache.vllm.scheduler.manager import NvmeOffloadingManager

vllm_base = pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")
LookupResult = vllm_base.LookupResult
ReqContext = vllm_base.ReqContext
ScheduleEndContext = vllm_base.ScheduleEndContext

LAYOUT = ChunkLayout(blocks_per_chunk=2, bytes_per_block=8192, world_size=1)


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def _payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(LAYOUT.payload_bytes))


def _found_by_name(manager, key: bytes, timeout: float = 10.0) -> bool:
    """``manager.on_disk(key)`` for a chunk another engine published: the name's
    lstat waits on the directory's worker at most ``PROBE_WAIT`` (250 ms), which a
    loaded host can exceed; the late answer is indexed, so asking again finds it."""
    deadline = time.monotonic() + timeout
    while not manager.on_disk(key):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Harness:
    def __init__(self, directory, num_slots=6, capacity_bytes=1 << 30, **store_keys):
        self.pool = StagingPool(LAYOUT.payload_bytes, num_slots)
        self.dirs = [str(directory)]

        def open_store():
            return BlockStore(self.dirs, self.pool, namespace="test-ns", capacity_bytes=capacity_bytes, **store_keys)

        self.manager = NvmeOffloadingManager(pool=self.pool, store=open_store(), layout=LAYOUT, reopen_store=open_store, enable_events=True)

    def store(self, indices, req="r"):
        ctx = ReqContext(req_id=req)
        keys = [_key(i) for i in indices]
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
            view = self.pool.view(int(slot))
            view[:] = _payload(int.from_bytes(key[:32], "big"))
            view.release()
        self.manager.complete_store(out.keys_to_store, ctx)
        return out

    def step(self):
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=[]))

    def settle(self, timeout=10.0):
        deadline = time.monotonic() + timeout
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "I/O did not finish"
            self.step()
            time.sleep(0.001)

    def lookup_until_final(self, key, req="r", timeout=10.0):
        ctx = ReqContext(req_id=req)
        deadline = time.monotonic() + timeout
        seen = []
        while True:
            result = self.manager.lookup(key, ctx)
            seen.append(result)
            if result in (LookupResult.HIT, LookupResult.MISS):
                return result, seen
            assert time.monotonic() < deadline
            self.step()
            time.sleep(0.001)

    def slot_bytes(self, slot):
        view = self.pool.view(int(slot))
        data = bytes(view[: LAYOUT.payload_bytes])
        view.release()
        return data

    def close(self):
        self.manager.shutdown()


@pytest.fixture
def harness(tmp_path):
    h = Harness(tmp_path / "kv")
    yield h
    h.close()


def test_store_is_hit_pending_then_hit_and_written_once_per_step(harness):
    ctx = ReqContext(req_id="r")
    out = harness.manager.prepare_store([_key(1), _key(2)], ctx)
    assert out.keys_to_store == [_key(1), _key(2)]
    # Slot being filled by a worker: pending, never a HIT before the copy completes.
    assert harness.manager.lookup(_key(1), ctx) is LookupResult.HIT_PENDING
    assert harness.manager.metrics.totals["lookups_deferred_storing"] == 1
    for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
        view = harness.pool.view(int(slot))
        view[:] = _payload(int.from_bytes(key[:32], "big"))
        view.release()
    harness.manager.complete_store(out.keys_to_store, ctx)
    assert harness.manager.lookup(_key(1), ctx) is LookupResult.HIT
    # Writes are batched: nothing is submitted before the step ends.
    assert not harness.manager.store.contains(_key(1))
    assert harness.manager.has_pending_work()
    harness.settle()
    assert harness.manager.store.contains(_key(1)) and harness.manager.store.contains(_key(2))
    assert harness.manager.metrics.totals["disk_writes"] == 2
    # Already staged or on disk: not stored again.
    again = harness.manager.prepare_store([_key(1), _key(2)], ctx)
    assert again.keys_to_store == []


def test_a_request_whose_load_failed_misses_until_it_finishes(harness):
    # vLLM recomputes it (kv_load_failure_policy="recompute"); a second load
    # would need its blocks twice in vLLM 0.32's admission (the e2e test
    # test_a_load_that_times_out_on_a_slow_disk_is_recomputed_in_a_small_kv_cache).
    harness.store([1])
    harness.settle()
    failed, other = ReqContext(req_id="failed"), ReqContext(req_id="other")
    assert harness.manager.lookup(_key(1), failed) is LookupResult.HIT
    harness.manager.loads_failed({"failed"})
    assert harness.manager.lookup(_key(1), failed) is LookupResult.MISS
    assert harness.manager.lookup(_key(1), other) is LookupResult.HIT, "other requests still load it"
    harness.manager.on_request_finished(failed)
    assert harness.manager.lookup(_key(1), ReqContext(req_id="failed")) is LookupResult.HIT, "a later request of that id"


def test_chunk_evicted_from_staging_is_read_back_verified(harness):
    harness.store([1])
    harness.settle()
    harness.store([10, 11, 12, 13, 14, 15])  # six slots: pushes chunk 1 out
    harness.settle()
    assert harness.manager.staged_state(_key(1)) is None
    result, seen = harness.lookup_until_final(_key(1))
    assert result is LookupResult.HIT and seen[0] is LookupResult.HIT_PENDING
    assert harness.manager.metrics.totals["lookups_deferred_storing"] == 0, "a read, not a store"
    spec = harness.manager.prepare_load([_key(1)], ReqContext(req_id="r"))
    assert harness.slot_bytes(spec.block_ids[0]) == _payload(1)
    assert harness.manager.metrics.totals["disk_read_bytes"] >= LAYOUT.payload_bytes
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    assert harness.manager.get_load_source(_key(1), ReqContext(req_id="r")) is CacheHitSource.DISK
    harness.manager.complete_load([_key(1)], ReqContext(req_id="r"))


def test_loading_chunks_are_pinned_until_complete_load(harness):
    harness.store([1, 2])
    harness.settle()
    ctx = ReqContext(req_id="a")
    assert harness.manager.lookup(_key(1), ctx) is LookupResult.HIT
    harness.manager.prepare_load([_key(1)], ctx)
    harness.store([20, 21, 22, 23, 24])
    harness.settle()
    assert harness.manager.staged_state(_key(1)) is not None  # pinned: survived
    assert harness.manager.staged_state(_key(2)) is None  # not pinned: evicted
    harness.manager.complete_load([_key(1)], ctx)
    assert harness.manager.cache.get(_key(1)).evictable


def test_missing_and_corrupt_chunks_are_misses(harness, tmp_path):
    ctx = ReqContext(req_id="r")
    assert harness.manager.lookup(_key(99), ctx) is LookupResult.MISS
    harness.store([3])
    harness.settle()
    harness.manager.cache.remove(_key(3))  # as if evicted from staging
    files = glob.glob(os.path.join(str(tmp_path / "kv"), "**", "*.kvc"), recursive=True)
    assert len(files) == 1
    with open(files[0], "r+b") as f:
        f.seek(os.path.getsize(files[0]) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    result, seen = harness.lookup_until_final(_key(3))
    assert result is LookupResult.MISS
    assert harness.manager.metrics.totals["corrupt_chunks"] == 1
    assert harness.manager.lookup(_key(3), ctx) is LookupResult.MISS  # no second read
    assert not harness.manager.store.contains(_key(3))
    removed = [e for e in harness.manager.take_events() if e.removed]
    assert removed and removed[-1].keys == [_key(3)]


def test_full_staging_defers_when_writes_will_free_slots_else_truncates(tmp_path):
    h = Harness(tmp_path / "kv", num_slots=6)
    try:
        # Five slots held by queued disk writes: they free up within a step,
        # so a batch that fits then is deferred (None = retried by vLLM).
        h.store([0, 1, 2, 3, 4])
        assert h.manager.prepare_store([_key(50), _key(51)], ReqContext(req_id="x")) is None
        assert h.manager.metrics.totals["store_deferred"] == 1
        h.settle()
        assert len(h.manager.prepare_store([_key(50), _key(51)], ReqContext(req_id="x")).keys_to_store) == 2
        # Four slots now being filled by workers (not freeing soon), two
        # evictable: a batch of four stores its two leading chunks only.
        ctx = ReqContext(req_id="busy")
        busy = h.manager.prepare_store([_key(10 + i) for i in range(2)], ctx)
        assert len(busy.keys_to_store) == 2
        big = h.manager.prepare_store([_key(60 + i) for i in range(4)], ReqContext(req_id="y"))
        assert big.keys_to_store == [_key(60), _key(61)]
        assert h.manager.metrics.totals["store_truncated_chunks"] == 2
        assert h.manager.prepare_store([_key(70)], ReqContext(req_id="z")) is None
        h.manager.complete_store(busy.keys_to_store, ctx, success=False)
        assert h.manager.cache.allocatable() == 2
    finally:
        h.close()


def test_request_holds_looked_up_chunks_until_scheduled(harness):
    harness.store([1, 2])
    harness.settle()
    ctx = ReqContext(req_id="waiting")
    assert harness.manager.lookup(_key(1), ctx) is LookupResult.HIT
    harness.store([30, 31, 32, 33])
    harness.settle()
    # Chunk 1 is held for the waiting request; chunk 2 was not looked up.
    assert harness.manager.staged_state(_key(1)) is not None
    harness.manager.on_schedule_end(ScheduleEndContext(new_req_ids=["waiting"], preempted_req_ids=[]))
    assert harness.manager.cache.get(_key(1)).evictable


def test_persistence_reset_and_declared_stats(tmp_path):
    first = Harness(tmp_path / "kv")
    first.store([1, 2, 3])
    first.close()  # shutdown flushes the queued writes
    second = Harness(tmp_path / "kv")
    try:
        assert len(second.manager.store) == 3
        result, _ = second.lookup_until_final(_key(2))
        assert result is LookupResult.HIT
        stats = second.manager.get_stats()
        declared = set(metric_definitions())
        emitted = set(stats.data["data"])
        assert emitted and emitted <= declared
        assert "vllm:pykvcache_disk_capacity_bytes" in emitted
        second.manager.reset_cache()
        assert len(second.manager.store) == 0 and len(second.manager.cache) == 0
        assert second.manager.lookup(_key(1), ReqContext(req_id="r")) is LookupResult.MISS
    finally:
        second.close()


def test_chunks_published_by_another_engine_become_hits(tmp_path):
    """Two engines share one directory: a chunk the other one stored after
    this one opened is found (one lstat, rate-limited per key) and served.
    Walks off here: with the default, the walk that starts when the other
    writer appears may index the chunk before the lookup probes it."""
    ours = Harness(tmp_path, refresh_interval_s=None)
    theirs = Harness(tmp_path)
    assert ours.lookup_until_final(_key(7))[0] == LookupResult.MISS
    theirs.store([7])
    theirs.settle()
    result, _ = ours.lookup_until_final(_key(7))
    # Probed absent less than a second ago: asked again once the key may be probed again
    # (a loaded host once needed more than one more second: the vLLM 0.33 stage at nice 10).
    deadline = time.monotonic() + 10
    while result == LookupResult.MISS and time.monotonic() < deadline:
        time.sleep(1.05)
        result, _ = ours.lookup_until_final(_key(7))
    assert result == LookupResult.HIT
    slot = ours.manager.prepare_load([_key(7)], ReqContext(req_id="r")).block_ids[0]
    with ours.pool.view(int(slot)) as view:
        assert bytes(view[: LAYOUT.payload_bytes]) == _payload(7)
    assert ours.manager.metrics.totals["peer_chunks_found"] == 1


def test_background_preformat_fills_the_store_yields_to_stores_and_restarts_after_a_wipe(tmp_path):
    file_bytes = 4096 + LAYOUT.payload_bytes
    capacity = 20 * file_bytes
    pool = StagingPool(LAYOUT.payload_bytes, 6)

    def open_store():
        return BlockStore([str(tmp_path)], pool, namespace="test-ns", capacity_bytes=capacity)

    manager = NvmeOffloadingManager(pool=pool, store=open_store(), layout=LAYOUT, reopen_store=open_store)
    manager.start_background_preformat()
    assert manager._preformatter.finished.wait(30)
    assert manager.store.stats()["filler_chunks"] == 20 and len(manager.store) == 0
    ctx = ReqContext(req_id="r")
    keys = [_key(i) for i in range(5)]
    out = manager.prepare_store(keys, ctx)
    for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
        with pool.view(int(slot)) as view:
            view[:] = _payload(int.from_bytes(key[:32], "big"))
    manager.complete_store(out.keys_to_store, ctx)
    manager.flush(timeout=30)
    stats = manager.store.stats()
    # Each write takes a filler's place; it recycles the file unless the claim
    # finds it locked (then it writes a fresh file and the filler is unlinked).
    assert len(manager.store) == 5 and stats["filler_chunks"] == 15
    assert stats["recycled_files"] >= 1 and stats["recycled_files"] + stats["recycle_skipped"] == 5
    manager.reset_cache()  # wipes the files: the preformatter starts again on the new store
    assert manager._preformatter is not None and manager._preformatter.finished.wait(30)
    assert manager.store.stats()["filler_chunks"] == 20
    manager.shutdown()
    assert manager._preformatter is None


def _event_keys(events, removed):
    Medium = vllm_base.Medium
    out = []
    for e in events:
        assert e.medium is Medium.STORAGE, e
        if e.removed == removed:
            out.extend(e.keys)
    return out


def test_disk_stores_and_capacity_evictions_reach_the_kv_event_stream(tmp_path):
    """vLLM's KV events (take_events -> OffloadingEvent, medium STORAGE): a
    chunk is announced once written, and announced removed when the engine
    evicts it for capacity (before: only failed reads and resets were, so a
    router kept scoring this node for prefixes it no longer had)."""
    from pykvcache._core import chunk_file_bytes

    h = Harness(tmp_path / "kv", num_slots=6, capacity_bytes=3 * chunk_file_bytes(LAYOUT.payload_bytes))
    try:
        for i in (0, 1, 2):  # one at a time: concurrent writes publish (enter the LRU) in any order
            h.store([i])
            h.settle()
        events = list(h.manager.take_events())
        assert sorted(_event_keys(events, removed=False)) == [_key(0), _key(1), _key(2)]
        assert _event_keys(events, removed=True) == []
        h.store([3, 4])  # evicts the two least recently used: 0 and 1
        h.settle()
        events = list(h.manager.take_events())
        assert sorted(_event_keys(events, removed=False)) == [_key(3), _key(4)]
        assert sorted(_event_keys(events, removed=True)) == [_key(0), _key(1)]
        assert not h.manager.store.contains(_key(0)) and h.manager.store.contains(_key(2))
        assert list(h.manager.take_events()) == []  # each change announced once
    finally:
        h.close()


def test_a_chunk_another_node_removed_is_announced_removed_after_a_refresh(tmp_path):
    """Two managers on one directory (two nodes of a shared filesystem): the
    node that stored a chunk announces its removal when its refresh finds
    that the other node evicted it."""
    a, b = Harness(tmp_path / "kv"), Harness(tmp_path / "kv")
    try:
        a.store([7])
        a.settle()
        assert _event_keys(a.manager.take_events(), removed=False) == [_key(7)]
        assert _found_by_name(b.manager, _key(7))  # found by name on B
        assert b.manager.store.evict(_key(7))
        assert list(a.manager.take_events()) == []  # A cannot know yet
        assert a.manager.store.refresh() == (0, 1)
        assert _event_keys(a.manager.take_events(), removed=True) == [_key(7)]
        assert _event_keys(b.manager.take_events(), removed=True) == []  # B never announced it
    finally:
        a.close()
        b.close()


def _chunk_files(directory) -> dict[str, bytes]:
    paths = glob.glob(os.path.join(str(directory), "**", "*.kvc"), recursive=True)
    return {p: open(p, "rb").read() for p in sorted(paths)}


def test_a_verify_header_writers_chunks_survive_a_full_verifying_manager(tmp_path):
    """A verify="full" engine sharing the directory with a verify="header" writer
    cannot serve the writer's chunks (no payload checksum); the manager then evicted, so
    deleted, every one it read. The engine keeps them (miss kind ``kept``): the files stay,
    the next lookups miss without a read, and the writer still serves them."""
    writer = Harness(tmp_path / "kv", verify="header")
    reader = Harness(tmp_path / "kv")
    try:
        writer.store([4, 5])
        writer.settle()
        before = _chunk_files(tmp_path / "kv")
        assert len(before) == 2
        assert _found_by_name(reader.manager, _key(4))  # found by name (published after the reader opened)
        result, _ = reader.lookup_until_final(_key(4))
        assert result is LookupResult.MISS
        assert _chunk_files(tmp_path / "kv") == before, "the writer's chunks are left as they are"
        assert reader.manager.metrics.totals["kept_chunks"] == 1
        assert reader.manager.lookup(_key(4), ReqContext(req_id="again")) is LookupResult.MISS
        assert reader.manager.metrics.totals["kept_chunks"] == 1, "no second read"
        assert reader.manager.store.stats()["corrupt_chunks"] == 0
        writer.manager.cache.remove(_key(4))  # as if evicted from staging: read from disk
        assert writer.lookup_until_final(_key(4), req="w")[0] is LookupResult.HIT
        slot = writer.manager.prepare_load([_key(4)], ReqContext(req_id="w")).block_ids[0]
        assert writer.slot_bytes(slot) == _payload(4)
        writer.manager.complete_load([_key(4)], ReqContext(req_id="w"))
    finally:
        reader.close()
        writer.close()


@NEEDS_FAULT_INJECTION
def test_a_read_error_the_engine_cannot_judge_deletes_no_chunk(tmp_path):
    """A read that fails with an errno that says nothing about the file (EINVAL, injected into
    the transfer): before, the manager evicted the chunk after any ``error``, deleting it."""
    writer = Harness(tmp_path / "kv")
    writer.store([8])
    writer.close()
    before = _chunk_files(tmp_path / "kv")
    reader = Harness(tmp_path / "kv", _fault_fail_nth=(1, errno.EINVAL))
    try:
        result, _ = reader.lookup_until_final(_key(8))
        assert result is LookupResult.MISS
        assert reader.manager.metrics.totals["read_errors"] == 1
        assert _chunk_files(tmp_path / "kv") == before
    finally:
        reader.close()


def test_a_corrupt_chunk_is_removed_once_by_the_engine(harness, tmp_path):
    """The engine removes a corrupt chunk when it finds it (miss kind ``corrupt``); the
    manager forgets it and announces it removed, once, and deletes nothing itself."""
    harness.store([3, 6])
    harness.settle()
    harness.manager.cache.remove(_key(3))
    assert len(_event_keys(harness.manager.take_events(), removed=False)) == 2
    files = _chunk_files(tmp_path / "kv")
    victim = next(p for p, data in files.items() if data[4096 : 4096 + 64] == _payload(3)[:64])
    with open(victim, "r+b") as f:
        f.seek(4096 + 100)
        f.write(b"\xff")
    assert harness.lookup_until_final(_key(3))[0] is LookupResult.MISS
    assert sorted(_chunk_files(tmp_path / "kv")) == sorted(p for p in files if p != victim)
    assert harness.manager.store.stats()["corrupt_chunks"] == 1
    assert harness.manager.metrics.totals["corrupt_chunks"] == 1
    assert len(harness.manager.store) == 1
    assert _event_keys(harness.manager.take_events(), removed=True) == [_key(3)]
    assert harness.lookup_until_final(_key(3))[0] is LookupResult.MISS
    assert harness.manager.metrics.totals["corrupt_chunks"] == 1, "no second read"
    assert list(harness.manager.take_events()) == []


def test_many_corrupt_chunks_log_one_warning_then_a_summary(harness, tmp_path, caplog):
    # One WARNING line per corrupt chunk (65 for one
    # attack). Now: the first in full, the rest counted into one summary.
    import logging

    indices = list(range(40, 52))
    for start in range(0, len(indices), 4):
        harness.store(indices[start : start + 4])
        harness.settle()
    for i in indices:
        harness.manager.cache.remove(_key(i))  # as if evicted from staging
    files = glob.glob(os.path.join(str(tmp_path / "kv"), "**", "*.kvc"), recursive=True)
    assert len(files) == len(indices)
    for path in files:
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            byte = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([byte[0] ^ 1]))
    with caplog.at_level(logging.WARNING):
        for i in indices:
            result, _ = harness.lookup_until_final(_key(i), req=f"r{i}")
            assert result is LookupResult.MISS
        assert harness.manager.metrics.totals["corrupt_chunks"] == len(indices)
        lines = [r.getMessage() for r in caplog.records if "unusable" in r.getMessage()]
        assert len(lines) == 1, lines
        assert "corrupt" in lines[0] and "summarised" in lines[0]
        harness.close()  # the summary of the rest comes out at shutdown
    lines = [r.getMessage() for r in caplog.records if "unusable" in r.getMessage()]
    assert len(lines) == 2 and f"{len(indices) - 1} more" in lines[1] and "corrupt" in lines[1], lines


def test_unusable_chunk_summaries_come_at_most_once_per_interval(caplog):
    import logging

    from pykvcache.vllm.logs import ChunkTroubleLog

    now = [0.0]
    log = ChunkTroubleLog(logging.getLogger("test.trouble"), "unusable chunks", interval_s=60, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.trouble"):
        for i in range(65):  # one attack: 64 corrupt chunks and an I/O error, within 2 s
            now[0] = i / 32
            log.report(b"\x01%d" % i, "error" if i == 30 else "corrupt", "payload checksum mismatch")
        assert len(caplog.records) == 1
        now[0] = 61.0
        log.report(b"\x02", "corrupt", "bad header")  # the interval has passed: the summary
        assert len(caplog.records) == 2
        assert "65 more in the last 61 s (corrupt 64, error 1)" in caplog.records[1].getMessage()
        assert "bad header" in caplog.records[1].getMessage()
        log.flush()  # nothing counted since: no line
        assert len(caplog.records) == 2
