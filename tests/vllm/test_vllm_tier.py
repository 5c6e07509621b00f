"""pykvcache as a secondary tier inside vLLM's own tiering framework, driven
the way the scheduler drives it: vLLM's ``TieringOffloadingSpec`` builds its
``TieringOffloadingManager`` with the CPU primary tier (a real shared region)
and loads ``PykvcacheTier`` by module path from ``secondary_tiers``; the test
plays the scheduler (lookup, prepare_store/complete_store, on_schedule_end,
prepare_load) and the worker (bytes into and out of the CPU tier's chunks).
No engine process, so it runs on the 0.32 CPU build and the 0.33 CUDA build.
"""

from __future__ import annotations

import hashlib
import importlib.util
import time

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

TIER = {"type": "PykvcacheTier", "module_path": "pykvcache.vllm.tier"}
BYTES_PER_BLOCK = 16384  # 2 blocks per chunk: 32 KiB chunks
CHUNK_TOKENS = 64  # 2 blocks of 32 tokens


def _spec(tmp_path, engine_id="tier-test", num_chunks=16, **tier_keys):
    from offloading_configs import tiny_offloading_config
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    tier = {**TIER, "storage_dirs": [str(tmp_path / "kv")], "capacity_bytes": "64MiB", "fingerprint_weights": False, **tier_keys}
    config = tiny_offloading_config({}, engine_id=engine_id, bytes_per_block=BYTES_PER_BLOCK)
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "blocks_per_chunk": 2,
        "cpu_bytes_to_use": num_chunks * 2 * BYTES_PER_BLOCK,
        "secondary_tiers": [tier],
    }
    import dataclasses

    return TieringOffloadingSpec(dataclasses.replace(config, extra_config=extra))


def _keys(tag: str, n: int) -> list[bytes]:
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(hashlib.sha256(f"{tag}{i}".encode()).digest(), 0) for i in range(n)]


def _payload(key: bytes, size: int) -> np.ndarray:
    return np.frombuffer(hashlib.shake_256(key).digest(size), dtype=np.uint8)


class Scheduler:
    """What vLLM's OffloadingConnectorScheduler does with a manager, step by step."""

    def __init__(self, spec):
        self.manager = spec.get_manager()
        self.tier = self.manager.secondary_tiers[0]
        self.primary = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        self.n = 0

    def ctx(self, keys=()):
        from vllm.v1.kv_offload.base import ReqContext

        self.n += 1
        ctx = ReqContext(req_id=f"r{self.n}")
        # As the connector's update_offload_keys records them before lookups:
        # each chunk key with its end token (64-token chunks).
        for i, key in enumerate(keys):
            ctx._offload_key_positions[key] = (i + 1) * CHUNK_TOKENS
        self.manager.on_new_request(ctx)
        return ctx

    def step(self, ctx_ids=()):
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=list(ctx_ids), preempted_req_ids=[]))

    def store(self, keys):
        ctx = self.ctx(keys)
        out = self.manager.prepare_store(keys, ctx)
        assert list(out.keys_to_store) == list(keys)
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
            self.primary[chunk] = _payload(key, self.primary.shape[1])  # the GPU -> CPU copy
        self.manager.complete_store(out.keys_to_store, ctx)
        self.settle()
        self.manager.on_request_finished(ctx)
        return ctx

    def reset(self):
        """The connector's reset_cache: vLLM 0.33 holds promotions back until
        the workers confirm the reset (on_reset_flushed); 0.32 has no such call."""
        self.manager.reset_cache()
        if hasattr(self.manager, "on_reset_flushed"):
            self.manager.on_reset_flushed()

    def close(self):
        self.primary = None  # the CPU tier's region cannot unmap while viewed
        self.manager.shutdown()

    def settle(self, timeout=20.0):
        deadline = time.monotonic() + timeout
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "tier jobs never finished"
            self.step()
            time.sleep(0.002)

    def load(self, keys, timeout=20.0):
        """Looks the prefix up until it is HIT (or ends), then loads it;
        returns (hit keys, their bytes in the CPU tier)."""
        from vllm.v1.kv_offload.base import LookupResult

        ctx = self.ctx(keys)
        deadline = time.monotonic() + timeout
        while True:
            results = []
            for key in keys:
                r = self.manager.lookup(key, ctx)
                results.append(r)
                if r is not LookupResult.HIT:
                    break
            if all(r is LookupResult.HIT for r in results) or results[-1] is LookupResult.MISS:
                break
            assert time.monotonic() < deadline, f"lookups never resolved: {results}"
            self.step()
            time.sleep(0.002)
        hits = [k for k, r in zip(keys, results) if r is LookupResult.HIT]
        data = []
        if hits:
            spec = self.manager.prepare_load(hits, ctx)
            data = [self.primary[c].copy() for c in spec.chunk_ids]
            self.manager.complete_load(hits, ctx)
        self.manager.on_request_finished(ctx)
        self.step([ctx.req_id])
        return hits, data


