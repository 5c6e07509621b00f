"""HIT for chunks whose disk reads are in flight (decision 0055), engine-free.

The manager (scheduler side) and pykvcache's real worker share one memfd
staging region, mapped twice as in vLLM (the worker attaches through /proc);
the store lives on a real FUSE filesystem that can be stalled on command
(tests/helpers/stall_fs.py), so a read is really in flight while the
worker's copy waits for it. A child process waits on a ready word through its
own mapping for the cross-process case.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
base = pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from pykvcache import BlockStore, StagingPool  # noqa: E402
from pykvcache.vllm.layout import ChunkLayout  # noqa: E402
from pykvcache.vllm.scheduler.manager import NvmeOffloadingManager  # noqa: E402
from pykvcache.vllm.scheduler.staging_cache import EntryState  # noqa: E402
from pykvcache.vllm.transfer_spec import StagingSlotsSpec  # noqa: E402
from pykvcache.vllm.worker.staging_worker import StagingWorker  # noqa: E402
from stall_fs import StallFs, skip_reason  # noqa: E402

LookupResult = base.LookupResult
ReqContext = base.ReqContext
ScheduleEndContext = base.ScheduleEndContext

NUM_BLOCKS = 16
PAGE = 256
BPC = 2
LAYOUT = ChunkLayout(BPC, bytes_per_block=2 * PAGE, world_size=1)
KEY = (7).to_bytes(32, "big") + (0).to_bytes(4, "big")

needs_fuse = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))


def _kv_caches():
    gen = torch.Generator().manual_seed(5)
    tensors = [
        base.CanonicalKVCacheTensor(
            tensor=torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen), page_size_bytes=PAGE
        )
        for _ in range(2)
    ]
    refs = [[base.CanonicalKVCacheRef(tensor_idx=t, page_size_bytes=PAGE) for t in (0, 1)]]
    return base.CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def _gpu(blocks):
    return base.GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])


#: Region names unique in this process: a worker attaches by name, and a
#: name built from ``id()`` can be reused while an earlier rig's region is
#: still open, which the new worker would then attach instead.
_RIGS = itertools.count()


class Rig:
    """Manager + store on ``directory`` + a worker attached to the same memfd."""

    def __init__(self, directory, io_deadline):
        self.name = f"pykvcache-test-inflight-{os.getpid()}-{next(_RIGS)}"
        self.pool = StagingPool(LAYOUT.payload_bytes, 6, shm_name=self.name, memfd=True)
        self.store = BlockStore([str(directory)], self.pool, namespace="inflight", capacity_bytes=1 << 30, io_deadline=io_deadline)
        self.manager = NvmeOffloadingManager(pool=self.pool, store=self.store, layout=LAYOUT)
        self.kv = _kv_caches()
        self.original = [t.tensor.clone() for t in self.kv.tensors]
        self.worker = StagingWorker(self.kv, LAYOUT, self.name, rank=0)

    def store_chunk(self):
        """Blocks 2, 3 stored as one chunk, written to disk, gone from staging."""
        ctx = ReqContext(req_id="writer")
        out = self.manager.prepare_store([KEY], ctx)
        assert self.worker.submit_store(1, _gpu([2, 3]), out.store_spec)
        assert [r.job_id for r in self.worker.get_finished()] == [1]
        self.manager.complete_store(out.keys_to_store, ctx)
        self.manager.flush(timeout=10)
        assert self.manager.metrics.totals["disk_writes"] == 1
        self.manager.cache.remove(KEY)  # as if evicted from staging: on disk only

    def reads_settled(self):
        """The scheduler's view of the reads once they ended. The engine
        settles a slot's ready word just before it completes the op, so the
        worker can finish its copy a moment before the scheduler's handle says
        done; vLLM's scheduler sees it at its next step, a test waits for it
        (a bare poll right after the copy lost that race in a CI run)."""
        self.manager.flush(timeout=10)

    def loaded_blocks(self):
        return [t.tensor[10:12].clone() for t in self.kv.tensors]

    def expected_blocks(self):
        return [orig[2:4] for orig in self.original]

    def zero_destination(self):
        for t in self.kv.tensors:
            t.tensor[10:12] = 0

    def submit_load(self, spec, dst=(10, 11), job_id=2):
        """``submit_load`` as vLLM's step calls it: it must return at once,
        whatever the reads do (decision 0065)."""
        start = time.monotonic()
        assert self.worker.submit_load(job_id, spec, _gpu(list(dst)))
        took = time.monotonic() - start
        assert took < 0.3, f"submit_load blocked the step for {took:.2f} s"

    def poll_until_finished(self, job_id=2, timeout=10.0):
        """Polls ``get_finished`` as vLLM does once per step (every 10 ms
        here) until the job is reported; its results and the time it took."""
        start = time.monotonic()
        while True:
            done = self.worker.get_finished()
            if done:
                assert [r.job_id for r in done] == [job_id], done
                return done, time.monotonic() - start
            assert time.monotonic() - start < timeout, "the load never finished"
            time.sleep(0.01)

    def close(self):
        import gc

        self.worker.shutdown()
        del self.worker
        gc.collect()
        self.manager.shutdown()


@pytest.fixture
def stall_fs(tmp_path):
    with StallFs(tmp_path) as fs:
        yield fs


def _first_lookup_is_a_hit_in_flight(rig, req="r"):
    rig.manager.enable_in_flight_hits()
    ctx = ReqContext(req_id=req)
    assert rig.manager.lookup(KEY, ctx) is LookupResult.HIT, "first lookup of an on-disk chunk"
    assert rig.manager.staged_state(KEY) is EntryState.READING, "the read is in flight"
    totals = rig.manager.metrics.totals
    assert totals["lookup_in_flight_hits"] == 1 and totals["lookups_deferred"] == 0
    spec = rig.manager.prepare_load([KEY], ctx)
    assert spec.ready_generations and spec.ready_generations[0] > 0, spec.ready_generations
    # The worker's backstop: by then the engine has settled every read.
    assert spec.wait_s == rig.store.stats()["io_verdict_bound_s"] == 9 * rig.store.stats()["io_deadline_s"]
    return ctx, spec


@needs_fuse
def test_first_lookup_is_a_hit_and_the_load_waits_for_verified_bytes_outside_the_step(stall_fs):
    rig = Rig(stall_fs.mount_point, io_deadline=10.0)
    try:
        rig.store_chunk()
        rig.zero_destination()
        stall_fs.stall()  # the read cannot end until resume()
        ctx, spec = _first_lookup_is_a_hit_in_flight(rig)
        rig.submit_load(spec)
        for _ in range(25):  # steps while the read is stalled: nothing finishes, nothing copied
            assert rig.worker.get_finished() == []
            time.sleep(0.02)
        assert all(not t.any() for t in rig.loaded_blocks()), "nothing copied before the read ended"
        stall_fs.resume()
        done, _ = rig.poll_until_finished()
        assert [(r.job_id, r.success, r.transfer_size) for r in done] == [(2, True, 2 * 2 * PAGE)]
        assert rig.worker.take_failed_loads() == set()
        for got, want in zip(rig.loaded_blocks(), rig.expected_blocks()):
            assert torch.equal(got, want), "verified bytes of the chunk"
        rig.reads_settled()
        assert rig.manager.staged_state(KEY) is EntryState.READY
        rig.manager.complete_load([KEY], ctx)
        assert rig.manager.cache.get(KEY).evictable
    finally:
        stall_fs.resume()
        rig.close()


@needs_fuse
def test_an_idle_step_sleeps_until_the_read_ends_not_longer(stall_fs):
    """A step that computes nothing sleeps on the load's read (decision
    0065): woken when the read ends, not at its bound, and at once when no
    load waits."""
    rig = Rig(stall_fs.mount_point, io_deadline=10.0)
    try:
        rig.store_chunk()
        rig.zero_destination()
        start = time.monotonic()
        rig.worker.wait_for_reads(5.0)
        assert time.monotonic() - start < 0.5, "nothing pending: no sleep"
        stall_fs.stall()
        ctx, spec = _first_lookup_is_a_hit_in_flight(rig)
        rig.submit_load(spec)
        start = time.monotonic()
        rig.worker.wait_for_reads(0.3)  # the read is stalled: the bound ends the sleep
        assert 0.25 < time.monotonic() - start < 2.0
        timer = threading.Timer(0.3, stall_fs.resume)
        timer.start()
        start = time.monotonic()
        rig.worker.wait_for_reads(5.0)
        slept = time.monotonic() - start
        timer.join()
        assert 0.2 < slept < 3.0, f"slept {slept:.2f} s: woken by the read, not the 5 s bound"
        done = rig.worker.get_finished()
        assert [(r.job_id, r.transfer_size) for r in done] == [(2, 2 * 2 * PAGE)]
        rig.reads_settled()
        rig.manager.complete_load([KEY], ctx)
    finally:
        stall_fs.resume()
        rig.close()


KEY2 = (7).to_bytes(32, "big") + (1).to_bytes(4, "big")


def _staged_and_in_flight(rig, stall_fs):
    """A two-chunk prefix (blocks 2-5): KEY verified in staging, KEY2 on disk
    only, its read stalled in flight; the load's destination (10-13) zeroed."""
    writer = ReqContext(req_id="writer")
    out = rig.manager.prepare_store([KEY, KEY2], writer)
    assert rig.worker.submit_store(1, _gpu([2, 3, 4, 5]), out.store_spec)
    rig.worker.get_finished()
    rig.manager.complete_store(out.keys_to_store, writer)
    rig.manager.flush(timeout=10)
    rig.manager.cache.remove(KEY2)
    for t in rig.kv.tensors:
        t.tensor[10:14] = 0
    stall_fs.stall()
    rig.manager.enable_in_flight_hits()
    ctx = ReqContext(req_id="r")
    assert [rig.manager.lookup(k, ctx) for k in (KEY, KEY2)] == [LookupResult.HIT] * 2
    spec = rig.manager.prepare_load([KEY, KEY2], ctx)
    assert spec.ready_generations[0] == 0 and spec.ready_generations[1] > 0, spec.ready_generations
    return ctx, spec


