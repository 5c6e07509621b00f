"""An ``NvmeOffloadingManager`` over a real staging pool and a real on-disk
store (io_uring reads, verified chunks), driven as vLLM drives it.

No vLLM engine: :class:`Harness` plays the scheduler (probe the head of the
queue, load, run a few steps, finish) and the connector (queue a request at
arrival), and checks the staged bytes the "worker" would copy.
"""

from __future__ import annotations

import time
from collections import deque

import pytest
from pykvcache import BlockStore, StagingPool
from pykvcache.gate import AdmissionGate, CostModel, LoadCost, OnlineLoadModel, PrefillCurve
from pykvcache.vllm.layout import ChunkLayout
from pykvcache.vllm.scheduler.gate_plan import GateWiring
from pykvcache.vllm.scheduler.lookahead import WaitingRequest
from pykvcache.vllm.scheduler.manager import NvmeOffloadingManager

vllm_base = pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")
LookupResult = vllm_base.LookupResult
ReqContext = vllm_base.ReqContext
ScheduleEndContext = vllm_base.ScheduleEndContext

LAYOUT = ChunkLayout(blocks_per_chunk=2, bytes_per_block=8192, world_size=1)
CT = 64  # tokens per chunk
CHUNK = LAYOUT.payload_bytes


def chunk_key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def chunk_payload(key: bytes) -> bytes:
    i = int.from_bytes(key[:32], "big")
    return bytes((i * 7 + j) % 251 for j in range(CHUNK))


def break_even_gate(break_even_chunks: float | None = None) -> AdmissionGate:
    """A gate whose break-even is ``break_even_chunks`` chunks (None: loads from
    the first chunk). Linear prefill, tiny per-byte load cost: break-even =
    fixed / b."""
    bpt = CHUNK / CT
    load = LoadCost(fixed_s=1e-3, disk_bytes_per_s=1e15, h2d_bytes_per_s=1e15)
    b = 1.0 if break_even_chunks is None else 1e-3 / (break_even_chunks * CT)
    return AdmissionGate(CostModel(PrefillCurve(0.0, b, 0.0), load, bpt), chunk_tokens=CT, online=None)


def learning_gate(load: LoadCost) -> AdmissionGate:
    """A gate calibrated at ``load`` that learns the device from the loads it times
    (one second of prefill per token: every prefix loads)."""
    return AdmissionGate(CostModel(PrefillCurve(0.0, 1.0, 0.0), load, CHUNK / CT), chunk_tokens=CT, online=OnlineLoadModel(load))


class Harness:
    def __init__(
        self,
        directory,
        *,
        num_slots,
        lookahead_slots=0,
        window=0,
        hold_slots=None,
        gate=None,
        admission=None,
        store_min_tokens=0,
        trace=None,
    ):
        self.pool = StagingPool(CHUNK, num_slots)
        self.store_obj = BlockStore([str(directory)], self.pool, namespace="la-ns", capacity_bytes=1 << 30)
        gating = None
        if gate is not None:

            def gating(hooks):  # what build_gating makes of the settings, with this gate
                return GateWiring(
                    gate,
                    chunk_tokens=CT,
                    chunk_bytes=CHUNK,
                    admission=admission,
                    store_min_tokens=store_min_tokens,
                    hooks=hooks,
                    trace=trace,
                )

        self.m = NvmeOffloadingManager(
            pool=self.pool,
            store=self.store_obj,
            layout=LAYOUT,
            gating=gating,
            chunk_tokens=CT,
            lookahead_slots=lookahead_slots,
            lookahead_requests=window,
            lookup_hold_slots=hold_slots,
        )

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
                view[:] = chunk_payload(key)
                view.release()
            self.m.complete_store(out.keys_to_store, ctx)
            pending = pending[len(batch) :]
            self.settle()

    def on_disk_only(self, keys):
        """Store ``keys`` to disk, then empty staging: they come back only by a read."""
        self.write_to_disk(keys)
        self.m.cache.clear()

    def step(self, scheduled=()):
        self.m.on_schedule_end(ScheduleEndContext(new_req_ids=list(scheduled), preempted_req_ids=[]))

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
            assert data == chunk_payload(key), "staged bytes differ from what was stored"
        self.m.complete_load(keys, ctx)

    def queue(self, rid, keys, arrival):
        self.m.lookahead_add(WaitingRequest(req_id=rid, key_lists=[keys], arrival=arrival))

    def close(self):
        self.m.shutdown()


def run_queue(h, requests, *, run_steps=2, check=None, max_steps=5000):
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
