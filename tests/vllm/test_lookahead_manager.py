"""Lookahead preloading and gate wiring in the manager, over a real staging pool
and a real on-disk store (io_uring reads, verified chunks).

No vLLM engine: the test plays the scheduler (probe the head of the queue,
load, run a few steps, finish) and the connector (queue every request at
arrival), and checks the staged bytes the "worker" would copy.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from pathlib import Path

import pytest

from pykvcache import BlockStore, StagingPool
from pykvcache.gate import AdmissionGate, CostModel, LoadCost, PrefillCurve, StoreAdmission
from pykvcache.vllm.scheduler.gate_plan import GateWiring
from pykvcache.vllm.layout import ChunkLayout
from pykvcache.vllm.scheduler.lookahead import WaitingRequest
from pykvcache.vllm.scheduler.manager import NvmeOffloadingManager
from pykvcache.vllm.metrics import COUNTERS, GAUGES, metric_definitions
from pykvcache.vllm.scheduler.staging_cache import LOOKAHEAD, LOOKUP

vllm_base = pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")
LookupResult = vllm_base.LookupResult
ReqContext = vllm_base.ReqContext
ScheduleEndContext = vllm_base.ScheduleEndContext

LAYOUT = ChunkLayout(blocks_per_chunk=2, bytes_per_block=8192, world_size=1)
CT = 64  # tokens per chunk
CHUNK = LAYOUT.payload_bytes


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def _payload(key: bytes) -> bytes:
    i = int.from_bytes(key[:32], "big")
    return bytes((i * 7 + j) % 251 for j in range(CHUNK))


def _gate(break_even_chunks: float | None = None) -> AdmissionGate:
    """A gate whose break-even is ``break_even_chunks`` chunks (None: loads from
    the first chunk). Linear prefill, tiny per-byte load cost: break-even =
    fixed / b."""
    bpt = CHUNK / CT
    load = LoadCost(fixed_s=1e-3, disk_bytes_per_s=1e15, h2d_bytes_per_s=1e15)
    b = 1.0 if break_even_chunks is None else 1e-3 / (break_even_chunks * CT)
    return AdmissionGate(CostModel(PrefillCurve(0.0, b, 0.0), load, bpt), chunk_tokens=CT,
                         online=None)


class Harness:
    def __init__(self, directory, *, num_slots, lookahead_slots=0, window=0,
                 hold_slots=None, gate=None, admission=None, store_min_tokens=0):
        self.pool = StagingPool(CHUNK, num_slots)
        self.store_obj = BlockStore([str(directory)], self.pool, namespace="la-ns",
                                    capacity_bytes=1 << 30)
        gating = None
        if gate is not None:
            gating = GateWiring(gate, chunk_tokens=CT, chunk_bytes=CHUNK, admission=admission,
                                store_min_tokens=store_min_tokens)
        self.m = NvmeOffloadingManager(pool=self.pool, store=self.store_obj, layout=LAYOUT,
                                       gating=gating, lookahead_slots=lookahead_slots,
                                       lookahead_requests=window, lookup_hold_slots=hold_slots)

    def ctx(self, rid, keys):
        c = ReqContext(req_id=rid)
        for i, k in enumerate(keys):
            c.set_offload_key_position(k, (i + 1) * CT)
        return c

    def write_to_disk(self, keys):
        """Store chunks the way vLLM does, a few per step, until all are on disk."""
        pending = list(keys)
        while pending:
            batch = pending[: max(1, self.m.allocatable_slots() - 1)]
            ctx = ReqContext(req_id="writer")
            out = self.m.prepare_store(batch, ctx)
            if out is None:
                self.step()
                continue
            for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
                view = self.pool.view(int(slot))
                view[:] = _payload(key)
                view.release()
            self.m.complete_store(out.keys_to_store, ctx)
            pending = pending[len(batch):]
            self.settle()

    def on_disk_only(self, keys):
        """Store ``keys`` to disk, then empty staging: they come back only by a read."""
        self.write_to_disk(keys)
        self.m.cache.clear()

    def step(self, scheduled=()):
        self.m.on_schedule_end(ScheduleEndContext(new_req_ids=list(scheduled),
                                                  preempted_req_ids=[]))

    def settle(self, timeout=10.0):
        deadline = time.monotonic() + timeout
        while self.m.has_pending_work():
            assert time.monotonic() < deadline, "I/O did not finish"
            self.step()
            time.sleep(0.0005)

    def probe(self, rid, keys):
        """vLLM's prefix lookup: stop at the first MISS; None if it must wait."""
        ctx = self.ctx(rid, keys)
        hits, wait = 0, False
        for k in keys:
            r = self.m.lookup(k, ctx)
            if r is LookupResult.MISS:
                break
            if r is LookupResult.RETRY:
                wait = True
                continue
            hits += 1
            wait |= r is LookupResult.HIT_PENDING
        return ctx, (None if wait else hits)

    def load(self, ctx, keys):
        spec = self.m.prepare_load(keys, ctx)
        for key, slot in zip(keys, spec.block_ids):
            view = self.pool.view(int(slot))
            data = bytes(view[:CHUNK])
            view.release()
            assert data == _payload(key), "staged bytes differ from what was stored"
        self.m.complete_load(keys, ctx)

    def queue(self, rid, keys, arrival):
        self.m.lookahead_add(WaitingRequest(req_id=rid, key_lists=[keys], arrival=arrival))

    def close(self):
        self.m.shutdown()


