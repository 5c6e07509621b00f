"""Order and membership of the lookahead queue (pure logic, no I/O)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")

from pykvcache.vllm.scheduler.lookahead import LookaheadQueue, WaitingRequest  # noqa: E402


def _req(rid, priority=0, arrival=0.0):
    return WaitingRequest(req_id=rid, key_lists=[[rid.encode()]], priority=priority, arrival=arrival)


def test_fcfs_orders_by_arrival_and_ignores_priority():
    q = LookaheadQueue(by_priority=False)
    q.add(_req("late", priority=-5, arrival=3.0))
    q.add(_req("early", priority=9, arrival=1.0))
    q.add(_req("mid", arrival=2.0))
    assert [r.req_id for r in q.head(10)] == ["early", "mid", "late"]
    assert [r.req_id for r in q.head(2)] == ["early", "mid"]


def test_priority_policy_orders_by_priority_then_arrival_then_insertion():
    q = LookaheadQueue(by_priority=True)
    q.add(_req("b", priority=1, arrival=1.0))
    q.add(_req("a", priority=0, arrival=5.0))
    q.add(_req("c", priority=1, arrival=1.0))  # same priority and arrival as b: after it
    q.add(_req("d", priority=1, arrival=0.5))
    assert [r.req_id for r in q] == ["a", "d", "b", "c"]


def test_remove_and_readd():
    q = LookaheadQueue()
    for i, rid in enumerate("abcde"):
        q.add(_req(rid, arrival=float(i)))
    assert q.remove("c").req_id == "c"
    assert q.remove("c") is None
    assert "c" not in q and len(q) == 4
    assert [r.req_id for r in q.head(3)] == ["a", "b", "d"]
    q.add(_req("a", arrival=10.0))  # re-added: moves to its new place, not duplicated
    assert [r.req_id for r in q] == ["b", "d", "e", "a"]
    for rid in "bdea":
        q.remove(rid)
    assert len(q) == 0 and q.head(5) == []


def test_the_preloader_asks_its_host_only_for_its_gate_gate_inputs_and_staging():
    """The preloader's interface to the manager is ``PreloadHost``: its gate,
    the gate's inputs for a prefix (the same answer a lookup's plan gets) and
    ``stage``; its holds are kept in the staging cache it shares. A host of
    two methods and a gate is enough to plan over."""
    from pykvcache import StagingPool
    from pykvcache.gate import ChunkState
    from pykvcache.vllm.metrics import ManagerMetrics
    from pykvcache.vllm.scheduler.gating import GateInputs, NoGating
    from pykvcache.vllm.scheduler.lookahead import Preloader
    from pykvcache.vllm.scheduler.staging_cache import EntryState, Origin, StagingCache
    from vllm.v1.kv_offload.base import LookupResult

    pool = StagingPool(4096, 4)
    cache = StagingCache(pool)
    on_disk = {b"a", b"b"}  # c is not: the preload stops before it

    class Host:
        asked: list = []
        gating = NoGating()  # the gate asks gate_inputs; without one the preload stops at the first missing chunk

        def gate_inputs(self, keys, req_id):
            self.asked.append((list(keys), req_id))
            return GateInputs([ChunkState.DISK if k in on_disk else ChunkState.MISSING for k in keys], 0, 0)

        def stage(self, key, owner=None, background=False, tenant=b""):
            assert background, "a preload reads at background priority"
            cache.insert(key, EntryState.READING, Origin.DISK, tenant)
            cache.hold(owner, key)
            return LookupResult.HIT_PENDING

    host = Host()
    metrics = ManagerMetrics()
    preloader = Preloader(host, cache, metrics, chunk_bytes=4096, budget_slots=4, window=2, chunk_tokens=64)
    try:
        preloader.add(WaitingRequest(req_id="r", key_lists=[[b"a", b"b", b"c"]]))
        preloader.plan()
        assert host.asked == [([b"a", b"b", b"c"], "r")]
        assert preloader.held == {b"a", b"b"}
        assert metrics.totals["lookahead_preload_reads"] == 2
        assert metrics.totals["lookahead_preload_bytes"] == 2 * 4096
        preloader.forget("r", cancelled=True)
        assert not preloader.held
    finally:
        cache.clear()
        pool.close()
