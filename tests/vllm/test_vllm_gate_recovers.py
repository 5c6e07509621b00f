"""A gate that learnt a slow disk comes back to it.

On the two-node GlusterFS fixture the first loads after a partition healed
taught the gate 20.7 MB/s, and it recomputed every request from then on: a
gate that recomputes sees no loads, so it never learnt that the disk was fast
again. These tests drive the manager's gate (``GateWiring``: plans, finished
reads, the store's breaker counters) through its seam as the manager does,
with a scripted clock, disk and circuit breaker, and no engine. With a sampler (the
standalone manager, decision 0054) an exploration is read in the background
while its request recomputes; the last tests script that device too.
"""

from __future__ import annotations

import pytest
from pykvcache.gate import ChunkState, ProfileExpectation, build_gate
from pykvcache.vllm.scheduler.gate_plan import GateWiring
from pykvcache.vllm.scheduler.gating import GateHooks, GateInputs, ReadEnded, ReadStarted, RequestDropped, Tick
from vllm.v1.kv_offload.base import ReqContext

CT = 64
BPT = 12 * 1024
CHUNK = CT * BPT  # 768 KiB
CHUNKS = 14  # a ~900-token prompt, as in the Gluster e2e test
FAST = 1e9  # bytes/s
SLOW = 20e6  # bytes/s (what the gate learnt on the GlusterFS fixture): 14 chunks in ~0.5 s, against ~0.2 s of prefill


class Serving:
    """One request per second against the wiring; every chunk on disk.
    ``breakers``: the gate follows :attr:`breakers`; ``background``:
    explorations are read in the background by a device that serves
    ``burst_bytes`` at once after idling (a cgroup throttle's slice
    allowance), then ``bytes_per_s``."""

    def __init__(self, *, breakers: bool = False, background: tuple[float, int] | None = None) -> None:
        gate, _ = build_gate(None, ProfileExpectation(model="m", dtype="float32", kv_bytes_per_token=BPT, chunk_tokens=CT), steps=True)
        # ~0.2 ms per prefilled token (what the step timer learns of the tiny e2e model).
        for n in (256, 512, 768, 1024, 1536, 2048):
            assert gate.observe_prefill([(0, n)], 0.01 + 2e-4 * n)
        self.gate = gate
        self.now = 1000.0
        self.breakers = (0, 0, 0)  # (opens, closes, open dirs), as BlockStore.breaker_health
        self.n = 0
        self.totals: dict[str, float] = {}
        self.sampled: list[list[bytes]] = []  # each exploration's background reads
        self.device = background
        hooks = GateHooks(
            breakers=(lambda: self.breakers) if breakers else None,
            io_deadline_s=2.0,
            sampler=(lambda keys: (self.sampled.append(list(keys)), list(keys))[1]) if background else None,
        )
        self.wiring = GateWiring(gate, chunk_tokens=CT, chunk_bytes=CHUNK, hooks=hooks, clock=lambda: self.now)

    def _serve_sample(self, keys: list[bytes]) -> None:
        """The sample's reads, submitted together now, end in order on the device."""
        rate, burst = self.device
        for _ in keys:
            self.wiring.observe(ReadStarted(self.now))
        served = 0
        for key in keys:
            served += CHUNK
            self.wiring.observe(ReadEnded(key, True, 1e-4 + max(0, served - burst) / rate, CHUNK, started_at=self.now))

    def learn(self, bytes_per_s: float, lessons: int) -> list:
        """Requests loading at ``bytes_per_s`` until the gate has learnt
        ``lessons`` loads; returns their decisions. A lesson covers 0.1 s of
        the device's time (decision 0079): at 1 GB/s, nine of these 11 ms
        loads."""
        decisions = []
        while self.gate.online.samples < lessons:
            decisions.append(self.request(bytes_per_s))
            assert len(decisions) <= 10 * lessons, "the gate learns nothing"
        return decisions

    def plan(self, name: str, chunks: int = CHUNKS):
        """The gate's plan for request ``name`` of ``chunks`` chunks, every one on disk."""
        ctx = ReqContext(req_id=name)
        keys = [f"{name}c{i}".encode().ljust(12, b".") + b"\0\0\0\0" for i in range(chunks)]
        for i, key in enumerate(keys):
            ctx._offload_key_positions[key] = (i + 1) * CT
        plan = self.wiring.plan_for(keys[0], ctx, lambda ks, _req: GateInputs([ChunkState.DISK] * len(ks), 0))
        return ctx, keys, plan

    def request(self, bytes_per_s: float, scheduled_before_reads_end: bool = False):
        """Plans one request, completes its disk reads at ``bytes_per_s`` (all
        submitted together: the longest read ends when the last byte is in),
        then a second passes. ``scheduled_before_reads_end``: vLLM schedules it
        (the plan is dropped) before its reads end, as with lookups answering
        HIT for reads in flight (decision 0055)."""
        self.n += 1
        samples = len(self.sampled)
        ctx, keys, plan = self.plan(f"r{self.n}")
        if len(self.sampled) > samples:
            self.device = (bytes_per_s, self.device[1])
            self._serve_sample(self.sampled[-1])
        if scheduled_before_reads_end:
            self.wiring.observe(RequestDropped(ctx.req_id))
        loaded = [k for k in keys if k in plan.allowed]
        for key in loaded:
            self.wiring.observe(ReadEnded(key, True, 0.001 + len(loaded) * CHUNK / bytes_per_s))
        self.wiring.observe(RequestDropped(ctx.req_id))
        for name, value in self.wiring.snapshot().counters.items():
            self.totals[name] = self.totals.get(name, 0) + value
        self.now += 1.0
        return plan.decision


