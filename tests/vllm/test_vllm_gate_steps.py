"""The gate's prefill side is fed from vLLM's scheduler steps."""

from __future__ import annotations

import pytest
from pykvcache.gate import ChunkState, ProfileExpectation, build_gate
from pykvcache.vllm.scheduler.gate_plan import GateWiring
from pykvcache.vllm.scheduler.gating import Reset, StepFinished, StepScheduled
from pykvcache.vllm.scheduler.step_timer import StepTimer, step_work
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

CT = 64
BPT = 12 * 1024


def _new(req_id: str, computed: int) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=None,
        mm_features=[],
        sampling_params=None,
        pooling_params=None,
        block_ids=([],),
        num_computed_tokens=computed,
        lora_request=None,
    )


def _output(new: list[tuple[str, int, int]], running: list[tuple[str, int, int]]) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [_new(r, c) for r, c, _ in new]
    cached = CachedRequestData.make_empty()
    cached.req_ids = [r for r, _, _ in running]
    cached.num_computed_tokens = [c for _, c, _ in running]
    out.scheduled_cached_reqs = cached
    out.num_scheduled_tokens = {r: n for r, _, n in new + running}
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    return out


def test_step_work_reads_every_scheduled_request():
    out = _output([("a", 128, 896)], [("b", 2048, 512), ("c", 700, 1)])
    assert step_work(out) == [(128, 896), (2048, 512), (700, 1)]
    assert step_work(SchedulerOutput.make_empty()) == []


def test_only_mostly_prefill_steps_are_timed_and_each_from_its_start():
    seen = []
    timer = StepTimer(lambda w, s: seen.append((w, s)) or True, min_prefill_tokens=CT)
    timer.scheduled([(0, 1024)], now=10.0)
    timer.finished(now=12.0)  # the step's output came back
    timer.scheduled([(0, 32)], now=12.5)  # shorter than a chunk: overhead-dominated
    timer.scheduled([(0, 256)] + [(900, 1)] * 40, now=13.0)  # mostly decodes
    timer.scheduled([(0, 512), (900, 1)], now=14.0)
    timer.scheduled([(900, 1)], now=15.0)  # ended by the next build (no output reported)
    timer.finished(now=15.2)
    timer.finished(now=99.0)  # nothing pending: ignored
    assert seen == [([(0, 1024)], 2.0), ([(0, 512), (900, 1)], 1.0)]


def test_the_manager_wiring_teaches_a_default_gate_how_slow_this_host_computes():
    def default_gate(steps):
        return build_gate(None, ProfileExpectation(model="m", dtype="float32", kv_bytes_per_token=BPT, chunk_tokens=CT), steps=steps)[0]

    assert default_gate(steps=False).decide([ChunkState.DISK] * 2).recompute  # no step source: the prior gates
    gate = default_gate(steps=True)  # PyKvCacheConnector reports the steps (build_gating's steps_timed)
    wiring = GateWiring(gate, chunk_tokens=CT, chunk_bytes=CT * BPT)
    assert gate.decide([ChunkState.DISK] * 2).reason == "uncalibrated"
    for _ in range(200):  # a disk learnt slow under CPU contention
        gate.observe_load(16 * CT * BPT, 0.001 + 16 * CT * BPT / 2e8)
    clock = [0.0]
    wiring.steps.clock = lambda: clock[0]
    for i, n in enumerate([1024, 512, 2048, 768, 1536, 256]):
        wiring.observe(StepScheduled(step_work(_output([(f"r{i}", 0, n)], []))))
        clock[0] += 0.01 + 2e-3 * n  # a 2-core CPU: ~2 s per 1k tokens
        wiring.observe(StepFinished())
    assert wiring.steps.observed == 6
    d = gate.decide([ChunkState.DISK] * 16)
    assert d.reason == "load" and d.load_chunks == 16
    assert d.est_recompute_s == pytest.approx(16 * CT * 2e-3, rel=0.1)
    wiring.observe(Reset())
    assert wiring.snapshot().gauges["gate_prefill_observations"] == 6
