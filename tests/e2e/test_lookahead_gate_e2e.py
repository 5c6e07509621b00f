"""Lookahead preloading and the break-even gate inside a real vLLM (CPU build).

One engine process (``driver_lookahead.py``) with ``PyKvCacheConnector``,
``max_num_seqs=1`` and a gate profile written here whose break-even is about
450 tokens, 490 at the slow device's speed (the gate learns the device from
its reads: the profile prices the copy high, so that the decisions do not
hang on the speed it learns). The chunk files live on a real slow device when the kernel
offers one (``slow_device.py``: a loop device whose reads the blkio throttle
limits to ``SLOW_READ_BPS``; the driver runs in the throttled group), else on
the temporary directory (then only the timing test is skipped):

* first     every prompt once, computed from scratch: the reference tokens;
            the chunks go to disk;
* pairs     ``PAIRS`` times, in alternating order, a batch with lookahead and
            one without (``pykvcache_lookahead: false`` on its queued
            request). A batch is a head request ``H`` (a prompt shorter than
            one chunk, so nothing to look up, and a long decode) and a queued
            request ``Q`` whose ~900-token prefix (14 chunks) is on disk only
            (device cache and staging emptied before each batch, files kept).
            With ``max_num_seqs=1`` vLLM does not probe ``Q`` while ``H``
            decodes: without lookahead ``Q``'s reads start when ``H``
            finishes; with it they start at ``Q``'s arrival and finish while
            ``H`` decodes;
* short_i   short prompts, one at a time (2-3 chunks on disk, below the break-even): the gate
            recomputes them without reading the disk.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from child_paths import child
from engine_driver import driver_env
from vllm_marks import VLLM_ENGINE

sys.path.insert(0, str(Path(__file__).parent))
from slow_device import ThrottledDevice  # noqa: E402

pytestmark = VLLM_ENGINE

DRIVER = child("driver_lookahead.py")
CHUNK_TOKENS = 64
CHUNK_BYTES = 2 * 2 * 2 * 64 * 4 * CHUNK_TOKENS
SLOT_FOOTPRINT = CHUNK_BYTES + 4096
STAGING_SLOTS = 96
Q_CHUNKS = 14  # chunks of every queued prompt's prefix (at least)
PAIRS = 3  # batches with and without lookahead
HEAD_DECODE = 200  # tokens the head request generates while Q waits (~1 s here)
#: Reads of the slow device: a 14-chunk prefix takes ~0.45 s.
SLOW_READ_BPS = 4 << 20
# Profile coefficients: recompute c*n^2, load per token = h2d copy (+ disk).
# The copy (5 ms per token) outweighs the disk's share even at SLOW_READ_BPS
# (0.5 ms per token), so the break-even is ~450 tokens whatever the gate learns
# of the device: queued prompts (~900 tokens) load, short ones (2-3 chunks) do not.
PREFILL_C = 1.11e-5
H2D_BYTES_PER_S = 2048 / 5e-3
FIXED_S = 1e-4
DISK_BYTES_PER_S = 1e9


def _texts():
    from pykvcache.testing.tiny_model import synthetic_text

    queued = [synthetic_text(270, seed=5000 + i) for i in range(2 * PAIRS + 1)]  # the last: warm-up
    heads = [synthetic_text(10, seed=8000 + i) for i in range(2 * PAIRS)]
    shorts = [synthetic_text(40 + 5 * i, seed=6000 + i) for i in range(3)]
    return queued, heads, shorts


def _profile(model: str, path: Path) -> float:
    from pykvcache.gate import GateProfile, hardware_id
    from pykvcache.gate.cost_model import CostModel, LoadCost, PrefillCurve

    model_cost = CostModel(PrefillCurve(0.0, 0.0, PREFILL_C), LoadCost(FIXED_S, DISK_BYTES_PER_S, H2D_BYTES_PER_S), 2048.0)
    break_even = model_cost.break_even_tokens()
    GateProfile(
        model=model,
        dtype="float32",
        block_size=32,
        chunk_tokens=CHUNK_TOKENS,
        kv_bytes_per_token=2048.0,
        world_size=1,
        hardware=hardware_id(),
        storage={"dir": str(path.parent), "device": None},
        prefill={"a": 0.0, "b": 0.0, "c": PREFILL_C},
        load={"fixed_s": FIXED_S, "disk_bytes_per_s": DISK_BYTES_PER_S, "h2d_bytes_per_s": H2D_BYTES_PER_S},
        break_even_tokens=break_even,
        created="test",
        pykvcache_version="test",
        notes=["coefficients chosen by the test, not measured"],
    ).save(path)
    return break_even


@pytest.fixture(scope="module")
def slow_device(tmp_path_factory):
    """The throttled device, or None and the reason the kernel offers none."""
    reason = ThrottledDevice.unavailable()
    if reason is not None:
        yield None, reason
        return
    dev = ThrottledDevice(tmp_path_factory.mktemp("pykvcache-slowdev"), SLOW_READ_BPS, size_mib=512)
    try:
        dev.setup()
        rate = dev.measured_read_rate()
        # The facility is there: a device that is not slow is a failure, not a skip.
        assert rate < 2 * SLOW_READ_BPS, f"blkio throttle not effective: {rate / 1e6:.0f} MB/s"
        yield dev, None
    finally:
        dev.cleanup()


def _pair_order(i: int) -> tuple[bool, bool]:
    return (True, False) if i % 2 == 0 else (False, True)


@pytest.fixture(scope="module")
def scenario_result(tmp_path_factory, tiny_model, slow_device):
    from pykvcache.vllm.config import kv_transfer_config

    dev, no_device = slow_device
    model = tiny_model
    work = tmp_path_factory.mktemp("pykvcache-lookahead")
    break_even = _profile(model, work / "profile.json")
    queued, heads, shorts = _texts()
    off = {"pykvcache_lookahead": False}
    phases = [{"op": "generate", "name": "first", "prompts": queued + shorts}]
    reset = {"op": "reset_prefix_cache", "reset_connector": True}  # staging emptied, files kept
    # The process's first loads pay one-off costs (copy paths, allocations):
    # not inside a measured batch.
    phases += [reset, {"op": "generate", "name": "warm_up", "prompts": [queued[-1]], "max_tokens": 2}]
    for i in range(PAIRS):
        for j, lookahead in enumerate(_pair_order(i)):
            k = 2 * i + j
            phases += [
                reset,
                {
                    "op": "generate",
                    "name": f"{'on' if lookahead else 'off'}_{i}",
                    "prompts": [heads[k], queued[k]],
                    "max_tokens_each": [HEAD_DECODE, 2],
                    "kv_transfer_params_each": [None, None if lookahead else off],
                },
            ]
    # One short prompt per generate(): none waits behind another. Co-queued at arrival, the
    # preloader weighs a recompute by the requests waiting behind it (decision 0079) and may
    # preload what the lookup's gate then recomputes: a disagreement since
    # fixed (decision 0070), hit in a clean-clone CI run when the engine received all three before
    # its first step; this test's subject is the gate below the break-even.
    phases += [reset] + [{"op": "generate", "name": f"short_{i}", "prompts": [s]} for i, s in enumerate(shorts)]
    storage = (dev.mount if dev is not None else work) / "store"
    scenario = {
        "model": model,
        "llm": {
            "max_num_seqs": 1,
            "kv_transfer_config": kv_transfer_config(
                [str(storage)],
                256 << 20,
                lookahead=True,
                staging_bytes=STAGING_SLOTS * SLOT_FOOTPRINT,
                block_size=CHUNK_TOKENS,
                gate_profile=str(work / "profile.json"),
                wipe_on_reset=False,
            ),
        },
        "phases": phases,
    }
    path = work / "scenario.json"
    path.write_text(json.dumps(scenario))
    # Multi-process: the subject is what a request meets on arrival at an engine that runs
    # beside its client. In-process, generate() queues every prompt before the first step,
    # so the short prompts all wait behind each other; the preloader, which weighs a
    # recompute by the requests waiting behind it (decision 0079), then preloaded the chunks
    # of 3 prompts the lookup's gate recomputes (3 wasted preload reads, seen in this run).
    env = driver_env(multiprocess=True)
    proc = subprocess.run(
        [sys.executable, str(DRIVER), str(path)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        preexec_fn=dev.preexec if dev is not None else None,
    )
    (work / "run.log").write_text(proc.stdout + "\n" + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        pytest.fail(f"lookahead driver failed (rc={proc.returncode}):\n{tail}")
    result = json.loads(lines[-1][len("RESULT ") :])
    result["by_name"] = {p["name"]: p for p in result["phases"]}
    result["break_even"] = break_even
    result["log"] = proc.stdout + proc.stderr
    result["slow_device"] = dev is not None
    result["no_device"] = no_device
    times = ", ".join(f"{p['name']}={p['seconds']}s" for p in result["phases"] if "name" in p)
    print(f"[lookahead] startup={result['startup_s']}s {times}", file=sys.stderr)
    return result


def _delta(result, name: str, metric: str, last: str | None = None) -> float:
    """``metric``'s growth over phase ``name`` (through phase ``last`` when given)."""
    phases = result["phases"]
    i = next(j for j, p in enumerate(phases) if p["name"] == name)
    k = next(j for j, p in enumerate(phases) if p["name"] == (last or name))
    before = next((p for p in reversed(phases[:i]) if "metrics" in p), None)
    full = "vllm:pykvcache_" + metric
    return phases[k]["metrics"].get(full, 0) - (before["metrics"].get(full, 0) if before else 0)