def _run_queue(h, requests, *, run_steps=2, check=None, max_steps=5000):
    """max_num_seqs=1: the head is probed when nothing runs; a scheduled request
    runs ``run_steps`` steps, during which no waiting request is probed."""
    waiting = deque(requests)
    served = {}
    steps = 0
    while waiting:
        steps += 1
        assert steps < max_steps
        rid, keys = waiting[0]
        ctx, hits = h.probe(rid, keys)
        if hits is None:
            h.step()
            time.sleep(0.0005)
            if check:
                check()
            continue
        if hits:
            h.load(ctx, keys[:hits])
        served[rid] = hits
        waiting.popleft()
        h.step(scheduled=[rid])
        for _ in range(run_steps):
            time.sleep(0.001)  # the forward pass: reads progress meanwhile
            h.step()
            if check:
                check()
        h.m.on_request_finished(ctx)
    return served


def test_declared_metrics_cover_gate_and_lookahead():
    names = set(metric_definitions())
    for name in ("lookahead_preload_bytes", "lookahead_wasted_bytes", "lookahead_used_bytes",
                 "gate_decisions_load", "gate_limited_lookups", "store_skipped_first_sighting",
                 "lookup_hold_cap_retries"):
        assert "vllm:pykvcache_" + name in names and name in COUNTERS
    for name in ("gate_break_even_tokens", "lookahead_slots_held"):
        assert "vllm:pykvcache_" + name in names and name in GAUGES


def test_queued_request_is_staged_before_its_first_lookup(tmp_path):
    h = Harness(tmp_path / "kv", num_slots=32, lookahead_slots=16, window=4, gate=_gate())
    try:
        keys = [_key(i) for i in range(6)]
        h.write_to_disk(keys)
        h.m.cache.clear()  # nothing staged: the prefix is only on disk
        h.queue("r1", keys, arrival=1.0)
        h.settle()
        m = h.m.metrics.totals
        assert m["lookahead_preload_reads"] == 6 and m["disk_reads"] == 6
        # Preloads go to the engine at background priority (loads overtake them).
        assert h.store_obj.stats()["prefetches"] == 6
        ctx, hits = h.probe("r1", keys)
        assert hits == 6  # every chunk HIT at the first probe: no wait step
        h.load(ctx, keys)
        h.step(scheduled=["r1"])
        assert m["lookup_waited_requests"] == 0 and m["lookup_ready_requests"] == 1
        assert m["lookahead_used_bytes"] == 6 * CHUNK and m["lookahead_wasted_bytes"] == 0
        assert not h.m.preloader.held and len(h.m.preloader.queue) == 0
    finally:
        h.close()


def test_preempted_request_is_queued_again_and_staged_before_it_resumes(tmp_path):
    h = Harness(tmp_path / "kv", num_slots=32, lookahead_slots=16, window=4, gate=_gate())
    try:
        keys = [_key(i) for i in range(6)]
        h.on_disk_only(keys)
        h.queue("r1", keys, arrival=1.0)
        h.settle()
        ctx, hits = h.probe("r1", keys)
        h.load(ctx, keys)
        h.step(scheduled=["r1"])
        pre = h.m.preloader
        assert "r1" not in pre.queue and "r1" in pre.running
        # While r1 ran, staging went to other chunks; then vLLM preempts it
        # (its device blocks are freed, it waits again at the front).
        h.m.cache.clear()
        h.m.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=["r1"]))
        h.settle()
        m = h.m.metrics.totals
        assert m["lookahead_requeued_preempted"] == 1
        assert m["lookahead_preload_reads"] == 12 and h.store_obj.stats()["prefetches"] == 12
        ctx, hits = h.probe("r1", keys)
        assert hits == 6  # staged again before vLLM asked
        h.load(ctx, keys)
        # Rescheduled: vLLM lists it among the cached requests (resumed).
        h.m.on_request_resumed("r1")
        assert "r1" not in pre.queue and not pre.held and "r1" in pre.running
        h.m.on_request_finished(ReqContext(req_id="r1"))
        assert "r1" not in pre.running
        # A finished request is never queued again.
        h.m.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=["r1"]))
        assert "r1" not in pre.queue and m["lookahead_requeued_preempted"] == 1
    finally:
        h.close()


