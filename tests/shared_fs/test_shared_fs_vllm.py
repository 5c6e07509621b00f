"""Two vLLM engines, one per node of the GlusterFS fixture (two FUSE clients of
one volume, each in its own network namespace), sharing one store directory.

Two engine starts in all, one after the other (2-core machine):

node A (mount A, KV events published over ZMQ and subscribed to here) computes
five ~900-token prompts U (with a cache salt: a reference only), P, Q, R, S with
a capacity of about three of them, so U and most of P are evicted again;

node B (mount B, its own KV events subscribed to as well) then
  1. serves Q from the store: cached tokens, disk reads, A's tokens;
  2. with its network link down (``ip -n NS link set kvc down``) serves R:
     the chunks are misses, R is recomputed with A's tokens, within a bound;
  3. with the link back up (once the breaker's probe closed it) serves S and
     then Q from the disk again, without a restart;
  4. takes the link down and up twice more, each time as in 2 and 3: disk
     hits resume after every recovery, well inside a minute (the
     gate learnt the reconnect's slow first loads as the disk's speed and
     recomputed from then on; decision 0054);
  5. with its FUSE client killed (every call ENOTCONN) serves U: misses,
     recomputed, no crash.

Each request after a recovery is for the prompt node B touched longest ago:
the two others (28 chunks) went through its 24 staging slots since, so its
leading chunks come from the disk, and vLLM's own prefix cache is reset
before it.

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
CYCLES = 3  # link down and up this many times in a row
# Disk hits after the breaker closed again (the probe's back-off is the
# breaker's, not the gate's), and after the link came back.
HITS_AFTER_CLOSE_S = 30.0
HITS_AFTER_LINK_UP_S = 45.0
GATE_MARGIN = 0.02  # node B loads unless loading looks 50x slower than recomputing


def _texts():
    from pykvcache.testing.tiny_model import synthetic_text

    return {name: synthetic_text(250, seed=700 + i) for i, name in enumerate("UPQRS")}


def _kv(directory, **extra):
    from pykvcache.vllm.config import kv_transfer_config

    return kv_transfer_config(
        [str(directory)], CAPACITY_CHUNKS * SLOT_FOOTPRINT, staging_bytes=24 * SLOT_FOOTPRINT, block_size=CHUNK_TOKENS, **extra
    )


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
    # What node A wrote: segment files (.seg), the default on a network filesystem, or chunk files (.kvc).
    written = [p.name for p in a_dir.rglob("*") if p.is_file()]
    a_layout = (sum(n.endswith(".seg") for n in written), sum(n.endswith(".kvc") for n in written))
    ns_b = gluster.netns["b"]
    link = ["ip", "-n", ns_b, "link", "set", "kvc"]
    reset = {"op": "reset_prefix_cache"}
    phases = [_gen("Q", [texts["Q"]])]
    for c in range(1, CYCLES + 1):
        # Cycle 1 keeps the names the single-partition tests below read.
        name = (
            {"down": "link_down", "part": "R_partitioned", "up": "link_up", "closed": "breaker_closed", "S": "S_link_back", "Q": "c1_Q"}
            if c == 1
            else {k: f"c{c}_{k}" for k in ("down", "part", "up", "closed", "S", "Q")}
        )
        phases += [
            reset,
            {"op": "shell", "name": name["down"], "argv": link + ["down"]},
            # No settling with the link down: the link stays down for the request only.
            _gen(name["part"], [texts["R"]], settle=False),
            {"op": "shell", "name": name["up"], "argv": link + ["up"]},
            # The breaker probes after its back-off (doubling while the link
            # was down): hits resume once a probe succeeds, not at once.
            {"op": "until_breaker_closed", "name": name["closed"], "timeout_s": 90},
            reset,
            _gen(name["S"], [texts["S"]]),
            reset,
            _gen(name["Q"], [texts["Q"]]),
        ]
    phases += [
        {"op": "shell", "name": "kill_client", "argv": ["kill", "-9", str(gluster.client_pids["b"])]},
        {"op": "sleep", "seconds": 1},
        _gen("U_client_dead", [texts["U"]]),
        {"op": "events_take"},
    ]
    # The gate stays on (learning an outage as the device's speed is under
    # test), with a margin that tolerates a device ~50x slower than the
    # recompute: on a busy host the reads of this FUSE mount slow to ~90 ms a
    # chunk while the tiny model's prefill does not, and recomputing is then
    # the gate's right answer. A read timed during the outage (seconds a
    # chunk) is still far below that.
    node_b = {
        "model": tiny_model,
        "llm": {"kv_transfer_config": _kv(b_dir, gate_margin=GATE_MARGIN, self_describing_kv_events=True)},
        # Its own publisher, as each node of a cluster has (what a router subscribes to).
        "kv_events": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{work}/kv-events-b.sock"},
        "phases": phases,
    }
    try:
        try:
            b, _ = run_driver(child("driver.py"), node_b, work, "node-b", timeout=600)
        except subprocess.TimeoutExpired as exc:
            partial = (exc.stdout or b"") + b"\n" + (exc.stderr or b"")
            (work / "node-b.log").write_bytes(partial if isinstance(partial, bytes) else partial.encode())
            tail = partial[-4000:].decode(errors="replace") if isinstance(partial, bytes) else partial[-4000:]
            pytest.fail(f"node B's driver did not finish in 600 s:\n{tail}")
    finally:
        gluster.link("b", up=True)
        gluster.remount("b")
        shutil.rmtree(a_dir, ignore_errors=True)
    for result in (a, b):
        result["by_name"] = {p["name"]: p for p in result["phases"]}
        times = ", ".join(f"{p['name']}={p.get('generate_s', p['seconds'])}s" for p in result["phases"])
        print(f"startup={result['startup_s']}s {times}", file=sys.stderr)
    b["by_name"]["_order"] = b["phases"]  # the phases in order (names repeat: reset_prefix_cache)
    a["by_name"]["_layout"] = a_layout
    return a["by_name"], b["by_name"]


def _metric(phase, name):
    return phase["metrics"].get(f"vllm:pykvcache_{name}", 0)


def test_a_prefix_stored_on_node_a_is_served_from_the_store_on_node_b(nodes):
    a, b = nodes
    q = b["Q"]
    assert a["Q"]["num_cached_tokens"] == [0]
    segments, chunk_files = a["_layout"]
    assert segments >= 1 and chunk_files == 0, "node A did not write segment files (decision 0086)"
    assert q["num_cached_tokens"][0] >= 13 * CHUNK_TOKENS, q["num_cached_tokens"]
    assert _metric(q, "disk_reads") >= 13
    assert _metric(q, "corrupt_chunks") == 0
    assert q["tokens"] == a["Q"]["tokens"], "node B's tokens differ from vLLM's own computation"


def test_node_b_partitioned_from_the_store_recomputes_within_the_bound_and_recovers(nodes):
    a, b = nodes
    r = b["R_partitioned"]
    print(f"request on the partitioned node: {r['generate_s']} s (bound {PARTITION_BOUND_S} s); Q from disk took {b['Q']['generate_s']} s")
    assert r["tokens"] == a["R"]["tokens"]
    assert r["num_cached_tokens"] == [0], "nothing could be loaded over a dead link"
    assert r["generate_s"] <= PARTITION_BOUND_S, f"the dead mount held the request {r['generate_s']} s"
    closed = b["breaker_closed"]
    print(f"breaker closed {closed['seconds']} s after the link came back ({closed['attempts']} tiny requests)")
    assert closed["closed"], "no probe closed the breaker within 90 s of the link coming back"
    s = b["S_link_back"]
    assert s["tokens"] == a["S"]["tokens"]
    assert s["num_cached_tokens"][0] >= 13 * CHUNK_TOKENS, "disk hits did not resume after the link came back"


def _cycles(b):
    """Per down/up cycle: the phases from the link coming up to the last
    request after it, with each request's disk reads and cached tokens."""
    order = b["_order"]
    out = []
    reads_before = latency_before = 0
    for c in range(1, CYCLES + 1):
        up, closed, names = (
            ("link_up", "breaker_closed", ["S_link_back", "c1_Q"]) if c == 1 else (f"c{c}_up", f"c{c}_closed", [f"c{c}_S", f"c{c}_Q"])
        )
        start = next(i for i, p in enumerate(order) if p["name"] == up)
        elapsed = 0.0  # since the link came up (the end of that phase)
        since_closed = None
        requests = []
        for p in order[start + 1 :]:
            elapsed += p["seconds"]
            if since_closed is not None:
                since_closed += p["seconds"]
            if p["name"] == closed:
                since_closed = 0.0
            if "metrics" in p:
                reads = _metric(p, "disk_reads")
                latency = _metric(p, "disk_read_latency_seconds")  # the histogram's sum
                if p["name"] in names:
                    n = reads - reads_before
                    requests.append(
                        {
                            "name": p["name"],
                            "after_up_s": round(elapsed, 1),
                            "after_closed_s": round(since_closed, 1),
                            "disk_reads": n,
                            "cached": p["num_cached_tokens"][0],
                            "read_ms": round((latency - latency_before) / n * 1e3, 1) if n else None,
                            "explore": _metric(p, "gate_decisions_explore"),
                            "bandwidth_mbps": _metric(p, "gate_disk_bandwidth_mbps"),
                        }
                    )
                reads_before, latency_before = reads, latency
            if p["name"] == names[-1]:
                break
        out.append({"cycle": c, "closed": b[closed]["closed"], "closed_after_s": b[closed]["seconds"], "requests": requests})
    return out