def test_tier_stores_and_promotes_through_vllms_tiering_manager(tmp_path):
    from pykvcache.vllm.tier import PykvcacheTier

    spec = _spec(tmp_path)
    s = Scheduler(spec)
    assert isinstance(s.tier, PykvcacheTier)
    keys = _keys("a", 6)
    s.store(keys)
    assert len(s.tier.store) == 6  # cascaded to disk
    s.reset()  # empties the CPU tier only
    hits, data = s.load(keys)
    assert hits == keys
    for key, got in zip(keys, data):
        assert np.array_equal(got, _payload(key, s.primary.shape[1]))
    stats = s.tier.metrics.snapshot() if hasattr(s.tier.metrics, "snapshot") else s.tier.metrics.totals
    assert stats["disk_reads"] == 6 and stats["disk_writes"] == 6
    s.close()


def test_tier_chunks_survive_a_restart(tmp_path):
    keys = _keys("restart", 8)
    first = Scheduler(_spec(tmp_path, engine_id="one"))
    first.store(keys)
    first.close()
    second = Scheduler(_spec(tmp_path, engine_id="two"))
    hits, data = second.load(keys)
    assert hits == keys
    assert all(np.array_equal(d, _payload(k, second.primary.shape[1])) for k, d in zip(keys, data))
    second.close()


def test_a_corrupt_chunk_fails_only_its_key_and_ends_the_prefix_there(tmp_path):
    """The checksum catches a flipped byte: the promotion keeps the chunks
    before it, the framework turns the bad one into a miss, no wrong bytes."""
    keys = _keys("corrupt", 8)
    first = Scheduler(_spec(tmp_path, engine_id="one"))
    first.store(keys)
    first.close()
    files = sorted((tmp_path / "kv").rglob("*.kvc"))
    assert len(files) == 8
    second = Scheduler(_spec(tmp_path, engine_id="two"))
    raw = bytearray(files[0].read_bytes())
    raw[-1] ^= 0xFF  # a payload byte: only the checksum can tell
    files[0].write_bytes(bytes(raw))
    hits, data = second.load(keys)
    assert hits == keys[: len(hits)] and len(hits) < 8
    for key, got in zip(hits, data):
        assert np.array_equal(got, _payload(key, second.primary.shape[1]))
    assert second.tier.metrics.totals["corrupt_chunks"] == 1
    # Removed by the engine when it found it, and by nothing else.
    assert second.tier.store.stats()["corrupt_chunks"] == 1
    assert sorted((tmp_path / "kv").rglob("*.kvc")) == files[1:]
    assert len(second.tier.store) == 7
    second.close()


def _chunk_files(root) -> dict:
    return {p: p.read_bytes() for p in sorted(root.rglob("*.kvc"))}


def test_a_verify_header_writers_chunks_survive_a_full_verifying_tier(tmp_path):
    """The tier evicted (deleted) every chunk a promotion could not read, also the
    sound chunks of a verify="header" writer sharing the directory, which a verify="full"
    engine does not serve. The engine keeps them now; the tier does not read them again soon,
    and the writer still serves them."""
    keys = _keys("header", 4)
    writer = Scheduler(_spec(tmp_path, engine_id="one", verify="header", gate=False))
    writer.store(keys)
    writer.close()
    before = _chunk_files(tmp_path / "kv")
    assert len(before) == 4
    reader = Scheduler(_spec(tmp_path, engine_id="two", gate=False))
    hits, _ = reader.load(keys)
    assert hits == []
    assert _chunk_files(tmp_path / "kv") == before, "the writer's chunks are left as they are"
    kept = reader.tier.metrics.totals["kept_chunks"]
    assert kept >= 1 and reader.tier.store.stats()["corrupt_chunks"] == 0
    assert reader.load(keys)[0] == []
    assert reader.tier.metrics.totals["kept_chunks"] == kept, "not read again at once"
    reader.close()
    assert _chunk_files(tmp_path / "kv") == before
    writer = Scheduler(_spec(tmp_path, engine_id="three", verify="header", gate=False))
    hits, data = writer.load(keys)
    assert hits == keys
    assert all(np.array_equal(d, _payload(k, writer.primary.shape[1])) for k, d in zip(keys, data))
    writer.close()