def test_shared_prefix_is_read_once_and_window_and_budget_bound_preloads(tmp_path):
    h = Harness(tmp_path / "kv", num_slots=40, lookahead_slots=10, window=2, gate=_gate())
    try:
        shared = [_key(i) for i in range(4)]
        tails = {r: [_key(100 + 10 * r + j) for j in range(4)] for r in range(4)}
        h.on_disk_only(shared + [k for t in tails.values() for k in t])
        for r in range(4):
            h.queue(f"r{r}", shared + tails[r], arrival=float(r))
        h.settle()
        m = h.m.metrics.totals
        # Window 2 (r0, r1), budget 10 slots: the shared 4 chunks are read once
        # and held once, r0's tail 4, then 2 of r1's tail; r2 and r3 untouched.
        assert m["lookahead_preload_reads"] == 10 and m["disk_reads"] == 10
        assert len(h.m.preloader.held) == 10 and m["lookahead_budget_stops"] >= 1
        assert sum(h.m.staged_state(k) is not None for k in tails[1]) == 2
        assert all(h.m.staged_state(k) is None for k in tails[2] + tails[3])
        # r0 is aborted before scheduling: its tail is released (not evicted),
        # the window moves on to r1, r2 within the same budget.
        h.m.on_request_finished(ReqContext(req_id="r0"))
        assert m["lookahead_cancelled_requests"] == 1
        h.step()
        h.settle()
        assert len(h.m.preloader.held) == 10
        assert all(h.m.staged_state(k) is not None for k in tails[1])
        assert sum(h.m.staged_state(k) is not None for k in tails[2]) == 2
        assert all(h.m.staged_state(k) is None for k in tails[3])
        assert all(h.m.staged_state(k) is not None for k in tails[0])  # cached, not dropped
    finally:
        h.close()


def test_preloads_never_evict_unused_preloads_and_waste_is_counted(tmp_path):
    # 8 slots: the budget (6) would allow more, but staging decides.
    h = Harness(tmp_path / "kv", num_slots=8, lookahead_slots=6, window=8, gate=_gate())
    try:
        a = [_key(i) for i in range(4)]
        b = [_key(10 + i) for i in range(4)]
        c = [_key(20 + i) for i in range(8)]
        h.on_disk_only(a + b + c)
        h.queue("a", a, 1.0)
        h.queue("b", b, 2.0)
        h.settle()
        assert len(h.m.preloader.held) == 6  # a:4, b:2 (budget)
        # a is aborted: its 4 preloads become evictable but are still unused.
        h.m.on_request_finished(ReqContext(req_id="a"))
        h.step()
        h.settle()
        # b gets its last 2 chunks into the 2 free slots, then stops: the only
        # evictable slots hold a's unused preloads.
        assert all(h.m.staged_state(k) is not None for k in b)
        assert all(h.m.staged_state(k) is not None for k in a)
        assert h.m.metrics.totals["lookahead_wasted_bytes"] == 0
        # A lookup of another request (not a preload) may evict them: counted as waste.
        h.m.preloader.forget("b", cancelled=True)
        ctx, hits = h.probe("c", c)
        h.settle()
        h.step()
        assert h.m.metrics.totals["lookahead_wasted_bytes"] >= CHUNK
    finally:
        h.close()


def test_gate_recomputes_short_prefixes_without_reading_and_loads_long_ones(tmp_path):
    h = Harness(tmp_path / "kv", num_slots=32, gate=_gate(break_even_chunks=3.5))
    try:
        keys = [_key(i) for i in range(8)]
        h.on_disk_only(keys)
        reads = h.m.metrics.totals["disk_reads"]
        short = keys[:2]
        ctx, hits = h.probe("short", short)
        assert hits == 0 and h.m.metrics.totals["disk_reads"] == reads
        assert all(h.m.staged_state(k) is None for k in short)  # nothing was read
        h.m.on_request_finished(ctx)
        ctx, hits = h.probe("long", keys)
        assert hits is None  # reads started
        h.settle()
        ctx, hits = h.probe("long", keys)
        assert hits == 8
        h.load(ctx, keys)
        h.step(scheduled=["long"])
        stats = h.m.get_stats()
        assert stats is not None
        t = h.m.metrics.totals
        assert t["gate_decisions_recompute"] == 1 and t["gate_decisions_load"] == 1
        assert t["gate_tokens_recomputed"] == 2 * CT and t["gate_tokens_loaded"] == 8 * CT
        assert t["gate_limited_lookups"] == 1
        assert h.m.metrics.gauges["gate_break_even_tokens"] == pytest.approx(3.5 * CT)
    finally:
        h.close()


def test_gate_applies_to_preloads(tmp_path):
    h = Harness(tmp_path / "kv", num_slots=32, lookahead_slots=16, window=4,
                gate=_gate(break_even_chunks=3.5))
    try:
        keys = [_key(i) for i in range(8)]
        h.on_disk_only(keys)
        h.queue("short", [_key(i) for i in range(2)], 1.0)
        h.settle()
        assert h.m.metrics.totals["lookahead_preload_reads"] == 0
        assert h.m.metrics.totals["lookahead_gate_skipped_chunks"] >= 2
        h.queue("long", keys, 2.0)
        h.settle()
        assert h.m.metrics.totals["lookahead_preload_reads"] == 8
        # Preload decisions are not request decisions.
        assert h.m.metrics.totals["gate_decisions_load"] == 0
    finally:
        h.close()