def test_a_gate_that_learnt_a_slow_disk_keeps_sampling_and_loads_again_once_samples_are_fast():
    s = Serving()
    assert all(d.reason == "load" for d in s.learn(FAST, 3))
    # The window's median turns with the fourth slow load: from then on a disk
    # at 20 MB/s is slower than this CPU's prefill.
    first = [s.request(SLOW) for _ in range(5)]
    assert [d.load_chunks == CHUNKS for d in first] == [True] * 4 + [False]
    # The disk stays slow for a minute: the gate keeps sampling, at a bounded cost.
    slow = [s.request(SLOW) for _ in range(60)]
    explored = [d for d in first + slow if d.reason == "explore"]
    assert 3 <= len(explored) <= 8, [round(d.est_load_s, 2) for d in explored]
    assert all(d.recompute for d in slow if d.reason != "explore")
    # Each sample is the smallest useful one here: one chunk read (its
    # estimated load is more than twice its recompute beyond that).
    assert all(d.load_chunks == 1 and d.disk_chunks == 1 for d in explored)
    assert s.totals["gate_decisions_explore"] == len(explored)
    # The disk is fast again: whole prefixes are loaded within the longest
    # exploration interval plus two sampled requests.
    back = []
    for _ in range(60):
        back.append(s.request(FAST))
        if back[-1].reason == "load" and back[-1].load_chunks == CHUNKS:
            break
    assert back[-1].reason == "load" and back[-1].load_chunks == CHUNKS, [d.reason for d in back]
    assert len(back) <= 30 + 3, f"{len(back)} requests (one per second) before the gate loaded again"
    assert sum(d.reason == "explore" for d in back) == 2
    assert s.gate.online.disk_bytes_per_s > 100e6