def test_a_stalled_directory_under_the_tier_deletes_no_chunk(tmp_path):
    """A promotion timed out on a stalled mount before the breaker opened, the tier
    evicted the chunk, and the unlink, queued behind the stalled work, deleted the good chunk
    once the mount answered again. A miss of kind ``unavailable`` now only keeps the key from
    being read again for a moment."""
    from stall_fs import StallFs, skip_reason

    if skip_reason() is not None:
        pytest.skip(skip_reason())
    keys = _keys("stall", 4)
    with StallFs(tmp_path / "fuse") as fs:
        s = Scheduler(_spec(tmp_path, storage_dirs=[str(fs.mount_point)], io_deadline_s=0.5, gate=False))
        try:
            s.store(keys)
            s.reset()
            before = _chunk_files(fs.backing)
            assert len(before) == 4
            fs.stall()
            hits, _ = s.load(keys[:1])  # one timeout: the breaker stays closed
            assert hits == []
            s.settle()
            fs.resume()
            deadline = time.monotonic() + 20
            while s.tier.store.stats()["stuck_ops"]:
                assert time.monotonic() < deadline, "the stalled work never ended"
                time.sleep(0.05)
            time.sleep(1.1)  # the key is not read again for a second (DiskPresence)
            hits, data = s.load(keys)
            assert hits == keys
            assert all(np.array_equal(d, _payload(k, s.primary.shape[1])) for k, d in zip(keys, data))
            assert _chunk_files(fs.backing) == before
            assert s.tier.metrics.totals["unavailable_reads"] == 1
        finally:
            fs.resume()
            s.close()


def test_the_gate_limits_what_the_tier_promotes(tmp_path):
    """With a cost model under which no load pays (gate_margin huge), the
    tier answers MISS before reading anything and counts the decision."""
    keys = _keys("gate", 8)
    first = Scheduler(_spec(tmp_path, engine_id="one"))
    first.store(keys)
    first.close()
    second = Scheduler(_spec(tmp_path, engine_id="two", gate_margin=1e9))
    hits, _ = second.load(keys)
    assert hits == []
    assert second.tier.metrics.totals["gate_limited_lookups"] >= 1
    assert second.tier.metrics.totals["disk_reads"] == 0
    second.close()


def test_standalone_only_keys_are_refused_with_the_reason(tmp_path):
    from pykvcache.vllm.config import ConfigError

    with pytest.raises(ConfigError, match=r"lookahead_bytes.*lookahead preloading.*standalone"):
        _spec(tmp_path, lookahead_bytes="1GiB").get_manager()
    with pytest.raises(ConfigError, match="unknown key"):
        _spec(tmp_path, capacity="1GiB").get_manager()


def test_refused_misspelt_and_invalid_tier_keys_are_reported_in_one_error(tmp_path):
    # The refused (standalone-only) keys were reported
    # alone; the misspelt and invalid ones only after those were fixed.
    from pykvcache.vllm.config import ConfigError
    from pykvcache.vllm.tier import tier_settings

    with pytest.raises(ConfigError) as info:
        tier_settings(
            {
                "storage_dirs": [str(tmp_path / "kv")],
                "capacity_bytes": "64MiB",
                "wipe_on_reset": True,
                "lookahead_bytes": "1GiB",
                "capacty_bytes": "1GiB",
                "verify": "sometimes",
            }
        )
    message = str(info.value)
    for part in ("'wipe_on_reset'", "'lookahead_bytes'", "unknown key(s) 'capacty_bytes'", "verify must be one of"):
        assert part in message, (part, message)
    assert message.count("invalid pykvcache") == 1, message  # one error, one heading