@needs_fuse
def test_each_chunk_is_copied_as_its_read_ends(stall_fs):
    """Decision 0057: a load of a staged chunk and a chunk read in flight
    copies the first at once and the second when its read ends, not both
    after the last read."""
    rig = Rig(stall_fs.mount_point, io_deadline=10.0)
    try:
        ctx, spec = _staged_and_in_flight(rig, stall_fs)
        rig.submit_load(spec, dst=(10, 11, 12, 13))
        first = [orig[2:4] for orig in rig.original]
        assert all(torch.equal(t.tensor[10:12], want) for t, want in zip(rig.kv.tensors, first)), (
            "the staged chunk is copied when the load is submitted"
        )
        assert rig.worker.get_finished() == [], "the load still waits for the second read"
        assert all(not t.tensor[12:14].any() for t in rig.kv.tensors), "nothing of the chunk still being read"
        stall_fs.resume()
        done, _ = rig.poll_until_finished()
        assert rig.worker.take_failed_loads() == set()
        assert [(r.job_id, r.success, r.transfer_size) for r in done] == [(2, True, 4 * 2 * PAGE)]
        for t, orig in zip(rig.kv.tensors, rig.original):
            assert torch.equal(t.tensor[10:14], orig[2:6])
        rig.manager.poll_io()
        rig.manager.complete_load([KEY, KEY2], ctx)
    finally:
        stall_fs.resume()
        rig.close()