def test_disk_hits_resume_after_every_one_of_several_partitions_in_a_row(nodes):
    a, b = nodes
    q = b["Q"]
    print(
        f"before the partitions: Q {_metric(q, 'disk_reads')} disk reads, "
        f"{_metric(q, 'disk_read_latency_seconds') / max(1, _metric(q, 'disk_reads')) * 1e3:.1f} ms each, "
        f"gate {_metric(q, 'gate_disk_bandwidth_mbps'):.0f} MB/s"
    )
    cycles = _cycles(b)
    for c in cycles:
        print(
            f"cycle {c['cycle']}: breaker closed {c['closed_after_s']} s after the link came up; "
            + "; ".join(
                f"{r['name']}: {r['disk_reads']} disk reads ({r['read_ms']} ms each), "
                f"{r['cached']} cached tokens, "
                f"ended {r['after_up_s']} s after link up ({r['after_closed_s']} s after close), "
                f"gate {r['bandwidth_mbps']:.0f} MB/s, {r['explore']:.0f} explored in all"
                for r in c["requests"]
            )
        )
    for c in range(2, CYCLES + 1):
        part = b[f"c{c}_part"]
        assert part["tokens"] == a["R"]["tokens"]
        assert part["generate_s"] <= PARTITION_BOUND_S, f"cycle {c}: the dead mount held the request"
    served = {"S_link_back": "S", "c1_Q": "Q"} | {f"c{c}_{n}": n for c in range(2, CYCLES + 1) for n in "SQ"}
    for name, prompt in served.items():
        assert b[name]["tokens"] == a[prompt]["tokens"], f"{name}: node B's tokens differ from vLLM's own"
    for c in cycles:
        assert c["closed"], f"cycle {c['cycle']}: no probe closed the breaker within 90 s of the link coming back"
        hits = [r for r in c["requests"] if r["disk_reads"] > 0 and r["cached"] >= CHUNK_TOKENS]
        assert hits, f"cycle {c['cycle']}: no disk hit after the link came back: {c['requests']}"
        first = hits[0]
        assert first["after_closed_s"] <= HITS_AFTER_CLOSE_S, (c["cycle"], first)
        assert first["after_up_s"] <= HITS_AFTER_LINK_UP_S, (c["cycle"], first)