def test_online_refinement_observes_disk_loads(tmp_path):
    from pykvcache.gate import OnlineLoadModel

    # A device calibrated absurdly fast (0.1 us, 1 PB/s): any real read is slower.
    fast = LoadCost(fixed_s=1e-7, disk_bytes_per_s=1e15, h2d_bytes_per_s=1e15)
    gate = AdmissionGate(CostModel(PrefillCurve(0.0, 1.0, 0.0), fast, CHUNK / CT),
                         chunk_tokens=CT, online=OnlineLoadModel(fast))
    h = Harness(tmp_path / "kv", num_slots=16, gate=gate)
    try:
        keys = [_key(i) for i in range(8)]
        h.on_disk_only(keys)
        h.probe("r", keys[:4])
        h.settle()
        assert h.m.metrics.totals["gate_load_observations"] == 1
        assert gate.online.samples == 1
        assert gate.online.disk_bytes_per_s == 1e15  # one load alone moves nothing
        h.probe("r2", keys[4:])
        h.settle()
        assert gate.online.samples == 2
        assert gate.online.disk_bytes_per_s < 1e15  # two agree: towards the slower real device
    finally:
        h.close()


def test_preloaded_loads_teach_the_gate_the_device(tmp_path):
    """Decision 0079: a request whose chunks the preloader read finds them
    staged at its lookup, so no plan times its load; with lookahead on every
    load can be such a one (the 8k benchmark at 50 MB/s observed none in a
    run and kept the prior). The device's busy periods time the preloads."""
    from pykvcache.gate import OnlineLoadModel

    fast = LoadCost(fixed_s=1e-7, disk_bytes_per_s=1e15, h2d_bytes_per_s=1e15)
    gate = AdmissionGate(CostModel(PrefillCurve(0.0, 1.0, 0.0), fast, CHUNK / CT),
                         chunk_tokens=CT, online=OnlineLoadModel(fast))
    h = Harness(tmp_path / "kv", num_slots=32, lookahead_slots=16, window=4, gate=gate)
    try:
        keys = [_key(i) for i in range(9)]
        h.on_disk_only(keys)
        m = h.m.metrics.totals
        # First contact: before a read of the device is timed a preload reads
        # none of it; the request is asked to retry while its first chunk is
        # read in the background, and is decided again once that read timed
        # the device (here: at once, a fast disk).
        h.queue("r0", keys[6:], arrival=0.5)
        ctx, hits = h.probe("r0", keys[6:])
        assert hits is None and m["lookahead_preload_reads"] == 0 and m["gate_sample_reads"] == 1
        h.settle()  # the sample's read ends: timed, and the preloader reads the rest
        assert gate.online.timed and m["lookahead_preload_reads"] == 2
        ctx, hits = h.probe("r0", keys[6:])
        assert hits == 3
        h.load(ctx, keys[6:])
        h.step(scheduled=["r0"])
        for rid, part, arrival in (("r1", keys[:3], 1.0), ("r2", keys[3:6], 2.0)):
            h.queue(rid, part, arrival=arrival)
            h.settle()
            ctx, hits = h.probe(rid, part)
            assert hits == 3 and all(h.m.chunk_state(k).name == "STAGED" for k in part)
            h.load(ctx, part)
            h.step(scheduled=[rid])
        assert m["lookahead_preload_reads"] == 8
        assert gate.online.samples == 4 and m["gate_load_observations"] == 4
        assert gate.online.disk_bytes_per_s < 1e15, "the preload periods agree: the real device"
    finally:
        h.close()


def test_store_admission_second_sighting(tmp_path):
    gate = _gate()
    h = Harness(tmp_path / "kv", num_slots=16, gate=gate,
                admission=StoreAdmission(chunk_tokens=CT, second_sighting=True))
    try:
        keys = [_key(i) for i in range(3)]
        ctx, _ = h.probe("first", keys)  # first sighting (all MISS)
        out = h.m.prepare_store(keys, ctx)
        assert out.keys_to_store == []
        assert h.m.metrics.totals["store_skipped_first_sighting"] == 0  # counted in get_stats
        h.m.get_stats()
        assert h.m.metrics.totals["store_skipped_first_sighting"] == 3
        h.m.on_request_finished(ctx)
        ctx2, _ = h.probe("second", keys)
        out = h.m.prepare_store(keys, ctx2)
        assert out.keys_to_store == keys
    finally:
        h.close()


