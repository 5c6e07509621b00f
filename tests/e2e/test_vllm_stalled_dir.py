"""A real vLLM whose storage directory stalls in the middle of serving, then is emptied.

The store lives on a FUSE passthrough (tests/helpers/stall_fs.py); the driver SIGSTOPs its
daemon between two requests, so every open, read and write on the mount hangs in the kernel
as on a network filesystem whose link is down (measured before: 78 s for one request on
GlusterFS). Later a cleanup job deletes everything in the storage directory while the engine
serves: stores resume without a restart. One engine: the tokens to match are its own from the
first, uncached request.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from child_paths import child
from engine_driver import run_driver
from vllm_marks import VLLM_ENGINE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from stall_fs import StallFs, skip_reason  # noqa: E402

pytestmark = [*VLLM_ENGINE, pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))]

CHUNK_TOKENS = 64
SLOT_FOOTPRINT = 2 * 2 * 2 * 64 * 4 * CHUNK_TOKENS + 4096
DEADLINE_S = 1.0


def _metric(phase: dict, name: str) -> float:
    return phase["metrics"].get(f"vllm:pykvcache_{name}", 0)


def test_a_stalled_store_never_stalls_serving_and_hits_return_after_it_resumes(tiny_model, tmp_path):
    from pykvcache.testing.tiny_model import synthetic_text
    from pykvcache.vllm.config import kv_transfer_config

    prompt = f"{synthetic_text(250, seed=100)} {synthetic_text(12, seed=201)}"
    fillers = [synthetic_text(250, seed=300 + i) for i in range(3)]
    with StallFs(tmp_path / "fs") as fs:
        pid, mp = fs.proc.pid, fs.mount_point
        config = kv_transfer_config(
            [str(fs.mount_point)],
            1 << 30,
            staging_bytes=24 * SLOT_FOOTPRINT,
            block_size=CHUNK_TOKENS,
            io_deadline_s=DEADLINE_S,
            # The breaker is under test, not the gate: once it has learnt
            # this FUSE mount (~190 MB/s from two loads), the gate rightly
            # recomputes a 250-token prompt of the tiny model.
            gate=False,
        )
        scenario = {
            "model": tiny_model,
            "llm": {"kv_transfer_config": config},
            "phases": [
                {"op": "generate", "name": "first", "prompts": [prompt]},
                # Push the prompt's chunks out of the device cache and of staging: on disk only.
                {"op": "reset_prefix_cache"},
                {"op": "generate", "name": "fillers", "prompts": fillers},
                {"op": "reset_prefix_cache"},
                {"op": "signal", "pid": pid, "signal": "SIGSTOP"},
                {"op": "generate", "name": "stalled", "prompts": [prompt], "settle": False},
                {"op": "reset_prefix_cache"},
                {"op": "generate", "name": "stalled_again", "prompts": [prompt], "settle": False},
                {"op": "signal", "pid": pid, "signal": "SIGCONT"},
                {"op": "sleep", "seconds": 6},
                {"op": "reset_prefix_cache"},
                {"op": "generate", "name": "fillers_again", "prompts": fillers},
                {"op": "reset_prefix_cache"},
                {"op": "generate", "name": "resumed", "prompts": [prompt]},
                # A cleanup job empties the storage directory under the serving engine.
                {"op": "shell", "name": "emptied", "argv": ["sh", "-c", f"rm -rf {mp}/*"]},
                {"op": "reset_prefix_cache"},
                {"op": "generate", "name": "after_emptied", "prompts": [prompt]},
                {"op": "until_breaker_closed", "name": "back", "timeout_s": 10},
                # Its put was skipped: the prompt's chunks are in staging only. Out of
                # staging, the next request computes and stores them on disk again.
                {"op": "reset_prefix_cache"},
                {"op": "generate", "name": "fillers_back", "prompts": fillers},
                {"op": "reset_prefix_cache"},
                {"op": "generate", "name": "stored_again", "prompts": [prompt]},
                {"op": "reset_prefix_cache"},
                {"op": "generate", "name": "fillers_third", "prompts": fillers},
                {"op": "reset_prefix_cache"},
                {"op": "generate", "name": "hit_again", "prompts": [prompt]},
            ],
        }
        try:
            result, _ = run_driver(str(child("driver.py")), scenario, tmp_path, "stalled", timeout=600)
        finally:
            fs.resume()
    p = {ph["name"]: ph for ph in result["phases"]}
    print(f"[stalled] startup={result['startup_s']}s " + ", ".join(f"{n}={ph['seconds']}s" for n, ph in p.items()), file=sys.stderr)
    expected = p["first"]["tokens"]
    stalled = p["stalled"]
    assert stalled["tokens"] == expected and p["stalled_again"]["tokens"] == expected
    # Bounded by the deadline, not by the filesystem (78 s on Gluster before).
    assert stalled["seconds"] < DEADLINE_S * 3 + 10, stalled["seconds"]
    assert p["stalled_again"]["seconds"] < DEADLINE_S * 3 + 10
    assert _metric(stalled, "disk_io_timeouts") > 0 and _metric(stalled, "unavailable_reads") > 0
    # The breaker is open: the directory's chunks read as absent, nothing waits on it.
    assert _metric(p["stalled_again"], "disk_breaker_open_dirs") == 1
    assert _metric(p["stalled_again"], "disk_reads") == _metric(stalled, "disk_reads")
    resumed = p["resumed"]
    assert resumed["tokens"] == expected
    assert resumed["num_cached_tokens"][0] > 0
    assert _metric(resumed, "disk_reads") > _metric(p["fillers_again"], "disk_reads"), "disk hits again, no restart"
    assert _metric(resumed, "disk_breaker_open_dirs") == 0
    assert _metric(resumed, "disk_quarantined_slots") == 0 and _metric(resumed, "disk_stuck_ops") == 0
    assert _metric(resumed, "corrupt_chunks") == 0
    # Emptied: the directory is unavailable at once (breaker), never a failure of serving,
    # and stores succeed again within seconds, no restart; what it stores is read back.
    after = p["after_emptied"]
    assert p["emptied"]["rc"] == 0, p["emptied"]["output"]
    assert after["tokens"] == expected
    assert _metric(after, "disk_breaker_opens") > _metric(resumed, "disk_breaker_opens")
    assert p["back"]["closed"], "the breaker's probe found the directory usable again"
    hit = p["hit_again"]
    assert hit["tokens"] == expected and hit["num_cached_tokens"][0] > 0
    assert _metric(hit, "disk_reads") > _metric(p["fillers_third"], "disk_reads"), "stored and read back after the cleanup"