def test_node_b_with_its_filesystem_client_killed_misses_and_keeps_serving(nodes):
    a, b = nodes
    u = b["U_client_dead"]
    assert u["tokens"] == a["U"]["tokens"]
    assert u["num_cached_tokens"] == [0]
    assert _metric(u, "corrupt_chunks") == 0


def test_node_a_publishes_stores_and_evictions_with_the_requests_block_hashes(nodes):
    a, _ = nodes
    events = a["events_take"]["events"]
    gpu_stored = {h for e in events if e["type"] == "BlockStored" and e["medium"] == "GPU" for h in e["block_hashes"]}
    stored = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "STORAGE"]
    removed = [h for e in events if e["type"] == "BlockRemoved" and e["medium"] == "STORAGE" for h in e["block_hashes"]]
    stored_hashes = [h for e in stored for h in e["block_hashes"]]
    print(
        f"KV events: {len(stored)} STORAGE stores ({len(stored_hashes)} block hashes), "
        f"{len(removed)} STORAGE removals, {len(gpu_stored)} GPU block hashes"
    )
    assert len(stored) >= 5 * 13, "every stored chunk of the five prompts is announced"
    # The same hashes as the request's blocks (vLLM's own GPU prefix-cache events).
    assert set(stored_hashes) <= gpu_stored
    # Self-describing payloads: each chunk's tokens are a chunk of one of the prompts.
    prompts = [a[n]["prompt_ids"][0] + a[n]["tokens"][0] for n in "UPQRS"]
    chunks = {tuple(p[i : i + CHUNK_TOKENS]) for p in prompts for i in range(0, len(p), CHUNK_TOKENS)}
    assert all(tuple(e["token_ids"]) in chunks for e in stored)
    # Evicted for capacity: U's and most of P's chunks, nothing of S.
    assert len(removed) >= 20 * 2, removed
    assert set(removed) <= set(stored_hashes)
    s_tokens = {tuple(a["S"]["prompt_ids"][0][i : i + CHUNK_TOKENS]) for i in range(0, 832, CHUNK_TOKENS)}
    s_hashes = {h for e in stored if tuple(e["token_ids"]) in s_tokens for h in e["block_hashes"]}
    assert s_hashes and not (s_hashes & set(removed))


