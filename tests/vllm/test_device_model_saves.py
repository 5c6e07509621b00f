"""When the gate's learnt device model is written (decisions 0073):
every load until the window outweighs the prior, then at most once per
interval. vLLM's OpenAI server force-kills its engine on SIGINT by default
(``--shutdown-timeout 0``), so the save at shutdown may never run: a server
that learnt its first loads and was stopped must still leave them."""

from __future__ import annotations

import pytest
from pykvcache.gate import ProfileExpectation, build_gate, device_memory
from pykvcache.vllm.scheduler.gate_plan import GateWiring
from pykvcache.vllm.scheduler.gating import GateHooks, Tick

CT = 64
BPT = 32 * 1024
CHUNK = CT * BPT


def _points(path) -> int:
    import json

    return len(json.loads(path.read_text())["points"])


def test_the_first_loads_are_saved_each_then_once_per_interval(tmp_path):
    gate, _ = build_gate(None, ProfileExpectation(model="m", dtype="float32", kv_bytes_per_token=BPT, chunk_tokens=CT), steps=True)
    path = tmp_path / device_memory.FILE_NAME
    now = [1000.0]
    wiring = GateWiring(gate, chunk_tokens=CT, chunk_bytes=CHUNK, hooks=GateHooks(device_file=path), clock=lambda: now[0])

    def tick() -> bool:
        """A step's tick; whether it wrote the file (on the writer's thread)."""
        path.unlink(missing_ok=True)
        wiring.observe(Tick())
        assert wiring._device_writer.flush(timeout=30.0)
        return path.exists()

    online = gate.online
    eager = online.prior_weight + 1
    for i in range(1, eager + 3):
        online.observe(16 * CHUNK, 16 * CHUNK / 25e6)  # a 25 MB/s disk, no time passing
        assert tick() is (i <= eager), i
        if i <= eager:
            assert _points(path) == i
    assert not tick(), "nothing new: nothing written"
    now[0] += 60.0
    assert tick() and _points(path) == eager + 2
    online.observe(16 * CHUNK, 16 * CHUNK / 25e6)
    wiring.close()  # and at shutdown, whenever the last save was
    assert _points(path) == eager + 3

    # What a restart after the eager saves starts from: the learnt disk, not the prior.
    gate2, _ = build_gate(None, ProfileExpectation(model="m", dtype="float32", kv_bytes_per_token=BPT, chunk_tokens=CT), steps=True)
    assert gate2.online.disk_bytes_per_s == pytest.approx(1e9)
    GateWiring(gate2, chunk_tokens=CT, chunk_bytes=CHUNK, hooks=GateHooks(device_file=path))
    assert gate2.online.samples == eager + 3
    assert gate2.online.disk_bytes_per_s == pytest.approx(25e6, rel=0.05)


def test_a_stalled_save_never_holds_the_scheduler(tmp_path):
    """The save ends with a rename over the previous file, which frees its
    blocks: on ext4 mounted with ``discard`` the renaming thread waited for the
    discard behind the reads at the device, 41-62 ms in the middle of a
    restarted server's first disk hit, and a network filesystem can stall it
    for seconds (decision 0082). The disk tier saves on its own thread: with
    the storage stalled (a real FUSE filesystem whose daemon is stopped), the
    scheduler's call returns at once, and the file is written once the
    filesystem answers again."""
    import sys
    import threading
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
    from stall_fs import StallFs, skip_reason

    if skip_reason() is not None:
        pytest.skip(skip_reason())
    from pykvcache import BlockStore, StagingPool
    from pykvcache.vllm.scheduler.disk_tier import DiskTier

    gate, _ = build_gate(None, ProfileExpectation(model="m", dtype="float32", kv_bytes_per_token=BPT, chunk_tokens=CT), steps=True)
    with StallFs(tmp_path) as fs:
        pool = StagingPool(CHUNK, 2)
        store = BlockStore([str(fs.mount_point / "kv")], pool, namespace="saves", capacity_bytes=1 << 30)
        disk = DiskTier(store, pool, gating=lambda hooks: GateWiring(gate, chunk_tokens=CT, chunk_bytes=CHUNK, hooks=hooks))
        try:
            gate.online.observe(16 * CHUNK, 16 * CHUNK / 25e6)  # a lesson: a 25 MB/s disk
            fs.stall()
            resume = threading.Timer(3.0, fs.resume)
            resume.start()
            began = time.monotonic()
            disk.gating.observe(Tick())  # the step's tick saves what was learnt
            held = time.monotonic() - began
            resume.join()
            assert held < 0.5, f"the scheduler's thread waited {held:.2f} s for the stalled filesystem"
            assert disk.gating._device_writer.flush(timeout=30.0)
            assert _points(Path(store.namespace_dir[0]) / device_memory.FILE_NAME) == 1
        finally:
            fs.resume()
            disk.shutdown(lambda: None)
