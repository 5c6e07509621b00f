"""When the gate's learnt device model is written (decisions 0073):
every load until the window outweighs the prior, then at most once per
interval. vLLM's OpenAI server force-kills its engine on SIGINT by default
(``--shutdown-timeout 0``), so the save at shutdown may never run: a server
that learnt its first loads and was stopped must still leave them."""

from __future__ import annotations

import pytest

from pykvcache.gate import ProfileExpectation, build_gate, device_memory
from pykvcache.vllm.gate_plan import GateWiring

CT = 64
BPT = 32 * 1024
CHUNK = CT * BPT


def _points(path) -> int:
    import json

    return len(json.loads(path.read_text())["points"])


def test_the_first_loads_are_saved_each_then_once_per_interval(tmp_path):
    gate, _ = build_gate(None, ProfileExpectation(model="m", dtype="float32", kv_bytes_per_token=BPT,
                                                   chunk_tokens=CT), steps=True)
    wiring = GateWiring(gate, chunk_tokens=CT, chunk_bytes=CHUNK)
    now = [1000.0]
    wiring.clock = lambda: now[0]
    path = tmp_path / device_memory.FILE_NAME
    online = gate.online
    eager = online.prior_weight + 1
    for i in range(1, eager + 3):
        online.observe(16 * CHUNK, 16 * CHUNK / 25e6)  # a 25 MB/s disk, no time passing
        saved = wiring.save_device(path, every_s=60.0)
        assert saved is (i <= eager), i
        assert _points(path) == min(i, eager)
    assert not wiring.save_device(path, every_s=60.0), "nothing new: nothing written"
    now[0] += 60.0
    assert wiring.save_device(path, every_s=60.0) and _points(path) == eager + 2

    # What a restart after the eager saves starts from: the learnt disk, not the prior.
    gate2, _ = build_gate(None, ProfileExpectation(model="m", dtype="float32", kv_bytes_per_token=BPT,
                                                    chunk_tokens=CT), steps=True)
    assert gate2.online.disk_bytes_per_s == pytest.approx(1e9)
    assert device_memory.restore(path, gate2.online)[0] == eager + 2
    assert gate2.online.disk_bytes_per_s == pytest.approx(25e6, rel=0.05)