def _chunks(ids: list[int], size: int) -> set[tuple[int, ...]]:
    return {tuple(ids[i : i + size]) for i in range(0, len(ids) - size + 1, size)}


def test_two_nodes_announce_a_shared_store_block_once_and_never_as_a_device_block_they_lack(nodes):
    """What a router reading both nodes' events (vllm-router's ``kv_aware``) learns of the
    shared store: a chunk is announced as ``STORAGE`` once, by the node that wrote it. Node B
    indexes node A's chunks on the shared store and reads some of them; announcing them
    would tell the router that B holds them too (two announcements of one shared-store
    block). Compared by tokens: vLLM's block hashes are seeded per process."""
    a, b = nodes
    a_events, b_events = a["events_take"]["events"], b["events_take"]["events"]

    def announced(events: list[dict], medium: str, size: int) -> set[tuple[int, ...]]:
        stored = [e for e in events if e["type"] == "BlockStored" and e["medium"] == medium]
        return {c for e in stored for c in _chunks(e["token_ids"], size)}

    block = 32  # vLLM's block size here (its GPU events' unit); a chunk is two blocks
    a_storage = announced(a_events, "STORAGE", CHUNK_TOKENS)
    b_storage = announced(b_events, "STORAGE", CHUNK_TOKENS)
    b_device = announced(b_events, "GPU", block)
    q_ids, p_ids = a["Q"]["prompt_ids"][0], a["P"]["prompt_ids"][0]
    q_chunks = _chunks(q_ids, CHUNK_TOKENS)
    assert len(q_chunks & a_storage) >= 13, "node A announces Q's chunks it wrote"
    print(f"node B's events: {len(b_events)} ({len(b_storage)} STORAGE chunks, {len(b_device)} GPU blocks)")
    # B read Q's chunks from the store (test above) and announces them once in its device,
    # as vLLM's own GPU blocks; never as STORAGE: A wrote them, B wrote none of them.
    assert _chunks(q_ids[: 13 * CHUNK_TOKENS], block) <= b_device
    assert not (b_storage & a_storage), "node B announced a chunk node A wrote"
    # P: on the store (what capacity left of it), never asked of B: B announces none of it.
    p_blocks = _chunks(p_ids, block)
    assert not (p_blocks & b_device) and not (_chunks(p_ids, CHUNK_TOKENS) & b_storage)
    assert _chunks(p_ids, CHUNK_TOKENS) & a_storage, "node A announced P's chunks"