def test_what_was_learnt_while_the_breaker_was_open_or_half_open_is_forgotten():
    s = Serving(breakers=True)
    assert all(d.load_chunks == CHUNKS for d in s.learn(FAST, 2))
    learnt = s.gate.online.disk_bytes_per_s
    s.now += 30.0
    # The link dies: three loads complete slowly while the breaker is still
    # closed (the breaker opens only after three operations in a row time out
    # or fail), then it opens, and loads straddling that complete slowly while
    # it is open and while it is half-open.
    for _ in range(3):
        s.request(SLOW)
    assert s.gate.online.disk_bytes_per_s < learnt / 10, "learnt as it happened: the breaker was closed"
    s.breakers = (1, 0, 1)  # open
    s.request(FAST)  # a lookup before the reads complete: the plan loads again
    s.wiring.observe(Tick())
    assert s.gate.online.disk_bytes_per_s == pytest.approx(learnt)
    assert s.totals["gate_loads_forgotten"] == 3
    for _ in range(2):  # open, then half-open (not closed either)
        assert s.request(SLOW).load_chunks == CHUNKS
    assert s.gate.online.disk_bytes_per_s == pytest.approx(learnt)
    assert s.totals["gate_loads_ignored"] == 3
    s.now += 20.0
    s.breakers = (1, 1, 0)  # the probe succeeded
    d = s.request(FAST)
    assert d.reason == "load" and d.load_chunks == CHUNKS
    assert s.gate.online.disk_bytes_per_s == pytest.approx(learnt)


def test_the_first_loads_after_a_breaker_closes_do_not_drag_the_learnt_bandwidth_down():
    s = Serving(breakers=True)
    assert all(d.load_chunks == CHUNKS for d in s.learn(FAST, 2))
    learnt = s.gate.online.disk_bytes_per_s
    s.now += 30.0
    # An outage that opened and closed between two looks (an idle engine):
    # the counters still say so.
    s.breakers = (1, 1, 0)
    # The mount reconnects: its first loads are slow.
    for _ in range(2):
        d = s.request(SLOW)
        assert d.reason == "load" and d.load_chunks == CHUNKS
    assert s.gate.online.disk_bytes_per_s == pytest.approx(learnt)
    assert s.totals["gate_loads_ignored"] == 2
    # A device that stays slow after the outage is learnt from the loads after those.
    later = [s.request(SLOW) for _ in range(4)]
    assert later[-1].load_chunks < CHUNKS
    assert s.gate.online.disk_bytes_per_s < learnt / 10


def test_a_gate_that_recomputed_through_an_outage_samples_the_disk_as_soon_as_the_breaker_closes():
    s = Serving(breakers=True)
    s.learn(FAST, 3)
    for _ in range(6):
        s.request(SLOW)  # learnt slow, long before any outage
    assert s.request(SLOW).load_chunks < CHUNKS
    for _ in range(40):  # the exploration interval grows to its longest
        s.request(SLOW)
    s.breakers = (1, 0, 1)
    s.request(SLOW)
    s.now += 5.0
    s.breakers = (1, 1, 0)
    d = s.request(FAST)
    assert d.reason == "explore", "the breaker closed: the device may be anything now"


def test_reads_that_end_after_their_request_was_scheduled_still_teach_the_gate():
    """With lookups answering HIT for reads in flight (decision 0055) vLLM
    schedules a request before its reads end, and its plan was dropped then:
    the gate kept its prior (1000 MB/s) on a disk capped at 25 MB/s and loaded
    every prefix at 0.54x recompute's p50 (serving benchmark, 2026-12-05)."""
    s = Serving()
    decisions = [s.request(SLOW, scheduled_before_reads_end=True) for _ in range(8)]
    loads = sum(bool(d.load_chunks) for d in decisions)
    assert loads >= 2 and s.wiring.observations == loads, "each load timed to its last read"
    assert decisions[0].load_chunks == CHUNKS
    assert decisions[-1].recompute, "a disk at 20 MB/s is slower than this CPU's prefill, once learnt"
    assert not s.wiring._timing, "nothing left timed once the reads ended"


def test_timed_loads_of_scheduled_requests_are_bounded():
    from pykvcache.vllm.scheduler.gate_plan import MAX_TIMED_REQUESTS

    s = Serving()
    for n in range(MAX_TIMED_REQUESTS + 10):
        ctx, _keys, _plan = s.plan(f"q{n}", chunks=2)
        s.wiring.observe(RequestDropped(ctx.req_id))  # its reads never come (the lookup stopped early)
    assert len(s.wiring._timing) == MAX_TIMED_REQUESTS
    assert len(s.wiring._awaited_by) <= 2 * MAX_TIMED_REQUESTS, "the oldest let go of their keys"