def test_lookup_holds_of_waiting_requests_are_capped(tmp_path):
    h = Harness(tmp_path / "kv", num_slots=12, hold_slots=4)
    try:
        a = [_key(i) for i in range(5)]
        b = [_key(10 + i) for i in range(3)]
        h.on_disk_only(a + b)
        _, hits = h.probe("a", a)  # the first waiting request may take what it needs
        assert hits is None
        assert all(h.m.staged_state(k) is not None for k in a)
        _, hits = h.probe("b", b)  # others already hold 5 >= 4 slots: ask again later
        assert hits is None and h.m.metrics.totals["lookup_hold_cap_retries"] == 3
        assert all(h.m.staged_state(k) is None for k in b)  # nothing read, nothing held
        h.settle()
        h.step(scheduled=["a"])  # a scheduled: its holds end
        _, hits = h.probe("b", b)
        assert hits is None
    finally:
        h.close()


def test_fifty_queued_requests_do_not_thrash_staging(tmp_path):
    """50 queued requests with 8-chunk prefixes, staging for 5 of them: preloads
    stay within budget, are used before eviction, and every request loads its
    whole prefix, byte-identical."""
    n_req, chunks = 50, 8
    budget = 20  # lookahead share: 50% of 40 slots = 2.5 requests
    h = Harness(tmp_path / "kv", num_slots=5 * chunks, lookahead_slots=budget, window=8,
                hold_slots=20, gate=_gate())
    try:
        reqs = [(f"q{r}", [_key(1000 * (r + 1) + j) for j in range(chunks)])
                for r in range(n_req)]
        h.write_to_disk([k for _, ks in reqs for k in ks])
        peak = []

        def check():
            held = len(h.m.preloader.held)
            peak.append(held)
            assert held <= budget

        for i, (rid, keys) in enumerate(reqs):
            h.queue(rid, keys, arrival=float(i))
            check()
        t0 = time.monotonic()
        served = _run_queue(h, reqs, run_steps=2, check=check)
        elapsed = time.monotonic() - t0
        h.m.get_stats()
        t = h.m.metrics.totals
        assert served == {rid: chunks for rid, _ in reqs}
        preloaded = t["lookahead_preload_bytes"]
        print(f"\nthrash: preloaded={preloaded / CHUNK:.0f} chunks used={t['lookahead_used_bytes'] / CHUNK:.0f} "
              f"wasted={t['lookahead_wasted_bytes'] / CHUNK:.0f} waited={t['lookup_waited_requests']:.0f} "
              f"ready={t['lookup_ready_requests']:.0f} peak_held={max(peak)} evictions={t['staging_evictions']:.0f} "
              f"elapsed={elapsed:.2f}s")
        assert preloaded >= 0.8 * n_req * chunks * CHUNK  # almost every chunk came by preload
        assert t["lookahead_wasted_bytes"] <= 0.05 * preloaded
        assert t["lookahead_used_bytes"] >= 0.95 * preloaded - CHUNK * chunks
        assert t["lookup_ready_requests"] >= 0.8 * n_req
        assert max(peak) <= budget
    finally:
        h.close()


def test_a_request_vllm_has_probed_hands_its_preloads_to_its_lookups(tmp_path):
    """Found by the serving benchmark: the head request, once vLLM probes it,
    holds its chunks through its own lookups; its preload holds then only
    spent the lookahead budget, and the request behind it got a partial
    preload (its first probe waited for reads). Now the head's preload holds
    are released at the next pass and the next request is staged whole."""
    h = Harness(tmp_path / "kv", num_slots=40, lookahead_slots=6, window=4, gate=_gate())
    try:
        head = [_key(i) for i in range(6)]
        nxt = [_key(100 + i) for i in range(6)]
        h.on_disk_only(head + nxt)
        h.queue("head", head, arrival=1.0)
        h.queue("next", nxt, arrival=2.0)
        h.settle()
        # The budget (6 chunks) went to the head: nothing of "next" is staged.
        assert all(h.m.staged_state(k) is None for k in nxt)
        # vLLM probes the head (a slot freed): every chunk HIT, held by its lookups.
        ctx, hits = h.probe("head", head)
        assert hits == 6
        h.step()  # step end: the preloader plans again, the head is still waiting
        h.settle()
        m = h.m.metrics.totals
        assert m["lookahead_handed_to_lookups"] == 1
        assert all(h.m.staged_state(k) is not None for k in nxt)  # staged whole
        ctx2, hits2 = h.probe("next", nxt)
        assert hits2 == 6  # HIT at its first probe: no deferred step
        # The head's chunks stayed staged throughout (its lookups held them).
        h.load(ctx, head)
        h.load(ctx2, nxt)
        h.step(scheduled=["head", "next"])
        assert m["lookahead_used_bytes"] == 12 * CHUNK and m["lookahead_wasted_bytes"] == 0
    finally:
        h.close()