def test_the_tier_declares_its_metrics_to_vllm(tmp_path):
    """vLLM asserts on emitting an undeclared metric: every name the tier
    reports is in the spec's definitions (built from the tier entry)."""
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    spec = _spec(tmp_path)
    defs = TieringOffloadingSpec.build_metric_definitions(dict(spec.extra_config))
    s = Scheduler(spec)
    s.store(_keys("m", 2))
    stats = s.tier.get_stats()
    assert stats is not None
    # reduce() reports a histogram as its _sum and _count
    names = {n if n in defs else n.removesuffix("_sum").removesuffix("_count") for n in stats.reduce()}
    assert names and names <= set(defs), sorted(names - set(defs))
    s.close()


def test_every_refused_key_is_a_key_of_the_standalone_spec():
    """The refusal list names real keys (docs/vllm.md's mode table is about them)."""
    from pykvcache.vllm.config import PykvcacheConfig
    from pykvcache.vllm.tier import STANDALONE_ONLY

    assert set(STANDALONE_ONLY) <= PykvcacheConfig.keys()


# -- jobs the tier must refuse, one at a time --------------------------------------------


def _job(s, keys, chunk_ids, *, load: bool, job_id: int):
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    return TransferJob(
        job_id=job_id,
        keys=list(keys),
        chunk_ids=np.asarray(chunk_ids),
        is_promotion=load,
        req_context=ReqContext(req_id=f"direct-{job_id}"),
    )


def _finish(tier, job_ids, timeout=20.0) -> dict:
    """Polls the tier as the framework does until the jobs have reported."""
    results: dict = {}
    deadline = time.monotonic() + timeout
    while not set(job_ids) <= set(results):
        assert time.monotonic() < deadline, f"jobs never finished: {sorted(set(job_ids) - set(results))}"
        for result in tier.get_finished_jobs():
            assert result.job_id not in results, f"job {result.job_id} reported twice"
            results[result.job_id] = result
        time.sleep(0.002)
    return results


@pytest.mark.parametrize("cpu_tier_io", ["copy", "direct"])
def test_a_store_job_naming_rows_outside_the_cpu_tier_fails_alone(tmp_path, cpu_tier_io):
    """A chunk id of -1 stored the CPU tier's last row under the key (numpy wraps it); 2 keys
    with 1 chunk id answered success having stored one. Each such job now fails as a whole,
    stores nothing, and the jobs after it work."""
    s = Scheduler(_spec(tmp_path, engine_id=f"tier-rows-{cpu_tier_io}", cpu_tier_io=cpu_tier_io, gate=False))
    tier, rows = s.tier, s.primary.shape[0]
    free = tier.pool.free_slots
    keys = _keys("bad-rows", 4)
    s.primary[rows - 1] = _payload(b"last row", s.primary.shape[1])
    # -1 (numpy's last row), one past the end, 2 keys for 1 chunk id, a float chunk id.
    bad = {1: ([keys[0]], [-1]), 2: ([keys[1]], [rows]), 3: (keys[2:4], [0]), 4: ([keys[3]], [0.5])}
    for job_id, (job_keys, chunks) in bad.items():
        tier.submit_store(_job(s, job_keys, chunks, load=False, job_id=job_id))
    results = _finish(tier, list(bad))
    assert all(not r.success for r in results.values()), results
    assert len(tier.store) == 0, "a refused store job wrote a chunk"
    good = _keys("good-rows", 2)
    s.store(good)  # the framework's own jobs still work
    assert len(tier.store) == 2 and tier.pool.free_slots == free
    s.close()