@needs_fuse
def test_a_failed_read_stops_the_copy_at_its_chunk(stall_fs):
    rig = Rig(stall_fs.mount_point, io_deadline=0.5)
    try:
        ctx, spec = _staged_and_in_flight(rig, stall_fs)
        rig.worker.report_load_failures = True
        rig.submit_load(spec, dst=(10, 11, 12, 13))
        rig.poll_until_finished()
        assert rig.worker.take_failed_loads() == {2}, "vLLM recomputes the job's blocks"
        for t, orig in zip(rig.kv.tensors, rig.original):
            assert torch.equal(t.tensor[10:12], orig[2:4]), "the verified chunk was copied"
            assert not t.tensor[12:14].any(), "nothing of the chunk whose read failed"
        rig.manager.poll_io()
        rig.manager.complete_load([KEY, KEY2], ctx)
    finally:
        stall_fs.resume()
        rig.close()


@needs_fuse
def test_a_read_past_the_deadline_is_a_failed_load_and_copies_nothing(stall_fs):
    rig = Rig(stall_fs.mount_point, io_deadline=0.5)
    try:
        rig.store_chunk()
        rig.zero_destination()
        rig.worker.report_load_failures = True  # as PyKvCacheConnector sets it
        stall_fs.stall()
        ctx, spec = _first_lookup_is_a_hit_in_flight(rig)
        rig.submit_load(spec)
        done, took = rig.poll_until_finished()
        # Bounded by the I/O deadline (the worker's own bound, or the engine's
        # verdict if that comes first), never by the stall.
        assert 0.4 < took < 0.5 + 1, f"waited {took:.2f} s"
        assert rig.worker.take_failed_loads() == {2}
        assert [(r.job_id, r.success, r.transfer_size) for r in done] == [(2, True, 0)]
        assert all(not t.any() for t in rig.loaded_blocks()), "nothing copied from a failed read"
        # The engine's watchdog abandons the read (within 8 deadlines while the
        # directory answers nothing) and settles the word failed.
        slot, generation = int(spec.block_ids[0]), spec.ready_generations[0]
        deadline = time.monotonic() + 10
        while rig.pool.ready_state(slot) != (generation, "failed"):
            assert time.monotonic() < deadline, rig.pool.ready_state(slot)
            time.sleep(0.02)
        # The scheduler side: the read's miss keeps the slot while the load
        # holds it (FAILED, never a hit), then frees it.
        rig.reads_settled()
        entry = rig.manager.cache.get(KEY)
        assert entry is not None and entry.state is EntryState.FAILED
        assert rig.manager.metrics.totals["in_flight_read_failures"] == 1
        assert rig.manager.stage(KEY) is LookupResult.MISS
        rig.manager.complete_load([KEY], ctx)
        assert rig.manager.cache.get(KEY) is None, "freed once the load let go"
    finally:
        stall_fs.resume()
        rig.close()


