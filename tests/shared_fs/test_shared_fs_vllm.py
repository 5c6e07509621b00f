"""Two vLLM engines, one per node of the GlusterFS fixture (two FUSE clients of
one volume, each in its own network namespace), sharing one store directory.

Two engine starts in all, one after the other (2-core machine):

node A (mount A, KV events published over ZMQ and subscribed to here) computes
five ~900-token prompts U (with a cache salt: a reference only), P, Q, R, S with
a capacity of about three of them, so U and most of P are evicted again;

node B (mount B) then
  1. serves Q from the store: cached tokens, disk reads, A's tokens;
  2. with its network link down (``ip -n NS link set kvc down``) serves R:
     the chunks are misses, R is recomputed with A's tokens, within a bound;
  3. with the link back up serves S from the disk again, without a restart;
  4. with its FUSE client killed (every call ENOTCONN) serves U: misses,
     recomputed, no crash.

A's generations are vLLM's own computation (nothing was on disk for them), so
"A's tokens" is "vLLM alone" for each prompt.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from child_paths import child
from engine_driver import run_driver
from vllm_marks import VLLM_ENGINE

pytestmark = VLLM_ENGINE

CHUNK_TOKENS = 64
CHUNK_BYTES = 2 * 2 * 2 * 64 * 4 * CHUNK_TOKENS  # layers * (K,V) * kv heads * head_dim * fp32
SLOT_FOOTPRINT = CHUNK_BYTES + 4096
CAPACITY_CHUNKS = 44  # Q, R and S (~14 chunks each) fit; U and P are evicted for them
# Node B's request while its link is down: the disk must not hold it longer
# than this beyond the recompute (the engine's I/O deadline; without one, a
# dead mount blocks for about network.ping-timeout plus TCP retries).
PARTITION_BOUND_S = 15.0


def _texts():
    from pykvcache.testing.tiny_model import synthetic_text

    return {name: synthetic_text(250, seed=700 + i) for i, name in enumerate("UPQRS")}


def _kv(directory, **extra):
    from pykvcache.vllm.config import kv_transfer_config

    return kv_transfer_config([str(directory)], CAPACITY_CHUNKS * SLOT_FOOTPRINT,
                              staging_bytes=24 * SLOT_FOOTPRINT, block_size=CHUNK_TOKENS, **extra)


def _gen(name, prompts, **kw):
    return {"op": "generate", "name": name, "prompts": prompts, **kw}


@pytest.fixture(scope="module")
def nodes(gluster, tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("shared-fs-vllm")
    texts = _texts()
    a_dir, b_dir = gluster.mounts["a"] / "vllm-store", gluster.mounts["b"] / "vllm-store"
    shutil.rmtree(a_dir, ignore_errors=True)
    a_dir.mkdir(mode=0o700)
    endpoint = f"ipc://{work}/kv-events.sock"
    node_a = {
        "model": tiny_model,
        "llm": {"kv_transfer_config": _kv(a_dir, self_describing_kv_events=True)},
        "kv_events": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint},
        "phases": [_gen("U", [{"text": texts["U"], "salt": "reference"}], prompt_ids=True)]
        + [_gen(n, [texts[n]], prompt_ids=True) for n in "PQRS"]
        + [{"op": "events_take"}],
    }
    a, _ = run_driver(child("driver.py"), node_a, work, "node-a")
    ns_b = gluster.netns["b"]
    node_b = {
        "model": tiny_model,
        "llm": {"kv_transfer_config": _kv(b_dir)},
        "phases": [
            _gen("Q", [texts["Q"]]),
            {"op": "shell", "name": "link_down", "argv": ["ip", "-n", ns_b, "link", "set", "kvc", "down"]},
            _gen("R_partitioned", [texts["R"]]),
            {"op": "shell", "name": "link_up", "argv": ["ip", "-n", ns_b, "link", "set", "kvc", "up"]},
            # The breaker probes after its back-off (doubling while the link
            # was down): hits resume once a probe succeeds, not at once.
            {"op": "until_breaker_closed", "name": "breaker_closed", "timeout_s": 90},
            _gen("S_link_back", [texts["S"]]),
            {"op": "shell", "name": "kill_client", "argv": ["kill", "-9", str(gluster.client_pids["b"])]},
            {"op": "sleep", "seconds": 1},
            _gen("U_client_dead", [texts["U"]]),
        ],
    }
    try:
        try:
            b, _ = run_driver(child("driver.py"), node_b, work, "node-b", timeout=400)
        except subprocess.TimeoutExpired as exc:
            partial = (exc.stdout or b"") + b"\n" + (exc.stderr or b"")
            (work / "node-b.log").write_bytes(partial if isinstance(partial, bytes) else partial.encode())
            tail = partial[-4000:].decode(errors="replace") if isinstance(partial, bytes) else partial[-4000:]
            pytest.fail(f"node B's driver did not finish in 400 s:\n{tail}")
    finally:
        gluster.link("b", up=True)
        gluster.remount("b")
        shutil.rmtree(a_dir, ignore_errors=True)
    for result in (a, b):
        result["by_name"] = {p["name"]: p for p in result["phases"]}
        times = ", ".join(f"{p['name']}={p.get('generate_s', p['seconds'])}s" for p in result["phases"])
        print(f"startup={result['startup_s']}s {times}", file=sys.stderr)
    return a["by_name"], b["by_name"]


def _metric(phase, name):
    return phase["metrics"].get(f"vllm:pykvcache_{name}", 0)


def test_a_prefix_stored_on_node_a_is_served_from_the_store_on_node_b(nodes):
    a, b = nodes
    q = b["Q"]
    assert a["Q"]["num_cached_tokens"] == [0]
    assert q["num_cached_tokens"][0] >= 13 * CHUNK_TOKENS, q["num_cached_tokens"]
    assert _metric(q, "disk_reads") >= 13
    assert _metric(q, "corrupt_chunks") == 0
    assert q["tokens"] == a["Q"]["tokens"], "node B's tokens differ from vLLM's own computation"


def test_node_b_partitioned_from_the_store_recomputes_within_the_bound_and_recovers(nodes):
    a, b = nodes
    r = b["R_partitioned"]
    print(f"request on the partitioned node: {r['generate_s']} s (bound {PARTITION_BOUND_S} s); "
          f"Q from disk took {b['Q']['generate_s']} s")
    assert r["tokens"] == a["R"]["tokens"]
    assert r["num_cached_tokens"] == [0], "nothing could be loaded over a dead link"
    assert r["generate_s"] <= PARTITION_BOUND_S, f"the dead mount held the request {r['generate_s']} s"
    closed = b["breaker_closed"]
    print(f"breaker closed {closed['seconds']} s after the link came back ({closed['attempts']} tiny requests)")
    assert closed["closed"], "no probe closed the breaker within 90 s of the link coming back"
    s = b["S_link_back"]
    assert s["tokens"] == a["S"]["tokens"]
    assert s["num_cached_tokens"][0] >= 13 * CHUNK_TOKENS, "disk hits did not resume after the link came back"


def test_node_b_with_its_filesystem_client_killed_misses_and_keeps_serving(nodes):
    a, b = nodes
    u = b["U_client_dead"]
    assert u["tokens"] == a["U"]["tokens"]
    assert u["num_cached_tokens"] == [0]
    assert _metric(u, "corrupt_chunks") == 0


def test_node_a_publishes_stores_and_evictions_with_the_requests_block_hashes(nodes):
    a, _ = nodes
    events = a["events_take"]["events"]
    gpu_stored = {h for e in events if e["type"] == "BlockStored" and e["medium"] == "GPU"
                  for h in e["block_hashes"]}
    stored = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "STORAGE"]
    removed = [h for e in events if e["type"] == "BlockRemoved" and e["medium"] == "STORAGE"
               for h in e["block_hashes"]]
    stored_hashes = [h for e in stored for h in e["block_hashes"]]
    print(f"KV events: {len(stored)} STORAGE stores ({len(stored_hashes)} block hashes), "
          f"{len(removed)} STORAGE removals, {len(gpu_stored)} GPU block hashes")
    assert len(stored) >= 5 * 13, "every stored chunk of the five prompts is announced"
    # The same hashes as the request's blocks (vLLM's own GPU prefix-cache events).
    assert set(stored_hashes) <= gpu_stored
    # Self-describing payloads: each chunk's tokens are a chunk of one of the prompts.
    prompts = [a[n]["prompt_ids"][0] + a[n]["tokens"][0] for n in "UPQRS"]
    chunks = {tuple(p[i:i + CHUNK_TOKENS]) for p in prompts for i in range(0, len(p), CHUNK_TOKENS)}
    assert all(tuple(e["token_ids"]) in chunks for e in stored)
    # Evicted for capacity: U's and most of P's chunks, nothing of S.
    assert len(removed) >= 20 * 2, removed
    assert set(removed) <= set(stored_hashes)
    s_tokens = {tuple(a["S"]["prompt_ids"][0][i:i + CHUNK_TOKENS]) for i in range(0, 832, CHUNK_TOKENS)}
    s_hashes = {h for e in stored if tuple(e["token_ids"]) in s_tokens for h in e["block_hashes"]}
    assert s_hashes and not (s_hashes & set(removed))