def _batches(result):
    """Per batch: Q's arrival -> first token, Q's first token after H's last
    token (its own wait once the running slot is free), H's decode time."""
    out = {}
    for i in range(PAIRS):
        for mode in ("on", "off"):
            p = result["by_name"][f"{mode}_{i}"]
            h, q = p["ts"]
            out[(mode, i)] = {
                "ttft_s": q["first_token"] - q["queued"],
                "after_head_s": q["first_token"] - h["last_token"],
                "head_s": h["last_token"] - h["queued"],
            }
    return out


def test_first_pass_computes_everything(scenario_result):
    first = scenario_result["by_name"]["first"]
    assert first["num_cached_tokens"] == [0] * len(first["tokens"])
    assert min(first["prompt_lens"][: 2 * PAIRS + 1]) > Q_CHUNKS * CHUNK_TOKENS
    assert "Using a conservative default" not in scenario_result["log"], "the test profile was rejected"
    if scenario_result["no_device"]:
        print(f"\n[lookahead] no slow device: {scenario_result['no_device']}", file=sys.stderr)


def test_queued_request_is_staged_before_it_is_scheduled(scenario_result):
    r = scenario_result
    first = r["by_name"]["first"]
    ready = {}
    for i in range(PAIRS):
        for mode in ("on", "off"):
            name = f"{mode}_{i}"
            phase = r["by_name"][name]
            k = 2 * i + _pair_order(i).index(mode == "on")
            assert phase["prompt_lens"][0] < CHUNK_TOKENS, "the head must have nothing to look up"
            assert phase["tokens"][1] == first["tokens"][k][:2], name  # loaded KV: same tokens
            assert phase["num_cached_tokens"][1] >= Q_CHUNKS * CHUNK_TOKENS, name
            assert _delta(r, name, "disk_reads") >= Q_CHUNKS, name  # from disk, not staging
            if mode == "on":
                # Reads started at Q's arrival (while H decoded), every
                # preloaded byte was then loaded by Q, nothing wasted.
                assert _delta(r, name, "lookahead_preload_reads") >= Q_CHUNKS, name
                assert _delta(r, name, "lookahead_wasted_bytes") == 0, name
                assert _delta(r, name, "lookahead_used_bytes") == _delta(r, name, "lookahead_preload_bytes")
                ready[name] = (_delta(r, name, "lookup_ready_requests"), _delta(r, name, "lookup_waited_requests"))
            else:
                # No preload: Q's reads started at its first probe, after H.
                assert _delta(r, name, "lookahead_preload_reads") == 0, name
                assert _delta(r, name, "lookup_waited_requests") == 1, name
    print(f"\n[lookahead] on-batches (ready, waited): {ready}", file=sys.stderr)
    # Staged before it was scheduled: Q's first lookup found its whole gated
    # prefix in staging. H decodes ~2x longer than the throttled read on an
    # idle machine, but other I/O on the disk behind the loop device can
    # stretch a read by seconds (seen: 3.3 s for a 0.44 s read while another
    # test suite filled the disk), so a read may still be in flight when H
    # ends: a majority of the batches, not all, is asserted.
    assert all(sum(v) == 1 for v in ready.values()), ready
    assert sum(v[0] for v in ready.values()) > PAIRS // 2, ready


