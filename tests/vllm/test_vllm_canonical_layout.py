"""The parallelism-agnostic chunk layout through vLLM's own canonical-layout
code, no engine: for the tiny model's geometry at TP=1 and TP=2, vLLM's
``derive_canonical_mappings`` (the code its worker runs at KV registration)
certifies each rank's pages; pykvcache places them in one shared row, so a
chunk stored by the TP=1 worker is read back by both TP=2 ranks as exactly
their heads, and a chunk stored by the two TP=2 ranks is the TP=1 chunk.
Runs on the 0.32 CPU build and the 0.33 CUDA build (CPU tensors)."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

BLOCK, HEADS, HEAD_DIM, NUM_BLOCKS, BPC = 32, 2, 64, 8, 2
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def _config(model: str, tp: int, rank: int, canonical: bool = True):
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig

    cfg = VllmConfig(
        model_config=ModelConfig(model=model, dtype="float32", max_model_len=2048, enforce_eager=True),
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=BLOCK),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
    )
    cfg.parallel_config.rank = rank
    return cfg


def _rank_kv(full, tp: int, rank: int):
    """This rank's KV tensors (head-major, K and V packed per head: the
    layout vLLM's CPU attention uses) cut from the whole model's."""
    per = HEADS // tp
    return {name: t[:, rank * per : (rank + 1) * per].contiguous() for name, t in full.items()}


def _canonical_caches(cfg, kv: dict):
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
        derive_canonical_mappings,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    heads = next(iter(kv.values())).shape[1]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD_DIM, dtype=torch.float32)
    page = spec.page_size_bytes
    kcc = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=page * NUM_BLOCKS * 2, layers=[n], layer_stride=0, block_stride=page) for n in LAYERS],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )
    mappings = derive_canonical_mappings(cfg, kcc, kv)
    tensors, refs = [], []
    for i, name in enumerate(LAYERS):
        tensors.append(CanonicalKVCacheTensor(tensor=kv[name].view(torch.int8).view(NUM_BLOCKS, page), page_size_bytes=page))
        refs.append(CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page, mapping=mappings.get(name)))
    return CanonicalKVCaches(tensors=tensors, group_data_refs=[refs]), page


def _copier(caches, layout, pool, rank):
    from pykvcache.vllm.worker.cpu_copy import CpuCopier
    from pykvcache.vllm.worker.slot_map import SlotMap

    return CpuCopier([t.tensor for t in caches.tensors], SlotMap(caches.group_data_refs, layout), pool, rank)


def _layout(page: int, tp: int):
    from pykvcache.vllm.layout import ChunkLayout

    # What the spec computes: one worker's bytes per block times the head shards.
    return ChunkLayout(BPC, bytes_per_block=2 * page * tp, world_size=1, ranks_share_row=True)


def test_a_chunk_stored_at_tp1_loads_into_both_tp2_ranks_and_back(tiny_model):
    import torch
    from pykvcache import StagingPool
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    gen = torch.Generator().manual_seed(7)
    full = {n: torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, generator=gen) for n in LAYERS}
    tp1, page1 = _canonical_caches(_config(tiny_model, 1, 0), {n: t.clone() for n, t in full.items()})
    assert all(r.mapping is not None and r.mapping.parallelism_agnostic for r in tp1.group_data_refs[0])
    layout = _layout(page1, 1)
    pool = StagingPool(layout.payload_bytes, 4)
    try:
        # TP=1 stores blocks 2,3 (one chunk) into slot 1.
        _copier(tp1, layout, pool, 0).store(GPULoadStoreSpec([2, 3], group_sizes=[1 * 2], block_indices=[0]), [1])
        for rank in range(2):
            kv = {n: torch.zeros_like(t) for n, t in _rank_kv(full, 2, rank).items()}
            caches, page2 = _canonical_caches(_config(tiny_model, 2, rank), kv)
            assert page2 * 2 == page1
            assert _layout(page2, 2) == layout, "TP=2 sizes the chunk as TP=1 does"
            _copier(caches, layout, pool, rank).load(GPULoadStoreSpec([5, 6], group_sizes=[2], block_indices=[0]), [1])
            want = _rank_kv(full, 2, rank)
            for n in LAYERS:
                assert torch.equal(kv[n][5:7], want[n][2:4]), f"rank {rank} {n}"
                assert not kv[n][4].any()
        # Both TP=2 ranks store their halves of blocks 0,1 into slot 2: the TP=1 chunk.
        for rank in range(2):
            caches, _ = _canonical_caches(_config(tiny_model, 2, rank), _rank_kv(full, 2, rank))
            _copier(caches, layout, pool, rank).store(GPULoadStoreSpec([0, 1], group_sizes=[2], block_indices=[0]), [2])
        _copier(tp1, layout, pool, 0).store(GPULoadStoreSpec([0, 1], group_sizes=[2], block_indices=[0]), [3])
        region = pool.region()
        a, b = pool.payload_offset(2), pool.payload_offset(3)
        assert bytes(region[a : a + layout.row_bytes]) == bytes(region[b : b + layout.row_bytes])
        region.release()
    finally:
        import gc

        gc.collect()
        pool.close()


def test_uncertified_pages_are_refused_not_stored_per_topology(tiny_model):
    """A ref vLLM gave no parallelism-agnostic mapping (here: none) fails at
    worker start-up, naming the key to remove, as vLLM's own tiering spec does."""
    import torch
    from pykvcache.vllm.worker.slot_map import SlotMap
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    page = 2 * BLOCK * HEADS * HEAD_DIM * 4
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=torch.zeros(NUM_BLOCKS, page, dtype=torch.int8), page_size_bytes=page)],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=page)]],
    )
    with pytest.raises(RuntimeError, match="could not certify.*remove canonical_layout"):
        SlotMap(caches.group_data_refs, _layout(page, 1))


def test_the_namespace_is_shared_across_tp_only_when_certified(tmp_path, tiny_model):
    """The spec's namespace: identical at TP=1 and TP=2 with canonical_layout
    where vLLM certifies it; per-size (strict) without it or when vLLM does not."""
    import dataclasses

    from offloading_configs import tiny_offloading_config
    from pykvcache.vllm.host_config import publishing
    from pykvcache.vllm.spec import NvmeOffloadingSpec

    def spec(tp: int, canonical: bool, certified: bool = True):
        base = tiny_offloading_config(
            {"storage_dirs": [str(tmp_path / "kv")], "capacity_bytes": "1GiB", "staging_bytes": "8MiB", "fingerprint_weights": False},
            bytes_per_block=65536 // tp,
        )
        par = dataclasses.replace(base.parallel, world_size=tp, tp_size=tp, is_parallelism_agnostic=certified)
        config = dataclasses.replace(base, parallel=par, canonical_layout=canonical)
        with publishing(_config(tiny_model, tp, 0)):
            s = NvmeOffloadingSpec(config)
        return s

    assert spec(1, True).namespace == spec(2, True).namespace
    assert spec(1, True).layout.payload_bytes == spec(2, True).layout.payload_bytes
    assert spec(1, False).namespace != spec(2, False).namespace
    assert spec(1, True, certified=False).namespace != spec(2, True, certified=False).namespace
    assert not spec(2, True, certified=False).parallelism_agnostic
    # Opting in changes the bytes' layout: it never shares the per-rank namespace.
    assert spec(1, True).namespace != spec(1, False).namespace