def test_a_lookup_finding_staging_full_takes_a_slot_from_a_later_requests_preload(tmp_path):
    """Found by the serving benchmark (18 staging-full misses per run once
    preloads were handed over): staging full of preloads for a request still
    queued, and vLLM probes another one (ahead of it in vLLM's order). The
    lookup used to answer MISS (that request recomputed a prefix on disk); now
    the youngest preload gives up its last chunks, one per slot needed."""
    h = Harness(tmp_path / "kv", num_slots=8, lookahead_slots=8, window=4, gate=_gate())
    try:
        later = [_key(i) for i in range(8)]
        now = [_key(100 + i) for i in range(3)]
        h.on_disk_only(later + now)
        h.queue("later", later, arrival=2.0)
        h.settle()
        assert h.m.cache.allocatable() == 0  # every slot held for "later"
        ctx, hits = h.probe("now", now)
        m = h.m.metrics.totals
        assert m["staging_full_misses"] == 0 and m["lookahead_reclaimed_chunks"] == 3
        h.settle()
        ctx, hits = h.probe("now", now)
        assert hits == 3
        h.load(ctx, now)
        # "later" kept the head of its prefix; its last 3 chunks were given up.
        held = h.m.cache.held_by(h.m.preloader.owner("later"))
        assert held == frozenset(later[:5])
    finally:
        h.close()


def test_queued_bytes_count_what_a_new_read_waits_behind(tmp_path):
    """The gate prices a load behind the demand reads and writes the engine
    has not finished: not prefetches (a demand read overtakes them), not
    writes still queued in the manager (submitted after it), not I/O that
    finished but is collected only at the next step. Counting those made
    loads look faster than predicted (the gate learnt a disk capped at 200
    MB/s as 0.4-7 GB/s). A stalled FUSE mount keeps reads in flight."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
    from stall_fs import StallFs, skip_reason

    if (why := skip_reason()) is not None:
        pytest.skip(why)
    with StallFs(tmp_path / "fs") as fs:
        h = Harness(fs.mount_point, num_slots=16, lookahead_slots=8, window=4)
        try:
            keys = [_key(i) for i in range(1, 7)]
            h.on_disk_only(keys)
            assert h.m.queued_bytes() == 0
            # A stored chunk whose write is not submitted yet is not ahead of a read.
            ctx = ReqContext(req_id="writer")
            out = h.m.prepare_store([_key(50)], ctx)
            view = h.pool.view(int(out.store_spec.block_ids[0]))
            view[:] = _payload(_key(50))
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


def test_the_manager_counts_who_waits_behind_a_request_for_the_gate(tmp_path):
    """Arrived and not scheduled = waiting, in arrival order; a preempted request
    waits again at the front; scheduled or finished ones do not. The gate weighs
    a recompute by the requests behind it (waiting_queue.py)."""
    h = Harness(tmp_path, num_slots=8, gate=_gate())
    try:
        for rid in ("a", "b", "c"):
            h.m.on_new_request(ReqContext(req_id=rid))
        assert [h.m.waiting_behind(r) for r in ("a", "b", "c", "zz")] == [2, 1, 0, 3]
        h.step(scheduled=["a"])
        assert [h.m.waiting_behind(r) for r in ("b", "c", "zz")] == [1, 0, 2]
        h.m.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=["a"]))
        assert [h.m.waiting_behind(r) for r in ("a", "b", "c")] == [2, 1, 0]  # a: front again
        h.m.on_request_resumed("a")
        h.m.on_request_finished(ReqContext(req_id="b"))
        assert h.m.waiting_behind("c") == 0 and h.m.waiting_behind("zz") == 1
    finally:
        h.close()


def test_co_queued_requests_are_preloaded_only_where_their_lookup_then_loads(tmp_path):
    """Three short prefixes arrive together. A load costs one step whether its
    chunks are staged or not, and a prefix's prefill is half that step: alone
    it is recomputed, with two requests behind it (each delayed by a recompute)
    it is loaded. Counted by who waits *besides* it, all three were preloaded
    and then the second and third recomputed at their lookups (the ones ahead
    were scheduled by then): 4 chunks read for nothing. Counted by who waits
    *behind* it, only the first is preloaded, and its lookup loads it."""
    step_s = 1e-3
    load = LoadCost(fixed_s=0.0, disk_bytes_per_s=1e15, h2d_bytes_per_s=1e15, step_s=step_s)
    b = 0.5 * step_s / (2 * CT)  # a 2-chunk prefix's prefill: half a step
    # Uncapped weight: this is about who is counted (0070); with the default cap
    # (0070) one and two requests behind weigh the same.
    gate = AdmissionGate(CostModel(PrefillCurve(0.0, b, 0.0), load, CHUNK / CT), chunk_tokens=CT, online=None,
                         behind_weight_cap=math.inf)
    h = Harness(tmp_path / "kv", num_slots=32, lookahead_slots=16, window=8, gate=gate)
    try:
        prefixes = {rid: [_key(10 * n + i) for i in range(2)] for n, rid in enumerate("abc")}
        h.on_disk_only([k for keys in prefixes.values() for k in keys])
        for n, (rid, keys) in enumerate(prefixes.items()):
            h.m.on_new_request(ReqContext(req_id=rid))  # vLLM: add_request, then the lookahead hook
            h.queue(rid, keys, float(n))
        h.settle()
        preloaded = {rid for rid, keys in prefixes.items() if all(h.m.staged_state(k) is not None for k in keys)}
        assert preloaded == {"a"}, preloaded
        served = _run_queue(h, list(prefixes.items()))
        assert served == {"a": 2, "b": 0, "c": 0}
        t = h.m.metrics.totals
        assert t["lookahead_preload_reads"] == 2 and t["disk_reads"] == 2
        assert t["lookahead_used_bytes"] == 2 * CHUNK and t["lookahead_wasted_bytes"] == 0
    finally:
        h.close()


def test_a_lookup_promotes_the_queued_preload_of_its_chunk(tmp_path):
    """A preload its request now needs must not wait behind the other preloads
    (decision 0061): the lookup raises its queued prefetch to demand priority.
    A stalled FUSE mount keeps the preloads queued (their opens wait)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
    from stall_fs import StallFs, skip_reason

    if (why := skip_reason()) is not None:
        pytest.skip(why)
    with StallFs(tmp_path / "fs") as fs:
        h = Harness(fs.mount_point, num_slots=32, lookahead_slots=16, window=4, gate=_gate())
        try:
            keys = [_key(i) for i in range(1, 7)]
            other = [_key(i) for i in range(20, 24)]
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
    from pykvcache.gate import OnlineLoadModel
    from pykvcache.vllm.scheduler.disk_io import PRELOAD_YIELD_S

    slow = LoadCost(fixed_s=1e-3, disk_bytes_per_s=1e9, h2d_bytes_per_s=1e15)
    gate = AdmissionGate(CostModel(PrefillCurve(0.0, 1.0, 0.0), slow, CHUNK / CT),
                         chunk_tokens=CT, online=OnlineLoadModel(slow))
    h = Harness(tmp_path / "kv", num_slots=16, gate=gate)
    try:
        keys = [_key(i) for i in range(8)]
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