def test_lookahead_lowers_arrival_to_first_token(scenario_result):
    r = scenario_result
    if not r["slow_device"]:
        pytest.skip(
            f"no slow device ({r['no_device']}): on this disk a 14-chunk read takes "
            "~1 ms, far below the run-to-run noise of a shared machine"
        )
    b = _batches(r)
    expected_read = Q_CHUNKS * CHUNK_BYTES / SLOW_READ_BPS
    ttft_gain = [b[("off", i)]["ttft_s"] - b[("on", i)]["ttft_s"] for i in range(PAIRS)]
    wait_gain = [b[("off", i)]["after_head_s"] - b[("on", i)]["after_head_s"] for i in range(PAIRS)]
    head_noise = [b[("off", i)]["head_s"] - b[("on", i)]["head_s"] for i in range(PAIRS)]
    report = {f"{m}_{i}": {k: round(v * 1e3, 1) for k, v in b[(m, i)].items()} for i in range(PAIRS) for m in ("on", "off")}
    print(
        "\nlookahead timing (ms):",
        json.dumps(report),
        f"\npaired off - on (ms): arrival->first token {[round(g * 1e3) for g in ttft_gain]}, "
        f"after the head's last token {[round(g * 1e3) for g in wait_gain]}, "
        f"head's own time {[round(g * 1e3) for g in head_noise]}; "
        f"expected read {expected_read * 1e3:.0f} ms",
        file=sys.stderr,
    )
    # Once the running slot is free, Q waits for its reads only without
    # lookahead: the paired difference is about one throttled read, set by
    # the device, not by the CPU (many times this machine's step noise).
    assert statistics.median(wait_gain) > 0.5 * expected_read
    # Arrival -> first token = H's time + that wait. H is the same work in
    # both batches of a pair, but on a shared 2-core machine its time varies
    # by up to ~1 s between batches (CPU contention), which says nothing
    # about lookahead. Asserted only when this run's spread of H is below
    # the expected gain; otherwise reported.
    spread = statistics.median(abs(x) for x in head_noise)
    if spread > 0.5 * expected_read:
        pytest.skip(
            f"head's time varied by {spread * 1e3:.0f} ms (median |paired difference|) in this run, "
            f"more than half the expected gain ({expected_read * 1e3:.0f} ms): arrival -> first token "
            f"gains {[round(g * 1e3) for g in ttft_gain]} ms reported, not asserted"
        )
    assert statistics.median(ttft_gain) > 0.25 * expected_read