@needs_fuse
def test_a_chunk_corrupted_while_its_read_waits_is_a_failed_load(stall_fs):
    rig = Rig(stall_fs.mount_point, io_deadline=10.0)
    try:
        rig.store_chunk()
        files = [p for p in stall_fs.backing.rglob("*.kvc")]
        assert len(files) == 1
        rig.zero_destination()
        rig.worker.report_load_failures = True
        stall_fs.stall()
        ctx, spec = _first_lookup_is_a_hit_in_flight(rig)
        # Between lookup and load the file changes under the store (a bad
        # sector, another writer): one payload byte flipped, on the backing side.
        with open(files[0], "r+b") as f:
            f.seek(4096 + 100)
            byte = f.read(1)
            f.seek(4096 + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        rig.submit_load(spec)
        time.sleep(0.2)
        stall_fs.resume()
        rig.poll_until_finished()
        assert rig.worker.take_failed_loads() == {2}
        assert all(not t.any() for t in rig.loaded_blocks()), "nothing copied from a corrupt chunk"
        rig.reads_settled()
        assert rig.manager.metrics.totals["corrupt_chunks"] == 1
        assert rig.manager.metrics.totals["in_flight_read_failures"] == 1
        rig.manager.complete_load([KEY], ctx)
        # The engine removed the file: the request's next lookup is a miss (recompute).
        assert rig.manager.lookup(KEY, ReqContext(req_id="r")) is LookupResult.MISS
    finally:
        stall_fs.resume()
        rig.close()


def test_a_ready_word_of_a_recycled_slot_is_never_taken_as_ready(tmp_path):
    pool = StagingPool(LAYOUT.payload_bytes, 1)
    store = BlockStore([str(tmp_path)], pool, namespace="gen", capacity_bytes=1 << 30)
    try:
        for name in (b"one", b"two"):
            slot = pool.acquire()
            view = pool.view(slot)
            view[:] = bytes([name[0]]) * LAYOUT.payload_bytes
            view.release()
            assert store.put(name, slot, LAYOUT.payload_bytes).wait(10).ok
            pool.release(slot)
        slot = pool.acquire()
        assert store.get(b"one", slot).wait(10).ok
        first, state = pool.ready_state(slot)
        assert first > 0 and state == "ready"
        assert pool.wait_ready([slot], [first], 1.0) == ["ready"]
        # The slot is read again for another chunk: a waiter for the first
        # read must not see the second one's verdict as its own.
        assert store.get(b"two", slot).wait(10).ok
        second, state = pool.ready_state(slot)
        assert second != first and state == "ready"
        assert pool.wait_ready([slot], [first], 1.0) == ["recycled"]
        assert pool.wait_ready([slot], [second], 1.0) == ["ready"]
        # A miss settles failed.
        assert store.get(b"absent", slot).wait(10).status == "miss"
        third, state = pool.ready_state(slot)
        assert third != second and state == "failed"
        assert pool.wait_ready([slot], [third], 1.0) == ["failed"]
        pool.release(slot)
    finally:
        store.close()
        pool.close()


def test_a_worker_without_failure_reporting_never_copies_a_failed_chunk():
    """Under the stock OffloadingConnector nobody would tell vLLM: raise, never copy."""
    name = f"pykvcache-test-inflight-stock-{os.getpid()}"
    pool = StagingPool(LAYOUT.payload_bytes, 2, shm_name=name, memfd=True)
    kv = _kv_caches()
    before = [t.tensor.clone() for t in kv.tensors]
    worker = StagingWorker(kv, LAYOUT, name, rank=0)
    try:
        spec = StagingSlotsSpec([0], ready_generations=[-1], wait_s=1.0)
        with pytest.raises(RuntimeError, match="does not report failed loads"):
            worker.submit_load(3, spec, _gpu([10, 11]))
        assert all(torch.equal(t.tensor, b) for t, b in zip(kv.tensors, before))
    finally:
        import gc

        del worker
        gc.collect()
        pool.close()


def test_a_worker_in_another_process_waits_on_the_scheduler_s_word(tmp_path):
    """Cross-process: the scheduler's store settles the word, a child process
    (its own mapping of the memfd, found through /proc as a vLLM worker finds
    it) waits on it."""
    name = f"pykvcache-test-inflight-xproc-{os.getpid()}"
    pool = StagingPool(LAYOUT.payload_bytes, 2, shm_name=name, memfd=True)
    store = BlockStore([str(tmp_path)], pool, namespace="xproc", capacity_bytes=1 << 30)
    try:
        slot = pool.acquire()
        assert store.put(b"k", slot, LAYOUT.payload_bytes).wait(10).ok
        pool.release(slot)
        slot = pool.acquire()
        handle = store.get(b"k", slot)
        assert handle.wait(10).ok
        generation, _ = pool.ready_state(slot)
        child = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from pykvcache._core import StagingPool as P; p = P.attach_memfd(sys.argv[1]); "
                "print(p.wait_ready([int(sys.argv[2])], [int(sys.argv[3])], 5.0)[0], "
                "p.wait_ready([int(sys.argv[2])], [int(sys.argv[3]) + 1], 0.1)[0])",
                name,
                str(slot),
                str(generation),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ},
        )
        assert child.returncode == 0, child.stderr
        assert child.stdout.split() == ["ready", "recycled"]
        pool.release(slot)
    finally:
        store.close()
        pool.close()