def test_an_exploration_is_read_in_the_background_while_its_request_recomputes(tmp_path):
    """Decision 0054: a gate that learnt a disk far slower than the real one
    samples it without making a request wait: the explored request misses,
    the sample's chunks are read at preload priority into staging (a later
    request loads them), and two samples faster than learnt bring the loads back."""
    from pykvcache.gate import Exploration, OnlineLoadModel

    calibrated = LoadCost(fixed_s=1e-4, disk_bytes_per_s=100e6, h2d_bytes_per_s=1e15)
    # Recompute priced at 10 s per chunk, learnt loads at 100 s (16 KiB in 100 s): the
    # choices do not depend on how fast this machine's real reads are (a busy CI host).
    prefill = PrefillCurve(0.0, 10.0 / CT, 0.0)
    online = OnlineLoadModel(calibrated)
    gate = AdmissionGate(CostModel(prefill, calibrated, CHUNK / CT), chunk_tokens=CT, online=online,
                         exploration=Exploration(min_sample_s=250.0))
    for _ in range(3):
        online.observe(CHUNK, 100.0)
    h = Harness(tmp_path / "kv", num_slots=32, gate=gate)
    try:
        keys = [_key(i) for i in range(24)]
        h.on_disk_only(keys)
        ctx, hits = h.probe("r1", keys[:8])
        m = h.m.metrics.totals
        assert hits == 0, "the explored request waits for nothing: it recomputes"
        # Sized to outlast 250 s at the learnt speed: 3 chunks, no owner.
        assert m["gate_sample_reads"] == 3 and gate.totals["gate_decisions_recompute"] == 1
        assert h.m.cache.count_held(LOOKAHEAD) == 0 and h.m.cache.count_held(LOOKUP) == 0
        h.settle()
        assert gate.exploration.surprises == 1 and gate.online.disk_bytes_per_s < 1e3
        # A later request loads what the sample staged, without a disk read.
        reads = m["disk_reads"]
        ctx, hits = h.probe("r1-again", keys[:3])
        assert hits == 3 and m["disk_reads"] == reads
        h.load(ctx, keys[:3])
        # The second sample, at once: two surprises in a row, the slow window goes.
        ctx, hits = h.probe("r2", keys[8:16])
        assert hits == 0 and m["gate_sample_reads"] == 6
        h.settle()
        assert gate.totals["gate_loads_forgotten"] >= 3 and gate.online.disk_bytes_per_s > 16e3
        ctx, hits = h.probe("r3", keys[16:])
        assert hits is None, "the disk is fast again: its reads started"
        h.settle()
        ctx, hits = h.probe("r3", keys[16:])
        assert hits == 8
        h.load(ctx, keys[16:])
        assert gate.totals["gate_decisions_explore"] == 2
    finally:
        h.close()


