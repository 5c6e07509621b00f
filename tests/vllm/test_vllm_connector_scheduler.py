"""The connector's scheduler side built from a real ``VllmConfig`` by vLLM's
own classes, no engine: ``build_offloading_config`` turns the config and a KV
cache description into the spec's ``OffloadingConfig``, ``PyKvCacheConnector``
(vLLM's ``OffloadingConnector`` plus lookahead) builds pykvcache's spec and
manager in the scheduler role, and real ``Request`` objects with vLLM's block
hashes are looked up through ``get_num_new_matched_tokens`` and stepped with
``build_connector_meta``, as vLLM's scheduler does.

Runs on the 0.32 CPU build and on the 0.33 CUDA build without a GPU, where
``EngineArgs.create_engine_config()`` cannot run (the platform has no device
type): the config is assembled from its parts with ``DeviceConfig("cpu")``.
"""

from __future__ import annotations

import importlib.util
import time

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

BLOCK = 32
CHUNK_TOKENS = 64  # blocks_per_chunk 2
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def vllm_config(model: str, extra: dict, connector: str = "PyKvCacheConnector"):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig

    kv = {"kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": extra}
    if connector == "PyKvCacheConnector":
        kv["kv_connector_module_path"] = "pykvcache.vllm"
    return VllmConfig(
        model_config=ModelConfig(model=model, dtype="float32", max_model_len=2048, enforce_eager=True),
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(**kv),
    )


def kv_cache_config(cfg, num_blocks: int = 64):
    """What vLLM's KV cache manager would describe for the tiny model: one
    full-attention group, one tensor per layer."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    mc = cfg.model_config
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=mc.get_total_num_kv_heads(), head_size=mc.get_head_size(), dtype=torch.float32)
    page = spec.page_size_bytes
    # One backing allocation, layer-major: each tensor's size is the total
    # (vLLM sizes worker_kv_bytes_per_block from it).
    total = page * num_blocks * len(LAYERS)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=total, layers=[name], layer_stride=page * num_blocks, block_stride=page, offset=i * page * num_blocks)
            for i, name in enumerate(LAYERS)
        ],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )


def request(req_id: str, tokens: list[int]):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None, block_hasher=get_request_block_hasher(BLOCK, hash_fn))


def step(connector):
    """One scheduler step with nothing scheduled: build_connector_meta ends
    the step (0.33 releases the manager lock there; pykvcache's manager
    collects I/O and plans preloads in on_schedule_end)."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    out = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )
    return connector.build_connector_meta(out)


@pytest.fixture
def extra(tmp_path):
    return {
        "storage_dirs": [str(tmp_path / "kv")],
        "capacity_bytes": "256MiB",
        "staging_bytes": "16MiB",
        "blocks_per_chunk": 2,
        "gate": False,
    }


def _connector(model, extra, connector="PyKvCacheConnector"):
    from pykvcache.vllm.connector import PyKvCacheConnector
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    cfg = vllm_config(model, dict(extra), connector)
    kcc = kv_cache_config(cfg)
    if connector == "PyKvCacheConnector":
        return cfg, kcc, PyKvCacheConnector(cfg, KVConnectorRole.SCHEDULER, kcc)
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    return cfg, kcc, OffloadingConnector(cfg, KVConnectorRole.SCHEDULER, kcc)


def test_vllms_offloading_config_of_a_real_vllm_config_builds_the_spec(tiny_model, extra):
    from pykvcache.vllm.host_config import publishing
    from pykvcache.vllm.spec import NvmeOffloadingSpec
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config

    cfg = vllm_config(tiny_model, {"spec_name": "NvmeOffloadingSpec", "spec_module_path": "pykvcache.vllm", **extra}, "OffloadingConnector")
    kcc = kv_cache_config(cfg)
    oc = build_offloading_config(cfg, kcc)
    assert oc.cache.blocks_per_chunk == 2 and oc.parallel.tp_size == 1
    # 2 layers x K and V x 32 tokens x 2 KV heads x 64 dims x 4 bytes
    assert oc.worker_kv_bytes_per_block == 2 * 2 * BLOCK * 2 * 64 * 4
    with publishing(cfg):
        spec = NvmeOffloadingSpec(oc)
    assert spec.layout.payload_bytes == 2 * oc.worker_kv_bytes_per_block
    assert spec.chunk_tokens == CHUNK_TOKENS
    # The model identity was read from the real config: the namespace names the model.
    assert spec.namespace.startswith("tiny-llama")
    assert NvmeOffloadingSpec.build_metric_definitions(dict(oc.extra_config))


