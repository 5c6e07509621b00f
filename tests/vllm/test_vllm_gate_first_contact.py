"""First contact with a device far slower than the gate's profile.

A profile calibrated on a fast disk (1426 MB/s), served from a disk capped at
0.26 MB/s: a 2 MiB chunk takes 8 s there, four times the I/O deadline, so no
read ever ends with its chunk. The gate committed its first requests to
loads of up to 24 chunks, each waited for the deadline and was recomputed, and
it learnt nothing (only reads that served their chunk taught it): the
profile's 1426 MB/s stayed (2026-12-06, 2-core VM). These tests drive the manager's gate wiring
(``GateWiring``: plans, a background sampler, read ends, a scripted clock)
with the real gate ``build_gate`` makes from such a profile, and no engine.
"""

from __future__ import annotations

import statistics

from pykvcache.gate import ChunkState, GateProfile, ProfileExpectation, build_gate, hardware_id
from pykvcache.vllm.scheduler.gate_plan import GateWiring
from pykvcache.vllm.scheduler.gating import GateHooks, GateInputs, ReadEnded, ReadStarted, RequestDropped
from vllm.v1.kv_offload.base import ReqContext

CT = 64
BPT = 32 * 1024  # the serving benchmark's model: 2 MiB chunks
CHUNK = CT * BPT
CHUNKS = 24  # a 1.5k-token document on disk
SLOW = 0.26e6  # bytes/s
DEADLINE_S = 2.0  # the engine's default I/O deadline for such chunks


def _gate(tmp_path):
    profile = GateProfile(
        model="/models/llama3-geometry",
        dtype="float32",
        block_size=32,
        chunk_tokens=CT,
        kv_bytes_per_token=BPT,
        world_size=1,
        hardware=hardware_id(),
        storage={"dir": "/data", "device": "vda", "fstype": "ext4"},
        # ~1 s for a 1.5k-token prefix, as on a 2-core CPU.
        prefill={"a": 0.0, "b": 6.5e-4, "c": 0.0, "points": []},
        load={"fixed_s": 0.0, "disk_bytes_per_s": 1426e6, "h2d_bytes_per_s": 4.7e9, "points": []},
        break_even_tokens=22.0,
        created="2026-12-06T00:00:00+00:00",
        pykvcache_version="0.1.0",
    )
    expect = ProfileExpectation(model=profile.model, dtype=profile.dtype, kv_bytes_per_token=BPT, chunk_tokens=CT)
    gate, source = build_gate(profile.save(tmp_path / "profile.json"), expect, steps=True)
    assert source == "profile"
    return gate


class SlowDevice:
    """Requests one per second, every chunk on disk. Every read (a request's
    or a background sample) times out at the I/O deadline, as the engine's
    reads of 2 MiB at 0.26 MB/s do (``timed_out``). A request asked to retry
    (first contact) is asked again at each 50 ms scheduler step."""

    def __init__(self, gate) -> None:
        self.gate = gate
        self.now = 100.0
        self.sampled: list[bytes] = []
        hooks = GateHooks(sampler=lambda keys: (self.sampled.extend(keys), list(keys))[1])
        self.wiring = GateWiring(gate, chunk_tokens=CT, chunk_bytes=CHUNK, hooks=hooks, clock=lambda: self.now)
        self.reads: list[tuple[float, bytes]] = []  # (submitted at, key), outstanding
        self.n = 0

    def _submit(self, keys) -> None:
        for key in keys:
            self.wiring.observe(ReadStarted(self.now))
            self.reads.append((self.now, key))

    def _advance(self, to: float) -> None:
        """The clock moves to ``to``; reads that time out meanwhile end."""
        for started, key in sorted(self.reads):
            if started + DEADLINE_S <= to:
                self.now = max(self.now, started + DEADLINE_S)
                self.reads.remove((started, key))
                self.wiring.observe(ReadEnded(key, False, 0.0, started_at=started, timed_out=True))
        self.now = to

    def request(self) -> tuple[float, float]:
        """One request; returns ``(seconds it waits for the disk, its recompute)``."""
        self.n += 1
        ctx = ReqContext(req_id=f"r{self.n}")
        keys = [f"d{self.n}c{i}".encode().ljust(12, b".") + b"\0\0\0\0" for i in range(CHUNKS)]
        for i, key in enumerate(keys):
            ctx._offload_key_positions[key] = (i + 1) * CT
        arrived = self.now
        while True:
            sampled = len(self.sampled)
            plan = self.wiring.plan_for(keys[0], ctx, lambda ks, _req: GateInputs([ChunkState.DISK] * len(ks), 0))
            self._submit(self.sampled[sampled:])
            if plan.retry_until is None:
                break
            self._advance(self.now + 0.05)
        self._submit(sorted(plan.awaiting))
        # Its load takes that long (each read waits for the ones before it).
        wait = self.now - arrived + len(plan.awaiting) * CHUNK / SLOW
        self.wiring.observe(RequestDropped(ctx.req_id))
        self._advance(arrived + 1.0)
        return wait, plan.decision.est_recompute_s


def test_first_contact_with_a_disk_far_slower_than_the_profile_costs_no_request_a_wait(tmp_path):
    device = SlowDevice(_gate(tmp_path))
    served = [device.request() for _ in range(30)]
    first, rest = served[:5], served[5:]
    assert all(wait <= 3 * recompute for wait, recompute in first), first
    # After the first 5: the median request waits for no read (recomputing is its whole cost).
    assert statistics.median(wait for wait, _ in rest) == 0.0
    # Reads that ran out of time taught the gate the device: about a chunk per deadline (busy
    # periods of reads that overlap a little more), not the profile's 1426 MB/s.
    assert device.gate.online.disk_bytes_per_s < 2 * CHUNK / DEADLINE_S
    assert device.sampled, "the device was sampled in the background"
    assert first[0][0] > 0, "the first request waited for its first chunk's read, at most its recompute"