def test_a_restarted_manager_starts_from_the_device_model_the_last_one_learnt(tmp_path):
    """Decision 0073: the learnt device model is saved beside the namespace at
    shutdown and replayed at the next start; without it a restart prices reads
    at the prior until two loads end."""
    from pykvcache.gate import OnlineLoadModel, device_memory

    fast = LoadCost(fixed_s=1e-7, disk_bytes_per_s=1e15, h2d_bytes_per_s=1e15)

    def gate():
        return AdmissionGate(CostModel(PrefillCurve(0.0, 1.0, 0.0), fast, CHUNK / CT), chunk_tokens=CT,
                             online=OnlineLoadModel(fast))

    first = gate()
    h = Harness(tmp_path / "kv", num_slots=16, gate=first)
    keys = [_key(i) for i in range(8)]
    try:
        h.on_disk_only(keys)
        for rid, part in (("r1", keys[:4]), ("r2", keys[4:])):
            h.probe(rid, part)
            h.settle()
        assert first.online.samples == 2 and first.online.disk_bytes_per_s < 1e15
        saved = h.store_obj.namespace_dir[0]
    finally:
        h.close()
    assert (Path(saved) / device_memory.FILE_NAME).exists()
    second = gate()
    h = Harness(tmp_path / "kv", num_slots=16, gate=second)
    try:
        assert second.online.samples == 2
        assert second.online.disk_bytes_per_s == pytest.approx(first.online.disk_bytes_per_s)
        assert h.m.gating.device_bytes_per_s() == pytest.approx(first.online.disk_bytes_per_s)
        # Its preload byte bound comes from the restored speed from the start (0061).
        from pykvcache._core import chunk_file_bytes
        from pykvcache.vllm.scheduler.disk_io import PRELOAD_YIELD_S

        assert h.store_obj.background_budget == max(chunk_file_bytes(CHUNK),
                                                     int(second.online.disk_bytes_per_s * PRELOAD_YIELD_S))
    finally:
        h.close()
    # A file that cannot be read (here: a directory in its place) is ignored, and so is failing to save.
    (Path(saved) / device_memory.FILE_NAME).unlink()
    (Path(saved) / device_memory.FILE_NAME).mkdir()
    third = gate()
    h = Harness(tmp_path / "kv", num_slots=16, gate=third)
    try:
        assert third.online.samples == 0
        h.probe("r3", keys[:4])
        h.settle()
        assert third.online.samples == 1
    finally:
        h.close()


def test_the_gate_trace_records_decisions_reads_and_lessons(tmp_path, caplog):
    """``gate_trace``: a preload's and a lookup's decisions with the states
    they saw, each read, and the busy period learnt, one JSON line each; a
    trace that cannot be written stops with one warning and serving goes on
    (here: /dev/full, every write ENOSPC)."""
    import json
    import logging

    from pykvcache.gate import OnlineLoadModel
    from pykvcache.gate.trace import DecisionTrace

    prior = LoadCost(fixed_s=1e-4, disk_bytes_per_s=1e9, h2d_bytes_per_s=1e15)
    online = OnlineLoadModel(prior)
    online.observe(CHUNK, CHUNK / 1e9)  # past first contact: the device timed once
    gate = AdmissionGate(CostModel(PrefillCurve(0.0, 10.0 / CT, 0.0), prior, CHUNK / CT), chunk_tokens=CT,
                         online=online)
    h = Harness(tmp_path / "kv", num_slots=16, gate=gate, lookahead_slots=8, window=4)
    path = tmp_path / "trace.jsonl"
    h.m.gating.set_trace(DecisionTrace(path))
    try:
        keys = [_key(i) for i in range(8)]
        h.on_disk_only(keys)
        h.queue("waiting", keys[:4], arrival=0.0)
        h.step()
        h.settle()
        h.probe("r", keys[4:])
        h.settle()
    finally:
        h.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records[0]["ev"] == "start"
    first = {}
    for r in records:
        if r["ev"] == "decide":
            first.setdefault(r["role"], r)
    assert (first["preload"]["req"], first["preload"]["disk"], first["preload"]["load"]) == ("waiting", 4, 4)
    lookup = first["lookup"]
    assert (lookup["req"], lookup["disk"], lookup["load"], lookup["reason"]) == ("r", 4, 4, "load")
    reads = [r for r in records if r["ev"] == "read"]
    assert len(reads) == 8 and all(r["latency_s"] >= 0 and r["mb"] > 0 for r in reads)
    assert any(r["ev"] == "learn" and r["mbps"] and r["from"] in ("period", "load") for r in records)
    assert [r["t"] for r in records] == sorted(r["t"] for r in records)

    with caplog.at_level(logging.WARNING, logger="pykvcache.gate.trace"):
        full = DecisionTrace("/dev/full")
        for _ in range(3):
            full.read(0.0, 0.1, CHUNK, sample=False)
    said = [r.getMessage() for r in caplog.records if "/dev/full" in r.getMessage()]
    assert len(said) == 1 and "the trace stops" in said[0], said