def test_background_samples_cost_their_request_nothing_and_bring_the_loads_back():
    """Decision 0054: the explored request recomputes; the sample is read
    beside it and its busy period is the measurement."""
    s = Serving(background=(SLOW, 0))
    # Past first contact (tests/vllm/test_vllm_gate_first_contact.py): a read timed the device.
    s.gate.observe_load(CHUNK, CHUNK / FAST)
    assert all(d.reason == "load" for d in s.learn(FAST, 3))
    learnt = [s.request(SLOW) for _ in range(5)]
    assert learnt[-1].recompute
    slow = [s.request(SLOW) for _ in range(60)]
    explored = [d for d in learnt + slow if d.sample_chunks]
    assert 3 <= len(explored) <= 8
    # No request waits for a sample: each explored one recomputes, and none loads.
    assert all(d.recompute and d.reason == "below_break_even" for d in learnt[-1:] + slow)
    # A sample outlasts the estimated 0.5 s at the learnt speed: 13 chunks of 768 KiB at 20 MB/s.
    assert all(len(keys) == 13 for keys in s.sampled), [len(k) for k in s.sampled]
    assert s.totals["gate_decisions_explore"] == len(explored) == len(s.sampled)
    assert s.totals.get("gate_loads_forgotten", 0) == 0
    back = []
    for _ in range(60):
        back.append(s.request(FAST))
        if back[-1].reason == "load" and back[-1].load_chunks == CHUNKS:
            break
    assert back[-1].load_chunks == CHUNKS, [d.reason for d in back]
    assert len(back) <= 30 + 3, f"{len(back)} requests (one per second) before the gate loaded again"
    assert sum(bool(d.sample_chunks) for d in back) == 2
    assert s.gate.online.disk_bytes_per_s > 100e6


@pytest.mark.parametrize("min_sample_s", [0.5, 0.0])
def test_a_sample_sized_to_outlast_a_throttles_burst_does_not_unlearn_a_slow_disk(min_sample_s):
    """A cgroup-v1 read throttle serves a 100 ms slice's allowance at once
    after idling (2.5 MB at 25 MB/s): a one-chunk sample there looks 2x+
    faster than the device, twice in a row, and the gate forgot a window that
    was right (decision 0054). A sample of 0.5 s at the learnt speed does not;
    one cut short (``min_sample_s`` 0 here; in service, staging with room for
    one chunk) is less than two slices' worth and proves nothing either way
    (decision 0079): it is learnt as an ordinary lesson, pooled."""
    s = Serving(background=(SLOW, int(SLOW * 0.1) + CHUNK // 2))
    s.gate.exploration.min_sample_s = min_sample_s
    s.learn(FAST, 3)
    for _ in range(5):
        s.request(SLOW)
    decisions = [s.request(SLOW) for _ in range(90)]
    assert s.sampled, "no exploration"
    assert min_sample_s or all(len(keys) == 1 for keys in s.sampled)
    assert s.totals.get("gate_loads_forgotten", 0) == 0
    assert all(d.recompute for d in decisions)
    if not min_sample_s:
        assert s.gate.exploration.surprises == 0, "a cut-short sample is no verdict on the device"
        assert s.gate.online.disk_bytes_per_s < 2 * SLOW


def test_a_read_pooled_into_a_lesson_counts_as_timed_for_the_preload_bound():
    """Before its first lesson the default gate holds the prior; a read pooled
    into that lesson has timed the device all the same, so the preload bound
    (0061) follows the prior's speed from then on, as it did when the prior
    outvoted a first load, instead of one chunk until 0.1 s of reads are in."""
    s = Serving()
    assert s.wiring.snapshot().device_bytes_per_s is None
    s.request(FAST)  # 11 ms: pooled
    assert s.gate.online.samples == 0 and s.gate.online.pooled == 1
    assert s.wiring.snapshot().device_bytes_per_s == s.gate.online.base.disk_bytes_per_s