def test_without_in_flight_hits_the_first_lookup_still_defers(tmp_path):
    """The stock OffloadingConnector's path (no failure reporting): HIT_PENDING, counted."""
    pool = StagingPool(LAYOUT.payload_bytes, 4)
    store = BlockStore([str(tmp_path)], pool, namespace="stock", capacity_bytes=1 << 30)
    manager = NvmeOffloadingManager(pool=pool, store=store, layout=LAYOUT)
    try:
        slot = pool.acquire()
        assert store.put(KEY, slot, LAYOUT.payload_bytes).wait(10).ok
        pool.release(slot)
        assert manager.lookup(KEY, ReqContext(req_id="r")) is LookupResult.HIT_PENDING
        assert manager.metrics.totals["lookups_deferred"] == 1
    finally:
        manager.shutdown()


@needs_fuse
def test_a_step_that_hands_out_a_load_in_flight_is_timed_as_compute(stall_fs):
    """The step no longer contains the wait for the disk (decision 0065), so
    the gate's prefill model learns from it like from any other step."""
    from pykvcache.gate import ProfileExpectation, build_gate
    from pykvcache.vllm.scheduler.gate_plan import GateWiring

    rig = Rig(stall_fs.mount_point, io_deadline=10.0)
    try:
        rig.store_chunk()
        gate, _ = build_gate(
            None,
            ProfileExpectation(model="m", dtype="float32", kv_bytes_per_token=LAYOUT.payload_bytes // 64, chunk_tokens=64),
            enabled=False,
            steps=True,
        )
        rig.manager.gating = GateWiring(gate, chunk_tokens=64, chunk_bytes=LAYOUT.payload_bytes)
        seen = []
        rig.manager.gating.steps._observe = lambda work, seconds: seen.append((work, seconds)) or True
        stall_fs.stall()
        ctx, spec = _first_lookup_is_a_hit_in_flight(rig)
        rig.manager.step_scheduled([(0, 1024)])  # this step hands out the load
        rig.submit_load(spec)  # returns at once: the step ends without the read
        rig.manager.step_finished()
        rig.manager.step_scheduled([(0, 1024)])  # a plain prefill step
        rig.manager.step_finished()
        assert [work for work, _ in seen] == [[(0, 1024)]] * 2, seen
        assert seen[0][1] < 0.3, "the step's time holds no disk wait"
        stall_fs.resume()
        rig.poll_until_finished()
        rig.manager.flush(timeout=10)
        rig.manager.complete_load([KEY], ctx)
    finally:
        stall_fs.resume()
        rig.close()


@needs_fuse
def test_a_chunk_looked_up_again_while_its_read_is_in_flight_counts_once(stall_fs):
    """vLLM looks a waiting request's chunks up at every scheduling attempt until it is
    admitted: the counter read 8,328 for 9 requests of ~14 chunks. It counts reads: one per
    chunk read in flight, however many lookups (and requests) asked while it was."""
    rig = Rig(stall_fs.mount_point, io_deadline=10.0)
    try:
        rig.store_chunk()
        stall_fs.stall()
        ctx, _spec = _first_lookup_is_a_hit_in_flight(rig)  # counted 1 there
        for req in (ctx.req_id, "another"):
            for _ in range(5):  # the scheduler's next attempts, and a second request on the same prefix
                assert rig.manager.lookup(KEY, ReqContext(req_id=req)) is LookupResult.HIT
        assert rig.manager.metrics.totals["lookup_in_flight_hits"] == 1
        stall_fs.resume()
        rig.reads_settled()
        rig.manager.complete_load([KEY], ctx)
    finally:
        stall_fs.resume()
        rig.close()


def test_a_load_whose_reads_all_ended_is_traced_as_one_copy_then_done(tmp_path):
    """gate_trace's load path (decision 0082) when every read ended before the
    worker got the load: one copy of every chunk, then ``load_done`` (the
    disk-hit part times the load's end from it)."""
    rig = Rig(tmp_path / "kv", io_deadline=10.0)
    try:
        rig.store_chunk()
        ctx = ReqContext(req_id="r")
        deadline = time.monotonic() + 10
        while rig.manager.lookup(KEY, ctx) is not LookupResult.HIT:
            assert time.monotonic() < deadline, "the read never ended"
            rig.reads_settled()
        spec = rig.manager.prepare_load([KEY], ctx)
        assert not any(getattr(spec, "ready_generations", None) or ()), "every read ended"
        events = []
        rig.worker.trace = lambda ev, **fields: events.append((ev, fields))
        rig.submit_load(spec)
        rig.poll_until_finished()
        assert [ev for ev, _ in events] == ["load_in", "copied", "load_done"], events
        assert events[1][1]["chunks"] == 1
        assert all(torch.equal(a, b) for a, b in zip(rig.loaded_blocks(), rig.expected_blocks()))
    finally:
        rig.close()