@pytest.mark.parametrize("cpu_tier_io", ["copy", "direct"])
def test_a_promotion_into_rows_outside_the_cpu_tier_fails_alone(tmp_path, cpu_tier_io):
    """A promotion into a row past the end used to make every later get_finished_jobs()
    raise IndexError and keep its staging slot; -1 read into the last row."""
    s = Scheduler(_spec(tmp_path, engine_id=f"tier-load-rows-{cpu_tier_io}", cpu_tier_io=cpu_tier_io, gate=False))
    tier, rows = s.tier, s.primary.shape[0]
    free = tier.pool.free_slots
    good = _keys("good-rows", 2)
    s.store(good)
    s.primary[rows - 1] = _payload(b"last row", s.primary.shape[1])
    # -1, one past the end, 2 keys for 1 chunk id, two keys read into one row.
    loads = {5: ([good[0]], [-1]), 6: ([good[0]], [rows]), 7: (good, [2]), 8: (good, [3, 3])}
    for job_id, (job_keys, chunks) in loads.items():
        tier.submit_load(_job(s, job_keys, chunks, load=True, job_id=job_id))
    results = _finish(tier, list(loads))
    for job_id, r in results.items():
        assert not r.success and not r.successful_keys, (job_id, r)
    assert np.array_equal(s.primary[rows - 1], _payload(b"last row", s.primary.shape[1])), "a refused load wrote into a row"
    tier.submit_load(_job(s, good, [5, 6], load=True, job_id=9))
    [ok] = _finish(tier, [9]).values()
    assert ok.success
    for key, row in zip(good, (5, 6)):
        assert np.array_equal(s.primary[row], _payload(key, s.primary.shape[1]))
    assert not tier.has_pending_work()
    assert tier.pool.free_slots == free, "a staging slot leaked"
    s.close()


def test_concurrent_callers_of_one_tier_are_serialized(tmp_path):
    """vLLM 0.33 calls a tier under its manager's lock, from the scheduler's thread or its
    tier-poll thread; 4 threads at once used to break the tier's queue ("pop from an empty
    deque", "slot N is not acquired"). Every job of every thread ends, each exactly once,
    with its bytes, and no slot leaks."""
    import threading

    from vllm.v1.kv_offload.base import ReqContext

    threads, per_thread = 4, 12
    s = Scheduler(_spec(tmp_path, engine_id="tier-threads", num_chunks=threads * per_thread, staging_bytes=4 * 36864, gate=False))
    tier, width = s.tier, s.primary.shape[1]
    free = tier.pool.free_slots
    keys = {t: _keys(f"thread{t}-", per_thread) for t in range(threads)}
    row = {key: t * per_thread + i for t in range(threads) for i, key in enumerate(keys[t])}
    for key, r in row.items():
        s.primary[r] = _payload(key, width)  # written before the threads start: stores only read rows
    done: list = []
    errors: list = []

    def caller(t: int, load: bool) -> None:
        try:
            for i, key in enumerate(keys[t]):
                job_id = (2 if load else 1) * 10000 + 100 * t + i
                job = _job(s, [key], [row[key]], load=load, job_id=job_id)
                (tier.submit_load if load else tier.submit_store)(job)
                tier.lookup(key, ReqContext(req_id=f"lookup-{t}-{i}"))
                done.extend(tier.get_finished_jobs())
                tier.get_stats()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    def run(load: bool) -> None:
        workers = [threading.Thread(target=caller, args=(t, load)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert not errors, errors
        deadline = time.monotonic() + 20
        while len(done) < threads * per_thread:
            assert time.monotonic() < deadline, f"{len(done)} of {threads * per_thread} jobs reported"
            done.extend(tier.get_finished_jobs())
            time.sleep(0.002)
        ids = sorted(r.job_id for r in done)
        assert ids == sorted((2 if load else 1) * 10000 + 100 * t + i for t in range(threads) for i in range(per_thread)), ids
        assert all(r.success for r in done), [r for r in done if not r.success]
        done.clear()

    run(load=False)
    assert len(tier.store) == threads * per_thread
    s.primary[:] = 0
    run(load=True)
    for key, r in row.items():
        assert np.array_equal(s.primary[r], _payload(key, width)), r
    assert not tier.has_pending_work() and tier.pool.free_slots == free
    s.close()


def test_the_tier_refuses_an_engine_with_lora_enabled(tmp_path):
    """The tier sees chunk keys, which for a LoRA request vLLM derives from the adapter's name
    and path: an adapter retrained under the same name would be served the old adapter's KV.
    With LoRA on, the tier refuses to start, naming the spec that keys adapters by content."""
    from types import SimpleNamespace

    from pykvcache.vllm.host_config import publishing
    from vllm.config import LoRAConfig

    # The engine's config as the tier finds it (a whole VllmConfig needs a model and a device).
    with_lora = SimpleNamespace(lora_config=LoRAConfig(max_lora_rank=8))
    with publishing(with_lora), pytest.raises(ValueError, match="LoRA adapters apart by their content"):
        _spec(tmp_path).get_manager()
    # Without LoRA the same tier starts.
    Scheduler(_spec(tmp_path)).close()
