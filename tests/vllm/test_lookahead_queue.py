"""Order and membership of the lookahead queue (pure logic, no I/O)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")

from pykvcache.vllm.lookahead import LookaheadQueue, WaitingRequest  # noqa: E402


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
