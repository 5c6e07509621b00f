"""Lookahead preloading in the manager: what a queued request gets staged before
vLLM asks, within the window and the budget, and who keeps a staged chunk.

Over a real staging pool and store (tests/helpers/manager_harness.py).
"""

from __future__ import annotations

import time

from manager_harness import CHUNK, Harness, ReqContext, ScheduleEndContext, break_even_gate, chunk_key, run_queue
from pykvcache.vllm.metrics import COUNTERS, GAUGES, metric_definitions


def test_declared_metrics_cover_gate_and_lookahead():
    names = set(metric_definitions())
    for name in (
        "lookahead_preload_bytes",
        "lookahead_wasted_bytes",
        "lookahead_used_bytes",
        "gate_decisions_load",
        "gate_limited_lookups",
        "store_skipped_first_sighting",
        "lookup_hold_cap_retries",
    ):
        assert "vllm:pykvcache_" + name in names and name in COUNTERS
    for name in ("gate_break_even_tokens", "lookahead_slots_held"):
        assert "vllm:pykvcache_" + name in names and name in GAUGES


def test_queued_request_is_staged_before_its_first_lookup(tmp_path):
    h = Harness(tmp_path / "kv", num_slots=32, lookahead_slots=16, window=4, gate=break_even_gate())
    try:
        keys = [chunk_key(i) for i in range(6)]
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
    h = Harness(tmp_path / "kv", num_slots=32, lookahead_slots=16, window=4, gate=break_even_gate())
    try:
        keys = [chunk_key(i) for i in range(6)]
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
    h = Harness(tmp_path / "kv", num_slots=40, lookahead_slots=10, window=2, gate=break_even_gate())
    try:
        shared = [chunk_key(i) for i in range(4)]
        tails = {r: [chunk_key(100 + 10 * r + j) for j in range(4)] for r in range(4)}
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
    h = Harness(tmp_path / "kv", num_slots=8, lookahead_slots=6, window=8, gate=break_even_gate())
    try:
        a = [chunk_key(i) for i in range(4)]
        b = [chunk_key(10 + i) for i in range(4)]
        c = [chunk_key(20 + i) for i in range(8)]
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


def test_lookup_holds_of_waiting_requests_are_capped(tmp_path):
    h = Harness(tmp_path / "kv", num_slots=12, hold_slots=4)
    try:
        a = [chunk_key(i) for i in range(5)]
        b = [chunk_key(10 + i) for i in range(3)]
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
    h = Harness(tmp_path / "kv", num_slots=5 * chunks, lookahead_slots=budget, window=8, hold_slots=20, gate=break_even_gate())
    try:
        reqs = [(f"q{r}", [chunk_key(1000 * (r + 1) + j) for j in range(chunks)]) for r in range(n_req)]
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
        served = run_queue(h, reqs, run_steps=2, check=check)
        elapsed = time.monotonic() - t0
        h.m.get_stats()
        t = h.m.metrics.totals
        assert served == {rid: chunks for rid, _ in reqs}
        preloaded = t["lookahead_preload_bytes"]
        print(
            f"\nthrash: preloaded={preloaded / CHUNK:.0f} chunks used={t['lookahead_used_bytes'] / CHUNK:.0f} "
            f"wasted={t['lookahead_wasted_bytes'] / CHUNK:.0f} waited={t['lookup_waited_requests']:.0f} "
            f"ready={t['lookup_ready_requests']:.0f} peak_held={max(peak)} evictions={t['staging_evictions']:.0f} "
            f"elapsed={elapsed:.2f}s"
        )
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
    h = Harness(tmp_path / "kv", num_slots=40, lookahead_slots=6, window=4, gate=break_even_gate())
    try:
        head = [chunk_key(i) for i in range(6)]
        nxt = [chunk_key(100 + i) for i in range(6)]
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
    h = Harness(tmp_path / "kv", num_slots=8, lookahead_slots=8, window=4, gate=break_even_gate())
    try:
        later = [chunk_key(i) for i in range(8)]
        now = [chunk_key(100 + i) for i in range(3)]
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