def test_gate_recomputes_below_break_even_and_loads_above(scenario_result):
    r = scenario_result
    assert 300 < r["break_even"] < 600
    shorts = [p for p in r["phases"] if p["name"].startswith("short_")]
    short = {k: [x for p in shorts for x in p[k]] for k in ("prompt_lens", "tokens", "num_cached_tokens")}
    first = r["by_name"]["first"]
    assert len(shorts) == 3
    assert max(short["prompt_lens"]) < r["break_even"]
    assert all(n >= 2 * CHUNK_TOKENS for n in short["prompt_lens"])  # chunks exist on disk
    assert short["tokens"] == first["tokens"][2 * PAIRS + 1 :]
    assert short["num_cached_tokens"] == [0] * len(short["tokens"])
    assert _delta(r, "short_0", "disk_reads", "short_2") == 0
    assert _delta(r, "short_0", "gate_decisions_recompute", "short_2") >= len(short["tokens"])
    assert _delta(r, "short_0", "lookahead_preload_reads", "short_2") == 0
    # Above the break-even: loaded (the queued prompts are ~900 tokens).
    assert all(_delta(r, f"on_{i}", "gate_decisions_load") >= 1 for i in range(PAIRS))
    be = shorts[-1]["metrics"].get("vllm:pykvcache_gate_break_even_tokens")
    assert be is not None and 300 < be < 700, be