@pytest.mark.parametrize("connector", ["PyKvCacheConnector", "OffloadingConnector"])
def test_the_scheduler_side_finds_a_prefix_stored_by_an_earlier_engine(tiny_model, extra, connector):
    """Chunks stored through one connector's manager are, after a restart,
    found by vLLM's scheduler-side lookups of a new request with the same
    prompt: pending while read, then every whole chunk but the last token's."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    extra = {**extra, "spec_name": "NvmeOffloadingSpec", "spec_module_path": "pykvcache.vllm"}
    tokens = [(7 * i) % 700 + 5 for i in range(5 * CHUNK_TOKENS + 1)]
    _, _, first = _connector(tiny_model, extra, connector)
    manager = first.scheduler.manager
    req = request("first", tokens)
    keys = [make_offload_key(h, 0) for h in req.block_hashes[1::2]]
    assert len(keys) == 5
    ctx = ReqContext(req_id="first")
    out = manager.prepare_store(keys, ctx)
    for slot in out.store_spec.block_ids:
        with manager.pool.view(int(slot)) as view:
            view[:8] = b"pykvcach"
    manager.complete_store(keys, ctx)
    manager.flush()
    manager.shutdown()  # persists: the next engine's index finds the chunks

    _, _, second = _connector(tiny_model, extra, connector)
    req = request("second", tokens)
    second.on_new_request(req)
    deadline = time.monotonic() + 30
    while True:
        matched, is_async = second.get_num_new_matched_tokens(req, 0)
        if matched is not None:
            break
        assert time.monotonic() < deadline, "lookups stayed pending"
        step(second)
        time.sleep(0.005)
    assert matched == 5 * CHUNK_TOKENS and is_async
    step(second)
    second.scheduler.manager.shutdown()


def test_lookahead_stages_a_waiting_request_at_arrival(tiny_model, extra):
    """PyKvCacheConnector computes the chunk keys from the real Request's
    block hashes at arrival and starts the reads before any lookup."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    extra = {**extra, "lookahead_requests": 4}
    tokens = [(11 * i) % 700 + 5 for i in range(3 * CHUNK_TOKENS + 1)]
    _, _, first = _connector(tiny_model, extra)
    manager = first.scheduler.manager
    req = request("a", tokens)
    keys = [make_offload_key(h, 0) for h in req.block_hashes[1::2]]
    out = manager.prepare_store(keys, ReqContext(req_id="a"))
    manager.complete_store(keys, ReqContext(req_id="a"))
    manager.flush()
    manager.shutdown()
    del out

    _, _, second = _connector(tiny_model, extra)
    manager = second.scheduler.manager
    second.on_new_request(request("b", tokens))
    assert all(manager.staged_state(k) is not None for k in keys), "no read started at arrival"
    manager.shutdown()


def test_pykvcache_connector_times_steps_for_the_gate(tiny_model, extra):
    """PyKvCacheConnector connects the gate's prefill side: without a
    profile the gate does not deny loads until steps are timed, and every step
    vLLM builds reaches the manager's step timer."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    _, _, conn = _connector(tiny_model, extra)
    manager = conn.scheduler.manager
    gate = manager.gating.gate
    assert gate.prefill_online.fed and gate.uncalibrated
    timer = manager.gating.steps
    times = iter([1.0, 2.5])
    timer.clock = lambda: next(times)
    conn.build_connector_meta(SchedulerOutput.make_empty())
    assert [t for t, _ in timer._pending] == [1.0]  # the step is being timed
    conn.update_connector_output(KVConnectorOutput())
    assert timer._pending == [] and timer._last_end == 2.5  # and ended by its output
    manager.shutdown()


def test_a_step_that_computes_nothing_is_marked_for_the_worker(tiny_model, extra):
    """Decision 0065: the worker may sleep on its pending reads only in a step
    that schedules no token; the scheduler side marks it in the metadata."""
    from vllm.v1.core.sched.output import SchedulerOutput

    _, _, conn = _connector(tiny_model, extra)
    assert step(conn).pykvcache_idle_step is True
    busy = SchedulerOutput.make_empty()
    busy.total_num_scheduled_tokens = 32
    assert conn.build_connector_meta(busy).pykvcache_idle_step is False
    conn.scheduler.manager.shutdown()


@pytest.mark.parametrize("staging, warned", [("2MiB", True), ("16MiB", False)])
def test_staging_too_small_for_the_longest_prompt_is_said_at_start(tiny_model, extra, caplog, staging, warned):
    """The spec reads max_model_len from the real VllmConfig (2048 tokens: 31
    chunks of 132 KiB files, 4.1 MiB): 2 MiB of staging cannot hold one such
    prefix and the start-up log says so with the size to give; 16 MiB (3.9
    prefixes) is quiet."""
    import logging

    with caplog.at_level(logging.WARNING, logger="vllm.pykvcache"):
        _, _, connector = _connector(tiny_model, {**extra, "staging_bytes": staging})
    said = [r.getMessage() for r in caplog.records if "full-length" in r.getMessage()]
    if warned:
        assert said and "fewer than the 31 of one full-length prompt" in said[0], said
        assert "staging_bytes >= " in said[0]
    else:
        assert said == []
    connector.scheduler.manager.shutdown()