def test_a_load_that_times_out_on_a_slow_disk_is_recomputed_in_a_small_kv_cache(tmp_path, tiny_model, slow_device):
    """Found by the serving benchmark at 25 MB/s: a load whose
    reads outlived the worker's wait (io_deadline_s) failed, vLLM re-queued its
    request, whose next lookup found the chunks read meanwhile and answered
    HIT. (Since decision 0065 a load fails only when its reads stop making
    progress: here the device is slowed until one chunk's read outlasts the
    I/O deadline, and the engine abandons it.) vLLM 0.32 keeps a request whose asynchronous load failed among its
    in-flight prefills, so a second asynchronous admission must fit its
    blocks twice: in a KV cache under twice the prompt it never did, and the
    server served nothing more (two benchmark servers hung until killed). The
    request's lookups now miss after a failed load: it is recomputed at once."""
    from pykvcache.testing.tiny_model import synthetic_text
    from pykvcache.vllm.config import kv_transfer_config

    dev, no_device = slow_device
    if dev is None:
        pytest.skip(no_device)
    prompt = f"{synthetic_text(250, seed=100)} {synthetic_text(12, seed=201)}"  # ~900 tokens, 14 chunks
    fillers = [synthetic_text(250, seed=300 + i) for i in range(3)]
    scenario = {
        "model": tiny_model,
        # 44 blocks of 32 tokens: the prompt (29 blocks) fits once, not twice.
        "max_model_len": 1024,
        "kv_cache_memory_bytes": 44 * 32 * 2 * 2 * 2 * 64 * 4,
        "llm": {
            "kv_transfer_config": kv_transfer_config(
                [str(dev.mount / "store-failed-load")],
                256 << 20,
                lookahead=True,
                lookahead_bytes=0,
                lookahead_requests=0,
                staging_bytes=24 * SLOT_FOOTPRINT,
                block_size=CHUNK_TOKENS,
                # At 256 KiB/s one 128 KiB chunk takes ~0.5 s: no read ends
                # within the deadline, the engine abandons them, the load fails.
                io_deadline_s=0.15,
                gate=False,
            )
        },
        "phases": [
            {"op": "generate", "name": "first", "prompts": [prompt]},
            {"op": "reset_prefix_cache"},
            {"op": "generate", "name": "fillers", "prompts": fillers},  # its chunks: on disk only
            {"op": "reset_prefix_cache"},
            {"op": "generate", "name": "reload", "prompts": [prompt]},
        ],
    }
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(scenario))
    with dev.read_rate(256 << 10):
        proc = subprocess.run(
            [sys.executable, str(child("driver.py")), str(path)],
            capture_output=True,
            text=True,
            timeout=300,
            env=driver_env(multiprocess=False),
            preexec_fn=dev.preexec,
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
    by = {p["name"]: p for p in json.loads(lines[-1][len("RESULT ") :])["phases"] if "name" in p}
    reload = by["reload"]
    metric = reload["metrics"].get
    print(f"[failed load] reload {reload['seconds']} s, failed loads {metric('vllm:pykvcache_failed_loads', 0)}", file=sys.stderr)
    assert metric("vllm:pykvcache_failed_loads", 0) >= 1, "the load was expected to outlive the worker's wait"
    assert reload["tokens"] == by["first"]["tokens"], "recomputed, identical greedy tokens"
